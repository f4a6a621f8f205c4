"""experiments.bench.grpo_e2e: the whole GRPO step end to end. --smoke (tiny, 4 steps, the
third traced: the host's program launches counted) in
a process where wandb, gguf, reasoning-gym and math-verify cannot be imported (as on the
stock GPU image) writes its JSON: steps/hour from the step profile, phases that sum to
each step, decode tokens/s, memory; the task's verifier on known responses; the
summary's arithmetic on known records."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench.grpo_e2e import FIRST_SYMBOL, LongReverseTask, StepTracer, summarize
from tests.test_bench_accelerator import _blocked_env

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("prefill_s", "decode_s", "reward_s", "learner_s", "host_s", "transfer_s", "other_s")


def test_long_reverse_task_prompts_and_verifier():
    task = LongReverseTask(prompt_len=20, response_len=10, k=4, alphabet=5, vocab_size=100)
    a, b = task.train_prompts(3, 2)
    assert len(a.ids) == 20 and a.ids[0] == 1 and a.ids[-1] == 3 and b.index == 4
    assert task.train_prompts(3, 1)[0] == a               # deterministic
    assert task.eval_prompts(1)[0].ids != task.train_prompts(0, 1)[0].ids
    symbols = [t - FIRST_SYMBOL for t in a.ids[-5:-1]]
    assert all(0 <= s < 5 for s in symbols)
    right = [FIRST_SYMBOL + s for s in symbols[::-1]]
    assert task.reward(a, right + [7] * 6) == {"correct": 1.0}
    assert task.reward(a, right[:2] + [99, 99]) == {"correct": 0.5}
    assert task.reward(a, []) == {"correct": 0.0}
    assert all(FIRST_SYMBOL + 5 <= t < 100 for t in a.ids[1:-5])   # filler never a symbol
    with pytest.raises(ValueError, match="vocab_size"):
        LongReverseTask(vocab_size=10)


def test_summary_of_known_records():
    recs = [{"step_s": 9.0, "decode_s": 5.0, "reward_mean": 0.1},
            {"step_s": 2.0, "prefill_s": 0.1, "decode_s": 1.0, "learner_s": 0.8, "host_s": 0.05,
             "transfer_s": 0.02, "other_s": 0.03, "reward_mean": 0.2},
            {"step_s": 2.0, "prefill_s": 0.1, "decode_s": 1.0, "learner_s": 0.8, "host_s": 0.05,
             "transfer_s": 0.02, "other_s": 0.03, "reward_mean": 0.3}]
    s = summarize(recs, tokens_per_step=1000)
    assert s["steps_timed"] == 2 and s["steps_per_hour"] == 1800.0
    assert s["host_transfer_other_share"] == pytest.approx(0.05)
    assert s["decode_tokens_per_s"] == 1000.0 and s["first_step_s"] == 9.0
    assert s["steady_steps"] == 1 and s["all_timed_steps_per_hour"] == 1800.0
    with pytest.raises(ValueError, match="steps >= 2"):
        summarize(recs[:1], 10)


def test_steady_state_skips_the_batches_sampled_ahead():
    """Async at K = 2: the first K steps after the compiling one take pre-made data (fast);
    the steady state (the headline) starts after them and one more; the mean over every
    timed step is reported apart."""
    step_s = [30.0, 0.1, 0.1, 0.8, 0.7, 0.9]
    recs = [{"step_s": x, "reward_mean": 0.0} for x in step_s]
    s = summarize(recs, 10, staleness=2)
    assert s["steady_steps"] == 2 and s["steps_per_hour"] == pytest.approx(3600 / 0.8)
    assert s["all_timed_steps_per_hour"] == pytest.approx(3600 / (2.6 / 5))
    short = summarize(recs[:3], 10, staleness=2)  # nothing steady: all timed, and says so
    assert short["steady_steps"] == 0 and short["steps_per_hour"] == pytest.approx(3600 / 0.1)


def test_smoke_runs_the_whole_step_without_optional_packages(tmp_path):
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.bench.grpo_e2e", "--smoke",
                           "--steps", "4", "--trace-steps", "1",
                           "--out", str(out), "--run-dir", str(tmp_path / "run")],
                          env=_blocked_env(tmp_path), cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["platform"] == "cpu" and len(res["steps"]) == 4 and res["steps_timed"] == 2
    for step in res["steps"]:
        assert sum(step[k] for k in PHASES) == pytest.approx(step["step_s"], rel=1e-6)
        assert 0.0 <= step["reward_mean"] <= 1.0
    # step 3 ran under the profiler: left out of the timing, its launches counted
    mean = (res["steps"][1]["step_s"] + res["steps"][3]["step_s"]) / 2
    trace = res["trace"]
    assert trace["steps"] == [3] and trace["device"]["events_per_step"] > 0
    launched = {d["name"]: d["count"] for d in trace["host_launches"]["by_name"]}
    assert launched["decode_segment_impl"] >= 1 and launched["_empty_arrays"] == 1
    # the step's host code launches whole programs, not eager jnp ops one by one (each a
    # device launch and a host round trip on an accelerator; 60 per harvest before)
    eager = {"gather", "broadcast_in_dim", "convert_element_type", "select_n", "add"}
    assert not eager & set(launched), launched
    assert trace["host_launches"]["per_step"] <= 12, launched
    assert res["all_timed_steps_per_hour"] == pytest.approx(3600 / mean)
    assert res["steps_per_hour"] == pytest.approx(3600 / res["steps"][3]["step_s"])  # steady
    assert res["headline"]["value"] == pytest.approx(res["steps_per_hour"], abs=0.1)
    assert res["tokens_per_step"] == 2 * 2 * 6 and res["decode_tokens_per_s"] > 0
    assert res["process_peak_rss_mb"] > 100 and res["peak_device_bytes"] is None  # CPU
    assert "steps/hour" in proc.stdout and "host + transfer + other" in proc.stdout


def test_a_failing_profiler_is_an_error_entry_not_a_failed_run(monkeypatch):
    import jax

    def refuse(*a, **k):
        raise RuntimeError("no CUPTI")

    monkeypatch.setattr(jax.profiler, "start_trace", refuse)
    tracer = StepTracer(2, 4)
    for step in range(1, 6):
        tracer({"step": step})  # no exception: the run goes on
    got = tracer.summary()
    assert got["steps"] == [3, 4] and "host_launches" not in got
    assert got["errors"] == ["start_trace: RuntimeError: no CUPTI"]


def test_a_trace_without_device_lanes_still_counts_the_host_launches(monkeypatch):
    import jax

    import experiments.common.trace as trace_mod
    host_only = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(step)", "ts": 0, "dur": 5},
        {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(step)", "ts": 10, "dur": 5}]}
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: None)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    monkeypatch.setattr(trace_mod, "read_perfetto", lambda folder: host_only)
    tracer = StepTracer(1, 3)
    for step in range(1, 4):
        tracer({"step": step})
    got = tracer.summary()
    assert got["host_launches"]["launches"] == 2 and got["host_launches"]["per_step"] == 1.0
    assert "device" not in got and got["errors"][0].startswith("device lanes: ValueError")
