"""The learner with TrainConfig.lora: one SGD step moves the adapters by the gradient of an
independent reference (per-sequence jax.grad through the MERGED params, hand-written
log-softmax); the optimizer state exists for the adapters only and the base is untouched;
the KL reference (base, adapters off) equals a full-params step against a separate frozen
base copy; the packed forward with 2 micro-batches gives the naive single-batch LoRA step;
steps on a batch lower its loss; the sampler (rl.rollout.generate) runs the adapted policy
from composed or merged params alike; misuse errors. Geometry and trajectories are
tests/rl/test_trainer.py's (vocab 16, B = 8 rows, T = 8)."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import forward, init_params
from models.lora import LoraConfig, compose, count_bytes, init_lora, merge
from rl.learner import (
    OptimizerConfig,
    TrainConfig,
    batch_from_trajectory,
    init_train_state,
    make_train_step,
)
from rl.objectives import LossConfig
from rl.objectives.vcpo import VCPOConfig
from rl.rollout import generate
from tests.rl.test_trainer import (
    CFG,
    FAST,
    GROUP,
    LR,
    PG_CONFIG,
    TEMP,
    B,
    grpo_advantages_np,
    hand_seq_logprob,
    make_traj,
)
from tests.rl.test_trainer_packed import GROUP as SHARED_GROUP
from tests.rl.test_trainer_packed import make_traj as make_shared_traj

LCFG = LoraConfig(rank=4, alpha=8.0)
LORA_PG = TrainConfig(loss=PG_CONFIG.loss, advantage=PG_CONFIG.advantage,
                      optimizer=PG_CONFIG.optimizer, temperature=TEMP, lora=LCFG)


@pytest.fixture(scope="module")
def base():
    return init_params(CFG, 3)


@pytest.fixture(scope="module")
def adapters(base):
    """Adapters as after some training: A and B both nonzero (so both get gradients)."""
    ad = init_lora(base, LCFG, 4)
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])


def fresh(adapters, config):
    return init_train_state(jax.tree.map(jnp.array, adapters), config, 0)


@partial(jax.jit, compiler_options=FAST)
def _seq_logprob_grad(adapters, base, tokens, target_mask):
    """∇_adapters Σ_t log π(token t) of ONE sequence [1, T] under merge(base, adapters)."""
    return jax.grad(lambda ad: hand_seq_logprob(merge(base, ad, LCFG), tokens, target_mask))(
        adapters)


def test_sgd_step_moves_only_the_adapters_by_the_reference_gradient(base, adapters):
    batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=CFG)
    base_before = jax.tree.map(np.array, base)
    new_state, _ = make_train_step(LORA_PG, CFG, compiler_options=FAST)(
        fresh(adapters, LORA_PG), batch, base)
    assert jax.tree.structure(new_state.params) == jax.tree.structure(adapters)
    adv = grpo_advantages_np(np.asarray(batch.rewards[:, 0]), GROUP)
    want = jax.tree.map(lambda a: np.zeros(a.shape, np.float64), adapters)
    for i in range(B):  # Δ = (lr / B) Σ_i A_i ∇ log π(y_i)
        g = _seq_logprob_grad(adapters, base, batch.tokens[i:i + 1],
                              batch.loss_mask[i].astype(np.float32))
        want = jax.tree.map(lambda w, gi: w + LR / B * adv[i] * np.asarray(gi, np.float64),
                            want, g)
    got = jax.tree.map(lambda n, a: np.asarray(n, np.float64) - np.asarray(a), new_state.params,
                       adapters)
    scale = max(float(np.abs(d).max()) for d in jax.tree.leaves(want))
    assert scale > 1e-3
    for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.abs(w_).max() > 1e-3 * scale  # every adapter leaf receives a gradient
        np.testing.assert_allclose(g_, w_, atol=1e-5 * scale, rtol=1e-4)
    for before, after in zip(jax.tree.leaves(base_before), jax.tree.leaves(base)):
        np.testing.assert_array_equal(before, after)  # the base is an input, never updated


def test_optimizer_state_is_the_adapters_alone(base, adapters):
    config = TrainConfig(loss=PG_CONFIG.loss, advantage=PG_CONFIG.advantage, temperature=TEMP,
                         optimizer=OptimizerConfig(learning_rate=1e-3), lora=LCFG)
    state = fresh(adapters, config)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    # AdamW: two moments shaped like the adapters, nothing shaped like the base
    shapes = [a.shape for a in jax.tree.leaves(adapters)]
    assert sorted(x.shape for x in moments) == sorted(2 * shapes)
    assert count_bytes(moments) == 2 * count_bytes(adapters) < count_bytes(base) / 3
    batch = batch_from_trajectory(make_traj(1), group_size=GROUP, model_config=CFG)
    new_state, metrics = make_train_step(config, CFG, compiler_options=FAST)(state, batch, base)
    assert jax.tree.structure(new_state.opt_state) == jax.tree.structure(state.opt_state)
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0


def test_kl_reference_is_the_base_with_adapters_off(base, adapters):
    loss = LossConfig(name="ppo_clip", aggregation="token-mean", kl_coef=0.1, kl_estimator="k3")
    opt = OptimizerConfig(name="sgd", learning_rate=LR, max_grad_norm=None)
    lora_cfg = TrainConfig(loss=loss, optimizer=opt, temperature=TEMP, lora=LCFG)
    full_cfg = TrainConfig(loss=loss, optimizer=opt, temperature=TEMP)
    batch = batch_from_trajectory(make_traj(7), group_size=GROUP, model_config=CFG)
    _, got = make_train_step(lora_cfg, CFG, compiler_options=FAST)(
        fresh(adapters, lora_cfg), batch, base)
    ref_copy = jax.tree.map(jnp.array, base)  # a second, separate frozen copy
    _, want = make_train_step(full_cfg, CFG, compiler_options=FAST)(
        fresh(merge(base, adapters, LCFG), full_cfg), batch, ref_copy)  # donated: a copy
    assert float(want["kl"]) > 1e-3  # the adapters moved the policy away from the base
    for key in ("kl", "loss", "pg_loss", "entropy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)


def test_packed_micro_batched_lora_step_equals_the_naive_one(base, adapters):
    naive = TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean", kl_coef=0.1,
                                        entropy_coef=0.01),
                        optimizer=OptimizerConfig(name="sgd", learning_rate=1.0,
                                                  max_grad_norm=None),
                        temperature=TEMP, lora=LCFG)
    packed = dataclasses.replace(naive, packed=True, micro_batches=2)
    traj = make_shared_traj(0)
    out = []
    for config, pack in ((naive, False), (packed, True)):
        batch = batch_from_trajectory(traj, group_size=SHARED_GROUP, model_config=CFG,
                                      packed=pack)
        assert (batch.packed is not None) == pack
        state, metrics = make_train_step(config, CFG, compiler_options=FAST)(
            fresh(adapters, config), batch, base)
        out.append((state.params, metrics))
    (got, got_m), (want, want_m) = out[1], out[0]
    assert float(want_m["kl"]) > 1e-4 and float(want_m["grad_norm"]) > 1e-2
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for g, w, a in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(adapters)):
        assert np.abs(np.asarray(w) - np.asarray(a)).max() > 1e-4  # the step moves each leaf
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0)


def test_lora_steps_lower_the_loss(base):
    # old_logp "behaviour" with μ = the base policy: the PPO loss moves with the adapters
    config = TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                         optimizer=OptimizerConfig(learning_rate=3e-2), temperature=TEMP,
                         old_logp="behaviour", lora=LCFG)
    batch = batch_from_trajectory(make_traj(2), group_size=GROUP, model_config=CFG)
    z = np.asarray(forward(base, CFG, batch.tokens), np.float64)[:, :-1] / TEMP
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    blp = np.zeros(batch.tokens.shape, np.float32)
    blp[:, 1:] = np.take_along_axis(logp, np.asarray(batch.tokens)[:, 1:, None], axis=-1)[..., 0]
    batch = batch.replace(behaviour_logprobs=blp)
    step = make_train_step(config, CFG, compiler_options=FAST)
    state = fresh(init_lora(base, LCFG, 6), config)  # fresh adapters: B = 0, π = μ
    losses = []
    for _ in range(6):
        state, metrics = step(state, batch, base)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05, losses


def test_sampler_runs_the_adapted_policy_on_the_fly_or_merged(base):
    ad = jax.tree.map(lambda x: x + 0.3, init_lora(base, LCFG, 8))  # far from the base
    prompts = [[3, 4, 5], [6, 7]]
    out = [generate(p, CFG, prompts, max_new_tokens=6, num_samples=2, rng=4, stop_ids=())
           for p in (compose(base, ad, LCFG), merge(base, ad, LCFG), base)]
    assert out[0].tokens == out[1].tokens and out[0].tokens != out[2].tokens
    for a, b in zip(out[0].logprobs, out[1].logprobs):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-5)


def test_lora_misuse_is_a_clear_error(base, adapters):
    batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=CFG)
    with pytest.raises(ValueError, match="pass the base params"):
        make_train_step(LORA_PG, CFG, compiler_options=FAST)(fresh(adapters, LORA_PG), batch)
    with pytest.raises(ValueError, match="lora with VCPO is not supported"):
        TrainConfig(vcpo=VCPOConfig(enabled=True), lora=LCFG)
    with pytest.raises(ValueError, match="must be a models.lora.LoraConfig"):
        TrainConfig(lora={"rank": 8})
    # adapters built for another config
    other = LoraConfig(rank=4, alpha=8.0, targets=("q_proj",))
    with pytest.raises(ValueError, match="LoraConfig.targets select"):
        compose(base, adapters, other)
