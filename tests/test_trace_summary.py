"""experiments.common.trace: the summary of a profiler trace's device events
against hand-counted synthetic traces (lanes, overlaps, gaps, per-step figures), and one
real trace of a jitted function on this CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from experiments.common.trace import (device_events, host_launches,
                                                 merged_intervals, summarize, traced)


def meta(pid, tid, process, thread):
    return [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}]


def x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


GPU_TRACE = {"traceEvents": [
    *meta(1, 1, "/host:CPU", "python"), *meta(2, 7, "/device:GPU:0", "Stream #7"),
    *meta(2, 8, "/device:GPU:0", "Stream #8"), *meta(2, 9, "/device:GPU:0", "XLA Ops"),
    x(2, 9, "gemm", 112, 30),                                # a derived lane: not counted
    x(1, 1, "PjitFunction(step)", 0, 500),                  # host: not a device event
    x(2, 7, "fusion_1", 100, 10), x(2, 7, "gemm", 112, 30),  # 2 us gap
    x(2, 8, "copy", 130, 20),                                # overlaps gemm: busy to 150
    x(2, 7, "fusion_1", 210, 10),                            # 60 us gap
    x(2, 7, "gemm", 226, 4),                                 # 6 us gap
]}


def test_device_lanes_busy_time_gaps_and_top_names():
    events = device_events(GPU_TRACE)
    assert len(events) == 5 and all(e["pid"] == 2 for e in events)
    s = summarize(events, steps=2)
    # intervals [100,110) [112,150) [210,220) [226,230): busy 10+38+10+4 = 62 of 130
    assert s["window_us"] == 130 and s["busy_us"] == 62
    assert s["busy_share"] == pytest.approx(62 / 130)
    assert s["events_per_step"] == 2.5 and s["busy_us_per_step"] == 31
    assert s["gaps"]["over_5us"] == {"count": 2, "total_us": 66.0}
    assert s["gaps"]["over_50us"] == {"count": 1, "total_us": 60.0}
    top = {t["name"]: t for t in s["top"]}
    assert [t["name"] for t in s["top"]] == ["gemm", "fusion_1", "copy"]
    assert top["gemm"]["count"] == 2 and top["gemm"]["total_us"] == 34
    assert top["copy"]["share_of_busy"] == pytest.approx(20 / 62)


def test_cpu_trace_falls_back_to_the_xla_client_threads():
    trace = [*meta(1, 1, "/host:CPU", "python"), *meta(1, 2, "/host:CPU", "tf_XLAEigen/123"),
             x(1, 1, "PjitFunction(f)", 0, 100), x(1, 2, "fusion", 10, 5)]
    assert [e["name"] for e in device_events(trace)] == ["fusion"]
    with pytest.raises(ValueError, match="no device events"):
        summarize(device_events(trace[:5]))  # the host event only


def test_merged_intervals():
    assert merged_intervals([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]


def test_a_real_trace_of_a_jitted_function():
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    a = jnp.ones((128, 128))
    f(a).block_until_ready()
    s = traced(lambda: [f(a).block_until_ready() for _ in range(3)], steps=3)
    assert s["events"] >= 3 and 0 < s["busy_us"] <= s["window_us"]
    assert s["steps"] == 3 and s["top"][0]["total_us"] > 0


def test_host_launches_count_each_call_once():
    """jax writes one call as two nested events of one name; calls of the same name one
    after another, on another thread, or another name nested inside, all count."""
    events = [*meta(1, 1, "/host:CPU", "python"), *meta(1, 2, "/host:CPU", "worker"),
              x(1, 1, "PjitFunction(step)", 0, 100), x(1, 1, "PjitFunction(step)", 1, 98),
              x(1, 1, "PjitFunction(inner)", 10, 5),        # another name inside: counted
              x(1, 1, "PjitFunction(step)", 200, 50), x(1, 1, "PjitFunction(step)", 201, 48),
              x(1, 2, "PjitFunction(step)", 20, 10),         # another thread, overlapping
              x(1, 1, "$api.py:1 device_get", 300, 10),      # not a launch
              x(2, 7, "fusion_1", 0, 10)]
    got = host_launches({"traceEvents": events}, steps=2)
    assert got["launches"] == 4 and got["per_step"] == 2.0
    assert got["by_name"] == [{"name": "step", "count": 3, "per_step": 1.5},
                              {"name": "inner", "count": 1, "per_step": 0.5}]
    with pytest.raises(ValueError, match="steps"):
        host_launches(events, steps=0)
