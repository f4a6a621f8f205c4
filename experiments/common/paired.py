"""Paired comparisons of training runs on the same evaluation problems, with bootstrap
confidence intervals over problems and seeds: what the off-policy studies' verdicts rest on.

    results = problem_results(run_dir)                  # {step: {pass: {prompt index: acc}}}
    table = seed_problem_matrix([run_a_seed0, run_a_seed1], step=None, pass_="greedy")
    diff = paired_bootstrap(table_a, table_b)           # mean a - b, its 95 % CI
    kept = gain_kept(table_m, table_sync, table_init)   # the share of the sync gain kept

A table is [seeds, problems] of per-problem accuracy (rl's eval_problems.jsonl: every eval
pass writes each problem's accuracy). Two tables are paired when row s of both is the same
seed (the same eval problems, the same prompt stream) and column p the same problem.

The bootstrap: B replicates, each drawing S seeds and P problems with replacement (the same
draw for both sides of a pair) and computing the statistic on the drawn sub-table; the CI
is the percentile interval. Resampling problems covers the eval-set noise, resampling seeds
the run-to-run noise; with one seed only the problems are resampled (the CI then says
nothing about seeds, and the caller should say so).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

PROBLEMS_FILE = "eval_problems.jsonl"


def problem_results(run_dir: str | Path) -> dict[int, dict[str, dict[int, float]]]:
    """{eval step: {pass ("sampled" | "greedy"): {prompt index: accuracy}}} of a run dir."""
    out: dict[int, dict[str, dict[int, float]]] = {}
    path = Path(run_dir) / PROBLEMS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: runs save per-problem evals there "
                                "(rl.loops.evaluation.make_evaluator)")
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        out.setdefault(int(r["step"]), {})[r["pass"]] = dict(
            zip((int(i) for i in r["prompt_index"]), (float(a) for a in r["accuracy"])))
    return out


def seed_problem_matrix(run_dirs: Sequence[str | Path], *, step: int | None = None,
                        pass_: str = "greedy") -> np.ndarray:
    """[seeds, problems] float64: each run's per-problem accuracy at eval `step` (None: its
    last eval), problems in prompt-index order; ValueError when the runs evaluated
    different problems (then they cannot be paired)."""
    rows, index = [], None
    for d in run_dirs:
        res = problem_results(d)
        at = max(res) if step is None else step
        if at not in res or pass_ not in res[at]:
            raise ValueError(f"{d}: no {pass_!r} eval at step {at} (it has {sorted(res)})")
        probs = res[at][pass_]
        keys = sorted(probs)
        if index is None:
            index = keys
        elif keys != index:
            raise ValueError(f"{d}: evaluated other problems than {run_dirs[0]}; runs compared "
                             "in pairs must share their eval set")
        rows.append([probs[k] for k in keys])
    return np.asarray(rows, np.float64)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A statistic with its bootstrap percentile interval (level, e.g. 0.95)."""

    value: float
    low: float
    high: float
    level: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes(self, x: float) -> bool:
        return not self.low <= x <= self.high

    def as_dict(self) -> dict:
        """JSON: a statistic that is undefined (e.g. a share of a zero gain) is None."""
        def clean(x):
            return float(x) if math.isfinite(x) else None

        return {"value": clean(self.value), "low": clean(self.low), "high": clean(self.high),
                "level": self.level, "half_width": clean(self.half_width)}


def bootstrap(tables: Sequence[np.ndarray], statistic: Callable[..., float], *,
              replicates: int = 4000, level: float = 0.95, seed: int = 0) -> Estimate:
    """The statistic of paired [seeds, problems] tables, with the percentile interval of
    `replicates` joint draws of seeds and problems (module doc)."""
    tables = [np.asarray(t, np.float64) for t in tables]
    shape = tables[0].shape
    if len(shape) != 2 or any(t.shape != shape for t in tables):
        raise ValueError(f"paired tables must all be [seeds, problems] of one shape, got "
                         f"{[t.shape for t in tables]}")
    s, p = shape
    rng = np.random.default_rng(seed)
    values = np.empty(replicates)
    for b in range(replicates):
        rows = rng.integers(0, s, s) if s > 1 else np.zeros(1, int)
        cols = rng.integers(0, p, p)
        values[b] = statistic(*(t[np.ix_(rows, cols)] for t in tables))
    tail = (1 - level) / 2
    finite = values[np.isfinite(values)]
    lo, hi = np.quantile(finite, [tail, 1 - tail]) if finite.size else (np.nan, np.nan)
    return Estimate(float(statistic(*tables)), float(lo), float(hi), level)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, **kw) -> Estimate:
    """mean(a) − mean(b) over paired [seeds, problems] tables, with its CI."""
    return bootstrap([a, b], lambda x, y: float(x.mean() - y.mean()), **kw)


def gain_kept(method: np.ndarray, sync: np.ndarray, initial: np.ndarray, **kw) -> Estimate:
    """(mean(method) − mean(initial)) / (mean(sync) − mean(initial)): the share of the
    synchronous run's gain a method keeps, with its CI (all three tables paired)."""
    def share(m, s, i):
        gain = s.mean() - i.mean()
        return float((m.mean() - i.mean()) / gain) if gain != 0 else float("nan")

    return bootstrap([method, sync, initial], share, **kw)
