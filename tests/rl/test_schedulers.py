"""Prompt schedulers (rl.schedulers): DOTS's difficulty estimate and calibration and DPS's
HMM recursions against float64 hand computations (plain Python loops; DPS's in the
official code's transposed convention), DARS's schedules against the official tables and
its allocation (sums to the budget, hard prompts get more), state()/restore() round
trips, uniform = stream order."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rl.schedulers import (
    DarsConfig,
    DarsScheduler,
    DotsConfig,
    DotsScheduler,
    DpsConfig,
    DpsScheduler,
    PromptScheduler,
    UniformConfig,
    UniformScheduler,
    make_scheduler,
)
from rl.schedulers.dars import apportion, dars_allocation, schedule_extra, schedule_total
from rl.schedulers.dots import (
    adaptive_difficulty,
    calibration,
    predict_difficulty,
    selection_weights,
)
from rl.schedulers.dps import observe_state
from rl.tasks import SyntheticTask


# ----------------------------------------------------------------------------- references
def naive_difficulty(query, refs, ref_d):
    """d̂ by Python loops: softmax over the reference set of z_q . z_i / sqrt(h)."""
    h = len(query)
    logits = [sum(query[t] * r[t] for t in range(h)) / math.sqrt(h) for r in refs]
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    return sum(ei * di for ei, di in zip(e, ref_d)) / sum(e)


def naive_line(xs, ys):
    """Least-squares slope and intercept of ys on xs by the normal equations (loops)."""
    n = len(xs)
    sx, sy = sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    den = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / den
    return slope, (sy - slope * sx) / n


class NaiveDps:
    """The official BayesianHMMSampler's recursions written out with loops, in ITS
    convention (column-stochastic: alpha[s_next][s_prev], prediction P @ pi), with a
    general emission E[s][o] (E = I is the official deterministic observation)."""

    def __init__(self, prior, emission, alpha0, lam):
        self.pi0, self.e, self.a0, self.lam = prior, emission, alpha0, lam
        self.alpha, self.pis, self.before = {}, {}, {}

    def known(self, pid):
        if pid not in self.alpha:
            self.alpha[pid] = [[self.a0[s][t] for s in range(3)] for t in range(3)]  # a0^T
            self.pis[pid], self.before[pid] = list(self.pi0), list(self.pi0)

    @staticmethod
    def expected(alpha):  # column-normalised: P[t][s] = p(next t | prev s)
        cols = [sum(alpha[t][s] for t in range(3)) for s in range(3)]
        return [[alpha[t][s] / cols[s] for s in range(3)] for t in range(3)]

    def train(self, obs_by_pid):
        for pid in list(self.alpha):
            alpha, pi, before = self.alpha[pid], self.pis[pid], self.before[pid]
            p_old = self.expected(alpha)
            new = [[self.lam * alpha[t][s] + (1 - self.lam) * self.a0[s][t] for s in range(3)]
                   for t in range(3)]
            if pid in obs_by_pid:
                o = obs_by_pid[pid]
                post = [pi[t] * self.e[t][o] for t in range(3)]
                z = sum(post)
                post = [x / z for x in post]
                upd = [[self.e[t][o] * before[s] * p_old[t][s] for s in range(3)]
                       for t in range(3)]
                z = sum(map(sum, upd))
                new = [[new[t][s] + upd[t][s] / z for s in range(3)] for t in range(3)]
            else:
                post = pi
            p_new = self.expected(new)
            nxt = [sum(p_new[t][s] * post[s] for s in range(3)) for t in range(3)]
            z = sum(nxt)
            self.alpha[pid], self.before[pid], self.pis[pid] = new, post, [x / z for x in nxt]


# ----------------------------------------------------------------------------- DOTS
def test_dots_difficulty_estimate_matches_a_float64_hand_computation():
    rng = np.random.default_rng(0)
    q, k, h = 5, 4, 3
    query, refs = rng.normal(size=(q, h)), rng.normal(size=(k, h)) * 2.0
    ref_d = rng.uniform(size=k)
    got = predict_difficulty(query, refs, ref_d)
    want = [naive_difficulty(query[i].tolist(), refs.tolist(), ref_d.tolist()) for i in range(q)]
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
    assert adaptive_difficulty(np.array([1.0, 0.0, 0.0, 1.0, 0.0])) == 0.6


def test_dots_calibration_is_the_least_squares_line():
    xs, ys = [0.2, 0.5, 0.45, 0.9], [0.0, 0.75, 0.5, 1.0]
    s, c = calibration(np.array(xs), np.array(ys))
    ws, wc = naive_line(xs, ys)
    assert s == pytest.approx(ws, rel=1e-13) and c == pytest.approx(wc, rel=1e-13)
    assert calibration(np.full(3, 0.4), np.array([0.0, 0.5, 1.0])) == (0.0, 0.5)


def test_dots_round_measures_a_reference_set_then_trains_on_mu_batches():
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(12, 4))
    s = DotsScheduler(DotsConfig(prompts_per_step=2, group_size=4, reference_size=3,
                                 selection_interval=2, seed=5), emb)
    with pytest.raises(ValueError, match="measure"):
        s.select(0, range(12))
    ref = s.measure(0, range(12))
    assert len(set(ref)) == 3 and set(ref) <= set(range(12))
    with pytest.raises(ValueError, match="measure"):  # not measured yet
        s.select(0, range(12))
    with pytest.raises(ValueError, match="reference prompts"):
        s.update([ref[0]], [np.ones(4)])
    rewards = [np.array([1.0, 1, 1, 0]), np.zeros(4), np.array([1.0, 0, 1, 0])]
    s.update(ref, rewards)
    d = [0.25, 1.0, 0.5]  # 1 - share correct
    np.testing.assert_array_equal(s.ref_difficulty, d)
    # d̂ by loops, then the line through the reference points (their own d̂, d)
    ref_emb = [emb[i].tolist() for i in ref]
    raw = [naive_difficulty(emb[q].tolist(), ref_emb, d) for q in range(12)]
    slope, icpt = naive_line([raw[i] for i in ref], d)
    np.testing.assert_allclose(s.predicted(range(12)), [slope * x + icpt for x in raw],
                               rtol=1e-12, atol=1e-14)
    first = s.select(0, range(12))
    s.update([p for p, _ in first], [np.ones(4)] * 2)  # training groups: not used
    np.testing.assert_array_equal(s.ref_difficulty, d)
    assert s.measure(1, range(12)) == []  # the round's second step: no new reference set
    second = s.select(1, range(12))
    ids = [p for p, _ in first + second]
    assert len(set(ids)) == 4 and all(n == 4 for _, n in first + second)
    assert len(s.measure(2, range(12))) == 3  # a new round


def test_dots_draws_moderate_difficulty_prompts_more_often():
    # two reference prompts far apart; candidates cluster near one or the other
    emb = np.array([[4.0, 0.0], [0.0, 4.0]] + [[4.0, 0.0]] * 5 + [[0.0, 4.0]] * 5)
    s = DotsScheduler(DotsConfig(prompts_per_step=3, group_size=2, reference_size=2,
                                 selection_interval=1, temperature=0.1, calibrate=False), emb)
    counts = np.zeros(12)
    for step in range(200):
        s.ref_ids, s.ref_difficulty = [0, 1], np.array([0.5, 0.0])
        s.measured = True
        for pid, _ in s.select(step, list(range(2, 12))):
            counts[pid] += 1
    near_half, easy = counts[2:7].sum(), counts[7:12].sum()
    w = selection_weights(np.array([0.5, 0.0]), 0.5, 0.1)
    assert w[0] / w[1] == pytest.approx(math.exp(5.0), rel=1e-14)
    # a tiny τ with every candidate far from α: the weights are shifted, never all 0
    np.testing.assert_allclose(selection_weights(np.array([0.0, 1.0, 0.95]), 0.5, 1e-4),
                               [0.0, 0.0, 1.0], rtol=0, atol=1e-200)  # exp(-500)
    np.testing.assert_allclose(selection_weights(np.array([0.0, 1.0]), 0.5, 1e-4), [1.0, 1.0])
    assert near_half > 0.9 * (near_half + easy)


# ----------------------------------------------------------------------------- DPS
def test_dps_one_step_by_hand():
    # α_0 = 1, λ = 0.7, π_0 = 1/3: prompt 0 observed partial, 1 unsolved, 2 only offered.
    # ξ[s, P] = 1/3 each, so α^0 rows = [1, 4/3, 1] -> A^0 rows = [0.3, 0.4, 0.3] and
    # μ^prior(0) = e_P A^0 = [0.3, 0.4, 0.3]; α^1 rows [4/3, 1, 1]: μ^prior(1)(P) = 0.3;
    # prompt 2: α stays 1, μ^prior = π_0 A_0 = 1/3 each.
    s = DpsScheduler(DpsConfig(prompts_per_step=1, group_size=4))
    s.select(0, [0, 1, 2])
    s.update([0, 1], [np.array([1.0, 0, 0, 1]), np.zeros(4)])
    np.testing.assert_allclose(s.prior[0], [0.3, 0.4, 0.3], rtol=1e-15)
    np.testing.assert_allclose(s.alpha[0], [[1, 4 / 3, 1]] * 3, rtol=1e-15)
    np.testing.assert_allclose(s.prior[1], [0.4, 0.3, 0.3], rtol=1e-15)
    np.testing.assert_allclose(s.prior[2], [1 / 3] * 3, rtol=1e-15)
    np.testing.assert_allclose(s.predicted([0, 1, 2, 9]), [0.4, 0.3, 1 / 3, 1 / 3],
                               rtol=1e-15)


def test_dps_observed_states():
    assert observe_state(np.zeros(4)) == 0
    assert observe_state(np.array([1.0, 0.0, 1.0])) == 1
    assert observe_state(np.ones(3)) == 2
    assert observe_state(np.array([0.6, 0.7]), correct_threshold=0.5) == 2


@pytest.mark.parametrize("noisy", [False, True])
def test_dps_scheduler_matches_the_official_recursions_over_several_steps(noisy):
    e = ((0.8, 0.15, 0.05), (0.1, 0.8, 0.1), (0.05, 0.15, 0.8)) if noisy else None
    cfg = DpsConfig(prompts_per_step=2, group_size=3, emission=e, forgetting=0.6,
                    prior=(0.6, 0.3, 0.1), stay_bonus=1.5)
    s = DpsScheduler(cfg)
    ref = NaiveDps(list(cfg.prior), [list(r) for r in cfg.emission],
                   [list(r) for r in cfg.transition_prior], 0.6)
    groups = [
        ([0, 1], [[0, 0, 0], [1, 0, 0]]),
        ([1, 2], [[1, 1, 0], [1, 1, 1]]),
        ([0, 2], [[1, 0, 0], [1, 1, 1]]),
        ([3, 1], [[0, 0, 0], [1, 1, 1]]),
        ([0, 3], [[1, 1, 1], [1, 0, 1]]),
    ]
    for step, (ids, rews) in enumerate(groups):
        offered = sorted(set(ids) | {4 + step})  # one more prompt offered, not sampled
        s.select(step, offered)
        for pid in offered:
            ref.known(pid)
        s.update(ids, [np.asarray(r, float) for r in rews])
        ref.train({i: observe_state(np.asarray(r, float)) for i, r in zip(ids, rews)})
        for pid in range(10):
            want = ref.pis[pid][1] if pid in ref.pis else cfg.prior[1]
            assert s.predicted([pid])[0] == pytest.approx(want, rel=1e-12)
        for pid in ref.alpha:  # α in the official column convention is our α transposed
            np.testing.assert_allclose(s.alpha[pid], np.array(ref.alpha[pid]).T, rtol=1e-12)


def test_dps_selects_the_prompts_predicted_partially_solved():
    s = DpsScheduler(DpsConfig(prompts_per_step=2, group_size=4))
    s.select(0, range(6))
    s.update([0, 1, 2, 3], [np.zeros(4), np.array([1.0, 0, 0, 1]), np.ones(4),
                            np.array([0, 1.0, 1, 1])])
    assert sorted(p for p, _ in s.select(1, range(6))) == [1, 3]  # 0.4 each
    s4 = DpsScheduler(DpsConfig(prompts_per_step=4, group_size=4))
    s4.restore(s.state())
    assert sorted(p for p, _ in s4.select(1, range(6))) == [1, 3, 4, 5]  # 1/3 beats 0.3


# ----------------------------------------------------------------------------- DARS
def test_dars_schedules_are_the_official_tables():
    acc = np.arange(9) / 8.0  # n = 8: accuracy 0, 1/8, ..., 1
    # resample_func1 (ET) and resample_func2 (HW) of the official ray_dars_trainer.py
    np.testing.assert_array_equal(schedule_total(acc, 8, "et", 32),
                                  [32, 18, 11, 9, 8, 8, 8, 8, 8])
    np.testing.assert_array_equal(schedule_total(acc, 8, "hw", 48),
                                  [48, 24, 12, 9, 8, 8, 8, 8, 8])
    np.testing.assert_array_equal(schedule_extra(acc, 8, "et"), [24, 10, 3, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(schedule_extra(acc, 8, "hw"), [40, 16, 4, 1, 0, 0, 0, 0, 0])


def test_dars_equal_treatment_lifts_the_cumulative_advantage_to_that_of_one_half():
    n = 16
    for k in range(1, 8):  # hard prompts of a group of 16
        a = k / n
        want = min(64, math.floor(n / (4 * a * (1 - a)) + 0.5))
        got = schedule_total(np.array([a]), n, "et", 64)[0]
        assert got == want
        # un-normalised advantages: 2 N a (1 - a) within one rollout's worth of n / 2
        assert got == 64 or abs(2 * got * a * (1 - a) - n / 2) <= 2 * a * (1 - a) * 0.5 + 1e-12
    np.testing.assert_allclose(schedule_extra(np.array([0.0, 0.25]), 8, "et", max_extra=16),
                               [16, 3])
    np.testing.assert_array_equal(apportion(10, np.array([1.0, 1.0, 1.0])), [4, 3, 3])
    np.testing.assert_array_equal(apportion(7, np.array([3.0, 0.0, 1.0])), [5, 0, 2])


@pytest.mark.parametrize("schedule", ["et", "hw"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dars_allocation_sums_to_the_budget_and_favours_hard_prompts(schedule, seed):
    rng = np.random.default_rng(seed)
    acc = rng.integers(0, 9, size=12) / 8.0
    for extra in (0, 5, 37, 96):
        alloc = dars_allocation(acc, 8, extra, schedule)
        assert alloc.sum() == extra and (alloc >= 0).all()
        for i in range(acc.size):
            for j in range(acc.size):
                if acc[i] < acc[j]:
                    assert alloc[i] >= alloc[j], (acc, alloc)
        if extra and (acc < 0.5).any():
            assert alloc[acc >= 0.5].sum() == 0


def test_dars_scheduler_two_stages_within_the_budget():
    cfg = DarsConfig(prompts_per_step=4, group_size=4, budget=24, schedule="et", max_extra=4)
    s = DarsScheduler(cfg)
    plan = s.select(0, [10, 11, 12, 13, 14])
    assert plan == [(10, 4), (11, 4), (12, 4), (13, 4)]
    with pytest.raises(ValueError, match="stage 1"):
        s.follow_up(0)
    s.update([10, 11, 12, 13], [np.zeros(4), np.array([1.0, 0, 0, 0]), np.ones(4),
                                np.array([1.0, 1, 0, 0])])
    extra = dict(s.follow_up(0))
    assert sum(extra.values()) == 24 - 16
    # wanted: N_max - n = 4 (a = 0) and round(4 / (4 · 3/16)) - 4 = 5 - 4 = 1 (a = 1/4);
    # 8 apportioned 4 : 1: quotas 6.4 and 1.6 -> 6 and 1, the rest to the larger remainder
    assert extra == {10: 6, 11: 2}


# ----------------------------------------------------------------------------- uniform
def test_uniform_is_todays_stream_order():
    task = SyntheticTask(kind="reverse", length=3, alphabet=3)
    s = UniformScheduler(UniformConfig(prompts_per_step=4, group_size=3))
    for pos in (0, 4, 8):
        prompts = task.train_prompts(pos, 4)
        plan = s.select(pos // 4, [p.index for p in prompts])
        assert plan == [(pos + i, 3) for i in range(4)]
        s.update([p for p, _ in plan], [np.zeros(3)] * 4)
        assert s.follow_up(pos // 4) == []
    with pytest.raises(ValueError, match="prompts_per_step=4"):
        s.select(0, [0, 1])


# ----------------------------------------------------------------------------- state
def _schedulers():
    emb = np.random.default_rng(3).normal(size=(16, 3))
    return [
        lambda: make_scheduler("uniform", prompts_per_step=3, group_size=2),
        lambda: make_scheduler("dots", embeddings=emb, reference_size=4, selection_interval=2,
                               prompts_per_step=3, group_size=2, temperature=0.05),
        lambda: make_scheduler("dps", prompts_per_step=3, group_size=2, forgetting=0.8),
        lambda: make_scheduler("dars", prompts_per_step=3, group_size=2, budget=10),
    ]


def _drive(s, steps, start, rewards_rng):
    """Run `steps` scheduler steps (select, update, follow_up, update); the decisions."""
    out = []
    for step in range(start, start + steps):
        cands = list(range(4, 16)) if s.name in ("dots", "dps") else list(range(step * 3,
                                                                              step * 3 + 3))
        probe = s.measure(step, cands)
        if probe:
            s.update(probe, [rewards_rng.integers(0, 2, size=2).astype(float) for _ in probe])
        plan = s.select(step, cands)
        s.update([p for p, _ in plan],
                 [rewards_rng.integers(0, 2, size=n).astype(float) for _, n in plan])
        extra = s.follow_up(step)
        if extra:
            s.update([p for p, _ in extra],
                     [rewards_rng.integers(0, 2, size=n).astype(float) for _, n in extra])
        out.append((plan, extra))
    return out


@pytest.mark.parametrize("index", range(4))
def test_state_restore_round_trip_gives_identical_decisions(index):
    make = _schedulers()[index]
    s = make()
    assert isinstance(s, PromptScheduler)
    _drive(s, 3, 0, np.random.default_rng(7))  # DOTS: saved in the middle of a round
    saved = json.loads(json.dumps(s.state()))  # plain JSON, as a checkpoint holds it
    fresh = make()
    fresh.restore(saved)
    a = _drive(s, 4, 3, np.random.default_rng(8))
    b = _drive(fresh, 4, 3, np.random.default_rng(8))
    assert a == b
    if s.name in ("dots", "dps"):  # the history matters: a fresh scheduler decides otherwise
        c = _drive(make(), 4, 3, np.random.default_rng(8))
        assert c != a


def test_restoring_another_schedulers_state_is_refused():
    dps = make_scheduler("dps", prompts_per_step=2, group_size=2)
    with pytest.raises(ValueError, match="cannot restore"):
        dps.restore(make_scheduler("dars").state())


# ----------------------------------------------------------------------------- configs
@pytest.mark.parametrize("build,match", [
    (lambda: UniformConfig(prompts_per_step=0), "prompts_per_step"),
    (lambda: DotsConfig(reference_size=0), "reference_size"),
    (lambda: DotsConfig(selection_interval=0), "selection_interval"),
    (lambda: DotsConfig(temperature=0.0), "temperature"),
    (lambda: DpsConfig(forgetting=1.5), "forgetting"),
    (lambda: DpsConfig(emission=((1.0, 0.0),)), "emission"),
    (lambda: DarsConfig(prompts_per_step=4, group_size=4, budget=10), "budget"),
    (lambda: DarsConfig(schedule="xx"), "schedule"),
    (lambda: make_scheduler("dots"), "embeddings"),
    (lambda: make_scheduler("nope"), "unknown prompt scheduler"),
])
def test_bad_configs_raise_early_with_a_message(build, match):
    with pytest.raises(ValueError, match=match):
        build()
