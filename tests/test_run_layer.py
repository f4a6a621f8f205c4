"""The library-owned run layer (rl.run): a run started from Python writes the run record
(model.json, run_config.json) and summary.json like the command line, is evaluable and
loadable from its run dir, and `train(RunConfig.load(run_dir), resume=True)` continues it
bit for bit (checked against an uninterrupted run of the same length). Also the shape of
the API the issue fixes: both loops take the same short parameter list, and no argparse
lives below experiments/.

Same geometry as tests/test_train_job.py (2 groups of 4, 8 eval prompts), so the compiled
sampler and train step are shared within one pytest process."""
import ast
import inspect
import json
from pathlib import Path

import jax
import numpy as np

from rl.loops import run, run_async
from rl.run import PRESETS, EvalOptions, RunConfig, evaluate, load_run, train

ROOT = Path(__file__).resolve().parents[1]


def small(run_dir, steps):
    return PRESETS["tiny-synthetic"].overrides({
        "loop.steps": steps, "loop.prompts_per_step": 2, "loop.group_size": 4,
        "loop.eval_prompts": 8, "loop.eval_every": 0, "logging.wandb": "disabled",
        "logging.progress": False, "run_dir": str(run_dir)})


def train_records(run_dir):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items()  # timings and memory differ run to run
             if not k.endswith("_s") and k not in ("tokens_per_s", "peak_rss_mb")}
            for r in recs if r["kind"] == "train"]


def test_a_python_run_is_recorded_evaluable_and_resumes_exactly_from_its_config(tmp_path):
    full = train(small(tmp_path / "full", 4))
    first = train(small(tmp_path / "split", 2))
    cfg = RunConfig.load(tmp_path / "split")
    assert cfg == small(tmp_path / "split", 2)  # the record recreates the run
    for name in ("model.json", "run_config.json", "summary.json", "metrics.jsonl"):
        assert (tmp_path / "split" / name).is_file()
    assert first.summary == json.loads((tmp_path / "split" / "summary.json").read_text())
    assert first.summary["command"].endswith("split/run_config.json")
    resumed = train(cfg.override("loop.steps", 4), resume=True)

    assert int(resumed.state.step) == int(full.state.step) == 4
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert train_records(tmp_path / "full") == train_records(tmp_path / "split")

    policy = load_run(tmp_path / "split")  # what export and evaluate read
    assert policy.step == 4 and policy.meta["preset"] == "tiny-synthetic"
    for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(resumed.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    quiet = EvalOptions(progress=False)
    report = evaluate(tmp_path / "split", n=8, options=quiet)
    by_config = evaluate(cfg, n=8, options=quiet)  # a config with checkpoints: its run
    assert report["step"] == by_config["step"] == 4 and report["model_kind"] == "run"
    assert report["per_prompt_accuracy"] == by_config["per_prompt_accuracy"]
    # the final eval of the run scored the same 8 prompts greedily with these params
    last = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text()
            .splitlines() if json.loads(x)["kind"] == "eval"][-1]
    assert report["accuracy"] == last["greedy_accuracy"]


def test_both_loops_take_the_same_short_parameter_list():
    a, b = inspect.signature(run).parameters, inspect.signature(run_async).parameters
    assert list(a) == list(b) and len(a) <= 6
    assert [p.kind for p in a.values()] == [p.kind for p in b.values()]


def test_no_argparse_under_rl_or_models():
    users = []
    for pkg in ("rl", "models", "kernels"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) else [])
                if "argparse" in names:
                    users.append(str(path.relative_to(ROOT)))
    assert not users, f"argparse below experiments/: {users}"
