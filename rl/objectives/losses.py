"""Policy-gradient losses for LM post-training: per-token losses, aggregation, KL, entropy.

A loss is computed in two steps:
  1. a per-token loss ``ℓ [batch, seq]`` (PPO-clip, GSPO, CISPO, or a registered one),
     returned with per-token statistics (clip indicators, ratios);
  2. `aggregate` reduces it with one of four modes.
``ppo_clip_loss`` / ``gspo_loss`` / ``cispo_loss`` do both and return
``(loss, metrics)``; `compute_loss` does both from a `LossConfig` and
adds the KL and entropy terms and off-policy token weights.

Conventions: ``logp``, ``old_logp`` (proximal / old policy), ``ref_logp`` and
``mask`` are ``[batch, seq]``; ``advantages`` are ``[batch]`` (broadcast over
tokens) or ``[batch, seq]``; ``mask`` is binary (bool, int or float; nonzero =
response token). Masked positions may hold anything, NaN included: they are
replaced by 0 with ``jnp.where`` before any arithmetic, so neither the loss nor its
gradient sees them. Ratios are ``exp(clip(logp - old_logp, -20, 20))``.
Non-finite values at unmasked positions raise ValueError when the inputs are
concrete (the check is skipped under jit/grad/vmap, where values are unknown).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rl.objectives.registry import (
    check_finite,
    check_float,
    check_number,
    check_params,
    check_rank,
    check_same_shape,
    freeze_params,
    get_loss,
    register_loss,
)

Array = jax.Array
sg = jax.lax.stop_gradient

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")
_LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------------------
# Input handling


def _float32_up(x: Array) -> Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def token_mask(mask: Array, name: str = "mask") -> Array:
    """Validate a [batch, seq] mask and return it as bool."""
    m = jnp.asarray(mask)
    check_rank(name, m, 2, "a [batch, seq] array")
    return m if m.dtype == jnp.bool_ else m != 0


def token_array(name: str, x: Array, mask: Array) -> Array:
    """Validate a [batch, seq] float array against ``mask`` [batch, seq] (bool), and
    return it in >= float32 with masked positions set to 0 (NaN there cannot leak)."""
    x = jnp.asarray(x)
    check_rank(name, x, 2, "a [batch, seq] array")
    check_float(name, x)
    check_same_shape(**{name: x, "mask": mask})
    check_finite(name, x, where=mask)
    return jnp.where(mask, _float32_up(x), 0.0)


def token_advantages_of(advantages: Array, mask: Array) -> Array:
    """Advantages [batch] or [batch, seq] -> [batch, seq] float, 0 where masked."""
    a = jnp.asarray(advantages)
    check_rank("advantages", a, {1, 2}, "a [batch] or [batch, seq] array")
    if a.ndim == 1:
        if a.shape[0] != mask.shape[0]:
            raise ValueError(
                f"advantages has shape {a.shape} but mask has shape {mask.shape}; "
                f"one advantage per sequence (or one per token) is needed"
            )
        a = jnp.broadcast_to(a[:, None], mask.shape)
    check_same_shape(advantages=a, mask=mask)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(jnp.float32)
    check_finite("advantages", a, where=mask)
    return jnp.where(mask, _float32_up(a), 0.0)


def _inputs(logp, old_logp, advantages, mask):
    m = token_mask(mask)
    return (token_array("logp", logp, m), token_array("old_logp", old_logp, m),
            token_advantages_of(advantages, m), m)


def _log_ratio(logp: Array, old_logp: Array) -> Array:
    return jnp.clip(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _check_clip(clip_low: float | None, clip_high: float, *, low_below_one: bool = True) -> None:
    check_number("clip_low", clip_low, low=0.0, high=1.0 if low_below_one else None,
                 high_open=True, allow_none=True)
    check_number("clip_high", clip_high, low=0.0)


def masked_mean(x: Array, mask: Array) -> Array:
    """Mean of ``x`` over ``mask`` (same shape); 0 when the mask is empty."""
    m = jnp.asarray(mask).astype(bool)
    x = jnp.where(m, x, 0.0)
    return jnp.sum(x) / jnp.maximum(jnp.sum(m), 1)


# ---------------------------------------------------------------------------
# Aggregation


def aggregate(per_token_loss: Array, mask: Array, mode: str = "token-mean", *,
              max_len: int | None = None) -> Array:
    """Reduce a per-token loss [batch, seq] over ``mask`` [batch, seq] to a scalar.

    With L_i = sum_t M_it and B = number of sequences with L_i > 0:

      * "token-mean":              sum ℓM / sum M                  (DAPO; veRL default)
      * "seq-mean-token-mean":     (1/B) sum_i (sum_t ℓM) / L_i    (GRPO paper, GSPO)
      * "seq-mean-token-sum":      (1/B) sum_i sum_t ℓM
      * "seq-mean-token-sum-norm": (1/B) sum_i sum_t ℓM / C        (Dr. GRPO), with the
        constant C = ``max_len`` (default: the padded length ``seq``).
    Fully masked sequences are left out of B; an all-masked batch gives 0. The result
    is float32 for float32 / bf16 / fp16 inputs and float64 for float64 ones.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation mode must be one of {AGGREGATIONS}, got {mode!r}")
    m = token_mask(mask)
    x = jnp.asarray(per_token_loss)
    check_rank("per_token_loss", x, 2, "a [batch, seq] array")
    check_same_shape(per_token_loss=x, mask=m)
    # Sums over a batch of tokens lose too much in bf16: reduce in float32 (or wider).
    x = jnp.where(m, _float32_up(x), 0.0)
    if mode == "token-mean":
        return jnp.sum(x) / jnp.maximum(jnp.sum(m), 1)
    lengths = jnp.sum(m, axis=1).astype(x.dtype)
    n_seqs = jnp.maximum(jnp.sum(lengths > 0), 1)
    seq_sums = jnp.sum(x, axis=1)
    if mode == "seq-mean-token-mean":
        return jnp.sum(seq_sums / jnp.maximum(lengths, 1.0)) / n_seqs
    if mode == "seq-mean-token-sum":
        return jnp.sum(seq_sums) / n_seqs
    if max_len is None:
        max_len = x.shape[1]
    check_number("max_len", max_len, low=0.0, low_open=True)
    return jnp.sum(seq_sums) / (n_seqs * float(max_len))


# ---------------------------------------------------------------------------
# Per-token policy losses (registered; each returns (ℓ [batch, seq], token stats))


@register_loss("ppo_clip")
def ppo_clip_token_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = 3.0,
) -> tuple[Array, dict[str, Array]]:
    """Token-level PPO-clip with asymmetric clip and dual clip.

    ℓ_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))  (Schulman et al. 2017);
    clip_high > clip_low is DAPO's clip-higher (Yu et al. 2025: 0.2 / 0.28);
    for A < 0 the dual clip bounds ℓ_t <= -A·dual_clip (Ye et al. 2020; veRL default
    c = 3, DAPO recipe c = 10; None disables it).

    Args:
        logp, old_logp, mask: [batch, seq]; advantages [batch] or [batch, seq].
    Returns:
        ℓ [batch, seq] (0 where masked) and per-token float indicators
        clip_frac_low / clip_frac_high / clip_frac_dual / clip_frac (where the clip
        is active, i.e. the token's gradient is 0) and ratio_mean (r_t).
    """
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    logp, old_logp, adv, m = _inputs(logp, old_logp, advantages, mask)
    ratio = jnp.exp(_log_ratio(logp, old_logp))
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    low = (adv < 0) & (ratio < 1.0 - clip_low)
    high = (adv > 0) & (ratio > 1.0 + clip_high)
    if dual_clip is None:
        dual = jnp.zeros_like(low)
    else:
        bound = -adv * dual_clip
        dual = (adv < 0) & (bound < loss)
        loss = jnp.where(dual, bound, loss)
    stats = {"clip_frac_low": low, "clip_frac_high": high, "clip_frac_dual": dual,
             "clip_frac": low | high | dual, "ratio_mean": ratio}
    return jnp.where(m, loss, 0.0), stats


@register_loss("gspo")
def gspo_token_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
    clip_low: float = 3e-4, clip_high: float = 4e-4,
) -> tuple[Array, dict[str, Array]]:
    """GSPO: sequence-level ratio, clipped per sequence (Zheng et al. 2025).

    log s_i = mean_t (logp - old_logp) over the response; the token ratio that
    carries the gradient is exp(sg[log s_i] + logp_t - sg[logp_t]) (its log
    clamped <= 10), whose value is s_i and whose gradient is s_i ∇logp_t;
    ℓ_t = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high)); no dual clip.
    Use with "seq-mean-token-mean" aggregation (the paper's). The mean runs over
    ``mask``; compute_loss passes the kept tokens, so tokens that an off-policy
    correction rejected (mode="mask", weight 0) are not part of s_i.

    Returns:
        ℓ [batch, seq] and token stats (clip_frac_low / clip_frac_high / clip_frac,
        ratio_mean = s_i on each token).
    """
    _check_clip(clip_low, clip_high)
    logp, old_logp, adv, m = _inputs(logp, old_logp, advantages, mask)
    lengths = jnp.sum(m, axis=1)
    log_s = jnp.sum(logp - old_logp, axis=1) / jnp.maximum(lengths, 1)
    log_tok = jnp.minimum(sg(log_s)[:, None] + logp - sg(logp), 10.0)
    ratio = jnp.exp(log_tok)
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    low = (adv < 0) & (ratio < 1.0 - clip_low)
    high = (adv > 0) & (ratio > 1.0 + clip_high)
    stats = {"clip_frac_low": low, "clip_frac_high": high, "clip_frac": low | high,
             "ratio_mean": ratio}
    return jnp.where(m, loss, 0.0), stats


@register_loss("cispo")
def cispo_token_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
    clip_high: float = 0.28, clip_low: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """CISPO: clipped IS weight times a REINFORCE term (MiniMax-M1, 2025).

    ℓ_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] · A · logp_t: every token keeps
    a gradient (only through logp), the weight is bounded. MiniMax leaves the lower
    bound off (clip_low=None -> 0) and tunes only clip_high; 0.28 is the common
    open-source default (e.g. Trinity-RFT).

    Returns:
        ℓ [batch, seq] and token stats (clip_frac_high / clip_frac_low where the
        weight is clipped, ratio_mean).
    """
    _check_clip(clip_low, clip_high, low_below_one=False)
    logp, old_logp, adv, m = _inputs(logp, old_logp, advantages, mask)
    ratio = jnp.exp(_log_ratio(logp, old_logp))
    lower = 0.0 if clip_low is None else max(1.0 - clip_low, 0.0)
    weight = sg(jnp.clip(ratio, lower, 1.0 + clip_high))
    loss = -weight * adv * logp
    high = ratio > 1.0 + clip_high
    low = ratio < lower
    stats = {"clip_frac_low": low, "clip_frac_high": high, "clip_frac": low | high,
             "ratio_mean": ratio}
    return jnp.where(m, loss, 0.0), stats


# ---------------------------------------------------------------------------
# KL and entropy


def kl_penalty(logp: Array, ref_logp: Array, mask: Array, estimator: str = "k3") -> Array:
    """Per-token KL estimate of π_θ against a reference policy (Schulman 2020 "Approximating
    KL divergence"), with x = logp, y = ref_logp, all [batch, seq]:

      k1 = x - y;  k2 = ½ (x - y)²;  k3 = e^{y-x} - (y - x) - 1 (y - x clamped to ±20,
      result to ±10; veRL's "low_var_kl");  "k3+" = k3's value with k2's gradient
      (straight-through: k2 + sg[k3 - k2]).

    Returns:
        [batch, seq], 0 where masked.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    m = token_mask(mask)
    x = token_array("logp", logp, m)
    y = token_array("ref_logp", ref_logp, m)
    if estimator == "k1":
        kl = x - y
    elif estimator == "k2":
        kl = 0.5 * jnp.square(x - y)
    else:
        d = jnp.clip(y - x, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        k3 = jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)
        if estimator == "k3":
            kl = k3
        else:
            k2 = 0.5 * jnp.square(x - y)
            kl = k2 + sg(k3 - k2)
    return jnp.where(m, kl, 0.0)


def token_entropy(logits: Array, mask: Array | None = None) -> Array:
    """Entropy H = -Σ_v p_v log p_v of the next-token distribution.

    Args:
        logits: [..., vocab] (e.g. [batch, seq, vocab]); -inf entries (banned tokens)
            are fine; computed in float32 or wider.
        mask: optional [...] (e.g. [batch, seq]); masked rows give 0 and may hold NaN.
    Returns:
        [...] entropies (nats).
    """
    x = _float32_up(jnp.asarray(logits))
    check_float("logits", x)
    if x.ndim < 1:
        raise ValueError(f"logits must have a vocab axis, got shape {x.shape}")
    if mask is not None:
        m = jnp.asarray(mask).astype(bool)
        if m.shape != x.shape[:-1]:
            raise ValueError(
                f"mask has shape {m.shape} but logits has shape {x.shape}; mask must be "
                f"logits' shape without the vocab axis"
            )
        x = jnp.where(m[..., None], x, 0.0)
    # A row with no finite logit has no distribution: give it entropy 0, not NaN.
    row_ok = jnp.isfinite(jnp.max(x, axis=-1, keepdims=True))
    x = jnp.where(row_ok, x, 0.0)
    logz = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    logq = x - logz
    p = jnp.exp(logq)
    live = p > 0  # p = 0 for -inf logits: 0·log 0 := 0 (and a finite gradient)
    h = -jnp.sum(jnp.where(live, p * jnp.where(live, logq, 0.0), 0.0), axis=-1)
    if mask is not None:
        h = jnp.where(m, h, 0.0)
    return h


# ---------------------------------------------------------------------------
# Loss = per-token loss + aggregation + metrics


def reduce_loss(per_token: Array, stats: dict[str, Array], logp: Array, old_logp: Array,
                mask: Array, aggregation: str = "token-mean", max_len: int | None = None,
                stats_mask: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Aggregate a per-token loss [batch, seq] over ``mask`` and reduce its token stats to
    metrics over ``stats_mask`` (default ``mask``; compute_loss passes the trained tokens).

    Metrics: every stat's masked token mean, ratio_max, approx_kl (k3 estimate of
    KL(π_old || π_θ) on the sampled tokens) and pg_loss (the aggregated loss).
    """
    m = token_mask(mask)
    loss = aggregate(per_token, m, aggregation, max_len=max_len)
    sm = m if stats_mask is None else token_mask(stats_mask, "stats_mask")
    metrics = {k: masked_mean(v.astype(jnp.float32), sm) for k, v in stats.items()}
    lr = sg(_log_ratio(jnp.where(sm, logp, 0.0), jnp.where(sm, old_logp, 0.0)))
    metrics["ratio_max"] = jnp.where(jnp.any(sm), jnp.max(jnp.where(sm, jnp.exp(lr), 0.0)), 0.0)
    metrics["approx_kl"] = masked_mean(jnp.exp(lr) - lr - 1.0, sm)
    metrics["pg_loss"] = loss
    return loss, metrics


def ppo_clip_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = 3.0,
    aggregation: str = "token-mean", max_len: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO-clip loss (see `ppo_clip_token_loss`) aggregated with `aggregate`.

    Returns:
        (scalar loss, metrics: clip_frac_low/high/dual, clip_frac, ratio_mean,
        ratio_max, approx_kl, pg_loss).
    """
    per_token, stats = ppo_clip_token_loss(logp, old_logp, advantages, mask, clip_low=clip_low,
                                           clip_high=clip_high, dual_clip=dual_clip)
    return reduce_loss(per_token, stats, logp, old_logp, mask, aggregation, max_len)


def gspo_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
    clip_low: float = 3e-4, clip_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean", max_len: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """GSPO loss (see `gspo_token_loss`); returns (scalar loss, metrics)."""
    per_token, stats = gspo_token_loss(logp, old_logp, advantages, mask,
                                       clip_low=clip_low, clip_high=clip_high)
    return reduce_loss(per_token, stats, logp, old_logp, mask, aggregation, max_len)


def cispo_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
    clip_high: float = 0.28, clip_low: float | None = None,
    aggregation: str = "token-mean", max_len: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """CISPO loss (see `cispo_token_loss`); returns (scalar loss, metrics)."""
    per_token, stats = cispo_token_loss(logp, old_logp, advantages, mask,
                                        clip_high=clip_high, clip_low=clip_low)
    return reduce_loss(per_token, stats, logp, old_logp, mask, aggregation, max_len)


# ---------------------------------------------------------------------------
# Config and dispatch

_RESERVED = ("logp", "old_logp", "advantages", "mask")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which policy loss to run and how to reduce it (hashable: usable as a jit static).

    Attributes:
        name: registered per-token loss ("ppo_clip", "gspo", "cispo", or your own).
        params: the loss's hyper-parameters (dict or pairs; unset ones take the loss
            function's defaults). Unknown names raise ValueError at construction.
        aggregation: one of `AGGREGATIONS`.
        max_len: C of "seq-mean-token-sum-norm" (default: padded length).
        kl_estimator / kl_coef: KL-to-reference term (off by default; 0.001 is the
            usual coefficient when on).
        entropy_coef: entropy bonus (subtracted from the loss; off by default).
    """

    name: str = "ppo_clip"
    params: Any = ()
    aggregation: str = "token-mean"
    max_len: int | None = None
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "params", freeze_params(self.params))
        check_params("policy loss", self.name, get_loss(self.name), self.params, _RESERVED)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        check_number("kl_coef", self.kl_coef, low=0.0)
        check_number("entropy_coef", self.entropy_coef)
        check_number("max_len", self.max_len, low=0.0, low_open=True, allow_none=True)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    @classmethod
    def preset(cls, algorithm: str) -> "LossConfig":
        """Loss settings of a published recipe; see `LOSS_PRESETS`."""
        if algorithm not in LOSS_PRESETS:
            raise ValueError(
                f"unknown preset {algorithm!r}; known: {', '.join(sorted(LOSS_PRESETS))}"
            )
        return cls(**LOSS_PRESETS[algorithm])


# Sources of the presets:
#   grpo    GRPO (Shao et al. 2024): PPO-clip 0.2, per-sequence token mean, KL k3
#           to the reference (coef 0.001 as in veRL's GRPO examples; the paper used
#           0.04); veRL's dual clip c = 3.
#   dr_grpo Dr. GRPO (Liu et al. 2025): sum over tokens / constant, no KL.
#   dapo    DAPO (Yu et al. 2025): clip 0.2 / 0.28 (clip-higher), dual clip 10,
#           token-mean, no KL. Pair with rl.objectives.offpolicy.dynamic_sampling_mask and
#           overlong_penalty.
#   gspo    GSPO (Zheng et al. 2025): sequence ratio, clip 3e-4 / 4e-4,
#           seq-mean-token-mean, no KL.
#   cispo   CISPO (MiniMax-M1, 2025): IS weight clipped at 1 + 0.28, no lower
#           bound, token-mean, no KL.
LOSS_PRESETS: dict[str, dict[str, Any]] = {
    "grpo": dict(name="ppo_clip", params={"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0},
                 aggregation="seq-mean-token-mean", kl_estimator="k3", kl_coef=0.001),
    "dr_grpo": dict(name="ppo_clip", params={"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0},
                    aggregation="seq-mean-token-sum-norm"),
    "dapo": dict(name="ppo_clip", params={"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 10.0},
                 aggregation="token-mean"),
    "gspo": dict(name="gspo", params={"clip_low": 3e-4, "clip_high": 4e-4},
                 aggregation="seq-mean-token-mean"),
    "cispo": dict(name="cispo", params={"clip_high": 0.28, "clip_low": None},
                  aggregation="token-mean"),
}


def compute_loss(
    config: LossConfig,
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    ref_logp: Array | None = None,
    entropy: Array | None = None,
    token_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The full policy loss ``config`` describes.

    loss = aggregate(ℓ · sg[token_weights]) + kl_coef · aggregate(KL) - entropy_coef ·
    aggregate(entropy), every aggregate over the ORIGINAL ``mask`` — so zero weights
    (off-policy rejection, see rl.objectives.offpolicy) drop tokens while keeping the
    denominator, as AReaL's decoupled objective requires. The per-token loss itself is
    computed on the kept tokens (mask and weight > 0): GSPO's sequence ratio is the
    geometric mean over kept tokens only, and the per-sequence advantage A_i multiplies
    the kept tokens only; the clip / ratio metrics describe the kept tokens.

    Args:
        config: a `LossConfig`.
        logp, old_logp, mask: [batch, seq]; advantages [batch] or [batch, seq].
        ref_logp: [batch, seq], required when ``config.kl_coef > 0``.
        entropy: [batch, seq] token entropies (e.g. `token_entropy`), required
            when ``config.entropy_coef != 0``; otherwise only logged if given.
        token_weights: [batch, seq] off-policy weights (detached here).
    Returns:
        (scalar loss, metrics) with the loss's clip fractions and ratio statistics,
        pg_loss, kl / entropy when present, and loss.
    """
    fn = get_loss(config.name)
    m = token_mask(mask)
    keep = m
    if token_weights is not None:
        w = sg(token_array("token_weights", token_weights, m))
        keep = m & (w > 0)
    # The per-token loss sees only the kept tokens: for token-level losses this changes
    # nothing (a dropped token's ℓ is multiplied by 0 anyway), and GSPO's sequence ratio
    # s_i = exp(mean over kept tokens of log π_θ - log π_old) leaves out tokens the
    # off-policy correction rejected (or a 0 loss weight dropped), so one untrusted
    # token can neither move s_i nor clip the whole sequence.
    per_token, stats = fn(logp, old_logp, advantages, keep, **config.kwargs)
    if token_weights is not None:
        per_token = per_token * w
    total, metrics = reduce_loss(per_token, stats, jnp.asarray(logp), jnp.asarray(old_logp), m,
                                 config.aggregation, config.max_len, stats_mask=keep)
    if config.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("ref_logp is required when kl_coef > 0 (or set kl_coef=0)")
        kl = aggregate(kl_penalty(logp, ref_logp, m, config.kl_estimator), m,
                       config.aggregation, max_len=config.max_len)
        metrics["kl"] = kl
        total = total + config.kl_coef * kl
    if config.entropy_coef != 0:
        if entropy is None:
            raise ValueError("entropy [batch, seq] is required when entropy_coef != 0")
        ent = aggregate(token_array("entropy", entropy, m), m, config.aggregation,
                        max_len=config.max_len)
        metrics["entropy"] = ent
        total = total - config.entropy_coef * ent
    elif entropy is not None:
        metrics["entropy"] = masked_mean(token_array("entropy", entropy, m), m)
    metrics["loss"] = total
    return total, metrics
