"""The real-model result: SmolLM2-135M-Instruct made better at a reasoning-gym task by
GRPO on a CPU, over several seeds.

    python -m experiments.repro.smollm2_rg --seeds 0 1 --train   # run each seed (~32 min each on
                                                            # 2 CPU cores), then collect
    python -m experiments.repro.smollm2_rg --seeds 0 1           # collect finished runs only

Each seed is `python -m experiments.train --preset smollm2-rg --seed S --run-dir
runs/smollm2-rg-sS` (seeds run one after another, so each has the machine to itself).
The collection reads each run's metrics.jsonl and summary.json and writes
experiments/results/smollm2_rg.json: headline = the mean over seeds of the gain in greedy
accuracy on the 256 held-out problems (final eval minus step-0 eval, a fraction), with
per seed the before / after accuracy and their standard errors, the gain's standard
error (sqrt(se_before² + se_after²), conservative: the problems are the same before and
after), each named reward before / after, the eval curve (step, minutes, accuracy),
steps, wall time, load, and the exact command; plus smollm2_rg.png: train rewards and
held-out accuracy against step and against minutes, one line per seed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from experiments.common.benchmarking import machine, results_path
from rl.runtime.logging import atomic_write_json

PRESET = "smollm2-rg"
TARGET_GAIN = 0.15


def run_dir_of(root: Path, seed: int) -> Path:
    return root / f"{PRESET}-s{seed}"


def train_command(root: Path, seed: int) -> list[str]:
    return ["--preset", PRESET, "--seed", str(seed), "--run-dir", str(run_dir_of(root, seed))]


def read_run(run_dir: Path) -> dict:
    """One seed's before / after, curves and cost from its run dir."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ValueError(f"{run_dir} has no summary.json: the run has not finished (train it "
                         "with --train, or resume it with experiments.train --resume)")
    summary = json.loads(summary_path.read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    if len(evals) < 2 or evals[0].get("greedy_accuracy") is None:
        raise ValueError(f"{run_dir}: needs a greedy eval at the start and at the end")
    first, last = evals[0], evals[-1]
    before, after = first["greedy_accuracy"], last["greedy_accuracy"]
    se_b, se_a = first["greedy_accuracy_stderr"], last["greedy_accuracy_stderr"]
    names = [k[len("greedy_"):] for k in first
             if k.startswith("greedy_") and k[len("greedy_"):] in ("correct", "format")]
    return {
        "run_dir": str(run_dir),
        "command": summary.get("command"),
        "before": {"accuracy": before, "stderr": se_b},
        "after": {"accuracy": after, "stderr": se_a},
        "gain": after - before,
        "gain_stderr": math.sqrt(se_b ** 2 + se_a ** 2),
        "greedy_rewards": {n: {"before": first[f"greedy_{n}"], "after": last[f"greedy_{n}"]}
                           for n in names},
        "greedy_mean_length": {"before": first.get("greedy_mean_length"),
                               "after": last.get("greedy_mean_length")},
        "greedy_truncated_frac": {"before": first.get("greedy_truncated_frac"),
                                  "after": last.get("greedy_truncated_frac")},
        "steps": summary.get("steps"),
        # the run clock (metrics' time_s: first eval to final eval, continued across a
        # --resume) and the last process's wall time (model load included)
        "run_clock_minutes": round(last.get("time_s", 0.0) / 60, 2),
        "wall_time_s": summary.get("wall_time_s"),
        "resumed": "--resume" in (summary.get("command") or ""),
        "load_average_1_5_15min": summary.get("load_average_1_5_15min"),
        "zero_spread_frac_mean": statistics.fmean(r["zero_spread_frac"] for r in train)
        if train and "zero_spread_frac" in train[0] else None,
        "eval_curve": [{"step": r["step"], "minutes": round(r.get("time_s", 0.0) / 60, 2),
                        "greedy_accuracy": r["greedy_accuracy"],
                        "greedy_format": r.get("greedy_format"),
                        "sampled_accuracy": r.get("accuracy")} for r in evals],
        "train_curve": [{"step": r["step"], "minutes": round(r.get("time_s", 0.0) / 60, 2),
                         "correct": r.get("reward_correct"), "format": r.get("reward_format"),
                         "zero_spread_frac": r.get("zero_spread_frac")} for r in train],
    }


def gain_over_seeds(runs: dict) -> dict:
    """{mean, std (None for one seed), min, max, seeds, steps_mean} of the runs' gains."""
    gains = [r["gain"] for r in runs.values()]
    return {"mean": statistics.fmean(gains),
            "std": statistics.stdev(gains) if len(gains) > 1 else None,
            "min": min(gains), "max": max(gains), "seeds": len(gains),
            "steps_mean": statistics.fmean(r["steps"] for r in runs.values())}


def train_missing(seeds: list[int], run_dir_of, train_command) -> None:
    """Run `experiments.train` for each seed whose run dir has no summary.json yet, one
    after another (each run has the machine to itself)."""
    from experiments import train

    for seed in seeds:
        if not (run_dir_of(seed) / "summary.json").is_file():
            train.main(train_command(seed))


def collect(root: Path, seeds: list[int]) -> dict:
    runs = {str(s): read_run(run_dir_of(root, s)) for s in seeds}
    gains = gain_over_seeds(runs)
    out = {
        "headline": {
            "metric": "mean gain in greedy accuracy on 256 held-out chain_sum problems "
                      "(after - before, fraction), over seeds",
            "value": round(gains["mean"], 4),
            "target": TARGET_GAIN,
            "machine": machine(),
            "reached_target": gains["mean"] >= TARGET_GAIN,
        },
        "gain_over_seeds": gains,
        "before_mean": statistics.fmean(r["before"]["accuracy"] for r in runs.values()),
        "after_mean": statistics.fmean(r["after"]["accuracy"] for r in runs.values()),
        "command": "python -m experiments.repro.smollm2_rg --train --seeds " +
                   " ".join(map(str, seeds)),
        "per_seed_command": "python -m experiments.train --preset smollm2-rg --seed S "
                            "--run-dir runs/smollm2-rg-sS",
        "runs": runs,
    }
    return out


def plot(result: dict, path: Path) -> None:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common.plots import _smooth, save_png

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=110)
    colors = ("tab:blue", "tab:red", "tab:green", "tab:purple")
    for (seed, run), color in zip(result["runs"].items(), colors * 4):
        for col, x in enumerate(("step", "minutes")):
            ax = axes[0, col]
            tr = run["train_curve"]
            xs = [r[x] for r in tr]
            ax.plot(xs, _smooth([r["correct"] for r in tr], 5), color=color, lw=1.5,
                    label=f"seed {seed}: correct")
            ax.plot(xs, _smooth([r["format"] for r in tr], 5), color=color, lw=1.0, ls="--",
                    label=f"seed {seed}: format")
            ev = run["eval_curve"]
            ax = axes[1, col]
            ax.plot([r[x] for r in ev], [r["greedy_accuracy"] for r in ev], "o-", color=color,
                    ms=3.5, label=f"seed {seed}: greedy accuracy")
            ax.plot([r[x] for r in ev], [r["greedy_format"] for r in ev], "s:", color=color,
                    ms=2.5, lw=0.9, label=f"seed {seed}: greedy format")
    before = result["before_mean"]
    for col, x in enumerate(("optimizer step", "wall-clock minutes")):
        axes[0, col].set_title(f"train rewards (5-step mean) vs {x}", fontsize=9)
        axes[1, col].set_title(f"held-out (256) greedy eval vs {x}", fontsize=9)
        axes[1, col].axhline(before, color="gray", ls=":", lw=1.0,
                             label=f"starting policy accuracy ({before:.3f})")
        for row in range(2):
            axes[row, col].set_xlabel(x)
            axes[row, col].grid(alpha=0.3)
            axes[row, col].legend(fontsize=6.5, loc="best")
    h = result["headline"]
    fig.suptitle(f"SmolLM2-135M-Instruct, GRPO on reasoning-gym chain_sum, 2-core CPU: "
                 f"greedy accuracy gain {h['value']:+.3f} (mean of {len(result['runs'])} seeds)",
                 fontsize=10)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.repro.smollm2_rg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--train", action="store_true", help="train the seeds that have no "
                   "summary.json yet (one after another) before collecting")
    p.add_argument("--run-root", default="runs", help="where the run dirs live (default runs/)")
    p.add_argument("--out", default=str(results_path(__file__)))
    args = p.parse_args(argv)
    root = Path(args.run_root)
    if args.train:
        train_missing(args.seeds, lambda seed: run_dir_of(root, seed),
                      lambda seed: train_command(root, seed))
    try:
        result = collect(root, args.seeds)
    except ValueError as err:
        sys.exit(f"error: {err}")
    out = Path(args.out)
    atomic_write_json(out, result)
    plot(result, out.with_suffix(".png"))
    print(f"{'seed':>5} {'before':>15} {'after':>15} {'gain':>15} {'steps':>6} {'minutes':>8}  (run clock)")
    for seed, r in result["runs"].items():
        print(f"{seed:>5} {r['before']['accuracy']:7.3f} ± {r['before']['stderr']:.3f} "
              f"{r['after']['accuracy']:7.3f} ± {r['after']['stderr']:.3f} "
              f"{r['gain']:+7.3f} ± {r['gain_stderr']:.3f} {r['steps']:>6} "
              f"{r['run_clock_minutes']:8.1f}")
    g = result["gain_over_seeds"]
    print(f"mean gain {g['mean']:+.3f} (min {g['min']:+.3f}, max {g['max']:+.3f}) over "
          f"{g['seeds']} seeds; target +{TARGET_GAIN}; wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
