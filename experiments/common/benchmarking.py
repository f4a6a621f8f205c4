"""Shared pieces of the benchmark and reproduction scripts: which machine, how busy it
was, round-robin timing of compiled calls, and the results file with its headline.

Every script writes its results where `results_path` says (experiments/bench/X.py:
experiments/results/bench_X.json; experiments/repro/X.py: experiments/results/X.json),
holding a top-level "headline" {"metric", "value", "target", "machine"} beside its table.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl.runtime.host import load_average, machine

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"  # experiments/results


COMPILE_EVENTS = frozenset({  # jax.monitoring duration events that make up a compilation
    "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration"})


@contextlib.contextmanager
def compile_seconds():
    """Yield a one-element list that accumulates the seconds jax spends tracing, lowering
    and compiling inside the block (its compile events; they run on the calling thread,
    so wall time minus this is run time)."""
    import jax

    total = [0.0]

    def listener(event, duration, **_):
        if event in COMPILE_EVENTS:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield total
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def time_calls(calls: dict[str, Callable[[], Any]], reps_seconds: float,
               min_reps: int = 5) -> dict[str, float]:
    """Median wall time in ms of each already-compiled call. The calls are timed
    round-robin so that load from other processes hits them all alike."""
    import jax

    times: dict[str, list[float]] = {name: [] for name in calls}
    first = next(iter(calls))
    start = time.perf_counter()
    while (len(times[first]) < min_reps
           or time.perf_counter() - start < reps_seconds * len(calls)):
        for name, fn in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def results_path(script: str | os.PathLike) -> Path:
    """The results JSON of the script at `script` (pass its __file__):
    experiments/bench/X.py -> RESULTS_DIR/bench_X.json, experiments/repro/X.py ->
    RESULTS_DIR/X.json. ValueError for a file in neither room."""
    path = Path(script)
    room = path.parent.name
    if path.suffix != ".py" or room not in ("bench", "repro"):
        raise ValueError(f"{str(path)!r} is not a script of experiments/bench/ or "
                         "experiments/repro/")
    return RESULTS_DIR / (f"bench_{path.stem}.json" if room == "bench" else f"{path.stem}.json")


def write_results(path: Path, result: dict[str, Any]) -> Path:
    """Validate the headline and write `result` as JSON (atomically)."""
    head = result.get("headline")
    need = {"metric": str, "value": (int, float), "target": (int, float), "machine": str}
    if not isinstance(head, dict) or any(not isinstance(head.get(k), t) for k, t in need.items()):
        raise ValueError(f"result needs a headline with {sorted(need)}; got {head!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path


def round_robin(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Wall seconds of `repeats` calls of each, alternating (load hits all alike)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratios(times: dict[str, list[float]], base: str) -> dict[str, dict]:
    """Each side's round-by-round time ratio to `base` (the calls alternate, so round i of
    both sides saw the same machine): median, min, max and every ratio."""
    out = {}
    for k, v in times.items():
        if k == base:
            continue
        r = [a / c for a, c in zip(v, times[base])]
        out[k] = {"median": round(statistics.median(r), 3), "min": round(min(r), 3),
                  "max": round(max(r), 3), "all": [round(x, 3) for x in r]}
    return out
