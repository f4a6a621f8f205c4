"""The main job over several seeds: one result is a mean and a spread, not a single run.

    python -m experiments.train_seeds                       # tiny-synthetic, seeds 0 1 2 3 4
    python -m experiments.train_seeds --perturbed-fp        # + the same seeds under AVX2-only XLA
    python -m experiments.train_seeds --seeds 0 1 --preset tiny-synthetic -- --steps 200

Runs `experiments.train.main` for each seed, one after another, in this process (each in
its own run dir, <runs-root>/seed_<s>; flags after `--` pass through to every run), then
writes `--results-json` (default experiments/results/train_default.json) and a PNG beside
it: every seed's eval curve and their mean. The JSON's "headline" is the mean over seeds of
each run's headline (final eval reward / random-policy eval reward) with its spread (std,
min, max, 95% t-interval) and the preset's target; "final_eval_reward" holds the same
statistics of the final eval reward and the bar (`--bar`): how many seeds cleared it.
"seeds" holds each seed's numbers as its run dir's summary.json states them, and its curves.

A single machine's floating point is one draw: the same seed on a CPU with another vector
ISA departs after ~100 steps. `--perturbed-fp` imitates that machine: it re-runs the seeds
in a child process with XLA_FLAGS += --xla_cpu_max_isa=AVX2 (XLA's CPU code then uses
AVX2, not AVX-512: other summation orders, different bits from the first step) and records
its statistics under "perturbed_fp".
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments.common.train_cli import main as train_main
from rl.run import DEFAULT_PRESET, PRESETS
from rl.runtime.host import load_average, machine
from rl.runtime.logging import atomic_write_json

PERTURB_FLAG = "--xla_cpu_max_isa=AVX2"
DEFAULT_BAR = 0.7
# two-sided 95% Student-t quantiles by degrees of freedom (1..10); beyond 10 the normal's
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.train_seeds",
                                description="The main job over several seeds: mean and spread.")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--runs-root", default="runs/seeds",
                   help="each seed runs in <runs-root>/seed_<s> (default runs/seeds)")
    p.add_argument("--results-json", default="experiments/results/train_default.json",
                   help="where the multi-seed summary goes (the PNG beside it)")
    p.add_argument("--bar", type=float, default=DEFAULT_BAR,
                   help=f"final eval reward every seed should reach (default {DEFAULT_BAR})")
    p.add_argument("--perturbed-fp", action="store_true",
                   help=f"also run the seeds in a child process with XLA_FLAGS += {PERTURB_FLAG}")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    p.add_argument("train_args", nargs="*", metavar="-- TRAIN_FLAGS",
                   help="flags passed to every experiments.train run (after --)")
    return p


def check_train_args(train_args: list[str]) -> None:
    """ValueError for pass-through flags the driver sets itself."""
    owned = {"--seed", "--run-dir", "--preset", "--resume", "--results-json"}
    clash = sorted({a.split("=")[0] for a in train_args} & owned)
    if clash:
        raise ValueError(f"{', '.join(clash)} is set by experiments.train_seeds per seed; "
                         "drop it from the pass-through flags (use --seeds / --runs-root / "
                         "--preset / --results-json of the driver)")


def seed_record(seed: int, run_dir: Path, summary: dict) -> dict:
    """One seed's numbers, as its summary.json states them."""
    return {
        "seed": seed,
        "run_dir": str(run_dir),
        "final_eval_reward": summary["final_eval_reward"],
        "final_greedy_eval_reward": summary["final_greedy_eval_reward"],
        "random_policy_eval_reward": summary["initial_eval_reward"],
        "ratio": summary["headline"]["value"],
        "wall_time_s": summary["wall_time_s"],
        "steps": summary["steps"],
        "curve": {k: summary["curve"][k] for k in ("eval_reward", "eval_greedy_reward")},
    }


def run_seeds(preset: str, seeds: list[int], runs_root: Path, train_args: list[str],
              progress: bool = True) -> list[dict]:
    """experiments.train.main for each seed in turn; the per-seed records."""
    records = []
    bar = tqdm(seeds, desc=f"{preset} seeds", unit="run", disable=not progress)
    for seed in bar:
        run_dir = runs_root / f"seed_{seed}"
        summary = train_main(["--preset", preset, "--seed", str(seed), "--run-dir", str(run_dir),
                              "--no-progress", *train_args])
        records.append(seed_record(seed, run_dir, summary))
        bar.set_postfix(seed=seed, final=f"{summary['final_eval_reward']:.3f}")
    return records


def spread(values: list[float]) -> dict:
    """mean, sample std, min, max and the 95% Student-t interval of the mean."""
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    std = float(x.std(ddof=1)) if n > 1 else 0.0
    t = _T95[n - 2] if 1 < n <= len(_T95) + 1 else 1.96
    half = t * std / math.sqrt(n) if n > 1 else float("nan")
    return {"mean": round(float(x.mean()), 4), "std": round(std, 4),
            "min": round(float(x.min()), 4), "max": round(float(x.max()), 4),
            "ci95": [round(float(x.mean()) - half, 4), round(float(x.mean()) + half, 4)]}


def aggregate(records: list[dict], bar: float) -> dict:
    """Statistics over seeds of the ratio and of the final (sampled, greedy) eval reward."""
    final = spread([r["final_eval_reward"] for r in records])
    cleared = [r["seed"] for r in records if r["final_eval_reward"] >= bar]
    return {
        "ratio": spread([r["ratio"] for r in records]),
        "final_eval_reward": {**final, "bar": bar, "seeds_at_or_above_bar": cleared,
                              "all_at_or_above_bar": len(cleared) == len(records)},
        "final_greedy_eval_reward": spread([r["final_greedy_eval_reward"] for r in records]),
        "random_policy_eval_reward": spread([r["random_policy_eval_reward"] for r in records]),
        "wall_time_s": spread([r["wall_time_s"] for r in records]),
    }


def results(preset: str, records: list[dict], bar: float, command: str,
            load_before: list[float]) -> dict:
    """The JSON: headline (mean ratio over seeds, spread, target, bar), statistics, seeds."""
    stats = aggregate(records, bar)
    r, f = stats["ratio"], stats["final_eval_reward"]
    target = PRESETS[preset].headline_target
    return {
        "headline": {
            "metric": f"final eval reward / random-policy eval reward, mean over "
                      f"{len(records)} seeds",
            "value": r["mean"],
            "spread": {k: r[k] for k in ("std", "min", "max", "ci95")},
            "target": target,
            "reached_target": None if target is None else r["min"] >= target,
            "bar": {"metric": "final eval reward", "value": bar,
                    "all_seeds_cleared": f["all_at_or_above_bar"]},
            "final_eval_reward": {k: f[k] for k in ("mean", "std", "min", "max", "ci95")},
            "machine": machine(),
            "seeds": [rec["seed"] for rec in records],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        },
        "command": command,
        "preset": preset,
        **stats,
        "seeds": records,
        "load_average_1_5_15min": {"before": load_before, "after": load_average()},
    }


def run_perturbed(args: argparse.Namespace) -> dict:
    """The same seeds in a child process with PERTURB_FLAG added to XLA_FLAGS (set before
    JAX starts, so it cannot be done in this process); the child's results JSON."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + PERTURB_FLAG).strip())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "perturbed.json"
        cmd = [sys.executable, "-m", "experiments.train_seeds", "--preset", args.preset,
               "--seeds", *map(str, args.seeds), "--runs-root", f"{args.runs_root}_perturbed_fp",
               "--results-json", str(out), "--bar", str(args.bar), "--no-plot",
               "--", *args.train_args]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def plot_seeds(res: dict, path: Path) -> None:
    """Every seed's eval curve (thin), their mean (thick), the bar and the random policy;
    the perturbed-fp variant dashed when present."""
    from experiments.plots import plt, save_png

    fig, ax = plt.subplots(figsize=(7, 4.2))
    variants = [("default fp", res, "tab:blue", "-")]
    if "perturbed_fp" in res:
        variants.append(("AVX2 fp", res["perturbed_fp"], "tab:orange", "--"))
    for label, r, color, style in variants:
        curves = [np.asarray(s["curve"]["eval_reward"], dtype=np.float64) for s in r["seeds"]]
        for c in curves:
            ax.plot(c[:, 0], c[:, 1], color=color, ls=style, lw=0.7, alpha=0.45)
        n = min(len(c) for c in curves)
        mean = np.mean([c[:n, 1] for c in curves], axis=0)
        f = r["final_eval_reward"]
        ax.plot(curves[0][:n, 0], mean, color=color, ls=style, lw=2.2,
                label=f"{label}: mean of {len(curves)} seeds (final {f['mean']:.3f}, "
                      f"min {f['min']:.3f})")
    bar = res["final_eval_reward"]["bar"]
    ax.axhline(bar, color="tab:red", lw=0.8, ls=":", label=f"bar {bar}")
    ax.axhline(res["random_policy_eval_reward"]["mean"], color="gray", lw=0.8, ls=":",
               label="random policy")
    ax.set_xlabel("step")
    ax.set_ylabel("eval reward (sampled, held-out prompts)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{res['preset']}: GRPO eval reward over seeds")
    ax.legend(fontsize=8, loc="lower right")
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_train_args(args.train_args)
    except ValueError as err:
        parser.error(str(err))
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds has repeats: {args.seeds}")
    argv_used = sys.argv[1:] if argv is None else argv
    command = "python -m experiments.train_seeds " + " ".join(argv_used)
    load_before = load_average()
    t0 = time.perf_counter()
    records = run_seeds(args.preset, args.seeds, Path(args.runs_root), args.train_args)
    res = results(args.preset, records, args.bar, command.strip(), load_before)
    if args.perturbed_fp:
        res["perturbed_fp"] = run_perturbed(args)
    res["total_wall_time_s"] = round(time.perf_counter() - t0, 1)
    path = Path(args.results_json)
    atomic_write_json(path, res)
    if not args.no_plot:
        plot_seeds(res, path.with_suffix(".png"))
    print(format_table(res))
    return res


def format_table(res: dict) -> str:
    """Per-seed table and the mean/spread lines (and the perturbed variant's)."""
    lines = []
    for label, r in [("default fp", res), ("AVX2 fp", res.get("perturbed_fp"))]:
        if r is None:
            continue
        lines.append(f"{label}  ({r['headline']['xla_flags'] or 'no XLA_FLAGS'})")
        lines.append(f"  {'seed':>4} {'random':>7} {'final':>7} {'greedy':>7} {'ratio':>6} "
                     f"{'wall s':>7}")
        for s in r["seeds"]:
            lines.append(f"  {s['seed']:>4} {s['random_policy_eval_reward']:7.3f} "
                         f"{s['final_eval_reward']:7.3f} {s['final_greedy_eval_reward']:7.3f} "
                         f"{s['ratio']:6.2f} {s['wall_time_s']:7.1f}")
        f, q = r["final_eval_reward"], r["ratio"]
        lines.append(f"  final eval reward {f['mean']:.3f} ± {f['std']:.3f} (min {f['min']:.3f}, "
                     f"max {f['max']:.3f}); bar {f['bar']}: {len(f['seeds_at_or_above_bar'])}/"
                     f"{len(r['seeds'])} seeds; ratio {q['mean']:.2f}x (min {q['min']:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
