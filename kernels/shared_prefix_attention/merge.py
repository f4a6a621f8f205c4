"""Merging two partial attentions over disjoint key sets by their log-sum-exp.

A partial attention over a key set K gives, per query row, the normalised output
o_K = sum_{j in K} softmax_K(s)_j v_j and lse_K = log sum_{j in K} exp(s_j) (natural log of
the scaled scores; -inf when K is empty, with o_K = 0). Over the union of two disjoint sets

    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b.

The backward of this merge needs no formula of its own: for the merged softmax
P = exp(s - lse), each part's flash backward fed the MERGED output, lse and dO computes
exactly its block of dS = P * (dO V^T - rowsum(dO * O)), so dq adds over the parts and
dk/dv come out per part (`split.py` does that; the tests check it against float64
autodiff).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_by_lse(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array):
    """Merge two partial attentions over disjoint key sets.

    Args:
      o_a, o_b: `[..., D]` normalised partial outputs (any float dtype).
      lse_a, lse_b: `[...]` log-sum-exp of each part's scaled scores, -inf for an empty
        part (its output is then ignored, whatever it holds).
    Returns:
      (o `[..., D]`, lse `[...]`) in the wider of float32 and the inputs' dtype; two empty
      parts give o = 0 and lse = -inf, never NaN.
    """
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"merge_by_lse needs o [..., D] and lse [...] of equal shapes, got "
                         f"o {o_a.shape}, {o_b.shape} and lse {lse_a.shape}, {lse_b.shape}")
    acc = jnp.promote_types(jnp.promote_types(o_a.dtype, lse_a.dtype), jnp.float32)
    lse_a, lse_b = lse_a.astype(acc), lse_b.astype(acc)
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w_a = jnp.where(lse_a == -jnp.inf, 0.0, jnp.exp(lse_a - m_safe))
    w_b = jnp.where(lse_b == -jnp.inf, 0.0, jnp.exp(lse_b - m_safe))
    total = w_a + w_b
    empty = total == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, total)
    o_a = jnp.where((w_a == 0.0)[..., None], 0.0, o_a.astype(acc))
    o_b = jnp.where((w_b == 0.0)[..., None], 0.0, o_b.astype(acc))
    o = (w_a * inv)[..., None] * o_a + (w_b * inv)[..., None] * o_b
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
    return o, lse
