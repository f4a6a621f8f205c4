"""VCPO in the train step (TrainConfig.vcpo): one SGD step against a float64 reference
built from per-row jax.grad calls (log w, exact gradient norms, the OPOB baseline, the
truncated sequence weights, the √ρ update scale of the whole batch over 2 micro-batches);
with all weights 1 and the cheap mode's equal norms VCPO's step equals GRPO's; off by
default (the plain step); bad combinations raise."""
import math
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from test_trainer import (
    CFG,
    FAST,
    GROUP,
    LR,
    PG_CONFIG,
    REPO,
    TEMP,
    B,
    _np_logprobs,
    _seq_logprob_grad,
    fresh_state,
    make_traj,
)

from models.decoder import init_params
from rl.learner import (
    OffPolicyConfig,
    TrainConfig,
    batch_from_trajectory,
    init_train_state,
    make_train_step,
)
from rl.objectives import AdvantageConfig, VCPOConfig

EXACT = TrainConfig(loss=PG_CONFIG.loss, advantage=PG_CONFIG.advantage,
                    optimizer=PG_CONFIG.optimizer, temperature=TEMP, micro_batches=2,
                    vcpo=VCPOConfig(enabled=True, chunk=3))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 3)


def _with_behaviour(batch, mu):
    blp = np.zeros(batch.tokens.shape, np.float32)
    blp[:, 1:] = mu
    return batch.replace(behaviour_logprobs=blp), blp[:, 1:].astype(np.float64)


def _deltas(new_params, params):
    return [np.asarray(n, np.float64) - np.asarray(p, np.float64)
            for n, p in zip(jax.tree.leaves(new_params), jax.tree.leaves(params))]


def _assert_same_update(got, want):
    scale = max(float(np.abs(w).max()) for w in want)
    assert scale > 1e-4  # the step really moves the params
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5 * scale, rtol=1e-3)


@pytest.fixture(scope="module")
def one_device_step(params):
    """The reference test's batch (row 2's log w above log 8, row 6 empty) and one VCPO step
    on one device: shared with the 8-device test, which must reproduce it."""
    batch = batch_from_trajectory(make_traj(31, empty_row=6), group_size=GROUP, model_config=CFG)
    mask = np.asarray(batch.loss_mask)[:, 1:]
    logp = _np_logprobs(params, batch.tokens)
    noise = np.random.default_rng(3).uniform(-0.8, 0.8, logp.shape)
    first = np.argmax(mask[2])
    noise[2, first] = -3.0  # row 2: log w > log 8, capped in the loss
    batch, mu = _with_behaviour(batch, np.where(mask, logp + noise, 0.0))
    new, m = make_train_step(EXACT, CFG, compiler_options=FAST)(fresh_state(params, EXACT), batch)
    return dict(batch=batch, mask=mask, logp=logp, mu=mu, params=new.params, metrics=m)


def test_vcpo_step_matches_float64_reference(params, one_device_step):
    batch, mask, logp, mu = (one_device_step[k] for k in ("batch", "mask", "logp", "mu"))
    new_params, m = one_device_step["params"], one_device_step["metrics"]

    b = mask.shape[0]
    rewards = np.asarray(batch.rewards[:, 0], np.float64)
    log_w = np.array([sum(logp[i, t] - mu[i, t] for t in range(mask.shape[1]) if mask[i, t])
                      for i in range(b)])
    valid = mask.any(axis=1)
    grads, norms = [], []
    for i in range(b):
        g = _seq_logprob_grad(params, batch.tokens[i:i + 1], batch.loss_mask[i].astype(np.float32))
        grads.append([np.asarray(x, np.float64) for x in jax.tree.leaves(g)])
        norms.append(sum(float(np.sum(x * x)) for x in grads[-1]))
    adv, base = np.zeros(b), []
    for g0 in range(0, b, GROUP):
        rows = range(g0, g0 + GROUP)
        big_w = {i: math.exp(2 * log_w[i]) * norms[i] for i in rows if valid[i]}
        bg = sum(big_w[i] * rewards[i] for i in big_w) / (sum(big_w.values()) + 1e-8)
        base.append(bg)
        mean = sum(rewards[i] for i in rows) / GROUP
        std = math.sqrt(sum((rewards[i] - mean) ** 2 for i in rows) / GROUP)
        for i in rows:
            adv[i] = (rewards[i] - bg) / std
    w = [math.exp(x) for x, v in zip(log_w, valid) if v]
    rho = sum(w) ** 2 / sum(x * x for x in w) / len(w)
    trunc = np.minimum(np.exp(np.clip(log_w, -20, 20)), 8.0)
    assert trunc[2] == 8.0 and rho < 0.9  # the cap and the ESS scale are both exercised
    # PPO-clip at ratio 1, seq-mean-token-sum: θ' = θ + √ρ lr / B' Σ_i A_i w̃_i ∇ log π(y_i)
    n_seq = int(valid.sum())
    want = [math.sqrt(rho) * LR / n_seq * sum(adv[i] * trunc[i] * grads[i][k] for i in range(b))
            for k in range(len(grads[0]))]
    _assert_same_update(_deltas(new_params, params), want)
    np.testing.assert_allclose(m["vcpo_ess"], rho, rtol=1e-4)
    np.testing.assert_allclose(m["vcpo_lr_scale"], math.sqrt(rho), rtol=1e-4)
    group_means = rewards.reshape(-1, GROUP).mean(axis=1)
    np.testing.assert_allclose(m["vcpo_baseline_minus_mean"], np.abs(np.array(base) - group_means).mean(),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["vcpo_logw_max"], log_w[valid].max(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m["vcpo_capped_frac"], 1 / n_seq, rtol=1e-6)


def test_packed_vcpo_step_equals_the_unpacked_twin_step(params):
    """A packed batch takes the ghost norms' head window (the response width R): its VCPO
    step equals the unpacked step with the vmap(grad) twin's norms on the same batch
    (groups sharing their prompts), metrics included (a loss token outside the window
    would make the norms NaN)."""
    import dataclasses

    traj = make_traj(55, empty_row=6)  # two responses fill the width R = 4: the window's edge
    assert np.asarray(traj.response_mask).sum(1).max() == np.asarray(traj.response_mask).shape[1]
    first = np.repeat(np.arange(0, B, GROUP), GROUP)  # every row takes its group's prompt
    traj = traj.replace(prompt_ids=np.asarray(traj.prompt_ids)[first],
                        prompt_lengths=np.asarray(traj.prompt_lengths)[first])
    plain = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG)
    mask = np.asarray(plain.loss_mask)[:, 1:]
    noise = np.random.default_rng(5).uniform(-0.8, 0.8, mask.shape)
    mu = np.where(mask, _np_logprobs(params, plain.tokens) + noise, 0.0)
    plain, _ = _with_behaviour(plain, mu)
    packed = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, packed=True)
    assert packed.packed is not None
    packed = packed.replace(behaviour_logprobs=plain.behaviour_logprobs)
    ghost = dataclasses.replace(EXACT, packed=True)
    twin = dataclasses.replace(EXACT, vcpo=dataclasses.replace(EXACT.vcpo, grad_norms="exact"))
    a, ma = make_train_step(ghost, CFG, compiler_options=FAST)(fresh_state(params, ghost), packed)
    b, mb = make_train_step(twin, CFG, compiler_options=FAST)(fresh_state(params, twin), plain)
    assert np.isfinite(float(ma["vcpo_grad_sq_norm_mean"]))
    for key in ("vcpo_grad_sq_norm_mean", "vcpo_baseline_minus_mean", "vcpo_ess"):
        np.testing.assert_allclose(ma[key], mb[key], rtol=1e-4, atol=1e-6)
    _assert_same_update(_deltas(a.params, params), _deltas(b.params, params))


def test_equal_weights_and_norms_give_the_grpo_step(params):
    batch = batch_from_trajectory(make_traj(32), group_size=GROUP, model_config=CFG)
    mask = np.asarray(batch.loss_mask)[:, 1:]
    batch, _ = _with_behaviour(batch, np.where(mask, _np_logprobs(params, batch.tokens), 0.0))
    vcpo = TrainConfig(loss=PG_CONFIG.loss, optimizer=PG_CONFIG.optimizer, temperature=TEMP,
                       vcpo=VCPOConfig(enabled=True, grad_norms="none"))
    # OPOB with equal W is the group mean; VCPO divides by the population std, no eps.
    # The GRPO step also monitors ρ (metrics only: its update must stay GRPO's).
    grpo = TrainConfig(loss=PG_CONFIG.loss, optimizer=PG_CONFIG.optimizer, temperature=TEMP,
                       advantage=AdvantageConfig("grpo", {"eps": 0.0, "unbiased_std": False}),
                       vcpo=VCPOConfig(monitor=True))
    a, ma = make_train_step(vcpo, CFG, compiler_options=FAST)(fresh_state(params, vcpo), batch)
    b, mb = make_train_step(grpo, CFG, compiler_options=FAST)(fresh_state(params, grpo), batch)
    _assert_same_update(_deltas(a.params, params), _deltas(b.params, params))
    for m in (ma, mb):
        assert float(m["vcpo_ess"]) == pytest.approx(1.0, abs=1e-5)
        assert abs(float(m["vcpo_logw_max"])) < 1e-4
    assert "vcpo_lr_scale" not in mb and "vcpo_lr_scale" in ma


@pytest.mark.parametrize("micro_batches,packed", [(1, False), (2, False), (2, True)])
def test_monitor_logs_the_batch_ess_of_float64_log_weights(params, micro_batches, packed):
    # VCPOConfig(monitor=True) reads each row's log w from the loss's own forward (per
    # micro-batch, packed or not); ρ and the tails must be the whole batch's, in float64
    batch = batch_from_trajectory(make_traj(33), group_size=GROUP, model_config=CFG)
    mask = np.asarray(batch.loss_mask)[:, 1:]
    logp = _np_logprobs(params, batch.tokens)
    noise = np.random.default_rng(34).normal(0.0, 0.5, logp.shape)
    batch, mu = _with_behaviour(batch, np.where(mask, logp + noise, 0.0))
    config = TrainConfig(loss=PG_CONFIG.loss, optimizer=PG_CONFIG.optimizer, temperature=TEMP,
                         micro_batches=micro_batches, packed=packed, vcpo=VCPOConfig(monitor=True))
    plain = TrainConfig(loss=PG_CONFIG.loss, optimizer=PG_CONFIG.optimizer, temperature=TEMP,
                        micro_batches=micro_batches, packed=packed)
    if packed:
        batch = batch_from_trajectory(make_traj(33), group_size=GROUP, model_config=CFG,
                                      packed=True).replace(behaviour_logprobs=batch.behaviour_logprobs)
    a, m = make_train_step(config, CFG, compiler_options=FAST)(fresh_state(params, config), batch)
    b, _ = make_train_step(plain, CFG, compiler_options=FAST)(fresh_state(params, plain), batch)
    _assert_same_update(_deltas(a.params, params), _deltas(b.params, params))  # metrics only
    mu = np.asarray(batch.behaviour_logprobs, np.float64)[:, 1:]
    log_w = np.where(mask, logp - mu, 0.0).sum(axis=1)
    valid = mask.any(axis=1)
    w = np.exp(log_w[valid])
    rho = w.sum() ** 2 / (w ** 2).sum() / valid.sum()
    assert rho < 0.9  # off-policy enough that a wrong row set would show
    np.testing.assert_allclose(m["vcpo_ess"], rho, rtol=1e-4)
    np.testing.assert_allclose(m["vcpo_logw_max"], log_w[valid].max(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(m["vcpo_logw_mean"], log_w[valid].mean(), rtol=1e-4, atol=1e-5)
    assert "vcpo_lr_scale" not in m


def test_vcpo_is_off_by_default_and_validated(params):
    assert TrainConfig() == TrainConfig(vcpo=VCPOConfig(enabled=False))
    assert len(init_train_state(params, TrainConfig(vcpo=VCPOConfig(monitor=True))).opt_state) == 2
    plain = init_train_state(params, TrainConfig()).opt_state
    on = init_train_state(params, TrainConfig(vcpo=VCPOConfig(enabled=True))).opt_state
    none = init_train_state(params, TrainConfig(vcpo=VCPOConfig(enabled=True, lr_scale="none")))
    assert len(plain) == 2 and len(on) == 3  # scale_by_ess is chained only when it scales
    assert jax.tree.structure(none.opt_state) == jax.tree.structure(plain)
    with pytest.raises(ValueError, match="offpolicy"):
        TrainConfig(vcpo=VCPOConfig(enabled=True), offpolicy=OffPolicyConfig(correction="truncated_is"))
    with pytest.raises(ValueError, match="advantage"):
        TrainConfig(vcpo=VCPOConfig(enabled=True), advantage=AdvantageConfig("rloo"))
    with pytest.raises(ValueError, match="vcpo"):
        TrainConfig(vcpo={"enabled": True})


# 8 forced CPU devices need a fresh process; it runs the reference test's batch on a
# (data=2, fsdp=2, tensor=2) mesh: ρ must count the whole batch (all devices) and the
# per-row gradient norms must survive the mesh's activation annotations.
_SHARDED = textwrap.dedent("""
    import sys, jax, numpy as np
    from models.decoder import init_params
    from models.sharding import make_mesh
    from rl.learner import TrainBatch, init_train_state, make_train_step
    sys.path.insert(0, "tests/rl")
    from test_trainer import CFG, FAST
    from test_trainer_vcpo import EXACT
    assert len(jax.devices()) == 8
    data = np.load(sys.argv[1])
    batch = TrainBatch(**{k: data[k] for k in ("tokens", "positions", "loss_mask",
                          "behaviour_logprobs", "versions", "rewards")},
                       group_size=4, reward_names=("r",))
    step = make_train_step(EXACT, CFG, make_mesh(data=2, fsdp=2, tensor=2), compiler_options=FAST)
    new, m = step(step.place_state(init_train_state(init_params(CFG, 3), EXACT)), batch)
    np.savez(sys.argv[2], ess=np.asarray(m["vcpo_ess"]),
             **{f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(new.params))})
""")


def test_sharded_vcpo_step_matches_single_device(tmp_path, one_device_step):
    b = one_device_step["batch"]
    np.savez(tmp_path / "in.npz", **{k: np.asarray(getattr(b, k)) for k in (
        "tokens", "positions", "loss_mask", "behaviour_logprobs", "versions", "rewards")})
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SHARDED, str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(float(out["ess"]), float(one_device_step["metrics"]["vcpo_ess"]),
                               rtol=1e-5)
    for i, want in enumerate(jax.tree.leaves(one_device_step["params"])):
        np.testing.assert_allclose(out[f"p{i}"], np.asarray(want), atol=2e-5, rtol=1e-4)
