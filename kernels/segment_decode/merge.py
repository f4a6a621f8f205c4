"""Merging partial softmax-attention states computed over disjoint key sets.

A partial state over a key set K for one query is the triple
  m = max_{j in K} s_j                 (running max of the scaled scores; -inf if K is empty)
  l = sum_{j in K} exp(s_j - m)        (0 if K is empty)
  o = sum_{j in K} exp(s_j - m) v_j / l  (the NORMALISED partial output; 0 if K is empty)
so `o` is exactly the attention output restricted to K. Two states over disjoint sets
merge into the state over their union; merging is associative and commutative, which is
what split-K (flash-decoding) and segment (cascade / Hydragen) attention rely on.
Everything is computed in float32; empty sets (m = -inf or l = 0) get weight exactly 0,
so no NaN can appear, and merging two empty states gives o = 0, m = -inf, l = 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_state(o: jax.Array, m: jax.Array, l: jax.Array, name: str) -> None:
    if o.ndim < 1:
        raise ValueError(f"o_{name} must have a trailing head_dim axis, got shape {o.shape}")
    if m.shape != o.shape[:-1] or l.shape != o.shape[:-1]:
        raise ValueError(
            f"m_{name} and l_{name} must have shape o_{name}.shape[:-1] = {o.shape[:-1]}, "
            f"got {m.shape} and {l.shape}"
        )


def _weights(m: jax.Array, l: jax.Array, m_new: jax.Array) -> jax.Array:
    """l * exp(m - m_new), exactly 0 for an empty state. m_new must be finite."""
    empty = (m == -jnp.inf) | (l <= 0)
    return jnp.where(empty, 0.0, l * jnp.exp(jnp.where(empty, 0.0, m - m_new)))


def merge_attention_states(
    o_a: jax.Array, m_a: jax.Array, l_a: jax.Array,
    o_b: jax.Array, m_b: jax.Array, l_b: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merge the partial states of two disjoint key sets into the state of their union.

    Args:
      o_a, o_b: [..., head_dim] normalised partial outputs (any float dtype).
      m_a, m_b: [...] running max of the scaled scores (-inf for an empty set).
      l_a, l_b: [...] sum of exp(s - m) over the set (0 for an empty set).
    Returns:
      (o [..., head_dim], m [...], l [...]) in float32; o is normalised, and an empty
      union gives o = 0, m = -inf, l = 0.
    """
    _check_state(o_a, m_a, l_a, "a")
    _check_state(o_b, m_b, l_b, "b")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {o_a.shape} and {o_b.shape}")
    o_a, m_a, l_a, o_b, m_b, l_b = (
        x.astype(jnp.float32) for x in (o_a, m_a, l_a, o_b, m_b, l_b)
    )
    m = jnp.maximum(m_a, m_b)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w_a = _weights(m_a, l_a, m_safe)
    w_b = _weights(m_b, l_b, m_safe)
    l = w_a + w_b
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    # `where` (not a product) so that garbage in an empty side's o cannot leak as 0 * NaN.
    o = (jnp.where(w_a[..., None] > 0, (w_a * inv)[..., None] * o_a, 0.0)
         + jnp.where(w_b[..., None] > 0, (w_b * inv)[..., None] * o_b, 0.0))
    return o, m, l


def reduce_attention_states(
    o: jax.Array, m: jax.Array, l: jax.Array, axis: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merge partial states stacked along `axis` (e.g. the split-K axis) in one reduction.

    Args:
      o: [..., splits, ..., head_dim] normalised partial outputs; `axis` indexes m's axes
         (it must not be o's trailing head_dim axis).
      m, l: o.shape[:-1]; m = -inf and l = 0 mark empty splits.
    Returns:
      (o [..., head_dim], m [...], l [...]) in float32 with `axis` removed; same semantics as
      folding `merge_attention_states` over the splits.
    """
    _check_state(o, m, l, "")
    if not -m.ndim <= axis < m.ndim:
        raise ValueError(f"axis must index m's {m.ndim} axes, got {axis}")
    axis = axis % m.ndim
    o, m, l = (x.astype(jnp.float32) for x in (o, m, l))
    m_new = jnp.max(m, axis=axis)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    w = _weights(m, l, jnp.expand_dims(m_safe, axis))
    l_new = jnp.sum(w, axis=axis)
    inv = jnp.where(l_new > 0, 1.0 / jnp.where(l_new > 0, l_new, 1.0), 0.0)
    o_new = jnp.sum(jnp.where(w[..., None] > 0, w[..., None] * o, 0.0), axis=axis)
    return o_new * inv[..., None], m_new, l_new


def new_token_state(q: jax.Array, k_new: jax.Array, v_new: jax.Array, sm_scale: float
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The partial state over ONE key per sample that is not in any stored segment (the
    decoding token's own key): its softmax over a single key is 1, so o = v_new, m = the
    scaled score, l = 1. Lets decode attend to the new token without first writing it
    into a copy of the cache.

    Args:
      q: [groups, N, heads, head_dim]; k_new, v_new: [groups, N, kv_heads, head_dim]
        (query head h uses kv head h // (heads // kv_heads)).
    Returns:
      (o [groups, N, kv_heads, heads_per_kv, head_dim], m, l [groups, N, kv_heads,
      heads_per_kv]) in float32.
    """
    g, n, h, d = q.shape
    kvh = k_new.shape[2]
    q5 = q.reshape(g, n, kvh, h // kvh, d).astype(jnp.float32)
    s = jnp.einsum("gnkhd,gnkd->gnkh", q5, k_new.astype(jnp.float32)) * sm_scale
    o = jnp.broadcast_to(v_new.astype(jnp.float32)[:, :, :, None, :], q5.shape)
    return o, s, jnp.ones_like(s)
