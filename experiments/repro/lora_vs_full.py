"""LoRA vs full fine-tuning on the real-model preset: SmolLM2-135M-Instruct, GRPO on
reasoning-gym chain_sum (experiments.repro.smollm2_rg's preset, the same 30-minute budget
and the same 256 held-out problems), with rank-8 adapters on every projection.

    python -m experiments.repro.lora_vs_full --seeds 0 1 --train  # run the LoRA seeds (~33
                                                                  # min each on 2 cores), collect
    python -m experiments.repro.lora_vs_full --seeds 0 1          # collect finished runs only

Each seed is `python -m experiments.train --preset smollm2-rg --seed S --lora-rank 8
--lr 2e-4 --run-dir runs/smollm2-rg-lora-r8-sS`. The learning rate is 10x the full
fine-tune's 2e-5: with Adam each entry of B moves ~lr per step, and the weight update
(alpha/r) A dB has entries ~ lr * (alpha/r) * sqrt(r / fan_in) = 0.24 lr for SmolLM2
(alpha/r = 2, r = 8, fan_in 576), rank 8 only; 10x puts LoRA's per-entry step at ~2.4x the
full fine-tune's 2e-5 inside an 8-dimensional subspace per matrix (no sweep was run).

The full fine-tune's runs are read from experiments/results/smollm2_rg.json (its seeds);
the LoRA runs from their run dirs (experiments.common.seeds.read_before_after: before /
after greedy accuracy with standard errors, eval and train curves). Writes
experiments/results/lora_vs_full.json, headline = LoRA's mean gain in greedy accuracy
(after - before) with the full fine-tune's mean gain as the target, and lora_vs_full.png:
held-out greedy accuracy against step and against minutes, LoRA next to full FT.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.common.benchmarking import RESULTS_DIR, machine, results_path
from experiments.common.seeds import gain_over_seeds, over_seeds, read_before_after
from rl.runtime.logging import atomic_write_json

PRESET = "smollm2-rg"  # experiments.repro.smollm2_rg's
RANK, LR = 8, 2e-4
FULL_JSON = RESULTS_DIR / "smollm2_rg.json"


def run_dir_of(root: Path, seed: int) -> Path:
    return root / f"{PRESET}-lora-r{RANK}-s{seed}"


def train_command(root: Path, seed: int) -> list[str]:
    return ["--preset", PRESET, "--seed", str(seed), "--lora-rank", str(RANK), "--lr", str(LR),
            "--run-dir", str(run_dir_of(root, seed))]


def collect(root: Path, seeds: list[int], full_json: Path = FULL_JSON, train=None) -> dict:
    """The results JSON from the LoRA seeds' run dirs under `root` and the full fine-tune's
    results; with `train` (the train job's main), unfinished LoRA seeds are trained first."""
    lora = over_seeds(seeds, lambda s: run_dir_of(root, s), read_before_after,
                      train=None if train is None else lambda s: train(train_command(root, s)))
    full = json.loads(full_json.read_text())["runs"]
    lg, fg = gain_over_seeds(lora), gain_over_seeds(full)
    return {
        "headline": {
            "metric": f"mean gain in greedy accuracy on 256 held-out chain_sum problems, LoRA "
                      f"r={RANK} (target: the full fine-tune's mean gain, "
                      f"{fg['seeds']} seeds)",
            "value": round(lg["mean"], 4),
            "target": round(fg["mean"], 4),
            "machine": machine(),
            "lora_over_full": round(lg["mean"] / fg["mean"], 3),
        },
        "lora": {"gain_over_seeds": lg, "rank": RANK, "alpha": 2.0 * RANK, "lr": LR,
                 "targets": "q,k,v,o,gate,up,down", "runs": lora,
                 "sampler": "merged (the loops' default when these runs were made; the default "
                            "is now on the fly, which samples the same tokens)"},
        "full": {"gain_over_seeds": fg, "lr": 2e-5, "source": str(full_json),
                 "curves": {s: {"eval_curve": r["eval_curve"], "steps": r["steps"]}
                            for s, r in full.items()}},
        "command": "python -m experiments.repro.lora_vs_full --train --seeds "
                   + " ".join(map(str, seeds)),
        "per_seed_command": "python -m experiments.train " + " ".join(
            train_command(Path("runs"), 0)).replace("-s0", "-sS").replace("--seed 0", "--seed S"),
        "note": "both arms run the preset's 30-minute run clock on a shared 2-core machine: "
                "steps differ with the load (each run's steps and load average are recorded)",
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common.plots import save_png

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    arms = [("full FT", result["full"]["curves"], "tab:gray", "s--", 1.0),
            (f"LoRA r={RANK}", result["lora"]["runs"], "tab:red", "o-", 1.8)]
    for col, x in enumerate(("step", "minutes")):
        ax = axes[col]
        for name, runs, color, style, lw in arms:
            for seed, run in runs.items():
                ev = run["eval_curve"]
                ax.plot([r[x] for r in ev], [r["greedy_accuracy"] for r in ev], style,
                        color=color, lw=lw, ms=3, alpha=0.9, label=f"{name}, seed {seed}")
        ax.set_xlabel("optimizer step" if x == "step" else "run-clock minutes")
        ax.set_ylabel("held-out greedy accuracy (256 problems)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    h = result["headline"]
    fig.suptitle(f"SmolLM2-135M GRPO on chain_sum: LoRA r={RANK} (lr {LR:g}) gain "
                 f"{h['value']:+.3f} vs full fine-tune (lr 2e-5) {h['target']:+.3f}", fontsize=10)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.repro.lora_vs_full",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--train", action="store_true", help="train the LoRA seeds that have no "
                   "summary.json yet (one after another) before collecting")
    p.add_argument("--run-root", default="runs", help="where the run dirs live (default runs/)")
    p.add_argument("--full", default=str(FULL_JSON), help="the full fine-tune's results JSON")
    p.add_argument("--out", default=str(results_path(__file__)))
    args = p.parse_args(argv)
    root = Path(args.run_root)
    train = None
    if args.train:
        from experiments.common.train_cli import main as train
    try:
        result = collect(root, args.seeds, Path(args.full), train)
    except ValueError as err:
        sys.exit(f"error: {err}")
    out = Path(args.out)
    atomic_write_json(out, result)
    plot(result, out.with_suffix(".png"))
    print(f"{'arm':>10} {'seed':>5} {'before':>7} {'after':>7} {'gain':>16} {'steps':>6}")
    for arm, runs in (("full", json.loads(Path(args.full).read_text())["runs"]),
                      (f"lora-r{RANK}", result["lora"]["runs"])):
        for seed, r in runs.items():
            print(f"{arm:>10} {seed:>5} {r['before']['accuracy']:7.3f} "
                  f"{r['after']['accuracy']:7.3f} {r['gain']:+7.3f} ± {r['gain_stderr']:.3f} "
                  f"{r['steps']:>6}")
    h = result["headline"]
    print(f"mean gain: LoRA {h['value']:+.3f}, full FT {h['target']:+.3f} "
          f"(ratio {h['lora_over_full']:.2f}); wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
