"""Data efficiency: uniform GRPO against the prompt schedulers (DOTS, DPS, DARS), rollout
replay and online pruning, on the tiny synthetic task and the real-model preset (issue 22).

    python -m experiments.repro.data_efficiency --method-flag prune:--segment-len=2  # 6 x 3 seeds
    python -m experiments.repro.data_efficiency --seeds 5 --methods uniform,dps
    python -m experiments.repro.data_efficiency --preset smollm2-rg --seeds 1 \
        --methods uniform,dars,replay --lock /tmp/realmodel.lock \
        --method-flag dars:--micro-batches=2 \
        --results-json experiments/results/data_efficiency_smollm2.json
        # SmolLM2-135M, ~32 min per run on 2 cores; compare runs made on an equally loaded
        # machine (--uniform-from reuses finished uniform runs of the preset, but only when
        # they were made by the same code on the same machine load)

Each run is `python -m experiments.train --preset P --seed s <method's flags>` in its own
process (under `flock /tmp/cpu.lock` when that file exists, so machine load affects
every run alike); the runs go seed by seed with the method order rotated each seed
(interleaved). A method is one entry of METHODS: a name and its command-line flags.

Per method, over seeds (the accuracy is the eval's greedy accuracy on the preset's eval
prompts; the wall time is the training time, Σ (rollout_s + train_s) over the steps up to
the eval, evals excluded, and each one-off XLA compile step (a step over 5x the run's
median step time: the first step, and the first use of each new batch shape, which DARS
and replay have two of) counted at the median step time, since on this tiny task one
compile (~10 s) outweighs hundreds of steps (~0.03 s each); sampled tokens are Σ
sampled_tokens):
  - final accuracy (mean ± sample std over seeds);
  - wall time and sampled tokens at which the seed-mean accuracy curve first reaches the
    target, 90 % of uniform's final mean accuracy (and the time to uniform's final mean
    accuracy itself, for the headline);
  - the fraction of zero-advantage groups (groups whose N rewards are all equal) in the
    learner's batches, and in the fresh groups alone (replay's batches also hold replayed
    groups, which the buffer admits only when informative).
Headline: the best method's wall-time speedup over uniform to uniform's final mean
accuracy (target 1.3, the papers' claim). Writes experiments/results/data_efficiency.json
and data_efficiency.png (accuracy vs wall time and vs sampled tokens, seed means).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common.benchmarking import machine, results_path
from experiments.common.seeds import read_metrics, spread, train_missing

LOCK = "/tmp/cpu.lock"
METRIC = "greedy_accuracy"
COMPILE_FACTOR = 5.0  # a step over 5x the run's median step time is an XLA compile

# name -> experiments.train flags; one entry per method. Pruning checks groups at segment
# boundaries: on tiny-synthetic (4-token responses) run it with prune:--segment-len=2.
METHODS: dict[str, list[str]] = {
    "uniform": [],
    "dots": ["--prompt-scheduler", "dots"],
    "dps": ["--prompt-scheduler", "dps"],
    "dars": ["--prompt-scheduler", "dars"],
    "replay": ["--replay-fraction", "0.5", "--set", "train.old_logp=behaviour"],
    "prune": ["--prune"],
}


def run_order(methods: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Seed by seed, the method order rotated by one each seed (interleaved)."""
    out = []
    for i, s in enumerate(seeds):
        k = i % len(methods)
        out += [(m, s) for m in methods[k:] + methods[:k]]
    return out


def run_one(method: str, seed: int, args: argparse.Namespace, run_dir: Path) -> None:
    """Train one (method, seed) run in its own process (an unfinished one starts again)."""
    if run_dir.exists():
        for f in sorted(run_dir.rglob("*"), reverse=True):  # a half run: start it again
            f.unlink() if f.is_file() or f.is_symlink() else f.rmdir()
    cmd = [sys.executable, "-m", "experiments.train", "--preset", args.preset, "--seed",
           str(seed), "--run-dir", str(run_dir), "--no-progress", "--wandb", "disabled",
           "--save-every", "0", *METHODS[method], *method_flags(args).get(method, [])]
    if args.eval_every:
        cmd += ["--eval-every", str(args.eval_every)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if args.lock and os.path.exists(args.lock):
        cmd = ["flock", args.lock] + cmd
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{method} seed {seed} failed:\n{out.stdout[-2000:]}\n"
                           f"{out.stderr[-4000:]}")
    print(f"  {method:8s} seed {seed}: done in {time.perf_counter() - t0:.0f} s (with lock wait)",
          flush=True)


def method_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """--method-flag NAME:FLAG=VALUE (repeatable): extra experiments.train flags for one
    method, e.g. dars:--micro-batches=2 (its doubled batch in two halves, same update)."""
    out: dict[str, list[str]] = {}
    for spec in args.method_flag:
        name, sep, flag = spec.partition(":")
        if not sep or name not in METHODS or not flag.startswith("--"):
            raise SystemExit(f"--method-flag {spec!r}: expected NAME:--flag[=value] with NAME in "
                             f"{list(METHODS)}")
        out.setdefault(name, []).extend(flag.split("=", 1))
    return out


def run_dirs(method: str, args: argparse.Namespace, out: Path) -> list[Path]:
    """The run dirs of one method: out/<method>_s<seed>, or for uniform with
    --uniform-from, that template's dirs (finished runs of the same preset, reused)."""
    if method == "uniform" and args.uniform_from:
        return [Path(args.uniform_from.format(seed=s)) for s in range(args.uniform_seeds)]
    return [out / f"{method}_s{s}" for s in range(args.seeds)]


def read_run(run_dir: Path) -> dict:
    """A run's curve at its evals: step, wall_s (training seconds, each compile step
    counted at the run's median step time), raw_wall_s (as measured), tokens, accuracy;
    the compile steps and seconds left out; the mean zero-advantage fractions."""
    train, evals = read_metrics(run_dir)
    train, evals = (sorted(rs, key=lambda r: r["step"]) for rs in (train, evals))
    step_s = np.asarray([r["rollout_s"] + r["train_s"] for r in train], np.float64)
    compiles = step_s > COMPILE_FACTOR * np.median(step_s)
    wall = np.cumsum(np.where(compiles, np.median(step_s), step_s))
    raw = np.cumsum(step_s)
    tokens = np.cumsum([r["sampled_tokens"] for r in train])
    at = {r["step"]: i for i, r in enumerate(train)}
    curve = [{"step": e["step"], "wall_s": 0.0 if e["step"] == 0 else float(wall[at[e["step"]]]),
              "raw_wall_s": 0.0 if e["step"] == 0 else float(raw[at[e["step"]]]),
              "tokens": 0 if e["step"] == 0 else int(tokens[at[e["step"]]]),
              "accuracy": float(e[METRIC])} for e in evals]
    zero = [r["zero_spread_frac"] for r in train]
    fresh = [r.get("fresh_zero_spread_frac", r["zero_spread_frac"]) for r in train]
    return {"curve": curve, "compile_steps": int(compiles.sum()),
            "compile_s": float(raw[-1] - wall[-1]), "zero_adv_frac": float(np.mean(zero)),
            "fresh_zero_adv_frac": float(np.mean(fresh))}


def mean_curve(runs: list[dict]) -> list[dict]:
    """The seed mean of wall, tokens and accuracy at each eval step all runs share."""
    steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in runs]))
    by = [{p["step"]: p for p in r["curve"]} for r in runs]
    return [{"step": s, **{k: float(np.mean([b[s][k] for b in by]))
                           for k in ("wall_s", "raw_wall_s", "tokens", "accuracy")}} for s in steps]


def first_reach(curve: list[dict], target: float, key: str) -> float | None:
    """`key` (wall_s or tokens) at the first eval whose accuracy >= target, linearly
    interpolated from the eval before; None if never reached."""
    for i, p in enumerate(curve):
        if p["accuracy"] >= target:
            if i == 0:
                return p[key]
            q = curve[i - 1]
            f = (target - q["accuracy"]) / max(p["accuracy"] - q["accuracy"], 1e-12)
            return q[key] + f * (p[key] - q[key])
    return None


def summarize(per_method: dict[str, list[dict]], reach: float = 0.9) -> dict:
    """The table (see the module docstring) from each method's runs (read_run)."""
    uni = per_method["uniform"]
    uni_final = spread([r["curve"][-1]["accuracy"] for r in uni], digits=None)["mean"]
    target = reach * uni_final
    uni_mean = mean_curve(uni)
    base_t = first_reach(uni_mean, target, "wall_s")
    base_full = first_reach(uni_mean, uni_final, "wall_s")
    table = {}
    for name, runs in per_method.items():
        mc = mean_curve(runs)
        fin = spread([r["curve"][-1]["accuracy"] for r in runs], digits=None)
        t, tok = first_reach(mc, target, "wall_s"), first_reach(mc, target, "tokens")
        t_full = first_reach(mc, uni_final, "wall_s")
        seeds_reached = sum(first_reach(r["curve"], target, "wall_s") is not None for r in runs)
        table[name] = {
            "seeds": len(runs),
            "final_accuracy_mean": fin["mean"], "final_accuracy_std": fin["std"],
            "wall_s_to_target": t, "tokens_to_target": tok,
            "seeds_reaching_target": seeds_reached,
            "speedup_to_target": None if t is None or base_t is None else base_t / t,
            "wall_s_to_uniform_final": t_full,
            "speedup_to_uniform_final": None if t_full is None or base_full is None
            else base_full / t_full,
            "total_wall_s_mean": float(np.mean([r["curve"][-1]["wall_s"] for r in runs])),
            "compile_s_mean": float(np.mean([r["compile_s"] for r in runs])),
            "compile_steps_mean": float(np.mean([r["compile_steps"] for r in runs])),
            "total_tokens_mean": float(np.mean([r["curve"][-1]["tokens"] for r in runs])),
            "zero_adv_frac_mean": float(np.mean([r["zero_adv_frac"] for r in runs])),
            "fresh_zero_adv_frac_mean": float(np.mean([r["fresh_zero_adv_frac"] for r in runs])),
            "mean_curve": mc,
        }
    return {"uniform_final_accuracy": uni_final, "target_accuracy": target,
            "target_rule": f"{reach:g} x uniform's final mean {METRIC}", "table": table}


def format_table(summary: dict) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [f"target {summary['target_accuracy']:.3f} ({summary['target_rule']})",
             f"{'method':8s} {'final acc':>15s} {'wall→tgt s':>10s} {'speedup':>7s} "
             f"{'tok→tgt':>9s} {'reached':>7s} {'→uni final':>10s} {'zero-adv':>8s} "
             f"{'fresh z-a':>9s} {'total s':>7s}"]
    for name, r in summary["table"].items():
        lines.append(
            f"{name:8s} {r['final_accuracy_mean']:.3f} ± {r['final_accuracy_std']:.3f}"
            f"{f(r['wall_s_to_target'], '10.1f'):>12s} {f(r['speedup_to_target'], '7.2f'):>7s} "
            f"{f(r['tokens_to_target'], '9.0f'):>9s} "
            f"{r['seeds_reaching_target']:>4d}/{r['seeds']:<2d} "
            f"{f(r['speedup_to_uniform_final'], '10.2f'):>10s} "
            f"{r['zero_adv_frac_mean']:8.3f} {r['fresh_zero_adv_frac_mean']:9.3f} "
            f"{r['total_wall_s_mean']:7.1f}")
    return "\n".join(lines)


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common.plots import save_png

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in summary["table"].items():
        mc = r["mean_curve"]
        for ax, key in zip(axes, ("wall_s", "tokens")):
            ax.plot([p[key] for p in mc], [p["accuracy"] for p in mc], marker=".", label=name)
    for ax, label in zip(axes, ("training wall time (s, evals excluded)", "sampled tokens")):
        ax.axhline(summary["target_accuracy"], color="gray", ls=":", lw=1, label="target")
        ax.set_xlabel(label)
        ax.set_ylabel(f"eval {METRIC} (mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.repro.data_efficiency",
                                description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny-synthetic")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, from {list(METHODS)} (uniform is required)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="steps per run (0: the preset's)")
    p.add_argument("--eval-every", type=int, default=0, help="0: the preset's")
    p.add_argument("--method-flag", action="append", default=[], metavar="NAME:FLAG=VALUE",
                   help="an extra experiments.train flag for one method (repeatable)")
    p.add_argument("--uniform-from", default="", metavar="TEMPLATE",
                   help="reuse finished uniform runs of this preset instead of training them, "
                        "e.g. 'runs/smollm2-rg-s{seed}' (experiments.repro.smollm2_rg's)")
    p.add_argument("--uniform-seeds", type=int, default=3, help="with --uniform-from")
    p.add_argument("--out-dir", default="runs/data_efficiency")
    p.add_argument("--lock", default=LOCK, help="flock file per run ('' for none)")
    p.add_argument("--results-json", default=str(results_path(__file__)))
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "uniform" not in methods:
        p.error(f"--methods: unknown {unknown} (known {list(METHODS)}); uniform is required")
    if args.seeds < 3:
        print("note: fewer than 3 seeds: the spread is not meaningful", file=sys.stderr)
    out = Path(args.out_dir) / args.preset
    method_flags(args)  # a bad --method-flag fails before any run
    trained = [m for m in methods if not (m == "uniform" and args.uniform_from)]
    order = run_order(trained, list(range(args.seeds)))
    print(f"{len(order)} runs: {order}", flush=True)
    train_missing(order, lambda ms: out / f"{ms[0]}_s{ms[1]}",
                  lambda ms: run_one(*ms, args, out / f"{ms[0]}_s{ms[1]}"))  # interrupted: resumes
    per = {m: [read_run(d) for d in run_dirs(m, args, out)] for m in methods}
    summary = summarize(per)
    print(format_table(summary))
    best = max((n for n in methods if n != "uniform"),
               key=lambda n: summary["table"][n]["speedup_to_uniform_final"] or 0.0)
    summary["headline"] = {
        "metric": f"wall-time speedup over uniform GRPO to uniform's final mean {METRIC} "
                  f"({best}, {args.seeds} seeds, {args.preset})",
        "value": summary["table"][best]["speedup_to_uniform_final"], "target": 1.3,
        "machine": machine()}
    summary["config"] = {"preset": args.preset, "seeds": args.seeds, "steps": args.steps or None,
                         "eval_every": args.eval_every or None,
                         "methods": {m: METHODS[m] + method_flags(args).get(m, [])
                                     for m in methods},
                         "uniform_from": args.uniform_from or None,
                         "order": order, "command": "python -m experiments.repro.data_efficiency "
                         + " ".join(sys.argv[1:] if argv is None else argv)}
    path = Path(args.results_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, allow_nan=False,
                               default=lambda x: None if isinstance(x, float) and math.isnan(x)
                               else x))
    plot(summary, path.with_suffix(".png"),
         f"{args.preset}: data efficiency ({args.seeds} seeds, mean)")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return summary


if __name__ == "__main__":
    main()
