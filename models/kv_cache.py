"""KV caches for decoding, in two layouts, and all their layout logic (allocation,
per-layer writes, which cached keys a query may see) so the decoder only dispatches.

  KVCache           dense / replicated: one [max_len] slot range per batch row.
  SegmentedKVCache  shared prompt: one prompt segment per group of N samples (stored once)
                    plus one response segment per sample; decode attention goes through
                    kernels.segment_decode (the group's N queries read the prompt once).
                    With a `ResponseTree` (a rollout tree), a sample that forked from
                    another reads the prefix they share from the other's segment.

Decode has two paths with the same result (tests/models/test_bounded_decode.py):

  * masked (kv_bound=None, the exact slow twin): each layer writes the new token into a
    copy of its row / response segment and attends, masked, to every allocated slot;
  * bounded (kv_bound=int, what the sampler runs): each layer reads only the first
    kv_bound slots of its rows / response segments, in place, and attends to the new
    token's own key as one more key (no copy of the cache to write it); the new keys
    are written once, after all layers (`after_decode`). kv_bound is static (the caller
    picks it from a few buckets of the longest live row), so cost follows the tokens
    present instead of the allocated cache.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kernels.segment_decode import segment_decode_attention, tree_decode_attention
from models.attention import attention, chunk_attention, decode_attention
from models.config import ModelConfig


@struct.dataclass
class KVCache:
    """k, v [layers, batch, max_len, kv_heads, head_dim]; lengths [batch] int32 = number
    of valid positions per row (the next token is written at index lengths[b])."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
    """An empty cache (lengths 0) in `dtype` (default: the config's compute dtype)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch and max_len must be >= 1, got {batch}, {max_len}")
    if max_len > config.max_position_embeddings:
        raise ValueError(
            f"init_cache: max_len={max_len} exceeds max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    dt = jnp.dtype(dtype or config.dtype)
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), lengths=jnp.zeros((batch,), jnp.int32)
    )


def cache_logical_axes() -> KVCache:
    """Logical axis names of each cache field (for sharding the cache like activations)."""
    kv = ("layers", "batch", "seq", "kv_heads", "head_dim")
    return KVCache(k=kv, v=kv, lengths=("batch",))


def write_layer(
    k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array, start: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Write new keys/values of one layer at per-row offsets.

    k_cache, v_cache [batch, max_len, kv_heads, head_dim]; k_new, v_new
    [batch, t, kv_heads, head_dim]; start [batch] int32 (row b gets slots start[b]..+t).
    """

    def one(cache, new, s):
        return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (s, 0, 0))

    return jax.vmap(one)(k_cache, k_new, start), jax.vmap(one)(v_cache, v_new, start)


def prefill_mask(lengths: jax.Array, t: int) -> jax.Array:
    """bool [batch, t, t]: causal attention among the first lengths[b] prompt tokens.
    Query rows at or past the length (padding) see nothing."""
    idx = jnp.arange(t)
    causal = idx[None, :, None] >= idx[None, None, :]
    valid = idx[None, :] < lengths[:, None]
    return causal & valid[:, :, None] & valid[:, None, :]


def decode_mask(lengths: jax.Array, max_len: int) -> jax.Array:
    """bool [batch, 1, max_len]: the new token (already written at slot lengths[b]) sees
    slots 0..lengths[b]."""
    return (jnp.arange(max_len)[None, :] <= lengths[:, None])[:, None, :]


# ----------------------------------------------------------------------------- segmented layout
@struct.dataclass
class ResponseTree:
    """Which response segments of its group each sample reads (a rollout tree,
    rl.rollout.tree_sampler): sample i of group g reads entries lo[g, i, j] <= r <
    hi[g, i, j] of sample j's segment for j != i (the prefix it shares with the sample that
    wrote it), and its own segment from lo[g, i, i] (where its own entries begin) up to its
    length resp_lengths[g, i]; the diagonal of hi is not read. lo, hi [groups, N, N] int32.
    All zeros: no sample shares anything (the segmented layout as it is)."""

    lo: jax.Array
    hi: jax.Array

    def spans(self, own_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(lo, hi) with the diagonal of hi := own_lengths [groups, N]: the spans
        kernels.segment_decode.tree_decode_attention reads."""
        n = own_lengths.shape[1]
        eye = jnp.eye(n, dtype=bool)[None]
        return self.lo, jnp.where(eye, own_lengths[:, :, None], self.hi)


def no_forks(groups: int, group_size: int) -> ResponseTree:
    """The tree of a group whose samples share no response prefix."""
    z = jnp.zeros((groups, group_size, group_size), jnp.int32)
    return ResponseTree(lo=z, hi=z)


@struct.dataclass
class SegmentedKVCache:
    """Shared-prompt KV cache for sampling N responses per prompt (issue 7).

    k_prompt, v_prompt [layers, groups, P, kv_heads, head_dim]: each group's prompt keys and
    values, stored ONCE per group. k_resp, v_resp [layers, groups, N, R, kv_heads,
    head_dim]: each sample's own keys and values. prompt_lengths [groups] and resp_lengths
    [groups, N] int32 count the valid entries; sample (g, n) writes its next key at
    resp_lengths[g, n]. Batch row b of the decoder is sample (b // N, b % N). tree
    (optional): samples that forked from another read their shared prefix from its segment
    (`ResponseTree`); None: each sample reads its own segment only."""

    k_prompt: jax.Array
    v_prompt: jax.Array
    k_resp: jax.Array
    v_resp: jax.Array
    prompt_lengths: jax.Array
    resp_lengths: jax.Array
    tree: ResponseTree | None = None

    @property
    def groups(self) -> int:
        return self.k_prompt.shape[1]

    @property
    def group_size(self) -> int:
        return self.k_resp.shape[2]

    @property
    def batch(self) -> int:
        return self.groups * self.group_size

    @property
    def prompt_len(self) -> int:
        return self.k_prompt.shape[2]

    @property
    def resp_len(self) -> int:
        return self.k_resp.shape[3]


def init_segmented_cache(config: ModelConfig, groups: int, group_size: int, prompt_len: int,
                         resp_len: int, dtype: str | None = None) -> SegmentedKVCache:
    """An empty segmented cache (lengths 0): a prompt segment of prompt_len entries per
    group and a response segment of resp_len entries per sample, in `dtype` (default: the
    config's compute dtype)."""
    for name, value in (("groups", groups), ("group_size", group_size),
                        ("prompt_len", prompt_len), ("resp_len", resp_len)):
        if value < 1:
            raise ValueError(f"init_segmented_cache: {name} must be >= 1, got {value}")
    if prompt_len + resp_len > config.max_position_embeddings:
        raise ValueError(
            f"init_segmented_cache: prompt_len + resp_len = {prompt_len + resp_len} exceeds "
            f"max_position_embeddings={config.max_position_embeddings}")
    dt = jnp.dtype(dtype or config.dtype)
    kv = (config.num_kv_heads, config.head_dim)
    p_shape = (config.num_layers, groups, prompt_len) + kv
    r_shape = (config.num_layers, groups, group_size, resp_len) + kv
    return SegmentedKVCache(
        k_prompt=jnp.zeros(p_shape, dt), v_prompt=jnp.zeros(p_shape, dt),
        k_resp=jnp.zeros(r_shape, dt), v_resp=jnp.zeros(r_shape, dt),
        prompt_lengths=jnp.zeros((groups,), jnp.int32),
        resp_lengths=jnp.zeros((groups, group_size), jnp.int32))


def segmented_cache_logical_axes() -> SegmentedKVCache:
    """Logical axis names of each segmented-cache field ("batch" = the group axis)."""
    p = ("layers", "batch", "seq", "kv_heads", "head_dim")
    r = ("layers", "batch", "samples", "seq", "kv_heads", "head_dim")
    return SegmentedKVCache(k_prompt=p, v_prompt=p, k_resp=r, v_resp=r,
                            prompt_lengths=("batch",), resp_lengths=("batch", "samples"))


def cache_bytes(cache: KVCache | SegmentedKVCache) -> dict[str, int]:
    """Bytes of the key/value arrays: {"prompt": ..., "response": ..., "total": ...} for a
    segmented cache, {"total": ...} for a dense one (lengths not counted)."""
    if isinstance(cache, SegmentedKVCache):
        prompt = cache.k_prompt.nbytes + cache.v_prompt.nbytes
        resp = cache.k_resp.nbytes + cache.v_resp.nbytes
        return {"prompt": prompt, "response": resp, "total": prompt + resp}
    return {"total": cache.k.nbytes + cache.v.nbytes}


@struct.dataclass
class BoundedDecode:
    """The decode `mask` of the bounded path: lengths (dense: lengths [batch]; segmented:
    (prompt_lengths [groups], resp_lengths [groups, N], tree)) before this step, and the static
    bound: attend to the first `bound` slots of each row / response segment (plus the new
    token). Every live row must have length < bound."""

    lengths: Any
    bound: int = struct.field(pytree_node=False)


def check_kv_bound(kv_bound: int | None, limit: int) -> int | None:
    """kv_bound as an int in [1, limit] (larger values are capped at limit), or None."""
    if kv_bound is None:
        return None
    if isinstance(kv_bound, bool) or not isinstance(kv_bound, int) or kv_bound < 1:
        raise ValueError(f"kv_bound must be an int >= 1 or None, got {kv_bound!r}")
    return min(kv_bound, limit)


def decode_inputs(cache: KVCache | SegmentedKVCache, kv_bound: int | None = None):
    """What the decoder's decode mode scans over and broadcasts, for either layout:
    (positions [batch, 1], mask, start, per-layer kv arrays). kv_bound None (the masked
    path): dense mask = decode_mask, start = lengths, kv = (k, v); segmented mask =
    (prompt_lengths, resp_lengths, tree), start = None, kv = (k_prompt, v_prompt, k_resp,
    v_resp). kv_bound int: mask = BoundedDecode(lengths, bound) (capped at the cache's
    max_len / resp_len), the rest as above. A segmented mask's lengths are the triple
    (prompt_lengths, resp_lengths, tree), tree None unless the cache holds a rollout tree."""
    if isinstance(cache, SegmentedKVCache):
        lengths = (cache.prompt_lengths, cache.resp_lengths, cache.tree)
        pos = (cache.prompt_lengths[:, None] + cache.resp_lengths).reshape(-1, 1)
        kv = (cache.k_prompt, cache.v_prompt, cache.k_resp, cache.v_resp)
        if kv_bound is not None:
            return pos, BoundedDecode(lengths, check_kv_bound(kv_bound, cache.resp_len)), \
                None, kv
        return pos, lengths, None, kv
    if kv_bound is not None:
        bounded = BoundedDecode(cache.lengths, check_kv_bound(kv_bound, cache.max_len))
        return cache.lengths[:, None], bounded, cache.lengths, (cache.k, cache.v)
    return (cache.lengths[:, None], decode_mask(cache.lengths, cache.max_len), cache.lengths,
            (cache.k, cache.v))


def _layer_prefix(x: jax.Array, layer: jax.Array, axis: int, bound: int) -> jax.Array:
    """x[layer] cut to its first `bound` entries along `axis` (of x[layer]), read in place
    (one dynamic slice, which XLA fuses into its consumer)."""
    sizes = (1,) + tuple(bound if i == axis else n for i, n in enumerate(x.shape[1:]))
    return jax.lax.dynamic_slice(x, (layer,) + (0,) * (x.ndim - 1), sizes)[0]


def _segmented_attention(q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, own_lengths,
                         tree: ResponseTree | None, impl, k_new=None, v_new=None):
    """Segment decode attention, or tree decode attention when the cache holds a rollout
    tree (each sample reads its own segment up to own_lengths [groups, N], its ancestors'
    per the tree; impl None is the XLA path there, "pallas" / "pallas_triton" the Triton
    kernel, and "pallas_mosaic" is refused: no Mosaic kernel reads a tree yet)."""
    if tree is None:
        return segment_decode_attention(q, k_prompt, v_prompt, k_resp, v_resp,
                                        prompt_lengths=prompt_lengths, resp_lengths=own_lengths,
                                        k_new=k_new, v_new=v_new, impl=impl)
    lo, hi = tree.spans(own_lengths)
    return tree_decode_attention(q, k_prompt, v_prompt, k_resp, v_resp,
                                 prompt_lengths=prompt_lengths, resp_lo=lo, resp_hi=hi,
                                 k_new=k_new, v_new=v_new, impl=impl)


def _decode_layer_bounded(q, k, v, kv, layer, mask: BoundedDecode, impl):
    """The bounded path of `decode_layer`: nothing is written here; the layer reads the
    first mask.bound slots of its cache (lengths before this step are valid there) and
    attends to the new token's (k, v) as one more key."""
    k_new, v_new = k[:, 0], v[:, 0]
    bound, dt = mask.bound, q.dtype
    if len(kv) == 4:  # segmented
        prompt_lengths, resp_lengths, tree = mask.lengths
        g, n = resp_lengths.shape
        b, _, heads, d = q.shape
        k_resp, v_resp = (_layer_prefix(x, layer, 2, bound) for x in kv[2:])
        out = _segmented_attention(
            q.reshape(g, n, heads, d), kv[0][layer].astype(dt), kv[1][layer].astype(dt),
            k_resp.astype(dt), v_resp.astype(dt), prompt_lengths,
            jnp.minimum(resp_lengths, bound), tree, impl,
            k_new=k_new.reshape(g, n, *k_new.shape[1:]),
            v_new=v_new.reshape(g, n, *v_new.shape[1:]))
        return out.reshape(b, 1, heads, d), (k_new, v_new)
    k_cache, v_cache = (_layer_prefix(x, layer, 1, bound).astype(dt) for x in kv)
    out = decode_attention(q, k_cache, v_cache, jnp.minimum(mask.lengths, bound), k_new, v_new,
                           impl=impl)
    return out, (k_new, v_new)


@struct.dataclass
class ChunkAttend:
    """The decode `mask` of a chunked-prefill step (models/chunked_prefill.py): the decoder
    runs C tokens per row in decode mode over a read-only cache kv (k, v) [layers, G, W,
    kv_heads, head_dim] and returns their fresh (k, v) per layer instead of a new cache.
    Query rows g*N .. g*N+N-1 attend to cache row g's entries < cache_lengths[g] among the
    first num_blocks * block (see models.attention.chunk_attention), and causally to the
    own_lengths[b] valid tokens of their own chunk."""

    cache_lengths: jax.Array
    num_blocks: jax.Array
    own_lengths: jax.Array
    block: int = struct.field(pytree_node=False)


def decode_layer(q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple, layer: jax.Array, mask,
                 start, impl: str | None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One layer's decode attention for either layout (see `decode_inputs`).

    q [batch, 1, heads, head_dim], k, v [batch, 1, kv_heads, head_dim]: the new token.
    kv: the whole cache's arrays (all layers, read only); layer: this layer's index.
    Attends to every valid cached key of the layer plus the new token, which is written
    into a copy of this layer's row/response segment only (the prompt segment is never
    copied). Returns (out [batch, 1, heads, head_dim], the new token's (k, v) [batch,
    kv_heads, head_dim]) for `after_decode` to write into the cache once for all layers.
    A BoundedDecode mask takes the bounded path (see the module docstring); a ChunkAttend
    mask runs a chunk of tokens (chunked prefill) and returns the chunk's whole (k, v)
    [batch, C, kv_heads, head_dim]."""
    if isinstance(mask, ChunkAttend):
        out = chunk_attention(q, k, v, kv[0][layer], kv[1][layer],
                              cache_lengths=mask.cache_lengths, num_blocks=mask.num_blocks,
                              block=mask.block, own_lengths=mask.own_lengths)
        return out, (k, v)
    if isinstance(mask, BoundedDecode):
        return _decode_layer_bounded(q, k, v, kv, layer, mask, impl)
    new = (k[:, 0], v[:, 0])
    if len(kv) == 4:  # segmented
        k_prompt, v_prompt, k_resp, v_resp = (x[layer] for x in kv)
        prompt_lengths, resp_lengths, tree = mask
        g, n = resp_lengths.shape
        b, _, heads, d = q.shape
        k_resp, v_resp = write_response(k_resp, v_resp, k.reshape(g, n, *k.shape[2:]),
                                        v.reshape(g, n, *v.shape[2:]), resp_lengths)
        dt = q.dtype
        out = _segmented_attention(
            q.reshape(g, n, heads, d), k_prompt.astype(dt), v_prompt.astype(dt),
            k_resp.astype(dt), v_resp.astype(dt), prompt_lengths, resp_lengths + 1, tree, impl)
        return out.reshape(b, 1, heads, d), new
    k_layer, v_layer = write_layer(kv[0][layer], kv[1][layer], k, v, start)
    out = attention(q, k_layer.astype(q.dtype), v_layer.astype(q.dtype), mask=mask, impl=impl)
    return out, new


def write_response(k_resp: jax.Array, v_resp: jax.Array, k_new: jax.Array, v_new: jax.Array,
                   at: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write one key/value per sample into its response segment at index at[g, n].

    k_resp, v_resp [groups, N, R, kv_heads, head_dim]; k_new, v_new [groups, N, kv_heads,
    head_dim]; at [groups, N] int32. An index >= R (a finished sample whose segment is
    full) is dropped rather than clamped onto a valid entry."""
    g, n = at.shape
    gi, ni = jnp.arange(g)[:, None], jnp.arange(n)[None, :]
    return (k_resp.at[gi, ni, at].set(k_new.astype(k_resp.dtype), mode="drop"),
            v_resp.at[gi, ni, at].set(v_new.astype(v_resp.dtype), mode="drop"))


def after_decode(cache: KVCache | SegmentedKVCache, new_kv: tuple[jax.Array, jax.Array]
                 ) -> KVCache | SegmentedKVCache:
    """The cache after a decode step: the new token's keys/values new_kv (k, v) [layers,
    batch, kv_heads, head_dim] written at every row's length (one scatter, in place under
    jit; an index past the end is dropped) and every length advanced by one."""
    k, v = new_kv
    if isinstance(cache, SegmentedKVCache):
        g, n = cache.resp_lengths.shape
        gi, ni = jnp.arange(g)[:, None], jnp.arange(n)[None, :]

        def put(seg, x):
            x = x.reshape((x.shape[0], g, n) + x.shape[2:]).astype(seg.dtype)
            return seg.at[:, gi, ni, cache.resp_lengths].set(x, mode="drop")

        return cache.replace(k_resp=put(cache.k_resp, k), v_resp=put(cache.v_resp, v),
                             resp_lengths=cache.resp_lengths + 1)
    rows = jnp.arange(cache.batch)
    return KVCache(k=cache.k.at[:, rows, cache.lengths].set(k.astype(cache.k.dtype), mode="drop"),
                   v=cache.v.at[:, rows, cache.lengths].set(v.astype(cache.v.dtype), mode="drop"),
                   lengths=cache.lengths + 1)


def keep_lengths_where(new: KVCache | SegmentedKVCache, old: KVCache | SegmentedKVCache,
                       advance: jax.Array) -> KVCache | SegmentedKVCache:
    """`new` with the lengths of rows where advance [batch] is False reset to `old`'s (a
    finished row's throw-away decode step must not grow its cache)."""
    if isinstance(new, SegmentedKVCache):
        adv = advance.reshape(new.resp_lengths.shape)
        return new.replace(resp_lengths=jnp.where(adv, new.resp_lengths, old.resp_lengths))
    return new.replace(lengths=jnp.where(advance, new.lengths, old.lengths))
