"""The step profile (rl.runtime.logging.StepProfile, profile_summary): a short synchronous
run logs every phase and the phases cover the step's wall time; the rollout engine's
prefill / decode timings; the per-step memory high-water mark is reset between steps;
the summary's means, shares and steps/hour."""
import dataclasses
import mmap
import time

import jax
import numpy as np
import pytest

from rl.loops import AsyncConfig, RolloutSpec, run, run_async, sample_groups
from rl.rollout import SamplingConfig
from rl.run import PRESETS, LoggingConfig, load_policy
from rl.runtime.logging import EXTRA_PHASES, PHASES, StepProfile, format_profile, profile_summary

PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=3, prompts_per_step=2, group_size=4, eval_prompts=8,
                           eval_every=0, save_every=0, eval_greedy=False)


def cfg(run_dir, asynchronous=None):
    """The preset with this file's loop (asynchronous: an AsyncConfig for run_async),
    writing into run_dir, no wandb, no progress bar."""
    return dataclasses.replace(PRESET, loop=LOOP, asynchronous=asynchronous, run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False))


@pytest.fixture(scope="module")
def policy():
    config, params, task = load_policy(PRESET, 0)
    return config, jax.device_put(params, jax.devices()[0]), task


def test_sync_run_logs_a_complete_step_profile(policy, tmp_path):
    config, params, task = policy
    res = run(config, params, task, cfg(tmp_path / "run"))
    for r in res.train:
        for k in (*PHASES, "other_s", "step_s"):
            assert r[k] >= 0.0 or k == "other_s", (k, r[k])
        assert r["prefill_s"] > 0 and r["decode_s"] > 0 and r["learner_s"] > 0
        assert r["reward_s"] > 0 and r["host_s"] > 0 and r["transfer_s"] > 0
        total = sum(r[k] for k in PHASES) + r["other_s"]
        assert total == pytest.approx(r["step_s"], rel=1e-9, abs=1e-9)
        # the named phases cover the step: what none of them timed is a sliver
        assert abs(r["other_s"]) <= 0.05 * r["step_s"] + 0.02, r
        # the old coarse timings are inside the step and made of its phases
        assert r["rollout_s"] + r["train_s"] <= r["step_s"] + 1e-6
        assert r["learner_s"] <= r["train_s"] + 1e-6
        assert r["prefill_s"] + r["decode_s"] + r["reward_s"] <= r["rollout_s"] + 1e-6
        assert r["peak_rss_mb"] > 10.0
    # (whether the first step compiles depends on what earlier tests in this process
    # compiled: the jitted step is cached per config, so its time is not asserted here)
    summary = profile_summary(res.train)
    assert summary["steps_measured"] == 2 and not summary["compile_step_included"]
    assert summary["steps_per_hour"] == pytest.approx(
        3600 / np.mean([r["step_s"] for r in res.train[1:]]))
    assert sum(p["share"] for p in summary["phases"].values()) == pytest.approx(1.0)
    assert "steps/hour" in format_profile(summary)


def test_engine_times_prefill_and_decode(policy):
    config, params, task = policy
    prof = StepProfile()
    prof.start()
    t = time.perf_counter()
    spec = RolloutSpec(task, config, group_size=4, segment_len=2, sampling=SamplingConfig())
    traj = sample_groups(params, 0, spec, task.train_prompts(0, 2), seed=0, profile=prof)
    wall = time.perf_counter() - t
    rec = prof.finish()
    assert traj.batch_size == 8
    assert rec["prefill_s"] > 0 and rec["decode_s"] > 0 and rec["host_s"] > 0
    assert rec["prefill_s"] + rec["decode_s"] + rec["host_s"] == pytest.approx(wall, rel=0.05, abs=3e-3)
    assert rec["learner_s"] == rec["reward_s"] == 0.0


def test_peak_memory_is_per_step():
    prof = StepProfile()
    prof.start()
    # 300 MB of fresh anonymous pages: a fresh mapping always adds resident memory (a numpy
    # array could reuse heap pages the long-running test process already has resident)
    big = mmap.mmap(-1, 300_000_000)
    for offset in range(0, len(big), mmap.PAGESIZE):
        big[offset] = 1
    big.close()
    first = prof.finish()
    prof.start()
    second = prof.finish()
    if not second["peak_rss_per_step"]:
        pytest.skip("/proc/self/clear_refs is not writable here: the peak is process-wide")
    assert first["peak_rss_mb"] - second["peak_rss_mb"] > 200


def test_step_profile_phases_and_errors():
    prof = StepProfile()
    with pytest.raises(RuntimeError, match="before start"):
        prof.finish()
    prof.start()
    with prof.phase("reward_s"):
        time.sleep(0.05)
    prof.add("decode_s", 0.01)
    time.sleep(0.03)
    rec = prof.finish()
    assert rec["reward_s"] == pytest.approx(0.05, abs=0.02)
    assert rec["decode_s"] == 0.01
    assert rec["other_s"] == pytest.approx(0.03, abs=0.02)
    with pytest.raises(ValueError, match="unknown phase"):
        prof.add("sampling_s", 1.0)


def test_profile_summary_means_and_shares():
    recs = [{"step_s": 10.0, "decode_s": 6.0, "learner_s": 3.0, "other_s": 1.0, "peak_rss_mb": 900},
            {"step_s": 2.0, "decode_s": 1.0, "learner_s": 0.5, "other_s": 0.5, "peak_rss_mb": 500},
            {"step_s": 4.0, "decode_s": 2.0, "learner_s": 1.5, "other_s": 0.5, "peak_rss_mb": 700}]
    s = profile_summary(recs)
    assert s["steps_measured"] == 2 and s["first_step_s"] == 10.0
    assert s["step_s_mean"] == 3.0 and s["steps_per_hour"] == 1200.0
    assert s["phases"]["decode_s"] == {"mean_s": 1.5, "share": 0.5}
    assert s["phases"]["learner_s"]["share"] == pytest.approx(1 / 3)
    assert s["peak_rss_mb"] == 900 and s["peak_rss_mb_per_step"] == [900, 500, 700]
    assert profile_summary([{"step": 1, "loss": 0.0}]) is None
    one = profile_summary(recs[:1])
    assert one["compile_step_included"] and one["steps_per_hour"] == 360.0


@pytest.mark.parametrize("mode,proximal", [("deterministic", "exact"), ("threaded", "current")])
def test_async_run_logs_the_learner_side_profile(policy, tmp_path, mode, proximal):
    config, params, task = policy
    res = run_async(config, params, task, cfg(tmp_path / mode, AsyncConfig(
        max_staleness=1, mode=mode, proximal=proximal)))
    for r in res.train:
        phases = (*PHASES, *EXTRA_PHASES)
        assert sum(r[k] for k in phases) + r["other_s"] == pytest.approx(r["step_s"], abs=1e-9)
        assert abs(r["other_s"]) <= 0.05 * r["step_s"] + 0.02, r
        assert r["learner_s"] > 0 and r["host_s"] > 0 and r["peak_rss_mb"] > 10.0
        if mode == "deterministic":  # the learner samples itself: the rollout is split
            assert r["prefill_s"] > 0 and r["decode_s"] > 0 and r["reward_s"] > 0
            assert r["proximal_s"] > 0 and r["wait_s"] == 0.0
        else:  # the producer thread samples; the learner only waits for it
            assert r["prefill_s"] == r["decode_s"] == 0.0 and r["proximal_s"] < 1e-3
    assert profile_summary(res.train)["phases"].keys() >= {"learner_s", "wait_s", "other_s"}
