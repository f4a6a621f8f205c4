"""Prompt schedulers (rl.schedulers): DOTS's difficulty estimate and DPS's HMM filter
against float64 hand computations (plain Python loops), DARS's allocation (sums to the
budget, hard prompts get more), state()/restore() round trips, uniform = stream order."""
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
from rl.schedulers.dars import apportion, dars_allocation, schedule_extra
from rl.schedulers.dots import predict_difficulty, selection_weights
from rl.schedulers.dps import filter_update, observe_state
from rl.tasks import SyntheticTask


# ----------------------------------------------------------------------------- references
def naive_difficulty(query, refs, ref_d):
    """d̂ by Python loops: softmax over the reference set of z_q . z_i / sqrt(h)."""
    h = len(query)
    logits = [sum(query[t] * r[t] for t in range(h)) / math.sqrt(h) for r in refs]
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    return sum(ei * di for ei, di in zip(e, ref_d)) / sum(e)


def matvec_left(b, a):
    """b A for a list b and a list-of-lists A."""
    return [sum(b[s] * a[s][t] for s in range(len(b))) for t in range(len(a[0]))]


class NaiveDps:
    """DPS's filter, transition learning and prediction written out with loops."""

    def __init__(self, prior, emission, alpha0, forgetting):
        self.prior, self.e, self.alpha0, self.lam = prior, emission, alpha0, forgetting
        self.n = [[0.0] * 3 for _ in range(3)]
        self.beliefs, self.last, self.clock = {}, {}, 0

    def a(self):
        rows = []
        for s in range(3):
            tot = sum(self.alpha0[s][t] + self.n[s][t] for t in range(3))
            rows.append([(self.alpha0[s][t] + self.n[s][t]) / tot for t in range(3)])
        return rows

    def predict(self, pid):
        a = self.a()
        if pid in self.beliefs:
            b, k = self.beliefs[pid], self.clock + 1 - self.last[pid]
        else:
            b, k = self.prior, 1
        for _ in range(k):
            b = matvec_left(b, a)
        return b[1]

    def update(self, obs_by_pid):
        a = self.a()
        self.clock += 1
        xi_total = [[0.0] * 3 for _ in range(3)]
        for pid, o in obs_by_pid:
            if pid in self.beliefs:
                b, k = self.beliefs[pid], self.clock - self.last[pid]
            else:
                b, k = self.prior, 1
            for _ in range(k - 1):
                b = matvec_left(b, a)
            xi = [[b[s] * a[s][t] * self.e[t][o] for t in range(3)] for s in range(3)]
            z = sum(sum(row) for row in xi)
            xi = [[x / z for x in row] for row in xi]
            if pid in self.beliefs:
                for s in range(3):
                    for t in range(3):
                        xi_total[s][t] += xi[s][t]
            self.beliefs[pid] = [sum(xi[s][t] for s in range(3)) for t in range(3)]
            self.last[pid] = self.clock
        self.n = [[self.lam * self.n[s][t] + xi_total[s][t] for t in range(3)]
                  for s in range(3)]


# ----------------------------------------------------------------------------- DOTS
def test_dots_difficulty_estimate_matches_a_float64_hand_computation():
    rng = np.random.default_rng(0)
    q, k, h = 5, 4, 3
    query, refs = rng.normal(size=(q, h)), rng.normal(size=(k, h)) * 2.0
    ref_d = rng.uniform(size=k)
    got = predict_difficulty(query, refs, ref_d)
    want = [naive_difficulty(query[i].tolist(), refs.tolist(), ref_d.tolist()) for i in range(q)]
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


def test_dots_scheduler_measures_reference_prompts_and_predicts_the_rest():
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(10, 4))
    cfg = DotsConfig(reference_ids=(0, 1, 2), prompts_per_step=4, group_size=4,
                     reference_per_step=3)
    s = DotsScheduler(cfg, emb)
    plan = s.select(0, list(range(3, 10)))
    assert [p for p, _ in plan[:3]] == [0, 1, 2] and all(n == 4 for _, n in plan)
    rewards = {0: [1, 1, 1, 0], 1: [0, 0, 0, 0], 2: [1, 0, 1, 0]}
    s.update([0, 1, 2], [np.asarray(rewards[i], float) for i in (0, 1, 2)])
    ref_d = [0.25, 1.0, 0.5]  # 1 - share correct
    np.testing.assert_allclose(s.ref_difficulty, ref_d, rtol=0, atol=0)
    for pid in (5, 9):
        want = naive_difficulty(emb[pid].tolist(), emb[:3].tolist(), ref_d)
        assert s.predicted([pid])[0] == pytest.approx(want, rel=1e-13)


def test_dots_draws_moderate_difficulty_prompts_more_often():
    # two reference prompts far apart; candidates cluster near one or the other
    emb = np.array([[4.0, 0.0], [0.0, 4.0]] + [[4.0, 0.0]] * 5 + [[0.0, 4.0]] * 5)
    s = DotsScheduler(DotsConfig(reference_ids=(0, 1), prompts_per_step=3, group_size=2,
                                 reference_per_step=0, temperature=0.1), emb)
    s.update([0, 1], [np.array([1.0, 0.0]), np.array([1.0, 1.0])])  # d = 0.5 and 0.0
    counts = np.zeros(12)
    for step in range(200):
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
def test_dps_filter_step_matches_a_float64_hand_computation():
    a = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.05, 0.15, 0.8]]
    e = [[0.8, 0.15, 0.05], [0.1, 0.8, 0.1], [0.05, 0.15, 0.8]]  # noisy observations
    b = [0.5, 0.3, 0.2]
    for steps, obs in ((1, 1), (3, 0), (2, 2)):
        post, xi = filter_update(np.array(b), np.array(a), np.array(e), steps, obs)
        bb = b
        for _ in range(steps - 1):
            bb = matvec_left(bb, a)
        ref = [[bb[s] * a[s][t] * e[t][obs] for t in range(3)] for s in range(3)]
        z = sum(map(sum, ref))
        np.testing.assert_allclose(xi, np.array(ref) / z, rtol=1e-14, atol=0)
        np.testing.assert_allclose(post, [sum(ref[s][t] for s in range(3)) / z
                                          for t in range(3)], rtol=1e-14, atol=0)


def test_dps_observed_states():
    assert observe_state(np.zeros(4)) == 0
    assert observe_state(np.array([1.0, 0.0, 1.0])) == 1
    assert observe_state(np.ones(3)) == 2
    assert observe_state(np.array([0.6, 0.7]), correct_threshold=0.5) == 2


@pytest.mark.parametrize("noisy", [False, True])
def test_dps_scheduler_matches_a_naive_filter_over_several_steps(noisy):
    e = ((0.8, 0.15, 0.05), (0.1, 0.8, 0.1), (0.05, 0.15, 0.8)) if noisy else None
    cfg = DpsConfig(prompts_per_step=2, group_size=3, emission=e, forgetting=0.9,
                    prior=(0.6, 0.3, 0.1))
    s = DpsScheduler(cfg)
    ref = NaiveDps(list(cfg.prior), [list(r) for r in cfg.emission],
                   [list(r) for r in cfg.transition_prior], 0.9)
    groups = [
        ([0, 1], [[0, 0, 0], [1, 0, 0]]),
        ([1, 2], [[1, 1, 0], [1, 1, 1]]),
        ([0, 2], [[1, 0, 0], [1, 1, 1]]),
        ([3, 1], [[0, 0, 0], [1, 1, 1]]),
        ([0, 3], [[1, 1, 1], [1, 0, 1]]),
    ]
    for ids, rews in groups:
        s.update(ids, [np.asarray(r, float) for r in rews])
        ref.update([(i, observe_state(np.asarray(r, float))) for i, r in zip(ids, rews)])
        for pid in range(5):  # 4 was never observed
            assert s.predicted([pid])[0] == pytest.approx(ref.predict(pid), rel=1e-12)
    np.testing.assert_allclose(s.counts, ref.n, rtol=1e-12)


def test_dps_selects_the_prompts_predicted_partially_solved():
    s = DpsScheduler(DpsConfig(prompts_per_step=2, group_size=4, stay_bonus=20.0))
    s.update([0, 1, 2, 3], [np.zeros(4), np.array([1.0, 0, 0, 1]), np.ones(4),
                            np.array([0, 1.0, 1, 1])])
    assert sorted(p for p, _ in s.select(1, [0, 1, 2, 3])) == [1, 3]


# ----------------------------------------------------------------------------- DARS
def test_dars_schedules_match_hand_computation():
    a = np.array([0.0, 0.25, 0.5, 0.75])
    et = schedule_extra(a, 8, "et", max_extra=16)
    np.testing.assert_allclose(et, [16.0, 8 * (1 / (2 * math.sqrt(0.25 * 0.75)) - 1), 0, 0],
                               rtol=1e-14)
    hw = schedule_extra(a, 8, "hw", max_extra=16)
    np.testing.assert_allclose(hw, [16.0, 8.0, 0.0, 0.0], rtol=1e-14)
    np.testing.assert_array_equal(apportion(10, np.array([1.0, 1.0, 1.0])), [4, 3, 3])
    np.testing.assert_array_equal(apportion(7, np.array([3.0, 0.0, 1.0])), [5, 0, 2])


@pytest.mark.parametrize("schedule", ["et", "hw"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dars_allocation_sums_to_the_budget_and_favours_hard_prompts(schedule, seed):
    rng = np.random.default_rng(seed)
    acc = rng.integers(0, 9, size=12) / 8.0
    for extra in (0, 5, 37, 96):
        alloc = dars_allocation(acc, 8, extra, schedule, max_extra=16)
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
    # wanted: 4 (capped) and 4 (1/(2 sqrt(3/16)) - 1) = 0.62; 8 apportioned: 7 and 1
    assert extra == {10: 7, 11: 1}


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
        lambda: make_scheduler("dots", embeddings=emb, reference_ids=(0, 1, 2, 3),
                               prompts_per_step=3, group_size=2, reference_per_step=1),
        lambda: make_scheduler("dps", prompts_per_step=3, group_size=2, forgetting=0.8),
        lambda: make_scheduler("dars", prompts_per_step=3, group_size=2, budget=10),
    ]


def _drive(s, steps, start, rewards_rng):
    """Run `steps` scheduler steps (select, update, follow_up, update); the decisions."""
    out = []
    for step in range(start, start + steps):
        cands = list(range(4, 16)) if s.name in ("dots", "dps") else list(range(step * 3,
                                                                              step * 3 + 3))
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
    _drive(s, 4, 0, np.random.default_rng(7))
    saved = json.loads(json.dumps(s.state()))  # plain JSON, as a checkpoint holds it
    fresh = make()
    fresh.restore(saved)
    a = _drive(s, 4, 4, np.random.default_rng(8))
    b = _drive(fresh, 4, 4, np.random.default_rng(8))
    assert a == b
    if s.name in ("dots", "dps"):  # the history matters: a fresh scheduler decides otherwise
        c = _drive(make(), 4, 4, np.random.default_rng(8))
        assert c != a


def test_restoring_another_schedulers_state_is_refused():
    dps = make_scheduler("dps", prompts_per_step=2, group_size=2)
    with pytest.raises(ValueError, match="cannot restore"):
        dps.restore(make_scheduler("dars").state())


# ----------------------------------------------------------------------------- configs
@pytest.mark.parametrize("build,match", [
    (lambda: UniformConfig(prompts_per_step=0), "prompts_per_step"),
    (lambda: DotsConfig(reference_ids=()), "reference_ids"),
    (lambda: DotsConfig(reference_ids=(1, 2), reference_per_step=3), "reference_per_step"),
    (lambda: DotsConfig(reference_ids=(1,), temperature=0.0), "temperature"),
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
