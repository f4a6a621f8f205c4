"""Rollout engine tests on the tiny model: continuous batching of whole groups, harvested
Trajectory contents against a full-forward recomputation, version stamps per segment,
extract/resume (exact continuation with the same params; correct log-probs under new
params), and input validation. Geometry matches tests/rl/test_sampling.py (8 slots,
prompts <= 8, 24 new tokens, T = 0.7) so compiled functions are shared."""
import math

import numpy as np
import pytest

from models.config import get_config
from models.decoder import forward, init_params
from rl.rollout import PartialGroup, RolloutConfig, RolloutEngine, SamplingConfig
from rl.trajectory import Trajectory, concat_trajectories

CFG = get_config("tiny")
N, SEG, R_MAX = 4, 8, 24
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 200], [7, 7, 8], [100, 101, 102, 103], [60]]


def rollout_config(stop_ids=(), seed=0):
    return RolloutConfig(num_slots=8, group_size=N, segment_len=SEG, max_prompt_len=8,
                         max_new_tokens=R_MAX, sampling=SamplingConfig(temperature=0.7),
                         stop_ids=stop_ids, seed=seed)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


@pytest.fixture(scope="module")
def params_b():
    return init_params(CFG, 1)


def ref_logprobs(params, traj: Trajectory, temperature=0.7):
    """[B, R_max] float64 log softmax(logits / T) at the response tokens (0 where masked),
    from one padded full-forward call."""
    b = traj.batch_size
    rows = -(-b // 8) * 8
    toks = np.zeros((rows, 32), np.int32)
    plen, rlen = np.asarray(traj.prompt_lengths), np.asarray(traj.response_lengths)
    for i in range(b):
        toks[i, :plen[i]] = np.asarray(traj.prompt_ids[i, :plen[i]])
        toks[i, plen[i]:plen[i] + rlen[i]] = np.asarray(traj.response_ids[i, :rlen[i]])
    logits = np.concatenate([np.asarray(forward(params, CFG, toks[i:i + 8]))  # one shape
                             for i in range(0, rows, 8)]).astype(np.float64)
    out = np.zeros((b, R_MAX))
    for i in range(b):
        for t in range(rlen[i]):
            z = logits[i, plen[i] - 1 + t] / temperature
            out[i, t] = z[toks[i, plen[i] + t]] - (z.max() + math.log(np.exp(z - z.max()).sum()))
    return out


def run_to_end(engine, params, first_version=0):
    """Step until idle; version = step index. Returns (trajectories, StepInfos)."""
    trajs, infos, v = [], [], first_version
    while not engine.idle:
        infos.append(engine.step(params, v))
        v += 1
        if (t := engine.harvest()) is not None:
            trajs.append((v - 1, t))
    return trajs, infos


def test_engine_continuous_batching_and_trajectories(params):
    # 40 frequent stop ids make responses end at different lengths.
    stops = tuple(range(100, 140))
    engine = RolloutEngine(CFG, rollout_config(stop_ids=stops), prompts=iter(PROMPTS))
    trajs, infos = run_to_end(engine, params)
    assert infos[0].started_groups == 2  # 8 slots = 2 groups at a time
    assert sum(i.started_groups for i in infos) == len(PROMPTS)
    assert any(i.started_groups for i in infos[1:])  # freed slots were refilled
    traj = concat_trajectories([t for _, t in trajs])
    gids = np.asarray(traj.group_ids)
    assert sorted(gids.tolist()) == sorted(list(range(len(PROMPTS))) * N)
    np.testing.assert_allclose(np.asarray(traj.behaviour_logprobs) * np.asarray(traj.response_mask),
                               ref_logprobs(params, traj), atol=1e-4)
    resp, mask = np.asarray(traj.response_ids), np.asarray(traj.response_mask)
    lengths, finished = mask.sum(1), np.asarray(traj.finished)
    assert traj.num_tokens() == lengths.sum() == sum(i.new_tokens for i in infos)
    assert len(set(lengths.tolist())) > 2
    for i in range(traj.batch_size):
        body = resp[i, :lengths[i]]
        assert not np.isin(body[:-1], stops).any()  # stopped at the first stop id
        assert finished[i] == np.isin(body[-1], stops)
        assert finished[i] or lengths[i] == R_MAX
        np.testing.assert_array_equal(np.asarray(traj.prompt_ids[i, :traj.prompt_lengths[i]]),
                                      PROMPTS[gids[i]])
    # A live slot advances exactly SEG tokens per step, so token t of a group started at
    # step s carries version s + t // SEG.
    start = {}
    g = 0
    for step, info in enumerate(infos):
        for _ in range(info.started_groups):
            start[g] = step
            g += 1
    versions = np.asarray(traj.versions)
    for i in range(traj.batch_size):
        expect = start[gids[i]] + np.arange(lengths[i]) // SEG
        np.testing.assert_array_equal(versions[i, :lengths[i]], expect)
    assert engine.num_free_slots == 8 and engine.num_active_groups == 0


def _groups_by_id(traj):
    gids = np.asarray(traj.group_ids)
    return {int(g): np.nonzero(gids == g)[0] for g in np.unique(gids)}


def test_extract_resume_same_params_is_exact(params):
    # Stop id = the first token of group 0 / sample 0 in a free run, so that sample is
    # already done when its group is extracted (a partly finished group).
    free = RolloutEngine(CFG, rollout_config())
    free.submit(PROMPTS[:2])
    ref0 = concat_trajectories([t for _, t in run_to_end(free, params)[0]])
    stop = int(ref0.response_ids[0, 0])
    stops = (stop,)

    ref_engine = RolloutEngine(CFG, rollout_config(stops))
    ref_engine.submit(PROMPTS[:2])
    ref = concat_trajectories([t for _, t in run_to_end(ref_engine, params)[0]])

    engine = RolloutEngine(CFG, rollout_config(stops))
    engine.submit(PROMPTS[:2])
    engine.step(params, 0)
    parts = engine.extract_unfinished()
    assert [p.group_id for p in parts] == [0, 1] and engine.num_free_slots == 8
    assert parts[0].samples[0].done and parts[0].num_generated[0] == 1
    assert all(n == SEG for p in parts for n in p.num_generated[1:])
    engine.resume(parts[::-1])  # group 1 now lands in slots 0-3, group 0 in 4-7
    got = concat_trajectories([t for _, t in run_to_end(engine, params, first_version=1)[0]])
    rg, gg = _groups_by_id(ref), _groups_by_id(got)
    assert rg.keys() == gg.keys() == {0, 1}
    for g in (0, 1):
        r, o = rg[g], gg[g]
        np.testing.assert_array_equal(np.asarray(got.response_ids)[o], np.asarray(ref.response_ids)[r])
        np.testing.assert_array_equal(np.asarray(got.response_mask)[o], np.asarray(ref.response_mask)[r])
        np.testing.assert_allclose(np.asarray(got.behaviour_logprobs)[o],
                                   np.asarray(ref.behaviour_logprobs)[r], atol=1e-4)
        for j, row in enumerate(o):
            part = next(p for p in parts if p.group_id == g).samples[j]
            n = part.num_generated
            np.testing.assert_array_equal(np.asarray(got.behaviour_logprobs[row, :n]), part.logprobs)
            np.testing.assert_array_equal(np.asarray(got.versions[row, :n]), 0)
            length = int(got.response_lengths[row])
            assert (np.asarray(got.versions[row, n:length]) >= 1).all()
    assert bool(got.finished[gg[0][0]]) and int(got.response_lengths[gg[0][0]]) == 1


def test_resume_under_new_params(params, params_b):
    engine = RolloutEngine(CFG, rollout_config())
    engine.submit([PROMPTS[1]])
    engine.step(params, 0)
    (part,) = engine.extract_unfinished()
    assert part.num_generated == [SEG] * N
    engine.resume([part])
    trajs, _ = run_to_end(engine, params_b, first_version=1)
    traj = concat_trajectories([t for _, t in trajs])
    lp, v = np.asarray(traj.behaviour_logprobs), np.asarray(traj.versions)
    np.testing.assert_array_equal(np.asarray(traj.response_lengths), R_MAX)  # budget 24 - 8 left
    assert (v[:, :SEG] == 0).all() and (v[:, SEG:] >= 1).all()
    ref_a, ref_b = ref_logprobs(params, traj), ref_logprobs(params_b, traj)
    for j, s in enumerate(part.samples):
        np.testing.assert_array_equal(np.asarray(traj.response_ids[j, :SEG]), s.response_ids)
        np.testing.assert_array_equal(lp[j, :SEG], s.logprobs)
        np.testing.assert_allclose(lp[j, :SEG], ref_a[j, :SEG], atol=1e-4)
    # The resumed KV was rebuilt with params_b, so new tokens' log-probs are exactly those
    # of params_b's full forward.
    np.testing.assert_allclose(lp[:, SEG:], ref_b[:, SEG:], atol=1e-4)


def test_trajectory_validation():
    good = dict(prompt_ids=np.ones((2, 3)), prompt_lengths=[3, 1], response_ids=np.ones((2, 4)),
                response_mask=[[1, 1, 0, 0], [1, 0, 0, 0]], behaviour_logprobs=-np.ones((2, 4)),
                versions=np.zeros((2, 4)), group_ids=[0, 0], finished=[True, False],
                truncated=[False, True])
    traj = Trajectory.create(**good)
    assert traj.num_tokens() == 3
    assert traj.with_rewards({"acc": [1.0, 0.0]}).rewards["acc"].shape == (2,)
    for change, match in [
        (dict(response_mask=[[0, 1, 0, 0], [1, 0, 0, 0]]), "prefix"),
        (dict(prompt_lengths=[0, 1]), "prompt_lengths"),
        (dict(versions=np.zeros((2, 3))), "versions"),
        (dict(behaviour_logprobs=np.ones((2, 4))), "behaviour_logprobs"),
        (dict(finished=[True, False], truncated=[True, True]), "both finished and truncated"),
        (dict(rewards={"acc": [np.nan, 1.0]}), "non-finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            Trajectory.create(**{**good, **change})


def test_engine_bad_inputs(params):
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        RolloutConfig(num_slots=8, group_size=0, segment_len=8, max_prompt_len=8, max_new_tokens=8)
    with pytest.raises(ValueError, match="num_slots=2 cannot hold"):
        RolloutConfig(num_slots=2, group_size=4, segment_len=8, max_prompt_len=8, max_new_tokens=8)
    with pytest.raises(ValueError, match="stop_ids"):
        RolloutEngine(CFG, rollout_config(stop_ids=(256,)))
    engine = RolloutEngine(CFG, rollout_config())
    with pytest.raises(ValueError, match="empty"):
        engine.submit([[]])
    with pytest.raises(ValueError, match="10 tokens, longer than the cache's max_prompt_len=8"):
        engine.submit([list(range(1, 11))])
    with pytest.raises(ValueError, match="group_size=4"):
        engine.resume([PartialGroup(group_id=0, prompt_ids=np.array([1]), samples=())])
    engine = RolloutEngine(CFG, rollout_config(), prompts=iter([[3, 4], []]))
    with pytest.raises(ValueError, match="empty"):
        engine.step(params, 0)
