"""The off-policy testbed with power: a tiny policy trained from scratch on long responses,
where stale data can hurt, many seeds per cell, paired verdicts.

    python -m experiments.repro.staleness_testbed sweep [--methods ...] [--ks 0 4 16 64]
                                                        [--seeds 0 1 2 3 4] [--max-cells N]
    python -m experiments.repro.staleness_testbed report
    python -m experiments.repro.staleness_testbed regime --lrs 1e-3 3e-3 --ks 0 16 64

The task: rl.tasks.SyntheticTask (SETUP.task_options: long responses, per-position credit);
the learner and loop: the tiny-synthetic preset with SETUP's changes. Every cell (method,
staleness k, seed) trains with the deterministic k-stale source (step v samples with the
params of version max(v − k, 0); k = 0 is the synchronous run) for SETUP.steps steps, so the
version-0 warm-up is k / steps of the run; the methods are experiments.common.offpolicy_methods'.
A finished cell's record (its curves, and each eval problem's count of correct positions at
the initial and final greedy evals, read from the run's eval_problems.jsonl) goes to
experiments/results/staleness_testbed/<method>_k<k>_s<seed>.json; a cell with a record is
skipped, so a stopped sweep continues when the command is run again.

The report and its rule, fixed before the runs (docs/results/staleness-testbed.md): the
measure is greedy eval reward (the share of correct positions) on SETUP.eval_prompts
held-out problems at the last step; tables are [seeds, problems], paired by seed and
problem (experiments.common.paired: 4000 bootstrap replicates drawing seeds and problems).
  G            the synchronous gain: naive PPO at k = 0 minus the initial policy
  kept(m, k)   (m at k − initial) / G, with its CI
  staleness hurts at k   when naive PPO's kept share at k has a CI below 0.8
  m holds at k when kept(m, k) >= 0.8 and the paired CI of (m − naive) at k excludes 0
               from below (m beats naive PPO)
  verdict      reproduced: m holds at every k where staleness hurts; partly: at some;
               not: at none (and "untested" where staleness hurts nowhere)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common.docs_rows import replace_row
from experiments.common.offpolicy_methods import (
    COLORS,
    LABELS,
    METHODS,
    method_proximal,
    method_train,
)
from experiments.common.offpolicy_verdicts import (KEPT, render_rows, run_machines,
                                                   verdicts_from_tables)
from experiments.common.offpolicy_verdicts import RULE as SHARED_RULE
from experiments.common.paired import problem_results
from experiments.common.testbed import Setup
from rl.loops import AsyncConfig
from rl.run import PRESETS, RunConfig, train
from rl.runtime.host import machine
from rl.runtime.logging import atomic_write_json

RESULTS = Path("experiments/results")
CELLS_DIR = RESULTS / "staleness_testbed"
RESULT = RESULTS / "staleness_testbed.json"
REGIME = RESULTS / "staleness_testbed_regime.json"  # how the learning rate was chosen
PAGE = Path("docs/results/staleness-testbed.md")
README, INDEX = Path("README.md"), Path("docs/results/index.md")
WORK_DIR = Path("runs/staleness_testbed")


SETUP = Setup()
# the train/inference half (Missing Old Logits' claim): a bf16 sampler beside the fp32
# learner, so π_prox at a token's own version is not μ; the methods that differ there
MISMATCH = dataclasses.replace(SETUP, rollout_dtype="bfloat16")
MISMATCH_METHODS = ["naive", "decoupled", "exact"]
MISMATCH_CELLS = RESULTS / "staleness_testbed_mismatch"
MISMATCH_RESULT = RESULTS / "staleness_testbed_mismatch.json"


def cell_name(method: str, k: int, seed: int) -> str:
    return f"{method}_k{k}_s{seed}"


def cell_config(setup: Setup, method: str, k: int, seed: int, run_dir: Path) -> RunConfig:
    """The RunConfig of one (method, k, seed) cell (module doc)."""
    cfg = PRESETS["tiny-synthetic"].overrides({**setup.paths(), "loop.seed": seed,
                                                "model.init_seed": seed,
                                                "run_dir": str(run_dir)})
    return dataclasses.replace(
        cfg, name=f"testbed-{cell_name(method, k, seed)}", train=method_train(method, cfg.train),
        asynchronous=AsyncConfig(mode="deterministic", max_staleness=k,
                                 proximal=method_proximal(method)))


def cell_record(setup: Setup, method: str, k: int, seed: int, run_dir: Path, wall_s: float
                ) -> dict:
    """A finished cell's record: curves and the per-problem correct-position counts."""
    res = problem_results(run_dir)
    first, last = min(res), max(res)
    n = dict(setup.task_options).get("length", 4) * dict(setup.task_options).get("repeats", 1)
    evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in evals if r["kind"] == "train"]
    evals = [r for r in evals if r["kind"] == "eval"]

    def counts(step):
        probs = res[step]["greedy"]
        return [int(round(probs[i] * n)) for i in sorted(probs)]

    keys = ("reward_mean", "clip_frac", "behav_kept_frac", "is_kept_frac", "m2po_masked_frac",
            "icepop_masked_frac", "vcpo_ess", "staleness_log_ratio_abs_mean",
            "mismatch_log_ratio_abs_mean", "entropy")
    return {"method": method, "k": k, "seed": seed, "setup": dataclasses.asdict(setup),
            "positions": n, "initial_step": first, "final_step": last,
            "initial_correct": counts(first), "final_correct": counts(last),
            "eval": [[e["step"], e.get("greedy_reward"), e.get("reward")] for e in evals],
            "train_keys": ["step", *keys],
            "train": [[r["step"], *(None if r.get(key) is None else round(float(r[key]), 5)
                                    for key in keys)] for r in train_recs[::10]],
            "wall_s": round(wall_s, 1), "machine": machine()}


def sweep(methods: list[str], ks: list[int], seeds: list[int], max_cells: int | None,
          setup: Setup = SETUP, cells_dir: Path = CELLS_DIR, work_dir: Path = WORK_DIR) -> None:
    """Train every missing cell (seed by seed, so each seed's grid completes first)."""
    todo = [(m, k, s) for s in seeds for k in ks for m in methods
            if not (cells_dir / f"{cell_name(m, k, s)}.json").is_file()]
    for i, (m, k, s) in enumerate(todo[:max_cells]):
        run_dir = work_dir / cell_name(m, k, s)
        shutil.rmtree(run_dir, ignore_errors=True)  # minutes a cell: an unfinished one restarts
        t0 = time.perf_counter()
        train(cell_config(setup, m, k, s, run_dir))
        rec = cell_record(setup, m, k, s, run_dir, time.perf_counter() - t0)
        atomic_write_json(cells_dir / f"{cell_name(m, k, s)}.json", rec)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        print(f"[{i + 1}/{len(todo)}] {cell_name(m, k, s)}: reward "
              f"{np.mean(rec['initial_correct']) / rec['positions']:.3f} -> "
              f"{np.mean(rec['final_correct']) / rec['positions']:.3f} ({rec['wall_s']} s)",
              file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- report
def load_cells(cells_dir: Path = CELLS_DIR) -> dict[tuple[str, int], dict[int, dict]]:
    """{(method, k): {seed: record}}."""
    out: dict[tuple[str, int], dict[int, dict]] = {}
    for f in sorted(cells_dir.glob("*.json")):
        r = json.loads(f.read_text())
        out.setdefault((r["method"], r["k"]), {})[r["seed"]] = r
    return out


def table(cell: dict[int, dict], seeds: list[int], key: str = "final_correct") -> np.ndarray:
    """[seeds, problems] greedy reward of a cell's seeds."""
    return np.asarray([np.asarray(cell[s][key], np.float64) / cell[s]["positions"]
                       for s in seeds])


def report(cells_dir: Path = CELLS_DIR, out: Path = RESULT) -> dict:
    """The verdicts by the module doc's rule, from the committed cell records."""
    cells = load_cells(cells_dir)
    if ("naive", 0) not in cells:
        raise SystemExit("no synchronous baseline (naive, k=0) yet: run the sweep first")
    found = verdicts_from_tables({key: {s: {"initial": np.asarray(r["initial_correct"]) /
                                            r["positions"],
                                            "final": np.asarray(r["final_correct"]) /
                                            r["positions"]} for s, r in cell.items()}
                                  for key, cell in cells.items()})
    rows, ks, base = found["rows"], found["ks"], cells[("naive", 0)]
    kmax = max(ks)
    lost = next((float(table(base, r["seeds"]).mean()) - r["final"] for r in rows
                 if r["method"] == "naive" and r["k"] == kmax), None)
    result = {"headline": {"metric": f"naive PPO's loss of greedy reward at k={kmax} against "
                                     "synchronous training (the same seeds)",
                           "value": None if lost is None else round(lost, 4), "target": 0.2,
                           "machine": run_machines(cells)},
              "sync_gain": found["sync_gain"],
              "rule": {"kept": KEPT, "ci": 0.95, "replicates": 4000}, "ks": ks,
              "staleness_hurts_at": found["staleness_hurts_at"], "rows": rows,
              "verdicts": found["verdicts"],
              "setup": dataclasses.asdict(SETUP),
              "command": "python -m experiments.repro.staleness_testbed report"}
    atomic_write_json(out, result)
    plot(rows, out.with_suffix(".png"))
    if out == RESULT:  # the committed result: its page and summary rows are generated from it
        regime_result = json.loads(REGIME.read_text()) if REGIME.is_file() else None
        mismatch = None
        if (MISMATCH_CELLS / f"{cell_name('naive', 0, 0)}.json").is_file():
            mismatch = report(MISMATCH_CELLS, MISMATCH_RESULT)
        PAGE.write_text(render_page(result, regime_result, mismatch))
        replace_row(README, summary_row(result, "docs/results/staleness-testbed.md"),
                    "Off-policy testbed", "Staleness ablation")
        replace_row(INDEX, summary_row(result, "staleness-testbed.md", index=True),
                    "Off-policy testbed", "Staleness ablation")
    return result


def summary_row(result: dict, link: str, index: bool = False) -> str:
    """The study's one line in the README's table (or, index: the results index's, with its
    target and verdict columns)."""
    by = {(r["method"], r["k"]): r for r in result["rows"]}
    kmax, seeds = max(result["ks"]), min(len(r["seeds"]) for r in result["rows"])
    held = {v: [LABELS[m] for m, x in result["verdicts"].items() if x == v]
            for v in ("reproduced", "partly", "not")}
    naive = by.get(("naive", kmax))
    return (f"| [Off-policy testbed]({link}) | a tiny policy on 32-token responses: naive PPO "
            f"{by[('naive', 0)]['final']:.3f} synchronous, {naive['final']:.3f} at k = {kmax} "
            f"(loses {result['headline']['value']:.3f}); held at every hurting k: "
            f"{', '.join(held['reproduced']) or 'none'}; partly: "
            f"{', '.join(held['partly']) or 'none'}; not: {', '.join(held['not']) or 'none'} "
            f"({seeds} seed(s) a cell so far, paired 95 % intervals) |") + (
        f" naive PPO loses ≥ 0.2 at the largest k | "
        f"{'met' if result['headline']['value'] >= 0.2 else 'missed'} |" if index else "")


RULE = SHARED_RULE.replace("{measure}", "greedy eval reward (the share of the 32 positions "
                           "right) on 512 held-out problems at the last step")


def render_page(result: dict, regime_result: dict | None = None,
                mismatch: dict | None = None) -> str:
    """docs/results/staleness-testbed.md from the report's JSON (and the regime search's)."""
    setup = result["setup"]
    lines = ["# Off-policy testbed: stale data on a task with power", "",
             "<!-- generated by python -m experiments.repro.staleness_testbed report from "
             "experiments/results/staleness_testbed.json (the regime search: "
             "experiments/results/staleness_testbed_regime.json; bf16 rollouts: "
             "experiments/results/staleness_testbed_mismatch.json); do not edit -->", "",
             f"A tiny policy (2 layers, d = 64) learns from scratch to write the 32 symbols of "
             f"its prompt each shifted by one ({dict(setup['task_options'])}): a 32-token "
             f"response with per-position credit. {setup['steps']} steps of "
             f"{setup['prompts_per_step']} × {setup['group_size']} samples at learning rate "
             f"{setup['learning_rate']:g} (entropy bonus {setup['entropy_coef']:g}); each cell "
             "trains with the deterministic k-stale source (step v samples with version "
             "max(v − k, 0)); the methods are `experiments.common.offpolicy_methods`'.", "",
             RULE, ""]
    if regime_result:
        lines += ["## How the regime was found", "",
                  "Naive PPO, seed 0, at two learning rates (`" + regime_result["command"] + "`):",
                  "", "| learning rate | k | greedy reward at the last step |", "|---|---|---|"]
        lines += [f"| {r['learning_rate']:g} | {r['k']} | {r['final']:.3f} |"
                  for r in regime_result["runs"]]
        lines += ["", "Both rates make stale data hurt; the preset's 1e-3 is the one the sweep "
                  "uses.", ""]
    g, lost = result["sync_gain"], result["headline"]["value"]
    lines += ["## Results", "", f"Synchronous gain G = {g:.3f}; naive PPO loses "
              f"{lost:.3f} of it at k = {max(result['ks'])} (target ≥ 0.2); staleness hurts "
              f"at k = {result['staleness_hurts_at'] or 'none'}.", "",
              *render_rows(result["rows"])]
    fewest = min((len(r["seeds"]) for r in result["rows"]), default=0)
    if fewest < 2:
        lines += ["", f"Some cells have {fewest} seed so far (the sweep runs on, seed by seed): "
                  "their intervals resample the problems only, not the seeds."]
    lines += ["", "| method | verdict |", "|---|---|"]
    lines += [f"| {LABELS[m]} | {v} |" for m, v in result["verdicts"].items()]
    lines += ["", "The exact proximal policy repairs the train/inference term of π_θ/μ "
              "(Missing Old Logits' claim); here the sampler and the learner run the same fp32 "
              "code, so π_prox at each token's own version *is* μ and the method is naive PPO "
              "up to rounding: its row measures staleness, which it does not claim to repair. "
              "Its claim needs a real discrepancy (bf16 rollouts beside the fp32 learner, "
              "`rollout.dtype`), the real-model study's mismatch suite."]
    if mismatch:
        lines += ["", "## The train/inference half: bf16 rollouts", "",
                  "The same cells with a bf16 sampler beside the fp32 learner "
                  "(`rollout.dtype = \"bfloat16\"`, `sweep --suite mismatch`): π_prox at a "
                  "token's own version is no longer μ, which is what the exact proximal "
                  "policy repairs.", "", *render_rows(mismatch["rows"])]
        lines += ["", "| method | verdict (same rule) |", "|---|---|"]
        lines += [f"| {LABELS[m]} | {v} |" for m, v in mismatch["verdicts"].items()]
        lines += ["", "![kept share against k, bf16 rollouts]"
                  "(../../experiments/results/staleness_testbed_mismatch.png)"]
    lines += ["", "![kept share against k](../../experiments/results/staleness_testbed.png)",
              "", f"Machine: {result['headline']['machine']}. Command: `{result['command']}`."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in METHODS:
        rs = sorted((r for r in rows if r["method"] == m and None not in (
            r["kept"]["value"], r["kept"]["low"], r["kept"]["high"])), key=lambda r: r["k"])
        if not rs:
            continue
        ks = [max(r["k"], 0.5) for r in rs]
        v = [r["kept"]["value"] for r in rs]
        err = [[r["kept"]["value"] - r["kept"]["low"] for r in rs],
               [r["kept"]["high"] - r["kept"]["value"] for r in rs]]
        ax.errorbar(ks, v, yerr=err, fmt="o-", color=COLORS[m], capsize=3, label=LABELS[m])
    ax.axhline(KEPT, color="k", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max staleness k (k = 0 plotted at 0.5)")
    ax.set_ylabel("share of the synchronous gain kept")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def regime(lrs: list[float], ks: list[int], setup: Setup = SETUP) -> dict:
    """The search for a regime where staleness hurts: naive PPO, seed 0, at each learning
    rate and k; the cells go to experiments/results/staleness_testbed_regime/lr<lr>/, the
    curves to staleness_testbed_regime.json."""
    out = {"setup": dataclasses.asdict(setup), "machine": machine(), "runs": [],
           "command": "python -m experiments.repro.staleness_testbed regime --lrs "
                      + " ".join(map(str, lrs)) + " --ks " + " ".join(map(str, ks))}
    for lr in lrs:
        cells = RESULTS / "staleness_testbed_regime" / f"lr{lr:g}"
        sweep(["naive"], ks, [0], None, dataclasses.replace(setup, learning_rate=lr), cells,
              WORK_DIR / "regime")
        for k in ks:
            rec = json.loads((cells / f"{cell_name('naive', k, 0)}.json").read_text())
            out["runs"].append({"learning_rate": lr, "k": k, "eval": rec["eval"],
                                "final": float(np.mean(rec["final_correct"]) / rec["positions"])})
    base = {r["learning_rate"]: r["final"] for r in out["runs"] if r["k"] == 0}
    out["headline"] = {"metric": "naive PPO's loss at the largest k (sync final - stale final)",
                       "value": round(max(base[r["learning_rate"]] - r["final"]
                                          for r in out["runs"] if r["k"] == max(ks)), 4),
                       "target": 0.2, "machine": machine()}
    atomic_write_json(REGIME, out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.repro.staleness_testbed")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep")
    s.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    s.add_argument("--ks", nargs="+", type=int, default=[0, 4, 16, 64])
    s.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    s.add_argument("--max-cells", type=int)
    s.add_argument("--suite", choices=("main", "mismatch"), default="main",
                   help="mismatch: bf16 rollouts beside the fp32 learner, naive / decoupled / "
                        "exact only (default methods), k 0 and 16, 3 seeds")
    sub.add_parser("report")
    g = sub.add_parser("regime")
    g.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3])
    g.add_argument("--ks", nargs="+", type=int, default=[0, 16, 64])
    args = p.parse_args(argv)
    if args.cmd == "sweep" and args.suite == "mismatch":
        methods = MISMATCH_METHODS if args.methods == list(METHODS) else args.methods
        sweep(methods, [0, 16] if args.ks == [0, 4, 16, 64] else args.ks,
              args.seeds[:3] if args.seeds == [0, 1, 2, 3, 4] else args.seeds, args.max_cells,
              MISMATCH, MISMATCH_CELLS, WORK_DIR / "mismatch")
    elif args.cmd == "sweep":
        sweep(args.methods, args.ks, args.seeds, args.max_cells)
    elif args.cmd == "regime":
        r = regime(args.lrs, args.ks)
        print(json.dumps([(x["learning_rate"], x["k"], round(x["final"], 3)) for x in r["runs"]]))
    else:
        r = report()
        print(json.dumps({"staleness_hurts_at": r["staleness_hurts_at"],
                          "verdicts": r["verdicts"]}, indent=1))


if __name__ == "__main__":
    main()
