"""Online rollout pruning (rl.rollout.pruning, --prune) against plain GRPO on the
tiny-synthetic preset, over seeds: sampled tokens, tokens pruned / saved, wall time,
eval reward (sampled and greedy) at the end and along the way.

    python -m experiments.repro.prune_tiny                    # seeds 0 1 2, 800 steps each
    python -m experiments.repro.prune_tiny --seeds 0 --steps 100

Both arms run `experiments.train.main` with --segment-len 2 (the synthetic responses are
4 tokens, so a group's pruning point, 2 tokens, is a segment boundary); the pruning arm
adds --prune (defaults: ρ = 0.5, at most half a group, warmup 64 examples). Writes
experiments/results/prune_tiny.json (headline: the ratio of sampled tokens, pruned over
plain, at a matching final eval reward) and prune_tiny.png (greedy eval reward vs sampled
tokens, mean over seeds per arm).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from experiments.common.benchmarking import machine, results_path
from experiments.common.seeds import read_metrics, spread
from experiments.common.train_cli import main as train_main
from rl.runtime.logging import atomic_write_json

ARMS = {"grpo": [], "grpo+prune": ["--prune"]}


def one_run(arm: str, seed: int, steps: int, root: Path, extra: list[str]) -> dict:
    run_dir = root / f"{arm}_seed{seed}"
    argv = ["--seed", str(seed), "--steps", str(steps), "--segment-len", "2", "--run-dir",
            str(run_dir), "--wandb", "disabled", "--no-progress", *ARMS[arm],
            *(extra if ARMS[arm] else [])]
    summary = train_main(argv)
    train, evals = read_metrics(run_dir)
    tokens = np.cumsum([r["sampled_tokens"] for r in train])
    at = {r["step"]: int(tokens[r["step"] - 1]) if r["step"] else 0 for r in evals}
    return {
        "seed": seed, "sampled_tokens": int(tokens[-1]),
        "pruned": int(sum(r.get("prune_pruned", 0) for r in train)),
        "pruned_tokens": int(sum(r.get("prune_pruned_tokens", 0) for r in train)),
        "tokens_saved": int(sum(r.get("prune_tokens_saved", 0) for r in train)),
        "wall_s": summary["wall_time_s"],  # the whole run: load, compile, evals
        # the train steps but the first (which compiles; a later run in this process reuses it)
        "step_s": float(sum(r["rollout_s"] + r["train_s"] for r in train[1:])),
        "final_reward": evals[-1]["reward"], "final_greedy": evals[-1]["greedy_reward"],
        "curve": [{"step": r["step"], "tokens": at[r["step"]], "reward": r["reward"],
                   "greedy": r["greedy_reward"]} for r in evals]}


def stats(xs) -> dict:
    """mean, std, min, max over seeds (as computed, not rounded)."""
    return {k: v for k, v in spread(xs, digits=None).items() if k != "ci95"}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.repro.prune_tiny")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--results-json", default=str(results_path(__file__)))
    p.add_argument("--prune-flags", default="", help="more flags for the pruning arm, e.g. "
                   "'--prune-max-frac 0.25'")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        extra = args.prune_flags.split()
        runs = {arm: [one_run(arm, s, args.steps, Path(tmp), extra) for s in args.seeds]
                for arm in ARMS}
    table = {arm: {k: stats([r[k] for r in rs]) for k in
                   ("sampled_tokens", "pruned", "pruned_tokens", "tokens_saved", "wall_s", "step_s",
                    "final_reward", "final_greedy")} for arm, rs in runs.items()}
    print(f"{'arm':<12} {'tokens':>9} {'pruned':>8} {'saved':>8} {'step s':>7} "
          f"{'final':>13} {'greedy':>13}")
    for arm, t in table.items():
        print(f"{arm:<12} {t['sampled_tokens']['mean']:9.0f} {t['pruned']['mean']:8.0f} "
              f"{t['tokens_saved']['mean']:8.0f} {t['step_s']['mean']:7.1f} "
              f"{t['final_reward']['mean']:.3f}±{t['final_reward']['std']:.3f} "
              f"{t['final_greedy']['mean']:.3f}±{t['final_greedy']['std']:.3f}")
    ratio = table["grpo+prune"]["sampled_tokens"]["mean"] / table["grpo"]["sampled_tokens"]["mean"]
    out = {"headline": {"metric": "sampled tokens, pruned / plain GRPO (800 steps, tiny-synthetic)",
                        "value": ratio, "target": "< 1 at an equal final eval reward",
                        "machine": machine()},
           "command": "python -m experiments.repro.prune_tiny " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "prune_flags": args.prune_flags, "seeds": args.seeds, "steps": args.steps, "table": table, "runs": runs}
    path = Path(args.results_json)
    atomic_write_json(path, out)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common.plots import save_png
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, rs in runs.items():
        x = np.mean([[c["tokens"] for c in r["curve"]] for r in rs], axis=0)
        y = np.mean([[c["greedy"] for c in r["curve"]] for r in rs], axis=0)
        ax.plot(x, y, marker="o", ms=3, label=f"{arm} (mean of {len(rs)} seeds)")
    ax.set_xlabel("sampled tokens")
    ax.set_ylabel("greedy eval reward")
    ax.set_title("tiny-synthetic: online pruning vs plain GRPO")
    ax.legend()
    save_png(fig, path.with_suffix(".png"))
    return out


if __name__ == "__main__":
    main()
