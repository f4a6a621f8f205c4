"""UloRL: segment rollouts of S tokens per engine step equal one long call; params
swapped between segments give new-version tokens drawn from the new params (checked by
teacher forcing through models.decoder prefill/decode_step in float64); DMMPT against a
loop reference; the POIS / SAIS ratio modes; bad arguments."""
import dataclasses

import numpy as np
import pytest

from models.config import get_config
from models.decoder import decode_step, init_params, prefill
from models.kv_cache import init_cache
from rl.learner import (
    OffPolicyConfig,
    TrainConfig,
    apply_ratio_mode,
    batch_from_trajectory,
    dmmpt_mask,
    ratio_mode_changes,
)
from rl.rollout import RolloutConfig, RolloutEngine, SamplingConfig
from rl.trajectory import concat_trajectories

# Same geometry as tests/rl/test_rollout.py (compiled sampler functions are shared).
CFG = get_config("tiny")
N, R_MAX, TEMP = 4, 24, 0.7
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 200]]
STOPS = tuple(range(100, 116))  # ~6% stop chance per token: ragged lengths


def _run(segment_len, params_per_step):
    rc = RolloutConfig(num_slots=8, group_size=N, segment_len=segment_len, max_prompt_len=8,
                       max_new_tokens=R_MAX, sampling=SamplingConfig(temperature=TEMP),
                       stop_ids=STOPS, seed=3)
    engine = RolloutEngine(CFG, rc)
    engine.submit(PROMPTS)
    parts, step = [], 0
    while not engine.idle:
        engine.step(params_per_step(step), step)
        step += 1
        if (t := engine.harvest()) is not None:
            parts.append(t)
    traj = concat_trajectories(parts)
    order = np.argsort(np.asarray(traj.group_ids), kind="stable")
    return {k: np.asarray(getattr(traj, k))[order] for k in
            ("response_ids", "response_mask", "behaviour_logprobs", "versions", "prompt_ids",
             "prompt_lengths")}


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0), init_params(CFG, 1)


def test_segments_of_s_equal_one_long_call(params):
    p0, _ = params
    seg = _run(8, lambda s: p0)
    one = _run(R_MAX, lambda s: p0)
    lengths = seg["response_mask"].sum(1)
    assert len(set(lengths.tolist())) > 2  # ragged: some stopped early, some ran to 24
    for k in ("response_ids", "response_mask"):
        np.testing.assert_array_equal(seg[k], one[k])
    np.testing.assert_allclose(seg["behaviour_logprobs"], one["behaviour_logprobs"], atol=1e-5)
    # version = the step that drew the token: token t of the segmented run is in step t // 8
    t = np.arange(R_MAX)[None, :]
    np.testing.assert_array_equal(seg["versions"][seg["response_mask"]],
                                  np.broadcast_to(t // 8, seg["versions"].shape)[seg["response_mask"]])
    assert (one["versions"][one["response_mask"]] == 0).all()


def _teacher_forced_logprobs(rows, p0, p1, s):
    """float64 log softmax(logits / T) of each response token, decoding tokens 0..s-1 with
    p0 and the rest with p1, without recomputing earlier keys/values (as the sampler)."""
    b = rows["prompt_ids"].shape[0]
    plen = rows["prompt_lengths"]
    cache = init_cache(CFG, b, 8 + R_MAX)
    logits, cache = prefill(p0, CFG, rows["prompt_ids"], plen, cache)
    z = np.asarray(logits, np.float64)[np.arange(b), plen - 1]
    out = np.zeros((b, R_MAX))
    for t in range(R_MAX):
        z = z / TEMP
        lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
        out[:, t] = z[np.arange(b), rows["response_ids"][:, t]] - lse
        if t + 1 < R_MAX:
            logits, cache = decode_step(p0 if t + 1 < s else p1, CFG, rows["response_ids"][:, t], cache)
            z = np.asarray(logits, np.float64)
    return np.where(rows["response_mask"], out, 0.0)


def test_params_swapped_between_segments(params):
    p0, p1 = params
    s = 8
    same = _run(s, lambda step: p0)
    swapped = _run(s, lambda step: p0 if step == 0 else p1)
    mask = swapped["response_mask"]
    # Before the swap nothing changes; after it tokens carry version >= 1.
    np.testing.assert_array_equal(swapped["response_ids"][:, :s], same["response_ids"][:, :s])
    v = swapped["versions"]
    assert (v[:, :s][mask[:, :s]] == 0).all() and (v[:, s:][mask[:, s:]] >= 1).all()
    assert mask[:, s:].any()
    assert not np.array_equal(swapped["response_ids"][mask], same["response_ids"][mask])
    # μ after the swap is p1's distribution (over the p0-made prefix cache).
    ref = _teacher_forced_logprobs(swapped, p0, p1, s)
    np.testing.assert_allclose(swapped["behaviour_logprobs"], ref, atol=1e-4)


def _dmmpt_loop(probs, rewards, ent, mask, p_thr, e_thr):
    out = mask.copy()
    for i in range(probs.shape[0]):
        toks = [t for t in range(probs.shape[1]) if mask[i, t]]
        h = sum(float(ent[i, t]) for t in toks) / max(len(toks), 1)
        if rewards[i] == 1.0 and h < e_thr:
            for t in toks:
                if probs[i, t] >= p_thr:
                    out[i, t] = False
    return out


def test_dmmpt_mask_matches_loop():
    rng = np.random.default_rng(0)
    b, t = 12, 9
    probs = np.where(rng.random((b, t)) < 0.5, 0.995, rng.random((b, t)))
    probs[0, 0] = 0.99  # exactly at the threshold: masked
    rewards = rng.choice([0.0, 1.0, 0.5], size=b)
    rewards[:4] = 1.0
    ent = rng.uniform(0.0, 0.4, (b, t))
    ent[0] = 0.05
    mask = np.arange(t)[None] < rng.integers(0, t + 1, b)[:, None]
    mask[0, :3] = True
    got = np.asarray(dmmpt_mask(probs, rewards, ent, mask))
    ref = _dmmpt_loop(probs, rewards, ent, mask, 0.99, 0.2)
    np.testing.assert_array_equal(got, ref)
    assert not got[0, 0] and (got != mask).any() and (got <= mask).all()
    # Mean entropies given directly: same mask.
    mean_h = np.array([ent[i][mask[i]].mean() if mask[i].any() else 0.0 for i in range(b)])
    np.testing.assert_array_equal(np.asarray(dmmpt_mask(probs, rewards, mean_h, mask)), ref)
    # Other thresholds.
    np.testing.assert_array_equal(np.asarray(dmmpt_mask(probs, rewards, ent, mask, 0.5, 0.3)),
                                  _dmmpt_loop(probs, rewards, ent, mask, 0.5, 0.3))
    with pytest.raises(ValueError, match="rewards must be"):
        dmmpt_mask(probs, rewards[:3], ent, mask)
    with pytest.raises(ValueError, match="entropies must be"):
        dmmpt_mask(probs, rewards, ent[:, :2], mask)
    with pytest.raises(ValueError, match="p_threshold"):
        dmmpt_mask(probs, rewards, ent, mask, p_threshold=0.0)


def test_ratio_modes():
    from test_trainer import CFG as TCFG
    from test_trainer import GROUP, make_traj

    batch = batch_from_trajectory(make_traj(1), group_size=GROUP, model_config=TCFG)
    config = TrainConfig(old_logp="versions", offpolicy=OffPolicyConfig(correction="truncated_is"))
    c, b = apply_ratio_mode(config, batch, "pois")
    assert c.old_logp == "current" and c.offpolicy == OffPolicyConfig() and b.proximal_logprobs is None
    assert dataclasses.replace(c, old_logp="versions", offpolicy=config.offpolicy) == config
    c, b = apply_ratio_mode(config, batch, "sais")
    assert c.old_logp == "behaviour" and c.offpolicy == config.offpolicy
    prox = np.full(batch.tokens.shape, -1.0, np.float32)
    c, b = apply_ratio_mode(config, batch, "sais", prox)
    assert c.old_logp == "proximal" and b.proximal_logprobs is prox
    with pytest.raises(ValueError, match="ratio mode must be one of"):
        ratio_mode_changes("is")
    with pytest.raises(ValueError, match="takes no proximal_logprobs"):
        ratio_mode_changes("pois", prox)
    with pytest.raises(ValueError, match="expected the batch's tokens shape"):
        apply_ratio_mode(config, batch, "sais", prox[:, :2])
