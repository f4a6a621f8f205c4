"""VCPO on the learner side: the exact per-trajectory gradient norms ‖∇_θ log π(τ_i)‖²
that the minimum-variance baseline weighs (W_i = w_i² ‖∇_θ log π(τ_i)‖², Huang et al.
2026), computed with ``vmap(grad)`` over rows in chunks. The arithmetic of VCPO (ESS,
baseline, advantages, the ESS-scaled update) lives in `rl.objectives.vcpo`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from models.logprobs import token_logprobs
from rl.objectives.losses import token_mask
from rl.objectives.registry import check_rank, check_same_shape

Array = jax.Array


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
                                 attn_impl: str | None = None) -> Array:
    """[B] exact ‖∇_θ Σ_t log π(y_t)‖² per row (see per_trajectory_logprob_grads)."""
    return per_trajectory_logprob_grads(params, model_config, tokens, positions, mask,
                                        temperature, chunk, attn_impl)[1]
