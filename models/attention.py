"""The one dense attention entry point of the models (grouped-query, masked, softmax in f32).

`impl="reference"` is the readable twin (heads repeated explicitly); `impl="xla"` groups
query heads per key/value head without materialising the repeat on accelerators, and on
CPU repeats the key/value heads (XLA:CPU transposes the grouped [b, h, g, q, k] layout in
the backward: the repeated form's fwd+vjp is 1.2-2x faster there, measured at the tiny and
SmolLM2 shapes, 1 and 2 cores); its softmax is jax.nn.softmax over the masked scores (one
saved tensor for the backward, not the reference's exp/sum/divide). There is no Pallas
kernel for dense attention: `impl="pallas"` (or "pallas_triton" / "pallas_mosaic")
raises, and `impl=None` means "xla" here (unlike kernels.dispatch's platform default) so
that the decoder runs on every backend. `chunk_attention` (XLA only) is the chunked
prefill's: a chunk of queries over a cached prefix, block by block with an online softmax.
`tree_layer_attention` is the decoder's "tree" mode (models.tree): the dense path under
kend's mask, or kernels.tree_attention's Triton kernel with impl "pallas".
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels.dispatch import resolve_impl
from kernels.tree_attention import kend_mask, tree_attention

# Finite stand-in for -inf so a fully masked row never computes inf - inf.
_MASKED = -1e30


def _check(q, k, v, mask):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "attention: q, k, v must be [batch, len, heads, head_dim], got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v shapes differ: {k.shape} vs {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention: q {q.shape} and k {k.shape} must share batch and head_dim"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"attention: q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})"
        )
    if mask is not None:
        if mask.ndim > 3:
            raise ValueError(
                f"attention: mask must be [batch, q_len, kv_len] or broadcastable, got {mask.shape}"
            )
        try:
            jnp.broadcast_shapes(mask.shape, (q.shape[0], q.shape[1], k.shape[1]))
        except ValueError:
            raise ValueError(
                f"attention: mask shape {mask.shape} does not broadcast to "
                f"[batch, q_len, kv_len] = {(q.shape[0], q.shape[1], k.shape[1])}"
            ) from None


def _masked_softmax(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Softmax over the last axis in f32; rows with no allowed key give all zeros."""
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    scores = jnp.where(mask, scores, _MASKED)
    probs = jnp.where(mask, jnp.exp(scores - scores.max(axis=-1, keepdims=True)), 0.0)
    denom = probs.sum(axis=-1, keepdims=True)
    return probs / jnp.where(denom == 0, 1.0, denom)


def _reference(q, k, v, mask):
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = scores / math.sqrt(q.shape[-1])
    m = None if mask is None else mask[:, None, :, :]
    probs = _masked_softmax(scores, m)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32))
    return out.astype(q.dtype)


def _softmax_rows(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    """_masked_softmax's result through jax.nn.softmax (whose vjp keeps only its output):
    masked keys excluded, rows with no allowed key all zeros."""
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1)
    return jnp.where(jnp.any(mask, axis=-1, keepdims=True), probs, 0.0)


def _xla(q, k, v, mask):
    return jax.lax.platform_dependent(q, k, v, mask, cpu=attention_xla_repeated,
                                      default=attention_xla_grouped)


def attention_xla_repeated(q, k, v, mask):
    """impl="xla" on CPU: key/value heads repeated to the query heads, [b, h, q, k]
    scores. Shapes as `attention`'s, mask already broadcast to [b, q_len, kv_len]."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(q.shape[-1]))
    probs = _softmax_rows(scores, None if mask is None else mask[:, None, :, :])
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def attention_xla_grouped(q, k, v, mask):
    """impl="xla" on accelerators: query heads grouped per key/value head, [b, kv_heads,
    group, q, k] scores, no repeated copies. Shapes as attention_xla_repeated's."""
    b, q_len, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, q_len, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    probs = _softmax_rows(scores, None if mask is None else mask[:, None, None, :, :])
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, q_len, heads, d).astype(q.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Scaled dot-product attention with grouped key/value heads.

    q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim];
    mask bool [batch, q_len, kv_len] (or broadcastable; True = may attend).
    Returns [batch, q_len, heads, head_dim] in q.dtype. Scores scaled by 1/sqrt(head_dim),
    softmax in float32; a query row with no allowed key returns zeros.
    """
    impl = "xla" if impl is None else resolve_impl(impl)
    if impl.startswith("pallas"):
        raise ValueError("no pallas kernel for dense attention; use impl='xla'")
    _check(q, k, v, mask)
    if mask is not None:
        mask = jnp.broadcast_to(mask.astype(bool), (q.shape[0], q.shape[1], k.shape[1]))
    return _reference(q, k, v, mask) if impl == "reference" else _xla(q, k, v, mask)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    *,
    impl: str | None = None,
) -> jax.Array:
    """One decode step's attention without writing the new token into the cache first.

    q [batch, 1, heads, head_dim]; k, v [batch, L, kv_heads, head_dim] the cached keys
    (any prefix of the cache that covers every row's valid entries), of which the first
    lengths [batch] are valid; k_new, v_new [batch, kv_heads, head_dim] the new token's own
    key/value, which every query also attends to. Same result as writing the new token at
    index lengths[b] and calling `attention` with mask < lengths[b] + 1. Returns
    [batch, 1, heads, head_dim] in q.dtype; softmax in float32.
    """
    impl = "xla" if impl is None else resolve_impl(impl)
    if impl.startswith("pallas"):
        raise ValueError("no pallas kernel for dense attention; use impl='xla'")
    _check(q, k, v, None)
    b, q_len, heads, d = q.shape
    kv_heads, length = k.shape[2], k.shape[1]
    if q_len != 1 or k_new.shape != (b, kv_heads, d) or v_new.shape != k_new.shape:
        raise ValueError(f"decode_attention: q must be [batch, 1, heads, d] and k_new, v_new "
                         f"[batch, kv_heads, d] = {(b, kv_heads, d)}; got {q.shape}, "
                         f"{k_new.shape}, {v_new.shape}")
    valid = jnp.arange(length)[None, :] < lengths[:, None]  # [batch, L]
    if impl == "reference":  # the readable twin: append the new key, mask, softmax
        k_all = jnp.concatenate([k, k_new[:, None].astype(k.dtype)], axis=1)
        v_all = jnp.concatenate([v, v_new[:, None].astype(v.dtype)], axis=1)
        mask = jnp.concatenate([valid, jnp.ones((b, 1), bool)], axis=1)[:, None, :]
        return _reference(q, k_all, v_all, mask)
    g = heads // kv_heads
    qg = q.reshape(b, kv_heads, g, d)
    scale = 1.0 / math.sqrt(d)
    s_cache = jnp.einsum("bhgd,bkhd->bhgk", qg, k, preferred_element_type=jnp.float32) * scale
    s_new = jnp.einsum("bhgd,bhd->bhg", qg, k_new.astype(q.dtype),
                       preferred_element_type=jnp.float32) * scale
    keep = valid[:, None, None, :]
    s_cache = jnp.where(keep, s_cache, _MASKED)
    m = jnp.maximum(s_cache.max(axis=-1), s_new)  # the new key is always valid: m is finite
    p_cache = jnp.where(keep, jnp.exp(s_cache - m[..., None]), 0.0)
    p_new = jnp.exp(s_new - m)
    denom = p_cache.sum(axis=-1) + p_new
    out = jnp.einsum("bhgk,bkhd->bhgd", p_cache.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    out = (out + p_new[..., None] * v_new.astype(jnp.float32)[:, :, None, :]) / denom[..., None]
    return out.reshape(b, 1, heads, d).astype(q.dtype)


def online_softmax_merge(carry, s, ok, v):
    """One block of keys into an online softmax (chunk_attention's step).
    carry (m, den [G, kvh, hg, Q], acc [G, kvh, hg, Q, d]) float32; s [G, kvh, hg, Q, K]
    float32 scores; ok bool, broadcastable to s (True = visible); v [G, K, kvh, d]."""
    m, den, acc = carry
    s = jnp.where(ok, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
    return m_new, den * corr + p.sum(axis=-1), acc


def chunk_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    cache_lengths: jax.Array,
    num_blocks: jax.Array,
    block: int,
    own_lengths: jax.Array,
) -> jax.Array:
    """Attention of a chunk of C queries to a cached prefix plus the chunk itself, in
    blocks of keys with an online softmax, so memory is O(C * block) scores, never the
    full [q_len, kv_len] matrix (chunked prefill, models/chunked_prefill.py).

    q [B, C, heads, head_dim]; k, v [B, C, kv_heads, head_dim]: the chunk's own keys.
    k_cache, v_cache [G, W, kv_heads, head_dim] with B = G * N: the N query rows
    g*N .. g*N+N-1 share cache row g (N = 1: one cache row per query row; N > 1: the
    segmented layout, N samples behind one prompt). Cache entries [0, num_blocks * block)
    are read, `block` at a time (num_blocks: traced int32 scalar; block <= W, entries past
    W do not exist);
    entry j of row g is visible iff j < cache_lengths[g]. Own keys: query i of row b sees
    own key j iff j <= i < own_lengths[b]; a query row i >= own_lengths[b] sees nothing and
    returns zeros. Same result as `attention` over the visible keys (tested against it
    and a float64 loop). Returns q's shape and dtype; softmax statistics in float32."""
    b, c, heads, d = q.shape
    g, w, kvh, _ = k_cache.shape
    n, hg = b // g, heads // kvh
    if w < block:
        raise ValueError(f"chunk_attention: the cache holds W={w} entries per row, fewer than "
                         f"one block of {block}; use a block <= W")
    if (b != g * n or k.shape != (b, c, kvh, d) or v.shape != k.shape
            or v_cache.shape != k_cache.shape):
        raise ValueError(f"chunk_attention: q {q.shape}, k {k.shape}, v {v.shape} and caches "
                         f"{k_cache.shape}, {v_cache.shape} do not fit [G*N, C, ...], [G, W, ...]")
    scale = 1.0 / math.sqrt(d)
    q_ok = jnp.arange(c)[None, :] < own_lengths[:, None]  # [B, C]
    qg = q.reshape(g, n * c, kvh, hg, d)
    q_ok_g = q_ok.reshape(g, 1, 1, n * c, 1)

    def step(j, carry):  # one block of cached keys for all N * C queries of a cache row
        # carry: m, den [G, kvh, hg, N*C]; acc [G, kvh, hg, N*C, d]
        # A last block past W is read from W - block on; keys before j * block, which an
        # earlier block already counted, are masked out.
        lo = jnp.minimum(j * block, w - block)
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, lo, block, axis=1).astype(q.dtype)
                  for x in (k_cache, v_cache))
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, kb, preferred_element_type=jnp.float32) * scale
        pos = lo + jnp.arange(block)
        ok = q_ok_g & ((pos >= j * block)[None, :] & (pos[None, :] < cache_lengths[:, None])
                       )[:, None, None, None, :]
        return online_softmax_merge(carry, s, ok, vb)

    stats = (g, kvh, hg, n * c)
    m, den, acc = jax.lax.fori_loop(
        0, num_blocks, step, (jnp.full(stats, _MASKED, jnp.float32),
                              jnp.zeros(stats, jnp.float32), jnp.zeros(stats + (d,), jnp.float32)))

    def per_row(x):  # [G, kvh, hg, N*C, ...] -> [B, kvh, hg, C, ...]
        x = x.reshape((g, kvh, hg, n, c) + x.shape[4:])
        return jnp.moveaxis(x, 3, 1).reshape((b, kvh, hg, c) + x.shape[5:])

    m, den, acc = per_row(m), per_row(den), per_row(acc)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, c, kvh, hg, d), k,
                   preferred_element_type=jnp.float32) * scale
    idx = jnp.arange(c)
    ok = ((idx[None, :, None] >= idx[None, None, :]) & q_ok[:, :, None]
          & q_ok[:, None, :])[:, None, None]  # own key j visible to query i: j <= i, both valid
    _, den, acc = online_softmax_merge((m, den, acc), s, ok, v)
    out = acc / jnp.where(den == 0, 1.0, den)[..., None]  # [B, kvh, hg, C, d]
    return jnp.moveaxis(out, 3, 1).reshape(b, c, heads, d).astype(q.dtype)


def tree_layer_attention(q, k, v, kend, impl: str | None):
    """Attention over packed trees (models.tree; kend [batch, T] from visible_until):
    impl "pallas" / "pallas_triton" runs kernels.tree_attention's flash kernel; any other
    impl the dense attention entry point with kend's [T, T] mask (the exact twin)."""
    if impl in ("pallas", "pallas_triton"):
        return tree_attention(q, k, v, kend, impl=impl)
    return attention(q, k, v, mask=kend_mask(kend), impl=impl)
