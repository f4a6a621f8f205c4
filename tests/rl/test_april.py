"""APRIL and its baselines on the tiny model: no rollout is ever discarded (every started
prompt is returned for training, rejected, or still in the FIFO / engine — counted), a
resumed response keeps its extracted tokens, log-probs and versions and its budget, the
FIFO is drained before new prompts, state_dict round trip (resumed samples continue
identically), static / continuous semantics, the off-policy prefix mask, bad input.
Geometry as tests/rl/test_rollout.py (8 slots, prompts <= 8, 24 new tokens, T = 0.7,
S = 8) so compiled sampler functions are shared."""
import dataclasses
import itertools

import jax
import numpy as np
import pytest

from models.config import get_config
from models.decoder import init_params
from rl.learner import batch_from_trajectory
from rl.rollout import (
    AprilConfig,
    AprilRollout,
    ContinuousRollout,
    RolloutConfig,
    SamplingConfig,
    StaticRollout,
    offpolicy_prefix_mask,
)

CFG = get_config("tiny")
N, SEG, R_MAX = 4, 8, 24
STOPS = tuple(range(100, 116))  # ~6% stop chance per token: a mix of short and capped responses
RC = RolloutConfig(num_slots=8, group_size=N, segment_len=SEG, max_prompt_len=8, max_new_tokens=R_MAX,
                   sampling=SamplingConfig(temperature=0.7), stop_ids=STOPS, seed=0)
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, 256, _rng.integers(1, 9)).tolist() for _ in range(200)]
ROUNDS, GROUPS = 5, 2


def invariant(c):
    return c["submitted"] == c["harvested"] + c["rejected"] + c["dropped"] + c["in_fifo"] + c["in_engine"]


def spy(ro):
    """Record the order of engine.resume / engine.submit calls (global ids for resumes)
    into the returned list."""
    log, eng = [], ro.engine
    real_resume, real_submit = eng.resume, eng.submit
    eng.resume = lambda gs: (log.extend(("resume", g.group_id) for g in gs), real_resume(gs))[1]
    eng.submit = lambda ps: (log.extend(("submit", None) for _ in ps), real_submit(ps))[1]
    return log


@pytest.fixture(scope="module")
def params():
    return [init_params(CFG, 0), init_params(CFG, 1)]


@pytest.fixture(scope="module")
def april_run(params):
    ro = AprilRollout(CFG, RC, iter(PROMPTS), AprilConfig(over_provision=2.0))
    rounds, log = [], spy(ro)
    for r in range(ROUNDS):
        fifo_before, start = ro.fifo, len(log)
        traj = ro.collect(params[r % 2], r, GROUPS)  # the "trainer" bumps the version each round
        rounds.append(dict(traj=traj, counts=ro.counts, fifo_before=fifo_before, fifo_after=ro.fifo,
                           log=log[start:], stats=dict(ro.last_round)))
    return ro, rounds


def test_april_never_discards_a_rollout(april_run):
    ro, rounds = april_run
    returned = []
    for r, rd in enumerate(rounds):
        c = rd["counts"]
        assert invariant(c) and c["dropped"] == 0 and c["in_engine"] == 0
        gids = np.asarray(rd["traj"].group_ids).reshape(-1, N)[:, 0].tolist()
        assert len(gids) == GROUPS and rd["traj"].batch_size == GROUPS * N
        assert c["submitted"] + c["resumed"] - rounds[r - 1]["counts"]["submitted"] * (r > 0) \
            - (rounds[r - 1]["counts"]["resumed"] if r else 0) == rd["stats"]["started"]
        assert rd["stats"]["started"] <= 4  # ⌈2.0 × 2⌉ starts per round
        returned += gids
        prompts = np.asarray(rd["traj"].prompt_ids)
        plen = np.asarray(rd["traj"].prompt_lengths)
        for i, g in enumerate(np.asarray(rd["traj"].group_ids)):
            assert prompts[i, :plen[i]].tolist() == PROMPTS[g]  # global id g = the g-th prompt
    final = rounds[-1]["counts"]
    fifo_ids = [g.group_id for g in rounds[-1]["fifo_after"]]
    # Every started prompt is either trained on or waiting in the FIFO: count them.
    assert len(returned) == len(set(returned)) == final["harvested"] == ROUNDS * GROUPS
    assert sorted(returned + fifo_ids) == list(range(final["submitted"]))
    assert final["resumed"] > 0 and max(len(rd["fifo_after"]) for rd in rounds) > 0
    assert sum(rd["stats"]["offpolicy_tokens"] for rd in rounds) > 0


def test_resumed_response_keeps_prefix_logprobs_versions_and_budget(april_run):
    _, rounds = april_run
    checked = 0
    for r, rd in enumerate(rounds[:-1]):
        for part in rd["fifo_after"]:
            for later in rounds[r + 1:]:
                traj = later["traj"]
                rows = np.nonzero(np.asarray(traj.group_ids) == part.group_id)[0]
                if rows.size == 0:
                    continue
                for j, s in zip(rows, part.samples):
                    k, length = s.num_generated, int(traj.response_lengths[j])
                    np.testing.assert_array_equal(np.asarray(traj.response_ids[j, :k]), s.response_ids)
                    np.testing.assert_array_equal(np.asarray(traj.behaviour_logprobs[j, :k]), s.logprobs)
                    np.testing.assert_array_equal(np.asarray(traj.versions[j, :k]), s.versions)
                    assert (np.asarray(traj.versions[j, :k]) <= r).all()
                    assert (np.asarray(traj.versions[j, k:length]) > r).all()  # made after resuming
                    # the budget counts from the response start: max_new_tokens − k remained
                    assert length <= R_MAX and (bool(traj.finished[j]) or length == R_MAX)
                    assert s.done or length > k
                    checked += int(k > 0)
                break
    assert checked > 0


def test_fifo_is_drained_before_new_prompts(april_run):
    _, rounds = april_run
    saw_fifo = False
    for rd in rounds:
        fifo = [g.group_id for g in rd["fifo_before"]]
        resumed = [g for kind, g in rd["log"] if kind == "resume"]
        kinds = [kind for kind, _ in rd["log"]]
        if not fifo:
            assert "resume" not in kinds
            continue
        saw_fifo = True
        # all FIFO groups (oldest first) go in before any new prompt
        first_submit = kinds.index("submit") if "submit" in kinds else len(kinds)
        assert resumed[:len(fifo)] == fifo
        assert kinds[:len(fifo)] == ["resume"] * len(fifo) and first_submit >= len(fifo)
    assert saw_fifo


def test_state_dict_round_trip(params):
    ro = AprilRollout(CFG, RC, iter(PROMPTS), AprilConfig(over_provision=2.0))
    for r in range(3):
        ro.collect(params[r % 2], r, GROUPS)
    if not ro.fifo:
        pytest.fail("setup should leave groups in the FIFO")
    sd = ro.state_dict()
    c = ro.counts
    back = AprilRollout(CFG, RC, itertools.islice(PROMPTS, c["submitted"], None),
                        AprilConfig(over_provision=2.0))
    back.load_state_dict(sd)
    assert back.counts == c
    sd2 = back.state_dict()
    for k, v in sd["fifo"].items():
        np.testing.assert_array_equal(sd2["fifo"][k], v)
    assert {k: int(v) for k, v in sd2["counts"].items()} == {k: int(v) for k, v in sd["counts"].items()}
    fifo_ids = [g.group_id for g in ro.fifo]
    a, b = ro.collect(params[1], 3, GROUPS), back.collect(params[1], 3, GROUPS)
    ga, gb = np.asarray(a.group_ids), np.asarray(b.group_ids)
    both = set(ga.tolist()) & set(gb.tolist()) & set(fifo_ids)
    assert both  # resumed FIFO groups came back in both
    for g in both:
        for f in ("response_ids", "response_mask", "behaviour_logprobs", "versions"):
            np.testing.assert_array_equal(np.asarray(getattr(a, f))[ga == g],
                                          np.asarray(getattr(b, f))[gb == g])
    new_ids = set(gb.tolist()) - set(fifo_ids)
    assert all(g >= c["submitted"] for g in new_ids)  # fresh global ids after a restore
    assert invariant(back.counts)
    with pytest.raises(ValueError, match="'static' rollout"):
        back.load_state_dict({**sd, "strategy": np.asarray("static")})


def test_static_and_continuous_baselines(params):
    st = StaticRollout(CFG, RC, iter(PROMPTS))
    # 40 stop ids (as test_rollout.py): group lengths vary more, so the round often ends
    # with a refilled group still running
    co = ContinuousRollout(CFG, dataclasses.replace(RC, stop_ids=tuple(range(100, 140))), iter(PROMPTS))
    wasted = 0
    for r in range(4):
        t = st.collect(params[0], r, GROUPS)
        lengths = np.asarray(t.response_lengths)
        # static waits for the longest of its two groups: steps = ⌈max length / S⌉
        assert st.last_round["steps"] == -(-lengths.max() // SEG)
        assert st.last_round["offpolicy_tokens"] == 0 and st.counts["in_fifo"] == 0
        assert st.counts["submitted"] == (r + 1) * GROUPS and invariant(st.counts)
        before = co.counts["wasted_tokens"]
        t = co.collect(params[0], r, GROUPS)
        assert t.batch_size == GROUPS * N and invariant(co.counts) and co.counts["in_engine"] == 0
        assert co.last_round["wasted_tokens"] == co.counts["wasted_tokens"] - before
        assert co.last_round["generated_tokens"] >= co.last_round["trained_tokens"] - \
            sum(np.asarray(t.response_lengths)[np.asarray(t.versions)[:, 0] < r])  # carried groups
        wasted += co.last_round["wasted_tokens"]
    assert co.counts["dropped"] > 0 and wasted > 0


def test_accept_rejects_are_counted_and_kept(params):
    ro = AprilRollout(CFG, RC, iter(PROMPTS), AprilConfig(over_provision=1.5))
    seen = []

    def even(g):  # the counts add up while the round is running too
        seen.append(invariant(ro.counts))
        return int(np.asarray(g.group_ids)[0]) % 2 == 0

    t = ro.collect(params[0], 0, GROUPS, accept=even)
    assert seen and all(seen)
    assert (np.asarray(t.group_ids) % 2 == 0).all() and t.batch_size == GROUPS * N
    rej = [int(np.asarray(g.group_ids)[0]) for g in ro.last_rejected]
    assert rej and all(g % 2 for g in rej) and ro.counts["rejected"] == len(rej)
    assert invariant(ro.counts)
    # A filter that rejects everything stops after max_rejected, losing nothing.
    ro = AprilRollout(CFG, RC, iter(PROMPTS), AprilConfig(max_rejected=3))
    with pytest.raises(ValueError, match="max_rejected=3"):
        ro.collect(params[0], 0, GROUPS, accept=lambda g: False)
    assert ro.counts["rejected"] == 4 and invariant(ro.counts) and ro.counts["in_engine"] == 0
    # An exception inside accept loses nothing either.
    ro = AprilRollout(CFG, RC, iter(PROMPTS))

    def boom(g):
        raise KeyError("reward server down")

    with pytest.raises(KeyError, match="reward server down"):
        ro.collect(params[0], 0, GROUPS, accept=boom)
    c = ro.counts
    assert invariant(c) and c["in_engine"] == 0 and c["in_fifo"] == c["submitted"] > 0


def test_offpolicy_prefix_mask(april_run):
    ro, rounds = april_run
    version = int(np.argmax([rd["stats"]["offpolicy_tokens"] for rd in rounds]))
    traj = rounds[version]["traj"]
    batch = batch_from_trajectory(traj, group_size=N, model_config=CFG,
                                  rewards={"r": np.zeros(traj.batch_size)})
    masked = AprilRollout(CFG, RC, iter(()), AprilConfig(mask_offpolicy_prefix=True))
    masked.round_version = version
    got = np.asarray(masked.apply_mask(batch).loss_mask)
    lm, ver = np.asarray(batch.loss_mask), np.asarray(batch.versions)
    ref = lm.copy()
    for b in range(lm.shape[0]):
        for t in range(lm.shape[1]):
            if lm[b, t] and ver[b, t] < version:
                ref[b, t] = False
    np.testing.assert_array_equal(got, ref)
    assert (got != lm).any()  # that round did return resumed prefixes
    assert ro.apply_mask(batch) is batch  # flag off: unchanged
    with pytest.raises(ValueError, match="same shape"):
        offpolicy_prefix_mask(ver[:, :3], lm, 1)


def test_bad_configs(params):
    for bad in (0.5, float("inf"), True, "2"):
        with pytest.raises(ValueError, match="over_provision"):
            AprilConfig(over_provision=bad)
    with pytest.raises(ValueError, match="mask_offpolicy_prefix"):
        AprilConfig(mask_offpolicy_prefix=1)
    with pytest.raises(ValueError, match="max_rejected"):
        AprilConfig(max_rejected=-1)
    with pytest.raises(ValueError, match="AprilConfig"):
        AprilRollout(CFG, RC, iter(PROMPTS), {"over_provision": 2})
    with pytest.raises(ValueError, match="RolloutConfig"):
        StaticRollout(CFG, {"num_slots": 8}, iter(PROMPTS))
    ro = AprilRollout(CFG, RC, iter(PROMPTS))
    with pytest.raises(ValueError, match="num_groups"):
        ro.collect(params[0], 0, 0)
    with pytest.raises(ValueError, match="version"):
        ro.collect(params[0], -1, 1)
    with pytest.raises(ValueError, match="accept"):
        ro.collect(params[0], 0, 1, accept=3)
    with pytest.raises(ValueError, match="apply_mask: no round"):
        AprilRollout(CFG, RC, iter(()), AprilConfig(mask_offpolicy_prefix=True)).apply_mask(None)
    with pytest.raises(ValueError, match="exhausted"):
        AprilRollout(CFG, RC, iter(())).collect(params[0], 0, 1)
    with pytest.raises(ValueError, match="not a AprilRollout state dict"):
        ro.load_state_dict({"fifo": {}})


def test_complete_group_carried_through_the_engine_is_unchanged(params):
    """Complete groups beyond num_groups go back through the FIFO as all-done
    PartialGroups: the engine must hand them back exactly as they were harvested."""
    from rl.rollout import RolloutEngine
    from rl.rollout.april import _as_partial

    engine = RolloutEngine(CFG, RC)
    engine.submit(PROMPTS[:2])
    parts = []
    while not engine.idle:
        engine.step(params[0], 0)
        if (t := engine.harvest()) is not None:
            parts.append(t)
    first = jax.tree.map(lambda x: np.asarray(x)[:N], parts[0])
    again = RolloutEngine(CFG, RC)
    again.resume([_as_partial(first, R_MAX)])
    info = again.step(params[1], 7)
    back = again.harvest()
    assert info.new_tokens == 0 and back.batch_size == N and again.idle
    for f in ("prompt_ids", "prompt_lengths", "response_ids", "response_mask", "behaviour_logprobs",
              "versions", "group_ids", "finished", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(getattr(first, f)), err_msg=f)
