"""Policy losses, aggregation, KL and entropy against loop-based float64 numpy references."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl.objectives import (
    LossConfig,
    aggregate,
    available_losses,
    compute_loss,
    get_loss,
    register_loss,
    token_entropy,
)
from rl.objectives.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOSS_PRESETS,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
    ppo_clip_token_loss,
)

B, S, V = 4, 6, 5
TOL = dict(rtol=1e-4, atol=1e-5)
PPO_CONFIGS = [(0.2, 0.2, 3.0), (0.2, 0.28, 10.0), (0.2, 0.2, None)]


# ----------------------------------------------------------------------------- references


def ref_ppo_token(lp, old, adv, mask, lo, hi, c):
    """(loss [B, S], d loss_t / d logp_t [B, S], clipped-active [B, S]) per token."""
    loss, dtok, active = np.zeros(lp.shape), np.zeros(lp.shape), np.zeros(lp.shape, bool)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            a = float(adv[i] if adv.ndim == 1 else adv[i, t])
            r = math.exp(min(max(lp[i, t] - old[i, t], -20.0), 20.0))
            unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            val, grad = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
            if c is not None and a < 0 and -a * c < val:
                val, grad = -a * c, 0.0
            loss[i, t], dtok[i, t], active[i, t] = val, grad, grad == 0.0 and a != 0.0
    return loss, dtok, active


def ref_aggregate(x, mask, mode, max_len=None):
    lengths = [int(sum(mask[i])) for i in range(x.shape[0])]
    seqs = [i for i in range(x.shape[0]) if lengths[i] > 0]
    if mode == "token-mean":
        n = sum(lengths)
        return sum(x[i, t] for i in seqs for t in range(x.shape[1]) if mask[i, t]) / max(n, 1)
    sums = {i: sum(x[i, t] for t in range(x.shape[1]) if mask[i, t]) for i in seqs}
    if not seqs:
        return 0.0
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / lengths[i] for i in seqs) / len(seqs)
    if mode == "seq-mean-token-sum":
        return sum(sums.values()) / len(seqs)
    return sum(sums.values()) / len(seqs) / (max_len or x.shape[1])


def ref_gspo(lp, old, adv, mask, lo, hi):
    """(loss, d loss / d logp) for seq-mean-token-mean aggregation."""
    loss_tok, grad = np.zeros(lp.shape), np.zeros(lp.shape)
    lengths = mask.sum(1)
    n_seq = int((lengths > 0).sum())
    for i in range(lp.shape[0]):
        if lengths[i] == 0:
            continue
        log_s = sum(lp[i, t] - old[i, t] for t in range(lp.shape[1]) if mask[i, t]) / lengths[i]
        s = math.exp(min(log_s, 10.0))
        a = float(adv[i])
        unclipped, clipped = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        for t in range(lp.shape[1]):
            if mask[i, t]:
                loss_tok[i, t] = max(unclipped, clipped)
                if unclipped >= clipped and log_s < 10.0:
                    grad[i, t] = -a * s / (n_seq * lengths[i])
    return ref_aggregate(loss_tok, mask, "seq-mean-token-mean"), grad


def ref_cispo(lp, old, adv, mask, hi):
    n = max(mask.sum(), 1)
    loss, grad = 0.0, np.zeros(lp.shape)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                w = min(max(math.exp(lp[i, t] - old[i, t]), 0.0), 1 + hi)
                loss += -w * adv[i] * lp[i, t] / n
                grad[i, t] = -w * adv[i] / n
    return loss, grad


def ref_kl(x, y, mask, est):
    out = np.zeros(x.shape)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not mask[i, t]:
                continue
            d = y[i, t] - x[i, t]
            if est == "k1":
                out[i, t] = -d
            elif est == "k2":
                out[i, t] = 0.5 * d * d
            else:
                dc = min(max(d, -20.0), 20.0)
                out[i, t] = min(max(math.exp(dc) - dc - 1.0, -10.0), 10.0)
    return out


def ref_entropy(logits):
    out = np.zeros(logits.shape[:-1])
    for idx in np.ndindex(*logits.shape[:-1]):
        row = [float(v) for v in logits[idx]]
        top = max(row)
        z = sum(math.exp(v - top) for v in row if v != -math.inf)
        h = 0.0
        for v in row:
            if v != -math.inf:
                p = math.exp(v - top) / z
                h -= p * math.log(p)
        out[idx] = h
    return out


def make_inputs(seed, noise, empty_row=True):
    rng = np.random.default_rng(seed)
    lp = (-np.abs(rng.normal(size=(B, S))) - 0.1).astype(np.float32)
    # per-sequence noise scale: some sequences near-on-policy (inside GSPO's tiny clip)
    row_scale = rng.choice(np.array([1e-5, noise], np.float32), size=(B, 1))
    old = (lp + row_scale * rng.normal(size=(B, S))).astype(np.float32)
    ref = (lp + rng.normal(size=(B, S))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    adv[rng.integers(B)] = 0.0
    mask = rng.random((B, S)) > 0.3
    mask[:, 0] = True
    if empty_row:
        mask[rng.integers(B)] = False
    return lp, old, ref, adv, mask


def poison(x, mask):
    """NaN in every masked position: must not leak into values or gradients."""
    return np.where(mask, x, np.nan).astype(np.float32)


# ----------------------------------------------------------------------------- one jit for all


def everything(lp, old, ref, adv, mask):
    out = {}
    for k, (lo, hi, c) in enumerate(PPO_CONFIGS):
        kw = dict(clip_low=lo, clip_high=hi, dual_clip=c)
        out[f"ppo_tok{k}"], stats = ppo_clip_token_loss(lp, old, adv, mask, **kw)
        out[f"ppo_active{k}"] = stats["clip_frac"]
        (out[f"ppo_loss{k}"], out[f"ppo_metrics{k}"]), out[f"ppo_grad{k}"] = jax.value_and_grad(
            lambda x: ppo_clip_loss(x, old, adv, mask, **kw), has_aux=True)(lp)
    for mode in AGGREGATIONS:
        out[f"agg {mode}"] = aggregate(out["ppo_tok0"], mask, mode)
    out["agg norm 10"] = aggregate(out["ppo_tok0"], mask, "seq-mean-token-sum-norm", max_len=10)
    out["gspo"], out["gspo_grad"] = jax.value_and_grad(
        lambda x: gspo_loss(x, old, adv, mask)[0])(lp)
    out["cispo"], (out["cispo_grad"], out["cispo_grad_old"]) = jax.value_and_grad(
        lambda x, o: cispo_loss(x, o, adv, mask)[0], argnums=(0, 1))(lp, old)
    for est in KL_ESTIMATORS:
        out[f"kl {est}"] = kl_penalty(lp, ref, mask, est)
        out[f"kl_grad {est}"] = jax.grad(lambda x: jnp.sum(kl_penalty(x, ref, mask, est)))(lp)
    return out


everything_jit = jax.jit(everything)


@given(seed=st.integers(0, 2**31 - 1), noise=st.sampled_from([0.05, 1.0, 4.0]))
def test_losses_match_reference(seed, noise):
    lp, old, ref, adv, mask = make_inputs(seed, noise)
    out = everything_jit(poison(lp, mask), poison(old, mask), poison(ref, mask),
                         adv, mask)
    for name, value in out.items():
        for leaf in jax.tree.leaves(value):
            assert np.all(np.isfinite(np.asarray(leaf))), name
    n = max(mask.sum(), 1)
    for k, (lo, hi, c) in enumerate(PPO_CONFIGS):
        tok, dtok, active = ref_ppo_token(lp, old, adv, mask, lo, hi, c)
        np.testing.assert_allclose(out[f"ppo_tok{k}"], tok, **TOL)
        np.testing.assert_allclose(out[f"ppo_loss{k}"], ref_aggregate(tok, mask, "token-mean"), **TOL)
        np.testing.assert_allclose(out[f"ppo_grad{k}"], dtok / n, **TOL)
        # zero gradient exactly where the clip is active
        grad = np.asarray(out[f"ppo_grad{k}"])
        assert np.all(grad[active] == 0.0)
        np.testing.assert_array_equal(np.asarray(out[f"ppo_active{k}"]).astype(bool) & mask, active)
    tok0 = ref_ppo_token(lp, old, adv, mask, *PPO_CONFIGS[0])[0]
    for mode in AGGREGATIONS:
        np.testing.assert_allclose(out[f"agg {mode}"], ref_aggregate(tok0, mask, mode), **TOL)
    np.testing.assert_allclose(out["agg norm 10"],
                               ref_aggregate(tok0, mask, "seq-mean-token-sum-norm", 10), **TOL)
    gspo, gspo_grad = ref_gspo(lp, old, adv, mask, 3e-4, 4e-4)
    np.testing.assert_allclose(out["gspo"], gspo, **TOL)
    np.testing.assert_allclose(out["gspo_grad"], gspo_grad, **TOL)
    cispo, cispo_grad = ref_cispo(lp, old, adv, mask, 0.28)
    np.testing.assert_allclose(out["cispo"], cispo, **TOL)
    np.testing.assert_allclose(out["cispo_grad"], cispo_grad, **TOL)
    assert np.all(np.asarray(out["cispo_grad_old"]) == 0.0)  # the IS weight is detached
    for est in KL_ESTIMATORS:
        want = ref_kl(lp, ref, mask, "k3" if est == "k3+" else est)
        np.testing.assert_allclose(out[f"kl {est}"], want, **TOL)
    # gradients: k1 -> 1, k2 -> x - y, k3 -> 1 - e^{y-x}, k3+ -> k2's
    np.testing.assert_allclose(out["kl_grad k1"], mask.astype(np.float32), **TOL)
    np.testing.assert_allclose(out["kl_grad k2"], np.where(mask, lp - ref, 0), **TOL)
    np.testing.assert_allclose(out["kl_grad k3"], np.where(mask, 1 - np.exp(ref - lp), 0), **TOL)
    np.testing.assert_allclose(out["kl_grad k3+"], out["kl_grad k2"], **TOL)


def test_dual_clip_and_far_outside_ratios():
    # one sequence per case; r = e^3 ≈ 20 is far above every clip, r = e^-3 far below
    lp = np.zeros((B, S), np.float32)
    old = np.repeat(np.array([[-3.0], [3.0], [3.0], [-3.0]], np.float32), S, axis=1)
    adv = np.array([-1.0, 1.0, -1.0, 1.0], np.float32)
    mask = np.ones((B, S), bool)
    out = everything_jit(lp, old, lp, adv, mask)
    r_hi, r_lo = math.exp(3.0), math.exp(-3.0)
    # dual-clipped at -A·3, unclipped (pessimistic side), low clip -A·0.8, high clip -A·1.2
    want = {0: [3.0, -r_lo, 0.8, -1.2], 1: [10.0, -r_lo, 0.8, -1.28], 2: [r_hi, -r_lo, 0.8, -1.2]}
    for k, per_seq in want.items():
        np.testing.assert_allclose(out[f"ppo_loss{k}"], np.mean(per_seq), rtol=1e-5)
        grad = np.asarray(out[f"ppo_grad{k}"])
        want_grad = np.zeros((B, S))
        want_grad[1] = -r_lo / (B * S)
        if PPO_CONFIGS[k][2] is None:  # no dual clip: the r = e^3, A < 0 token keeps its gradient
            want_grad[0] = r_hi / (B * S)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
        metrics = out[f"ppo_metrics{k}"]
        has_dual = PPO_CONFIGS[k][2] is not None
        np.testing.assert_allclose(metrics["clip_frac_dual"], 0.25 if has_dual else 0.0)
        np.testing.assert_allclose(metrics["clip_frac_low"], 0.25)
        np.testing.assert_allclose(metrics["clip_frac_high"], 0.25)
        np.testing.assert_allclose(metrics["clip_frac"], 0.75 if has_dual else 0.5)
        np.testing.assert_allclose(metrics["ratio_max"], r_hi, rtol=1e-5)


def test_kl_clamps_on_extreme_log_ratios():
    x = np.array([[-30.0, -5.0, -41.0, -0.2, -160.0]], np.float32)
    y = np.array([[-2.0, -0.5, -2.0, -0.3, -10.0]], np.float32)  # y - x = 28, 4.5, 39, -0.1, 150
    mask = np.ones_like(x, bool)
    for est in ("k3", "k3+"):
        got = np.asarray(kl_penalty(x, y, mask, est))
        np.testing.assert_allclose(got, ref_kl(x, y, mask, "k3"), rtol=1e-5)
        np.testing.assert_array_equal(got[0, [0, 1, 2, 4]], 10.0)  # result clamp
    # the ±20 input clamp keeps e^{y-x} finite, so the k3 gradient is 0 there, not NaN
    g3 = np.asarray(jax.grad(lambda v: jnp.sum(kl_penalty(v, y, mask, "k3")))(x))
    np.testing.assert_array_equal(g3[0, [0, 1, 2, 4]], 0.0)
    np.testing.assert_allclose(g3[0, 3], 1 - math.exp(-0.1), rtol=1e-4)
    g = jax.grad(lambda v: jnp.sum(kl_penalty(v, y, mask, "k3+")))(x)
    np.testing.assert_allclose(g, x - y, rtol=1e-5)


def test_entropy_matches_reference_and_handles_masks_and_banned_tokens():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(B, S, V)).astype(np.float32) * 3
    logits[0, 1, 2] = -np.inf  # a banned token
    mask = rng.random((B, S)) > 0.3
    mask[0, 1] = True
    poisoned = np.where(mask[..., None], logits, np.nan).astype(np.float32)
    f = jax.jit(lambda x, m: token_entropy(x, m))
    got = f(poisoned, mask)
    np.testing.assert_allclose(got, np.where(mask, ref_entropy(logits), 0), **TOL)
    np.testing.assert_allclose(token_entropy(logits), ref_entropy(logits), **TOL)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(token_entropy(x, mask))))(poisoned)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_compute_loss_with_kl_entropy_and_token_weights():
    lp, old, ref, adv, mask = make_inputs(11, 1.0)
    rng = np.random.default_rng(11)
    ent = rng.random((B, S)).astype(np.float32)
    weights = rng.random((B, S)).astype(np.float32) * 2
    cfg = LossConfig("ppo_clip", {"clip_high": 0.28, "dual_clip": 10.0},
                     aggregation="seq-mean-token-mean", kl_estimator="k2", kl_coef=0.1,
                     entropy_coef=0.01)

    @jax.jit
    def f(x):
        full = compute_loss(cfg, x, old, adv, mask, ref_logp=ref, entropy=ent,
                            token_weights=weights)
        grad = jax.grad(lambda y: compute_loss(LossConfig("ppo_clip"), y, old, adv, mask,
                                               token_weights=weights)[0])(x)
        return full, grad

    (loss, metrics), g = f(poison(lp, mask))
    tok = ref_ppo_token(lp, old, adv, mask, 0.2, 0.28, 10.0)[0]
    mode = "seq-mean-token-mean"
    want = (ref_aggregate(tok * weights, mask, mode)
            + 0.1 * ref_aggregate(ref_kl(lp, ref, mask, "k2"), mask, mode)
            - 0.01 * ref_aggregate(ent, mask, mode))
    np.testing.assert_allclose(loss, want, **TOL)
    np.testing.assert_allclose(metrics["loss"], want, **TOL)
    assert {"pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "approx_kl"} <= set(metrics)
    # weights are detached: the gradient is the weighted per-token gradient
    dtok = ref_ppo_token(lp, old, adv, mask, 0.2, 0.2, 3.0)[1]
    np.testing.assert_allclose(g, dtok * weights / mask.sum(), **TOL)


def test_jit_and_vmap_agree_with_eager():
    lp, old, ref, adv, mask = make_inputs(5, 1.0)
    tok_adv = (adv[:, None] + np.random.default_rng(5).normal(size=(B, S))).astype(np.float32)
    eager = ppo_clip_loss(lp, old, tok_adv, mask)  # per-token advantages [batch, seq]
    jitted = jax.jit(ppo_clip_loss)(lp, old, tok_adv, mask)
    tok, _, _ = ref_ppo_token(lp, old, tok_adv, mask, 0.2, 0.2, 3.0)
    np.testing.assert_allclose(eager[0], ref_aggregate(tok, mask, "token-mean"), **TOL)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, **TOL)
    stack = lambda x: np.stack([x, x[::-1]])
    batched = jax.jit(jax.vmap(everything))(stack(lp), stack(old), stack(ref), stack(adv),
                                            stack(mask))
    single = everything_jit(lp[::-1], old[::-1], ref[::-1], adv[::-1], mask[::-1])
    for name in single:
        for a, b in zip(jax.tree.leaves(batched[name]), jax.tree.leaves(single[name])):
            np.testing.assert_allclose(a[1], b, **TOL, err_msg=name)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    lp, old, ref, adv, mask = make_inputs(6, 1.0)
    with pytest.raises(ValueError, match=r"shape mismatch: logp \(4, 6\), mask \(4, 5\)"):
        ppo_clip_loss(lp, old, adv, mask[:, :5])
    with pytest.raises(ValueError, match="advantages has shape"):
        ppo_clip_loss(lp, old, adv[:3], mask)
    with pytest.raises(ValueError, match=r"logp must be a \[batch, seq\] array"):
        ppo_clip_loss(lp[0], old, adv, mask)
    bad = lp.copy()
    bad[np.argwhere(mask)[0][0], np.argwhere(mask)[0][1]] = np.nan
    with pytest.raises(ValueError, match="logp has 1 non-finite"):
        ppo_clip_loss(bad, old, adv, mask)
    with pytest.raises(ValueError, match="aggregation mode must be one of"):
        aggregate(lp, mask, "sum")
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_penalty(lp, ref, mask, "k4")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low must be in"):
        ppo_clip_loss(lp, old, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match="ref_logp is required"):
        compute_loss(LossConfig.preset("grpo"), lp, old, adv, mask)


def test_registry_config_and_presets():
    assert {"ppo_clip", "gspo", "cispo"} <= set(available_losses())
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; known: cispo, gspo, ppo_clip"):
        get_loss("ppo")
    with pytest.raises(ValueError, match="takes no hyper-parameter 'dual_clip'"):
        LossConfig("gspo", {"dual_clip": 3.0})
    with pytest.raises(ValueError, match="aggregation must be one of"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="unknown preset"):
        LossConfig.preset("trpo")
    assert set(LOSS_PRESETS) == {"grpo", "dr_grpo", "dapo", "gspo", "cispo"}
    dapo = LossConfig.preset("dapo")
    assert dapo.kwargs == {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 10.0}
    assert dapo.aggregation == "token-mean" and dapo.kl_coef == 0.0
    assert hash(dapo) == hash(LossConfig.preset("dapo"))

    lp, old, ref, adv, mask = make_inputs(8, 1.0)
    loss, _ = compute_loss(LossConfig.preset("gspo"), lp, old, adv, mask)
    np.testing.assert_allclose(loss, ref_gspo(lp, old, adv, mask, 3e-4, 4e-4)[0], **TOL)

    @register_loss("test_reinforce", overwrite=True)
    def reinforce(logp, old_logp, advantages, mask, *, scale=1.0):
        per_token = -scale * jnp.asarray(advantages)[:, None] * jnp.where(mask, logp, 0.0)
        return per_token, {}

    loss, metrics = compute_loss(LossConfig("test_reinforce", {"scale": 2.0}), lp, old, adv, mask)
    want = ref_aggregate(-2.0 * adv[:, None] * lp, mask, "token-mean")
    np.testing.assert_allclose(loss, want, **TOL)
    assert "ratio_max" in metrics
