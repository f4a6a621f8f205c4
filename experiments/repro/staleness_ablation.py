"""The VCPO staleness ablation ("Stable Asynchrony", issue 9) on the tiny synthetic task.

    python -m experiments.repro.staleness_ablation                  # the grid (resumable)
    python -m experiments.repro.staleness_ablation --report-only    # tables + plots from the runs
    nohup python -m experiments.repro.staleness_ablation > ablation.log 2>&1 &

Each run trains the `tiny-synthetic` preset of experiments.train (tiny decoder from random
init, "reverse 4 symbols") with rl.loops.run_async in deterministic mode: step v trains on a
batch sampled with the params of version max(v - k, 0), so past step k every token is
exactly k versions stale. Methods (same preset optimizer, PPO-clip token-mean loss with
π_old = the step's starting params, i.e. ratio 1 and one update per batch):
  grpo           GRPO advantages, no off-policy correction;
  grpo_tis       + sequence-level truncated IS min(π/μ, 8) (the paper's TIS baseline);
  decoupled_ppo  AReaL's decoupled objective: token behaviour weights π_prox/μ, tokens
                 above 5 rejected (π_prox recomputed = the step's starting params);
  vcpo           VCPO: truncated sequence weight, OPOB baseline (paper weights, exact
                 per-trajectory gradient norms), update scaled by √ρ (ESS of the batch).
Every method logs the batch's ESS ratio ρ and log-weight tails (VCPOConfig.monitor).

Grid: methods × k × seeds; one JSON per run in experiments/results/staleness_ablation/
(skipped when present, so an interrupted grid continues where it stopped; seeds run in
the outer loop so a partial grid covers every cell once first). After every run the
summary experiments/results/staleness_ablation.json (headline: VCPO's final eval reward /
GRPO's at the largest k) and the PNGs (reward vs step and ESS vs step, one panel per k;
final eval reward vs k) are rewritten from the runs on disk.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from experiments.common.benchmarking import (
    RESULTS_DIR,
    load_average,
    machine,
    results_path,
    write_results,
)
from experiments.common.seeds import spread, train_missing
from rl.run import PRESETS, load_policy
from rl.learner import OffPolicyConfig, TrainConfig
from rl.objectives import VCPOConfig

PRESET = "tiny-synthetic"
NAME = "staleness_ablation"
RUNS_DIR = RESULTS_DIR / NAME  # one JSON per run
RESULT = results_path(__file__)
METHODS = ("grpo", "grpo_tis", "decoupled_ppo", "vcpo")
LABELS = {"grpo": "GRPO (no correction)", "grpo_tis": "GRPO + seq. TIS (cap 8)",
          "decoupled_ppo": "decoupled PPO (AReaL)", "vcpo": "VCPO"}
COLORS = {"grpo": "tab:gray", "grpo_tis": "tab:blue", "decoupled_ppo": "tab:green",
          "vcpo": "tab:red"}
# per-step metrics kept in each run's JSON (when the method logs them)
TRAIN_KEYS = ("reward_mean", "vcpo_ess", "vcpo_lr_scale", "vcpo_logw_max", "vcpo_logw_p99",
              "vcpo_logw_std", "vcpo_baseline_minus_mean", "grad_norm", "version_lag_mean",
              "is_capped_frac", "behav_kept_frac", "total_log_ratio_abs_mean", "train_s",
              "rollout_wait_s")


def ablation_train() -> TrainConfig:
    """The preset's TrainConfig as the committed results were measured with it: no entropy
    bonus, constant lr (the preset later gained both; this ablation's per-run JSONs are
    resumed, so a changed config would mix into them)."""
    t = PRESETS[PRESET].train
    return dataclasses.replace(
        t, loss=dataclasses.replace(t.loss, entropy_coef=0.0),
        optimizer=dataclasses.replace(t.optimizer, schedule="constant", decay_steps=None,
                                      min_lr_ratio=0.0))


def method_config(method: str) -> TrainConfig:
    """The ablation's TrainConfig with the method's correction; every method logs ρ."""
    base = ablation_train()
    monitor = VCPOConfig(monitor=True)
    if method == "grpo":
        return dataclasses.replace(base, vcpo=monitor)
    if method == "grpo_tis":
        return dataclasses.replace(base, vcpo=monitor, offpolicy=OffPolicyConfig(
            correction="truncated_is", level="sequence", cap=8.0))
    if method == "decoupled_ppo":
        return dataclasses.replace(base, vcpo=monitor, offpolicy=OffPolicyConfig(
            correction="behaviour", level="token", cap=5.0, mode="mask"))
    if method == "vcpo":
        return dataclasses.replace(base, vcpo=VCPOConfig(enabled=True))
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def run_name(method: str, k: int, seed: int) -> str:
    return f"{method}_k{k}_s{seed}"


def run_one(method: str, k: int, seed: int, steps: int, eval_every: int, eval_prompts: int,
            work_dir: Path, on_step=None) -> dict:
    """Train one (method, k, seed) cell; returns its JSON-ready record."""
    from rl.loops import AsyncConfig, RunHooks, run_async
    from rl.loops.config import LoggingConfig

    preset = PRESETS[PRESET]
    train = method_config(method)
    loop = dataclasses.replace(preset.loop, steps=steps, eval_every=eval_every,
                               eval_prompts=eval_prompts, eval_greedy=False, save_every=0,
                               seed=seed)
    model_config, params, task = load_policy(preset, seed)
    run_dir = work_dir / run_name(method, k, seed)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run interrupted before its JSON restarts
    cfg = dataclasses.replace(preset, train=train, loop=loop, run_dir=str(run_dir),
                              asynchronous=AsyncConfig(mode="deterministic", max_staleness=k),
                              logging=LoggingConfig(wandb="disabled", progress=False))
    t0 = time.perf_counter()
    result = run_async(model_config, params, task, cfg, hooks=RunHooks(on_step=on_step))
    wall = time.perf_counter() - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    loop_src = Path(__file__).resolve().parents[2] / "rl" / "loops" / "asynchronous.py"
    train_rows = [[r["step"]] + [None if r.get(key) is None else round(float(r[key]), 5)
                                 for key in TRAIN_KEYS] for r in result.train]
    return {
        "method": method, "k": k, "seed": seed, "steps": steps, "wall_s": round(wall, 1),
        "final_eval_reward": result.eval[-1]["reward"],
        "initial_eval_reward": result.eval[0]["reward"],
        "eval": [[r["step"], round(r["reward"], 4)] for r in result.eval],
        "train_keys": ["step", *TRAIN_KEYS], "train": train_rows,
        "config": {"train": repr(train), "loop": dataclasses.asdict(loop),
                   "async": {"mode": "deterministic", "max_staleness": k}},
        "load_average_after": load_average(),
        # provenance of the asynchronous loop the run used: git blob id of
        # rl/loops/asynchronous.py (of rl/loop.py in results from before the rl/ layout change)
        "rl_loop_blob": _git_blob(loop_src),
    }


def _git_blob(path: Path) -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True,
                              check=True, cwd=path.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ----------------------------------------------------------------------------- summary
def load_runs(runs_dir: Path = RUNS_DIR) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]


def _column(run: dict, key: str) -> np.ndarray:
    i = run["train_keys"].index(key)
    return np.array([np.nan if row[i] is None else row[i] for row in run["train"]], float)


def _cells(runs: list[dict]) -> dict[tuple[int, str], list[dict]]:
    cells: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        cells.setdefault((r["k"], r["method"]), []).append(r)
    return cells


def _verdict(k: int, stats: dict[str, dict]) -> str:
    if "vcpo" not in stats or "grpo" not in stats:
        return f"k={k}: incomplete (needs both vcpo and grpo runs)"
    v = stats["vcpo"]
    others = {m: s for m, s in stats.items() if m != "vcpo"}
    best = max(others, key=lambda m: others[m]["mean"])
    b = others[best]
    clear = v["min"] > b["max"] if v["mean"] > b["mean"] else v["max"] < b["min"]
    rel = "above" if v["mean"] > b["mean"] else "below"
    how = ("beyond the seed spread" if clear else "within the seed spread") \
        if min(v["n"], b["n"]) > 1 else "one seed only"
    return (f"k={k}: VCPO {v['mean']:.3f} vs GRPO {stats['grpo']['mean']:.3f}; best baseline "
            f"{LABELS[best]} {b['mean']:.3f}; VCPO is {rel} it, {how} "
            f"(median ESS: VCPO {v['ess_median']:.2f}, GRPO {stats['grpo']['ess_median']:.2f})")


def summarize(runs: list[dict]) -> dict:
    """Table of final eval reward (mean, min, max over seeds) and ESS statistics per
    (k, method), a verdict per k, and the headline."""
    table = []
    by_k: dict[int, dict[str, dict]] = {}
    for (k, method), rs in sorted(_cells(runs).items()):
        final = spread([r["final_eval_reward"] for r in rs], digits=None)
        ess = np.concatenate([_column(r, "vcpo_ess") for r in rs])
        lwmax = np.concatenate([_column(r, "vcpo_logw_max") for r in rs])
        after = np.concatenate([_column(r, "vcpo_ess")[k:] for r in rs])  # lag exactly k
        row = {"k": k, "method": method, "seeds": sorted(r["seed"] for r in rs),
               "final_eval_mean": final["mean"], "final_eval_min": final["min"],
               "final_eval_max": final["max"],
               "final_eval_per_seed": {str(r["seed"]): r["final_eval_reward"] for r in rs},
               # a collapse shows as a final eval well below the run's best eval
               "peak_eval_mean": float(np.mean([max(e[1] for e in r["eval"]) for r in rs])),
               "ess_median": float(np.nanmedian(ess)), "ess_min": float(np.nanmin(ess)),
               "ess_below_0.5_frac": float(np.nanmean(ess < 0.5)),
               "ess_median_after_k": float(np.nanmedian(after)) if after.size else None,
               "logw_max_median": float(np.nanmedian(lwmax)),
               "wall_s_mean": float(np.mean([r["wall_s"] for r in rs]))}
        table.append(row)
        by_k.setdefault(k, {})[method] = {"n": len(rs), "mean": row["final_eval_mean"],
                                          "min": row["final_eval_min"],
                                          "max": row["final_eval_max"], "ess_median": row["ess_median"]}
    verdicts = [_verdict(k, by_k[k]) for k in sorted(by_k)]
    ks = [k for k in sorted(by_k) if "vcpo" in by_k[k] and "grpo" in by_k[k]]
    value = float("nan")
    if ks:
        top = by_k[ks[-1]]
        value = top["vcpo"]["mean"] / top["grpo"]["mean"] if top["grpo"]["mean"] > 0 else float("nan")
    return {
        "headline": {"metric": f"VCPO final eval reward / GRPO's at the largest k "
                               f"(k={ks[-1] if ks else None}, mean over seeds)",
                     "value": round(value, 4) if math.isfinite(value) else 0.0,
                     "target": 1.0, "machine": machine()},
        "verdicts": verdicts, "table": table,
        "runs": len(runs), "total_wall_s": round(sum(r["wall_s"] for r in runs), 1),
    }


def plot(runs: list[dict], out_prefix: Path, window: int = 10) -> list[Path]:
    """reward vs step and ESS vs step (one panel per k, methods overlaid: mean over seeds,
    band = min..max), and final eval reward vs k. Returns the PNG paths."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common.plots import save_png, smooth

    cells = _cells(runs)
    ks = sorted({k for k, _ in cells})
    methods = [m for m in METHODS if any(mm == m for _, mm in cells)]
    paths = []

    def save(fig, suffix):
        path = out_prefix.with_name(out_prefix.name + suffix)
        save_png(fig, path)
        paths.append(path)

    def band(ax, steps, ys, m, n_seeds, marker=None):
        ax.plot(steps, ys.mean(0), color=COLORS[m], lw=1.6, marker=marker, ms=3,
                label=f"{LABELS[m]} ({n_seeds} seeds)")
        ax.fill_between(steps, ys.min(0), ys.max(0), color=COLORS[m], alpha=0.18, lw=0)

    # rows: eval reward of the learner's params; train reward (the batch's, sampled k
    # versions earlier); ESS ratio of the batch. One column per k; bands = min..max over seeds.
    rows = (("eval", "eval reward (learner)", False, "_reward.png"),
            ("reward_mean", f"batch reward ({window}-step mean)", False, "_reward.png"),
            ("vcpo_ess", f"ESS ratio ρ ({window}-step mean)", True, "_ess.png"))
    for suffix in ("_reward.png", "_ess.png"):
        spec = [r for r in rows if r[3] == suffix]
        fig, axes = plt.subplots(len(spec), len(ks), figsize=(3.4 * len(ks), 3.0 * len(spec)),
                                 dpi=110, squeeze=False, sharey="row")
        for (key, ylabel, log, _), ax_row in zip(spec, axes):
            for ax, k in zip(ax_row, ks):
                for m in methods:
                    rs = cells.get((k, m), [])
                    if not rs:
                        continue
                    if key == "eval":
                        n = min(len(r["eval"]) for r in rs)
                        steps = np.array([e[0] for e in rs[0]["eval"][:n]])
                        band(ax, steps, np.array([[e[1] for e in r["eval"][:n]] for r in rs]), m,
                             len(rs), marker="o")
                    else:
                        n = min(len(r["train"]) for r in rs)
                        steps = np.array([row[0] for row in rs[0]["train"][:n]])
                        band(ax, steps, np.stack([smooth(_column(r, key)[:n], window) for r in rs]),
                             m, len(rs))
                if k > 0:
                    ax.axvline(k, color="k", ls=":", lw=0.8)
                ax.set_title(f"staleness k = {k}", fontsize=10)
                ax.set_xlabel("optimizer step")
                if log:
                    ax.set_yscale("log")
                ax.grid(alpha=0.3)
            ax_row[0].set_ylabel(ylabel)
        axes[0][0].legend(fontsize=6, loc="upper left")
        save(fig, suffix)

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
    for j, m in enumerate(methods):
        xs, mean, lo, hi = [], [], [], []
        for i, k in enumerate(ks):
            rs = cells.get((k, m), [])
            if rs:
                f = [r["final_eval_reward"] for r in rs]
                xs.append(i + (j - 1.5) * 0.08)
                mean.append(np.mean(f))
                lo.append(np.mean(f) - min(f))
                hi.append(max(f) - np.mean(f))
        ax.errorbar(xs, mean, yerr=[lo, hi], fmt="o-", color=COLORS[m], ms=4, lw=1.2, capsize=3,
                    label=LABELS[m])
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("staleness k (versions)")
    ax.set_ylabel("final eval reward (mean, min..max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "_final.png")
    return paths


def report(runs_dir: Path = RUNS_DIR, out: Path = RESULT,
           command: str | None = None) -> dict:
    runs = load_runs(runs_dir)
    if not runs:
        raise SystemExit(f"no runs under {runs_dir}; run the grid first")
    summary = summarize(runs)
    summary["command"] = command or f"python -m experiments.repro.{NAME}"
    summary["load_average_1_5_15min"] = load_average()
    summary["plots"] = [p.name for p in plot(runs, out.with_suffix(""))]
    write_results(out, summary)
    return summary


def print_table(summary: dict) -> None:
    print(f"{'k':>4} {'method':<15} {'final eval (mean, min..max)':<28} {'peak eval':>9} "
          f"{'ESS median':>10} {'ESS min':>8} {'ESS<0.5':>8} {'max log w':>10}")
    for row in summary["table"]:
        print(f"{row['k']:>4} {row['method']:<15} "
              f"{row['final_eval_mean']:.3f} ({row['final_eval_min']:.3f}..{row['final_eval_max']:.3f})"
              f"{'':<6} {row['peak_eval_mean']:>9.3f} {row['ess_median']:>10.3f} "
              f"{row['ess_min']:>8.3f} {row['ess_below_0.5_frac']:>8.2f} {row['logw_max_median']:>10.2f}")
    for v in summary["verdicts"]:
        print(v)
    h = summary["headline"]
    print(f"headline: {h['metric']} = {h['value']} (target {h['target']})")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog=f"python -m experiments.repro.{NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--ks", nargs="+", type=int, default=[0, 4, 16, 64])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--runs-dir", default=str(RUNS_DIR), help="one JSON per run (resumable)")
    p.add_argument("--work-dir", default="runs/staleness_ablation", help="scratch run dirs")
    p.add_argument("--out", default=str(RESULT),
                   help="summary JSON (the PNGs are written beside it)")
    p.add_argument("--report-only", action="store_true", help="summarise the runs on disk")
    args = p.parse_args(argv)
    runs_dir, out = Path(args.runs_dir), Path(args.out)
    command = f"python -m experiments.repro.{NAME} " + " ".join(sys.argv[1:] if argv is None else argv)
    if not args.report_only:
        runs_dir.mkdir(parents=True, exist_ok=True)
        grid = [(m, k, s) for s in args.seeds for k in args.ks for m in args.methods]

        def record_of(cell) -> Path:
            return runs_dir / f"{run_name(*cell)}.json"

        done = sum(record_of(c).exists() for c in grid)
        bar = tqdm(total=len(grid), initial=done, desc="ablation", dynamic_ncols=True)

        def train_cell(cell) -> None:
            method, k, seed = cell
            name = run_name(method, k, seed)

            def on_step(rec, name=name):
                bar.set_postfix_str(f"{name} step {rec['step']}/{args.steps} "
                                    f"reward {rec['reward_mean']:.3f}", refresh=False)

            rec = run_one(method, k, seed, args.steps, args.eval_every, args.eval_prompts,
                          Path(args.work_dir), on_step=on_step)
            rec["command"] = command.strip()
            tmp = runs_dir / f"{name}.json.tmp"
            tmp.write_text(json.dumps(rec) + "\n")
            tmp.replace(runs_dir / f"{name}.json")
            bar.update(1)
            bar.write(f"{name}: final eval reward {rec['final_eval_reward']:.3f} "
                      f"({rec['wall_s']:.0f} s, load {rec['load_average_after'][0]})")
            report(runs_dir, out, command.strip())

        train_missing(grid, record_of, train_cell, finished=Path.exists)
        bar.close()
    summary = report(runs_dir, out, command.strip())
    print_table(summary)
    return summary


if __name__ == "__main__":
    main()
