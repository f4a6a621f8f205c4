"""Asynchronous RL on the real model (issue 35): held-out accuracy against staleness for
naive PPO, decoupled PPO (AReaL), M2PO and VCPO on SmolLM2-135M-Instruct, with a verdict
per paper claim.

    python -m experiments.repro.staleness_real tasks     # pick the task: base greedy accuracy
    nohup python -m experiments.repro.staleness_real sweep > staleness_real.log 2>&1 &
    python -m experiments.repro.staleness_real report    # tables, verdicts, PNGs from the runs
    python -m experiments.repro.staleness_real sweep --smoke   # the tiny model, a few steps
    python -m experiments.repro.staleness_real sweep --suite calc       # VCPO's tool-use half
    python -m experiments.repro.staleness_real sweep --suite calc-chain # its multi-call variant
    python -m experiments.repro.staleness_real sweep --suite mismatch   # bf16 rollouts (missing old logits)

`sweep` trains every (method, k, seed) cell of the grid (methods: module `methods`;
k = max staleness of the deterministic async loop, default {0, 2, 8, 32}; seeds {0, 1})
in the order of `methods.grid_order` (the synchronous baseline first, then the largest
staleness), each cell resumable (module `sweep`): stop it any time (SIGTERM / Ctrl-C
checkpoint the current cell) and run the same command again. After every cell the summary
experiments/results/staleness_real.json and its PNGs are rewritten from the records on
disk (module `report`). `--max-cells N` stops after N cells have finished in this call.

The task (module `tasks`: candidates measured by the base model's greedy accuracy, in
experiments/results/staleness_real_tasks.json) is the reasoning-gym mixture
`mix_sum_arith_legs`: chain sums of 2-3 two-digit terms, two-term 2-digit + - *
arithmetic and leg counting, in equal parts (base greedy accuracy 0.129 +- 0.021: room to
learn on three skills, where chain_sum 2x2 plateaus near 0.41 within 16 steps); 256
held-out problems of task seed 0 (the same split for every cell), strict verifier.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from experiments.common.benchmarking import RESULTS_DIR, machine, write_results
from experiments.repro.staleness_real.methods import METHODS, SweepSetup, grid_order, run_name
from experiments.repro.staleness_real.tasks import CANDIDATES, measure_candidates

NAME = "staleness_real"
RUNS_DIR = RESULTS_DIR / NAME  # one JSON record per finished cell
RESULT = RESULTS_DIR / f"{NAME}.json"
TASK = "mix_sum_arith_legs"
SMOLLM2_PARAM_BYTES = 134.5e6 * 4  # fp32 params published to a rollout device


# the tool-use half of VCPO's claim: the calculator environment (preset smollm2-calc,
# multi-turn, 64 held-out problems) at staleness {0, 8}, naive vs VCPO
CALC_RUNS_DIR = RESULTS_DIR / f"{NAME}_calc"
CALC_RESULT = RESULTS_DIR / f"{NAME}_calc.json"
CALC_SETUP = SweepSetup(task=None, task_options={}, steps=16, prompts_per_step=4, group_size=8,
                        eval_every=4, eval_prompts=64, eval_sampled_prompts=16, save_every=4,
                        preset="smollm2-calc")


# a sharper tool-use test: the calculator with one operation per call (a*b+c and 3-term
# sums need two dependent calls; base SmolLM2 greedy 0.328, the two-call kinds 0.00-0.04,
# docs/results/calculator-tool.md), up to 5 turns, 24 steps
CHAIN_RUNS_DIR = RESULTS_DIR / f"{NAME}_calc_chain"
CHAIN_RESULT = RESULTS_DIR / f"{NAME}_calc_chain.json"
CHAIN_SETUP = dataclasses.replace(
    CALC_SETUP, steps=24, task_options={"ops_per_call": 1, "shots": 2, "max_turns": 5,
                                        "max_prompt_len": 400, "max_episode_tokens": 640})

# the train/inference half of "missing old logits": the rg task with the rollouts sampled
# by a bf16 engine beside the fp32 learner (RolloutOptions.dtype), naive vs decoupled
# at staleness {0, 8}: naive PPO's old policy is then the bf16 engine's μ, decoupled PPO's
# is the learner's exact π_prox
MISMATCH_RUNS_DIR = RESULTS_DIR / f"{NAME}_mismatch"
MISMATCH_RESULT = RESULTS_DIR / f"{NAME}_mismatch.json"
MISMATCH_DTYPE = "bfloat16"
# suite -> (runs dir, summary JSON, work-dir suffix, default methods, default ks)
SUITES = {"rg": (RUNS_DIR, RESULT, "", list(METHODS), [0, 8, 32, 2]),
          "calc": (CALC_RUNS_DIR, CALC_RESULT, "_calc", ["naive", "vcpo"], [0, 8]),
          "calc-chain": (CHAIN_RUNS_DIR, CHAIN_RESULT, "_calc_chain", ["naive", "vcpo"], [0, 8]),
          "mismatch": (MISMATCH_RUNS_DIR, MISMATCH_RESULT, "_mismatch", ["naive", "decoupled"],
                       [0, 8])}


def setup_for(args) -> SweepSetup:
    """The cells' shared setup: --suite rg (the reasoning-gym task), calc, mismatch (rg
    with bf16 rollouts), or --smoke."""
    rollout_dtype = MISMATCH_DTYPE if args.suite == "mismatch" else None
    if args.smoke:
        return SweepSetup(task="synthetic", task_options={}, steps=args.steps,
                          prompts_per_step=2, group_size=4, eval_every=0, eval_prompts=8,
                          eval_sampled_prompts=4, save_every=1, preset="tiny-synthetic",
                          rollout_dtype=rollout_dtype)
    if args.suite in ("calc", "calc-chain"):
        base = CALC_SETUP if args.suite == "calc" else CHAIN_SETUP
        return dataclasses.replace(base, steps=args.steps or base.steps,
                                   eval_every=args.eval_every or base.eval_every)
    spec, options = CANDIDATES[args.task]
    return SweepSetup(task=spec, task_options=options, steps=args.steps or 40,
                      eval_every=args.eval_every or 10,
                      rollout_dtype=rollout_dtype)


def summarize(runs_dir: Path, out: Path, command: str, suite: str = "rg",
              partner_dir: Path | None = None) -> dict:
    """The summary JSON (+ PNGs beside it) from the records in runs_dir. partner_dir: the
    other half of the "missing old logits" verdict (suite rg: the mismatch suite's records;
    suite mismatch: the rg suite's, whose k = 0 cell is the fp32-rollout baseline), so both
    summaries carry the same verdicts; None: this suite's records alone."""
    from experiments.repro.staleness_real import report

    records = report.load_records(runs_dir)
    if not records:
        raise SystemExit(f"no finished cells under {runs_dir}; run the sweep first")
    rows = report.table(records)
    partner_records = report.load_records(partner_dir) if partner_dir else []
    partner = report.table(partner_records)
    # the mismatch suite's curves against the fp32-rollout synchronous cell
    ref = next((r for r in partner_records if (r["k"], r["method"], r["seed"]) == (0, "naive", 0)),
               None) if suite == "mismatch" else None
    head = report.headline(rows, machine())
    if head["value"] is None:  # incomplete grid: say so in the metric, not with a fake number
        head = {**head, "metric": head["metric"] + " [not measured yet: no VCPO or k=0 cell]",
                "value": 0.0}
    found = report.verdicts(partner, rows) if suite == "mismatch" else \
        report.verdicts(rows, partner, suite)
    summary = {
        "headline": head, "verdicts": found, "table": rows,
        "time_projection": report.time_projection(records, SMOLLM2_PARAM_BYTES),
        "cells_finished": sorted(run_name(r["method"], r["k"], r["seed"]) for r in records),
        "task": {"spec": records[0]["run_config"]["task"]["spec"],
                 "options": records[0]["run_config"]["task"]["options"],
                 "task_seed": records[0]["run_config"]["task"]["seed"],
                 "held_out": records[0]["run_config"]["loop"]["eval_prompts"],
                 "verifier": records[0]["run_config"]["reward"]["verifier"]},
        "command": command, "machine": machine(),
    }
    summary["plots"] = [p.name for p in report.plot(
        records, rows, out.with_suffix(""),
        None if ref is None else ("synchronous, fp32 rollouts (k=0)", ref))]
    write_results(out, summary)
    return summary


def print_summary(summary: dict) -> None:
    print(f"{'k':>3} {'method':<10} {'final acc (mean, min..max)':<30} {'ESS med':>8} "
          f"{'clip':>6} {'masked':>7} {'lr scale':>8} {'step s':>7}")
    for r in summary["table"]:
        f = r["final_accuracy"]
        masked = r["m2po_masked_frac_median"] or r["behav_rejected_frac_median"] or 0.0
        print(f"{r['k']:>3} {r['method']:<10} {f['mean']:.3f} ({f['min']:.3f}..{f['max']:.3f}) "
              f"n={len(r['seeds'])}{'':<7} {r['ess_median'] or float('nan'):>8.3f} "
              f"{r['clip_frac_median'] or 0.0:>6.3f} {masked:>7.3f} "
              f"{r['lr_scale_median'] or 1.0:>8.3f} {r['step_s_median'] or float('nan'):>7.1f}")
    for name, v in summary["verdicts"].items():
        print(f"{name}: {v['verdict']} -- {v['numbers']}")
    tp = summary.get("time_projection") or {}
    if tp:
        print(f"projected async speedup on separate devices: {tp['projected_speedup']}x "
              f"(rollout {tp['rollout_s_median']} s, train {tp['train_s_median']} s, swap {tp['swap_s']} s)")


def run_sweep(args, command: str) -> None:
    from tqdm.auto import tqdm

    from experiments.common.staleness_cells import finish_cell, record_path, run_cell
    from rl.runtime.preemption import Preempted

    runs_dir, work_dir = Path(args.runs_dir), Path(args.work_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    setup = setup_for(args)
    grid = grid_order(args.methods, args.ks, args.seeds, [max(args.ks)])
    todo = [c for c in grid if not record_path(runs_dir, *c).exists()]
    bar = tqdm(total=len(grid), initial=len(grid) - len(todo), desc=NAME, dynamic_ncols=True)
    finished = 0
    for cell in todo:
        name = run_name(*cell)

        def on_step(rec, name=name):
            bar.set_postfix_str(f"{name} step {rec['step']}/{setup.steps} "
                                f"reward {rec['reward_mean']:.3f}", refresh=True)

        try:
            run_dir, wall = run_cell(setup, *cell, work_dir, on_step=on_step)
        except Preempted:
            bar.write(f"{name}: stopped and checkpointed; run the same command to continue")
            sys.exit(0)
        rec = finish_cell(setup, cell, run_dir, wall, runs_dir, command)
        bar.update(1)
        bar.write(f"{name}: final greedy accuracy {rec['final_accuracy']:.3f} "
                  f"(from {rec['initial_accuracy']:.3f}; {wall / 60:.1f} min)")
        summarize(runs_dir, Path(args.out), command, args.suite, args.partner_dir)
        finished += 1
        if args.max_cells and finished >= args.max_cells:
            break
    bar.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m experiments.repro.{NAME}",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tasks", help="base model greedy accuracy on the candidate tasks")
    t.add_argument("names", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES))
    s = sub.add_parser("sweep", help="train the grid (resumable), then report")
    s.add_argument("--suite", choices=tuple(SUITES), default="rg",
                   help="rg: the reasoning-gym task (default grid: 4 methods x k 0 8 32 2); "
                        "calc: the calculator tool (naive and vcpo x k 0 8, 16 steps); "
                        "calc-chain: its one-operation-per-call variant (24 steps); "
                        "mismatch: rg with bf16 rollouts beside the fp32 learner (naive and "
                        "decoupled x k 0 8)")
    s.add_argument("--methods", nargs="+", choices=METHODS)
    s.add_argument("--ks", nargs="+", type=int,
                   help="max staleness levels, in the order their first seed runs")
    s.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    s.add_argument("--steps", type=int, default=0, help="0: the suite's (rg 40, calc 16)")
    s.add_argument("--eval-every", type=int, default=0, help="0: the suite's (rg 10, calc 4)")
    s.add_argument("--task", default=TASK, choices=list(CANDIDATES))
    s.add_argument("--max-cells", type=int, default=0, help="stop after N cells (0: all)")
    s.add_argument("--smoke", action="store_true",
                   help="the tiny random model on the synthetic task (tests, a dry run)")
    r = sub.add_parser("report", help="summarise the finished cells")
    r.add_argument("--suite", choices=tuple(SUITES), default="rg")
    for q in (s, r):
        q.add_argument("--runs-dir", help="one JSON per finished cell (default: the suite's)")
        q.add_argument("--out", help="summary JSON, PNGs beside it (default: the suite's)")
    s.add_argument("--work-dir", help="the cells' run dirs (default runs/staleness_real"
                                      "[_calc|_calc_chain|_mismatch])")
    args = p.parse_args(argv)
    if args.command != "tasks":
        runs_dir, out, suffix, methods, ks = SUITES[args.suite]
        partner = {"rg": MISMATCH_RUNS_DIR, "mismatch": RUNS_DIR}.get(args.suite)
        # the other suite's records join the verdicts only when both are the defaults
        args.partner_dir = partner if args.runs_dir is None and partner is not None \
            and partner.is_dir() else None
        args.runs_dir = args.runs_dir or str(runs_dir)
        args.out = args.out or str(out)
    if args.command == "sweep":
        args.work_dir = args.work_dir or f"runs/{NAME}{suffix}"
        args.methods = args.methods or methods
        args.ks = args.ks or ks
    command = f"python -m experiments.repro.{NAME} " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.command == "tasks":
        measure_candidates(args.names or list(CANDIDATES))
        return
    if args.command == "sweep":
        run_sweep(args, command.strip())
    print_summary(summarize(Path(args.runs_dir), Path(args.out), command.strip(), args.suite,
                            args.partner_dir))
