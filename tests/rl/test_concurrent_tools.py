"""Concurrent tool calls in the multi-turn engine (rl/rollout/multiturn.py,
max_concurrent_tool_calls) and the latency model (rl/envs/latency.py).

References: the inline engine (max_concurrent_tool_calls = 0, calls one after another on
the calling thread: the exact slow twin) for tokens and records; a teacher-forced forward
for the concurrent rollout's log-probs; a thread counter inside the tool for how many calls
really overlapped; numpy's normal quantiles for the lognormal's p50 / p99."""
import logging
import threading
import time

import numpy as np
import pytest

from rl.envs.base import EndReason
from rl.envs.latency import LatencyModel, parse_latency, with_latency
from rl.rollout.multiturn import MultiTurnConfig, MultiTurnEngine
from rl.rollout.sampler_state import SamplingConfig
from tests.rl.test_multiturn import (
    CFG,
    T,
    ScriptedEnv,
    assert_rows_equal,
    check_against_forward,
    check_structure,
    prompts,
    row_arrays,
)


class CountingEnv(ScriptedEnv):
    """The scripted env whose every step sleeps `delay` s, counting calls in flight (the
    most seen at once is `peak`); behaviour "hang" sleeps 30 s in prompt 2's first step."""

    def __init__(self, delay=0.0, behaviours=None):
        super().__init__(behaviours)
        self.delay, self.now, self.peak = delay, 0, 0
        self.lock = threading.Lock()

    def reset(self, prompt):
        ep = super().reset(prompt)
        step, env = ep.step, self

        def counted(text):
            with env.lock:
                env.now += 1
                env.peak = max(env.peak, env.now)
            try:
                if ep.behaviour == "hang":
                    time.sleep(30)
                time.sleep(env.delay)
                return step(text)
            finally:
                with env.lock:
                    env.now -= 1
        ep.step = counted
        return ep


def run(params, env, workers, *, slots=12, step_s=0.0, layout="segmented", fixed_version=True,
        park=None):
    from rl.rollout.multiturn import TimeLimits
    eng = MultiTurnEngine(CFG, env, MultiTurnConfig(
        num_slots=slots, group_size=2, segment_len=5, sampling=SamplingConfig(temperature=T),
        kv_layout=layout, max_concurrent_tool_calls=workers, time_limits=TimeLimits(step_s=step_s),
        park_after_s=park))
    eng.submit(prompts())
    batches, v, t0 = [], 0, time.perf_counter()
    while not eng.idle:
        eng.step(params, 0 if fixed_version else v)
        v += 1
        if (b := eng.harvest()) is not None:
            batches.append(b)
    wall = time.perf_counter() - t0
    eng.close()
    rows = [(b.trajectory, i, b.episodes[i]) for b in batches for i in range(len(b.episodes))]
    return eng, sorted(rows, key=lambda r: (r[2].group_id, r[2].sample)), wall


@pytest.fixture(scope="module")
def params():
    from models.decoder import init_params
    return init_params(CFG, 0)


@pytest.fixture(scope="module")
def inline(params):
    return run(params, CountingEnv(delay=0.05), 0)


@pytest.mark.parametrize("layout", ["segmented", "replicated"])
def test_concurrent_calls_give_the_inline_tokens_and_overlap(params, inline, layout):
    eng0, rows0, wall0 = inline if layout == "segmented" else run(params, CountingEnv(0.05), 0,
                                                                   layout=layout)
    env = CountingEnv(delay=0.05)
    eng, rows, wall = run(params, env, 4, layout=layout)
    assert len(rows) == len(rows0) == 2 * len(prompts())
    for (ta, i, ra), (tb, j, rb) in zip(rows0, rows):
        assert_rows_equal(row_arrays(ta, i), row_arrays(tb, j))
        assert ra.turn_texts == rb.turn_texts and ra.observations == rb.observations
        assert ra.outcome == rb.outcome and ra.end_reason == rb.end_reason
        assert ra.spans == rb.spans
    check_against_forward(params, rows)
    check_structure(rows, env)
    assert 1 < env.peak <= 4  # calls of different episodes really overlapped, within the bound
    assert eng.tool_calls == eng0.tool_calls == sum(r.turns for _, _, r in rows)
    s = eng.stats()
    assert 0 < s["slot_occupancy"] <= s["slot_held"] <= 1
    assert s["tool_s"] >= 0.05 * eng.tool_calls
    assert 0 <= s["tool_wait_share"] < 1


def test_parked_slots_take_other_episodes_and_give_the_same_tokens(params):
    """park_after_s=0: a slot whose episode waits on a tool is freed at once and the
    episode comes back, its history re-prefilled, into whichever slot is free when its
    call returns; 4 slots then carry more than 4 episodes' calls at once. The reference:
    the inline engine on the same slots (no parking, no concurrency)."""
    eng0, rows0, _ = run(params, CountingEnv(0.05), 0, slots=4, layout="replicated")
    env = CountingEnv(delay=0.05)
    eng, rows, _ = run(params, env, 12, slots=4, layout="replicated", park=0.0)
    assert eng.parked_count > 0 and env.peak > 4  # more calls in flight than slots
    assert len(rows) == len(rows0) == 2 * len(prompts())
    for (ta, i, ra), (tb, j, rb) in zip(rows0, rows):
        assert_rows_equal(row_arrays(ta, i), row_arrays(tb, j))
        assert ra.turn_texts == rb.turn_texts and ra.outcome == rb.outcome
        assert ra.spans == rb.spans and ra.end_reason == rb.end_reason
    check_against_forward(params, rows)
    assert eng.token_counts["reprefill"] > 0 and eng.num_parked == 0
    with pytest.raises(ValueError, match="replicated"):
        MultiTurnConfig(num_slots=4, group_size=2, segment_len=2, park_after_s=0.0,
                        max_concurrent_tool_calls=2)


def test_inline_calls_run_one_at_a_time(inline):
    eng, rows, _ = inline
    s = eng.stats()  # one call at a time: on average at most one running, never a wait
    assert 0 < s["tool_calls_in_flight"] <= 1 and s["tool_wait_share"] == 0
    assert s["tokens_per_s_tools_running"] == 0  # no step began with a call running


@pytest.mark.parametrize("behaviour,reason", [("raise", EndReason.ENV_ERROR),
                                              ("huge", EndReason.TOKEN_BUDGET),
                                              ("hang", EndReason.TIMEOUT)])
def test_a_failing_tool_ends_only_its_episode(params, inline, behaviour, reason, caplog):
    bad = 2
    with caplog.at_level(logging.WARNING, logger="rl.rollout.episodes"):
        _, rows, wall = run(params, CountingEnv(0.05, {bad: behaviour}), 4, step_s=1.0)
    _, clean, _ = inline
    assert len(rows) == len(clean)
    for (tc, i, rc), (tb, j, rb) in zip(clean, rows):
        if rb.group_id != bad:
            assert_rows_equal(row_arrays(tc, i), row_arrays(tb, j))
            assert rc.outcome == rb.outcome
        else:
            assert rb.end_reason == reason and rb.message
    assert wall < 20  # the hung call (30 s) was cut at its 1 s limit


def test_lognormal_latency_quantiles_and_seeding():
    m = parse_latency("lognormal:0.5,3")
    assert m == LatencyModel("lognormal", 0.5, 3.0) and parse_latency(m.spec) == m
    rng = np.random.default_rng(0)
    draws = np.array([m.draw(rng) for _ in range(200_000)])
    assert np.quantile(draws, 0.5) == pytest.approx(0.5, rel=0.02)
    assert np.quantile(draws, 0.99) == pytest.approx(3.0, rel=0.05)
    assert draws.mean() == pytest.approx(m.mean, rel=0.02)
    assert parse_latency("fixed:0.25").draw(rng) == 0.25 and parse_latency("").kind == "none"
    for bad in ("lognormal:3,0.5", "gauss:1", "fixed:", "fixed:-1", "lognormal:1"):
        with pytest.raises(ValueError):
            parse_latency(bad)


def test_latency_wrapper_is_seeded_per_episode_not_per_order():
    env = ScriptedEnv()
    ps = prompts()

    def delays(order, seed=0):
        wrapped = with_latency(env, "lognormal:0.001,0.002", seed=seed)
        eps = {}
        for k in order:  # two episodes (samples) per prompt, reset in the order given
            eps.setdefault(k, []).append(wrapped.reset(ps[k]))
        return {k: [e.model.draw(e.rng) for e in v] for k, v in eps.items()}

    a, b = delays([0, 0, 1, 1, 2, 2]), delays([2, 1, 0, 2, 1, 0])
    assert a == b  # the same delays whatever order other prompts reset in
    assert a[0][0] != a[0][1]  # the samples of a group differ
    assert delays([0, 0], seed=1)[0] != a[0]
    assert with_latency(env, "") is env
