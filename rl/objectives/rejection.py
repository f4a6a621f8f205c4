"""Rejection masks for the train/inference (and staleness) ratio: IcePop's two-sided token
mask and the token / sequence / geometric-mean rejection of "masked importance sampling".

With ρ_t = π_prox(y_t) / μ(y_t) (the learner's probability of a token over the sampler's
recorded one; [batch, seq] log-probs as in rl.objectives.offpolicy):

IcePop (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
Thinking Model", the Ring-1T report, 2025; the IcePop blog "Small Leak Can Sink a Great
Ship"): the policy gradient of token t is weighted by

    M(ρ_t; α, β) = ρ_t  if α ≤ ρ_t ≤ β,  else 0

so tokens whose two engines disagree beyond [α, β] are dropped (not clipped), and the kept
ones carry their ratio. Their J_IcePop = E[(1/Σ|y|) Σ_t M(π_train/π_infer; α, β) Â_t] puts
π_train(θ) inside M; with one update per batch (old_logp "current": π_prox = π_θ in value)
the loss here, sg[M(ρ_t)] · (π_θ/π_prox) Â_t, has the same value and gradient. Defaults
α = 0.5, β = 5 (OffPolicyConfig.low / cap); prime-rl ships α = 0.2, β = 5.

Masked importance sampling, the rejection half of verl's rollout correction (Liu, Li et al.
2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch"): a token or a whole sequence is kept (weight 1) when its ratio lies in
[C_low, C_high] (C_low = 1 / C_high unless given) and rejected (weight 0) otherwise, at

    token      ρ_t
    sequence   ρ_seq = Π_t ρ_t = exp(Σ_t log ρ_t)
    geometric  ρ_geo = (Π_t ρ_t)^(1/|T|) = exp(mean_t log ρ_t)   (a much tighter C_high,
               e.g. 1.001: it bounds the average per-token deviation)

C_high defaults: 2 (token), 8 (sequence), 1.01 (geometric). The weights multiply the
per-token loss, which is aggregated over the ORIGINAL mask (a rejected token still counts in
the token-mean's denominator), as every correction here does. Everything is computed in log
space, so no ratio overflows; the decisions are verl's (it clamps log-ratios at ±20 before
exponentiating, which changes no decision for thresholds inside (e^-20, e^20)).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rl.objectives.losses import masked_mean, token_array, token_mask
from rl.objectives.offpolicy import OffPolicyWeights
from rl.objectives.registry import check_number, register_correction

Array = jax.Array
sg = jax.lax.stop_gradient

ICEPOP_LOW, ICEPOP_HIGH = 0.5, 5.0
REJECTION_HIGH = {"token": 2.0, "sequence": 8.0, "geometric": 1.01}
LEVELS = tuple(REJECTION_HIGH)


def bounds(cap: float | None, low: float | None, default_high: float,
           default_low: float | None = None) -> tuple[float, float]:
    """(low, high) with the defaults filled in (low: default_low, else 1 / high)."""
    high = default_high if cap is None else cap
    check_number("cap (the upper bound)", high, low=0.0, low_open=True)
    lo = (default_low if default_low is not None else 1.0 / high) if low is None else low
    check_number("low (the lower bound)", lo, low=0.0, low_open=True)
    if lo > high:
        raise ValueError(f"the lower bound {lo} exceeds the upper bound {high}")
    return float(lo), float(high)


def log_ratios(prox_logp: Array, behaviour_logp: Array, mask: Array) -> tuple[Array, Array]:
    """(log ρ_t [batch, seq], 0 off the mask; the boolean mask), detached."""
    m = token_mask(mask)
    prox = sg(token_array("prox_logp", prox_logp, m))
    behav = sg(token_array("behaviour_logp", behaviour_logp, m))
    return jnp.where(m, prox - behav, 0.0), m


@register_correction("icepop", modes=(None,), levels=("token",), two_sided=True)
def icepop_weights(prox_logp: Array, behaviour_logp: Array, mask: Array, *,
                   level: str = "token", cap: float | None = None, mode: str | None = None,
                   low: float | None = None) -> OffPolicyWeights:
    """IcePop's M(ρ_t; α, β) (module doc): ρ_t on the tokens with α ≤ ρ_t ≤ β, 0 elsewhere.
    cap = β (default 5), low = α (default 0.5). Metrics icepop_masked_frac (the share of
    loss tokens dropped), icepop_low_frac / icepop_high_frac (below α / above β),
    icepop_weight_mean (over the kept tokens)."""
    if level != "token":
        raise ValueError(f"icepop masks tokens: level must be 'token', got {level!r}")
    alpha, beta = bounds(cap, low, ICEPOP_HIGH, ICEPOP_LOW)
    log_w, m = log_ratios(prox_logp, behaviour_logp, mask)
    below, above = m & (log_w < math.log(alpha)), m & (log_w > math.log(beta))
    keep = m & ~below & ~above
    w = jnp.where(keep, jnp.exp(jnp.minimum(log_w, math.log(beta))), 0.0)
    metrics = {"icepop_masked_frac": masked_mean(m & ~keep, m),
               "icepop_low_frac": masked_mean(below, m), "icepop_high_frac": masked_mean(above, m),
               "icepop_weight_mean": masked_mean(w, keep)}
    return OffPolicyWeights(w, keep, metrics)


def level_log_ratio(log_w: Array, m: Array, level: str) -> Array:
    """[batch, seq] log ρ at `level`: per token, or the sequence's sum / mean broadcast."""
    if level == "token":
        return log_w
    total = jnp.sum(log_w, axis=1, keepdims=True)
    if level == "geometric":
        total = total / jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1)
    return jnp.broadcast_to(total, log_w.shape)


@register_correction("rejection", modes=(None,), levels=LEVELS, two_sided=True)
def rejection_weights(prox_logp: Array, behaviour_logp: Array, mask: Array, *,
                      level: str = "token", cap: float | None = None, mode: str | None = None,
                      low: float | None = None) -> OffPolicyWeights:
    """Masked importance sampling's rejection (module doc): weight 1 where ρ at `level`
    ("token", "sequence" or "geometric") lies in [low, cap], 0 elsewhere; cap defaults 2 /
    8 / 1.01, low to 1 / cap. Metrics rs_masked_frac (loss tokens rejected), rs_seq_masked_frac
    (sequences with any token rejected), rs_low_frac / rs_high_frac (tokens below / above),
    rs_log_ratio_mean (of ρ at the level, over the loss tokens)."""
    if level not in LEVELS:
        raise ValueError(f"rejection level must be one of {LEVELS}, got {level!r}")
    lo, hi = bounds(cap, low, REJECTION_HIGH[level])
    log_w, m = log_ratios(prox_logp, behaviour_logp, mask)
    at = level_log_ratio(log_w, m, level)
    below, above = m & (at < math.log(lo)), m & (at > math.log(hi))
    keep = m & ~below & ~above
    seq = jnp.any(m, axis=1)
    rejected_seq = jnp.any(m & ~keep, axis=1)
    metrics = {"rs_masked_frac": masked_mean(m & ~keep, m),
               "rs_seq_masked_frac": jnp.sum(rejected_seq) / jnp.maximum(jnp.sum(seq), 1),
               "rs_low_frac": masked_mean(below, m), "rs_high_frac": masked_mean(above, m),
               "rs_log_ratio_mean": masked_mean(at, m)}
    return OffPolicyWeights(keep.astype(log_w.dtype), keep, metrics)
