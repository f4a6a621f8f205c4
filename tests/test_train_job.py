"""The main job (`python -m experiments.train`) end to end, in-process: resume is exact
(4 steps == 2 steps + --resume + 2 steps, params and optimizer state bit for bit), the
run dir holds metrics.jsonl, summary.json, reward_curve.png, checkpoints and offline
wandb files, and CLI mistakes give clear errors.

Same geometry as tests/rl/test_sync_loop.py (2 groups of 4, 8 eval prompts), so the
compiled sampler and train step are shared within one pytest process."""
import json

import jax
import numpy as np
import pytest

from experiments.common.train_cli import main
from rl.learner import init_train_state
from rl.run import PRESETS, load_policy
from rl.runtime.checkpoint import Checkpointer

SMALL = ["--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", "8",
         "--eval-every", "0", "--no-progress"]


def restore(run_dir, step):
    preset = PRESETS["tiny-synthetic"]
    _, params, _ = load_policy(preset, 0)
    with Checkpointer(run_dir / "checkpoints") as ck:
        return ck.restore(init_train_state(params, preset.train, 0), step=step)


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_resume_is_exact_and_outputs_are_written(tmp_path):
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    summary = main(["--steps", "4", "--run-dir", str(full_dir), "--wandb", "offline",
                    "--results-json", str(tmp_path / "res" / "train.json"), *SMALL])
    main(["--steps", "2", "--run-dir", str(split_dir), "--wandb", "disabled", *SMALL])
    main(["--steps", "4", "--run-dir", str(split_dir), "--wandb", "disabled", "--resume", *SMALL])

    full_state, full_meta = restore(full_dir, 4)
    split_state, split_meta = restore(split_dir, 4)
    # every checkpoint records the run's config (what a resume is checked against)
    full_config, split_config = full_meta.pop("config"), split_meta.pop("config")
    assert full_config == split_config and full_config["loop.steps"] == 4
    assert full_config["loop.group_size"] == 4 and full_config["train.temperature"] == 1.0
    assert full_meta == split_meta == {"data_position": 8, "task": "synthetic", "step": 4}
    assert leaves_equal(full_state, split_state)
    assert int(split_state.step) == 4
    _, params, _ = load_policy(PRESETS["tiny-synthetic"], 0)
    assert not leaves_equal(full_state.params, params)  # it did train

    def train_records(d):
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items()  # timings and memory differ run to run
                 if not k.endswith("_s") and k not in ("tokens_per_s", "peak_rss_mb")}
                for r in recs if r["kind"] == "train"]

    assert train_records(full_dir) == train_records(split_dir)
    assert [r["step"] for r in train_records(split_dir)] == [1, 2, 3, 4]

    for name in ("summary.json", "reward_curve.png", "wandb_id.txt"):
        assert (full_dir / name).is_file()
    assert list((full_dir / "wandb").glob("offline-run-*"))  # offline wandb, no network
    assert (full_dir / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "res" / "train.json").read_text())
    assert saved == summary
    assert saved["headline"]["metric"] == "final eval reward / random-policy eval reward"
    ev = saved["curve"]["eval_reward"]
    assert [s for s, _ in ev] == [0, 4]
    assert saved["headline"]["value"] == pytest.approx(ev[-1][1] / ev[0][1], rel=1e-3)
    assert (tmp_path / "res" / "train.png").is_file()
    assert not list(tmp_path.rglob("*.tmp"))


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no checkpoints"):
        main(["--run-dir", str(tmp_path / "nothing"), "--resume", "--wandb", "disabled", *SMALL])
    with pytest.raises(SystemExit):
        main(["--preset", "gpt-5"])
    with pytest.raises(SystemExit):
        main(["--lr", "-1", "--wandb", "disabled"])
    assert "learning_rate" in capsys.readouterr().err
    (tmp_path / "used" / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(SystemExit):
        main(["--run-dir", str(tmp_path / "used"), "--wandb", "disabled", *SMALL])
    assert "--resume" in capsys.readouterr().err


def test_time_limit_stops_after_the_crossing_step(tmp_path):
    """--time-limit: the step that crosses the budget is the last, with its eval and
    checkpoint; a tiny budget (0.6 ms) is crossed by the first step."""
    summary = main(["--steps", "50", "--time-limit", "0.00001", "--run-dir", str(tmp_path / "t"),
                    "--wandb", "disabled", *SMALL])
    assert summary["steps"] == 1
    assert [s for s, _ in summary["curve"]["eval_reward"]] == [0, 1]
    assert (tmp_path / "t" / "checkpoints" / "1").is_dir()


def test_task_flags(tmp_path, capsys):
    from experiments.common.flags import build_train_parser, parse_task_options, task_overrides

    def task_override(cfg, *argv):
        return task_overrides(cfg, build_train_parser().parse_args(argv))

    assert parse_task_options(["max_terms=2", "operators=('+', '-')", "name=x y", "a.b=0.5"]) == {
        "max_terms": 2, "operators": ("+", "-"), "name": "x y", "a.b": 0.5}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_task_options(["max_terms"])
    rg = PRESETS["smollm2-rg"]
    other = task_override(rg, "--task", "reasoning_gym:leg_counting",
                          "--task-option", "max_animals=2")
    # a new task drops the preset's dataset options but keeps its sampling budget
    assert other.task.kwargs == {"max_new_tokens": 48, "max_prompt_len": 128, "max_animals": 2}
    same = task_override(rg, "--task-option", "max_digits=1")
    assert same.task.kwargs["max_digits"] == 1 and same.task.spec == rg.task.spec
    # the preset's verifier was chosen for its task: a new task gets its own default
    assert rg.reward.verifier == same.reward.verifier == "dataset"
    assert other.reward.verifier is None
    with pytest.raises(SystemExit):  # the tiny model has no tokenizer for a text task
        main(["--task", "reasoning_gym:chain_sum", "--run-dir", str(tmp_path / "x"),
              "--wandb", "disabled", *SMALL])
    assert "tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--time-limit", "-1", "--wandb", "disabled", *SMALL])
    assert "time_limit_s" in capsys.readouterr().err


def test_time_limit_stops_the_async_loops_too(tmp_path):
    """The time limit belongs to the harness: both asynchronous sources stop after the
    crossing step as the synchronous loop does (its eval and checkpoint), and the threaded
    producer is stopped and joined."""
    import threading

    for mode in ("deterministic", "threaded"):
        summary = main(["--steps", "50", "--time-limit", "0.00001", "--max-staleness", "1",
                        "--async-mode", mode, "--run-dir", str(tmp_path / mode),
                        "--wandb", "disabled", *SMALL])
        assert summary["steps"] == 1, mode
        assert [s for s, _ in summary["curve"]["eval_reward"]] == [0, 1]
        assert (tmp_path / mode / "checkpoints" / "1").is_dir()
    assert not [t for t in threading.enumerate() if t.name == "tandem-rollout" and t.is_alive()]
