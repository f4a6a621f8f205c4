"""Readable reference for segment decode attention: replicate the prompt segment into
every sample, concatenate [prompt, own response] and run a plain masked softmax.

It materialises the replicated [groups, N, P + R_max, kv_heads, head_dim] key set, which
is exactly the cost the segment kernels avoid; it exists to be obviously correct.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def masked_decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, sm_scale: float
) -> jax.Array:
    """One query token per sample attending to its own key set with a validity mask.

    Args:
      q: [groups, N, heads, head_dim].
      k, v: [groups, N, L, kv_heads, head_dim]; query head h uses kv head
        h // (heads // kv_heads).
      valid: [groups, N, L] bool, which keys exist.
      sm_scale: multiplies the scores q.k.
    Returns:
      [groups, N, heads, head_dim] in q's dtype; zeros for a sample with no valid key.
    """
    heads, kv_heads = q.shape[2], k.shape[3]
    k = jnp.repeat(k.astype(jnp.float32), heads // kv_heads, axis=3)  # [g, n, L, heads, d]
    v = jnp.repeat(v.astype(jnp.float32), heads // kv_heads, axis=3)
    s = jnp.einsum("gnhd,gnlhd->gnhl", q.astype(jnp.float32), k) * sm_scale
    mask = valid[:, :, None, :]
    m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # no valid key: any finite shift will do
    e = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - m), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("gnhl,gnlhd->gnhd", p, v).astype(q.dtype)


def replicate_segments(
    k_prompt: jax.Array, v_prompt: jax.Array, k_resp: jax.Array, v_resp: jax.Array,
    prompt_lengths: jax.Array, resp_lengths: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The replicated layout: every sample gets its own copy of the prompt segment.

    Returns k, v [groups, N, P + R_max, kv_heads, head_dim] and valid [groups, N, P + R_max].
    """
    groups, n, r_max = k_resp.shape[:3]
    p = k_prompt.shape[1]
    tile = lambda x: jnp.broadcast_to(x[:, None], (groups, n) + x.shape[1:])
    k = jnp.concatenate([tile(k_prompt), k_resp], axis=2)
    v = jnp.concatenate([tile(v_prompt), v_resp], axis=2)
    prompt_valid = jnp.arange(p)[None, None, :] < prompt_lengths[:, None, None]
    resp_valid = jnp.arange(r_max)[None, None, :] < resp_lengths[:, :, None]
    valid = jnp.concatenate([jnp.broadcast_to(prompt_valid, (groups, n, p)), resp_valid], axis=2)
    return k, v, valid


@partial(jax.jit, static_argnames=("sm_scale",))
def segment_decode_attention_reference(
    q: jax.Array, k_prompt: jax.Array, v_prompt: jax.Array, k_resp: jax.Array,
    v_resp: jax.Array, prompt_lengths: jax.Array, resp_lengths: jax.Array,
    k_new: jax.Array | None = None, v_new: jax.Array | None = None, *, sm_scale: float,
) -> jax.Array:
    """Reference segment decode attention (inputs already validated by the public entry).

    Shapes as in `kernels.segment_decode.segment_decode_attention`; returns
    [groups, N, heads, head_dim] in q's dtype. k_new, v_new [groups, N, kv_heads, d]
    (optional) are appended to every sample's key set as one more valid key.
    """
    k, v, valid = replicate_segments(
        k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lengths
    )
    if k_new is not None:
        k = jnp.concatenate([k, k_new[:, :, None].astype(k.dtype)], axis=2)
        v = jnp.concatenate([v, v_new[:, :, None].astype(v.dtype)], axis=2)
        valid = jnp.concatenate([valid, jnp.ones(valid.shape[:2] + (1,), bool)], axis=2)
    return masked_decode_attention(q, k, v, valid, sm_scale)
