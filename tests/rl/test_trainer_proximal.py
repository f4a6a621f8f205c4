"""The learner's proximal policy sources (TrainConfig.old_logp "proximal" and "versions"):
the PPO ratio, the off-policy weights and the ratio decomposition are checked against a
float64 numpy computation from the model's logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import CFG, FAST, GROUP, TEMP, _np_logprobs, grpo_advantages_np, make_traj

from models.decoder import init_params
from rl.learner import (
    OffPolicyConfig,
    OptimizerConfig,
    TrainConfig,
    batch_from_trajectory,
    init_train_state,
    make_train_step,
)
from rl.objectives import AdvantageConfig, LossConfig


def _config(old_logp):
    return TrainConfig(
        loss=LossConfig(name="ppo_clip", aggregation="token-mean"),  # eps 0.2, dual clip 3
        advantage=AdvantageConfig("grpo"), old_logp=old_logp, temperature=TEMP,
        offpolicy=OffPolicyConfig(correction="truncated_is"),
        optimizer=OptimizerConfig(name="sgd", learning_rate=1.0, max_grad_norm=None))


def _np_ppo(logp, prox, mu, adv, mask):
    """token-mean PPO-clip (dual clip 3) with truncated IS weights min(π_prox/μ, 2)."""
    r = np.exp(np.clip(logp - prox, -20, 20))
    a = adv[:, None]
    loss = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    loss = np.where(a < 0, np.minimum(loss, -a * 3.0), loss)
    w = np.minimum(np.exp(prox - mu), 2.0)
    return (loss * w)[mask].mean()


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, 3)
    batch = batch_from_trajectory(make_traj(21), group_size=GROUP, model_config=CFG)
    mask = np.asarray(batch.loss_mask)[:, 1:]
    logp = _np_logprobs(params, batch.tokens)
    rng = np.random.default_rng(5)
    mu = np.where(mask, logp + rng.uniform(-1.0, 1.0, logp.shape), 0.0)
    blp = np.zeros(batch.tokens.shape, np.float32)
    blp[:, 1:] = mu
    batch = batch.replace(behaviour_logprobs=blp)
    adv = grpo_advantages_np(np.asarray(batch.rewards[:, 0]), GROUP)
    return params, batch, mask, logp, blp[:, 1:].astype(np.float64), adv


def _state(params, config, version=0):
    state = init_train_state(jax.tree.map(jnp.array, params), config, 0)
    return state.replace(version=jnp.asarray(version, jnp.int32))


def test_given_proximal_logprobs_set_ratio_weights_and_decomposition(setup):
    params, batch, mask, logp, mu, adv = setup
    prox = np.where(mask, logp + np.random.default_rng(6).uniform(-0.5, 0.5, logp.shape), 0.0)
    full = np.zeros(batch.tokens.shape, np.float32)
    full[:, 1:] = prox
    config = _config("proximal")
    _, m = make_train_step(config, CFG, compiler_options=FAST)(
        _state(params, config), batch.replace(proximal_logprobs=full))
    prox = full[:, 1:].astype(np.float64)
    np.testing.assert_allclose(m["pg_loss"], _np_ppo(logp, prox, mu, adv, mask), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["mismatch_log_ratio_mean"], (prox - mu)[mask].mean(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(m["staleness_log_ratio_mean"], (logp - prox)[mask].mean(), rtol=1e-4, atol=1e-5)


def test_versions_interpolate_between_behaviour_and_current(setup):
    params, batch, mask, logp, mu, adv = setup
    # current version 7; tokens from versions 3 (gap 4: α = 3/4) and 6 (gap 1: α = 0 -> μ)
    ver = np.where(np.arange(batch.tokens.shape[0])[:, None] % 2 == 0, 3, 6) * np.asarray(batch.loss_mask)
    batch = batch.replace(versions=ver.astype(np.int32))
    alpha = np.where(ver[:, 1:] == 3, 0.75, 0.0)
    prox = mu + alpha * (logp - mu)
    config = _config("versions")
    _, m = make_train_step(config, CFG, compiler_options=FAST)(_state(params, config, 7), batch)
    np.testing.assert_allclose(m["pg_loss"], _np_ppo(logp, prox, mu, adv, mask), rtol=1e-4, atol=1e-6)


def test_proximal_source_needs_the_batch_field(setup):
    params, batch, *_ = setup
    config = _config("proximal")
    step = make_train_step(config, CFG, compiler_options=FAST)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        step(_state(params, config), batch)
    with pytest.raises(ValueError, match="shape"):
        step(_state(params, config), batch.replace(proximal_logprobs=np.zeros((2, 3), np.float32)))
    with pytest.raises(ValueError, match="old_logp"):
        TrainConfig(old_logp="ewma")


def test_loss_weights_scale_each_tokens_loss(setup):
    params, batch, mask, logp, mu, adv = setup
    lw = np.random.default_rng(9).uniform(0.0, 2.0, batch.tokens.shape).astype(np.float32)
    config = _config("behaviour")
    _, m = make_train_step(config, CFG, compiler_options=FAST)(
        _state(params, config), batch.replace(loss_weights=lw))
    r = np.exp(logp - mu)
    a = adv[:, None]
    loss = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    loss = np.where(a < 0, np.minimum(loss, -a * 3.0), loss)
    w = np.minimum(np.exp(mu - mu), 2.0) * lw[:, 1:]  # prox = μ: IS weights 1
    np.testing.assert_allclose(m["pg_loss"], (loss * w)[mask].mean(), rtol=1e-4, atol=1e-6)
