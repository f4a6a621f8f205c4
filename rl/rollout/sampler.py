"""The sampler: fixed-slot `SamplerState`, jitted prefill and segment decoding.

A state has S slots; each slot holds one sample (one response to one prompt) with its KV
cache rows, the token to feed next, its response so far, the behaviour log-prob and the
policy version of every response token, a token budget, and its own rng key.

KV layouts (`kv_layout`, fixed when the state is made):

  * "segmented" (the default when the group size N is known): slots are organised as
    [groups, N] (slot s = sample s % N of group-slot s // N) and the cache is a
    models.kv_cache.SegmentedKVCache: each group's prompt keys/values are stored ONCE and
    read once per decode step for all N samples (kernels.segment_decode); each sample
    owns a response segment. A group occupies one aligned block of N slots.
  * "replicated": a dense KVCache row per slot holding prompt + response, the prompt
    copied N times (the comparison baseline; any slots may form a group).
Both layouts draw the same tokens from the same keys (the logits agree to float rounding).

How a slot runs. Its *context* (prompt, plus the partial response when a sample is
resumed) is prefilled except for the last token, which is left `pending`. In the
segmented layout the prompt segment holds prompt[:-1] and the response segment
[prompt[-1], r_0, ...]: a resumed group's prompt runs once and each sample's partial
response is teacher-forced behind it in the same packed forward
(models.decoder.prefill_segments), so resuming is exact and costs P + sum(n_i) tokens. Each decode
step feeds the pending token through the model (`models.decoder.decode_jit`, the one
model code path), samples the next token from the resulting logits and makes it pending.
So every token is drawn inside `decode_segment`, from logits computed with the params
passed to that call, and stamped with that call's `version`.

RNG. Slot s draws its t-th response token with key `fold_in(keys[s], t)`: the stream
depends only on the sample's key and the token index, never on how decoding is cut into
segments or which slot the sample occupies, so an extracted sample resumed later (same
key, same t) continues the same stream.

Behaviour log-probs (what the learner needs as log μ):

  * sampling with temperature T > 0: log_softmax(logits / T)[token];
  * greedy: log_softmax(logits)[argmax] (the T = 1 distribution; greedy itself is the
    T -> 0 limit, whose log-prob would be 0);
  * top-k / top-p: the token is drawn from the truncated, renormalised distribution and
    its log-prob under *that* distribution is recorded, because that is the policy that
    acted. The learner's π is untruncated, so π / μ is biased for RL (tokens outside the
    nucleus have μ = 0); a warning says so once.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.chunked_prefill import prefill_chunks_host
from models.config import ModelConfig
from rl.rollout.sampler_core import (
    ReplicatedFill,
    SegmentedFill,
    chunks_prefill,
    decode_segment_donated_jit,
    decode_segment_jit,
    fill_context,
    fill_jit,
)
from rl.rollout.sampler_state import (
    SamplerState,
    SamplingConfig,
    bucket,
    new_state,
    positive_int,
    sample_keys,
)

Params = Any


# ----------------------------------------------------------------------------- host wrappers
def bucket_width(n: int, limit: int) -> int:
    """Prefill width: n rounded up to a multiple of 8, or to 4 steps per octave beyond 64
    (<= 25% padding, few shapes), capped at `limit`."""
    step = max(8, 1 << max(0, n.bit_length() - 3))
    return min(limit, -(-n // step) * step)


def _check_tokens(name: str, ids: Sequence[int], config: ModelConfig) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a flat sequence of int token ids, got {arr.dtype} shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= config.vocab_size):
        raise ValueError(f"{name} has token ids outside the vocabulary [0, {config.vocab_size})")
    return arr.astype(np.int32)


def check_prompt(prompt: Sequence[int], max_prompt_len: int, config: ModelConfig,
                 name: str = "prompt") -> np.ndarray:
    """A prompt as int32 [P]; ValueError if empty, longer than max_prompt_len, or out of vocab."""
    arr = _check_tokens(name, prompt, config)
    if arr.size == 0:
        raise ValueError(f"{name} is empty; every prompt needs at least one token")
    if arr.size > max_prompt_len:
        raise ValueError(
            f"{name} has {arr.size} tokens, longer than the cache's max_prompt_len={max_prompt_len}; "
            "raise max_prompt_len or truncate the prompt")
    return arr


def _check_slots(slots: np.ndarray, num_slots: int) -> None:
    if slots.size and (slots.min() < 0 or slots.max() >= num_slots):
        raise ValueError(f"slots must be in [0, num_slots={num_slots}), got range "
                         f"[{slots.min()}, {slots.max()}]")
    if len(np.unique(slots)) != slots.size:
        raise ValueError(f"slots must be distinct, got {slots.tolist()}")


def _budgets(max_new_tokens: int | None, n: int, state: SamplerState) -> np.ndarray:
    b = state.max_new_tokens if max_new_tokens is None else positive_int("max_new_tokens", max_new_tokens)
    if b > state.max_new_tokens:
        raise ValueError(f"max_new_tokens={b} exceeds the state's max_new_tokens={state.max_new_tokens}")
    return np.full((n,), b, np.int32)


_FILL_SAMPLING = SamplingConfig()


def _run_fill(params, state: SamplerState, fill: ReplicatedFill | SegmentedFill,
              progress: Callable[[int, int, int], Any] | None = None) -> SamplerState:
    context_kv = None
    tokens, lengths = fill_context(fill)
    if progress is not None and chunks_prefill(state, tokens.shape[1]):
        # The chunked prefill as a host loop (one jitted chunk step per chunk) so that
        # progress can be reported; the jitted fill then loads its result.
        c = state.config
        shape = (c.num_layers,) + tokens.shape + (c.num_kv_heads, c.head_dim)
        _, *context_kv = prefill_chunks_host(
            params, c, tokens, lengths, jnp.zeros(shape, c.dtype), jnp.zeros(shape, c.dtype),
            chunk=state.prefill_chunk, attn_impl=state.attn_impl, on_chunk=progress)
    # The fill does not depend on the sampling config: compile it once per geometry.
    out = fill_jit(params, state.replace(sampling=_FILL_SAMPLING), fill, context_kv)
    return out.replace(sampling=state.sampling)


def _fill_groups(params, state: SamplerState, prompts: list[np.ndarray], group_slot: list[int],
                 responses: list[list[np.ndarray]], keys: np.ndarray, budget: np.ndarray,
                 logprobs: np.ndarray, versions: np.ndarray, done: np.ndarray,
                 stopped: np.ndarray, progress=None) -> SamplerState:
    """Segmented layout: pad G groups (responses[g][i] = partial response of the sample
    going to slot group_slot[g] * N + i; per-sample arrays [G, N, ...]) to buckets and
    call the jitted fill."""
    n, n_groups = state.group_size, state.cache.groups
    g = len(prompts)
    gb = bucket(g, n_groups)
    tp = bucket_width(max(p.size for p in prompts), state.max_prompt_len)
    longest = max(r.size for rs in responses for r in rs)
    tr = 1 if longest == 0 else bucket_width(longest, state.max_new_tokens)
    prompt_ids = np.zeros((gb, tp), np.int32)
    prompt_lengths = np.ones((gb,), np.int32)
    resp_ids = np.zeros((gb, n, tr), np.int32)
    n_gen = np.zeros((gb, n), np.int32)
    for i, (p, rs) in enumerate(zip(prompts, responses)):
        prompt_ids[i, :p.size], prompt_lengths[i] = p, p.size
        for j, r in enumerate(rs):
            resp_ids[i, j, :r.size], n_gen[i, j] = r, r.size

    def pad(x, fill):
        out = np.full((gb,) + x.shape[1:], fill, x.dtype)
        out[:g] = x
        return out

    return _run_fill(params, state, SegmentedFill(
        prompt_ids=prompt_ids, prompt_lengths=prompt_lengths, resp_ids=resp_ids,
        num_generated=n_gen, group_slot=pad(np.asarray(group_slot, np.int32), n_groups),
        keys=pad(keys.astype(np.uint32), 0), budget=pad(budget.astype(np.int32), 1),
        logprobs=pad(logprobs.astype(np.float32), 0), versions=pad(versions.astype(np.int32), -1),
        done=pad(done.astype(bool), True), stopped=pad(stopped.astype(bool), False)), progress)


def _group_blocks(slots: np.ndarray, n: int, what: str) -> np.ndarray:
    """Segmented layout: the group-slot of each row of slots [G, N], which must be one
    aligned block b*N .. b*N + N-1 (in any order)."""
    blocks = slots // n
    bad = [g for g in range(slots.shape[0]) if (blocks[g] != blocks[g, 0]).any()]
    if bad:
        raise ValueError(
            f"{what}: with kv_layout='segmented' a group's N={n} slots must be one aligned "
            f"block b*N .. b*N+N-1 (they share one prompt segment); group {bad[0]} has slots "
            f"{slots[bad[0]].tolist()}")
    return blocks[:, 0]


def _fill(params, state: SamplerState, contexts: list[np.ndarray], prompt_lengths: np.ndarray,
          row: np.ndarray, slot: np.ndarray, keys: np.ndarray, budget: np.ndarray,
          logprobs: np.ndarray, versions: np.ndarray, done: np.ndarray, stopped: np.ndarray,
          progress=None) -> SamplerState:
    """Replicated layout: pad rows / entries / context width to buckets and call the
    jitted fill."""
    s = state.num_slots
    n_rows, n_ent = len(contexts), row.size
    # Entries are padded to S and rows/width to coarse buckets: few compiled shapes, at the
    # price of prefilling some padding rows (cheap next to the decode).
    rows_b = bucket(n_rows, s)
    ent_b = s
    t = bucket_width(max(c.size for c in contexts), state.cache.max_len)
    ctx = np.zeros((rows_b, t), np.int32)
    clen = np.ones((rows_b,), np.int32)
    plen = np.ones((rows_b,), np.int32)
    for i, c in enumerate(contexts):
        ctx[i, :c.size], clen[i], plen[i] = c, c.size, prompt_lengths[i]

    def pad(x, fill):
        out = np.full((ent_b,) + x.shape[1:], fill, x.dtype)
        out[:n_ent] = x
        return out

    return _run_fill(params, state, ReplicatedFill(
        ctx_ids=ctx, ctx_lengths=clen, prompt_lengths=plen, slot=pad(slot.astype(np.int32), s),
        row=pad(row.astype(np.int32), 0), keys=pad(keys.astype(np.uint32), 0),
        budget=pad(budget.astype(np.int32), 1), logprobs=pad(logprobs.astype(np.float32), 0),
        versions=pad(versions.astype(np.int32), -1), done=pad(done.astype(bool), True),
        stopped=pad(stopped.astype(bool), False)), progress)


def prefill(
    params: Params,
    state: SamplerState,
    prompts: Sequence[Sequence[int]],
    slots: Any,
    keys: Any,
    *,
    max_new_tokens: int | None = None,
    progress: Callable[[int, int, int], Any] | None = None,
) -> SamplerState:
    """Start G groups: prompts (G token lists) are prefilled once each. Segmented layout:
    the prompt KV is written once into the group's prompt segment, and slots[g] must be
    one aligned block of the state's group_size slots (any order); replicated: it is
    copied into the N slots of the group. slots [G, N] int (distinct); keys [G, N, 2]
    uint32 (see `sample_keys`; keys[g, i] goes with slot slots[g, i]); max_new_tokens
    (default: the state's) is each sample's budget. The slots' previous contents are
    discarded. Prompts longer than the state's prefill_chunk prefill in chunks (bounded
    memory); progress(i, n, tokens), if given, is then called after chunk i of n (1-based)
    with the prompt positions it covered (e.g. a tqdm bar's update)."""
    config = state.config
    if len(prompts) == 0:
        return state
    slots = np.asarray(slots)
    if slots.ndim != 2 or slots.shape[0] != len(prompts):
        raise ValueError(f"slots must be [G={len(prompts)}, N], got shape {slots.shape}")
    g, n = slots.shape
    if n < 1:
        raise ValueError("group size N (slots.shape[1]) must be >= 1")
    _check_slots(slots.reshape(-1), state.num_slots)
    keys = np.asarray(keys)
    if keys.shape != (g, n, 2):
        raise ValueError(f"keys must be [G, N, 2] = {(g, n, 2)} uint32, got shape {keys.shape}")
    ctx = [check_prompt(p, state.max_prompt_len, config, f"prompts[{i}]") for i, p in enumerate(prompts)]
    m, r_max = g * n, state.max_new_tokens
    if state.kv_layout == "segmented":
        if n != state.group_size:
            raise ValueError(f"slots has groups of N={n} but the state's segmented cache holds "
                             f"groups of group_size={state.group_size}")
        blocks = _group_blocks(slots, n, "prefill")
        order = np.argsort(slots % n, axis=1)  # sample i of group g -> member slots[g, i] % N
        member_keys = np.take_along_axis(keys, order[:, :, None], axis=1)
        return _fill_groups(params, state, ctx, blocks.tolist(),
                            [[np.zeros((0,), np.int32)] * n] * g, member_keys,
                            _budgets(max_new_tokens, m, state).reshape(g, n),
                            np.zeros((g, n, r_max), np.float32), np.full((g, n, r_max), -1, np.int32),
                            np.zeros((g, n), bool), np.zeros((g, n), bool), progress)
    return _fill(params, state, ctx, np.array([c.size for c in ctx]), np.repeat(np.arange(g), n),
                 slots.reshape(-1), keys.reshape(m, 2), _budgets(max_new_tokens, m, state),
                 np.zeros((m, r_max), np.float32), np.full((m, r_max), -1, np.int32),
                 np.zeros((m,), bool), np.zeros((m,), bool), progress)


@dataclasses.dataclass(frozen=True)
class PartialSample:
    """One sample read out of a slot (host numpy). response_ids/logprobs/versions [n]
    are what it has produced so far; key [2] uint32 with position n is its rng stream;
    budget is its total response budget (so budget - n tokens remain)."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    key: np.ndarray
    budget: int
    done: bool
    stopped: bool

    @property
    def num_generated(self) -> int:
        return int(self.response_ids.size)


_SLOT_FIELDS = ("prompt_ids", "prompt_lengths", "response_ids", "logprobs", "versions",
                "num_generated", "budget", "done", "stopped", "keys")


@jax.jit
def _gather_slots(fields: dict, idx: jax.Array) -> dict:
    return {f: x[idx] for f, x in fields.items()}


def read_slots(state: SamplerState, slots: Sequence[int]) -> list[PartialSample]:
    """Copy the given slots to the host (one transfer)."""
    idx = np.asarray(slots, np.int32).reshape(-1)
    _check_slots(idx, state.num_slots)
    if not idx.size:
        return []  # no launch, no transfer
    # One compiled gather for every field (one dispatch, not one per field and index op),
    # the index padded to a power of two so that few sizes compile.
    padded = np.zeros((bucket(idx.size, state.num_slots, floor=1),), np.int32)
    padded[:idx.size] = idx
    host = jax.device_get(_gather_slots({f: getattr(state, f) for f in _SLOT_FIELDS}, padded))
    out = []
    for i in range(idx.size):
        n, p = int(host["num_generated"][i]), int(host["prompt_lengths"][i])
        out.append(PartialSample(
            prompt_ids=host["prompt_ids"][i, :p].copy(), response_ids=host["response_ids"][i, :n].copy(),
            logprobs=host["logprobs"][i, :n].copy(), versions=host["versions"][i, :n].copy(),
            key=host["keys"][i].copy(), budget=int(host["budget"][i]),
            done=bool(host["done"][i]), stopped=bool(host["stopped"][i])))
    return out


def load_samples(params: Params, state: SamplerState, samples: Sequence[PartialSample],
                 slots: Sequence[int]) -> SamplerState:
    """Put samples (e.g. from `read_slots`) back into `slots`. Each one's KV is rebuilt by
    prefilling prompt + partial response with `params`; its tokens, log-probs, versions,
    key and budget are kept, so decoding continues where it stopped. Segmented layout:
    `slots` must cover whole aligned blocks of group_size slots and the samples of one
    block must share their prompt; the prompt then runs once per block and each sample's
    partial response is teacher-forced into its response segment."""
    config = state.config
    slots = np.asarray(slots, np.int32).reshape(-1)
    if slots.size != len(samples):
        raise ValueError(f"got {len(samples)} samples but {slots.size} slots")
    if not samples:
        return state
    _check_slots(slots, state.num_slots)
    r_max = state.max_new_tokens
    ctx, plen = [], []
    m = len(samples)
    logprobs = np.zeros((m, r_max), np.float32)
    versions = np.full((m, r_max), -1, np.int32)
    for i, smp in enumerate(samples):
        p = check_prompt(smp.prompt_ids, state.max_prompt_len, config, f"samples[{i}].prompt_ids")
        resp = _check_tokens(f"samples[{i}].response_ids", smp.response_ids, config)
        n = resp.size
        if not 1 <= smp.budget <= r_max or n > smp.budget:
            raise ValueError(f"samples[{i}]: budget {smp.budget} must be in [1, {r_max}] and >= "
                             f"its {n} generated tokens")
        if np.asarray(smp.logprobs).shape != (n,) or np.asarray(smp.versions).shape != (n,):
            raise ValueError(f"samples[{i}]: logprobs and versions must have shape ({n},)")
        ctx.append(np.concatenate([p, resp]))
        plen.append(p.size)
        logprobs[i, :n], versions[i, :n] = smp.logprobs, smp.versions
    keys = np.stack([np.asarray(s.key, np.uint32) for s in samples])
    budget = np.array([s.budget for s in samples])
    done = np.array([s.done for s in samples])
    stopped = np.array([s.stopped for s in samples])
    if state.kv_layout == "segmented":
        n = state.group_size
        blocks = sorted(set((slots // n).tolist()))
        where = {int(s): i for i, s in enumerate(slots)}  # slot -> sample index
        missing = [b for b in blocks if any(b * n + j not in where for j in range(n))]
        if missing:
            raise ValueError(
                f"load_samples: with kv_layout='segmented' samples fill whole aligned blocks of "
                f"group_size={n} slots (one group each); block {missing[0]} (slots "
                f"{missing[0] * n}..{missing[0] * n + n - 1}) is only partly covered by {slots.tolist()}")
        idx = np.array([[where[b * n + j] for j in range(n)] for b in blocks])  # [G, N]
        for row in idx:
            p0 = ctx[row[0]][:plen[row[0]]]
            if any(plen[i] != p0.size or (ctx[i][:p0.size] != p0).any() for i in row):
                raise ValueError(
                    f"load_samples: samples {row.tolist()} go to one block of the segmented "
                    "cache and must share their prompt (one group); their prompts differ")
        return _fill_groups(params, state, [ctx[r[0]][:plen[r[0]]] for r in idx], blocks,
                            [[ctx[i][plen[i]:] for i in r] for r in idx], keys[idx], budget[idx],
                            logprobs[idx], versions[idx], done[idx], stopped[idx])
    return _fill(params, state, ctx, np.asarray(plen), np.arange(m), slots, keys, budget,
                 logprobs, versions, done, stopped)


def kv_bucket(n: int, limit: int) -> int:
    """The bounded decode's static cache bound for a longest live length needing n slots:
    n rounded up to a multiple of 16 up to 64, beyond that to 3/4 or all of the next
    power of two (<= 50 % padding, ~2 compiled bounds per octave), capped at `limit`."""
    if n <= 64:
        return min(limit, max(16, -(-n // 16) * 16))
    p = 1 << (n - 1).bit_length()
    return min(limit, 3 * p // 4 if n <= 3 * p // 4 else p)


def plan_bounded_decode(longest: int, num_tokens: int, limit: int) -> list[tuple[int, int]]:
    """Split num_tokens decode steps into chunks (steps, kv_bound) so that during each
    chunk every live slot's cache length (at most `longest` before the call, + 1 per step)
    stays below the chunk's bound: a slot's new key goes to index length, the bounded
    attention reads indices < kv_bound. limit: the cache's allocated slots per row."""
    chunks, length, left = [], longest, num_tokens
    while left > 0 and length < limit:
        bound = kv_bucket(length + 1, limit)
        steps = min(left, bound - length)
        chunks.append((steps, bound))
        length, left = length + steps, left - steps
    return chunks


def decode_segment(params: Params, state: SamplerState, num_tokens: int, version: int, *,
                   bounded: bool = True) -> SamplerState:
    """Advance every live slot by at most num_tokens tokens (fewer if it hits a stop id or
    its budget), drawing from `params` and stamping `version` on each new token. Swapping
    params between calls is how new policy versions enter the rollout. num_tokens and
    version are traced, so changing them does not recompile.

    bounded=True (default): decode cost follows the tokens present. The host reads the
    longest live cache length (one small transfer) and runs the steps in chunks, each
    compiled for a static bound from a few buckets (`kv_bucket`): attention reads only the
    first bound slots of each cache row in place, and the new keys are written once per
    step after all layers. bounded=False: the masked decode over every allocated slot (the
    exact slow twin; same tokens and log-probs to float rounding, tested)."""
    num_tokens = positive_int("num_tokens", num_tokens)
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    # numpy scalars go in as arguments; jnp.int32(...) would be an eager op (a device
    # launch) of its own per call
    version = np.int32(version)
    if not bounded:
        return decode_segment_jit(params, state, np.int32(num_tokens), version)
    cache = state.cache
    if state.kv_layout == "segmented":
        lengths, limit = cache.resp_lengths, cache.resp_len
    else:
        lengths, limit = cache.lengths, cache.max_len
    lengths, done = jax.device_get((lengths, state.done))
    live = np.asarray(lengths).reshape(-1)[~np.asarray(done)]
    if live.size == 0:
        return state
    for i, (steps, bound) in enumerate(plan_bounded_decode(int(live.max()), num_tokens, limit)):
        # The first chunk keeps the caller's state intact; later ones consume our own.
        fn = decode_segment_jit if i == 0 else decode_segment_donated_jit
        state = fn(params, state, np.int32(steps), version, kv_bound=bound)
    return state


# ----------------------------------------------------------------------------- convenience
@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """tokens[i][j]: response token ids of sample j for prompt i (including the stop id if
    it ended on one); logprobs[i][j] float32 [len] behaviour log-probs; finished[i][j]:
    ended on a stop id (else it used all max_new_tokens)."""

    tokens: list[list[list[int]]]
    logprobs: list[list[np.ndarray]]
    finished: list[list[bool]]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for row in self.tokens for t in row)


def generate(
    params: Params,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_ids: Sequence[int] | None = None,
    rng: Any = 0,
    num_samples: int = 1,
    segment_len: int = 32,
    progress: Callable[[int], Any] | None = None,
    attn_impl: str | None = None,
    kv_layout: str = "segmented",
    layer_loop: str = "scan",
    bucket_slots: bool = False,
) -> GenerationResult:
    """Sample num_samples responses per prompt (one prefill per prompt) with the sampler.
    stop_ids default to config.eos_token_ids; rng is an int seed or a key. progress, if
    given, is called after every segment with the number of tokens that segment produced
    (e.g. a tqdm bar's `update`). kv_layout: "segmented" (each prompt's KV stored once for
    its num_samples samples) or "replicated" (the same tokens, prompt KV copied per sample).
    layer_loop ("scan" / "unrolled") and bucket_slots: see `rl.rollout.init_state`."""
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    n = positive_int("num_samples", num_samples)
    segment_len = positive_int("segment_len", segment_len)
    stop_ids = config.eos_token_ids if stop_ids is None else stop_ids
    g = len(prompts)
    # No truncation warning here: plain generation is not RL.
    state = new_state(config, num_slots=g * n, max_prompt_len=max(len(p) for p in prompts),
                       max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                       attn_impl=attn_impl, cache_dtype=None, group_size=n,
                       kv_layout=kv_layout, layer_loop=layer_loop, bucket_slots=bucket_slots)
    keys = sample_keys(rng, np.arange(g), n)
    state = prefill(params, state, prompts, np.arange(g * n).reshape(g, n), keys)
    produced = 0
    while not bool(jax.device_get(state.done).all()):
        state = decode_segment(params, state, segment_len, 0)
        total = int(jax.device_get(state.num_generated).sum())
        if progress is not None:
            progress(total - produced)
        produced = total
    samples = read_slots(state, range(g * n))
    return GenerationResult(
        tokens=[[samples[i * n + j].response_ids.tolist() for j in range(n)] for i in range(g)],
        logprobs=[[samples[i * n + j].logprobs for j in range(n)] for i in range(g)],
        finished=[[samples[i * n + j].stopped for j in range(n)] for i in range(g)],
    )
