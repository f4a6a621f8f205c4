"""Appending tokens to live sampler slots: the multi-turn engine's observation step.

After a model turn ends, its slot is `done` with the turn's last token pending (fed to the
model by no one yet). `append_tokens` feeds that pending token and the observation's first
k - 1 tokens through the model at the slot's current position (a prefill of just those k
tokens, attending to everything already in the slot's cache and causally to themselves),
writes their keys/values behind the slot's cache, records the k observation tokens in the
slot's response (behaviour log-prob 0, the given version), makes the observation's last
token pending and the slot live again with a new budget. The episode's earlier tokens are
never recomputed: an episode of L tokens costs L - 1 token passes in all (prefill +
decode + appends).

Both KV layouts. Replicated: the slot's dense row [0, length) is the context. Segmented:
the context is the group's prompt segment [0, prompt_length) followed by the sample's
response segment [0, resp_length); the new keys go into the response segment, the shared
prompt segment is read, never copied back. Either way the context is gathered, per entry,
into one dense [width] row (width = a few static buckets of the longest position) and the
chunk runs in the decoder's decode mode with a `ChunkAttend` mask (the chunked prefill's
step, models/chunked_prefill.py): the same model code path as every other token.

Shapes are bucketed (entries to powers of two, observation widths to multiples of 8,
context widths by `kv_bucket`), so few programs are compiled.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.decoder import Decoder
from models.kv_cache import ChunkAttend, KVCache
from rl.rollout.sampler import bucket_width, kv_bucket
from rl.rollout.sampler_state import SamplerState, bucket

Params = Any


@struct.dataclass
class AppendInputs:
    """Device inputs of one append (M entries, padded): slot [M] int32 (>= num_slots: a
    padding entry, dropped); tokens [M, C] int32, right-padded observation ids; lengths
    [M] int32 valid tokens (0 allowed: the slot only goes live again); versions [M] int32
    stamped on the appended tokens; budget [M] int32 the slot's new response budget
    (counted from the start of the response, like SamplerState.budget)."""

    slot: jax.Array
    tokens: jax.Array
    lengths: jax.Array
    versions: jax.Array
    budget: jax.Array


def _positions(state: SamplerState, sl: jax.Array) -> jax.Array:
    """[M] the absolute position where each entry's next token goes (= its context length)."""
    cache = state.cache
    if state.kv_layout == "segmented":
        n = state.group_size
        g, i = sl // n, sl % n
        return cache.prompt_lengths[g] + cache.resp_lengths[g, i]
    return cache.lengths[sl]


def _context(state: SamplerState, sl: jax.Array, start: jax.Array, width: int
             ) -> tuple[jax.Array, jax.Array]:
    """Each entry's context keys/values as one dense row: [layers, M, width, kv_heads,
    head_dim], entries [0, start[m]) valid."""
    cache = state.cache
    if state.kv_layout == "replicated":
        return cache.k[:, sl, :width], cache.v[:, sl, :width]
    n = state.group_size
    g, i = sl // n, sl % n
    plen = cache.prompt_lengths[g][:, None]  # [M, 1]
    j = jnp.arange(width)[None, :]
    jp = jnp.clip(j, 0, cache.prompt_len - 1)
    jr = jnp.clip(j - plen, 0, cache.resp_len - 1)
    in_prompt = (j < plen)[None, :, :, None, None]

    def gather(prompt_seg, resp_seg):
        return jnp.where(in_prompt, prompt_seg[:, g[:, None], jp],
                         resp_seg[:, g[:, None], i[:, None], jr])

    return gather(cache.k_prompt, cache.k_resp), gather(cache.v_prompt, cache.v_resp)


def append_impl(params: Params, state: SamplerState, a: AppendInputs, width: int
                ) -> SamplerState:
    """Pure body of `append_tokens` (see the module docstring). width (static): the
    gathered context width; every entry's position must be <= width. Not jitted."""
    s, r_max = state.response_ids.shape
    m, c = a.tokens.shape
    sl = jnp.minimum(a.slot, s - 1)  # reads; every write uses a.slot (>= s: dropped)
    valid = a.slot < s
    k_len = jnp.where(valid, a.lengths, 0)
    start = _positions(state, sl)
    feed = jnp.concatenate([state.pending[sl][:, None], a.tokens[:, :c - 1]], axis=1)
    positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    ctx_k, ctx_v = _context(state, sl, start, width)
    mask = ChunkAttend(cache_lengths=start, num_blocks=jnp.int32(1), own_lengths=k_len,
                       block=width)
    _, (k, v) = Decoder(state.config, "decode", state.attn_impl).apply(
        {"params": params}, feed, positions, mask, None, (ctx_k, ctx_v),
        logits_at=jnp.zeros((m, 1), jnp.int32))  # k, v [layers, M, C, kv_heads, head_dim]
    own = jnp.arange(c)[None, :] < k_len[:, None]  # [M, C]
    cache = state.cache
    if state.kv_layout == "segmented":
        n = state.group_size
        g, i = sl // n, sl % n
        at = jnp.where(own, cache.resp_lengths[g, i][:, None] + jnp.arange(c)[None, :],
                       cache.resp_len)  # past the segment: dropped

        def put(seg, x):
            return seg.at[:, g[:, None], i[:, None], at].set(x.astype(seg.dtype), mode="drop")

        cache = cache.replace(k_resp=put(cache.k_resp, k), v_resp=put(cache.v_resp, v),
                              resp_lengths=cache.resp_lengths.at[g, i].add(k_len))
    else:
        at = jnp.where(own, start[:, None] + jnp.arange(c)[None, :], cache.max_len)
        cache = KVCache(k=cache.k.at[:, sl[:, None], at].set(k.astype(cache.k.dtype), mode="drop"),
                        v=cache.v.at[:, sl[:, None], at].set(v.astype(cache.v.dtype), mode="drop"),
                        lengths=cache.lengths.at[sl].add(k_len))
    n_gen = state.num_generated[sl]
    col = jnp.where(own, n_gen[:, None] + jnp.arange(c)[None, :], r_max)
    rows = a.slot[:, None]
    last = jnp.take_along_axis(a.tokens, jnp.maximum(k_len - 1, 0)[:, None], axis=1)[:, 0]
    return state.replace(
        cache=cache,
        pending=state.pending.at[a.slot].set(jnp.where(k_len > 0, last, state.pending[sl]),
                                             mode="drop"),
        response_ids=state.response_ids.at[rows, col].set(a.tokens, mode="drop"),
        logprobs=state.logprobs.at[rows, col].set(0.0, mode="drop"),
        versions=state.versions.at[rows, col].set(
            jnp.broadcast_to(a.versions[:, None], (m, c)), mode="drop"),
        num_generated=state.num_generated.at[a.slot].add(k_len, mode="drop"),
        budget=state.budget.at[a.slot].set(a.budget, mode="drop"),
        done=state.done.at[a.slot].set(n_gen + k_len >= a.budget, mode="drop"),
        stopped=state.stopped.at[a.slot].set(False, mode="drop"),
    )


append_jit = jax.jit(append_impl, static_argnames="width")


def append_tokens(params: Params, state: SamplerState, slots: Sequence[int],
                  tokens: Sequence[Sequence[int]], versions: Sequence[int],
                  budgets: Sequence[int]) -> SamplerState:
    """Append tokens[m] (k_m >= 0 ids, already validated) to slot slots[m] (distinct,
    each a slot whose turn has ended: done, its last token pending), stamping versions[m]
    on them, and make the slot live with response budget budgets[m] (> its tokens after
    the append). Returns the new state; see the module docstring."""
    m = len(slots)
    if not m:
        return state
    if not (len(tokens) == len(versions) == len(budgets) == m):
        raise ValueError(f"append_tokens: {m} slots but {len(tokens)} token lists, "
                         f"{len(versions)} versions, {len(budgets)} budgets")
    s = state.num_slots
    mb = bucket(m, s)
    longest = max((len(t) for t in tokens), default=0)
    c = bucket_width(max(longest, 1), state.max_new_tokens)
    slot = np.full((mb,), s, np.int32)
    toks = np.zeros((mb, c), np.int32)
    lens = np.zeros((mb,), np.int32)
    ver = np.zeros((mb,), np.int32)
    bud = np.ones((mb,), np.int32)
    for j, (sl, t) in enumerate(zip(slots, tokens)):
        slot[j], lens[j], ver[j], bud[j] = sl, len(t), versions[j], budgets[j]
        toks[j, :len(t)] = t
    cache = state.cache
    if state.kv_layout == "segmented":
        limit = cache.prompt_len + cache.resp_len
        pos = (cache.prompt_lengths[:, None] + cache.resp_lengths).reshape(-1)
    else:
        limit, pos = cache.max_len, cache.lengths
    longest_pos = int(np.asarray(jax.device_get(pos))[np.asarray(slots)].max())
    width = kv_bucket(max(longest_pos, 1), limit)
    return append_jit(params, state, AppendInputs(
        slot=slot, tokens=toks, lengths=lens, versions=ver, budget=bud), width=width)
