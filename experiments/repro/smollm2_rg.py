"""The real-model result: SmolLM2-135M-Instruct made better at a reasoning-gym task by
GRPO on a CPU, over several seeds.

    python -m experiments.repro.smollm2_rg --seeds 0 1 --train  # run each seed (~32 min each
                                                                # on 2 CPU cores), then collect
    python -m experiments.repro.smollm2_rg --seeds 0 1          # collect finished runs only

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
import statistics
import sys
from pathlib import Path

from experiments.common.benchmarking import machine, results_path
from experiments.common.seeds import gain_over_seeds, over_seeds, read_before_after
from rl.runtime.logging import atomic_write_json

PRESET = "smollm2-rg"
TARGET_GAIN = 0.15


def run_dir_of(root: Path, seed: int) -> Path:
    return root / f"{PRESET}-s{seed}"


def train_command(root: Path, seed: int) -> list[str]:
    return ["--preset", PRESET, "--seed", str(seed), "--run-dir", str(run_dir_of(root, seed))]


def collect(root: Path, seeds: list[int], train=None) -> dict:
    """The results JSON from the seeds' run dirs under `root`; with `train` (the train
    job's main), the seeds without a finished run are trained first."""
    runs = over_seeds(seeds, lambda s: run_dir_of(root, s), read_before_after,
                      train=None if train is None else lambda s: train(train_command(root, s)))
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

    from experiments.common.plots import save_png, smooth

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=110)
    colors = ("tab:blue", "tab:red", "tab:green", "tab:purple")
    for (seed, run), color in zip(result["runs"].items(), colors * 4):
        for col, x in enumerate(("step", "minutes")):
            ax = axes[0, col]
            tr = run["train_curve"]
            xs = [r[x] for r in tr]
            ax.plot(xs, smooth([r["correct"] for r in tr], 5), color=color, lw=1.5,
                    label=f"seed {seed}: correct")
            ax.plot(xs, smooth([r["format"] for r in tr], 5), color=color, lw=1.0, ls="--",
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
    train = None
    if args.train:
        from experiments.common.train_cli import main as train
    try:
        result = collect(root, args.seeds, train)
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
