"""Guess the number, learned from scratch: the tiny model over seeds vs the exact baselines.

    python -m experiments.repro.guess_number                  # preset tiny-guess, seeds 0 1 2
    python -m experiments.repro.guess_number --seeds 0 1 2 3 -- --steps 300

Runs `experiments.train` (preset tiny-guess: `--env guess_number`, the multi-turn engine,
GRPO on episode outcomes) for each seed in turn, each in <runs-root>/seed_<s> (a seed
whose run dir holds a finished run is read, not trained again), then writes
`--results-json` (default experiments/results/guess_number.json) and a PNG beside it:
every seed's eval score curve (sampled and greedy), their means, and the exact baselines
of rl.envs.guess_number: a feedback-blind uniform guess over the numbers and over the
whole vocabulary (what an untrained model does), a uniform guess among the numbers still
consistent with the feedback, and the optimum (binary search). Eval: the
preset's held-out episodes (every hidden number equally often), score = 1 - (t-1)/T if
found at turn t. Headline: the final sampled eval score, mean over seeds, against the
consistent-random baseline (a policy must use the feedback to pass it).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from experiments.common.benchmarking import load_average, machine, results_path
from experiments.common.seeds import check_train_args, over_seeds, plot_over_seeds, spread
from experiments.common.train_cli import main as train_main
from rl.run import PRESETS
from rl.envs import make_env
from rl.runtime.logging import atomic_write_json

PRESET = "tiny-guess"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.repro.guess_number",
                                description="guess_number over seeds vs exact baselines")
    p.add_argument("--preset", default=PRESET, choices=sorted(PRESETS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs-root", default="runs/guess_number")
    p.add_argument("--results-json", default=str(results_path(__file__)))
    p.add_argument("train_args", nargs="*", metavar="-- TRAIN_FLAGS",
                   help="flags passed to every experiments.train run (after --)")
    return p


def baselines(preset: str) -> dict[str, float]:
    """The exact baselines of the preset's game (rl.envs.guess_number)."""
    options = PRESETS[preset].task.kwargs
    env = make_env("guess_number", **{k: v for k, v in options.items() if k in ("k", "max_turns")})
    return {"random_numbers": round(env.random_baseline("numbers"), 4),
            "random_vocab": round(env.random_baseline("vocab"), 4),
            "consistent_random": round(env.consistent_random_baseline(), 4),
            "optimal": round(env.optimal_score(), 4), "k": env.k, "max_turns": env.max_turns}


def train_seed(preset: str, seed: int, run_dir: Path, train_args: list[str]) -> dict:
    return train_main(["--preset", preset, "--seed", str(seed), "--run-dir", str(run_dir),
                       "--no-progress", *train_args])


def read_seed(run_dir: Path) -> dict:
    """A finished run's numbers, as its summary.json states them."""
    s = json.loads((run_dir / "summary.json").read_text())
    return {"run_dir": str(run_dir), "steps": s["steps"],
            "initial_eval_score": s["initial_eval_reward"],
            "final_eval_score": s["final_eval_reward"],
            "final_greedy_eval_score": s["final_greedy_eval_reward"],
            "wall_time_s": s["wall_time_s"],
            "curve": {k: s["curve"][k] for k in ("eval_reward", "eval_greedy_reward")}}


def plot(res: dict, path: Path) -> None:
    from experiments.common.plots import plt, save_png

    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for key, color, label in (("eval_reward", "tab:blue", "sampled"),
                              ("eval_greedy_reward", "tab:green", "greedy")):
        curves = [c for s in res["seeds"] if (c := s["curve"][key])]
        if curves:
            plot_over_seeds(ax, curves, color=color,
                            label=f"{label} eval score, mean of {len(curves)} seeds")
    b = res["baselines"]
    for key, color, label in (("optimal", "black", "optimal (binary search)"),
                              ("consistent_random", "tab:purple",
                               "random among consistent numbers"),
                              ("random_numbers", "tab:red", "random over the numbers"),
                              ("random_vocab", "gray", "random over the vocabulary")):
        ax.axhline(b[key], color=color, lw=1.0, ls=":", label=f"{label} {b[key]:.3f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"eval score (K={b['k']}, T={b['max_turns']})")
    ax.set_ylim(0, 0.7)
    ax.set_title("guess the number: tiny model from scratch, multi-turn GRPO")
    ax.legend(fontsize=7.5, loc="lower right")
    save_png(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_train_args(args.train_args, "experiments.repro.guess_number")
    except ValueError as err:
        parser.error(str(err))
    command = "python -m experiments.repro.guess_number " + " ".join(
        sys.argv[1:] if argv is None else argv)
    load_before, t0 = load_average(), time.perf_counter()
    root = Path(args.runs_root)
    runs = over_seeds(args.seeds, lambda s: root / f"seed_{s}", read_seed,
                      train=lambda s: train_seed(args.preset, s, root / f"seed_{s}",
                                                 args.train_args))
    records = [{"seed": s, **runs[str(s)]} for s in args.seeds]
    b = baselines(args.preset)
    final = spread([r["final_eval_score"] for r in records])
    greedy = spread([r["final_greedy_eval_score"] for r in records])
    res = {
        "headline": {
            "metric": f"final sampled eval score, mean over {len(records)} seeds (target: the "
                      "random-among-consistent-numbers baseline)",
            "value": final["mean"], "spread": final, "target": b["consistent_random"],
            "reached_target": final["min"] > b["consistent_random"], "machine": machine()},
        "command": command.strip(), "preset": args.preset, "baselines": b,
        "final_eval_score": final, "final_greedy_eval_score": greedy,
        "seeds": records, "total_wall_time_s": round(time.perf_counter() - t0, 1),
        "load_average_1_5_15min": {"before": load_before, "after": load_average()},
    }
    path = Path(args.results_json)
    atomic_write_json(path, res)
    plot(res, path.with_suffix(".png"))
    print(format_table(res))
    return res


def format_table(res: dict) -> str:
    b = res["baselines"]
    lines = [f"{'seed':>4} {'initial':>8} {'final':>7} {'greedy':>7} {'wall s':>7}"]
    for s in res["seeds"]:
        lines.append(f"{s['seed']:>4} {s['initial_eval_score']:8.3f} {s['final_eval_score']:7.3f} "
                     f"{s['final_greedy_eval_score']:7.3f} {s['wall_time_s']:7.1f}")
    f, g = res["final_eval_score"], res["final_greedy_eval_score"]
    lines.append(f"final sampled {f['mean']:.3f} ± {f['std']:.3f}, greedy {g['mean']:.3f} ± "
                 f"{g['std']:.3f}; random {b['random_numbers']:.3f} (numbers) / "
                 f"{b['random_vocab']:.3f} (vocab), consistent-random "
                 f"{b['consistent_random']:.3f}, optimal {b['optimal']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
