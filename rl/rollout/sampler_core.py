"""The sampler's pure, traceable bodies: the token draw (`sample_tokens`) and the jitted
prefill (`fill_impl`) and segment decode (`decode_segment_impl`) that `rl.rollout.sampler`
calls and `rl.rollout.sharded_sampler` wraps with explicit shardings; `pending_hidden`,
the last position's hidden state of every slot (online pruning's quality head).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models import kv_cache as kvc
from models.chunked_prefill import prefill_chunks, segments_from_prompt_kv
from models.decoder import Decoder, decode_jit, prefill_jit, prefill_segments
from models.kv_cache import KVCache
from rl.rollout.sampler_state import SamplerState, SamplingConfig

Params = Any


# ----------------------------------------------------------------------------- sampling
def kth_largest_top_k(z: jax.Array, k: int) -> jax.Array:
    """[S, 1]: each row's k-th largest value of z [S, V] (lax.top_k's last)."""
    return jax.lax.top_k(z, k)[0][:, -1:]


def kth_largest_bisect(z: jax.Array, k: int) -> jax.Array:
    """The same value as `kth_largest_top_k`, exactly, by a 32-step bisection on the bits:
    float32 -> an order-preserving uint32 key, then the largest key t with at least k keys
    >= t is built bit by bit, one compare-and-count over the row per bit. XLA:CPU ran
    lax.top_k with k = 50 over SmolLM2's 49,152 ids in ~85 ms a decode step; the 32
    passes take a few. The float back from the key is the k-th largest value itself."""
    bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.uint32)
    sign = jnp.uint32(0x80000000)
    key = jnp.where(bits & sign, ~bits, bits | sign)  # negatives reversed, below positives

    def step(i, t):
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        enough = (key >= cand[:, None]).sum(axis=-1) >= k
        return jnp.where(enough, cand, t)

    t = jax.lax.fori_loop(0, 32, step, jnp.zeros(z.shape[0], jnp.uint32))
    bits = jnp.where(t & sign, t & ~sign, ~t)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)[:, None]


def sample_tokens(logits: jax.Array, keys: jax.Array, sampling: SamplingConfig
                  ) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. logits [S, V] float32, keys [S, 2] uint32 ->
    (tokens [S] int32, behaviour log-probs [S] float32; see the module docstring)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        top = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
        return tok, top - jax.nn.logsumexp(logits, axis=-1)
    z = logits / sampling.temperature
    vocab = z.shape[-1]
    if sampling.top_k is not None and sampling.top_k < vocab:
        k = sampling.top_k
        kth = jax.lax.platform_dependent(z, cpu=lambda x: kth_largest_bisect(x, k),
                                         default=lambda x: kth_largest_top_k(x, k))
        z = jnp.where(z >= kth, z, -jnp.inf)
    if sampling.top_p < 1.0:
        probs = jax.nn.softmax(z, axis=-1)
        desc = -jnp.sort(-probs, axis=-1)
        # Keep a token while the mass strictly before it is < top_p (the first always stays).
        keep = (jnp.cumsum(desc, axis=-1) - desc) < sampling.top_p
        cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(probs >= cutoff, z, -jnp.inf)
    return _draw(z, keys)


_BLOCK = 128  # vocabulary block of the two-level inverse-CDF draw


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last entry > 0 along the last axis (0 if none)."""
    idx = jnp.arange(x.shape[-1])
    return jnp.max(jnp.where(x > 0, idx, 0), axis=-1)


def _draw(z: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draw from softmax(z) per row (z [S, V], -inf = excluded) by inverse CDF with one
    uniform per row, in two levels: pick a block of _BLOCK tokens from the block masses,
    then a token inside it. A full-vocabulary cumsum is ~15x slower on CPU than these two
    short ones. Returns (tokens [S] int32, log softmax(z)[token] [S])."""
    s, vocab = z.shape
    nb = -(-vocab // _BLOCK)
    zp = jnp.pad(z, ((0, 0), (0, nb * _BLOCK - vocab)), constant_values=-jnp.inf)
    m = jnp.max(zp, axis=-1, keepdims=True)
    e = jnp.exp(zp - m).reshape(s, nb, _BLOCK)  # unnormalised probabilities, 0 where excluded
    block_mass = e.sum(axis=-1)
    cdf = jnp.cumsum(block_mass, axis=-1)
    total = cdf[:, -1]
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * total
    # First block whose cdf exceeds u; rounding could push past the end, so cap at the
    # last block with mass (likewise inside the block): never an excluded token.
    b = jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1), _last_positive(block_mass))
    before = jnp.where(b > 0, jnp.take_along_axis(cdf, jnp.maximum(b - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(e, b[:, None, None], axis=1)[:, 0]  # [S, _BLOCK]
    j = jnp.minimum(jnp.sum(before[:, None] + jnp.cumsum(inner, axis=-1) <= u[:, None], axis=-1),
                    _last_positive(inner))
    tok = (b * _BLOCK + j).astype(jnp.int32)
    logp = jnp.take_along_axis(zp, tok[:, None], axis=-1)[:, 0] - m[:, 0] - jnp.log(total)
    return tok, logp


# ----------------------------------------------------------------------------- jitted core
@struct.dataclass
class ReplicatedFill:
    """Device inputs of one fill of a replicated-layout state (built by `prefill` /
    `load_samples`). ctx_ids [Rows, T] right-padded contexts (prompt + partial response),
    ctx_lengths [Rows], prompt_lengths [Rows]; entry m copies context row[m] into slot[m]
    (slot >= S drops the entry); per entry: keys [M, 2] uint32, budget [M], the partial
    response's logprobs [M, R_max] float32 / versions [M, R_max] int32, done/stopped [M]."""

    ctx_ids: jax.Array
    ctx_lengths: jax.Array
    prompt_lengths: jax.Array
    slot: jax.Array
    row: jax.Array
    keys: jax.Array
    budget: jax.Array
    logprobs: jax.Array
    versions: jax.Array
    done: jax.Array
    stopped: jax.Array


@struct.dataclass
class SegmentedFill:
    """Device inputs of one fill of a segmented-layout state: Gb groups, each loaded into
    group-slot group_slot[g] (slots group_slot[g] * N + i; >= groups drops the group).
    prompt_ids [Gb, Tp] right-padded, prompt_lengths [Gb] >= 1; resp_ids [Gb, N, Tr] each
    sample's partial response (num_generated [Gb, N] valid tokens, 0 for a new group);
    per sample: keys [Gb, N, 2] uint32, budget [Gb, N], logprobs [Gb, N, R_max] float32,
    versions [Gb, N, R_max] int32, done/stopped [Gb, N]."""

    prompt_ids: jax.Array
    prompt_lengths: jax.Array
    resp_ids: jax.Array
    num_generated: jax.Array
    group_slot: jax.Array
    keys: jax.Array
    budget: jax.Array
    logprobs: jax.Array
    versions: jax.Array
    done: jax.Array
    stopped: jax.Array


def _pad_cols(x: jax.Array, width: int, valid: jax.Array) -> jax.Array:
    """x [M, w] (w <= width) -> [M, width], zero outside the valid [M] leading entries."""
    x = jnp.pad(x, ((0, 0), (0, width - x.shape[1])))
    return jnp.where(jnp.arange(width)[None, :] < valid[:, None], x, 0)


def _load_slots(state: SamplerState, cache, slot, prompt, plen, resp, n_gen, pending, keys,
                budget, logprobs, versions, done, stopped) -> SamplerState:
    """The per-slot bookkeeping of a fill, shared by both layouts: entry m goes to
    slot[m] (out of range: dropped). prompt [M, P_max], resp [M, R_max], the rest [M, ...]."""
    def put(field, value):
        return getattr(state, field).at[slot].set(value, mode="drop")

    return state.replace(
        cache=cache, pending=put("pending", pending), prompt_ids=put("prompt_ids", prompt),
        prompt_lengths=put("prompt_lengths", plen), response_ids=put("response_ids", resp),
        logprobs=put("logprobs", logprobs), versions=put("versions", versions),
        num_generated=put("num_generated", n_gen), budget=put("budget", budget),
        done=put("done", done | (n_gen >= budget)), stopped=put("stopped", stopped),
        keys=put("keys", keys))


def chunks_prefill(state: SamplerState, width: int) -> bool:
    """Whether a fill of contexts `width` tokens wide (replicated: the context; segmented:
    the prompt) runs the chunked prefill (models/chunked_prefill.py): the state's
    prefill_chunk is set and smaller than the width. Otherwise it runs in one shot."""
    return state.prefill_chunk is not None and width > state.prefill_chunk


def fill_context(fill: ReplicatedFill | SegmentedFill) -> tuple[jax.Array, jax.Array]:
    """The tokens [rows, T] and lengths [rows] a fill prefills (the part that gets chunked):
    replicated, the contexts; segmented, the prompt segments (each prompt but its last
    token)."""
    if isinstance(fill, SegmentedFill):
        return fill.prompt_ids, fill.prompt_lengths - 1
    return fill.ctx_ids, fill.ctx_lengths


def _fill_replicated(params, state: SamplerState, f: ReplicatedFill, context_kv) -> SamplerState:
    c = state.config
    r, t = f.ctx_ids.shape
    dt = state.cache.k.dtype
    if context_kv is None and chunks_prefill(state, t):
        _, *context_kv = prefill_chunks(params, c, f.ctx_ids, f.ctx_lengths,
                                        chunk=state.prefill_chunk, attn_impl=state.attn_impl)
    if context_kv is None:
        kv_shape = (c.num_layers, r, t, c.num_kv_heads, c.head_dim)
        empty = KVCache(k=jnp.zeros(kv_shape, dt), v=jnp.zeros(kv_shape, dt),
                        lengths=jnp.zeros((r,), jnp.int32))
        _, pc = prefill_jit(params, f.ctx_ids, f.ctx_lengths, empty, config=c,
                             attn_impl=state.attn_impl)
    else:
        pc = KVCache(k=context_kv[0][:, :, :t].astype(dt), v=context_kv[1][:, :, :t].astype(dt),
                     lengths=f.ctx_lengths)
    row, slot = f.row, f.slot
    clen, plen = f.ctx_lengths[row], f.prompt_lengths[row]
    rows_ctx = f.ctx_ids[row]  # [M, T]
    p_max, r_max = state.max_prompt_len, state.max_new_tokens
    n_gen = clen - plen
    # Response token j of entry m sits at context column plen[m] + j.
    j = jnp.clip(jnp.arange(r_max)[None, :] + plen[:, None], 0, t - 1)
    resp = _pad_cols(jnp.take_along_axis(rows_ctx, j, axis=1), r_max, n_gen)
    cache = state.cache
    cache = KVCache(
        # The only place a slot's KV rows are replaced: positions [0, T) of each slot.
        k=cache.k.at[:, slot, :t].set(pc.k[:, row], mode="drop"),
        v=cache.v.at[:, slot, :t].set(pc.v[:, row], mode="drop"),
        lengths=cache.lengths.at[slot].set(clen - 1, mode="drop"))
    pending = rows_ctx[jnp.arange(row.shape[0]), clen - 1]
    return _load_slots(state, cache, slot, _pad_cols(rows_ctx[:, :min(t, p_max)], p_max, plen),
                       plen, resp, n_gen, pending, f.keys, f.budget, f.logprobs, f.versions,
                       f.done, f.stopped)


def _fill_segmented(params, state: SamplerState, f: SegmentedFill, context_kv) -> SamplerState:
    cache = state.cache
    gb, tp = f.prompt_ids.shape
    n, tr = f.resp_ids.shape[1:]
    # Prompt segment = prompt[:-1]; sample i's response segment = [prompt[-1], r_0 ..
    # r_{n_i - 2}] (n_i tokens), leaving r_{n_i - 1} (or prompt[-1] if n_i = 0) pending.
    last = jnp.take_along_axis(f.prompt_ids, (f.prompt_lengths - 1)[:, None], axis=1)[:, 0]
    ctx = jnp.concatenate([jnp.broadcast_to(last[:, None, None], (gb, n, 1)),
                           f.resp_ids[:, :, :tr - 1]], axis=2)
    seg_plen = f.prompt_lengths - 1
    chunk = state.prefill_chunk
    if context_kv is None and chunks_prefill(state, tp):
        _, *context_kv = prefill_chunks(params, state.config, f.prompt_ids, seg_plen,
                                        chunk=chunk, attn_impl=state.attn_impl)
    if context_kv is None:
        kp, vp, kr, vr = prefill_segments(params, state.config, f.prompt_ids, seg_plen, ctx,
                                          f.num_generated, attn_impl=state.attn_impl)
    else:  # the prompt in chunks; the responses read its cache block by block
        kp, vp = (x[:, :, :tp] for x in context_kv)
        kr, vr = segments_from_prompt_kv(params, state.config, kp, vp, seg_plen, ctx,
                                         f.num_generated, chunk=min(chunk, tp),
                                         attn_impl=state.attn_impl)
    gs, dt = f.group_slot, cache.k_prompt.dtype
    cache = cache.replace(
        # The only place segments are replaced: [0, Tp) of the prompt, [0, Tr) of responses.
        k_prompt=cache.k_prompt.at[:, gs, :tp].set(kp.astype(dt), mode="drop"),
        v_prompt=cache.v_prompt.at[:, gs, :tp].set(vp.astype(dt), mode="drop"),
        k_resp=cache.k_resp.at[:, gs, :, :tr].set(kr.astype(dt), mode="drop"),
        v_resp=cache.v_resp.at[:, gs, :, :tr].set(vr.astype(dt), mode="drop"),
        prompt_lengths=cache.prompt_lengths.at[gs].set(seg_plen, mode="drop"),
        resp_lengths=cache.resp_lengths.at[gs].set(f.num_generated, mode="drop"))
    prev = jnp.take_along_axis(f.resp_ids, jnp.maximum(f.num_generated - 1, 0)[..., None],
                               axis=2)[..., 0]
    pending = jnp.where(f.num_generated == 0, last[:, None], prev)
    m = gb * n
    slot = (gs[:, None] * n + jnp.arange(n)[None, :]).reshape(m)
    plen = jnp.repeat(f.prompt_lengths, n)
    prompt = jnp.repeat(f.prompt_ids[:, :min(tp, state.max_prompt_len)], n, axis=0)
    n_gen = f.num_generated.reshape(m)
    resp = _pad_cols(f.resp_ids.reshape(m, tr), state.max_new_tokens, n_gen)

    def flat(x):
        return x.reshape((m,) + x.shape[2:])

    return _load_slots(state, cache, slot, _pad_cols(prompt, state.max_prompt_len, plen), plen,
                       resp, n_gen, pending.reshape(m), flat(f.keys), flat(f.budget),
                       flat(f.logprobs), flat(f.versions), flat(f.done), flat(f.stopped))


def fill_impl(params: Params, state: SamplerState, fill: ReplicatedFill | SegmentedFill,
              context_kv: tuple[jax.Array, jax.Array] | None = None) -> SamplerState:
    """Pure body of a fill (prefill of new groups or reload of partial samples): run the
    contexts through the model and load them into their slots. `fill` must match the
    state's layout (SegmentedFill for "segmented"). Contexts wider than the state's
    prefill_chunk run in chunks (`chunks_prefill`; a lax.scan, bounded memory), others in
    one shot. context_kv (optional): the (k, v) [layers, rows, >= T, kv_heads, head_dim]
    of `fill_context(fill)`, already prefilled (the host loop of `rl.rollout.sampler`,
    which shows progress); they are then not recomputed. Not jitted: wrap it with jax.jit
    (and shardings) as `prefill` / `load_samples` do."""
    if isinstance(fill, SegmentedFill) != (state.kv_layout == "segmented"):
        raise ValueError(f"a {type(fill).__name__} cannot fill a {state.kv_layout!r} state")
    if isinstance(fill, SegmentedFill):
        return _fill_segmented(params, state, fill, context_kv)
    return _fill_replicated(params, state, fill, context_kv)


def decode_one(params: Params, st: SamplerState, version: jax.Array,
               kv_bound: int | None = None) -> tuple[SamplerState, jax.Array]:
    """One decode step of every live slot (the body of `decode_segment_impl`): feed its
    pending token, draw the next from the logits with key fold_in(keys[s], t), stamp
    `version`, stop on a stop id or the budget. Returns (state, logits [S, vocab] float32
    of this step; done slots' rows are throw-away). Not jitted."""
    s, r_max = st.response_ids.shape
    rows = jnp.arange(s)
    live = ~st.done
    logits, cache = decode_jit(params, st.pending, st.cache, config=st.config,
                                attn_impl=st.attn_impl, kv_bound=kv_bound,
                                layer_loop=st.layer_loop)
    # Done slots computed a throw-away step: keep their cache length (the write they
    # made lies past it, or is dropped, and is never read).
    cache = kvc.keep_lengths_where(cache, st.cache, live)
    keys = jax.vmap(jax.random.fold_in)(st.keys, st.num_generated)
    tok, logp = sample_tokens(logits, keys, st.sampling)
    col = jnp.where(live, st.num_generated, r_max)  # r_max: out of range, dropped
    n = st.num_generated + live.astype(jnp.int32)
    hit = live & (tok[:, None] == st.stop_ids[None, :]).any(axis=-1)
    st = st.replace(
        cache=cache,
        pending=jnp.where(live, tok, st.pending),
        response_ids=st.response_ids.at[rows, col].set(tok, mode="drop"),
        logprobs=st.logprobs.at[rows, col].set(logp, mode="drop"),
        versions=st.versions.at[rows, col].set(version, mode="drop"),
        num_generated=n,
        done=st.done | hit | (live & (n >= st.budget)),
        stopped=st.stopped | hit,
    )
    return st, logits


def decode_segment_impl(params: Params, state: SamplerState, num_tokens: jax.Array,
                        version: jax.Array, kv_bound: int | None = None) -> SamplerState:
    """Pure body of `decode_segment`: up to num_tokens decode steps in one while_loop;
    stops early when all slots are done. num_tokens, version: int32 scalars. kv_bound
    (static): None runs the masked decode over every allocated cache slot (the exact
    slow twin); an int runs the bounded decode, which reads only the first kv_bound slots
    of each cache row / response segment, so the caller must keep every live slot's cache
    length below kv_bound for all num_tokens steps (`rl.rollout.sampler.decode_segment`
    plans that). Not jitted."""
    def cond(carry):
        i, st = carry
        return (i < num_tokens) & jnp.any(~st.done)

    def body(carry):
        i, st = carry
        return i + 1, decode_one(params, st, version, kv_bound)[0]

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


@jax.jit
def pending_hidden(params: Params, state: SamplerState) -> jax.Array:
    """[S, E] float32: the final-normed hidden state at each slot's pending token (its
    last sampled token, or the prompt's last token before any), i.e. the state the next
    decode step's logits are read from. One decode forward over the cache as it is; its
    cache write is discarded, so the state is untouched (done slots give throw-away rows)."""
    positions, mask, start, kv = kvc.decode_inputs(state.cache, None)
    h, _ = Decoder(state.config, "decode", state.attn_impl, return_hidden=True).apply(
        {"params": params}, state.pending[:, None], positions, mask, start, kv)
    return h[:, 0].astype(jnp.float32)


fill_jit = jax.jit(fill_impl)
decode_segment_jit = jax.jit(decode_segment_impl, static_argnames="kv_bound")
# The same, consuming its input state (in place): for the later chunks of one
# `decode_segment` call, whose input is an intermediate state nobody else holds.
decode_segment_donated_jit = jax.jit(decode_segment_impl, static_argnames="kv_bound",
                                     donate_argnums=1)


