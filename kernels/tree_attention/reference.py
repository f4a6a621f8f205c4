"""The readable twin of the tree attention: the dense mask from kend and a masked softmax
over every (query, key) pair."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def kend_mask(kend: jax.Array) -> jax.Array:
    """bool [batch, T, T] from kend [batch, T]: query i sees key j when j <= i < kend[j]."""
    t = kend.shape[-1]
    idx = jnp.arange(t)
    return (idx[None, :] <= idx[:, None])[None] & (idx[None, :, None] < kend[:, None, :])


def tree_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, kend: jax.Array,
                             sm_scale: float) -> jax.Array:
    """q [B, T, H, D], k / v [B, T, KVH, D], kend [B, T] -> [B, T, H, D] in q's dtype (fp32
    softmax; zeros for a query that sees no key)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    mask = kend_mask(kend)[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).astype(q.dtype)
