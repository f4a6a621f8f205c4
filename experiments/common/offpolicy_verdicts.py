"""The off-policy studies' verdict rule, one definition for the toy testbed
(experiments/repro/staleness_testbed) and the real-model confirmation
(experiments/repro/staleness_confirm), written on their pages before their runs.

    found = verdicts_from_tables(cells)   # cells: {(method, k): {seed: {"initial", "final"}}}
    found["rows"], found["verdicts"], found["staleness_hurts_at"], found["sync_gain"]

Each cell's "initial" and "final" are [problems] float arrays: every held-out problem's
measure at the initial and the last eval of that seed's run (the same problems, in the same
order, in every cell). Tables are [seeds, problems], paired by seed and problem
(experiments.common.paired: 4000 bootstrap replicates drawing seeds and problems).

  G            the synchronous gain: naive PPO at k = 0 minus the initial policy
  kept(m, k)   (m at k − initial) / G, with its CI
  staleness hurts at k   when naive PPO's kept share at k has its CI below KEPT
  m holds at k when kept(m, k) >= KEPT and the paired CI of (m − naive) at k lies above 0
  verdict      reproduced: m holds at every k where staleness hurts; partly: at some;
               not: at none (and "untested" where staleness hurts nowhere)
"""
from __future__ import annotations

import numpy as np

from experiments.common.offpolicy_methods import LABELS, METHODS
from experiments.common.paired import gain_kept, paired_bootstrap

KEPT = 0.8  # the share of the synchronous gain a method must keep to hold

RULE = """The rule, fixed before the runs (`experiments.common.offpolicy_verdicts`): the
measure is the {measure};
every comparison is paired by seed and problem, with a 95 % bootstrap interval over both
(4000 replicates, `experiments.common.paired`).

- **G**, the synchronous gain: naive PPO at k = 0 minus the initial policy.
- **kept(m, k)** = (m at k − initial) / G.
- **Staleness hurts at k** when naive PPO's kept share at k has its interval below 0.8.
- **m holds at k** when kept(m, k) ≥ 0.8 and the paired interval of (m − naive PPO) at k
  lies above 0.
- **Verdict**: *reproduced* when m holds at every k where staleness hurts, *partly* at
  some of them, *not* at none; *untested* where staleness hurts nowhere."""


def _table(cell: dict[int, dict], seeds: list[int], key: str) -> np.ndarray:
    return np.asarray([np.asarray(cell[s][key], np.float64) for s in seeds])


def _below(x, bound) -> bool:  # an undefined statistic (no gain to keep) decides nothing
    return x is not None and x < bound


def verdicts_from_tables(cells: dict[tuple[str, int], dict[int, dict]]) -> dict:
    """Rows (method, k, seeds, final mean, kept share, − naive PPO) and the verdicts by the
    module doc's rule; ValueError without the synchronous baseline (naive, 0)."""
    if ("naive", 0) not in cells:
        raise ValueError("no synchronous baseline (naive PPO at k = 0) among the cells")
    base = cells[("naive", 0)]
    rows = []
    for (m, k), cell in sorted(cells.items(), key=lambda c: (c[0][1], METHODS.index(c[0][0]))):
        seeds = sorted(set(cell) & set(base))
        if not seeds:
            continue
        init, sync = _table(base, seeds, "initial"), _table(base, seeds, "final")
        mine = _table(cell, seeds, "final")
        row = {"method": m, "k": k, "seeds": seeds, "final": float(mine.mean()),
               "kept": gain_kept(mine, sync, init).as_dict()}
        naive = cells.get(("naive", k), {})
        both = sorted(set(seeds) & set(naive))
        if m != "naive" and both:
            row["vs_naive"] = paired_bootstrap(_table(cell, both, "final"),
                                               _table(naive, both, "final")).as_dict()
        rows.append(row)
    hurts = {r["k"] for r in rows if r["method"] == "naive" and r["k"] > 0
             and _below(r["kept"]["high"], KEPT)}
    verdicts = {}
    for m in METHODS:
        if m == "naive" or not any(r["method"] == m for r in rows):
            continue
        tested = {r["k"] for r in rows if r["method"] == m and r["k"] in hurts}
        held = {r["k"] for r in rows if r["method"] == m and r["k"] in hurts
                and r["kept"]["value"] is not None and not _below(r["kept"]["value"], KEPT)
                and r.get("vs_naive", {}).get("low") is not None
                and not _below(r["vs_naive"]["low"], 1e-12)}
        verdicts[m] = ("untested" if not tested else "reproduced" if held == tested and
                       tested == hurts else "partly" if held else "not")
    every = sorted(base)
    g = float(_table(base, every, "final").mean() - _table(base, every, "initial").mean())
    return {"sync_gain": round(g, 4), "ks": sorted({k for _, k in cells}),
            "staleness_hurts_at": sorted(hurts), "rows": rows, "verdicts": verdicts}


def run_machines(cells: dict[tuple[str, int], dict[int, dict]]) -> str:
    """The machines the cells' runs ran on (their records' "machine"), "; "-joined: what a
    headline names, not the machine that computed the report."""
    return "; ".join(sorted({r["machine"] for cell in cells.values() for r in cell.values()
                             if r.get("machine")}))


def fmt(e: dict | None) -> str:
    """An estimate as "value [low, high]" ("–" when undefined)."""
    if not e or e.get("value") is None:
        return "–"
    lo, hi = e.get("low"), e.get("high")
    return f"{e['value']:.3f} [{lo:.3f}, {hi:.3f}]" if lo is not None else f"{e['value']:.3f}"


def render_rows(rows: list[dict], measure: str = "final greedy reward") -> list[str]:
    """The markdown table of the rows (one line each)."""
    lines = [f"| method | k | seeds | {measure} | kept share of G [95 % CI] | "
             "− naive PPO [95 % CI] |", "|---|---|---|---|---|---|"]
    return lines + [f"| {LABELS[r['method']]} | {r['k']} | {len(r['seeds'])} | "
                    f"{r['final']:.3f} | {fmt(r['kept'])} | {fmt(r.get('vs_naive'))} |"
                    for r in rows]
