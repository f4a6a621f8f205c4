"""Query layouts shared by the XLA and Pallas segment decode paths.

GQA convention (as in Llama / Qwen): query head h uses kv head h // heads_per_kv.
For the shared prompt segment the group's N queries are folded into one matrix per kv
head, [groups, kv_heads, N * heads_per_kv, head_dim] (Hydragen), so one pass over the
prompt keys serves every sample of the group. Row r of that matrix is sample
r // heads_per_kv, head (kv_head * heads_per_kv + r % heads_per_kv).
"""
from __future__ import annotations

import jax


def split_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """[groups, N, heads, head_dim] -> [groups, N, kv_heads, heads_per_kv, head_dim]."""
    g, n, h, d = q.shape
    return q.reshape(g, n, kv_heads, h // kv_heads, d)


def fold_for_prompt(q: jax.Array, kv_heads: int) -> jax.Array:
    """[groups, N, heads, head_dim] -> [groups, kv_heads, N * heads_per_kv, head_dim]."""
    g, n, h, d = q.shape
    return split_heads(q, kv_heads).transpose(0, 2, 1, 3, 4).reshape(g, kv_heads, -1, d)


def unfold_from_prompt(x: jax.Array, n: int) -> jax.Array:
    """[groups, kv_heads, N * heads_per_kv, *rest] -> [groups, N, kv_heads, heads_per_kv, *rest]."""
    g, kvh, rows = x.shape[:3]
    x = x.reshape(g, kvh, n, rows // n, *x.shape[3:])
    return x.transpose(0, 2, 1, 3, *range(4, x.ndim))
