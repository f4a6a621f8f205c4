"""APRIL rounds of multi-turn episodes (rl/rollout/april_episodes.py) on the scripted
environment of test_multiturn, tool calls inline.

References: one plain MultiTurnEngine run over the same prompts with the same seed to the
end, all groups at once (the episodes APRIL cuts into rounds and carries over must be the
same episodes, token for token); a teacher-forced forward for the log-probs of episodes
that span rounds; the counting invariant written out by hand."""
import math

import numpy as np
import pytest

from rl.rollout.april import AprilConfig
from rl.rollout.april_episodes import EpisodeAprilRollout
from rl.rollout.multiturn import MultiTurnConfig, MultiTurnEngine
from rl.rollout.sampler_state import SamplingConfig
from tests.rl.test_multiturn import (
    CFG,
    T,
    ScriptedEnv,
    assert_rows_equal,
    check_against_forward,
    prompts,
    row_arrays,
)

N, B, GAMMA = 2, 2, 1.5
SLOTS = math.ceil(GAMMA * B) * N


def make_engine(seed, slots=SLOTS):
    return MultiTurnEngine(CFG, ScriptedEnv(), MultiTurnConfig(
        num_slots=slots, group_size=N, segment_len=3, sampling=SamplingConfig(temperature=T),
        seed=seed, max_concurrent_tool_calls=0))


def april(stream=None, seed=0):
    ps = prompts()
    return EpisodeAprilRollout(make_engine, iter(ps if stream is None else stream),
                               AprilConfig(over_provision=GAMMA), group_size=N, seed=seed,
                               prompt_of=lambda g: ps[g])


def rows_of(traj):
    return {(int(traj.group_ids[i]), i % N): row_arrays(traj, i) for i in range(traj.batch_size)}


@pytest.fixture(scope="module")
def params():
    from models.decoder import init_params
    return init_params(CFG, 0)


@pytest.fixture(scope="module")
def reference(params):
    """Every group run to its end in one engine, version 0 throughout."""
    eng = make_engine(0, slots=len(prompts()) * N)
    eng.submit(prompts())
    out = {}
    while not eng.idle:
        eng.step(params, 0)
        if (b := eng.harvest()) is not None:
            out.update(rows_of(b.trajectory))
    return out


def invariant(c):
    return c["submitted"] + c["restarted"] == (c["harvested"] + c["rejected"] + c["lost"]
                                               + c["in_engine"] + c["in_hand"])


@pytest.fixture(scope="module")
def rounds(params):
    """One EpisodeAprilRollout run to the end of the six prompts, round r at version r:
    [(trajectory, records, version, counts, last_round)] (shared by the tests below)."""
    ro, out = april(), []
    for version in range(10):
        try:
            traj, records = ro.collect(params, version, B)
        except ValueError as e:  # the six prompts are used up
            assert "exhausted" in str(e)
            break
        out.append((traj, records, version, ro.counts, dict(ro.last_round)))
    return out


def test_rounds_return_b_groups_and_carry_the_rest_unchanged(rounds, reference):
    got = {}
    for traj, records, _, c, last in rounds:
        assert traj.batch_size == len(records) <= B * N and invariant(c)
        assert c["submitted"] <= len(prompts())
        got.update(rows_of(traj))
    assert any(last["carried"] > 0 for *_, last in rounds)  # the rounds cut episodes
    assert sorted(got) == sorted(reference)  # every group exactly once, none lost
    for key, row in got.items():
        # same params in every round: a carried episode goes on as if never cut, so its
        # tokens equal the reference's (versions aside: those are the rounds')
        assert_rows_equal(row[:5], reference[key][:5])


def test_carried_episodes_keep_each_tokens_version(rounds):
    spans = []
    for traj, _, version, _, _ in rounds:
        for i in range(traj.batch_size):
            _, r, _, env, _, ver = row_arrays(traj, i)
            assert np.all(np.diff(ver) >= 0) and ver.max() <= version
            # an observation token has the version of the model token before it
            for t in np.flatnonzero(env):
                assert t > 0 and ver[t] == ver[t - 1]
            spans.append(ver.max() - ver.min())
    assert max(spans) >= 1  # some episode spans rounds, i.e. weight versions
    assert rounds[-1][3]["resumed"] > 0


def test_log_probs_of_episodes_across_rounds_match_a_forward(params, rounds):
    check_against_forward(params, [(traj, i, records[i]) for traj, records, *_ in rounds
                                   for i in range(traj.batch_size)])


def test_a_restore_restarts_the_carried_groups_first(params):
    ps = prompts()
    first = april()
    traj, _ = first.collect(params, 0, B)
    seen = [int(g) for g in np.unique(np.asarray(traj.group_ids))]
    state = first.state_dict()
    carried = [int(x) for x in state["carried"]]
    assert carried and invariant(first.counts)
    submitted = int(state["counts"]["submitted"])
    resumed = april(stream=ps[submitted:])
    resumed.load_state_dict(state)
    c = resumed.counts
    assert c["lost"] == len(carried) and c["to_restart"] == len(carried) and invariant(c)
    assert c["wasted_tokens"] > 0  # the lost groups' tokens, never trained
    order = []
    for version in range(1, 10):
        try:
            traj, _ = resumed.collect(params, version, B)
        except ValueError:
            break
        order += sorted({int(g) for g in np.asarray(traj.group_ids)})
        assert invariant(resumed.counts)
    assert resumed.counts["restarted"] == len(carried)
    assert sorted(seen + order) == list(range(len(ps)))  # each prompt once: none skipped


def test_rejected_groups_are_counted_and_replaced(params):
    ro = april()
    seen = []

    def accept(group):
        seen.append(int(np.asarray(group.group_ids)[0]))
        return seen[-1] != 0  # reject group 0

    traj, _ = ro.collect(params, 0, B, accept=accept)
    assert 0 not in set(np.asarray(traj.group_ids).tolist()) and traj.batch_size == B * N
    assert ro.counts["rejected"] == 1 and invariant(ro.counts)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="AprilConfig"):
        EpisodeAprilRollout(make_engine, iter(prompts()), {"over_provision": 2}, group_size=N,
                            seed=0)
    ro = april()
    with pytest.raises(ValueError, match="num_groups"):
        ro.collect(None, 0, 0)
    with pytest.raises(ValueError, match="version"):
        ro.collect(None, -1, 1)
    with pytest.raises(ValueError, match="not a april_episodes state"):
        ro.load_state_dict({"strategy": "april_episodes"})
