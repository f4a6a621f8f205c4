"""Chunked prefill: a long prompt runs C tokens at a time, so memory stays bounded.

The one-shot prefill (models.decoder.prefill, the exact slow twin) attends all T prompt
tokens to each other at once: its scores are [batch, heads, T, T] (8k tokens of SmolLM2:
2.4 GB per copy). Here chunk i (tokens [i*C, (i+1)*C)) runs through the decoder in decode
mode over the cache written so far: its queries attend to the cached keys of the earlier
chunks, a block of C keys at a time with an online softmax (models.attention.
chunk_attention), and causally to the chunk itself; its keys/values are then written into
the cache. Scores are O(C * C) per block, never O(T^2), and only the causal blocks are
computed. The last chunk is padded to C (masked), so every chunk has one shape: one compiled
program whatever T is, and the chunk offset is a traced scalar.

Two drivers of the same step:

  * `chunked_prefill` / `prefill_chunks_host`: a host loop over a jitted chunk step (the
    cache donated, updated in place), with a progress callback (experiments.generate's bar);
  * `prefill_chunks`: a pure, traceable lax.scan over chunks, for callers inside a jit
    (the rollout sampler's fill, rl/rollout/sampler_core.py).
`segments_from_prompt_kv` completes the segmented (shared-prompt) layout: the N responses
of a group teacher-forced behind a prompt cache, reading it once per group.
chunk_size >= T means one shot: `chunked_prefill` then calls models.decoder.prefill.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.decoder import Decoder, prefill
from models.inputs import validate_tokens
from models.kv_cache import ChunkAttend, KVCache

Params = Any
DEFAULT_CHUNK = 512  # prompt tokens per chunk: scores stay <= C x C per block of keys


def check_chunk_size(chunk_size: int | None) -> int | None:
    """chunk_size as an int >= 1, or None (= never chunk); ValueError otherwise."""
    if chunk_size is None:
        return None
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer))
            or chunk_size < 1):
        raise ValueError(f"prefill chunk size must be an int >= 1 or None (one shot), got "
                         f"{chunk_size!r}")
    return int(chunk_size)


def _run_tokens(params, config, attn_impl, k_cache, v_cache, tokens, positions, mask, logits_at):
    """The decoder over `tokens` [B, C] attending through `mask` (ChunkAttend) to the
    read-only cache (k_cache, v_cache) [layers, G, W, kv_heads, head_dim]. Returns
    (logits [B, vocab] at logits_at [B] indices, fresh k, v [layers, B, C, kv_heads, head_dim])."""
    logits, (k, v) = Decoder(config, "decode", attn_impl).apply(
        {"params": params}, tokens, positions, mask, None, (k_cache, v_cache),
        logits_at=logits_at[:, None])
    return logits[:, 0], k, v


def _write(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache [layers, B, W, ...] with new [layers, B, C, ...] at slots start .. start+C-1;
    slots >= W (the padding of a last chunk) are dropped."""
    pos = start + jnp.arange(new.shape[2])
    return cache.at[:, :, pos].set(new.astype(cache.dtype), mode="drop")


def prompt_chunk(params, carry, tokens, start, lengths, *, config: ModelConfig,
                 attn_impl: str | None):
    """One chunk step, pure. carry = (k, v [layers, B, W, kv_heads, head_dim] with slots
    [0, start) filled, last_logits [B, vocab]); tokens [B, C] = prompt positions [start,
    start + C) (right-padded); lengths [B] valid prompt tokens (0 allowed). start must be a
    multiple of C. Returns the carry with the chunk's keys/values written and, for rows
    whose last token lengths[b] - 1 lies in this chunk, its logits."""
    k_cache, v_cache, last = carry
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    mask = ChunkAttend(cache_lengths=lengths, num_blocks=start // c,
                       own_lengths=jnp.clip(lengths - start, 0, c), block=c)
    logits, k, v = _run_tokens(params, config, attn_impl, k_cache, v_cache, tokens, positions,
                               mask, jnp.clip(lengths - 1 - start, 0, c - 1))
    here = (lengths - 1 >= start) & (lengths - 1 < start + c)
    last = jnp.where(here[:, None], logits, last)
    return _write(k_cache, k, start), _write(v_cache, v, start), last


_prompt_chunk_jit = jax.jit(prompt_chunk, static_argnames=("config", "attn_impl"),
                            donate_argnums=1)


def _chunks(tokens: jax.Array, chunk: int) -> tuple[jax.Array, int]:
    """tokens [B, T] -> ([n, B, chunk] right-padded with zeros, n = ceil(T / chunk))."""
    b, t = tokens.shape
    n = -(-t // chunk)
    padded = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)))
    return padded.reshape(b, n, chunk).swapaxes(0, 1), n


def prefill_chunks(params: Params, config: ModelConfig, tokens: jax.Array, lengths: jax.Array,
                   *, chunk: int, attn_impl: str | None = None, dtype: Any = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure, traceable chunked prefill (lax.scan over chunks) of right-padded tokens
    [B, T] with lengths [B] (0 <= lengths <= T; no checks: callers validate) into a fresh
    cache of width T in `dtype` (default: the compute dtype). Returns (logits [B, vocab]
    float32 of each row's last token (meaningless where lengths == 0), k, v [layers, B,
    T, kv_heads, head_dim]); entries past the lengths are meaningless."""
    b, t = tokens.shape
    shape = (config.num_layers, b, t, config.num_kv_heads, config.head_dim)
    dt = jnp.dtype(dtype or config.dtype)
    xs, n = _chunks(tokens, chunk)
    init = (jnp.zeros(shape, dt), jnp.zeros(shape, dt),
            jnp.zeros((b, config.vocab_size), jnp.float32))
    step = partial(prompt_chunk, params, lengths=lengths, config=config, attn_impl=attn_impl)
    (k, v, last), _ = jax.lax.scan(lambda cr, x: (step(cr, x[0], x[1]), None), init,
                                   (xs, jnp.arange(n, dtype=jnp.int32) * chunk))
    return last, k, v


def prefill_chunks_host(params: Params, config: ModelConfig, tokens: Any, lengths: Any,
                        k_cache: jax.Array, v_cache: jax.Array, *, chunk: int,
                        attn_impl: str | None = None,
                        on_chunk: Callable[[int, int, int], Any] | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The host loop twin of `prefill_chunks`: one jitted chunk step per chunk (compiled
    once per shape), writing into k_cache, v_cache [layers, B, W >= T, kv_heads,
    head_dim], which are consumed (donated: do not use them afterwards). on_chunk(i, n,
    tokens), if given, is called after chunk i of n (1-based) has finished with the number
    of prompt positions it covered. Returns (last-token logits [B, vocab], k, v)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    t = tokens.shape[1]
    xs, n = _chunks(tokens, chunk)
    carry = (k_cache, v_cache, jnp.zeros((tokens.shape[0], config.vocab_size), jnp.float32))
    for i in range(n):
        carry = _prompt_chunk_jit(params, carry, xs[i], jnp.int32(i * chunk), lengths,
                                  config=config, attn_impl=attn_impl)
        if on_chunk is not None:
            jax.block_until_ready(carry[2])
            on_chunk(i + 1, n, min(chunk, t - i * chunk))
    return carry[2], carry[0], carry[1]


def chunked_prefill(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    *,
    chunk_size: int | None = DEFAULT_CHUNK,
    attn_impl: str | None = None,
    on_chunk: Callable[[int, int, int], Any] | None = None,
) -> tuple[jax.Array, KVCache]:
    """models.decoder.prefill in chunks of chunk_size tokens: right-padded prompts tokens
    [batch, T] with lengths [batch] (1 <= lengths <= T) written into `cache` (consumed:
    donated; cache.lengths becomes `lengths`). Returns (logits [batch, vocab] float32 of
    each row's last prompt token = prefill's logits[b, lengths[b] - 1], the cache). Peak
    attention memory is O(chunk_size^2) per head instead of O(T^2). chunk_size None or >= T
    runs the one-shot prefill. on_chunk: see `prefill_chunks_host`."""
    chunk = check_chunk_size(chunk_size)
    validate_tokens(tokens, config)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, T], got shape {tokens.shape}")
    b, t = tokens.shape
    if chunk is None or chunk >= t:
        logits, cache = prefill(params, config, tokens, lengths, cache, attn_impl=attn_impl)
        last = jnp.take_along_axis(logits, (cache.lengths - 1)[:, None, None], axis=1)[:, 0]
        if on_chunk is not None:
            on_chunk(1, 1, t)
        return last, cache
    want = (config.num_layers, b, cache.max_len, config.num_kv_heads, config.head_dim)
    if tuple(cache.k.shape) != want:
        raise ValueError(f"cache.k must have shape {want} for these tokens, got "
                         f"{tuple(cache.k.shape)}")
    if t > cache.max_len:
        raise ValueError(f"prompt longer than the cache: tokens have T={t} positions but the cache "
                         f"holds max_len={cache.max_len}; allocate init_cache(..., max_len >= {t})")
    arr = np.asarray(lengths)
    if arr.shape != (b,) or arr.min() < 1 or arr.max() > t:
        raise ValueError(f"lengths must be [batch={b}] ints in [1, T={t}], got {arr.tolist()}")
    last, k, v = prefill_chunks_host(params, config, tokens, arr, cache.k, cache.v, chunk=chunk,
                                     attn_impl=attn_impl, on_chunk=on_chunk)
    return last, KVCache(k=k, v=v, lengths=jnp.asarray(arr, jnp.int32))


def segments_from_prompt_kv(params: Params, config: ModelConfig, k_prompt: jax.Array,
                            v_prompt: jax.Array, prompt_lengths: jax.Array,
                            resp_tokens: jax.Array, resp_lengths: jax.Array, *, chunk: int,
                            attn_impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """The response half of models.decoder.prefill_segments given the prompt's cache:
    resp_tokens [G, N, R] (resp_lengths [G, N] valid) teacher-forced at positions
    prompt_lengths[g] + t behind k_prompt, v_prompt [layers, G, P, kv_heads, head_dim]
    (prompt_lengths [G] valid, P >= chunk), each attending to the valid prompt keys (read
    in blocks of `chunk`, once for the group's N samples) and causally to itself. Pure.
    Returns k_resp, v_resp [layers, G, N, R, kv_heads, head_dim]."""
    g, n, r = resp_tokens.shape
    positions = jnp.broadcast_to(prompt_lengths[:, None, None] + jnp.arange(r, dtype=jnp.int32),
                                 (g, n, r)).reshape(g * n, r)
    mask = ChunkAttend(cache_lengths=prompt_lengths,
                       num_blocks=-(-jnp.max(prompt_lengths) // chunk),
                       own_lengths=resp_lengths.reshape(g * n), block=chunk)
    _, k, v = _run_tokens(params, config, attn_impl, k_prompt, v_prompt,
                          resp_tokens.reshape(g * n, r), positions, mask,
                          jnp.zeros((g * n,), jnp.int32))
    return (k.reshape(k.shape[:1] + (g, n, r) + k.shape[3:]),
            v.reshape(v.shape[:1] + (g, n, r) + v.shape[3:]))
