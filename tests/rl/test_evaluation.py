"""The evaluation report (rl.loops.evaluation.eval_report and its statistics) and the reports
that must not be misread: `python -m experiments.evaluate` end to end on the run dir of a
short tiny training run, its numbers recomputed naively from the per-prompt data and the
example completions it returns (rewards re-scored by the task itself); the statistics
against textbook formulas; the train batch's zero-spread fraction on hand-built rewards;
experiments.train's per-reward summary on a hand-made RunResult.

Same geometry as tests/test_train_job.py (2 groups of 4, 8 eval prompts; the evaluation
samples at most 8 rows at once), so compiled samplers are shared within one pytest process.
"""
import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from experiments import evaluate as evaluate_cli
from experiments.common.plots import plot_reward_curve
from experiments.common.train_cli import main as train_main
from rl.loops import RunResult
from rl.loops.evaluation import mean_stderr, pass_at_k
from rl.loops.scoring import batch_reward_metrics, zero_spread_fraction
from rl.run import PRESETS, ModelSpec, format_summary, summarize
from rl.tasks import make_task

SMALL = ["--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", "8",
         "--eval-every", "0", "--no-progress", "--wandb", "disabled"]


def naive_stderr(xs):
    xs = [float(x) for x in xs]
    n, m = len(xs), sum(xs) / len(xs)
    if all(x in (0.0, 1.0) for x in xs):
        return math.sqrt(m * (1 - m) / n)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow  # ~35 s on 2 cores alone (a 2-step training run, then 2 evaluations)
def test_evaluate_cli_on_a_training_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    summary = train_main(["--steps", "2", "--run-dir", str(run_dir), *SMALL])
    out_train = capsys.readouterr().out
    assert "random policy -> final" in out_train and "correct" in out_train

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    for r in evals:  # the periodic eval logs the report's numbers (sampled and greedy)
        assert "time_s" in r
        for key in ("reward", "correct", "accuracy", "accuracy_stderr", "mean_length",
                    "truncated_frac"):
            assert key in r and f"greedy_{key}" in r, key
        assert r["accuracy"] == r["correct"] and r["truncated_frac"] == 1.0  # no stop id
        assert r["mean_length"] == 4.0
    for r in train:
        assert 0.0 <= r["zero_spread_frac"] <= 1.0 and r["time_s"] > 0 and "reward_correct" in r
    # the summary's per-reward block is the first and last eval records'
    assert summary["rewards"]["correct"] == {
        "initial": evals[0]["correct"], "final": evals[-1]["correct"],
        "initial_greedy": evals[0]["greedy_correct"], "final_greedy": evals[-1]["greedy_correct"]}
    assert summary["initial_eval_reward"] == summary["random_policy_eval_reward"] == evals[0]["reward"]
    assert summary["initial_policy"] == "random policy"

    out = tmp_path / "eval.json"
    got = evaluate_cli.main(["--model", str(run_dir), "--n", "8", "--k", "4", "--examples", "3",
                             "--max-slots", "8", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert "pass@4" in printed and "accuracy (correct, greedy)" in printed
    saved = json.loads(out.read_text())
    assert saved == got
    for key in ("model", "step", "task", "task_options", "seed", "n", "accuracy",
                "accuracy_stderr", "reward", "rewards", "mean_length", "truncated_frac",
                "pass_at_k", "examples", "per_prompt_accuracy", "max_new_tokens"):
        assert key in saved, key
    assert saved["step"] == 2 and saved["task"] == "synthetic" and saved["n"] == 8
    assert saved["task_options"] == {"kind": "reverse", "length": 4, "alphabet": 4}

    # greedy accuracy and its error, recomputed from the per-prompt values
    acc = saved["per_prompt_accuracy"]
    assert len(acc) == 8
    assert saved["accuracy"] == pytest.approx(sum(acc) / 8)
    assert saved["rewards"]["correct"] == pytest.approx(sum(acc) / 8)
    assert saved["accuracy_stderr"] == pytest.approx(naive_stderr(acc))
    # pass@k from the per-prompt lists of k sampled accuracies
    pk = saved["pass_at_k"]
    lists = pk["per_prompt_accuracy"]
    assert pk["k"] == 4 and len(lists) == 8 and all(len(x) == 4 for x in lists)
    solved = [any(v == 1.0 for v in x) for x in lists]
    assert pk["pass_at_k"] == pytest.approx(sum(solved) / 8)
    assert pk["best_of_k"] == pytest.approx(sum(max(x) for x in lists) / 8)
    flat = [v for x in lists for v in x]
    assert pk["accuracy"] == pytest.approx(sum(flat) / 32)
    assert pk["accuracy_stderr"] == pytest.approx(naive_stderr(flat))
    assert pk["n"] == 32 and pk["mean_length"] == 4.0

    # the examples re-scored by the task itself
    task = make_task("synthetic", seed=0, kind="reverse", length=4, alphabet=4)
    prompts = task.eval_prompts(8)
    assert len(saved["examples"]) == 3
    for i, ex in enumerate(saved["examples"]):
        ids = [int(t) for t in ex["response"].split()]
        assert ex["prompt"] == prompts[i].text and ex["answer"] == list(prompts[i].answer)
        assert ex["rewards"] == task.reward(prompts[i], ids)
        assert ex["rewards"]["correct"] == acc[i] and ex["length"] == len(ids) == 4

    # chunking never changes a sample: the same report with everything decoded at once
    whole = evaluate_cli.main(["--model", str(run_dir), "--n", "8", "--k", "4",
                               "--examples", "0", "--max-slots", "32", "--no-progress"])
    assert whole["pass_at_k"]["per_prompt_accuracy"] == lists
    assert whole["per_prompt_accuracy"] == acc
    assert (run_dir / "evals" / "step2-synthetic.json").is_file()  # the run dir default


def test_evaluate_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        evaluate_cli.main(["--model", "tiny", "--task", "synthetic", "--n", "0"])
    assert "n must be an int >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_cli.main(["--model", "tiny", "--task", "synthetic", "--k", "-1"])
    assert "k must be an int >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_cli.main(["--model", str(tmp_path / "nope.gguf"), "--task", "synthetic"])
    assert "neither a registered name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_cli.main(["--model", "tiny"])
    assert "a task is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_cli.main(["--model", "tiny", "--task", "synthetic", "--task-option", "oops"])
    assert "KEY=VALUE" in capsys.readouterr().err


# ----------------------------------------------------------------------------- statistics
def test_statistics_against_textbook_formulas():
    m, e = mean_stderr([1, 0, 1, 1])  # Bernoulli: sqrt(p (1 - p) / n)
    assert m == 0.75 and e == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    m, e = mean_stderr([0.5, 1.0, 0.0])  # else: sample std / sqrt(n)
    assert m == 0.5 and e == pytest.approx(0.5 / math.sqrt(3))
    assert mean_stderr([0.5]) == (0.5, None)
    rng = np.random.default_rng(0)
    acc = (rng.random((50, 4)) < 0.3).astype(float)
    acc[3] = [0.75, 0.5, 0.0, 0.25]  # partial credit is not solved
    c = (acc >= 1).sum(axis=1)  # the unbiased pass@k estimator at n = k samples
    unbiased = np.mean([1 - math.comb(4 - ci, 4) / math.comb(4, 4) for ci in c])
    assert pass_at_k(acc) == pytest.approx(unbiased)
    with pytest.raises(ValueError):
        pass_at_k(np.zeros(4))


def test_zero_spread_fraction_on_a_hand_built_batch():
    rewards = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 0, 0, 0], float)  # 4 groups of 3
    assert zero_spread_fraction(rewards, 3) == 0.75
    assert zero_spread_fraction(rewards, 2) == 0.5  # [1,1] [1,0] [1,0] [.5,.5] [.5,0] [0,0]
    # two named rewards: each varies, the weighted total may not
    cols = np.array([[1, 0], [0, 1], [1, 1], [0, 1]], float)  # names (correct, format)
    assert batch_reward_metrics(("correct", "format"), cols, 2) == {"zero_spread_frac": 0.5}
    assert batch_reward_metrics(("correct", "format"), cols, 2,
                                {"format": 0.5}) == {"zero_spread_frac": 0.0}
    with pytest.raises(ValueError):
        zero_spread_fraction(rewards, 5)


# ----------------------------------------------------------------------------- summaries
def _records():
    first = {"step": 0, "kind": "eval", "reward": 0.3, "correct": 0.1, "format": 0.2,
             "accuracy": 0.1, "accuracy_stderr": 0.03, "mean_length": 90.0,
             "truncated_frac": 0.5, "greedy_reward": 0.4, "greedy_correct": 0.15,
             "greedy_format": 0.25, "time_s": 5.0}
    last = {"step": 10, "kind": "eval", "reward": 1.5, "correct": 0.6, "format": 0.9,
            "accuracy": 0.6, "accuracy_stderr": 0.05, "mean_length": 40.0,
            "truncated_frac": 0.0, "greedy_reward": 1.6, "greedy_correct": 0.7,
            "greedy_format": 0.9, "time_s": 65.0}
    train = [{"step": s, "kind": "train", "reward_mean": 0.1 * s, "reward_correct": 0.04 * s,
              "reward_format": 0.06 * s, "time_s": 6.0 * s} for s in range(1, 11)]
    return train, [first, last]


def test_summarize_reports_each_reward_before_and_after(tmp_path):
    train, evals = _records()
    task = SimpleNamespace(reward_names=("correct", "format"))
    result = RunResult(state=SimpleNamespace(step=10), train=train, eval=evals,
                       run_dir=tmp_path, data_position=80)
    tiny = PRESETS["tiny-synthetic"]
    pre = dataclasses.replace(tiny, model=ModelSpec("smollm2-135m"), headline_target=None)
    run_info = {"wall_s": 12.0, "command": "cmd", "machine": "test machine"}
    s = summarize(result, pre, task, **run_info)
    assert s["rewards"] == {
        "reward": {"initial": 0.3, "final": 1.5, "initial_greedy": 0.4, "final_greedy": 1.6},
        "correct": {"initial": 0.1, "final": 0.6, "initial_greedy": 0.15, "final_greedy": 0.7},
        "format": {"initial": 0.2, "final": 0.9, "initial_greedy": 0.25, "final_greedy": 0.9}}
    assert s["eval_metrics"]["truncated_frac"] == {"initial": 0.5, "final": 0.0}
    assert s["eval_metrics"]["mean_length"] == {"initial": 90.0, "final": 40.0}
    assert s["initial_policy"] == "starting policy" and "random_policy_eval_reward" not in s
    assert s["headline"]["metric"] == "final eval reward / starting-policy eval reward"
    assert s["headline"]["value"] == pytest.approx(5.0)
    assert s["curve"]["eval_rewards"]["format"] == [[0, 0.2], [10, 0.9]]
    text = format_summary(s)
    assert "(starting policy -> final) 0.300 -> 1.500 (5.00x)" in text
    assert "correct          0.100 -> 0.600 sampled, 0.150 -> 0.700 greedy" in text
    assert "format" in text and "truncated_frac" in text

    s_tiny = summarize(result, tiny, task, **run_info)
    assert s_tiny["initial_policy"] == "random policy"
    assert s_tiny["random_policy_eval_reward"] == s_tiny["initial_eval_reward"] == 0.3
    assert s_tiny["headline"]["metric"] == "final eval reward / random-policy eval reward"


def test_plot_reward_curve_per_reward_lines_and_minutes_panel(tmp_path):
    train, evals = _records()
    path = tmp_path / "curve.png"
    plot_reward_curve(train, evals, path, baseline=0.3, pretrained=True, minutes=True,
                      smooth=3)
    assert path.read_bytes()[:4] == b"\x89PNG"
    plot_reward_curve([{k: v for k, v in r.items() if k != "time_s"} for r in train], evals,
                      tmp_path / "no_time.png", minutes=True)  # no time_s: one panel
    assert (tmp_path / "no_time.png").is_file()


# ----------------------------------------------------------------------------- chunked evals
def test_eval_in_chunks_of_rows_draws_the_same_samples(tmp_path, monkeypatch):
    """loop.eval_max_rows (rows an eval samples at once) bounds the eval's KV cache and
    changes no sample: the chunked evaluator's record equals the one-batch evaluator's, for
    the sampled and the greedy pass, at a chunk size that does not divide the prompts and
    at one above them."""
    from models.config import get_config
    from models.decoder import init_params
    from rl.learner import TrainConfig
    from rl.loops import evaluation
    from rl.loops.config import LoopConfig, RolloutOptions, RunConfig
    from rl.loops.evaluation import ReportOptions, eval_report, make_evaluator
    from rl.loops.rollouts import RolloutSpec, rollout_spec
    from rl.rollout.sampler_state import SamplingConfig
    from rl.runtime.logging import MetricsLogger

    task = make_task("synthetic", seed=0, kind="reverse", length=4, alphabet=4)
    cfg = get_config("tiny", vocab_size=task.vocab_size)
    params = init_params(cfg, 0)
    train = TrainConfig(temperature=1.0)

    batches = []  # rows of every sampler call the evaluator makes
    real = evaluation.sample_groups
    monkeypatch.setattr(evaluation, "sample_groups",
                        lambda *a, **k: batches.append(len(a[3])) or real(*a, **k))

    def record(rows, name):
        batches.clear()
        run_cfg = RunConfig(train=train, rollout=RolloutOptions(segment_len=3), loop=LoopConfig(
            eval_prompts=7, eval_greedy=True, eval_max_rows=rows))
        loop = run_cfg.loop
        logger = MetricsLogger(tmp_path / name, wandb_mode="disabled")
        rec = make_evaluator(rollout_spec(cfg, task, run_cfg), loop, logger,
                             reward_weights={}, clock=lambda: 0.0)(5, params, 0)
        return {k: v for k, v in rec.items() if k != "time_s"}

    whole = record(0, "whole")
    assert batches == [7, 7]  # the sampled and the greedy pass, one batch each
    assert 0.0 < whole["accuracy"] or 0.0 < whole["mean_length"]  # it sampled something
    for rows, chunks in ((3, [3, 3, 1]), (16, [7])):
        assert record(rows, f"rows{rows}") == whole, rows
        assert batches == chunks * 2, (rows, batches)
    # the responses themselves, not only their statistics
    prompts = task.eval_prompts(7)
    spec = RolloutSpec(task, cfg, group_size=1, segment_len=3,
                       sampling=SamplingConfig(temperature=1.0))
    one = eval_report(params, 0, spec, prompts, seed=11, options=ReportOptions(examples=7))
    chunked = eval_report(params, 0, spec, prompts, seed=11,
                          options=ReportOptions(examples=7, max_slots=2))
    assert [e["response"] for e in chunked["examples"]] == [e["response"] for e in one["examples"]]
    with pytest.raises(ValueError, match="eval_max_rows"):
        LoopConfig(eval_max_rows=-1)


def test_eval_clear_programs_drops_the_compiled_programs_and_changes_no_number(tmp_path):
    """loop.eval_clear_programs: the programs compiled before an eval (a jitted function
    standing in for the train step) and the eval's own sampler programs are dropped by the
    time it returns, and the record equals the one of an eval without it."""
    import jax
    import jax.numpy as jnp

    from models.config import get_config
    from models.decoder import init_params
    from rl.learner import TrainConfig
    from rl.loops.config import LoopConfig, RolloutOptions, RunConfig
    from rl.loops.evaluation import make_evaluator
    from rl.loops.rollouts import rollout_spec
    from rl.rollout import sampler_core
    from rl.runtime.logging import MetricsLogger

    task = make_task("synthetic", seed=0, kind="reverse", length=4, alphabet=4)
    cfg = get_config("tiny", vocab_size=task.vocab_size)
    params = init_params(cfg, 0)
    step_like = jax.jit(lambda x: x * 2.0 + 1.0)

    def record(clear, name):
        step_like(jnp.ones(3))  # "the train step", compiled before the eval
        assert step_like._cache_size() == 1
        run_cfg = RunConfig(train=TrainConfig(temperature=1.0), rollout=RolloutOptions(
            segment_len=3), loop=LoopConfig(eval_prompts=5, eval_greedy=True,
                                            eval_clear_programs=clear))
        loop = run_cfg.loop
        logger = MetricsLogger(tmp_path / name, wandb_mode="disabled")
        rec = make_evaluator(rollout_spec(cfg, task, run_cfg), loop, logger,
                             reward_weights={}, clock=lambda: 0.0)(3, params, 0)
        return {k: v for k, v in rec.items() if k != "time_s"}

    kept = record(False, "kept")
    assert step_like._cache_size() == 1 and sampler_core.fill_jit._cache_size() > 0
    cleared = record(True, "cleared")
    assert step_like._cache_size() == 0 and sampler_core.fill_jit._cache_size() == 0
    assert cleared == kept
    with pytest.raises(ValueError, match="eval_clear_programs"):
        LoopConfig(eval_clear_programs=1)
