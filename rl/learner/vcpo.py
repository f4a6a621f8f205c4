"""VCPO on the learner side (Huang et al. 2026; the arithmetic — ESS, baseline, advantages,
the ESS-scaled update — lives in `rl.objectives.vcpo`).

    vcpo_terms                     what the step needs from VCPO for the WHOLE batch, before
                                   any micro-batch: advantages, truncated sequence weights,
                                   the vcpo_* metrics (and ρ for the optimizer)
    per_trajectory_logprob_grads   the exact per-trajectory gradient norms ‖∇_θ log π(τ_i)‖²
    per_trajectory_grad_sq_norms   that the minimum-variance baseline weighs
                                   (W_i = w_i² ‖∇_θ log π(τ_i)‖²): grad_norms="ghost" from
                                   one batched backward (models.ghost_norms), "exact" its
                                   slow twin, ``vmap(grad)`` over rows in chunks
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from models.config import ModelConfig
from models.ghost_norms import ghost_logprob_grads
from models.logprobs import token_logprobs, token_logprobs_fused
from rl.learner.batch import TrainBatch
from rl.learner.config import TrainConfig
from rl.learner.rewards import scalar_rewards
from rl.objectives.losses import token_mask
from rl.objectives.registry import check_rank, check_same_shape
from rl.objectives.vcpo import (
    ess_lr_scale,
    ess_ratio,
    sequence_log_weights,
    truncated_sequence_weights,
    vcpo_advantages,
    weight_tail_stats,
)

Array = jax.Array


# ----------------------------------------------------------------------------- in the step
class VCPOTerms(NamedTuple):
    """VCPO's per-batch terms. advantages [B] and seq_weights [B] are None when monitoring
    only; metrics holds vcpo_ess (ρ, which also scales the optimizer's update) and the
    vcpo_* statistics."""

    advantages: Array | None
    seq_weights: Array | None
    metrics: dict


def vcpo_terms(config: TrainConfig, model_config: ModelConfig, params: Any, batch: TrainBatch,
               monitor: bool = False) -> VCPOTerms:
    """VCPO's per-row quantities for the WHOLE batch (the jitted step sees the global array,
    so ρ counts every micro-batch and device): log w from the step's starting params (with
    exact per-row gradient norms when the OPOB baseline needs them), advantages, truncated
    sequence weights [B] and the vcpo_* metrics. monitor: only ρ and the log-weight
    statistics (one forward)."""
    vc = config.vcpo
    tokens, positions, loss_mask = batch.tokens, batch.positions, batch.loss_mask
    mask = loss_mask[:, 1:]
    norms = None
    if not monitor and vc.baseline == "opob" and vc.grad_norms != "none":
        args = (params, model_config, tokens, positions, token_mask(loss_mask),
                config.temperature, vc.chunk, config.attn_impl)
        if vc.grad_norms == "ghost":
            # a packed batch's loss tokens lie in its response segments (width R): the
            # vocabulary head runs on R positions a row instead of the whole row
            window = None if batch.packed is None else batch.packed.response_tokens.shape[-1]
            logp, norms = ghost_logprob_grads(*args, window=window)
        else:
            logp, norms = per_trajectory_logprob_grads(*args)
    else:  # one forward, micro-batch by micro-batch (the activations of one at a time)
        m = config.micro_batches

        def fwd(xs):
            return token_logprobs_fused(params, model_config, *xs, config.temperature,
                                        config.attn_impl, entropy=False)[0]

        split = lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:])  # noqa: E731
        logp = jax.lax.map(fwd, (split(tokens), split(positions))).reshape(mask.shape)
    log_w = sequence_log_weights(logp, batch.behaviour_logprobs[:, 1:], mask)
    valid = jnp.any(mask, axis=1)
    rho = ess_ratio(log_w, valid)
    if monitor:
        return VCPOTerms(None, None, monitor_metrics(log_w, valid))
    rewards = scalar_rewards(config, batch)
    adv, base = vcpo_advantages(rewards, log_w, norms, batch.group_size, baseline=vc.baseline,
                                variant=vc.variant, valid=valid, is_cap=vc.is_cap)
    seq_w = truncated_sequence_weights(log_w, vc.is_cap)
    group_mean = jnp.mean(rewards.reshape(base.shape[0], -1), axis=1)
    metrics = {
        "vcpo_ess": rho,
        "vcpo_lr_scale": ess_lr_scale(rho, vc.rho_base, vc.lr_scale),
        "vcpo_baseline_minus_mean": jnp.mean(jnp.abs(base - group_mean)),
        "vcpo_capped_frac": jnp.sum(valid & (log_w > math.log(vc.is_cap)))
        / jnp.maximum(jnp.sum(valid), 1),
        **weight_tail_stats(log_w, valid),
    }
    if norms is not None:
        metrics["vcpo_grad_sq_norm_mean"] = jnp.sum(jnp.where(valid, norms, 0.0)) \
            / jnp.maximum(jnp.sum(valid), 1)
    return VCPOTerms(adv, seq_w, metrics)


def monitor_metrics(log_w: Array, valid: Array) -> dict:
    """VCPOConfig.monitor's metrics from the rows' log w [B] (valid [B]: rows with tokens):
    vcpo_ess (ρ) and the vcpo_logw_* tail statistics."""
    return {"vcpo_ess": ess_ratio(log_w, valid), **weight_tail_stats(log_w, valid)}


# ----------------------------------------------------------------------------- exact gradient norms


def per_trajectory_logprob_grads(params: Any, model_config: Any, tokens: Array, positions: Array,
                                 mask: Array, temperature: float = 1.0, chunk: int = 8,
                                 attn_impl: str | None = None) -> tuple[Array, Array]:
    """Token log-probs and the exact squared gradient norm ‖∇_θ Σ_t log π(y_t)‖² of every
    row: jax.vmap(jax.value_and_grad(...)) over `chunk` rows at a time, chunks in lax.map
    (peak memory ≈ chunk copies of the gradient). Rows are padded to a multiple of chunk.

    Args:
        tokens, positions: [B, T] int; mask: [B, T] bool aligned with tokens (True at the
            response tokens that count, like TrainBatch.loss_mask; column 0 is ignored:
            token 0 has no predicting logit); temperature: the sampler's.
    Returns:
        (logp [B, T-1] float32 — logp[b, t] is the log-prob of token t+1, as
        models.logprobs.token_logprobs —, grad_sq_norms [B] float32).
    """
    tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
    m = token_mask(mask)
    check_rank("tokens", tokens, 2, "a [batch, seq] int array")
    check_same_shape(tokens=tokens, positions=positions, mask=m)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    b, t = tokens.shape
    chunk = min(chunk, b)
    pad = (-b) % chunk

    def row(p, tok, pos, msk):
        # a batch of one row cannot follow the models' ("batch", ...) activation annotations
        # under a mesh (vmap(grad) of them gave NaN gradients on a forced 8-device CPU mesh):
        # trace the row without logical rules; the chunk's rows still follow the inputs.
        with nn.logical_axis_rules(()):
            lp = token_logprobs(p, model_config, tok[None], pos[None], temperature, attn_impl)[0][0]
        return jnp.sum(jnp.where(msk[1:], lp, 0.0)), lp

    vg = jax.vmap(jax.value_and_grad(row, has_aux=True), in_axes=(None, 0, 0, 0))

    def one_chunk(xs):
        (_, lp), g = vg(params, *xs)
        sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
                 for x in jax.tree.leaves(g))
        return lp, sq

    def prep(x):
        x = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
        return x.reshape((-1, chunk) + x.shape[1:])

    lp, sq = jax.lax.map(one_chunk, (prep(tokens), prep(positions), prep(m)))
    return lp.reshape(-1, t - 1)[:b], sq.reshape(-1)[:b]


def per_trajectory_grad_sq_norms(params: Any, model_config: Any, tokens: Array, positions: Array,
                                 mask: Array, temperature: float = 1.0, chunk: int = 8,
                                 attn_impl: str | None = None, method: str = "ghost") -> Array:
    """[B] exact ‖∇_θ Σ_t log π(y_t)‖² per row: method "ghost" from one batched backward of
    `chunk` rows at a time (models.ghost_norms.ghost_logprob_grads; plain params), "exact"
    by its slow twin per_trajectory_logprob_grads (vmap(grad); any params)."""
    if method not in ("ghost", "exact"):
        raise ValueError(f"method must be 'ghost' or 'exact' (the vmap(grad) twin), got {method!r}")
    norms_of = ghost_logprob_grads if method == "ghost" else per_trajectory_logprob_grads
    return norms_of(params, model_config, tokens, positions, token_mask(mask), temperature,
                    chunk, attn_impl)[1]
