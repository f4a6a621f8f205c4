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

from models import kv_cache as kvc
from models.config import ModelConfig
from models.decoder import _decode_jit, _prefill_jit, prefill_segments
from models.kv_cache import KVCache, SegmentedKVCache, init_cache, init_segmented_cache

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
KV_LAYOUTS = ("segmented", "replicated")


def resolve_kv_layout(kv_layout: str | None, group_size: int | None) -> str:
    """kv_layout, or the default: "segmented" when the group size is known, else
    "replicated". ValueError for unknown names or "segmented" without a group size."""
    if kv_layout is None:
        return "replicated" if group_size is None else "segmented"
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS} or None, got {kv_layout!r}")
    if kv_layout == "segmented" and group_size is None:
        raise ValueError("kv_layout='segmented' needs group_size (the N samples per prompt "
                         "that share one prompt segment); pass group_size or use "
                         "kv_layout='replicated'")
    return kv_layout


@struct.dataclass
class SamplerState:
    """S fixed slots (S = groups * N in the segmented layout).

    Per-slot leaves, leading axis [S]: pending [S] int32 (next token to feed);
    prompt_ids [S, P_max], prompt_lengths [S]; response_ids [S, R_max], logprobs
    [S, R_max] float32, versions [S, R_max] int32 (-1 where no token yet); num_generated
    [S]; budget [S] (max response tokens, counted from the start of the response); done
    [S] (finished, or empty slot); stopped [S] (ended on a stop id); keys [S, 2] uint32.
    stop_ids [n_stop] int32 (-1 = unused) is shared by all slots.
    cache (the layers axis comes first because the decoder scans over layers; the slot /
    group axis is axis 1, see `state_logical_axes`):
      replicated: KVCache k, v [layers, S, P_max + R_max, kv_heads, head_dim], lengths [S];
      segmented: SegmentedKVCache k/v_prompt [layers, groups, P_max, kv_heads, head_dim],
        k/v_resp [layers, groups, N, R_max, kv_heads, head_dim], prompt_lengths [groups],
        resp_lengths [groups, N]; slot s = (s // N, s % N).
    config, sampling and attn_impl are static (part of the jit cache key)."""

    cache: KVCache | SegmentedKVCache
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

    @property
    def kv_layout(self) -> str:
        return "segmented" if isinstance(self.cache, SegmentedKVCache) else "replicated"

    @property
    def group_size(self) -> int | None:
        """N of the segmented layout (slots come in aligned blocks of N); None if replicated."""
        return self.cache.group_size if isinstance(self.cache, SegmentedKVCache) else None


def state_logical_axes(state: SamplerState) -> SamplerState:
    """Same tree as `state`, each array leaf replaced by its logical axis names ("batch"
    = the slot axis of per-slot leaves and the group axis of the segmented cache), for
    mapping onto a mesh with models.sharding (e.g. "batch" -> "data")."""
    slot = lambda x: ("batch",) + (None,) * (x.ndim - 1)  # noqa: E731
    cache_axes = (kvc.segmented_cache_logical_axes() if state.kv_layout == "segmented"
                  else kvc.cache_logical_axes())
    fields = {f: slot(getattr(state, f)) for f in (
        "pending", "prompt_ids", "prompt_lengths", "response_ids", "logprobs", "versions",
        "num_generated", "budget", "done", "stopped", "keys")}
    return state.replace(cache=cache_axes, stop_ids=(None,), **fields)


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
    group_size: int | None = None,
    kv_layout: str | None = None,
) -> SamplerState:
    """All slots empty (done). The cache holds max_prompt_len + max_new_tokens positions
    per sample, enough for any prompt plus a full response. kv_layout "segmented" (the
    default when group_size is given) stores each group's prompt KV once for its
    group_size samples and needs num_slots to be a multiple of group_size; "replicated"
    (the default without group_size) copies it into every slot. attn_impl picks the
    attention kernels (segmented: kernels.segment_decode for decode and
    kernels.shared_prefix_attention for prefill; None = their platform default).
    Warns once if `sampling` is truncated (top-k/top-p), since this state's log-probs
    are meant for RL."""
    warn_if_truncated(sampling)
    return _new_state(config, num_slots=num_slots, max_prompt_len=max_prompt_len,
                      max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                      attn_impl=attn_impl, cache_dtype=cache_dtype, group_size=group_size,
                      kv_layout=kv_layout)


def _new_state(config, *, num_slots, max_prompt_len, max_new_tokens, sampling, stop_ids,
               attn_impl, cache_dtype, group_size=None, kv_layout=None) -> SamplerState:
    num_slots = _positive_int("num_slots", num_slots)
    if group_size is not None:
        group_size = _positive_int("group_size", group_size)
    kv_layout = resolve_kv_layout(kv_layout, group_size)
    if kv_layout == "segmented" and num_slots % group_size:
        raise ValueError(f"kv_layout='segmented' needs num_slots ({num_slots}) to be a multiple "
                         f"of group_size ({group_size}): slots come in blocks of one group")
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
    if kv_layout == "segmented":
        cache = init_segmented_cache(config, s // group_size, group_size, p, r, cache_dtype)
    else:
        cache = init_cache(config, s, max_len, cache_dtype)
    return SamplerState(
        cache=cache,
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


def _fill_replicated(params, state: SamplerState, f: ReplicatedFill) -> SamplerState:
    c = state.config
    r, t = f.ctx_ids.shape
    kv_shape = (c.num_layers, r, t, c.num_kv_heads, c.head_dim)
    dt = state.cache.k.dtype
    empty = KVCache(k=jnp.zeros(kv_shape, dt), v=jnp.zeros(kv_shape, dt),
                    lengths=jnp.zeros((r,), jnp.int32))
    _, pc = _prefill_jit(params, f.ctx_ids, f.ctx_lengths, empty, config=c,
                         attn_impl=state.attn_impl)
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


def _fill_segmented(params, state: SamplerState, f: SegmentedFill) -> SamplerState:
    cache = state.cache
    gb, tp = f.prompt_ids.shape
    n, tr = f.resp_ids.shape[1:]
    # Prompt segment = prompt[:-1]; sample i's response segment = [prompt[-1], r_0 ..
    # r_{n_i - 2}] (n_i tokens), leaving r_{n_i - 1} (or prompt[-1] if n_i = 0) pending.
    last = jnp.take_along_axis(f.prompt_ids, (f.prompt_lengths - 1)[:, None], axis=1)[:, 0]
    ctx = jnp.concatenate([jnp.broadcast_to(last[:, None, None], (gb, n, 1)),
                           f.resp_ids[:, :, :tr - 1]], axis=2)
    seg_plen = f.prompt_lengths - 1
    kp, vp, kr, vr = prefill_segments(params, state.config, f.prompt_ids, seg_plen, ctx,
                                      f.num_generated, attn_impl=state.attn_impl)
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


def fill_impl(params: Params, state: SamplerState, fill: ReplicatedFill | SegmentedFill
              ) -> SamplerState:
    """Pure body of a fill (prefill of new groups or reload of partial samples): run the
    contexts through the model and load them into their slots. `fill` must match the
    state's layout (SegmentedFill for "segmented"). Not jitted: wrap it with jax.jit (and
    shardings) as `prefill` / `load_samples` do."""
    if isinstance(fill, SegmentedFill) != (state.kv_layout == "segmented"):
        raise ValueError(f"a {type(fill).__name__} cannot fill a {state.kv_layout!r} state")
    if isinstance(fill, SegmentedFill):
        return _fill_segmented(params, state, fill)
    return _fill_replicated(params, state, fill)


def decode_segment_impl(params: Params, state: SamplerState, num_tokens: jax.Array,
                        version: jax.Array) -> SamplerState:
    """Pure body of `decode_segment`: up to num_tokens decode steps in one while_loop;
    stops early when all slots are done. num_tokens, version: int32 scalars. Not jitted."""
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
        # made lies past it, or is dropped, and is never read).
        cache = kvc.keep_lengths_where(cache, st.cache, live)
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


_fill_jit = jax.jit(fill_impl)
_decode_segment_jit = jax.jit(decode_segment_impl)


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


def _run_fill(params, state: SamplerState, fill: ReplicatedFill | SegmentedFill) -> SamplerState:
    # The fill does not depend on the sampling config: compile it once per geometry.
    out = _fill_jit(params, state.replace(sampling=_FILL_SAMPLING), fill)
    return out.replace(sampling=state.sampling)


def _fill_groups(params, state: SamplerState, prompts: list[np.ndarray], group_slot: list[int],
                 responses: list[list[np.ndarray]], keys: np.ndarray, budget: np.ndarray,
                 logprobs: np.ndarray, versions: np.ndarray, done: np.ndarray,
                 stopped: np.ndarray) -> SamplerState:
    """Segmented layout: pad G groups (responses[g][i] = partial response of the sample
    going to slot group_slot[g] * N + i; per-sample arrays [G, N, ...]) to buckets and
    call the jitted fill."""
    n, n_groups = state.group_size, state.cache.groups
    g = len(prompts)
    gb = _bucket(g, n_groups)
    tp = _bucket_width(max(p.size for p in prompts), state.max_prompt_len)
    longest = max(r.size for rs in responses for r in rs)
    tr = 1 if longest == 0 else _bucket_width(longest, state.max_new_tokens)
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
        done=pad(done.astype(bool), True), stopped=pad(stopped.astype(bool), False)))


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
          logprobs: np.ndarray, versions: np.ndarray, done: np.ndarray, stopped: np.ndarray
          ) -> SamplerState:
    """Replicated layout: pad rows / entries / context width to buckets and call the
    jitted fill."""
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

    return _run_fill(params, state, ReplicatedFill(
        ctx_ids=ctx, ctx_lengths=clen, prompt_lengths=plen, slot=pad(slot.astype(np.int32), s),
        row=pad(row.astype(np.int32), 0), keys=pad(keys.astype(np.uint32), 0),
        budget=pad(budget.astype(np.int32), 1), logprobs=pad(logprobs.astype(np.float32), 0),
        versions=pad(versions.astype(np.int32), -1), done=pad(done.astype(bool), True),
        stopped=pad(stopped.astype(bool), False)))


def prefill(
    params: Params,
    state: SamplerState,
    prompts: Sequence[Sequence[int]],
    slots: Any,
    keys: Any,
    *,
    max_new_tokens: int | None = None,
) -> SamplerState:
    """Start G groups: prompts (G token lists) are prefilled once each. Segmented layout:
    the prompt KV is written once into the group's prompt segment, and slots[g] must be
    one aligned block of the state's group_size slots (any order); replicated: it is
    copied into the N slots of the group. slots [G, N] int (distinct); keys [G, N, 2]
    uint32 (see `sample_keys`; keys[g, i] goes with slot slots[g, i]); max_new_tokens
    (default: the state's) is each sample's budget. The slots' previous contents are
    discarded."""
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
                            np.zeros((g, n), bool), np.zeros((g, n), bool))
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
    kv_layout: str = "segmented",
) -> GenerationResult:
    """Sample num_samples responses per prompt (one prefill per prompt) with the sampler.
    stop_ids default to config.eos_token_ids; rng is an int seed or a key. progress, if
    given, is called after every segment with the number of tokens that segment produced
    (e.g. a tqdm bar's `update`). kv_layout: "segmented" (each prompt's KV stored once for
    its num_samples samples) or "replicated" (the same tokens, prompt KV copied per sample)."""
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    n = _positive_int("num_samples", num_samples)
    segment_len = _positive_int("segment_len", segment_len)
    stop_ids = config.eos_token_ids if stop_ids is None else stop_ids
    g = len(prompts)
    # No truncation warning here: plain generation is not RL.
    state = _new_state(config, num_slots=g * n, max_prompt_len=max(len(p) for p in prompts),
                       max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                       attn_impl=attn_impl, cache_dtype=None, group_size=n,
                       kv_layout=kv_layout)
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
