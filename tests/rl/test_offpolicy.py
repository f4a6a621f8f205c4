"""Off-policy corrections and DAPO data shaping against loop-based float64 references."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl.objectives import (
    LossConfig,
    approx_proximal_logp,
    behaviour_weights,
    compute_loss,
    decoupled_ppo_loss,
    dynamic_sampling_mask,
    kept_group_indices,
    m2po_mask,
    m2po_weights,
    overlong_penalty,
    ratio_decomposition_metrics,
    sequence_log_ratio,
    truncated_is_weights,
)
from rl.objectives.offpolicy import last_token_values

B, S = 4, 6
TOL = dict(rtol=1e-4, atol=1e-5)
WEIGHT_CASES = [  # (function, level, mode, cap)
    ("tis", "token", "truncate", 2.0),
    ("tis", "token", "mask", 2.0),
    ("tis", "sequence", "truncate", 8.0),
    ("tis", "sequence", "mask", 8.0),
    ("behav", "token", "mask", 5.0),
    ("behav", "sequence", "clamp", 1.5),
]
DECOUPLED_CASES = [("token", "mask", 5.0, None), ("sequence", "clamp", 1.2, 3.0)]
M2PO_THRESHOLDS = [0.04, 0.5]


# ----------------------------------------------------------------------------- references


def ref_weights(prox, mu, mask, kind, level, mode, cap):
    """(weights, keep) by loops; sequence level = product (TIS) or geometric mean (AReaL)."""
    w_out, keep = np.zeros(prox.shape), np.zeros(prox.shape, bool)
    for i in range(prox.shape[0]):
        toks = [t for t in range(prox.shape[1]) if mask[i, t]]
        seq_log = sum(float(prox[i, t]) - float(mu[i, t]) for t in toks)
        if kind == "behav" and toks:
            seq_log /= len(toks)
        for t in toks:
            log_w = seq_log if level == "sequence" else float(prox[i, t]) - float(mu[i, t])
            w = math.exp(log_w)
            if w > cap and mode == "mask":
                continue
            w_out[i, t], keep[i, t] = min(w, cap), True
    return w_out, keep


def ref_ppo_token(lp, old, adv, mask, lo, hi, c):
    loss, dtok = np.zeros(lp.shape), np.zeros(lp.shape)
    for i, t in zip(*np.nonzero(mask)):
        a, r = float(adv[i]), math.exp(float(lp[i, t]) - float(old[i, t]))
        unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
        val, grad = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
        if c is not None and a < 0 and -a * c < val:
            val, grad = -a * c, 0.0
        loss[i, t], dtok[i, t] = val, grad
    return loss, dtok


def ref_m2po(prox, mu, mask, tau):
    items = [((float(mu[i, t]) - float(prox[i, t])) ** 2, i * prox.shape[1] + t)
             for i in range(prox.shape[0]) for t in range(prox.shape[1]) if mask[i, t]]
    items.sort(key=lambda p: (-p[0], p[1]))  # largest first, earlier position first
    while len(items) > 1 and sum(v for v, _ in items) / len(items) > tau:
        items.pop(0)
    keep = np.zeros(prox.shape, bool)
    for _, flat in items:
        keep[flat // prox.shape[1], flat % prox.shape[1]] = True
    return keep


def ref_approx_prox(lp, mu, versions, v, mask):
    out = np.zeros(lp.shape)
    for i, t in zip(*np.nonzero(mask)):
        vb = int(versions[i, t])
        alpha = min(max((v - 1 - vb) / (v - vb), 0.0), 1.0) if v > vb else 0.0
        out[i, t] = mu[i, t] + alpha * (lp[i, t] - mu[i, t])
    return out


def make_inputs(seed, noise):
    rng = np.random.default_rng(seed)
    lp = (-np.abs(rng.normal(size=(B, S))) - 0.1).astype(np.float32)
    prox = (lp + 0.3 * rng.normal(size=(B, S))).astype(np.float32)
    mu = (prox + noise * rng.normal(size=(B, S))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    mask = rng.random((B, S)) > 0.3
    mask[:, 0] = True
    mask[rng.integers(B)] = False  # a fully masked sequence
    versions = rng.integers(0, 6, size=(B, S)).astype(np.int32)
    return lp, prox, mu, adv, mask, versions


def poison(x, mask):
    return np.where(mask, x, np.nan).astype(np.float32)


# ----------------------------------------------------------------------------- one jit for all


def everything(lp, prox, mu, adv, mask, versions):
    out = {}
    for k, (kind, level, mode, cap) in enumerate(WEIGHT_CASES):
        fn = truncated_is_weights if kind == "tis" else behaviour_weights
        res = fn(prox, mu, mask, level=level, mode=mode, cap=cap)
        out[f"w{k}"], out[f"keep{k}"] = res.weights, res.keep
        out[f"capped{k}"] = res.metrics[f"{kind}_capped_frac" if kind == "behav" else "is_capped_frac"]
    for k, (level, mode, cap, c) in enumerate(DECOUPLED_CASES):
        f = lambda x: decoupled_ppo_loss(x, prox, mu, adv, mask, level=level, mode=mode,
                                         behaviour_cap=cap, dual_clip=c)[0]
        out[f"dec{k}"], out[f"dec_grad{k}"] = jax.value_and_grad(f)(lp)
    for k, tau in enumerate(M2PO_THRESHOLDS):
        out[f"m2po{k}"] = m2po_mask(prox, mu, mask, threshold=tau)[0]
    out["approx"] = approx_proximal_logp(lp, mu, versions, 5, mask)
    out["approx_grad"] = jax.grad(
        lambda x: jnp.sum(approx_proximal_logp(x, mu, versions, 5, mask)))(lp)
    out["seq_sum"] = sequence_log_ratio(prox, mu, mask)
    out["seq_mean"] = sequence_log_ratio(prox, mu, mask, reduce="mean")
    out["decomp"] = ratio_decomposition_metrics(lp, prox, mu, mask)
    return out


everything_jit = jax.jit(everything)


@given(seed=st.integers(0, 2**31 - 1), noise=st.sampled_from([0.1, 1.0, 3.0]))
def test_offpolicy_matches_reference(seed, noise):
    lp, prox, mu, adv, mask, versions = make_inputs(seed, noise)
    out = everything_jit(poison(lp, mask), poison(prox, mask), poison(mu, mask), adv, mask,
                         versions)
    for leaf in jax.tree.leaves(out):
        assert np.all(np.isfinite(np.asarray(leaf)))
    for k, (kind, level, mode, cap) in enumerate(WEIGHT_CASES):
        w, keep = ref_weights(prox, mu, mask, kind, level, mode, cap)
        np.testing.assert_allclose(out[f"w{k}"], w, **TOL, err_msg=str(WEIGHT_CASES[k]))
        np.testing.assert_array_equal(out[f"keep{k}"], keep, err_msg=str(WEIGHT_CASES[k]))
        assert np.all(np.asarray(out[f"w{k}"]) <= cap * (1 + 1e-6))
    n = max(mask.sum(), 1)
    for k, (level, mode, cap, c) in enumerate(DECOUPLED_CASES):
        w, keep = ref_weights(prox, mu, mask, "behav", level, mode, cap)
        tok, dtok = ref_ppo_token(lp, prox, adv, mask, 0.2, 0.2, c)
        # sum over kept tokens, divided by the ORIGINAL mask count
        np.testing.assert_allclose(out[f"dec{k}"], np.sum(tok * w * keep) / n, **TOL)
        np.testing.assert_allclose(out[f"dec_grad{k}"], dtok * w * keep / n, **TOL)
    for k, tau in enumerate(M2PO_THRESHOLDS):
        np.testing.assert_array_equal(out[f"m2po{k}"], ref_m2po(prox, mu, mask, tau))
    np.testing.assert_allclose(out["approx"], ref_approx_prox(lp, mu, versions, 5, mask), **TOL)
    assert np.all(np.asarray(out["approx_grad"]) == 0.0)  # detached
    for i in range(B):
        toks = [t for t in range(S) if mask[i, t]]
        total = sum(float(prox[i, t]) - float(mu[i, t]) for t in toks)
        np.testing.assert_allclose(out["seq_sum"][i], total, **TOL)
        np.testing.assert_allclose(out["seq_mean"][i], total / max(len(toks), 1), **TOL)
    d = out["decomp"]
    valid = mask.astype(bool)
    for name, lr in (("mismatch", prox - mu), ("staleness", lp - prox), ("total", lp - mu)):
        lr = lr[valid].astype(np.float64)
        np.testing.assert_allclose(d[f"{name}_log_ratio_mean"], lr.mean(), **TOL)
        np.testing.assert_allclose(d[f"{name}_log_ratio_abs_mean"], np.abs(lr).mean(), **TOL)
        np.testing.assert_allclose(d[f"{name}_kl_k3"], np.mean(np.exp(lr) - lr - 1), **TOL)
        np.testing.assert_allclose(d[f"{name}_ratio_max"], np.exp(lr).max(), **TOL)


def test_m2po_keeps_at_least_one_token_and_all_when_below_threshold():
    lp, prox, mu, adv, mask, versions = make_inputs(1, 3.0)

    @jax.jit
    def f(p, m_, k):
        return (m2po_mask(p, m_, k, threshold=0.0), m2po_mask(p, m_, k, threshold=1e6),
                m2po_mask(p, m_, jnp.zeros_like(k), threshold=0.04)[0],
                m2po_mask(jnp.full_like(p, -1.0), jnp.full_like(p, -0.5), k, threshold=0.25)[0])

    (keep0, _), (keep_all, metrics_all), keep_none, keep_tie = f(prox, mu, mask)
    # every m2 is exactly 0.25: a mean equal to the threshold is accepted (M2 <= tau)
    np.testing.assert_array_equal(keep_tie, mask)
    assert int(np.asarray(keep0).sum()) == 1  # only the token with the smallest m2 survives
    m2 = np.where(mask, (mu - prox) ** 2, np.inf)
    assert np.asarray(keep0)[np.unravel_index(np.argmin(m2), m2.shape)]
    np.testing.assert_array_equal(keep_all, mask)
    assert float(metrics_all["m2po_masked_frac"]) == 0.0
    assert not np.asarray(keep_none).any()


@pytest.mark.parametrize("tau", [0.04, 0.5])
def test_m2po_weights_are_the_kept_tokens_ratio_in_float64(tau):
    _, prox, mu, _, mask, _ = make_inputs(4, 1.0)
    ow = jax.jit(lambda p, b, m: m2po_weights(p, b, m, threshold=tau))(poison(prox, mask),
                                                                      poison(mu, mask), mask)
    keep = ref_m2po(prox, mu, mask, tau)
    assert 0 < keep.sum() < mask.sum()  # both kept and masked tokens at this noise
    want = np.where(keep, np.exp(prox.astype(np.float64) - mu.astype(np.float64)), 0.0)
    np.testing.assert_array_equal(ow.keep, keep)
    np.testing.assert_allclose(ow.weights, want, rtol=1e-5, atol=0.0)
    np.testing.assert_allclose(ow.metrics["m2po_masked_frac"], 1 - keep.sum() / mask.sum(),
                               atol=1e-6)
    np.testing.assert_allclose(ow.metrics["m2po_weight_max"], want.max(), rtol=1e-5)
    # constants of the step: no gradient through the weights
    g = jax.grad(lambda p, b: jnp.sum(m2po_weights(p, b, mask, threshold=tau).weights),
                 argnums=(0, 1))(prox, mu)
    assert all(np.all(np.asarray(x) == 0.0) for x in g)


def test_decoupled_loss_equals_compute_loss_with_token_weights():
    lp, prox, mu, adv, mask, _ = make_inputs(2, 1.0)
    bw = behaviour_weights(prox, mu, mask)
    want, _ = compute_loss(LossConfig("ppo_clip", {"dual_clip": None}), lp, prox, adv, mask,
                           token_weights=bw.weights)
    got, metrics = decoupled_ppo_loss(lp, prox, mu, adv, mask)
    np.testing.assert_allclose(got, want, **TOL)
    # the weights are constants: no gradient reaches prox_logp or behaviour_logp through them
    g = jax.grad(lambda p, b: jnp.sum(behaviour_weights(p, b, mask).weights), argnums=(0, 1))(prox, mu)
    assert all(np.all(np.asarray(x) == 0.0) for x in g)
    assert {"behav_kept_frac", "behav_weight_mean", "clip_frac", "pg_loss"} <= set(metrics)


# ----------------------------------------------------------------------------- DAPO shaping


def test_dynamic_sampling_mask():
    r = np.array([1, 1, 1, 0, 1, 0, 0.3, 0.3, 0.3, 2.0, 0.5, 0.5], np.float32)
    ids = np.array([0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4])
    by3, by1, by_ids = jax.jit(lambda x, i: (dynamic_sampling_mask(x, 3), dynamic_sampling_mask(x, 1),
                                             dynamic_sampling_mask(x, group_ids=i)))(r, ids)
    want = []
    for g in range(4):
        vals = r[3 * g: 3 * g + 3]
        want += [bool(max(vals) != min(vals))] * 3
    np.testing.assert_array_equal(by3, want)
    np.testing.assert_array_equal(by1, np.ones(12, bool))  # size-1 groups are kept
    want_ids = [len({float(r[j]) for j in range(12) if ids[j] == ids[i]}) > 1 or
                (ids == ids[i]).sum() == 1 for i in range(12)]
    np.testing.assert_array_equal(by_ids, want_ids)
    np.testing.assert_array_equal(kept_group_indices(r, 3), [1, 3])  # eager, host side


def test_overlong_penalty_and_last_token_placement():
    lengths = np.array([0, 50, 80, 90, 99, 100, 130])
    got = np.asarray(overlong_penalty(lengths, max_len=100, buffer_len=20))
    for n, g in zip(lengths, got):
        if n <= 80:
            want = 0.0
        elif n <= 100:
            want = (80 - n) / 20
        else:
            want = -1.0
        assert abs(g - want) < 1e-6, (n, g, want)
    np.testing.assert_allclose(overlong_penalty(lengths, max_len=100, buffer_len=20, factor=0.5),
                               got * 0.5, atol=1e-7)
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]], bool)
    vals = np.array([0.5, -1.0, 2.0, 3.0], np.float32)
    got = np.asarray(jax.jit(last_token_values)(vals, mask))
    want = np.zeros((4, 4))
    want[0, 1], want[2, 3], want[3, 3] = 0.5, 2.0, 3.0
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- jit / vmap


def test_jit_and_vmap_agree_with_eager():
    lp, prox, mu, adv, mask, versions = make_inputs(4, 1.0)
    eager = truncated_is_weights(prox, mu, mask, level="sequence", mode="mask")
    jitted = jax.jit(lambda p, m_, k: truncated_is_weights(p, m_, k, level="sequence",
                                                           mode="mask"))(prox, mu, mask)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_array_equal(m2po_mask(prox, mu, mask)[0], everything_jit(
        lp, prox, mu, adv, mask, versions)["m2po0"])
    stack = lambda x: np.stack([x, x[::-1]])
    batched = jax.jit(jax.vmap(everything))(*map(stack, (lp, prox, mu, adv, mask, versions)))
    single = everything_jit(lp[::-1], prox[::-1], mu[::-1], adv[::-1], mask[::-1], versions[::-1])
    flat_b, flat_s = jax.tree.leaves(batched), jax.tree.leaves(single)
    for a, b in zip(flat_b, flat_s):
        np.testing.assert_allclose(a[1], b, **TOL)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    lp, prox, mu, adv, mask, versions = make_inputs(5, 1.0)
    with pytest.raises(ValueError, match=r"shape mismatch: behaviour_logp \(4, 5\), mask \(4, 6\)"):
        truncated_is_weights(prox, mu[:, :5], mask)
    with pytest.raises(ValueError, match="level must be"):
        truncated_is_weights(prox, mu, mask, level="batch")
    with pytest.raises(ValueError, match="mode must be 'truncate' or 'mask'"):
        truncated_is_weights(prox, mu, mask, mode="clamp")
    with pytest.raises(ValueError, match="cap must be a positive"):
        behaviour_weights(prox, mu, mask, cap=0.0)
    with pytest.raises(ValueError, match="token_versions must be integers"):
        approx_proximal_logp(lp, mu, versions.astype(np.float32), 5, mask)
    with pytest.raises(ValueError, match="group_size 5 does not divide the batch of 12"):
        dynamic_sampling_mask(np.zeros(12, np.float32), 5)
    with pytest.raises(ValueError, match="rewards has 1 non-finite"):
        dynamic_sampling_mask(np.array([0.0, np.nan]), 2)
    with pytest.raises(ValueError, match="max_len"):
        overlong_penalty(np.array([3]), max_len=10, buffer_len=20)
    bad = mu.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="behaviour_logp has 1 non-finite"):
        m2po_mask(prox, bad, np.ones_like(mask))
