"""Dense KV cache: one [max_len] slot range per batch row, for every layer.

All cache layout logic lives here (allocation, per-layer writes, which cached keys a
query may see), so a different layout (e.g. shared prompt + per-sample response
segments) can replace this file without touching the decoder.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

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
