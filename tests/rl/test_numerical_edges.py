"""Numerical edges of the objectives: float64 end to end, float32 reductions of bf16
losses, hyper-parameters of the wrong type, and which tokens enter GSPO's sequence
ratio when an off-policy correction rejects some (all against float64 numpy)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import LossConfig, compute_loss
from rl.objectives.advantages import (
    AdvantageConfig,
    grpo_advantages,
    mc_grpo_advantages,
    rloo_advantages,
)
from rl.objectives.losses import aggregate, gspo_token_loss, ppo_clip_token_loss
from rl.objectives.offpolicy import m2po_mask

# Rewards whose group statistics are not exact in float32: a float32 factor n/(n-1)
# or n/#nonzero is off by ~1e-8 relative, far above float64's 1e-16.
REWARDS = np.array([0.1, 0.7, 0.3, 1 / 3, 0.9, 0.2, 0.55, 0.05, 2 / 7, 0.6, 0.61, 0.62],
                   np.float64)


def _rloo_reference(r, n):
    out = np.empty_like(r)
    for s in range(0, len(r), n):
        g = r[s:s + n]
        for i in range(n):
            out[s + i] = g[i] - (g.sum() - g[i]) / (n - 1)
    return out


def _mc_grpo_reference(r, n):
    out = np.empty_like(r)
    for s in range(0, len(r), n):
        g = r[s:s + n]
        med = np.sort(g)[(n - 1) // 2]
        std = np.sqrt(((g - g.mean()) ** 2).sum() / (n - 1))
        adv = (g - med) / (std + 1e-6)
        nonzero = np.count_nonzero(g - med)
        out[s:s + n] = adv * (n / nonzero if nonzero else 1.0)
    return out


@pytest.mark.parametrize("ids", [False, True])
def test_rloo_and_mc_grpo_are_float64_in_float64_mode(ids):
    n = 4  # n/(n-1) = 4/3 and n/#nonzero = 4/3 are not exact in float32
    with jax.enable_x64():
        r = jnp.asarray(REWARDS)
        kw = {"group_ids": jnp.repeat(jnp.arange(3), n)} if ids else {"group_size": n}
        rloo = rloo_advantages(r, **kw)
        mc = mc_grpo_advantages(r, **kw).advantages
        assert rloo.dtype == jnp.float64 and mc.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(rloo), _rloo_reference(REWARDS, n),
                                   rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(np.asarray(mc), _mc_grpo_reference(REWARDS, n),
                                   rtol=1e-12, atol=1e-14)


def test_float32_rewards_stay_float32():
    r = jnp.asarray(REWARDS, jnp.float32)
    assert rloo_advantages(r, 4).dtype == jnp.float32
    assert mc_grpo_advantages(r, 4).advantages.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(rloo_advantages(r, 4)),
                               _rloo_reference(REWARDS, 4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_aggregate_of_bf16_is_float32(mode):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 300)).astype(np.float32)
    mask = rng.random((4, 300)) < 0.8
    xb = jnp.asarray(x, jnp.bfloat16)
    out = aggregate(xb, jnp.asarray(mask), mode)
    assert out.dtype == jnp.float32
    # reference: the bf16 values summed in float64
    xv = np.asarray(xb.astype(jnp.float32), np.float64) * mask
    lengths = mask.sum(1)
    ref = {"token-mean": xv.sum() / mask.sum(),
           "seq-mean-token-mean": (xv.sum(1) / lengths).mean(),
           "seq-mean-token-sum": xv.sum(1).mean(),
           "seq-mean-token-sum-norm": xv.sum(1).mean() / 300}[mode]
    np.testing.assert_allclose(float(out), ref, rtol=1e-5)


@pytest.mark.parametrize("build, name", [
    (lambda: LossConfig(max_len="512"), "max_len"),
    (lambda: LossConfig(kl_coef="0.1"), "kl_coef"),
    (lambda: LossConfig(entropy_coef=None), "entropy_coef"),
    (lambda: LossConfig(params={"clip_high": None}), "clip_high"),
    (lambda: LossConfig(params={"clip_low": "0.2"}), "clip_low"),
    (lambda: LossConfig(name="gspo", params={"clip_high": [4e-4]}), "clip_high"),
    (lambda: AdvantageConfig("grpo", params={"eps": "tiny"}), "eps"),
    (lambda: AdvantageConfig("mc_grpo", params={"mad_eps": None}), "mad_eps"),
])
def test_bad_hyper_parameters_raise_value_error_naming_them(build, name):
    with pytest.raises(ValueError, match=name):
        build()


def test_optional_hyper_parameters_still_accept_none():
    assert dict(LossConfig(params={"dual_clip": None}).params)["dual_clip"] is None
    assert dict(LossConfig(name="cispo", params={"clip_low": None}).params)["clip_low"] is None


@pytest.mark.parametrize("call, name", [
    (lambda x, m: aggregate(x, m, "seq-mean-token-sum-norm", max_len="a"), "max_len"),
    (lambda x, m: aggregate(x, m, "seq-mean-token-sum-norm", max_len=True), "max_len"),
    (lambda x, m: ppo_clip_token_loss(x, x, x[:, 0], m, clip_high=None), "clip_high"),
    (lambda x, m: ppo_clip_token_loss(x, x, x[:, 0], m, clip_low=1.5), "clip_low"),
    (lambda x, m: gspo_token_loss(x, x, x[:, 0], m, clip_low=float("nan")), "clip_low"),
    (lambda x, m: grpo_advantages(x[:, 0], 2, eps=None), "eps"),
    (lambda x, m: m2po_mask(x, x, m, threshold="1"), "threshold"),
])
def test_direct_calls_raise_value_error_naming_the_parameter(call, name):
    x = jnp.zeros((2, 3))
    m = jnp.ones((2, 3))
    with pytest.raises(ValueError, match=name):
        call(x, m)


def _gspo_reference(logp, old, adv, mask, keep, clip_low, clip_high):
    """float64 GSPO with s_i over the kept tokens and the loss averaged per sequence over
    the original mask ("seq-mean-token-mean"); ℓ is 0 on rejected tokens."""
    losses = []
    for i in range(logp.shape[0]):
        k = keep[i]
        log_s = (logp[i][k] - old[i][k]).mean()
        s = np.exp(log_s)
        lt = max(-adv[i] * s, -adv[i] * np.clip(s, 1 - clip_low, 1 + clip_high))
        losses.append(lt * k.sum() / mask[i].sum())
    return np.mean(losses)


def test_gspo_sequence_ratio_excludes_rejected_tokens():
    rng = np.random.default_rng(3)
    b, t = 3, 6
    old = rng.normal(-1.0, 0.3, (b, t))
    logp = old + rng.normal(0, 2e-4, (b, t))
    logp[0, 2] = old[0, 2] + 3.0  # the untrusted token: a huge log-ratio
    mask = np.ones((b, t), bool)
    mask[2, 4:] = False
    weights = np.ones((b, t))
    weights[0, 2] = 0.0  # rejected by the off-policy correction (mode="mask")
    adv = np.array([1.0, -0.5, 0.7])
    keep = mask & (weights > 0)
    cfg = LossConfig(name="gspo", aggregation="seq-mean-token-mean")
    loss, metrics = compute_loss(cfg, jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
                                 jnp.asarray(adv, jnp.float32), jnp.asarray(mask),
                                 token_weights=jnp.asarray(weights, jnp.float32))
    ref = _gspo_reference(logp, old, adv, mask, keep, 3e-4, 4e-4)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    # Counting the rejected token in s_0 would clip sequence 0 (s_0 ≈ e^{0.5}): different.
    wrong = _gspo_reference(logp, old, adv, mask, mask, 3e-4, 4e-4)
    assert abs(wrong - ref) > 1e-3
    # the clip metric describes the kept tokens: sequence 0 is no longer clipped
    assert float(metrics["clip_frac"]) < 0.2


def test_token_level_loss_unchanged_by_kept_mask():
    """For a per-token loss, passing the kept tokens changes nothing but the metrics' support:
    the loss equals Σ ℓ_t w_t / Σ mask in float64."""
    rng = np.random.default_rng(4)
    old = rng.normal(-1.0, 0.3, (2, 5))
    logp = old + rng.normal(0, 0.3, (2, 5))
    adv = np.array([0.8, -1.2])
    w = np.array([[1, 0, 0.5, 1, 1], [1, 1, 1, 0, 2.0]])
    cfg = LossConfig(name="ppo_clip", params={"dual_clip": None})
    loss, _ = compute_loss(cfg, jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
                           jnp.asarray(adv, jnp.float32), jnp.ones((2, 5)),
                           token_weights=jnp.asarray(w, jnp.float32))
    r = np.exp(logp - old)
    a = adv[:, None]
    ell = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    np.testing.assert_allclose(float(loss), (ell * w).sum() / 10, rtol=1e-5)
