"""Where a step's time goes on the device, from a jax profiler trace, as a few numbers
small enough for a results row (issue 33: "find where the 2.4 ms go").

`traced(fn, steps)` runs `fn()` once under `jax.profiler.trace(..., create_perfetto_trace=True)`
into a temporary folder and returns `summarize(events, steps)` of its perfetto trace:

  device lanes   the trace's "/device:..." processes: on a GPU their "Stream #..." threads
                 (the kernels; the derived "XLA Ops" / "XLA Modules" lanes would count
                 them twice), else all their threads (a TPU's cores); a trace without a
                 device process (CPU) falls back to the XLA client's threads, where the CPU
                 runs the program (nested wrapper events included there)
  window_us      first device event's start to the last one's end
  busy_us        the union of the device events' intervals (overlaps counted once)
  busy_share     busy_us / window_us; 1 - busy_share is the device idle inside the window
                 (launch gaps, host round trips, while-loop condition checks)
  gaps           idle stretches between device events: count and total over 5 / 50 us
  events         device events (kernels); events_per_step = events / steps
  top            the 15 names with the largest summed duration: name, count, total_us,
                 share of busy_us (summed durations may exceed busy_us where lanes overlap)

`host_launches(trace, steps)` counts the other side: the compiled programs the host
launched ("PjitFunction(name)" events: every jitted call and every eager jnp op, each a
launch and, on an accelerator, tens to hundreds of microseconds of host work), per step
and by name. jax records each call as two nested events of one name: an event inside a
counted one of the same name on the same thread is not counted again.

Pure stdlib on the trace file: no tensorboard or profiler plugin needed.
"""
from __future__ import annotations

import collections
import gzip
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CPU_DEVICE_THREADS = ("tf_XLAPjRtCpuClient", "tf_XLAEigen")
GAP_THRESHOLDS_US = (5.0, 50.0)
TOP = 15


def device_events(trace: dict | list) -> list[dict]:
    """The complete ("X") events on device lanes of a perfetto/chrome trace (module doc)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    on_device = [e for e in complete if procs.get(e["pid"], "").startswith("/device:")]
    streams = [e for e in on_device
               if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    if streams:  # a GPU's kernels; its derived "XLA Ops" / "XLA Modules" lanes repeat them
        return streams
    if on_device:
        return on_device
    return [e for e in complete
            if threads.get((e["pid"], e.get("tid")), "").startswith(CPU_DEVICE_THREADS)]


def merged_intervals(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals, sorted and non-overlapping."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def summarize(events: Sequence[dict], steps: int = 1) -> dict[str, Any]:
    """The summary of device `events` (module doc); `steps`: how many steps (e.g. decode
    tokens) the traced call made, for the per-step figures. ValueError without events."""
    if not events:
        raise ValueError("no device events in the trace: nothing ran on a device lane")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    merged = merged_intervals(spans)
    window = merged[-1][1] - merged[0][0]
    busy = sum(b - a for a, b in merged)
    gaps = [merged[i + 1][0] - merged[i][1] for i in range(len(merged) - 1)]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e.get("name", "?")].append(float(e["dur"]))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    return {
        "steps": steps, "events": len(events), "events_per_step": len(events) / steps,
        "window_us": window, "busy_us": busy, "busy_share": busy / window if window else 1.0,
        "window_us_per_step": window / steps, "busy_us_per_step": busy / steps,
        "gaps": {f"over_{t:g}us": {"count": sum(g > t for g in gaps),
                                   "total_us": sum(g for g in gaps if g > t)}
                 for t in GAP_THRESHOLDS_US},
        "top": [{"name": name[:120], "count": len(d), "total_us": sum(d),
                 "share_of_busy": sum(d) / busy if busy else 0.0} for name, d in top],
    }


def host_launches(trace: dict | list, steps: int = 1) -> dict[str, Any]:
    """Compiled programs launched from the host in a trace (module doc): {"steps",
    "launches", "per_step", "by_name": [{"name", "count", "per_step"}] most frequent first}."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    calls = sorted((e for e in events if e.get("ph") == "X"
                    and str(e.get("name", "")).startswith("PjitFunction(")),
                   key=lambda e: (e["pid"], e.get("tid"), float(e["ts"]), -float(e.get("dur", 0))))
    counts: collections.Counter = collections.Counter()
    open_until: dict[tuple, float] = {}  # (pid, tid, name) -> end of the counted call
    for e in calls:  # jax records one call as two nested events of the same name
        lane, start = (e["pid"], e.get("tid"), e["name"]), float(e["ts"])
        if start < open_until.get(lane, float("-inf")):
            continue
        open_until[lane] = start + float(e.get("dur", 0))
        counts[e["name"][len("PjitFunction("):-1]] += 1
    total = sum(counts.values())
    return {"steps": steps, "launches": total, "per_step": total / steps,
            "by_name": [{"name": n[:120], "count": c, "per_step": c / steps}
                        for n, c in counts.most_common()]}


def read_perfetto(folder: Path) -> dict:
    """The perfetto trace jax.profiler wrote under `folder` (the newest one)."""
    files = sorted(Path(folder).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {folder}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def traced(fn: Callable[[], Any], steps: int = 1) -> dict[str, Any]:
    """Run fn() once under the jax profiler (fn must block until its work is done, e.g.
    end in jax.block_until_ready) and summarize its device events over `steps` steps."""
    import jax
    with tempfile.TemporaryDirectory(prefix="jax-trace-") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            fn()
        return summarize(device_events(read_perfetto(Path(tmp))), steps)
