"""experiments.repro.data_efficiency's bookkeeping on hand-made run records: the interleaved
order, reading a run's metrics.jsonl (training wall time excludes evals), the seed-mean
curve, the interpolated first crossing of the target and the speedups (hand numbers)."""
import argparse
import json
from pathlib import Path

import pytest

from experiments.repro.data_efficiency import (
    first_reach,
    mean_curve,
    method_flags,
    read_run,
    run_dirs,
    run_order,
    summarize,
)


def test_run_order_interleaves_methods_across_seeds():
    assert run_order(["u", "a", "b"], [0, 1, 2]) == [
        ("u", 0), ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("u", 1), ("b", 2), ("u", 2), ("a", 2)]


def write_run(path, evals, step_s, tokens=10, zero=0.5, slow=()):
    """evals: {step: accuracy}; every train step takes step_s (rollout + train), the
    steps in `slow` 100 times longer (compiles)."""
    path.mkdir(parents=True)
    lines = [{"kind": "eval", "step": s, "greedy_accuracy": a, "time_s": 99.0}
             for s, a in evals.items()]
    lines += [{"kind": "train", "step": s, "rollout_s": step_s / 4,
               "train_s": (3 + 400 * (s in slow)) * step_s / 4,
               "sampled_tokens": tokens, "zero_spread_frac": zero}
              for s in range(1, max(evals) + 1)]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    return read_run(path)


def test_read_run_curve_and_first_crossing(tmp_path):
    run = write_run(tmp_path / "r", {0: 0.0, 2: 0.4, 4: 0.8}, step_s=1.0, tokens=10)
    assert [(p["step"], p["wall_s"], p["tokens"], p["accuracy"]) for p in run["curve"]] == [
        (0, 0.0, 0, 0.0), (2, 2.0, 20, 0.4), (4, 4.0, 40, 0.8)]
    assert run["zero_adv_frac"] == 0.5 and run["compile_steps"] == 0
    # 0.6 lies halfway between the evals at 2 s (0.4) and 4 s (0.8)
    assert first_reach(run["curve"], 0.6, "wall_s") == pytest.approx(3.0)
    assert first_reach(run["curve"], 0.6, "tokens") == pytest.approx(30.0)
    assert first_reach(run["curve"], 0.9, "wall_s") is None


def test_mean_curve_and_speedups(tmp_path):
    uni = [write_run(tmp_path / "u0", {0: 0.0, 2: 0.4, 4: 0.8}, step_s=1.0),
           write_run(tmp_path / "u1", {0: 0.0, 2: 0.2, 4: 0.6}, step_s=1.0)]
    fast = [write_run(tmp_path / "f0", {0: 0.0, 2: 0.7, 4: 0.8}, step_s=0.5),
            write_run(tmp_path / "f1", {0: 0.0, 2: 0.7, 4: 0.8}, step_s=0.5)]
    mc = mean_curve(uni)
    assert [p["accuracy"] for p in mc] == pytest.approx([0.0, 0.3, 0.7])
    s = summarize({"uniform": uni, "fast": fast}, reach=0.9)
    assert s["uniform_final_accuracy"] == pytest.approx(0.7)
    assert s["target_accuracy"] == pytest.approx(0.63)
    # uniform: 0.63 at 2 + 2 (0.33 / 0.4) = 3.65 s; fast: 0.63 at 0.63 / 0.7 * 1 = 0.9 s
    t = s["table"]
    assert t["uniform"]["wall_s_to_target"] == pytest.approx(3.65)
    assert t["fast"]["wall_s_to_target"] == pytest.approx(0.9)
    assert t["fast"]["speedup_to_target"] == pytest.approx(3.65 / 0.9)
    # to uniform's final mean 0.7: uniform at 4 s, fast at 1 s
    assert t["fast"]["speedup_to_uniform_final"] == pytest.approx(4.0)
    assert t["fast"]["final_accuracy_mean"] == pytest.approx(0.8)
    assert t["uniform"]["final_accuracy_std"] == pytest.approx(0.1414213562)


def test_compile_steps_count_at_the_median_step_time(tmp_path):
    run = write_run(tmp_path / "r", {0: 0.0, 4: 0.4, 8: 0.8}, step_s=1.0, slow=(1, 5))
    assert run["compile_steps"] == 2 and run["compile_s"] == pytest.approx(200.0)
    assert [p["wall_s"] for p in run["curve"]] == [0.0, 4.0, 8.0]
    assert [p["raw_wall_s"] for p in run["curve"]] == [0.0, 104.0, 208.0]


def test_method_flags_and_reused_uniform_runs():
    args = argparse.Namespace(method_flag=["dars:--micro-batches=2", "prune:--segment-len=2",
                                           "dars:--dars-schedule=hw"],
                              uniform_from="runs/smollm2-rg-s{seed}", uniform_seeds=3, seeds=1)
    assert method_flags(args) == {"dars": ["--micro-batches", "2", "--dars-schedule", "hw"],
                                  "prune": ["--segment-len", "2"]}
    out = Path("runs/de/p")
    assert run_dirs("uniform", args, out) == [Path(f"runs/smollm2-rg-s{s}") for s in range(3)]
    assert run_dirs("dps", args, out) == [out / "dps_s0"]
    for bad in ("nosuch:--x=1", "dars--micro-batches=2", "dars:micro-batches=2"):
        with pytest.raises(SystemExit, match="method-flag"):
            method_flags(argparse.Namespace(method_flag=[bad]))
