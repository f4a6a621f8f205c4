"""Learner tests: one policy-gradient step against an independent per-sequence jax.grad
with a hand-written log-softmax; micro-batch accumulation == full batch; 8 forced CPU
devices on a (data=2, fsdp=2, tensor=2) mesh == 1 device; TrainBatch packing; bad input;
the learning-rate schedule.

All steps share one geometry (B=8 rows, T=8 tokens, vocab 16) so each jitted function
compiles once for the whole file."""
import math
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import forward, init_params
from rl.learner import (
    OffPolicyConfig,
    OptimizerConfig,
    TrainConfig,
    batch_from_trajectory,
    init_train_state,
    make_schedule,
    make_train_step,
)
from rl.objectives import AdvantageConfig, LossConfig
from rl.trajectory import Trajectory

CFG = get_config("tiny", vocab_size=16, max_position_embeddings=32)
B, GROUP, P_MAX, R_MAX = 8, 4, 4, 4
TEMP = 0.7
LR = 1.0
REPO = Path(__file__).resolve().parents[2]
# Same semantics, about half the CPU compile time (tests are compile-bound).
FAST = {"xla_backend_optimization_level": 0}

# Plain policy gradient: PPO-clip at ratio 1 (old = the step's own params) has gradient
# -A ∇log π per token; "seq-mean-token-sum" makes it -(1/B) Σ_i A_i ∇ Σ_t log π(y_it).
PG_CONFIG = TrainConfig(
    loss=LossConfig(name="ppo_clip", params={"dual_clip": None}, aggregation="seq-mean-token-sum"),
    advantage=AdvantageConfig("grpo"),
    optimizer=OptimizerConfig(name="sgd", learning_rate=LR, max_grad_norm=None),
    temperature=TEMP,
)


def make_traj(seed, *, empty_row=None, rewards=None):
    """Random prompts (lengths 1..4) and responses (lengths 1..4) over the vocab."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, P_MAX + 1, B)
    rlen = rng.integers(1, R_MAX + 1, B)
    if empty_row is not None:
        rlen[empty_row] = 0
    pmask = np.arange(P_MAX)[None] < plen[:, None]
    rmask = np.arange(R_MAX)[None] < rlen[:, None]
    if rewards is None:
        rewards = {"r": rng.normal(size=B)}
    return Trajectory.create(
        prompt_ids=rng.integers(3, CFG.vocab_size, (B, P_MAX)) * pmask, prompt_lengths=plen,
        response_ids=rng.integers(3, CFG.vocab_size, (B, R_MAX)) * rmask, response_mask=rmask,
        behaviour_logprobs=np.where(rmask, -rng.random((B, R_MAX)) * 3, 0.0),
        versions=np.zeros((B, R_MAX)), group_ids=np.repeat(np.arange(B // GROUP), GROUP),
        finished=np.zeros(B, bool), truncated=np.ones(B, bool), rewards=rewards)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 3)


@pytest.fixture(scope="module")
def pg_step():
    return make_train_step(PG_CONFIG, CFG, compiler_options=FAST)


def fresh_state(params, config=PG_CONFIG):
    # The step donates its state: give it a private copy of the params.
    return init_train_state(jax.tree.map(jnp.array, params), config, 0)


@partial(jax.jit, compiler_options=FAST)
def _seq_logprob_grad(params, tokens, target_mask):
    """∇ Σ_t log π(token t) over target_mask [T] for ONE sequence tokens [1, T], with the
    log-softmax written out by hand."""
    return jax.grad(hand_seq_logprob)(params, tokens, target_mask)


def hand_seq_logprob(params, tokens, target_mask):
    """Σ_t log π(token t) over target_mask [T] for ONE sequence tokens [1, T] at TEMP, the
    log-softmax written out by hand (the independent reference of the step's log-probs)."""
    z = forward(params, CFG, tokens)[0] / TEMP  # [T, V]; row t predicts token t + 1
    m = jnp.max(z, axis=-1, keepdims=True)
    logp = z - (m + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1, keepdims=True)))
    picked = logp[jnp.arange(z.shape[0] - 1), tokens[0, 1:]]
    return jnp.sum(picked * target_mask[1:])


def grpo_advantages_np(rewards, group):
    out = np.zeros_like(rewards, dtype=np.float64)
    for g in range(len(rewards) // group):
        r = rewards[g * group:(g + 1) * group].astype(np.float64)
        mean = sum(r) / group
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (group - 1))
        for i in range(group):
            out[g * group + i] = (r[i] - mean) / (std + 1e-6)
    return out


def test_policy_gradient_step_matches_per_sequence_grads(params, pg_step):
    traj = make_traj(0)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG)
    new_state, metrics = pg_step(fresh_state(params), batch)
    adv = grpo_advantages_np(np.asarray(batch.rewards[:, 0]), GROUP)
    expected = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
    for i in range(B):
        g = _seq_logprob_grad(params, batch.tokens[i:i + 1], batch.loss_mask[i].astype(np.float32))
        # θ' = θ - lr ∇(-(1/B) Σ A_i log π(y_i)) = θ + (lr / B) Σ A_i ∇ log π(y_i)
        expected = jax.tree.map(lambda e, gi: e + LR / B * adv[i] * np.asarray(gi, np.float64),
                                expected, g)
    got_delta = jax.tree.map(lambda n, p: np.asarray(n, np.float64) - np.asarray(p), new_state.params, params)
    want_delta = jax.tree.map(lambda e, p: e - np.asarray(p, np.float64), expected, params)
    scale = max(float(np.abs(d).max()) for d in jax.tree.leaves(want_delta))
    assert scale > 1e-3  # the step really moves the params
    for got, want in zip(jax.tree.leaves(got_delta), jax.tree.leaves(want_delta)):
        np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=1e-4)
    assert int(new_state.step) == 1 and int(new_state.version) == 1
    assert metrics["tokens"] == float(np.asarray(traj.response_mask).sum())
    np.testing.assert_allclose(metrics["reward_mean"], np.asarray(traj.rewards["r"]).mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_mean"], 1.0, rtol=1e-6)


MB_CONFIG = TrainConfig(loss=PG_CONFIG.loss, advantage=PG_CONFIG.advantage,
                        optimizer=PG_CONFIG.optimizer, temperature=TEMP, micro_batches=2)


def test_micro_batches_equal_full_batch(params, pg_step):
    # Row 5 has an empty response, so the two micro-batches hold different numbers of
    # sequences and tokens: each micro-loss must be scaled by its share of the batch.
    traj = make_traj(1, empty_row=5)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG)
    full, m_full = pg_step(fresh_state(params), batch)
    acc, m_acc = make_train_step(MB_CONFIG, CFG, compiler_options=FAST)(
        fresh_state(params, MB_CONFIG), batch)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(acc.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-5)
    for key in ("loss", "grad_norm", "tokens", "entropy", "reward_mean"):
        np.testing.assert_allclose(m_acc[key], m_full[key], rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(full.params["embed"]["embedding"]),
                           np.asarray(params["embed"]["embedding"]))


# The 8-device half runs in a fresh process (the device count is fixed at jax's start);
# it reads the params and batch the 1-device half used and writes its new params back.
_SHARDED_SCRIPT = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, numpy as np
    from models.decoder import init_params
    from models.sharding import make_mesh
    from rl.learner import TrainBatch, init_train_state, make_train_step
    sys.path.insert(0, "tests/rl")
    from test_trainer import CFG, MB_CONFIG
    assert len(jax.devices()) == 8
    data = np.load(sys.argv[1])
    flat, treedef = jax.tree.flatten(jax.eval_shape(lambda: init_params(CFG, 0)))
    params = jax.tree.unflatten(treedef, [data[f"p{i}"] for i in range(len(flat))])
    batch = TrainBatch(**{k: data[k] for k in ("tokens", "positions", "loss_mask",
                          "behaviour_logprobs", "versions", "rewards")},
                       group_size=4, reward_names=("r",))
    step = make_train_step(MB_CONFIG, CFG, make_mesh(data=2, fsdp=2, tensor=2))
    new, metrics = step(step.place_state(init_train_state(params, MB_CONFIG)), batch)
    emb = new.params["embed"]["embedding"]
    assert tuple(emb.sharding.spec) == ("tensor", "fsdp"), emb.sharding.spec
    assert len(emb.addressable_shards) == 8
    out = {f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(new.params))}
    np.savez(sys.argv[2], loss=np.asarray(metrics["loss"]), **out)
""")


def test_sharded_step_matches_single_device(params, tmp_path):
    batch = batch_from_trajectory(make_traj(6), group_size=GROUP, model_config=CFG)
    one, m1 = make_train_step(MB_CONFIG, CFG, compiler_options=FAST)(
        fresh_state(params, MB_CONFIG), batch)
    fields = {k: np.asarray(getattr(batch, k)) for k in ("tokens", "positions", "loss_mask",
                                                          "behaviour_logprobs", "versions", "rewards")}
    leaves = {f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
    np.savez(tmp_path / "in.npz", **fields, **leaves)
    # The suite's compile flags (tests/conftest.py), as the 1-device step has them.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT, str(tmp_path / "in.npz"),
                          str(tmp_path / "out.npz")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    one_leaves = jax.tree.leaves(one.params)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(one_leaves, jax.tree.leaves(params)))
    diff = max(float(np.abs(np.asarray(a) - got[f"p{i}"]).max()) for i, a in enumerate(one_leaves))
    assert moved > 1e-3
    assert diff <= 1e-5, diff
    np.testing.assert_allclose(float(got["loss"]), float(m1["loss"]), rtol=1e-5, atol=1e-7)


def _np_logprobs(params, tokens):
    """float64 log softmax(logits / T) of each next token: [B, T-1]."""
    z = np.asarray(forward(params, CFG, tokens), np.float64)[:, :-1] / TEMP
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]


def test_kl_reference_and_truncated_is_enter_the_loss(params):
    # PPO-clip at ratio 1 with truncated IS weights w = min(π/μ, 2) and a k3 KL to a
    # different reference: loss = mean_t(-A w) + 0.1 mean_t(k3), token-mean.
    config = TrainConfig(
        loss=LossConfig(name="ppo_clip", aggregation="token-mean", kl_coef=0.1, kl_estimator="k3"),
        offpolicy=OffPolicyConfig(correction="truncated_is"), temperature=TEMP,
        optimizer=OptimizerConfig(name="sgd", learning_rate=LR, max_grad_norm=None))
    ref = init_params(CFG, 11)
    batch = batch_from_trajectory(make_traj(7), group_size=GROUP, model_config=CFG)
    mask = np.asarray(batch.loss_mask)[:, 1:]
    logp, ref_logp = _np_logprobs(params, batch.tokens), _np_logprobs(ref, batch.tokens)
    # Behaviour log-probs around the learner's, so some weights exceed the cap of 2.
    noise = np.random.default_rng(8).uniform(-1.5, 1.5, logp.shape)
    mu = np.where(mask, logp + noise, 0.0)
    blp = np.zeros(batch.tokens.shape, np.float32)
    blp[:, 1:] = mu
    batch = batch.replace(behaviour_logprobs=blp)
    _, metrics = make_train_step(config, CFG, compiler_options=FAST)(
        fresh_state(params, config), batch, ref)
    mu = blp[:, 1:].astype(np.float64)
    adv = grpo_advantages_np(np.asarray(batch.rewards[:, 0]), GROUP)
    w = np.minimum(np.exp(logp - mu), 2.0)
    assert (w[mask] == 2.0).any() and (w[mask] < 2.0).any()  # both regimes present
    d = ref_logp - logp
    k3 = np.clip(np.exp(d) - d - 1.0, -10, 10)
    pg = (-adv[:, None] * w)[mask].mean()
    kl = k3[mask].mean()
    np.testing.assert_allclose(metrics["kl"], kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["pg_loss"], pg, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], pg + 0.1 * kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["is_capped_frac"], (w[mask] == 2.0).mean(), atol=1e-6)
    np.testing.assert_allclose(metrics["mismatch_log_ratio_mean"], (logp - mu)[mask].mean(),
                               rtol=1e-4, atol=1e-5)


def test_m2po_correction_masks_by_second_moment_and_weights_by_the_ratio(params):
    # M2PO (correction "m2po"): PPO-clip at ratio 1 (π_prox = the step's params), tokens
    # with the largest (log π - log μ)² masked until the rest's mean <= 0.04, kept tokens
    # weighted by π/μ; loss = mean over the ORIGINAL mask of -A w (a naive float64 twin)
    config = TrainConfig(
        loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
        offpolicy=OffPolicyConfig(correction="m2po"), temperature=TEMP,
        optimizer=OptimizerConfig(name="sgd", learning_rate=LR, max_grad_norm=None))
    batch = batch_from_trajectory(make_traj(9), group_size=GROUP, model_config=CFG)
    mask = np.asarray(batch.loss_mask)[:, 1:]
    logp = _np_logprobs(params, batch.tokens)
    noise = np.random.default_rng(10).uniform(-0.6, 0.6, logp.shape)
    blp = np.zeros(batch.tokens.shape, np.float32)
    blp[:, 1:] = np.where(mask, logp + noise, 0.0)
    batch = batch.replace(behaviour_logprobs=blp)
    _, metrics = make_train_step(config, CFG, compiler_options=FAST)(
        fresh_state(params, config), batch)
    mu = blp[:, 1:].astype(np.float64)
    m2 = np.where(mask, (logp - mu) ** 2, -np.inf).ravel()
    kept = list(np.argsort(-m2, kind="stable")[: int(mask.sum())])
    while len(kept) > 1 and m2[kept].mean() > 0.04:
        kept.pop(0)
    keep = np.zeros(mask.size, bool)
    keep[kept] = True
    keep = keep.reshape(mask.shape)
    assert 0 < keep.sum() < mask.sum()
    w = np.where(keep, np.exp(logp - mu), 0.0)
    adv = grpo_advantages_np(np.asarray(batch.rewards[:, 0]), GROUP)
    np.testing.assert_allclose(metrics["pg_loss"], (-adv[:, None] * w)[mask].mean(),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["m2po_masked_frac"], 1 - keep.sum() / mask.sum(),
                               atol=1e-6)
    with pytest.raises(ValueError, match="level='token'"):
        OffPolicyConfig(correction="m2po", level="sequence")
    with pytest.raises(ValueError, match="m2po"):
        OffPolicyConfig(correction="m2po_typo")


# ----------------------------------------------------------------------------- packing & input errors
def test_batch_packs_prompt_then_response():
    traj = make_traj(2)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, seq_len=10)
    p_ids, r_ids = np.asarray(traj.prompt_ids), np.asarray(traj.response_ids)
    blp = np.asarray(traj.behaviour_logprobs)
    for i in range(B):
        p, r = int(traj.prompt_lengths[i]), int(np.asarray(traj.response_mask)[i].sum())
        row = list(p_ids[i, :p]) + list(r_ids[i, :r])
        assert batch.tokens[i].tolist() == row + [0] * (10 - len(row))
        assert batch.loss_mask[i].tolist() == [False] * p + [True] * r + [False] * (10 - p - r)
        np.testing.assert_array_equal(batch.behaviour_logprobs[i, p:p + r], blp[i, :r])
        assert batch.positions[i].tolist() == list(range(10))
    assert batch.rewards.shape == (B, 1) and batch.reward_names == ("r",)


@pytest.mark.parametrize("bad, match", [
    ({"r": [0.1] * (B - 1)}, "list of 8 numbers"),
    ({"r": [0.1] * 3 + [float("nan")] + [0.0] * 4}, "non-finite"),
    ({"r": [0.1] * 7 + [float("inf")]}, "non-finite"),
    ({}, "empty mapping"),
])
def test_bad_rewards_raise(bad, match):
    traj = make_traj(3)
    with pytest.raises(ValueError, match=match):
        batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, rewards=bad)


def test_other_bad_batches_raise():
    traj = make_traj(4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        batch_from_trajectory(traj, group_size=GROUP, model_config=CFG.replace(max_position_embeddings=6))
    with pytest.raises(ValueError, match="longer than seq_len"):
        batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, seq_len=2)
    with pytest.raises(ValueError, match="whole number of groups"):
        batch_from_trajectory(traj, group_size=3, model_config=CFG)
    shuffled = traj.replace(group_ids=np.asarray([0, 1] * 4, np.int32))
    with pytest.raises(ValueError, match="contiguous"):
        batch_from_trajectory(shuffled, group_size=GROUP, model_config=CFG)
    empty = jax.tree.map(lambda x: np.asarray(x)[:0], traj)
    with pytest.raises(ValueError, match="empty"):
        batch_from_trajectory(empty, group_size=GROUP, model_config=CFG)


def test_step_needs_reference_exactly_with_kl(params, pg_step):
    batch = batch_from_trajectory(make_traj(5), group_size=GROUP, model_config=CFG)
    with pytest.raises(ValueError, match="ref_params"):
        pg_step(fresh_state(params), batch, params)
    with pytest.raises(ValueError, match="micro_batches"):
        TrainConfig(micro_batches=0)
    with pytest.raises(ValueError, match="old_logp"):
        TrainConfig(old_logp="stale")
    with pytest.raises(ValueError, match="logprob_chunk must be an int >= 0"):
        TrainConfig(logprob_chunk=-1)
    with pytest.raises(ValueError, match="head_remat must be None"):
        TrainConfig(head_remat="yes")
    from rl.learner.config import KEEP_HEAD_LOGITS_BYTES
    auto, keep, remat = TrainConfig(), TrainConfig(head_remat=False), TrainConfig(head_remat=True)
    limit = KEEP_HEAD_LOGITS_BYTES // (4 * 1000)  # tokens of a 1000-word vocabulary
    assert auto.keeps_head_logits(limit, 1000) and not auto.keeps_head_logits(limit + 1, 1000)
    assert keep.keeps_head_logits(10**9, 1000) and not remat.keeps_head_logits(1, 1000)


# ----------------------------------------------------------------------------- optimizer
def test_schedules_follow_their_formulas():
    const = make_schedule(OptimizerConfig(learning_rate=0.1, warmup_steps=4))
    cos = make_schedule(OptimizerConfig(learning_rate=0.1, warmup_steps=2, schedule="cosine",
                                        decay_steps=10, min_lr_ratio=0.1))
    for s in range(20):
        np.testing.assert_allclose(float(const(s)), 0.1 * min(1.0, (s + 1) / 5), rtol=1e-6)
        t = min(max((s - 2) / 10, 0.0), 1.0)
        want = 0.1 * min(1.0, (s + 1) / 3) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
        np.testing.assert_allclose(float(cos(s)), want, rtol=1e-5)
    with pytest.raises(ValueError, match="decay_steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="learning_rate"):
        OptimizerConfig(learning_rate=float("nan"))


def test_cpu_default_compiler_options_apply_and_yield_to_the_caller():
    """On CPU the step hands only dots to YNNPACK (rl.learner.jitted.CPU_DEFAULT_OPTIONS),
    and a caller's option with the same key wins; the option really compiles here."""
    from rl.learner.jitted import CPU_DEFAULT_OPTIONS, cpu_default_options
    assert jax.default_backend() == "cpu" and cpu_default_options() == CPU_DEFAULT_OPTIONS
    key, value = CPU_DEFAULT_OPTIONS[0]
    assert dict(make_train_step(PG_CONFIG, CFG)._opts)[key] == value
    opts = dict(make_train_step(PG_CONFIG, CFG, compiler_options={key: "",
                                                                  "xla_backend_optimization_level": 0})._opts)
    assert opts == {key: "", "xla_backend_optimization_level": 0}
