"""Off-policy corrections for asynchronous / mismatched RL data, and DAPO's data filters.

The registered corrections (OffPolicyConfig.correction, rl.objectives.registry's
register_correction): "truncated_is" (truncated_is_weights), "behaviour" (AReaL's
behaviour_weights, the weights of the decoupled PPO objective), "m2po" (m2po_correction).

Three log-probs per token, all ``[batch, seq]``:

  * ``logp``           log π_θ, the learner being optimised (carries the gradient);
  * ``prox_logp``      log π_prox, the proximal (old) policy of the PPO clip;
  * ``behaviour_logp`` log μ, recorded by the sampler that produced the token.
Total ratio π_θ/μ = (π_prox/μ) [train–inference mismatch, staleness of the data]
× (π_θ/π_prox) [the PPO ratio]. The weights here are functions of π_prox/μ only and
are returned detached; multiply them into a per-token loss (``token_weights`` of
``rl.objectives.losses.compute_loss``) and aggregate over the ORIGINAL mask.

Masks follow ``rl.objectives.losses``: binary [batch, seq]; masked positions may hold NaN and
never reach the result. Every function jits and vmaps (string/float options are
static Python values).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl.objectives.advantages import grouped_rewards
from rl.objectives.losses import (
    masked_mean,
    ppo_clip_token_loss,
    reduce_loss,
    token_array,
    token_mask,
)
from rl.objectives.registry import check_number, check_rank, register_correction

Array = jax.Array
sg = jax.lax.stop_gradient


class OffPolicyWeights(NamedTuple):
    """weights: [batch, seq] detached weights, 0 where masked or rejected.
    keep: [batch, seq] bool, the tokens that survive rejection.
    metrics: scalar statistics."""

    weights: Array
    keep: Array
    metrics: dict[str, Array]


def sequence_log_ratio(logp_a: Array, logp_b: Array, mask: Array, *, reduce: str = "sum") -> Array:
    """Per-sequence log ratio of two policies over the response tokens.

    Args:
        logp_a, logp_b, mask: [batch, seq].
        reduce: "sum" -> log Π_t (a/b) (the sequence importance weight, e.g. VCPO's
            log w_i), "mean" -> the log of the geometric mean (GSPO, AReaL sequence level).
    Returns:
        [batch]; 0 for fully masked sequences.
    """
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
    m = token_mask(mask)
    a = token_array("logp_a", logp_a, m)
    b = token_array("logp_b", logp_b, m)
    s = jnp.sum(a - b, axis=1)
    if reduce == "mean":
        s = s / jnp.maximum(jnp.sum(m, axis=1), 1)
    return s


def _capped_weights(prox_logp, behaviour_logp, mask, *, level, seq_reduce, cap, reject, prefix):
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if not (isinstance(cap, (int, float)) and cap > 0):
        raise ValueError(f"cap must be a positive number, got {cap!r}")
    m = token_mask(mask)
    prox = sg(token_array("prox_logp", prox_logp, m))
    behav = sg(token_array("behaviour_logp", behaviour_logp, m))
    if level == "token":
        log_w = prox - behav
    else:
        log_w = jnp.broadcast_to(
            sequence_log_ratio(prox, behav, m, reduce=seq_reduce)[:, None], m.shape)
    log_cap = math.log(cap)
    over = m & (log_w > log_cap)
    keep = m & ~over if reject else m
    # exp of a log already capped above cannot overflow; far below it just underflows to 0.
    w = jnp.where(keep, jnp.exp(jnp.minimum(log_w, log_cap)), 0.0)
    metrics = {
        f"{prefix}_weight_mean": masked_mean(w, keep),
        f"{prefix}_capped_frac": masked_mean(over, m),
        f"{prefix}_kept_frac": masked_mean(keep, m),
        f"{prefix}_log_ratio_mean": masked_mean(log_w, m),
    }
    return OffPolicyWeights(w, keep, metrics)


@register_correction("truncated_is", modes=(None, "truncate", "mask"))
def truncated_is_weights(
    prox_logp: Array, behaviour_logp: Array, mask: Array, *,
    level: str = "token", cap: float | None = None, mode: str | None = "truncate",
) -> OffPolicyWeights:
    """Truncated importance sampling for the train/inference mismatch (Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").

    token:    w_t = min(exp(log π_prox - log μ), C)                 (C = 2 by default)
    sequence: w_i = min(exp(Σ_t (log π_prox - log μ)), C) on every token of i  (C = 8)
    mode "truncate" caps the weight at C; mode "mask" drops (weight 0, keep False)
    the tokens / sequences whose weight exceeds C and keeps the others' raw weight.

    Args:
        prox_logp, behaviour_logp, mask: [batch, seq].
    Returns:
        OffPolicyWeights(weights [batch, seq], keep [batch, seq], metrics is_*).
    """
    mode = "truncate" if mode is None else mode
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    if cap is None:
        cap = 2.0 if level == "token" else 8.0
    return _capped_weights(prox_logp, behaviour_logp, mask, level=level, seq_reduce="sum",
                           cap=cap, reject=mode == "mask", prefix="is")


@register_correction("behaviour", modes=(None, "mask", "clamp"))
def behaviour_weights(
    prox_logp: Array, behaviour_logp: Array, mask: Array, *,
    level: str = "token", cap: float | None = 5.0, mode: str | None = "mask",
) -> OffPolicyWeights:
    """AReaL's behaviour importance weight w = sg[π_prox / μ] with rejection (Fu et al.
    2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System").

    token: w_t = exp(log π_prox - log μ); sequence: the geometric mean
    exp(mean_t (log π_prox - log μ)) on every token of the sequence. mode "mask"
    rejects weights above ``cap`` (default 5), "clamp" caps them (None: the defaults).

    Returns:
        OffPolicyWeights(weights [batch, seq], keep [batch, seq], metrics behav_*).
    """
    cap = 5.0 if cap is None else cap
    mode = "mask" if mode is None else mode
    if mode not in ("mask", "clamp"):
        raise ValueError(f"mode must be 'mask' or 'clamp', got {mode!r}")
    return _capped_weights(prox_logp, behaviour_logp, mask, level=level, seq_reduce="mean",
                           cap=cap, reject=mode == "mask", prefix="behav")


def decoupled_ppo_loss(
    logp: Array, prox_logp: Array, behaviour_logp: Array, advantages: Array, mask: Array, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
    behaviour_cap: float = 5.0, level: str = "token", mode: str = "mask",
    aggregation: str = "token-mean", max_len: int | None = None,
) -> tuple[Array, dict[str, Array]]:
    """AReaL's decoupled PPO objective (Fu et al. 2025; Hilton et al. 2022 "Batch size-
    invariance for policy optimization").

    ℓ_t = sg[w_t] · PPO-clip(u_t = π_θ/π_prox, A) with the behaviour weight w of
    `behaviour_weights`; summed over the kept tokens and divided by the ORIGINAL
    mask's count ("token-mean"; other aggregation modes also use the original mask).
    AReaL applies no dual clip by default (``dual_clip=None``).

    Args:
        logp, prox_logp, behaviour_logp, mask: [batch, seq]; advantages [batch] or
            [batch, seq]. ``prox_logp`` is a constant (recomputed with the step's
            starting params, or `approx_proximal_logp`).
    Returns:
        (scalar loss, metrics: PPO clip fractions and ratio stats, behav_* stats).
    """
    bw = behaviour_weights(prox_logp, behaviour_logp, mask, level=level, cap=behaviour_cap,
                           mode=mode)
    per_token, stats = ppo_clip_token_loss(logp, prox_logp, advantages, mask, clip_low=clip_low,
                                           clip_high=clip_high, dual_clip=dual_clip)
    loss, metrics = reduce_loss(per_token * bw.weights, stats, jnp.asarray(logp),
                                jnp.asarray(prox_logp), mask, aggregation, max_len)
    return loss, {**metrics, **bw.metrics}


def approx_proximal_logp(
    logp: Array, behaviour_logp: Array, token_versions: Array, current_version: Any, mask: Array,
) -> Array:
    """Proximal log-probs without a forward pass, interpolated from policy versions (AReaL).

    log π_prox ≈ log μ + α (log π_θ - log μ), α = clamp((v - 1 - v_b) / (v - v_b), 0, 1),
    v = ``current_version`` (the learner's, π_prox is version v - 1), v_b = the version
    that generated the token. Tokens with v_b >= v (no older version between) get α = 0,
    i.e. π_prox = μ.

    Args:
        logp, behaviour_logp, mask: [batch, seq]; token_versions: [batch, seq] int;
        current_version: int or scalar int array.
    Returns:
        [batch, seq] detached log π_prox, 0 where masked.
    """
    m = token_mask(mask)
    x = token_array("logp", logp, m)
    mu = token_array("behaviour_logp", behaviour_logp, m)
    vb = jnp.asarray(token_versions)
    check_rank("token_versions", vb, 2, "a [batch, seq] int array")
    if vb.shape != m.shape:
        raise ValueError(f"token_versions has shape {vb.shape} but mask has shape {m.shape}")
    if not jnp.issubdtype(vb.dtype, jnp.integer):
        raise ValueError(f"token_versions must be integers, got dtype {vb.dtype}")
    v = jnp.asarray(current_version)
    check_rank("current_version", v, 0, "a scalar")
    gap = (v - vb).astype(jnp.float32)
    alpha = jnp.where(gap > 0, jnp.clip((gap - 1.0) / jnp.maximum(gap, 1.0), 0.0, 1.0), 0.0)
    return sg(jnp.where(m, mu + alpha * (x - mu), 0.0))


def m2po_mask(
    prox_logp: Array, behaviour_logp: Array, mask: Array, *, threshold: float = 0.04,
) -> tuple[Array, dict[str, Array]]:
    """M2PO second-moment masking ("Prosperity before Collapse: How Far Can Off-Policy
    RL Reach with Stale Data on LLMs?", 2025).

    Over all valid tokens of the batch, sort m_t = (log μ - log π_prox)² descending and
    mask the largest ones until the mean of the remaining m_t is <= ``threshold``
    (0.04, the paper's); at least one token is always kept. Ties are broken by flat
    position (earlier first). Vmap it for a per-sequence variant.

    Args:
        prox_logp, behaviour_logp, mask: [batch, seq].
    Returns:
        (keep [batch, seq] bool, metrics: m2po_masked_frac, m2po_m2_before, m2po_m2_after).
    """
    check_number("threshold", threshold, low=0.0)
    m = token_mask(mask)
    prox = sg(token_array("prox_logp", prox_logp, m))
    behav = sg(token_array("behaviour_logp", behaviour_logp, m))
    m2 = jnp.square(behav - prox).reshape(-1)
    valid = m.reshape(-1)
    n = jnp.sum(valid)
    order = jnp.argsort(jnp.where(valid, -m2, jnp.inf), stable=True)  # largest first
    top = jnp.where(valid, m2, 0.0)[order]
    rest_sum = jnp.cumsum(top[::-1])[::-1]  # sum of all but the k largest (small terms first)
    k = jnp.arange(m2.shape[0])  # candidate: remove the k largest
    rest = (n - k).astype(m2.dtype)
    ok = (k < n) & (rest_sum <= threshold * rest)
    n_remove = jnp.where(jnp.any(ok), jnp.argmax(ok), jnp.maximum(n - 1, 0))
    rank = jnp.zeros_like(k).at[order].set(k)
    keep = (valid & (rank >= n_remove)).reshape(m.shape)
    metrics = {
        "m2po_masked_frac": masked_mean(m & ~keep, m),
        "m2po_m2_before": masked_mean(m2.reshape(m.shape), m),
        "m2po_m2_after": masked_mean(m2.reshape(m.shape), keep),
    }
    return keep, metrics


def m2po_weights(
    prox_logp: Array, behaviour_logp: Array, mask: Array, *, threshold: float = 0.04,
) -> OffPolicyWeights:
    """M2PO's per-token weights: w_t = M_t · sg[π_prox / μ], M the second-moment mask of
    `m2po_mask`. With π_prox the step's starting params (one update per batch, the
    PPO ratio π_θ/π_prox = 1 in value, its clip inactive), the loss's gradient is the
    paper's -Σ_t M_t r_t A_t ∇log π_θ / N with r_t = π_θ/μ and no clip: the mask is the
    whole trust region. The kept tokens' weights are not capped (the paper's form).

    Returns:
        OffPolicyWeights(weights [batch, seq], keep [batch, seq], metrics m2po_*).
    """
    keep, metrics = m2po_mask(prox_logp, behaviour_logp, mask, threshold=threshold)
    m = token_mask(mask)
    log_w = jnp.where(keep, sg(token_array("prox_logp", prox_logp, m))
                      - sg(token_array("behaviour_logp", behaviour_logp, m)), 0.0)
    weights = jnp.where(keep, jnp.exp(log_w), 0.0)
    metrics = {**metrics, "m2po_weight_max": jnp.max(jnp.where(keep, weights, 0.0))}
    return OffPolicyWeights(sg(weights), keep, metrics)


@register_correction("m2po", modes=(None,), levels=("token",))
def m2po_correction(
    prox_logp: Array, behaviour_logp: Array, mask: Array, *,
    level: str = "token", cap: float | None = None, mode: str | None = None,
) -> OffPolicyWeights:
    """`m2po_weights` as the registered correction "m2po": ``cap`` is its threshold
    τ_M2 (None: the paper's 0.04); token level only, no modes."""
    return m2po_weights(prox_logp, behaviour_logp, mask,
                        **({} if cap is None else {"threshold": cap}))


def ratio_decomposition_metrics(
    logp: Array, prox_logp: Array, behaviour_logp: Array, mask: Array,
) -> dict[str, Array]:
    """Statistics of the two factors of π_θ/μ ("Missing Old Logits"): ``mismatch`` =
    π_prox/μ (train–inference discrepancy and staleness of the data), ``staleness`` =
    π_θ/π_prox (the PPO ratio), and ``total`` = π_θ/μ. For each: mean log ratio, mean
    |log ratio|, k3 KL estimate and max ratio over valid tokens. All detached.
    """
    m = token_mask(mask)
    x = sg(token_array("logp", logp, m))
    prox = sg(token_array("prox_logp", prox_logp, m))
    mu = sg(token_array("behaviour_logp", behaviour_logp, m))
    out = {}
    for name, lr in (("mismatch", prox - mu), ("staleness", x - prox), ("total", x - mu)):
        lr = jnp.clip(lr, -20.0, 20.0)
        out[f"{name}_log_ratio_mean"] = masked_mean(lr, m)
        out[f"{name}_log_ratio_abs_mean"] = masked_mean(jnp.abs(lr), m)
        # k3 estimate of KL(denominator || numerator) on tokens drawn from μ.
        out[f"{name}_kl_k3"] = masked_mean(jnp.exp(lr) - lr - 1.0, m)
        out[f"{name}_ratio_max"] = jnp.where(jnp.any(m), jnp.max(jnp.where(m, jnp.exp(lr), 0.0)), 0.0)
    return out


# ---------------------------------------------------------------------------
# DAPO data shaping (Yu et al. 2025)


def dynamic_sampling_mask(
    rewards: Array, group_size: int | None = None, *, group_ids: Array | None = None,
) -> Array:
    """DAPO dynamic sampling: keep a group iff its rewards are not all equal (std > 0),
    or it has a single sample.

    Args:
        rewards: [batch]; group_size / group_ids as in ``rl.objectives.advantages``.
    Returns:
        [batch] bool, True for every response of a kept group.
    """
    r, groups = grouped_rewards(rewards, group_size, group_ids)
    # max != min is exact; a floating std of equal values can come out as tiny noise.
    return (groups.max(r) != groups.min(r)) | (groups.count() == 1)


def kept_group_indices(rewards: Any, group_size: int) -> np.ndarray:
    """Host-side helper for a resampling loop: indices of the groups (contiguous blocks
    of ``group_size`` in ``rewards [batch]``) that dynamic sampling keeps."""
    keep = np.asarray(dynamic_sampling_mask(jnp.asarray(rewards), group_size))
    return np.flatnonzero(keep.reshape(-1, group_size)[:, 0])


def overlong_penalty(
    lengths: Array, *, max_len: int, buffer_len: int = 4096, factor: float = 1.0,
) -> Array:
    """DAPO's soft overlong punishment, added to the reward.

    p = clip(-(|y| - (max_len - buffer_len)) / buffer_len · factor, -factor, 0): 0 up to
    max_len - buffer_len, linear down to -factor at max_len, -factor beyond.

    Args:
        lengths: [batch] response lengths |y| (tokens).
        max_len: L_max, the generation limit; buffer_len: L_buf (4096 at DAPO's scale);
        factor: penalty at max_len (1.0).
    Returns:
        [batch] float32 penalties (<= 0).
    """
    if not (isinstance(buffer_len, (int, float)) and buffer_len > 0):
        raise ValueError(f"buffer_len must be > 0, got {buffer_len!r}")
    if not (isinstance(max_len, (int, float)) and max_len >= buffer_len):
        raise ValueError(f"max_len ({max_len!r}) must be >= buffer_len ({buffer_len!r})")
    check_number("factor", factor, low=0.0)
    n = jnp.asarray(lengths)
    check_rank("lengths", n, 1, "a [batch] vector of response lengths")
    x = (n.astype(jnp.float32) - (max_len - buffer_len)) / buffer_len * factor
    return jnp.clip(-x, -factor, 0.0) + 0.0  # + 0.0 turns -0.0 into 0.0


def last_token_values(values: Array, mask: Array) -> Array:
    """Place a per-sequence value [batch] on the last valid token of ``mask`` [batch, seq]
    (token-level reward placement); fully masked rows get zeros. Returns [batch, seq]."""
    m = token_mask(mask)
    v = jnp.asarray(values)
    check_rank("values", v, 1, "a [batch] vector")
    if v.shape[0] != m.shape[0]:
        raise ValueError(f"values has shape {v.shape} but mask has shape {m.shape}")
    seq = m.shape[1]
    last = seq - 1 - jnp.argmax(m[:, ::-1], axis=1)
    at_last = (jnp.arange(seq)[None, :] == last[:, None]) & jnp.any(m, axis=1, keepdims=True)
    return jnp.where(at_last, v[:, None].astype(jnp.float32), 0.0)

