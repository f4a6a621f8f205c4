"""A new off-policy correction and a new old-log-prob source are each one function and one
decorator, written here, with no edit under rl/learner/: the config accepts their names,
the train step's loss equals a float64 hand computation with them, and a short run trains
with them through the harness (rl.loops.run), logging the correction's metric.

The correction is a two-sided token mask of the train/inference ratio (keep a token when
1/c <= π_prox/μ <= c, weight it π_prox/μ); the source is the geometric midpoint of π_θ and
μ (log π_prox = (log π_θ + log μ) / 2, detached)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sync_loop import LOOP, PRESET, cfg, policy  # noqa: F401  (same geometry)

from models.config import get_config
from models.decoder import forward, init_params
from rl.learner import OffPolicyConfig, TrainConfig, batch_from_trajectory, init_train_state
from rl.learner.jitted import make_train_step
from rl.learner.old_logp import available_old_logp, register_old_logp
from rl.loops import AsyncConfig, run
from rl.objectives import (AdvantageConfig, LossConfig, OffPolicyWeights, available_corrections,
                           masked_mean, register_correction)
from rl.trajectory import Trajectory

CAP = 1.5


@register_correction("test_two_sided", modes=(None,), levels=("token",))
def two_sided(prox_logp, behaviour_logp, mask, *, level="token", cap=None, mode=None):
    c = CAP if cap is None else cap
    m = mask.astype(bool)
    log_w = jnp.where(m, jax.lax.stop_gradient(prox_logp - behaviour_logp), 0.0)
    keep = m & (jnp.abs(log_w) <= jnp.log(c))
    w = jnp.where(keep, jnp.exp(log_w), 0.0)
    return OffPolicyWeights(w, keep, {"two_sided_kept_frac": masked_mean(keep, m)})


@register_old_logp("test_midpoint")
def midpoint(logp, mb, version):
    return jax.lax.stop_gradient(0.5 * (logp + mb.behaviour))


CFG = get_config("tiny", vocab_size=16, max_position_embeddings=32)
B, GROUP, P, R = 8, 4, 3, 4
TEMP = 0.7
BASE = TrainConfig(loss=LossConfig(name="ppo_clip", params={"clip_low": 0.2, "clip_high": 0.2,
                                                            "dual_clip": None},
                                   aggregation="token-mean"),
                   advantage=AdvantageConfig("grpo"), temperature=TEMP)


def test_the_names_are_known_and_checked():
    assert "test_two_sided" in available_corrections()
    assert "test_midpoint" in available_old_logp()
    with pytest.raises(ValueError, match="works at level 'token': set level='token'"):
        OffPolicyConfig("test_two_sided", level="sequence")
    with pytest.raises(ValueError, match="mode for 'test_two_sided'"):
        OffPolicyConfig("test_two_sided", mode="mask")
    with pytest.raises(ValueError, match="register_correction"):
        OffPolicyConfig("no_such_correction")
    with pytest.raises(ValueError, match="register_old_logp"):
        TrainConfig(old_logp="no_such_source")


def batch_and_params():
    rng = np.random.default_rng(0)
    rmask = np.arange(R)[None] < rng.integers(2, R + 1, B)[:, None]
    traj = Trajectory.create(
        prompt_ids=rng.integers(3, CFG.vocab_size, (B, P)), prompt_lengths=np.full(B, P),
        response_ids=rng.integers(3, CFG.vocab_size, (B, R)) * rmask, response_mask=rmask,
        behaviour_logprobs=np.where(rmask, -rng.random((B, R)) * 3, 0.0),
        versions=np.zeros((B, R)), group_ids=np.repeat(np.arange(B // GROUP), GROUP),
        finished=np.ones(B, bool), truncated=np.zeros(B, bool),
        rewards={"r": rng.normal(size=B)})
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG)
    return batch, init_params(CFG, 3)


def hand_loss(params, batch, old: str, correction: bool) -> float:
    """Token-mean PPO-clip in float64: log π from the model's logits (log-softmax written
    out), GRPO advantages, old = π_θ or the midpoint, weights of the two-sided mask."""
    tokens = np.asarray(batch.tokens)
    z = np.asarray(forward(params, CFG, jnp.asarray(tokens), jnp.asarray(batch.positions)),
                   np.float64) / TEMP
    z = z - z.max(axis=-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = np.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    mask = np.asarray(batch.loss_mask)[:, 1:]
    mu = np.asarray(batch.behaviour_logprobs, np.float64)[:, 1:]
    r = np.asarray(batch.rewards, np.float64)[:, 0].reshape(-1, GROUP)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    prox = logp if old == "current" else 0.5 * (logp + mu)
    ratio = np.exp(logp - prox)
    per_token = -np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
    w = np.ones_like(logp)
    if correction:
        log_w = prox - mu
        w = np.where(np.abs(log_w) <= np.log(CAP), np.exp(log_w), 0.0)
    return float((per_token * w)[mask].sum() / mask.sum())


@pytest.mark.parametrize("old, correction", [("current", True), ("test_midpoint", False),
                                             ("test_midpoint", True)])
def test_the_step_computes_the_hand_loss(old, correction):
    batch, params = batch_and_params()
    config = dataclasses.replace(BASE, old_logp=old, offpolicy=OffPolicyConfig(
        "test_two_sided" if correction else "none"))
    state = init_train_state(jax.tree.map(jnp.array, params), config, 0)
    _, metrics = make_train_step(config, CFG)(state, batch)
    want = hand_loss(params, batch, old, correction)
    assert float(metrics["loss"]) == pytest.approx(want, rel=1e-4, abs=1e-6)
    if correction:
        assert 0.0 < float(metrics["two_sided_kept_frac"]) < 1.0  # the mask bites here


def test_a_run_trains_with_them(policy, tmp_path):  # noqa: F811
    config, params, task = policy
    train = dataclasses.replace(PRESET.train, old_logp="test_midpoint",
                                offpolicy=OffPolicyConfig("test_two_sided", cap=4.0))
    res = run(config, params, task, cfg(tmp_path / "r", dataclasses.replace(LOOP, steps=3),
                                        train=train,
                                        asynchronous=AsyncConfig(max_staleness=1,
                                                                 mode="deterministic")))
    assert [r["step"] for r in res.train] == [1, 2, 3]
    for r in res.train:
        assert np.isfinite(r["loss"]) and 0.0 < r["two_sided_kept_frac"] <= 1.0
    moved = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(res.state.params))]
    assert any(moved)
