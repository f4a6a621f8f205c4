"""VCPO: variance-controlled off-policy RL (Huang et al. 2026, "Stable Asynchrony:
Variance-Controlled Off-Policy RL for LLMs").

Stale rollouts give heavy-tailed sequence importance weights w_i = π_θ(τ_i)/μ(τ_i); a
few trajectories then dominate the update. VCPO (i) measures the effective sample size
ρ = ESS/M = (Σ w)² / (M Σ w²) of the optimizer minibatch and scales the update by √s or
s, s = min(1, ρ/ρ_base) (`scale_by_ess`, chained AFTER the optimizer), and (ii)
centres each group's rewards on the minimum-variance off-policy baseline
b_g = Σ W_i R_i / (Σ W_i + 1e-8), W_i = w_i² ‖∇_θ log π(τ_i)‖² (`min_variance_baseline`),
with per-trajectory gradient norms computed exactly, by default from one batched backward
pass ("ghost norms", `models.ghost_norms`), or by its slow twin ``vmap(grad)`` in chunks
(`rl.learner.vcpo.per_trajectory_grad_sq_norms`: both need the model, so they live on the
learner side). The loss multiplies each sequence by its truncated weight
min(exp(clamp(log w, -20, 20)), 8), detached.

Everything here works on log weights, so no weight is ever exponentiated to inf: ESS and
the baseline are ratios of sums, computed after shifting by the largest log weight.
`rl.learner.vcpo.vcpo_terms` wires it into the train step through ``TrainConfig.vcpo``
(a `VCPOConfig`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rl.objectives.offpolicy import sequence_log_ratio
from rl.objectives.registry import check_rank, check_same_shape

Array = jax.Array
sg = jax.lax.stop_gradient

LR_SCALES = ("sqrt", "linear", "none")
BASELINES = ("opob", "group_mean", "none")
VARIANTS = ("paper", "released")
GRAD_NORMS = ("ghost", "exact", "none")
_LOG_CLAMP = 20.0  # the loss's clamp on log w before exponentiating
_BASELINE_EPS = 1e-8  # b_g = Σ W R / (Σ W + 1e-8), as in the paper
_STD_FLOOR = 1e-8  # σ_g at or below this: no division


@dataclasses.dataclass(frozen=True)
class VCPOConfig:
    """VCPO in the train step (hashable: part of TrainConfig). Default: disabled, and the
    step is exactly the plain one.

    lr_scale: "sqrt" (paper default) / "linear" scale the final update by √s / s with
        s = min(1, ρ/rho_base); "none" leaves the update alone (ρ is still logged).
    baseline: "opob" (minimum-variance off-policy baseline), "group_mean" (b_g = mean of
        the group's rewards), "none" (b_g = 0). The advantage is (R_i - b_g)/σ_g either way
        (σ_g = population std of the group's raw rewards, no division when σ_g <= 1e-8);
        it replaces TrainConfig.advantage (which must stay "grpo"; its params are unused).
    variant: "paper" W_i = w_i² ‖∇ log π(τ_i)‖²; "released" W_i = w̃_i² w_i² ‖∇ Σ_t log π‖²
        (w̃ the truncated weight: the released code's w to the fourth power).
    grad_norms: the per-trajectory ‖∇_θ Σ_t log π(y_t)‖², both ways exact: "ghost" from one
        forward and input-gradient backward of `chunk` rows at a time (models.ghost_norms:
        each weight's row norm from Grams of its inputs and output gradients, no per-row
        gradient formed; plain params only, as VCPO refuses LoRA anyway); "exact" the slow
        twin, vmap(grad) over chunks of `chunk` rows (one full forward+backward per row and
        `chunk` gradient copies in memory); "none" drops the norm factor (W_i = w_i², cheap:
        one extra forward).
    is_cap: cap of the truncated sequence weight in the loss (8).
    monitor: with enabled=False, still log ρ and the log-weight tail statistics (vcpo_ess,
        vcpo_logw_*; from the log-probs of the loss's own forward pass, no extra pass)
        while the loss and update stay the plain ones: the diagnostic for any method (e.g.
        watch ESS collapse under GRPO). No effect when enabled (those metrics are logged
        then anyway).
    """

    enabled: bool = False
    lr_scale: str = "sqrt"
    rho_base: float = 1.0
    baseline: str = "opob"
    variant: str = "paper"
    grad_norms: str = "ghost"
    chunk: int = 8
    is_cap: float = 8.0
    monitor: bool = False

    def __post_init__(self):
        for name in ("enabled", "monitor"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"VCPOConfig.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        for name, allowed in (("lr_scale", LR_SCALES), ("baseline", BASELINES),
                              ("variant", VARIANTS), ("grad_norms", GRAD_NORMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"VCPOConfig.{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        _check_rho_base(self.rho_base, "VCPOConfig.rho_base")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"VCPOConfig.chunk must be an int >= 1 (rows per vmap(grad) chunk), "
                             f"got {self.chunk!r}")
        if not (isinstance(self.is_cap, (int, float)) and math.isfinite(self.is_cap)
                and self.is_cap > 0):
            raise ValueError(f"VCPOConfig.is_cap must be a finite number > 0, got {self.is_cap!r}")


def _check_rho_base(rho_base: Any, name: str = "rho_base") -> None:
    if not (isinstance(rho_base, (int, float)) and 0 < rho_base <= 1):
        raise ValueError(f"{name} must be a number in (0, 1], got {rho_base!r}")


def _rows(name: str, x: Any) -> Array:
    x = jnp.asarray(x)
    check_rank(name, x, 1, "a [batch] vector (one value per trajectory)")
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _valid(valid: Any, like: Array) -> Array:
    if valid is None:
        return jnp.ones(like.shape, bool)
    v = jnp.asarray(valid)
    check_same_shape(valid=v, log_w=like)
    return v if v.dtype == jnp.bool_ else v != 0


# ----------------------------------------------------------------------------- weights
def sequence_log_weights(logp: Array, behaviour_logp: Array, mask: Array) -> Array:
    """log w_i = Σ_t (log π_θ - log μ) over the response, unclipped and detached.

    Args:
        logp, behaviour_logp, mask: [batch, seq].
    Returns:
        [batch]; 0 for fully masked rows.
    """
    return sg(sequence_log_ratio(logp, behaviour_logp, mask, reduce="sum"))


def truncated_sequence_weights(log_w: Array, cap: float = 8.0) -> Array:
    """The loss's weight min(exp(clamp(log w, -20, 20)), cap), detached. log_w: [batch]."""
    if not (isinstance(cap, (int, float)) and cap > 0):
        raise ValueError(f"cap must be a number > 0, got {cap!r}")
    lw = sg(_rows("log_w", log_w))
    return jnp.minimum(jnp.exp(jnp.clip(lw, -_LOG_CLAMP, _LOG_CLAMP)), cap)


def ess_ratio(log_w: Array, valid: Array | None = None) -> Array:
    """Effective-sample-size ratio ρ = ESS / M = exp(2·LSE(log w) - LSE(2·log w)) / M over
    the M valid rows (detached).

    Computed with the largest valid log weight subtracted first, so any finite log w (even
    1e3, where w overflows) gives a finite ρ; the result is clipped to [1/M, 1] against
    rounding. ρ = 1 when all weights are equal, → 1/M when one weight dominates. No valid
    row gives ρ = 1 (nothing to down-weight).

    Args:
        log_w: [M] sequence log weights; valid: [M] bool (default all), e.g. rows with a
            non-empty response. Pass the WHOLE optimizer minibatch (all micro-batches and
            devices), not a micro-batch.
    Returns:
        scalar float32 ρ.
    """
    lw = sg(_rows("log_w", log_w))
    v = _valid(valid, lw)
    m = jnp.sum(v).astype(lw.dtype)
    top = jnp.max(jnp.where(v, lw, -jnp.inf))
    d = jnp.where(v, lw - jnp.where(jnp.isfinite(top), top, 0.0), -jnp.inf)
    # with the max subtracted, the max row contributes exactly 1: both logs are >= 0
    log_s1 = jnp.log(jnp.maximum(jnp.sum(jnp.exp(d)), 1.0))
    log_s2 = jnp.log(jnp.maximum(jnp.sum(jnp.exp(2.0 * d)), 1.0))
    rho = jnp.exp(2.0 * log_s1 - log_s2) / jnp.maximum(m, 1.0)
    return jnp.where(m > 0, jnp.clip(rho, 1.0 / jnp.maximum(m, 1.0), 1.0), 1.0)


def ess_lr_scale(rho: Array, rho_base: float = 1.0, mode: str = "sqrt") -> Array:
    """The update's scale: √s ("sqrt"), s ("linear") or 1 ("none"), s = min(1, ρ/rho_base)."""
    if mode not in LR_SCALES:
        raise ValueError(f"mode must be one of {LR_SCALES}, got {mode!r}")
    _check_rho_base(rho_base)
    rho = jnp.asarray(rho, jnp.float32)
    if mode == "none":
        return jnp.ones_like(rho)
    s = jnp.minimum(1.0, rho / rho_base)
    return jnp.sqrt(s) if mode == "sqrt" else s


def scale_by_ess(rho_base: float = 1.0, mode: str = "sqrt") -> optax.GradientTransformationExtraArgs:
    """Multiply the update by ess_lr_scale(ess, rho_base, mode); `ess` (ρ, a scalar) is an
    extra argument of `update`. Chain it AFTER the optimizer (and after gradient clipping),
    so it scales the final step:
    ``tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr), scale_by_ess())``;
    ``updates, state = tx.update(grads, state, params, ess=rho)``. Stateless."""
    ess_lr_scale(1.0, rho_base, mode)  # validate now, not at the first update

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, **extra_args):
        del params
        if "ess" not in extra_args:
            raise ValueError("scale_by_ess needs the ESS ratio: call update(..., ess=rho) with "
                             "rho from rl.objectives.vcpo.ess_ratio")
        s = ess_lr_scale(extra_args["ess"], rho_base, mode)
        return jax.tree.map(lambda u: (u * s).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------- baseline
def min_variance_baseline(rewards: Array, log_w: Array, grad_sq_norms: Array | None = None, *,
                          variant: str = "paper", valid: Array | None = None,
                          is_cap: float = 8.0) -> Array:
    """VCPO's minimum-variance off-policy baseline per group:
    b_g = Σ_i W_i R_i / (Σ_i W_i + 1e-8) over the group's valid rows, with
      "paper":    W_i = w_i² ‖∇ log π(τ_i)‖²,
      "released": W_i = w̃_i² w_i² ‖∇ Σ_t log π‖²  (w̃ = truncated_sequence_weights(log w, is_cap)),
    and ‖·‖² dropped (set to 1) when grad_sq_norms is None (cheap mode). Computed in log
    space (W never overflows); a group whose W are all 0 gets b = 0.

    Args:
        rewards, log_w: [G, N] raw rewards and sequence log weights; grad_sq_norms: [G, N]
            (>= 0) or None; valid: [G, N] bool (default all; invalid rows get W = 0).
    Returns:
        [G] baselines (detached).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    r = jnp.asarray(rewards)
    check_rank("rewards", r, 2, "a [groups, group_size] array")
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
    lw = sg(jnp.asarray(log_w, r.dtype))
    check_same_shape(rewards=r, log_w=lw)
    v = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid).astype(bool)
    check_same_shape(rewards=r, valid=v)
    log_big_w = 2.0 * lw
    if variant == "released":
        trunc = jnp.minimum(jnp.clip(lw, -_LOG_CLAMP, _LOG_CLAMP), math.log(is_cap))
        log_big_w = log_big_w + 2.0 * trunc
    if grad_sq_norms is not None:
        n = sg(jnp.asarray(grad_sq_norms, r.dtype))
        check_same_shape(rewards=r, grad_sq_norms=n)
        log_big_w = log_big_w + jnp.log(jnp.maximum(n, 0.0))  # a zero norm gives W = 0
    log_big_w = jnp.where(v, log_big_w, -jnp.inf)
    top = jnp.max(log_big_w, axis=1, keepdims=True)
    any_w = top > -jnp.inf  # False only when every W is 0 (a NaN input stays NaN: visible)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(log_big_w - shift)  # <= 1; invalid rows 0
    # 1e-8 on the same shifted scale; the exponent is clamped where Σ W << 1e-8 (b ≈ 0 there)
    eps = jnp.exp(jnp.minimum(math.log(_BASELINE_EPS) - shift, 80.0))
    b = jnp.sum(e * r, axis=1, keepdims=True) / (jnp.sum(e, axis=1, keepdims=True) + eps)
    return jnp.where(any_w, b, 0.0)[:, 0]


def centred_advantages(rewards: Array, baseline: Array) -> Array:
    """VCPO's applied advantage (R_i - b_g) / σ_g, σ_g = population std of group g's raw
    rewards (no division when σ_g <= 1e-8). rewards [G, N], baseline [G] -> [G, N]."""
    r = jnp.asarray(rewards)
    check_rank("rewards", r, 2, "a [groups, group_size] array")
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
    b = jnp.asarray(baseline, r.dtype)
    check_rank("baseline", b, 1, "a [groups] vector")
    if b.shape[0] != r.shape[0]:
        raise ValueError(f"baseline has {b.shape[0]} groups but rewards has {r.shape[0]}")
    c = r - jnp.max(r, axis=1, keepdims=True)  # shift: an all-equal group has std exactly 0
    c = c - jnp.mean(c, axis=1, keepdims=True)
    std = jnp.sqrt(jnp.mean(c * c, axis=1, keepdims=True))
    return (r - b[:, None]) / jnp.where(std > _STD_FLOOR, std, 1.0)


def vcpo_advantages(rewards: Array, log_w: Array, grad_sq_norms: Array | None, group_size: int,
                    *, baseline: str = "opob", variant: str = "paper", valid: Array | None = None,
                    is_cap: float = 8.0) -> tuple[Array, Array]:
    """Advantages of a flat batch of contiguous groups.

    Args:
        rewards, log_w: [B]; grad_sq_norms: [B] or None; group_size: static int dividing
            B; baseline: "opob" | "group_mean" | "none"; valid: [B] bool (rows in the loss).
    Returns:
        (advantages [B], baseline per row's group [G]).
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    r = _rows("rewards", rewards)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 \
            or r.shape[0] % group_size:
        raise ValueError(f"group_size must be a static int >= 1 dividing the batch of "
                         f"{r.shape[0]}, got {group_size!r}")
    shape = (r.shape[0] // group_size, group_size)
    rg = r.reshape(shape)
    if baseline == "opob":
        lw = _rows("log_w", log_w)
        check_same_shape(rewards=r, log_w=lw)
        norms = None if grad_sq_norms is None else _rows("grad_sq_norms", grad_sq_norms).reshape(shape)
        v = None if valid is None else _valid(valid, lw).reshape(shape)
        b = min_variance_baseline(rg, lw.reshape(shape), norms, variant=variant, valid=v,
                                  is_cap=is_cap)
    elif baseline == "group_mean":
        b = jnp.mean(rg, axis=1)
    else:
        b = jnp.zeros((shape[0],), r.dtype)
    return centred_advantages(rg, b).reshape(-1), b


def weight_tail_stats(log_w: Array, valid: Array | None = None, prefix: str = "vcpo_logw") -> dict:
    """Tail statistics of the valid log weights: max, p99 (order statistic at rank
    ceil(0.99 M)), mean, std; all 0 when no row is valid."""
    lw = sg(_rows("log_w", log_w))
    v = _valid(valid, lw)
    m = jnp.sum(v)
    mf = jnp.maximum(m, 1).astype(lw.dtype)
    mean = jnp.sum(jnp.where(v, lw, 0.0)) / mf
    std = jnp.sqrt(jnp.sum(jnp.where(v, jnp.square(lw - mean), 0.0)) / mf)
    ordered = jnp.sort(jnp.where(v, lw, -jnp.inf))  # invalid rows first
    k = lw.shape[0] - m + jnp.ceil(0.99 * m).astype(m.dtype) - 1
    p99 = ordered[jnp.clip(k, 0, lw.shape[0] - 1)]
    some = m > 0
    return {f"{prefix}_max": jnp.where(some, ordered[-1], 0.0),
            f"{prefix}_p99": jnp.where(some, p99, 0.0),
            f"{prefix}_mean": mean, f"{prefix}_std": std}
