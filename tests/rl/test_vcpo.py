"""rl.objectives.vcpo against float64 numpy / python-loop references: the ESS ratio (direct formula
on moderate weights, finite where the direct formula overflows, the 1 and 1/M limits),
the ESS update scale through optax, the minimum-variance baseline and its advantages,
and the exact per-trajectory gradient norms (vmap(grad) in chunks) against one jax.grad
per row with a hand-written log-softmax."""
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.config import get_config
from models.decoder import forward, init_params
from rl.learner import per_trajectory_logprob_grads
from rl.objectives import (
    VCPOConfig,
    centred_advantages,
    ess_lr_scale,
    ess_ratio,
    min_variance_baseline,
    scale_by_ess,
    sequence_log_weights,
    truncated_sequence_weights,
    vcpo_advantages,
    weight_tail_stats,
)


# ----------------------------------------------------------------------------- ESS
def ess_direct(log_w, valid):
    """(Σ w)² / Σ w² / M with the weights exponentiated directly (float64)."""
    w = [math.exp(x) for x, v in zip(log_w, valid) if v]
    return sum(w) ** 2 / sum(x * x for x in w) / len(w)


def ess_shifted(log_w, valid):
    """The same ratio with every weight divided by the largest first (float64 loop)."""
    xs = [x for x, v in zip(log_w, valid) if v]
    top = max(xs)
    s1 = math.fsum(math.exp(x - top) for x in xs)
    s2 = math.fsum(math.exp(2 * (x - top)) for x in xs)
    return s1 * s1 / s2 / len(xs)


@pytest.mark.parametrize("m", [1, 2, 7, 64])
def test_ess_equals_direct_formula_on_moderate_weights(m):
    rng = np.random.default_rng(m)
    log_w = rng.normal(0.0, 1.5, m)
    valid = rng.random(m) < 0.8
    valid[0] = True
    got = float(ess_ratio(log_w.astype(np.float32), valid))
    np.testing.assert_allclose(got, ess_direct(log_w, valid), rtol=2e-5)
    np.testing.assert_allclose(float(ess_ratio(log_w.astype(np.float32))),
                               ess_direct(log_w, np.ones(m, bool)), rtol=2e-5)


def test_ess_stays_finite_where_the_direct_formula_overflows():
    rng = np.random.default_rng(0)
    log_w = 1000.0 + rng.normal(0.0, 2.0, 32)
    with pytest.raises(OverflowError):
        ess_direct(log_w, np.ones(32, bool))
    got = float(ess_ratio(log_w.astype(np.float32)))
    assert math.isfinite(got) and 1 / 32 <= got <= 1
    np.testing.assert_allclose(got, ess_shifted(log_w, np.ones(32, bool)), rtol=1e-4)
    for extreme in ([-1000.0] * 5 + [1000.0], [3e4, -3e4, 0.0]):
        r = float(ess_ratio(np.asarray(extreme, np.float32)))
        assert math.isfinite(r) and 1 / len(extreme) <= r <= 1


def test_ess_limits():
    for value in (0.0, -7.0, 900.0):
        assert float(ess_ratio(np.full(16, value, np.float32))) == pytest.approx(1.0, abs=1e-6)
    dominant = np.zeros(16, np.float32)
    dominant[5] = 60.0
    assert float(ess_ratio(dominant)) == pytest.approx(1 / 16, rel=1e-6)
    # invalid rows are not counted, whatever their value
    lw = np.array([0.0, 0.0, 80.0, 0.0], np.float32)
    assert float(ess_ratio(lw, np.array([1, 1, 0, 1], bool))) == pytest.approx(1.0, abs=1e-6)
    assert float(ess_ratio(lw, np.zeros(4, bool))) == 1.0  # nothing valid: no down-weighting
    with pytest.raises(ValueError, match="log_w"):
        ess_ratio(np.zeros((2, 2), np.float32))


# ----------------------------------------------------------------------------- update scale
@pytest.mark.parametrize("mode", ["sqrt", "linear"])
@pytest.mark.parametrize("rho,rho_base", [(0.09, 1.0), (0.3, 0.5), (0.8, 0.5), (1.0, 1.0)])
def test_scale_by_ess_scales_the_final_update(mode, rho, rho_base):
    grads = {"a": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5)}
    params = jax.tree.map(jnp.zeros_like, grads)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1),
                     scale_by_ess(rho_base=rho_base, mode=mode))
    state = tx.init(params)
    got, _ = tx.update(grads, state, params, ess=jnp.float32(rho))
    base, _ = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)).update(
        grads, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)).init(params), params)
    s = min(1.0, rho / rho_base)
    want = math.sqrt(s) if mode == "sqrt" else s
    for k in grads:
        np.testing.assert_allclose(np.asarray(got[k]), want * np.asarray(base[k]), rtol=1e-6)
    assert float(ess_lr_scale(rho, rho_base, mode)) == pytest.approx(want, rel=1e-6)
    assert float(ess_lr_scale(rho, rho_base, "none")) == 1.0


def test_scale_by_ess_needs_the_ess_argument_and_valid_options():
    tx = scale_by_ess()
    with pytest.raises(ValueError, match="ess"):
        tx.update({"a": jnp.ones(2)}, tx.init({"a": jnp.ones(2)}))
    with pytest.raises(ValueError, match="rho_base"):
        scale_by_ess(rho_base=0.0)
    with pytest.raises(ValueError, match="mode"):
        scale_by_ess(mode="cube")


# ----------------------------------------------------------------------------- baseline
def baseline_loop(rewards, log_w, norms, variant, valid, cap=8.0):
    """b_g = Σ W R / (Σ W + 1e-8) per group, float64 loop."""
    out = []
    for g in range(rewards.shape[0]):
        num = den = 0.0
        for i in range(rewards.shape[1]):
            if not valid[g, i]:
                continue
            w = math.exp(log_w[g, i])
            big_w = w * w * (1.0 if norms is None else norms[g, i])
            if variant == "released":
                trunc = min(math.exp(max(-20.0, min(20.0, log_w[g, i]))), cap)
                big_w *= trunc * trunc
            num += big_w * rewards[g, i]
            den += big_w
        out.append(num / (den + 1e-8))
    return np.array(out)


def advantages_loop(rewards, b):
    out = np.zeros_like(rewards)
    for g in range(rewards.shape[0]):
        r = rewards[g]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
        for i in range(len(r)):
            out[g, i] = (r[i] - b[g]) / (std if std > 1e-8 else 1.0)
    return out


@pytest.mark.parametrize("variant", ["paper", "released"])
def test_baseline_matches_the_loop_reference(variant):
    rng = np.random.default_rng(1)
    g, n = 5, 6
    rewards = rng.random((g, n))
    log_w = rng.normal(0.0, 1.2, (g, n))
    log_w[1, 2] = 3.0  # above the cap of the released variant's truncated weight
    norms = rng.uniform(0.1, 50.0, (g, n))
    valid = rng.random((g, n)) < 0.85
    valid[:, 0] = True
    for nm in (norms, None):
        got = min_variance_baseline(rewards.astype(np.float32), log_w.astype(np.float32),
                                    None if nm is None else nm.astype(np.float32),
                                    variant=variant, valid=valid)
        np.testing.assert_allclose(np.asarray(got), baseline_loop(rewards, log_w, nm, variant, valid),
                                   rtol=1e-5, atol=1e-6)


def test_baseline_with_equal_norms_is_the_importance_weighted_mean():
    rng = np.random.default_rng(2)
    rewards, log_w = rng.random((3, 8)), rng.normal(0.0, 1.0, (3, 8))
    got = min_variance_baseline(rewards.astype(np.float32), log_w.astype(np.float32),
                                np.full((3, 8), 7.5, np.float32))
    w2 = np.exp(2 * log_w)
    np.testing.assert_allclose(np.asarray(got), (w2 * rewards).sum(1) / w2.sum(1), rtol=1e-5)
    # equal weights too: the plain group mean
    got = min_variance_baseline(rewards.astype(np.float32), np.zeros((3, 8), np.float32), None)
    np.testing.assert_allclose(np.asarray(got), rewards.mean(1), rtol=1e-5)


def test_baseline_is_finite_for_huge_and_tiny_weights():
    rewards = np.array([[1.0, 0.0, 0.5], [0.2, 0.4, 0.9]], np.float32)
    log_w = np.array([[900.0, 0.0, 899.0], [-900.0, -900.0, -900.0]], np.float32)
    got = np.asarray(min_variance_baseline(rewards, log_w, None))
    assert np.isfinite(got).all()
    e = math.exp(-2.0)  # W = w² = e^1800, ~0, e^1798: the third row weighs e^-2 of the first
    np.testing.assert_allclose(got[0], (1.0 + 0.5 * e) / (1 + e), rtol=1e-5)
    assert abs(got[1]) < 1e-30  # Σ W << 1e-8: the formula's eps pulls b to 0
    # zero gradient norms everywhere -> W = 0 -> b = 0
    assert np.asarray(min_variance_baseline(rewards, np.zeros_like(rewards),
                                            np.zeros_like(rewards))).tolist() == [0.0, 0.0]


def test_advantages_centre_on_the_baseline_and_divide_by_population_std():
    rng = np.random.default_rng(3)
    rewards = rng.random((4, 5))
    rewards[2] = 0.25  # σ_g = 0: no division
    b = rng.random(4)
    got = centred_advantages(rewards.astype(np.float32), b.astype(np.float32))
    np.testing.assert_allclose(np.asarray(got), advantages_loop(rewards, b), rtol=1e-5, atol=1e-6)
    log_w = rng.normal(size=20)
    norms = rng.uniform(1, 3, 20)
    adv, base = vcpo_advantages(rewards.reshape(-1).astype(np.float32), log_w.astype(np.float32),
                                norms.astype(np.float32), 5)
    want_b = baseline_loop(rewards, log_w.reshape(4, 5), norms.reshape(4, 5), "paper",
                           np.ones((4, 5), bool))
    np.testing.assert_allclose(np.asarray(base), want_b, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(adv), advantages_loop(rewards, want_b).reshape(-1),
                               rtol=1e-4, atol=1e-5)
    adv, base = vcpo_advantages(rewards.reshape(-1), log_w, None, 5, baseline="none")
    np.testing.assert_allclose(np.asarray(adv), advantages_loop(rewards, np.zeros(4)).reshape(-1),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="group_size"):
        vcpo_advantages(rewards.reshape(-1), log_w, None, 3)
    with pytest.raises(ValueError, match="baseline"):
        vcpo_advantages(rewards.reshape(-1), log_w, None, 5, baseline="median")


def test_sequence_weights_tails_and_config():
    rng = np.random.default_rng(4)
    logp, mu = rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    mask = rng.random((4, 6)) < 0.6
    mask[3] = False
    lw = np.asarray(sequence_log_weights(logp.astype(np.float32), mu.astype(np.float32), mask))
    want = [sum(logp[b, t] - mu[b, t] for t in range(6) if mask[b, t]) for b in range(4)]
    np.testing.assert_allclose(lw, want, rtol=1e-5, atol=1e-6)
    tw = np.asarray(truncated_sequence_weights(np.array([-30.0, 0.5, 2.0, 25.0], np.float32)))
    np.testing.assert_allclose(tw, [math.exp(-20), math.exp(0.5), math.exp(2.0), 8.0], rtol=1e-5)
    x = rng.normal(size=200)
    valid = rng.random(200) < 0.7
    stats = {k: float(v) for k, v in weight_tail_stats(x.astype(np.float32), valid).items()}
    xs = np.sort(x[valid])
    assert stats["vcpo_logw_max"] == pytest.approx(xs[-1], rel=1e-6)
    assert stats["vcpo_logw_p99"] == pytest.approx(xs[math.ceil(0.99 * len(xs)) - 1], rel=1e-6)
    assert stats["vcpo_logw_std"] == pytest.approx(xs.std(), rel=1e-4)
    for bad in ({"lr_scale": "cube"}, {"baseline": "median"}, {"variant": "v2"},
                {"grad_norms": "approx"}, {"chunk": 0}, {"rho_base": 1.5}, {"is_cap": -1.0},
                {"enabled": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            VCPOConfig(**bad)


# ----------------------------------------------------------------------------- grad norms
CFG = get_config("tiny", vocab_size=16, max_position_embeddings=32)
TEMP = 0.7
FAST = {"xla_backend_optimization_level": 0}  # compile-bound test: compile about twice as fast


@partial(jax.jit, compiler_options=FAST)
def _row_value_and_grad(params, tokens, target_mask):
    """Σ_t log π(token t) over target_mask [T] for ONE row tokens [1, T] and its gradient,
    with the log-softmax written out by hand."""

    def seq_logprob(p):
        z = forward(p, CFG, tokens)[0] / TEMP
        top = jnp.max(z, axis=-1, keepdims=True)
        logp = z - (top + jnp.log(jnp.sum(jnp.exp(z - top), axis=-1, keepdims=True)))
        picked = logp[jnp.arange(z.shape[0] - 1), tokens[0, 1:]]
        return jnp.sum(picked * target_mask[1:])

    return jax.value_and_grad(seq_logprob)(params)


def test_per_trajectory_grad_norms_match_one_grad_per_row():
    params = init_params(CFG, 7)
    rng = np.random.default_rng(5)
    b, t = 7, 8
    tokens = rng.integers(1, CFG.vocab_size, (b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    mask = np.zeros((b, t), bool)
    for i in range(b):
        start = rng.integers(1, 5)
        mask[i, start:start + rng.integers(1, 4)] = True
    mask[4] = False  # an empty response: norm 0
    fn = jax.jit(per_trajectory_logprob_grads, static_argnums=(1, 5, 6), compiler_options=FAST)
    logp, norms = fn(params, CFG, tokens, positions, mask, TEMP, 3)  # 7 rows: the last chunk padded
    for i in range(b):
        value, g = _row_value_and_grad(params, tokens[i:i + 1], mask[i].astype(np.float32))
        want = sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(g))
        np.testing.assert_allclose(float(norms[i]), want, rtol=1e-4, atol=1e-8)
        np.testing.assert_allclose(float(np.sum(np.asarray(logp[i]) * mask[i, 1:])), float(value),
                                   rtol=1e-5, atol=1e-5)
    assert float(norms[4]) == 0.0
