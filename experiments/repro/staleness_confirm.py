"""The real-model confirmation of the off-policy verdicts: SmolLM2-135M-Instruct where
synchronous GRPO moves (reasoning-gym chain_sum, the smollm2-rg preset's learner), 512
held-out problems, 3 seeds a cell, the toy testbed's rule.

    nohup python -m experiments.repro.staleness_confirm sweep > confirm.log 2>&1 &   # resumable
    python -m experiments.repro.staleness_confirm report    # JSON, PNG, page, README / index rows
    python -m experiments.repro.staleness_confirm sweep --smoke --runs-dir D --work-dir W

Why this regime: the smollm2-rg preset (chain_sum, two terms of 1-2 digits; AdamW 2e-5,
PPO-clip 0.2 / 0.28, 8 prompts x 8 samples) moves greedy accuracy 0.17 -> 0.41 on every
seed (docs/results/smollm2-rg.md), where the earlier real-model study's mixture moved
+0.05 in 40 steps and so could not tell a method that keeps the gain from one that loses
it. The verifier is strict (full credit only; on this task its base accuracy, 0.168, is
the dataset score's 0.170 to within a problem, experiments/results/staleness_real_tasks.json).

Every cell (method, staleness k, seed) trains SETUP.steps steps with the deterministic
k-stale source (step v samples with version max(v - k, 0)): at k = 8 a third of the run is
the version-0 warm-up and 16 steps train on data exactly 8 versions old. The methods are
experiments.common.offpolicy_methods'. A finished cell's record (its curves and every
held-out problem's greedy correctness at the initial and final evals, read from the run's
eval_problems.jsonl) goes to experiments/results/staleness_confirm/<method>_k<k>_s<seed>.json;
a cell with a record is skipped and an unfinished one resumes from its last checkpoint, so a
stopped sweep continues when the command is run again.

The order is the one that decides first: the synchronous baseline and naive PPO at k = 8,
seed by seed (whether staleness hurts at all is the question every correction's verdict
hangs on), then the corrections at k = 8, seed by seed. A correction's cell starts only if
the finished naive cells show staleness hurting at its k (the rule judges corrections only
there: elsewhere every verdict is "untested" whatever they score); `--force` runs them anyway.

The rule is the testbed's (experiments.common.offpolicy_verdicts, written on
docs/results/staleness-confirm.md before any cell ran): kept(m, k) = (m at k - initial) /
(sync - initial); staleness hurts at k when naive PPO's kept share has its 95 % interval
below 0.8; m holds at k when kept(m, k) >= 0.8 and the paired interval of (m - naive PPO)
lies above 0; reproduced / partly / not / untested from that.

Pilots of other learning rates, run lengths or k (`sweep --seeds 100 --methods naive
[--learning-rate R] [--steps N --k K]` into experiments/results/staleness_confirm_pilot/<folder>/)
never enter the verdicts: the report
puts each beside the study's cells in a table of the regimes tried (synchronous gain, naive
PPO's kept share at k and its paired difference, entropy and response length late in the
run; regime_row), so the page says how far the search for a regime where staleness hurts went.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from experiments.common.docs_rows import replace_row
from experiments.common.offpolicy_methods import LABELS, METHODS
from experiments.common.offpolicy_verdicts import (
    KEPT,
    RULE,
    fmt,
    render_rows,
    run_machines,
    verdicts_from_tables,
)
from experiments.common.paired import problem_results
from experiments.common.staleness_cells import SweepSetup, run_name
from rl.run import PRESETS
from rl.runtime.host import machine
from rl.runtime.logging import atomic_write_json

NAME = "staleness_confirm"
RESULTS = Path("experiments/results")
CELLS_DIR = RESULTS / NAME
# pilots of other learning rates (seed 100, outside the verdict seeds): one folder a rate
PILOTS_DIR = RESULTS / f"{NAME}_pilot"
RESULT = RESULTS / f"{NAME}.json"
PAGE = Path("docs/results/staleness-confirm.md")
README, INDEX = Path("README.md"), Path("docs/results/index.md")
WORK_DIR = Path("runs") / NAME
# the smollm2-rg preset's own task: chain_sum, two terms of 1-2 digits
SPEC, OPTIONS = PRESETS["smollm2-rg"].task.spec, dict(PRESETS["smollm2-rg"].task.kwargs)
SETUP = SweepSetup(task=SPEC, task_options=OPTIONS, steps=24, prompts_per_step=8,
                   group_size=8, eval_every=24, eval_prompts=512, eval_sampled_prompts=8,
                   save_every=4)
K = 8
SEEDS = (0, 1, 2)
CORRECTIONS = ("decoupled", "m2po", "icepop", "truncated_is", "vcpo")
COMMAND = f"python -m experiments.repro.{NAME}"


def grid(seeds=SEEDS, k: int = K, corrections=CORRECTIONS) -> list[tuple[str, int, int]]:
    """Cells in the order that decides first (module doc)."""
    first = [c for s in seeds for c in (("naive", 0, s), ("naive", k, s))]
    return first + [(m, k, s) for s in seeds for m in corrections]


def cell_record(setup: SweepSetup, cell: tuple[str, int, int], run_dir: Path, wall_s: float
                ) -> dict:
    """The staleness sweep's record of a finished cell plus each held-out problem's greedy
    correctness (0/1 under the strict verifier) at the initial and final evals."""
    from experiments.common.staleness_cells import cell_record as curves_record

    rec = curves_record(setup, *cell, run_dir, wall_s, f"{COMMAND} sweep")
    res = problem_results(run_dir)
    first, last = min(res), max(res)
    for name, step in (("initial", first), ("final", last)):
        probs = res[step]["greedy"]
        rec[f"{name}_step"] = step
        rec[f"{name}_correct"] = [probs[i] for i in sorted(probs)]
    rec["problem_index"] = sorted(res[last]["greedy"])
    return rec


def staleness_hurts(cells_dir: Path, k: int) -> bool:
    """Whether the rule finds that staleness hurts naive PPO at k on the finished cells
    (False without the synchronous baseline or naive PPO at k)."""
    cells = load_tables(cells_dir)
    if ("naive", 0) not in cells or ("naive", k) not in cells:
        return False
    return k in verdicts_from_tables(cells)["staleness_hurts_at"]


def sweep(cells: list[tuple[str, int, int]], max_cells: int | None, setup: SweepSetup = SETUP,
          cells_dir: Path = CELLS_DIR, work_dir: Path = WORK_DIR, force: bool = False) -> None:
    """Train every missing cell of `cells` in order (resuming an unfinished one); into the
    committed cells dir, the report (JSON, PNG, page, rows) is rewritten after each cell.
    A correction's cell starts only where the finished naive cells show staleness hurting
    (module doc; force: run it anyway)."""
    from experiments.common.staleness_cells import run_cell
    from rl.runtime.preemption import Preempted

    cells_dir.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if not (cells_dir / f"{run_name(*c)}.json").is_file()]
    for i, cell in enumerate(todo[:max_cells]):
        if cell[0] != "naive" and not force and not staleness_hurts(cells_dir, cell[1]):
            print(f"naive PPO is not hurt at k = {cell[1]} on the finished seeds: no loss for "
                  f"{cell[0]} and the other corrections to repair, so their cells are not run "
                  "(the rule judges them only where staleness hurts; --force runs them)",
                  file=sys.stderr, flush=True)
            return
        try:
            run_dir, wall = run_cell(setup, *cell, work_dir)
        except Preempted:
            print(f"{run_name(*cell)}: stopped and checkpointed; run the same command to "
                  "continue", file=sys.stderr, flush=True)
            sys.exit(0)
        rec = cell_record(setup, cell, run_dir, wall)
        atomic_write_json(cells_dir / f"{run_name(*cell)}.json", rec)
        for folder in ("checkpoints", "snapshots"):
            shutil.rmtree(run_dir / folder, ignore_errors=True)
        print(f"[{i + 1}/{len(todo)}] {run_name(*cell)}: greedy accuracy "
              f"{np.mean(rec['initial_correct']):.3f} -> {np.mean(rec['final_correct']):.3f} "
              f"({wall / 60:.1f} min)", file=sys.stderr, flush=True)
        if cells_dir == CELLS_DIR:  # the committed summary stays current cell by cell
            report()


# ----------------------------------------------------------------------------- report
def load_tables(cells_dir: Path = CELLS_DIR) -> dict[tuple[str, int], dict[int, dict]]:
    """{(method, k): {seed: {"initial": [problems], "final": [problems]}}} of the records."""
    out: dict[tuple[str, int], dict[int, dict]] = {}
    for f in sorted(cells_dir.glob("*.json")):
        r = json.loads(f.read_text())
        out.setdefault((r["method"], r["k"]), {})[r["seed"]] = {
            "initial": np.asarray(r["initial_correct"], np.float64),
            "final": np.asarray(r["final_correct"], np.float64), "record": r}
    return out


def report(cells_dir: Path = CELLS_DIR, out: Path = RESULT, page: bool = True) -> dict:
    """The verdicts by the rule (module doc) from the cell records; with page: the docs page
    and the README / results-index rows are rewritten from the JSON."""
    cells = load_tables(cells_dir)
    found = verdicts_from_tables(cells) if ("naive", 0) in cells else None
    ran_on = run_machines({key: {s: c["record"] for s, c in cell.items()}
                           for key, cell in cells.items()}) or machine()
    result = {"headline": headline(found, ran_on), "setup": dataclasses.asdict(SETUP), "k": K,
              "seeds_planned": list(SEEDS), "cells_planned": [run_name(*c) for c in grid()],
              "cells_finished": sorted(run_name(m, k, s) for (m, k), c in cells.items()
                                       for s in c),
              "rule": {"kept": KEPT, "ci": 0.95, "replicates": 4000},
              "command": f"{COMMAND} report", "machine": ran_on, **(found or {}),
              "regimes": [r for r in [regime_row(cells, "the study's cells")] if r] +
              (pilots(PILOTS_DIR) if page else [])}
    atomic_write_json(out, result)
    if found:
        plot(cells, result, out.with_suffix(".png"))
    if page:
        PAGE.write_text(render_page(result))
        if found:
            replace_row(README, summary_row(result, "docs/results/staleness-confirm.md"),
                        "Off-policy on SmolLM2", "Off-policy testbed")
            replace_row(INDEX, summary_row(result, "staleness-confirm.md", index=True),
                        "Off-policy on SmolLM2", "Off-policy testbed")
    return result


# the policy's state late in a run: the mean of each train metric over its last steps
LATE_STEPS = 4
LATE_KEYS = ("entropy", "response_len", "reward_mean")


def late_means(record: dict, steps: int = LATE_STEPS) -> dict[str, float]:
    """{metric: mean over the record's last `steps` train steps} for LATE_KEYS."""
    keys, rows = record["train_keys"], record["train"][-steps:]
    return {key: float(np.mean([r[keys.index(key)] for r in rows])) for key in LATE_KEYS}


def regime_row(cells: dict[tuple[str, int], dict[int, dict]], name: str) -> dict | None:
    """Naive PPO at k = 0 and its largest k > 0 on the seeds both ran (k = 0 alone, k None,
    when there is no such cell; None without k = 0): the steps, the
    learning rate (from the records' run config), the synchronous gain, naive PPO's kept
    share at k and the paired (k) − (k = 0) difference over seeds and problems, the
    policy's entropy at the first step and both runs' late train metrics (means over
    seeds)."""
    from experiments.common.paired import gain_kept, paired_bootstrap

    k = max([k for m, k in cells if m == "naive" and k > 0], default=None)
    base, stale = cells.get(("naive", 0), {}), cells.get(("naive", k), {}) if k else {}
    seeds = sorted(set(base) & set(stale)) if stale else sorted(base)
    if not seeds:
        return None
    sides = (("sync", base), ("stale", stale)) if stale else (("sync", base),)
    table = lambda cell, key: np.asarray([cell[s][key] for s in seeds])  # noqa: E731
    init, sync = table(base, "initial"), table(base, "final")
    rates = {cell[s]["record"]["run_config"]["train"]["optimizer"]["learning_rate"]
             for _, cell in sides for s in seeds}
    if len(rates) != 1:
        raise ValueError(f"{name}: naive PPO's cells ran at different rates {sorted(rates)}")
    late = {side: {key: float(np.mean([late_means(cell[s]["record"])[key] for s in seeds]))
                   for key in LATE_KEYS} for side, cell in sides}
    entropy = base[seeds[0]]["record"]["train_keys"].index("entropy")
    row = {"name": name, "learning_rate": rates.pop(), "seeds": seeds, "k": k,
           "steps": int(base[seeds[0]]["record"]["steps"]),
           "initial_entropy": float(np.mean([base[s]["record"]["train"][0][entropy]
                                              for s in seeds])),
           "initial": float(init.mean()), "sync_final": float(sync.mean()),
           "sync_gain": float(sync.mean() - init.mean()), "late": late,
           "stale_final": None, "kept": None, "stale_minus_sync": None}
    if stale:
        mine = table(stale, "final")
        row.update(stale_final=float(mine.mean()), kept=gain_kept(mine, sync, init).as_dict(),
                   stale_minus_sync=paired_bootstrap(mine, sync).as_dict())
    return row


def pilots(pilots_dir: Path) -> list[dict]:
    """regime_row of every pilot folder (one learning rate each) that holds both cells,
    by rate."""
    rows = [regime_row(load_tables(f), f.name) for f in sorted(pilots_dir.glob("*"))
            if f.is_dir()]
    return sorted((r for r in rows if r), key=lambda r: r["learning_rate"])


def headline(found: dict | None, ran_on: str) -> dict:
    """The synchronous gain (target >= +0.20) until naive PPO's k = 8 cell exists, then
    naive PPO's loss at k = 8 against synchronous training."""
    if not found:
        return {"metric": "synchronous greedy-accuracy gain (no cell finished yet)",
                "value": 0.0, "target": 0.2, "machine": ran_on}
    return {"metric": "synchronous GRPO's greedy-accuracy gain on 512 held-out chain_sum "
                      "problems (mean over seeds)", "value": found["sync_gain"],
            "target": 0.2, "machine": ran_on}


def summary_row(result: dict, link: str, index: bool = False) -> str:
    """The study's one line in the README's table (index: with target and verdict columns)."""
    by = {(r["method"], r["k"]): r for r in result["rows"]}
    naive = by.get(("naive", K))
    seeds = min(len(r["seeds"]) for r in result["rows"])
    stale = (f"naive PPO at k = {K} keeps {naive['kept']['value']:.2f} of it "
             f"[{naive['kept']['low']:.2f}, {naive['kept']['high']:.2f}]" if naive and
             naive["kept"]["value"] is not None else f"k = {K} not run yet")
    verdicts = "; ".join(f"{LABELS[m]}: {v}" for m, v in result["verdicts"].items()) or \
        "no correction run yet"
    g = result["sync_gain"]
    return (f"| [Off-policy on SmolLM2]({link}) | chain_sum, 512 problems: synchronous GRPO "
            f"gains {g:+.3f}; {stale}; {verdicts} ({seeds} seed(s) a cell so far, paired 95 % "
            f"intervals) |") + (
        f" sync gain ≥ +0.20, ≥ 3 seeds a cell | "
        f"{'met' if g >= 0.2 and seeds >= 3 else 'missed' if seeds >= 3 else 'running'} |"
        if index else "")


def render_page(result: dict) -> str:
    """docs/results/staleness-confirm.md from the report's JSON."""
    s = result["setup"]
    lines = ["# Off-policy corrections on SmolLM2: the real-model confirmation", "",
             f"<!-- generated by {COMMAND} report from experiments/results/{NAME}.json; "
             "do not edit -->", "",
             "SmolLM2-135M-Instruct, GRPO with the `smollm2-rg` preset's learner (AdamW 2e-5, "
             "PPO-clip 0.2 / 0.28, token-mean, temperature 0.8) on reasoning-gym `chain_sum` "
             f"(two terms of 1-2 digits), where synchronous training moves: {s['steps']} steps "
             f"of {s['prompts_per_step']} prompts × {s['group_size']} samples, greedy accuracy "
             f"on {s['eval_prompts']} held-out problems (strict verifier) at step 0 and step "
             f"{s['steps']}. Each cell trains with the deterministic k-stale source (step v "
             f"samples with version max(v − k, 0)); at k = {result['k']} the first "
             f"{result['k']} steps are the version-0 warm-up and the other "
             f"{s['steps'] - result['k']} train on data exactly {result['k']} versions old.",
             "", "**Commands**", "", "```bash",
             f"nohup {COMMAND} sweep > confirm.log 2>&1 &   # resumable; ~25 min a cell on 2 cores",
             f"{COMMAND} report", "```", "",
             "The order decides first: the synchronous run and naive PPO at k = "
             f"{result['k']}, seed by seed, then the corrections ("
             + ", ".join(LABELS[m] for m in CORRECTIONS) + "), which start only if the "
             f"finished naive cells show staleness hurting at k = {result['k']}: the rule "
             "judges a correction nowhere else (`--force` runs them anyway). This gate was "
             "added after 3 of the 6 naive cells had finished; the rule itself is unchanged.",
             "",
             RULE.replace("{measure}", f"greedy accuracy on the {s['eval_prompts']} held-out "
                          "problems at the last step"), ""]
    if not result.get("rows"):
        lines += ["## Results", "", "No cell has finished yet; this page is regenerated after "
                  "the runs, with the rule above unchanged.", ""]
    else:
        lines += ["## Results", "",
                  f"Synchronous gain G = {result['sync_gain']:+.3f} (target ≥ +0.20); "
                  f"staleness hurts at k = {result['staleness_hurts_at'] or 'none'}.", "",
                  *render_rows(result["rows"], "final greedy accuracy"), "",
                  "| method | verdict |", "|---|---|"]
        lines += [f"| {LABELS[m]} | {v} |" for m, v in result["verdicts"].items()]
        missing = [c for c in result["cells_planned"] if c not in result["cells_finished"]]
        if missing:
            lines += ["", f"Not run yet ({len(missing)} of {len(result['cells_planned'])} "
                      f"cells): {', '.join(missing)}. Cells with one seed resample the "
                      "problems only, not the seeds."]
        lines += ["", f"![greedy accuracy per cell](../../experiments/results/{NAME}.png)"]
    lines += render_regimes(result.get("regimes") or [])
    lines += ["", f"Cells: experiments/results/{NAME}/ (the study's), "
              f"experiments/results/{NAME}_pilot/ (the pilots), one JSON a cell with its run "
              "config, curves and per-problem results.", "",
              f"Machine: {result['machine']}. Command: `{result['command']}`."]
    return "\n".join(lines) + "\n"


def render_regimes(rows: list[dict]) -> list[str]:
    """The page's section on the regimes tried: one table line per regime row (learning
    rate, steps, k), and what they show, computed from the rows."""
    if not rows:
        return []
    lines = ["", "## Where staleness could hurt: the regimes tried", "",
             "Naive PPO at k = 0 (synchronous) and at a stale k, at the preset's rate (the "
             "study's cells) and in pilots of other rates, run lengths or k (one seed, 100, "
             f"outside the verdict seeds; `{COMMAND} sweep --seeds 100 --methods naive "
             "[--learning-rate R] [--steps N --k K] --runs-dir "
             f"experiments/results/{NAME}_pilot/NAME --work-dir W`). Intervals are paired over "
             "the eval problems (and seeds where there are several); *late* is the mean over "
             f"the last {LATE_STEPS} train steps.", "",
             "| regime: rate, steps, k | seeds | initial | synchronous final (gain) | stale "
             "final | kept share of the gain [95 % CI] | stale − synchronous [95 % CI] | "
             "entropy: step 1 → late, sync / stale | late response tokens, sync / stale | "
             "late batch reward, sync / stale |", "|---|---|---|---|---|---|---|---|---|---|"]

    def pair(late: dict, key: str, spec: str) -> str:
        return " / ".join("–" if side not in late else format(late[side][key], spec)
                          for side in ("sync", "stale"))

    def label(r: dict) -> str:
        return (f"{r['learning_rate']:g}, {r['steps']}, {'–' if r['k'] is None else r['k']} "
                f"({r['name']})")

    for r in rows:
        stale = "–" if r["stale_final"] is None else f"{r['stale_final']:.3f}"
        lines.append(
            f"| {label(r)} | {len(r['seeds'])} | {r['initial']:.3f} | "
            f"{r['sync_final']:.3f} ({r['sync_gain']:+.3f}) | {stale} | {fmt(r['kept'])} | "
            f"{fmt(r['stale_minus_sync'])} | {r['initial_entropy']:.2f} → "
            f"{pair(r['late'], 'entropy', '.2f')} | {pair(r['late'], 'response_len', '.1f')} | "
            f"{pair(r['late'], 'reward_mean', '.2f')} |")
    both = [r for r in rows if r["stale_minus_sync"]]
    below = [r for r in both if (r["stale_minus_sync"]["high"] or 0) < 0]
    above = [r for r in both if (r["stale_minus_sync"]["low"] or 0) > 0]
    collapse = [r for r in both if r["late"]["sync"]["entropy"] < r["late"]["stale"]["entropy"]
                and r["late"]["sync"]["response_len"] < r["late"]["stale"]["response_len"]]
    weak = [r for r in rows if r["sync_gain"] < 0.2]
    names = lambda rs: ", ".join(r["name"] for r in rs)  # noqa: E731
    lines += ["", f"- Stale data ended below synchronous training in {len(below)} of the "
              f"{len(both)} regimes with both cells" + (f" ({names(below)})" if below else "")
              + f" and above it in {len(above)}" + (f" ({names(above)})" if above else "")
              + " (paired intervals that exclude 0). "
              + ("A regime where stale data ends below is a candidate only: a verdict needs "
                 "its cells at 3 seeds." if below else
                 "No regime tried is one where staleness hurts, so every correction's "
                 "verdict here stays *untested*."),
              f"- Synchronous training gained less than the +0.20 a verdict needs in "
              f"{len(weak)} of {len(rows)} regimes" + (f" ({names(weak)})" if weak else "") + ".",
              f"- In {len(collapse)} of the {len(both)} regimes with both cells the synchronous "
              "policy's entropy fell further than the stale one's and its responses grew "
              "shorter. Our reading (not tested apart): with stale data the policy moves more "
              "slowly, and at the last step that slower policy answers more held-out problems "
              "greedily; stale data damps the collapse onto short answers rather than "
              "misleading the update.",
              "- What would give a regime where staleness hurts: k comparable to the time the "
              "policy takes to settle and a run long enough after it (as on the toy testbed, "
              "whose largest k is a sixth of its run, on its own page); at this model's cost "
              "on 2 cores such a grid of 3 seeds does not fit a session, and runs/ does not "
              "survive between sessions."]
    return lines


def plot(cells: dict, result: dict, path: Path) -> None:
    """Initial and final greedy accuracy of every cell, one dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    rows = result["rows"]
    for i, r in enumerate(rows):
        cell = cells[(r["method"], r["k"])]
        finals = [float(cell[s]["final"].mean()) for s in r["seeds"]]
        ax.scatter([i] * len(finals), finals, color="tab:blue", s=18, zorder=3)
        ax.hlines(np.mean(finals), i - 0.3, i + 0.3, color="tab:blue")
    init = float(np.mean([c["initial"].mean() for c in cells[("naive", 0)].values()]))
    ax.axhline(init, color="k", ls=":", lw=0.8, label="initial policy")
    ax.set_xticks(range(len(rows)), [f"{r['method']}\nk={r['k']}" for r in rows], fontsize=7)
    ax.set_ylabel(f"greedy accuracy ({result['setup']['eval_prompts']} problems)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def smoke_setup(steps: int = 2) -> SweepSetup:
    """The tiny model on the synthetic task: the whole path in seconds (tests)."""
    return SweepSetup(task="synthetic", task_options={}, steps=steps, prompts_per_step=2,
                      group_size=4, eval_every=steps, eval_prompts=8, eval_sampled_prompts=4,
                      save_every=1, preset="tiny-synthetic")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="train the missing cells in order (resumable)")
    s.add_argument("--methods", nargs="+", choices=METHODS,
                   help="only these methods' cells (default: the whole grid, in order)")
    s.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    s.add_argument("--max-cells", type=int)
    s.add_argument("--smoke", action="store_true", help="the tiny model, 2 steps a cell")
    s.add_argument("--force", action="store_true",
                   help="run the corrections' cells even where staleness does not hurt")
    s.add_argument("--learning-rate", type=float,
                   help="the learner's peak rate instead of the preset's (a pilot of another "
                        "regime: give it its own --runs-dir and --work-dir)")
    s.add_argument("--steps", type=int,
                   help="train steps a cell instead of the study's (a pilot: its own --runs-dir)")
    s.add_argument("--k", type=int, default=K,
                   help="the stale cells' k instead of the study's (a pilot: its own --runs-dir)")
    s.add_argument("--runs-dir", default=str(CELLS_DIR))
    s.add_argument("--work-dir", default=str(WORK_DIR))
    r = sub.add_parser("report")
    r.add_argument("--runs-dir", default=str(CELLS_DIR))
    args = p.parse_args(argv)
    if args.cmd == "sweep":
        cells = [c for c in grid(args.seeds, args.k)
                 if not args.methods or c[0] in args.methods]
        setup = smoke_setup() if args.smoke else SETUP
        other = [f for f, on in (("--learning-rate", args.learning_rate is not None),
                                 ("--steps", args.steps is not None), ("--k", args.k != K)) if on]
        if other and Path(args.runs_dir) == CELLS_DIR:
            p.error(f"{' and '.join(other)} give another regime: give it its own --runs-dir "
                    "(the committed cells are the study's)")
        if args.learning_rate is not None:
            setup = dataclasses.replace(setup, learning_rate=args.learning_rate)
        if args.steps is not None:
            if not args.k < args.steps:
                p.error(f"--k {args.k} must be below --steps {args.steps}")
            setup = dataclasses.replace(setup, steps=args.steps, eval_every=args.steps)
        sweep(cells, args.max_cells, setup, Path(args.runs_dir), Path(args.work_dir), args.force)
    else:
        out = report(Path(args.runs_dir)) if Path(args.runs_dir) == CELLS_DIR else \
            report(Path(args.runs_dir), Path(args.runs_dir) / "summary.json", page=False)
        print(json.dumps({k: out.get(k) for k in ("sync_gain", "staleness_hurts_at",
                                                   "verdicts")}, indent=1))


if __name__ == "__main__":
    main()
