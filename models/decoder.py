"""Decoder-only transformer (Llama / Qwen2 / Qwen3 / SmolLM2) in flax.linen, and its pure
entry points: init_params, param_logical_axes, forward, prefill, decode_step,
prefill_segments. (The packed shared-prefix forward, mode "packed", has its entry points
in models/packed.py.) decode_step takes either cache layout of models/kv_cache.py (dense
KVCache or shared-prompt SegmentedKVCache); the layout is dispatched there, not here.

Layers run under `nn.scan` (params stacked on a leading [layers] axis) so compile time
does not grow with depth; `layer_loop="unrolled"` (decode's option, LAYER_LOOPS) runs the
same stacked params as straight-line code instead: no loop in the program, so XLA fuses
across layer boundaries and an accelerator runs no per-layer loop iteration. Projections also read optional LoRA-adapter and quantized-base
leaves (models/lora.py: compose, quantize_base); plain params never carry them.
Params and key activations carry logical axis names (see models/sharding.py); without a
rules context those annotations are no-ops.
Entry points validate concrete inputs on the host, then call a cached jitted function
with the config as a static argument; they also work inside a caller's jit (checks on
traced values are skipped there).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from kernels.shared_prefix_attention import shared_prefix_attention
from models import kv_cache as kvc
from models import lora
from models.attention import attention, tree_layer_attention
from models.config import ModelConfig
from models.inputs import _check_positions, _check_shape, _is_concrete, validate_tokens
from models.kv_cache import KVCache, SegmentedKVCache
from models.packed_layout import packed_tokens_and_positions
from models.rope import apply_rope, rope_inv_freq
from models.swiglu import swiglu
from models.weight_grads import PROJECTION_NAME, project

Params = dict[str, Any]
_init = nn.initializers.normal(stddev=0.02)
# Layers as one "scan" over the stacked params (default: compile time independent of depth)
# or "unrolled" (same params and arithmetic as straight-line code; no loop at run time).
LAYER_LOOPS = ("scan", "unrolled")
# remat "dots": keep the layer's matmul outputs (projections, MLP), recompute the rest
# (projections are custom_vjp calls, models.weight_grads.project: saved by name)
SAVE_DOTS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(PROJECTION_NAME))


def remat_policy(remat: bool | str) -> str:
    """ModelConfig.remat as a REMAT_POLICIES name: False -> "none", True -> "full"."""
    return ("full" if remat else "none") if isinstance(remat, bool) else remat


def check_layer_loop(layer_loop: str) -> str:
    """layer_loop if it is one of LAYER_LOOPS, else a ValueError naming them."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    return layer_loop


# ----------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """x / rms(x) * scale over the last axis, normalised in float32."""

    eps: float
    axis_name: str  # logical name of the normalised axis ("embed" or "head_dim")
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        return rms_normalize(x, self.eps, self.dtype) * scale.astype(self.dtype)


def rms_normalize(x: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """x / rms(x) over the last axis, computed in float32, returned in dtype (RMSNorm
    without its scale)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(dtype)


class Linear(nn.Module):
    """Projection written as an einsum so heads stay a separate (shardable) axis."""

    spec: str  # einsum of (input, kernel), e.g. "bse,ehd->bshd"
    shape: tuple[int, ...]  # kernel shape
    axes: tuple[str, ...]  # kernel logical axes
    n_out: int  # trailing kernel axes that are outputs (bias shape)
    use_bias: bool
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = lora.base_kernel(self, _init, self.axes, self.shape, self.param_dtype)
        x = x.astype(self.dtype)
        y = lora.add_lowrank(self, x, project(self.spec, x, kernel.astype(self.dtype)),
                             self.shape[-self.n_out:])  # + (x A) B with an adapter (models.lora)
        if self.use_bias:
            out_shape, out_axes = self.shape[-self.n_out:], self.axes[-self.n_out:]
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, out_axes),
                out_shape,
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return y


def _dtypes(c: ModelConfig) -> dict[str, Any]:
    return {"dtype": jnp.dtype(c.dtype), "param_dtype": jnp.dtype(c.param_dtype)}


def packed_attention(q, k, v, lengths, packed_nr: tuple[int, int], impl: str | None):
    """Attention over packed groups [prompt, resp_1 ... resp_N] (DualKV layout).

    q [G, P + N*R, heads, head_dim]; k, v [G, P + N*R, kv_heads, head_dim];
    lengths = (prompt_lengths [G], resp_lengths [G, N]); packed_nr = (N, R) static.
    Prompt queries attend causally within the prompt, response queries to the valid
    prompt keys and causally to their own response only. Returns q's shape and dtype;
    padded query rows come out as zeros.
    """
    n, r = packed_nr
    g, s = q.shape[:2]
    p = s - n * r

    def split(x):  # [G, P + N*R, h, D] -> [G, P, h, D], [G, N, R, h, D]
        return x[:, :p], x[:, p:].reshape((g, n, r) + x.shape[2:])

    (qp, qr), (kp, kr), (vp, vr) = split(q), split(k), split(v)
    o_p, o_r = shared_prefix_attention(qp, kp, vp, qr, kr, vr, prompt_lengths=lengths[0],
                                       resp_lengths=lengths[1], impl=impl)
    return jnp.concatenate([o_p, o_r.reshape((g, n * r) + o_r.shape[3:])], axis=1)


class Attention(nn.Module):
    """GQA self-attention. mode "forward": no cache; "tree": no cache, packed trees with
    `mask` = kend [batch, T] (tree_layer_attention); "prefill": attend to the fresh keys
    and write them to the cache; "decode": write, then attend to the whole cache (either
    layout, via kv_cache.decode_layer); "packed": groups laid out [prompt, resp_1 ... resp_N]
    (packed_nr = (N, R)), attended by kernels.shared_prefix_attention with `mask` =
    (prompt_lengths, resp_lengths); "fill": "packed" that also returns the fresh (k, v)
    (to fill a SegmentedKVCache)."""

    config: ModelConfig
    mode: str
    attn_impl: str | None
    packed_nr: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x, positions, mask, start, kv, cache=None):
        c = self.config
        E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

        def in_proj(name, heads, axis):
            return Linear("bse,ehd->bshd", (E, heads, D), ("embed", axis, "head_dim"), 2,
                          c.attention_bias, name=name, **_dtypes(c))(x)

        q, k, v = in_proj("q_proj", H, "heads"), in_proj("k_proj", K, "kv_heads"), in_proj("v_proj", K, "kv_heads")
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, "head_dim", name="q_norm", **_dtypes(c))(q)
            k = RMSNorm(c.rms_norm_eps, "head_dim", name="k_norm", **_dtypes(c))(k)
        inv_freq = rope_inv_freq(c)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q = nn.with_logical_constraint(q, ("batch", "seq", "heads", "head_dim"))
        k = nn.with_logical_constraint(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = nn.with_logical_constraint(v, ("batch", "seq", "kv_heads", "head_dim"))

        new_kv = None
        if self.mode == "forward":
            out = attention(q, k, v, mask=mask, impl=self.attn_impl)
        elif self.mode == "tree":  # mask = kend [batch, T] (models.tree.visible_until)
            out = tree_layer_attention(q, k, v, mask, self.attn_impl)
        elif self.mode == "prefill":
            out = attention(q, k, v, mask=mask, impl=self.attn_impl)
            new_kv = kvc.write_layer(kv[0], kv[1], k, v, start)
        elif self.mode == "decode":
            # kv = this layer's index into the whole (broadcast) cache; returns the new
            # token's (k, v), written into the cache once after the layer scan.
            out, new_kv = kvc.decode_layer(q, k, v, cache, kv, mask, start, self.attn_impl)
        elif self.mode in ("packed", "fill"):
            if self.packed_nr is None:
                raise ValueError(f"Attention mode {self.mode!r} needs packed_nr = (N, R)")
            out = packed_attention(q, k, v, mask, self.packed_nr, self.attn_impl)
            if self.mode == "fill":
                new_kv = (k, v)
        else:
            raise ValueError(f"Attention.mode must be forward/tree/prefill/decode/packed/fill, "
                             f"got {self.mode!r}")
        out = Linear("bshd,hde->bse", (H, D, E), ("heads", "head_dim", "embed"), 1, False,
                     name="o_proj", **_dtypes(c))(out)
        return out, new_kv


class _Kernel(nn.Module):
    """A bias-free projection's weight alone (param "kernel", as Linear names it)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    param_dtype: Any

    @nn.compact
    def __call__(self):
        # the kernel (dequantised if stored quantized) + A B with an adapter (models.lora)
        return lora.merge_on_use(self, lora.base_kernel(self, _init, self.axes, self.shape,
                                                        self.param_dtype))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), through models.swiglu (a hand-written backward
    that XLA runs faster on CPU; params gate_proj/up_proj/down_proj kernels as Linear's)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        E, F = c.hidden_size, c.intermediate_size
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        w_gate = _Kernel((E, F), ("embed", "mlp"), pdt, name="gate_proj")()
        w_up = _Kernel((E, F), ("embed", "mlp"), pdt, name="up_proj")()
        w_down = _Kernel((F, E), ("mlp", "embed"), pdt, name="down_proj")()
        return swiglu(x.astype(dt), w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))


class Block(nn.Module):
    """Pre-norm decoder layer; the scan body (carry = residual stream x)."""

    config: ModelConfig
    mode: str
    attn_impl: str | None
    packed_nr: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x, positions, mask, start, kv, cache=None):
        c = self.config
        h = RMSNorm(c.rms_norm_eps, "embed", name="input_norm", **_dtypes(c))(x)
        a, kv = Attention(c, self.mode, self.attn_impl, self.packed_nr, name="attn")(
            h, positions, mask, start, kv, cache)
        x = x + a
        h = RMSNorm(c.rms_norm_eps, "embed", name="post_attn_norm", **_dtypes(c))(x)
        x = x + MLP(c, name="mlp")(h)
        return nn.with_logical_constraint(x, ("batch", "seq", "embed")), kv


class Decoder(nn.Module):
    """tokens [batch, seq] -> (logits [batch, seq, vocab] float32, new per-layer KV or None).

    mask bool [batch, seq, kv_len] (modes "packed"/"fill": the pair (prompt_lengths [G],
    resp_lengths [G, N]) and packed_nr = (N, R), tokens [G, P + N*R]); start [batch] cache
    write offsets and kv (k, v) [layers, batch, max_len, kv_heads, head_dim] are used by
    "prefill"/"decode" only (decode on a segmented cache: see kv_cache.decode_inputs).
    Mode "decode" returns, instead of a new cache, the new token's (k, v) [layers, batch,
    kv_heads, head_dim] per layer (kv_cache.after_decode writes them in place). logits_at [batch, K] int (optional): compute the final norm
    and the vocabulary head only at these sequence indices -> logits [batch, K, vocab]
    (the head is the costliest per-token layer of small models)."""

    config: ModelConfig
    mode: str = "forward"
    attn_impl: str | None = None
    packed_nr: tuple[int, int] | None = None
    # True: return the final-normed hidden states [batch, seq, embed] instead of logits
    # (the head runs elsewhere, e.g. models.logprobs' chunked log-softmax; see head_matrix)
    return_hidden: bool = False
    # "scan" or "unrolled" (LAYER_LOOPS): the same params tree and arithmetic either way
    layer_loop: str = "scan"

    @nn.compact
    def __call__(self, tokens, positions, mask, start=None, kv=None, logits_at=None):
        c = self.config
        dt = jnp.dtype(c.dtype)
        embed = nn.Embed(c.vocab_size, c.hidden_size, name="embed", dtype=dt,
                         param_dtype=jnp.dtype(c.param_dtype),
                         embedding_init=nn.with_logical_partitioning(_init, ("vocab", "embed")))
        x = nn.with_logical_constraint(embed(tokens), ("batch", "seq", "embed"))
        policy = remat_policy(c.remat)
        block = Block if policy == "none" else nn.remat(
            Block, prevent_cse=False, policy=None if policy == "full" else SAVE_DOTS)
        layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0, nn.broadcast),
            length=c.num_layers,
            # a full unroll: straight-line code, no while loop in the lowered program
            unroll=c.num_layers if check_layer_loop(self.layer_loop) == "unrolled" else 1,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.mode, self.attn_impl, self.packed_nr, name="layers")
        if self.mode == "decode":
            # The whole cache is broadcast to every layer (read in place) and the layer
            # index is scanned: scanning over the cache would slice and restack (copy)
            # all of it on every decode step. kv becomes the new tokens' (k, v) per layer.
            x, kv = layers(x, positions, mask, start, jnp.arange(c.num_layers), kv)
        else:
            x, kv = layers(x, positions, mask, start, kv, None)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
        x = RMSNorm(c.rms_norm_eps, "embed", name="final_norm", **_dtypes(c))(x)
        if self.return_hidden:
            if not c.tie_word_embeddings:
                _Head(c, name="lm_head")()  # declare the param (init) even when unused here
            return nn.with_logical_constraint(x, ("batch", "seq", "embed")), kv
        if c.tie_word_embeddings:
            head = embed.embedding.astype(dt).T
        else:
            head = _Head(c, name="lm_head")()
        logits = jnp.einsum("bse,ev->bsv", x, head.astype(dt), preferred_element_type=jnp.float32)
        return nn.with_logical_constraint(logits, ("batch", "seq", "vocab")), kv


class _Head(nn.Module):
    """Untied output projection; holds lm_head/kernel [embed, vocab]."""

    config: ModelConfig

    @nn.compact
    def __call__(self):
        c = self.config
        return self.param("kernel", nn.with_logical_partitioning(_init, ("embed", "vocab")),
                          (c.hidden_size, c.vocab_size), jnp.dtype(c.param_dtype))


# ----------------------------------------------------------------------------- entry points
def _as_key(rng) -> jax.Array:
    return jax.random.PRNGKey(rng) if isinstance(rng, int) else rng


def _dummy_inputs():
    one = jnp.zeros((1, 1), jnp.int32)
    return one, one, jnp.ones((1, 1, 1), bool)


def _init_boxed(config: ModelConfig, rng: jax.Array):
    return Decoder(config).init(rng, *_dummy_inputs())["params"]


@partial(jax.jit, static_argnums=0)
def _init_jit(config: ModelConfig, rng: jax.Array) -> Params:
    # Same distributions as the module initializers (normal(0.02) weights, unit norm
    # scales, zero biases), but drawn as ONE normal vector: each separate RNG call costs
    # about a second of XLA compile time on CPU, and tests build many tiny models.
    shapes = nn.unbox(jax.eval_shape(partial(_init_boxed, config), rng))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    sizes = [math.prod(leaf.shape) for _, leaf in leaves]
    noise = 0.02 * jax.random.normal(rng, (sum(sizes),), jnp.float32)
    out, offset = [], 0
    for (path, leaf), size in zip(leaves, sizes):
        name = path[-1].key
        if name == "scale":
            value = jnp.ones(leaf.shape, leaf.dtype)
        elif name == "bias":
            value = jnp.zeros(leaf.shape, leaf.dtype)
        else:
            value = noise[offset:offset + size].reshape(leaf.shape).astype(leaf.dtype)
            offset += size
        out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)


def init_params(config: ModelConfig, rng) -> Params:
    """Random params (plain arrays in config.param_dtype): normal(0.02) weights and
    embeddings, ones for norm scales, zeros for biases. rng: a PRNG key or an int seed."""
    return _init_jit(config, _as_key(rng))


def param_logical_axes(config: ModelConfig) -> Any:
    """Same tree as init_params(config, ...), each leaf a tuple of logical axis names,
    e.g. layers/mlp/up_proj/kernel -> ("layers", "embed", "mlp"). Allocates nothing."""
    boxed = jax.eval_shape(partial(_init_boxed, config), jax.random.PRNGKey(0))
    return jax.tree.map(lambda p: tuple(p.names), boxed,
                        is_leaf=lambda x: isinstance(x, nn.Partitioned))


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool [batch, seq, seq]: causal within equal non-zero segment ids (0 = padding)."""
    s = segment_ids
    idx = jnp.arange(s.shape[1])
    causal = idx[:, None] >= idx[None, :]
    return (s[:, :, None] == s[:, None, :]) & (s != 0)[:, :, None] & causal[None]


@partial(jax.jit, static_argnames=("config", "attn_impl"))
def _forward_jit(params, tokens, positions, segment_ids, logits_at=None, *, config, attn_impl):
    logits, _ = Decoder(config, "forward", attn_impl).apply(
        {"params": params}, tokens, positions, segment_mask(segment_ids), logits_at=logits_at
    )
    return logits


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    attn_impl: str | None = None,
    logits_at: jax.Array | None = None,
) -> jax.Array:
    """Logits [batch, seq, vocab] (float32) for tokens [batch, seq] int.

    positions [batch, seq] default to arange(seq) per row. segment_ids [batch, seq]
    (default all 1) pack several sequences per row: a token attends causally to tokens
    of its own segment id; id 0 marks padding (its logits are meaningless but finite).
    logits_at [batch, K] int in [0, seq) (optional): return logits [batch, K, vocab] at
    only those positions, skipping the vocabulary head elsewhere.
    """
    tokens, positions = _rows_and_positions(tokens, positions, config)
    _check_positions(positions, config)
    if segment_ids is None:
        segment_ids = jnp.ones(tokens.shape, jnp.int32)
    _check_shape("segment_ids", segment_ids, tokens.shape)
    if logits_at is not None:
        logits_at = _check_logits_at(logits_at, tokens.shape)
    return _forward_jit(params, tokens, jnp.asarray(positions, jnp.int32),
                        jnp.asarray(segment_ids, jnp.int32), logits_at,
                        config=config, attn_impl=attn_impl)


def _rows_and_positions(tokens, positions, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """tokens [batch, seq] int32 (vocabulary checked), positions (default arange per row)."""
    validate_tokens(tokens, config)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    _check_shape("positions", positions, tokens.shape)
    return tokens, positions


@partial(jax.jit, static_argnames=("config", "attn_impl"))
def _hidden_jit(params, tokens, positions, *, config, attn_impl):
    seg = jnp.ones(tokens.shape, jnp.int32)
    hidden, _ = Decoder(config, "forward", attn_impl, return_hidden=True).apply(
        {"params": params}, tokens, positions, segment_mask(seg))
    return hidden


def hidden_states(params: Params, config: ModelConfig, tokens: jax.Array,
                  positions: jax.Array | None = None, *, attn_impl: str | None = None
                  ) -> jax.Array:
    """The final-normed hidden states [batch, seq, embed] (what the vocabulary head reads;
    the compute dtype) of tokens [batch, seq] int, each row one causal sequence (positions
    [batch, seq] default to arange(seq)). Padding after a row's tokens does not change the
    states before it."""
    tokens, positions = _rows_and_positions(tokens, positions, config)
    return _hidden_jit(params, tokens, jnp.asarray(positions, jnp.int32), config=config,
                       attn_impl=attn_impl)


def _check_logits_at(logits_at, shape: tuple[int, int]) -> jax.Array:
    """Validate logits_at [batch, K] indices into a [batch, seq] sequence; return int32."""
    if jnp.ndim(logits_at) != 2 or jnp.shape(logits_at)[0] != shape[0]:
        raise ValueError(f"logits_at must be [batch={shape[0]}, K] indices, got shape "
                         f"{jnp.shape(logits_at)}")
    if not jnp.issubdtype(jnp.result_type(logits_at), jnp.integer):
        raise ValueError(f"logits_at must be integers, got {jnp.result_type(logits_at)}")
    if _is_concrete(logits_at):
        arr = np.asarray(logits_at)
        if arr.size and (arr.min() < 0 or arr.max() >= shape[1]):
            raise ValueError(f"logits_at must index the sequence [0, {shape[1]}), got range "
                             f"[{arr.min()}, {arr.max()}]")
    return jnp.asarray(logits_at, jnp.int32)


@partial(jax.jit, static_argnames=("config", "attn_impl"))
def prefill_jit(params, tokens, lengths, cache, *, config, attn_impl):
    """`prefill`'s jitted core, without its host-side checks (the caller vouches for the
    shapes): tokens [batch, T] int32, lengths [batch] int32 -> (logits [batch, T, vocab]
    float32, the cache holding the prompts). One compile per shape, config and attn_impl."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, (k, v) = Decoder(config, "prefill", attn_impl).apply(
        {"params": params}, tokens, positions, kvc.prefill_mask(lengths, t),
        jnp.zeros((b,), jnp.int32), (cache.k, cache.v),
    )
    return logits, KVCache(k=k, v=v, lengths=lengths)


def prefill(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    *,
    attn_impl: str | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run right-padded prompts tokens [batch, T] with lengths [batch] (1 <= lengths <= T)
    from an empty start, writing their keys/values to `cache` (previous contents are
    overwritten; cache.lengths becomes `lengths`). Returns logits [batch, T, vocab] float32;
    the next-token distribution of row b is logits[b, lengths[b] - 1]."""
    validate_tokens(tokens, config)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, T], got shape {tokens.shape}")
    b, t = tokens.shape
    _check_shape("lengths", lengths, (b,))
    _check_shape("cache.k", cache.k, (config.num_layers, b, cache.max_len,
                                      config.num_kv_heads, config.head_dim))
    if t > cache.max_len:
        raise ValueError(
            f"prompt longer than the cache: tokens have T={t} positions but the cache holds "
            f"max_len={cache.max_len}; allocate init_cache(..., max_len >= {t})"
        )
    if t > config.max_position_embeddings:
        raise ValueError(
            f"prompt width T={t} exceeds max_position_embeddings={config.max_position_embeddings}"
        )
    if _is_concrete(lengths):
        arr = np.asarray(lengths)
        if arr.min() < 1 or arr.max() > t:
            raise ValueError(f"lengths must be in [1, T={t}] (prompt width), got {arr.tolist()}")
    return prefill_jit(params, tokens, jnp.asarray(lengths, jnp.int32), cache,
                        config=config, attn_impl=attn_impl)


@partial(jax.jit, static_argnames=("config", "attn_impl", "kv_bound", "layer_loop"))
def decode_jit(params, tokens, cache, *, config, attn_impl, kv_bound=None, layer_loop="scan"):
    """`decode_step`'s jitted core, without its host-side checks (the caller vouches that
    no row is full and that kv_bound, if an int, exceeds every row's length): tokens
    [batch] int32 -> (logits [batch, vocab] float32, the cache one token longer).
    layer_loop: "scan" (default) or "unrolled" (LAYER_LOOPS; same result)."""
    # kv_bound None: the masked path (exact slow twin); int: the bounded path, attending to
    # the first kv_bound slots only (models/kv_cache.py).
    positions, mask, start, kv = kvc.decode_inputs(cache, kv_bound)
    logits, new_kv = Decoder(config, "decode", attn_impl, layer_loop=layer_loop).apply(
        {"params": params}, tokens[:, None], positions, mask, start, kv)
    return logits[:, 0], kvc.after_decode(cache, new_kv)


def decode_step(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    cache: KVCache | SegmentedKVCache,
    *,
    attn_impl: str | None = None,
    kv_bound: int | None = None,
    layer_loop: str = "scan",
) -> tuple[jax.Array, KVCache | SegmentedKVCache]:
    """Feed one token per row, tokens [batch], and return logits [batch, vocab] float32
    for the following token and the cache with every row's length + 1.

    Dense KVCache: row b's token sits at position cache.lengths[b]. SegmentedKVCache: row
    b is sample (g, n) = (b // N, b % N); its token sits at position prompt_lengths[g] +
    resp_lengths[g, n], is written into its response segment and attends (via
    kernels.segment_decode, impl = attn_impl) to the group's prompt segment and its own
    response segment. kv_bound (optional, static): attend to the first kv_bound slots of
    each row / response segment only (every row's length must be < kv_bound) -- the
    same logits at a cost that follows the tokens present; None attends, masked, to all.
    layer_loop: "scan" (default) or "unrolled" (straight-line layers; the same logits)."""
    validate_tokens(tokens, config)
    tokens = jnp.asarray(tokens, jnp.int32)
    _check_shape("tokens", tokens, (cache.batch,))
    if isinstance(cache, SegmentedKVCache):
        lengths, limit, what = cache.resp_lengths, cache.resp_len, "resp_lengths"
    else:
        lengths, limit, what = cache.lengths, cache.max_len, "lengths"
    if _is_concrete(lengths):
        arr = np.asarray(lengths)
        if arr.max() >= limit:
            where = "resp_len" if what == "resp_lengths" else "max_len"
            raise ValueError(
                f"cache is full: {what} {arr.tolist()} reached {where}={limit}; "
                "allocate a longer cache"
            )
        if kv_bound is not None and arr.max() >= kvc.check_kv_bound(kv_bound, limit):
            raise ValueError(f"kv_bound={kv_bound} must exceed every row's {what} (max "
                             f"{arr.max()}): the new token's slot must lie inside the bound")
    kv_bound = kvc.check_kv_bound(kv_bound, limit)
    return decode_jit(params, tokens, cache, config=config, attn_impl=attn_impl,
                       kv_bound=kv_bound, layer_loop=check_layer_loop(layer_loop))


def prefill_segments(
    params: Params,
    config: ModelConfig,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    resp_tokens: jax.Array,
    resp_lengths: jax.Array,
    *,
    attn_impl: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Keys and values of G groups in the segmented layout, in one packed forward.

    prompt_tokens [G, P] (right-padded, prompt_lengths [G] valid, may be 0) are run once
    per group; resp_tokens [G, N, R] (resp_lengths [G, N] valid, may be 0) are teacher-forced
    behind their group's prompt at positions prompt_lengths[g] + t, each attending to the
    prompt and causally to itself only (models/packed_layout.py, no vocabulary head).
    A pure traceable function (no checks): callers validate. Returns k_prompt, v_prompt
    [layers, G, P, kv_heads, head_dim] and k_resp, v_resp [layers, G, N, R, kv_heads,
    head_dim] in the compute dtype; entries past the lengths are meaningless.
    """
    g, p = prompt_tokens.shape
    _, n, r = resp_tokens.shape
    tokens, positions = packed_tokens_and_positions(prompt_tokens, prompt_lengths, resp_tokens)
    _, (k, v) = Decoder(config, "fill", attn_impl, (n, r)).apply(
        {"params": params}, tokens, positions, (prompt_lengths, resp_lengths),
        logits_at=jnp.zeros((g, 1), jnp.int32))

    def split(x):  # [layers, G, P + N*R, h, d] -> prompt, response segments
        return x[:, :, :p], x[:, :, p:].reshape(x.shape[:2] + (n, r) + x.shape[3:])

    (kp, kr), (vp, vr) = split(k), split(v)
    return kp, vp, kr, vr
