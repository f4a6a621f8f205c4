"""Rollout trees in the sampler: a live sample forks into children that continue its prefix.

A tree rollout decodes one token at a time and lets the host decide, between steps, which
token each live slot keeps and which slots fork (a rollout strategy such as
`rl.rollout.latr`). The device side is four jitted pieces over the segmented state
(`rl.rollout.sampler`; a group's N slots are one aligned block sharing its prompt segment):

    tree_decode_step(params, state, version, kv_bound) -> (state, TreeCandidates)
        one decode step of every live slot, exactly the sampler's (`decode_one`: the slot's
        key fold_in(keys[s], t), the same draw, the same stop rules), plus the top-m
        candidates of the step's distribution: ids [S, m], their untempered probabilities
        softmax(z)[c] (what a branching rule reads) and tempered log-probs
        log softmax(z / T)[c] (the behaviour log-prob a chosen candidate is stamped with).
    rewrite_tokens(state, slots, tokens, logprobs)
        replace the token a slot drew at its last step by another (a candidate the strategy
        chose instead): response id, behaviour log-prob, pending token, stop / budget.
    fork_slots(state, parents, children, tokens, logprobs)
        child := parent (its response ids, log-probs, versions, length, budget and the keys
        / values of its response so far), then its last token replaced by `tokens`. Parent
        and child are slots of one block (one group). The child keeps its own rng key, so
        after the fork it samples its own stream.
    retire_slots(state, slots)
        mark slots done (a pruned branch, a slot the tree does not use yet).

How a child gets the parent's keys, two ways with the same tokens:

  * shared (`share_prefixes(state)` first, what `rl.rollout.latr` runs): the cache holds a
    tree of segments (`models.kv_cache.ResponseTree`). The child reads the prefix from the
    segments that wrote it: the parent's own entries from the parent's fork up to the
    fork, and whatever the parent read from its own ancestors. Nothing is copied, and the
    child writes its own keys from the fork on. Decode attention over the tree is
    `kernels.segment_decode.tree_decode_attention` (reference, XLA, and a Triton kernel
    for attn_impl "pallas"; no Mosaic twin, so "pallas_mosaic" is refused).
  * copied (the default state, the slow twin): the fork copies the parent's response
    segment into the child's, and decode is the plain segment decode.

The prompt segment is shared either way, and the prefix is decoded once: the child starts
at the fork instead of recomputing it. A slot's segment may be overwritten only once no
live slot reads it, so a strategy that frees a slot must retire every slot forked from it
too (LATR's pruning takes a branch's descendants along).

Token-for-token twin: a tree rollout that never rewrites and never forks is the sampler's
own decode, one token per call (tests/rl/test_tree_sampler.py checks it against
`rl.rollout.generate`, and the shared tree against the copied one).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models import kv_cache as kvc
from rl.rollout.sampler_core import decode_one
from rl.rollout.sampler_state import SamplerState, bucket

Params = Any


@struct.dataclass
class TreeCandidates:
    """The top-m tokens of one decode step per slot: ids [S, m] int32 (most likely first),
    probs [S, m] float32 under softmax(logits) (untempered), logprobs [S, m] float32 under
    the sampling distribution log softmax(logits / T); token [S] / logprob [S]: what the
    sampler drew this step (for done slots: throw-away)."""

    ids: jax.Array
    probs: jax.Array
    logprobs: jax.Array
    token: jax.Array
    logprob: jax.Array


def top_candidates(probs: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(values [S, m], ids [S, m]) of each row's m largest probabilities, largest first,
    ties to the lower id (as lax.top_k). m argmax passes instead of lax.top_k: inside a
    while_loop (`rl.rollout.latr`'s device steps) XLA:CPU ran top_k over SmolLM2's 49,152
    ids ~80 ms a step slower than at the top level; m is LATR's 2-3 candidates."""
    cols = jnp.arange(probs.shape[-1])[None, :]
    values, ids = [], []
    for _ in range(m):
        i = jnp.argmax(probs, axis=-1)
        values.append(jnp.take_along_axis(probs, i[:, None], axis=-1)[:, 0])
        ids.append(i)
        probs = jnp.where(cols == i[:, None], -jnp.inf, probs)
    return jnp.stack(values, axis=-1), jnp.stack(ids, axis=-1)


def decode_candidates(params: Params, state: SamplerState, version: jax.Array, *,
                      kv_bound: int | None, top_m: int) -> tuple[SamplerState, TreeCandidates]:
    """The pure body of `tree_decode_step` (not jitted: for device loops over it)."""
    before = state.num_generated
    state, logits = decode_one(params, state, version, kv_bound)
    z = logits.astype(jnp.float32)
    probs, ids = top_candidates(jax.nn.softmax(z, axis=-1), top_m)
    temp = 1.0 if state.sampling.greedy else state.sampling.temperature
    logz = jax.nn.log_softmax(z / temp, axis=-1)
    rows = jnp.arange(state.num_slots)
    col = jnp.clip(before, 0, state.max_new_tokens - 1)
    return state, TreeCandidates(
        ids=ids.astype(jnp.int32), probs=probs,
        logprobs=jnp.take_along_axis(logz, ids, axis=-1),
        token=state.response_ids[rows, col], logprob=state.logprobs[rows, col])


_tree_decode_step_jit = jax.jit(decode_candidates, static_argnames=("kv_bound", "top_m"))


def tree_decode_step(params: Params, state: SamplerState, version: int, *, top_m: int = 2,
                     kv_bound: int | None = None) -> tuple[SamplerState, TreeCandidates]:
    """One decode step of every live slot plus its top-m candidates (module doc). kv_bound:
    the bounded decode's static bound (every live slot's response length must stay below
    it; `rl.rollout.sampler.kv_bucket` picks one), None for the masked decode."""
    if state.kv_layout != "segmented":
        raise ValueError("tree rollouts fork inside a group's block: they need "
                         "kv_layout='segmented'")
    if not 1 <= top_m <= state.config.vocab_size:
        raise ValueError(f"top_m must be in [1, vocab_size={state.config.vocab_size}], got {top_m}")
    return _tree_decode_step_jit(params, state, np.int32(version), kv_bound=kv_bound,
                                 top_m=int(top_m))


def _padded(idx: np.ndarray, fill: int, size: int) -> np.ndarray:
    """idx padded to a power-of-two bucket with `fill` (an out-of-range slot: dropped)."""
    out = np.full((bucket(idx.size, size, floor=1),), fill, idx.dtype)
    out[:idx.size] = idx
    return out


def set_last_tokens(st: SamplerState, slots, tokens, logprobs) -> SamplerState:
    """Slots' last response token (index num_generated - 1) := tokens, with log-probs,
    pending token, stop and budget redone; slots >= S are dropped. Pure, not jitted."""
    s = st.num_slots
    safe = jnp.minimum(slots, s - 1)
    col = jnp.where(slots < s, st.num_generated[safe] - 1, st.max_new_tokens)
    hit = (tokens[:, None] == st.stop_ids[None, :]).any(axis=-1)
    n = st.num_generated[safe]
    return st.replace(
        response_ids=st.response_ids.at[slots, col].set(tokens, mode="drop"),
        logprobs=st.logprobs.at[slots, col].set(logprobs, mode="drop"),
        pending=st.pending.at[slots].set(tokens, mode="drop"),
        stopped=st.stopped.at[slots].set(hit, mode="drop"),
        done=st.done.at[slots].set(hit | (n >= st.budget[safe]), mode="drop"))


@jax.jit
def _rewrite_jit(st: SamplerState, slots, tokens, logprobs) -> SamplerState:
    return set_last_tokens(st, slots, tokens, logprobs)


def _check(slots: np.ndarray, state: SamplerState, what: str) -> np.ndarray:
    slots = np.asarray(slots, np.int32).reshape(-1)
    if slots.size and (slots.min() < 0 or slots.max() >= state.num_slots):
        raise ValueError(f"{what}: slots must be in [0, {state.num_slots}), got {slots.tolist()}")
    if len(set(slots.tolist())) != slots.size:
        raise ValueError(f"{what}: slots must be distinct, got {slots.tolist()}")
    return slots


def rewrite_tokens(state: SamplerState, slots, tokens, logprobs) -> SamplerState:
    """Replace the last drawn token of `slots` (each has drawn at least one) by `tokens`
    with behaviour log-probs `logprobs` (module doc)."""
    slots = _check(slots, state, "rewrite_tokens")
    if not slots.size:
        return state
    s = state.num_slots
    return _rewrite_jit(state, _padded(slots, s, s),
                        _padded(np.asarray(tokens, np.int32).reshape(-1), 0, s),
                        _padded(np.asarray(logprobs, np.float32).reshape(-1), 0, s))


def share_prefixes(state: SamplerState) -> SamplerState:
    """`state` with a tree of segments in its cache (no sample shares anything yet): from
    now on `fork_slots` lets a child read its parent's keys in place instead of copying
    them (module doc). Call it after prefill."""
    if state.kv_layout != "segmented":
        raise ValueError("tree rollouts fork inside a group's block: they need "
                         "kv_layout='segmented'")
    if state.attn_impl == "pallas_mosaic":
        raise ValueError("share_prefixes: attn_impl='pallas_mosaic' has no tree-of-segments "
                         "kernel (no Mosaic twin yet); use attn_impl None / 'xla' (the XLA "
                         "tree path), 'pallas' (Triton), or fork by copy (do not call "
                         "share_prefixes)")
    cache = state.cache
    return state.replace(cache=cache.replace(tree=kvc.no_forks(cache.groups, cache.group_size)))


def _fork_keys(cache: kvc.SegmentedKVCache, g, i, gc, j) -> kvc.SegmentedKVCache:
    """The child (gc, j) gets the parent (g, i)'s keys up to its length: copied into its
    segment, or (a tree cache) read in place: the child reads what the parent reads, the
    parent's own entries up to the fork, and its own segment from the fork on."""
    fork = cache.resp_lengths[g, i]  # [F]: the parent's length = the child's first own entry
    lengths = cache.resp_lengths.at[gc, j].set(fork, mode="drop")
    if cache.tree is None:
        def copy(x):  # x [layers, groups, N, R, kv_heads, head_dim]
            return x.at[:, gc, j].set(x[:, g, i], mode="drop")

        return cache.replace(k_resp=copy(cache.k_resp), v_resp=copy(cache.v_resp),
                             resp_lengths=lengths)
    lo, hi = cache.tree.lo[g, i], cache.tree.hi[g, i]  # [F, N]: the parent's row
    col = jnp.arange(cache.group_size)[None, :]
    hi = jnp.where(col == i[:, None], fork[:, None], hi)  # the parent's own span ends here
    lo = jnp.where(col == j[:, None], fork[:, None], lo)  # the child's own entries begin here
    hi = jnp.where(col == j[:, None], 0, hi)
    tree = kvc.ResponseTree(lo=cache.tree.lo.at[gc, j].set(lo, mode="drop"),
                            hi=cache.tree.hi.at[gc, j].set(hi, mode="drop"))
    return cache.replace(tree=tree, resp_lengths=lengths)


@jax.jit
def _fork_jit(st: SamplerState, parents, children, tokens, logprobs) -> SamplerState:
    s, n = st.num_slots, st.cache.group_size
    safe = jnp.minimum(parents, s - 1)
    g, i, j = safe // n, safe % n, jnp.minimum(children, s - 1) % n
    # children >= S (padding) are dropped by the scatters (their group index is out of range)
    gc = jnp.where(children < s, g, st.cache.groups)
    cache = _fork_keys(st.cache, g, i, gc, j)

    def put(field):
        x = getattr(st, field)
        return x.at[children].set(x[safe], mode="drop")

    st = st.replace(cache=cache, **{f: put(f) for f in (
        "pending", "response_ids", "logprobs", "versions", "num_generated", "budget")},
        done=st.done.at[children].set(False, mode="drop"),
        stopped=st.stopped.at[children].set(False, mode="drop"))
    return set_last_tokens(st, children, tokens, logprobs)


def fork_slots(state: SamplerState, parents, children, tokens, logprobs) -> SamplerState:
    """Fork `parents` into `children` (same group block each; the parents have drawn at
    least one token this rollout): the child continues the parent's prefix with its last
    token replaced by `tokens` (module doc). A child may not be a parent of the same call."""
    parents = np.asarray(parents, np.int32).reshape(-1)
    children = _check(children, state, "fork_slots")
    if parents.size != children.size:
        raise ValueError(f"fork_slots: {parents.size} parents for {children.size} children")
    if not children.size:
        return state
    n = state.group_size
    if (parents // n != children // n).any():
        raise ValueError("fork_slots: a child must be a slot of its parent's group block "
                         f"(blocks of {n}); parents {parents.tolist()}, children {children.tolist()}")
    if set(parents.tolist()) & set(children.tolist()):
        raise ValueError("fork_slots: a slot cannot be a parent and a child in one call")
    s = state.num_slots
    return _fork_jit(state, _padded(parents, 0, s), _padded(children, s, s),
                     _padded(np.asarray(tokens, np.int32).reshape(-1), 0, s),
                     _padded(np.asarray(logprobs, np.float32).reshape(-1), 0, s))


@jax.jit
def _retire_jit(st: SamplerState, slots) -> SamplerState:
    return st.replace(done=st.done.at[slots].set(True, mode="drop"))


def retire_slots(state: SamplerState, slots) -> SamplerState:
    """Mark `slots` done (they decode no further; their contents are left as they are)."""
    slots = _check(slots, state, "retire_slots")
    if not slots.size:
        return state
    return _retire_jit(state, _padded(slots, state.num_slots, state.num_slots))
