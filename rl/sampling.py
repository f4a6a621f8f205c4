"""The sampler: fixed-slot `SamplerState`, jitted prefill and segment decoding.

A state has S slots; each slot holds one sample (one response to one prompt) with its KV
cache rows, the token to feed next, its response so far, the behaviour log-prob and the
policy version of every response token, a token budget, and its own rng key.

How a slot runs. Its *context* (prompt, plus the partial response when a sample is
resumed) is prefilled except for the last token, which is left `pending`. Each decode
step feeds the pending token through the model (`models.decoder._decode_jit`, the one
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
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig
from models.decoder import _decode_jit, _prefill_jit
from models.kv_cache import KVCache, init_cache

Params = Any


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn. greedy=True takes the argmax (temperature, top_k and
    top_p unused); otherwise softmax(logits / temperature), optionally truncated to the
    top_k most likely tokens and/or the smallest set with probability >= top_p (ties at
    the cut-off are kept)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self):
        if self.greedy:
            if self.top_k is not None or self.top_p != 1.0:
                raise ValueError("SamplingConfig: top_k/top_p have no effect with greedy=True; "
                                 "leave them at None/1.0")
            return
        if not self.temperature > 0:
            raise ValueError(
                f"SamplingConfig.temperature must be > 0 when sampling, got {self.temperature}; "
                "for argmax decoding set greedy=True")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"SamplingConfig.top_k must be an int >= 1 or None, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")

    @property
    def truncated(self) -> bool:
        """True if tokens come from a top-k/top-p truncated distribution."""
        return not self.greedy and (self.top_k is not None or self.top_p < 1.0)


_warned_truncated = False


def warn_if_truncated(sampling: SamplingConfig) -> None:
    """Warn (once per process) that truncated sampling makes μ differ from the learner's π."""
    global _warned_truncated
    if sampling.truncated and not _warned_truncated:
        _warned_truncated = True
        warnings.warn(
            "top-k/top-p sampling: behaviour log-probs are those of the truncated, renormalised "
            "distribution (the policy that acted). The learner's untruncated π differs from this "
            "μ, so importance ratios π/μ are biased; prefer plain temperature sampling for RL.",
            UserWarning, stacklevel=3)


# ----------------------------------------------------------------------------- state
@struct.dataclass
class SamplerState:
    """S fixed slots. cache: KVCache [layers, S, max_prompt_len + max_new_tokens, ...];
    pending [S] int32 (next token to feed); prompt_ids [S, P_max], prompt_lengths [S];
    response_ids [S, R_max], logprobs [S, R_max] float32, versions [S, R_max] int32
    (-1 where no token yet); num_generated [S]; budget [S] (max response tokens, counted
    from the start of the response); done [S] (finished, or empty slot); stopped [S]
    (ended on a stop id); keys [S, 2] uint32; stop_ids [n_stop] int32 (-1 = unused). config, sampling
    and attn_impl are static (part of the jit cache key)."""

    cache: KVCache
    pending: jax.Array
    prompt_ids: jax.Array
    prompt_lengths: jax.Array
    response_ids: jax.Array
    logprobs: jax.Array
    versions: jax.Array
    num_generated: jax.Array
    budget: jax.Array
    done: jax.Array
    stopped: jax.Array
    keys: jax.Array
    stop_ids: jax.Array
    config: ModelConfig = struct.field(pytree_node=False)
    sampling: SamplingConfig = struct.field(pytree_node=False)
    attn_impl: str | None = struct.field(pytree_node=False, default=None)

    @property
    def num_slots(self) -> int:
        return self.pending.shape[0]

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def max_new_tokens(self) -> int:
        return self.response_ids.shape[1]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def check_stop_ids(stop_ids: Sequence[int], config: ModelConfig) -> tuple[int, ...]:
    """Stop ids as a tuple; ValueError for ids outside [0, vocab_size)."""
    ids = tuple(int(t) for t in stop_ids)
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"stop_ids {bad} are not token ids: the vocabulary is [0, {config.vocab_size})")
    return ids


def _pad_stop_ids(stop_ids: tuple[int, ...]) -> np.ndarray:
    """Pad with -1 (never a token) to a multiple of 64 so the count rarely changes shapes."""
    out = np.full((max(64, -(-len(stop_ids) // 64) * 64),), -1, np.int32)
    out[:len(stop_ids)] = stop_ids
    return out


def init_state(
    config: ModelConfig,
    *,
    num_slots: int,
    max_prompt_len: int,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_ids: Sequence[int] = (),
    attn_impl: str | None = None,
    cache_dtype: str | None = None,
) -> SamplerState:
    """All slots empty (done). The cache holds max_prompt_len + max_new_tokens positions,
    enough for any prompt plus a full response. Warns once if `sampling` is truncated
    (top-k/top-p), since this state's log-probs are meant for RL."""
    warn_if_truncated(sampling)
    return _new_state(config, num_slots=num_slots, max_prompt_len=max_prompt_len,
                      max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                      attn_impl=attn_impl, cache_dtype=cache_dtype)


def _new_state(config, *, num_slots, max_prompt_len, max_new_tokens, sampling, stop_ids,
               attn_impl, cache_dtype) -> SamplerState:
    num_slots = _positive_int("num_slots", num_slots)
    max_prompt_len = _positive_int("max_prompt_len", max_prompt_len)
    max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    stop_ids = check_stop_ids(stop_ids, config)
    max_len = max_prompt_len + max_new_tokens
    if max_len > config.max_position_embeddings:
        raise ValueError(
            f"max_prompt_len + max_new_tokens = {max_len} exceeds the model's "
            f"max_position_embeddings={config.max_position_embeddings}; shorten one of them")
    s, p, r = num_slots, max_prompt_len, max_new_tokens
    return SamplerState(
        cache=init_cache(config, s, max_len, cache_dtype),
        pending=jnp.zeros((s,), jnp.int32),
        prompt_ids=jnp.zeros((s, p), jnp.int32),
        prompt_lengths=jnp.zeros((s,), jnp.int32),
        response_ids=jnp.zeros((s, r), jnp.int32),
        logprobs=jnp.zeros((s, r), jnp.float32),
        versions=jnp.full((s, r), -1, jnp.int32),
        num_generated=jnp.zeros((s,), jnp.int32),
        budget=jnp.zeros((s,), jnp.int32),
        done=jnp.ones((s,), bool),
        stopped=jnp.zeros((s,), bool),
        keys=jnp.zeros((s, 2), jnp.uint32),
        stop_ids=jnp.asarray(_pad_stop_ids(stop_ids)),
        config=config, sampling=sampling, attn_impl=attn_impl,
    )


def as_key_data(rng: Any) -> jax.Array:
    """An int seed, a raw uint32 key [2] or a typed key -> raw key data [2] uint32."""
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return jax.random.PRNGKey(int(rng))
    key = jnp.asarray(rng)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise ValueError(f"rng must be an int seed or a PRNG key, got dtype {key.dtype} shape {key.shape}")
    return key


@jax.jit
def _group_keys(base, group_ids, index):
    per_group = jax.vmap(lambda g: jax.random.fold_in(base, g))(group_ids)
    return jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(index))(per_group)


def sample_keys(rng: Any, group_ids: Sequence[int], group_size: int) -> np.ndarray:
    """Keys [G, N, 2] uint32: sample i of group g gets fold_in(fold_in(rng, g), i), so a
    sample's stream depends on its group id and index only (not on its slot)."""
    n = _positive_int("group_size", group_size)
    gids = np.asarray(group_ids, np.int32).reshape(-1)
    padded = np.zeros((_bucket(gids.size, 1 << 30),), np.int32)  # few compiled shapes
    padded[:gids.size] = gids
    keys = _group_keys(as_key_data(rng), padded, np.arange(n, dtype=np.int32))
    return np.asarray(keys)[:gids.size]


# ----------------------------------------------------------------------------- sampling
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
        kth = jax.lax.top_k(z, sampling.top_k)[0][:, -1:]
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
@jax.jit
def _fill_jit(params, state: SamplerState, ctx_ids, ctx_lengths, prompt_lengths, slot, row,
              keys, budget, logprobs, versions, done, stopped) -> SamplerState:
    """Prefill R contexts ctx_ids [R, T] (lengths [R], of which prompt_lengths [R] are
    prompt) and load them into slots: entry m writes context row[m] into slot[m]
    (slot >= S drops the entry). Per-entry: keys [M, 2], budget [M], the partial
    response's logprobs/versions [M, R_max], done/stopped [M]."""
    c = state.config
    r, t = ctx_ids.shape
    kv_shape = (c.num_layers, r, t, c.num_kv_heads, c.head_dim)
    dt = state.cache.k.dtype
    empty = KVCache(k=jnp.zeros(kv_shape, dt), v=jnp.zeros(kv_shape, dt),
                    lengths=jnp.zeros((r,), jnp.int32))
    _, pc = _prefill_jit(params, ctx_ids, ctx_lengths, empty, config=c, attn_impl=state.attn_impl)
    clen, plen = ctx_lengths[row], prompt_lengths[row]
    rows_ctx = ctx_ids[row]  # [M, T]

    def gather(offset, width):  # [M, width]: rows_ctx[m, offset[m] + j], 0 outside the row
        j = jnp.arange(width)[None, :] + offset[:, None]
        vals = jnp.take_along_axis(rows_ctx, jnp.clip(j, 0, t - 1), axis=1)
        return vals, j

    p_max, r_max = state.prompt_ids.shape[1], state.response_ids.shape[1]
    prompt, j = gather(jnp.zeros_like(plen), p_max)
    prompt = jnp.where(j < plen[:, None], prompt, 0)
    resp, j = gather(plen, r_max)
    n_gen = clen - plen
    in_resp = j < clen[:, None]
    cache = state.cache
    return state.replace(
        cache=KVCache(
            # The only place a slot's KV rows are replaced: positions [0, T) of each slot.
            k=cache.k.at[:, slot, :t].set(pc.k[:, row], mode="drop"),
            v=cache.v.at[:, slot, :t].set(pc.v[:, row], mode="drop"),
            lengths=cache.lengths.at[slot].set(clen - 1, mode="drop"),
        ),
        pending=state.pending.at[slot].set(rows_ctx[jnp.arange(row.shape[0]), clen - 1], mode="drop"),
        prompt_ids=state.prompt_ids.at[slot].set(prompt, mode="drop"),
        prompt_lengths=state.prompt_lengths.at[slot].set(plen, mode="drop"),
        response_ids=state.response_ids.at[slot].set(jnp.where(in_resp, resp, 0), mode="drop"),
        logprobs=state.logprobs.at[slot].set(logprobs, mode="drop"),
        versions=state.versions.at[slot].set(versions, mode="drop"),
        num_generated=state.num_generated.at[slot].set(n_gen, mode="drop"),
        budget=state.budget.at[slot].set(budget, mode="drop"),
        done=state.done.at[slot].set(done | (n_gen >= budget), mode="drop"),
        stopped=state.stopped.at[slot].set(stopped, mode="drop"),
        keys=state.keys.at[slot].set(keys, mode="drop"),
    )


@jax.jit
def _decode_segment_jit(params, state: SamplerState, num_tokens, version) -> SamplerState:
    """Up to num_tokens decode steps in one while_loop; stops early when all slots are done."""
    s, r_max = state.response_ids.shape
    rows = jnp.arange(s)
    stop = state.stop_ids

    def cond(carry):
        i, st = carry
        return (i < num_tokens) & jnp.any(~st.done)

    def body(carry):
        i, st = carry
        live = ~st.done
        logits, cache = _decode_jit(params, st.pending, st.cache, config=st.config,
                                    attn_impl=st.attn_impl)
        # Done slots computed a throw-away step: keep their cache length (the write they
        # made lies past it, inside the cache, and is never read).
        cache = cache.replace(lengths=jnp.where(live, cache.lengths, st.cache.lengths))
        keys = jax.vmap(jax.random.fold_in)(st.keys, st.num_generated)
        tok, logp = sample_tokens(logits, keys, st.sampling)
        col = jnp.where(live, st.num_generated, r_max)  # r_max: out of range, dropped
        n = st.num_generated + live.astype(jnp.int32)
        hit = live & (tok[:, None] == stop[None, :]).any(axis=-1)
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
        return i + 1, st

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


# ----------------------------------------------------------------------------- host wrappers
def _bucket(n: int, limit: int, floor: int = 8) -> int:
    """Pad sizes to powers of two (capped at `limit`) so few shapes get compiled."""
    return min(limit, max(floor, 1 << (max(n, 1) - 1).bit_length()))


def _bucket_width(n: int, limit: int) -> int:
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
    b = state.max_new_tokens if max_new_tokens is None else _positive_int("max_new_tokens", max_new_tokens)
    if b > state.max_new_tokens:
        raise ValueError(f"max_new_tokens={b} exceeds the state's max_new_tokens={state.max_new_tokens}")
    return np.full((n,), b, np.int32)


_FILL_SAMPLING = SamplingConfig()


def _fill(params, state: SamplerState, contexts: list[np.ndarray], prompt_lengths: np.ndarray,
          row: np.ndarray, slot: np.ndarray, keys: np.ndarray, budget: np.ndarray,
          logprobs: np.ndarray, versions: np.ndarray, done: np.ndarray, stopped: np.ndarray
          ) -> SamplerState:
    """Pad rows / entries / context width to buckets and call the jitted fill."""
    s = state.num_slots
    n_rows, n_ent = len(contexts), row.size
    # Entries are padded to S and rows/width to coarse buckets: few compiled shapes, at the
    # price of prefilling some padding rows (cheap next to the decode).
    rows_b = _bucket(n_rows, s)
    ent_b = s
    t = _bucket_width(max(c.size for c in contexts), state.cache.max_len)
    ctx = np.zeros((rows_b, t), np.int32)
    clen = np.ones((rows_b,), np.int32)
    plen = np.ones((rows_b,), np.int32)
    for i, c in enumerate(contexts):
        ctx[i, :c.size], clen[i], plen[i] = c, c.size, prompt_lengths[i]

    def pad(x, fill):
        out = np.full((ent_b,) + x.shape[1:], fill, x.dtype)
        out[:n_ent] = x
        return out

    # The fill does not depend on the sampling config: compile it once per geometry.
    out = _fill_jit(params, state.replace(sampling=_FILL_SAMPLING), ctx, clen, plen, pad(slot.astype(np.int32), s),
                     pad(row.astype(np.int32), 0), pad(keys.astype(np.uint32), 0),
                     pad(budget.astype(np.int32), 1), pad(logprobs.astype(np.float32), 0),
                     pad(versions.astype(np.int32), -1), pad(done.astype(bool), True),
                     pad(stopped.astype(bool), False))
    return out.replace(sampling=state.sampling)


def prefill(
    params: Params,
    state: SamplerState,
    prompts: Sequence[Sequence[int]],
    slots: Any,
    keys: Any,
    *,
    max_new_tokens: int | None = None,
) -> SamplerState:
    """Start G groups: prompts (G token lists) are prefilled once each and their KV rows
    copied into the N slots of their group. slots [G, N] int (distinct); keys [G, N, 2]
    uint32 (see `sample_keys`); max_new_tokens (default: the state's) is each sample's
    budget. The slots' previous contents are discarded."""
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
    return _fill(params, state, ctx, np.array([c.size for c in ctx]), np.repeat(np.arange(g), n),
                 slots.reshape(-1), keys.reshape(m, 2), _budgets(max_new_tokens, m, state),
                 np.zeros((m, r_max), np.float32), np.full((m, r_max), -1, np.int32),
                 np.zeros((m,), bool), np.zeros((m,), bool))


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


def read_slots(state: SamplerState, slots: Sequence[int]) -> list[PartialSample]:
    """Copy the given slots to the host (one transfer)."""
    idx = np.asarray(slots, np.int32).reshape(-1)
    _check_slots(idx, state.num_slots)
    fields = ("prompt_ids", "prompt_lengths", "response_ids", "logprobs", "versions",
              "num_generated", "budget", "done", "stopped", "keys")
    host = jax.device_get({f: getattr(state, f)[idx] for f in fields})
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
    key and budget are kept, so decoding continues where it stopped."""
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
    return _fill(params, state, ctx, np.asarray(plen), np.arange(m), slots, keys,
                 np.array([s.budget for s in samples]), logprobs, versions,
                 np.array([s.done for s in samples]), np.array([s.stopped for s in samples]))


def decode_segment(params: Params, state: SamplerState, num_tokens: int, version: int) -> SamplerState:
    """Advance every live slot by at most num_tokens tokens (fewer if it hits a stop id or
    its budget), drawing from `params` and stamping `version` on each new token. Swapping
    params between calls is how new policy versions enter the rollout. num_tokens and
    version are traced, so changing them does not recompile."""
    num_tokens = _positive_int("num_tokens", num_tokens)
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    return _decode_segment_jit(params, state, jnp.int32(num_tokens), jnp.int32(version))


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
) -> GenerationResult:
    """Sample num_samples responses per prompt (one prefill per prompt) with the sampler.
    stop_ids default to config.eos_token_ids; rng is an int seed or a key. progress, if
    given, is called after every segment with the number of tokens that segment produced
    (e.g. a tqdm bar's `update`)."""
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    n = _positive_int("num_samples", num_samples)
    segment_len = _positive_int("segment_len", segment_len)
    stop_ids = config.eos_token_ids if stop_ids is None else stop_ids
    g = len(prompts)
    # No truncation warning here: plain generation is not RL.
    state = _new_state(config, num_slots=g * n, max_prompt_len=max(len(p) for p in prompts),
                       max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                       attn_impl=attn_impl, cache_dtype=None)
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
