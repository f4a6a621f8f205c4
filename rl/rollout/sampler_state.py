"""The sampler's configuration and state: `SamplingConfig`, the fixed-slot `SamplerState`
pytree (KV cache, pending token, prompt / response ids, behaviour log-probs, versions,
budgets, done flags, per-sample rng keys), `init_state`, and the per-sample keys.
See `rl.rollout.sampler` for how a slot runs.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models import kv_cache as kvc
from models.chunked_prefill import DEFAULT_CHUNK, check_chunk_size
from models.config import ModelConfig
from models.decoder import check_layer_loop
from models.kv_cache import KVCache, SegmentedKVCache, init_cache, init_segmented_cache


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
    config, sampling, attn_impl, prefill_chunk (fills wider than it prefill in chunks
    of that many tokens, models/chunked_prefill.py; None: always one shot) and layer_loop
    (how decode runs the layers: "scan" or "unrolled", models.decoder.LAYER_LOOPS) are
    static (part of the jit cache key)."""

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
    prefill_chunk: int | None = struct.field(pytree_node=False, default=DEFAULT_CHUNK)
    layer_loop: str = struct.field(pytree_node=False, default="scan")

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


def positive_int(name: str, value: Any) -> int:
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
    prefill_chunk: int | None = DEFAULT_CHUNK,
    layer_loop: str = "scan",
    bucket_slots: bool = False,
) -> SamplerState:
    """All slots empty (done). The cache holds max_prompt_len + max_new_tokens positions
    per sample, enough for any prompt plus a full response. kv_layout "segmented" (the
    default when group_size is given) stores each group's prompt KV once for its
    group_size samples and needs num_slots to be a multiple of group_size; "replicated"
    (the default without group_size) copies it into every slot. attn_impl picks the
    attention kernels (segmented: kernels.segment_decode for decode and
    kernels.shared_prefix_attention for prefill; None = their platform default).
    prefill_chunk: contexts (replicated) or prompts (segmented) longer than this many
    tokens prefill in chunks of it, with memory O(chunk x T) instead of O(T^2) and the
    same result (models/chunked_prefill.py, XLA attention); None: always one shot.
    layer_loop: "scan" (default) or "unrolled": decode runs the layers as one loop or as
    straight-line code (no loop iteration per layer; longer compile; the same tokens).
    bucket_slots: allocate `slot_bucket(num_slots, group_size)` slots instead of
    num_slots, so that states for different batch sizes share a few compiled programs
    (the extra slots start empty, i.e. done). Warns once if `sampling` is truncated (top-k/top-p), since this state's log-probs
    are meant for RL."""
    warn_if_truncated(sampling)
    return new_state(config, num_slots=num_slots, max_prompt_len=max_prompt_len,
                      max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                      attn_impl=attn_impl, cache_dtype=cache_dtype, group_size=group_size,
                      kv_layout=kv_layout, prefill_chunk=prefill_chunk,
                      layer_loop=layer_loop, bucket_slots=bucket_slots)


MAX_POW2_SLOTS = 256  # slot_bucket: powers of two up to here, then multiples of it


def slot_bucket(num_slots: int, group_size: int | None = None) -> int:
    """Slots to allocate for num_slots samples so that batch sizes share compilations:
    the next power of two >= num_slots (at least 8) up to 256, beyond that the next
    multiple of 256; then rounded up to a multiple of group_size (whole groups). E.g.
    5 -> 8, 40 -> 64, 200 -> 256, 300 -> 512; with group_size 3: 40 -> 66."""
    n = positive_int("num_slots", num_slots)
    rows = (max(8, 1 << (n - 1).bit_length()) if n <= MAX_POW2_SLOTS
            else -(-n // MAX_POW2_SLOTS) * MAX_POW2_SLOTS)
    if group_size is not None:
        g = positive_int("group_size", group_size)
        rows = -(-rows // g) * g
    return rows


def new_state(config, *, num_slots, max_prompt_len, max_new_tokens, sampling, stop_ids,
               attn_impl, cache_dtype, group_size=None, kv_layout=None,
               prefill_chunk=DEFAULT_CHUNK, layer_loop="scan",
               bucket_slots=False) -> SamplerState:
    num_slots = positive_int("num_slots", num_slots)
    if group_size is not None:
        group_size = positive_int("group_size", group_size)
    if bucket_slots:
        num_slots = slot_bucket(num_slots, group_size)
    kv_layout = resolve_kv_layout(kv_layout, group_size)
    if kv_layout == "segmented" and num_slots % group_size:
        raise ValueError(f"kv_layout='segmented' needs num_slots ({num_slots}) to be a multiple "
                         f"of group_size ({group_size}): slots come in blocks of one group")
    max_prompt_len = positive_int("max_prompt_len", max_prompt_len)
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    stop_ids = check_stop_ids(stop_ids, config)
    max_len = max_prompt_len + max_new_tokens
    if max_len > config.max_position_embeddings:
        raise ValueError(
            f"max_prompt_len + max_new_tokens = {max_len} exceeds the model's "
            f"max_position_embeddings={config.max_position_embeddings}; shorten one of them")
    arrays = _empty_arrays(config, num_slots, max_prompt_len, max_new_tokens,
                           group_size if kv_layout == "segmented" else None,
                           None if cache_dtype is None else str(jnp.dtype(cache_dtype)), stop_ids)
    return SamplerState(
        **arrays,
        config=config, sampling=sampling, attn_impl=attn_impl,
        prefill_chunk=check_chunk_size(prefill_chunk),
        layer_loop=check_layer_loop(layer_loop),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _empty_arrays(config, s, p, r, group_size, cache_dtype, stop_ids) -> dict:
    """Every array of an empty state in one compiled program: one dispatch instead of one
    per leaf (on an accelerator each eager op costs a launch and a host round trip, and an
    engine builds a state per rollout batch). group_size None: the replicated cache."""
    if group_size is not None:
        cache = init_segmented_cache(config, s // group_size, group_size, p, r, cache_dtype)
    else:
        cache = init_cache(config, s, p + r, cache_dtype)
    return dict(
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
        stop_ids=jnp.asarray(_pad_stop_ids(stop_ids)))


def bucket(n: int, limit: int, floor: int = 8) -> int:
    """Pad sizes to powers of two (capped at `limit`) so few shapes get compiled."""
    return min(limit, max(floor, 1 << (max(n, 1) - 1).bit_length()))


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
    n = positive_int("group_size", group_size)
    gids = np.asarray(group_ids, np.int32).reshape(-1)
    padded = np.zeros((bucket(gids.size, 1 << 30),), np.int32)  # few compiled shapes
    padded[:gids.size] = gids
    keys = _group_keys(as_key_data(rng), padded, np.arange(n, dtype=np.int32))
    return np.asarray(keys)[:gids.size]


