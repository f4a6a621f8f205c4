"""LoRA adapters and a quantized frozen base (QLoRA) for the scanned decoder.

An adapter on projection W (stacked [layers, in..., out...]) is A [layers, prod(in), r]
and B [layers, r, prod(out)]; the adapted layer computes x W + (alpha / r) (x A) B. A is
drawn ~ N(0, 1 / prod(in)), B = 0, so a fresh adapter leaves the model exactly as it was.

Adapters live in their own pytree (`init_lora`), mirroring the params' nesting:
{"layers": {"attn" | "mlp": {"q_proj": {"lora_a", "lora_b"}, ...}}}. `compose(base,
adapters, config)` inserts them into the base tree as extra leaves (`lora_a`, and `lora_b`
pre-multiplied by alpha / r) next to each targeted kernel; every entry point of
models.decoder / models.logprobs / models.packed then runs the adapted model, because the
layers read those leaves (`base_kernel`, `add_lowrank`, `merge_on_use`, called by
decoder.Linear and decoder._Kernel): the attention projections q/k/v/o add the factored
(x A) B (never forming A B); the MLP's gate/up/down, whose matrices go whole into
models.swiglu's hand-written backward, get W + A B merged per layer inside the layer scan
(one layer's matrix at a time). Gradients reach A and B through either form by autodiff.
`merge(base, adapters, config)` is the exact slow twin: full params with W + (alpha/r) A B,
for the sampler (one merge per policy version) and for export.

QLoRA: `quantize_base(params, fmt)` stores every projection kernel of the base as
{"qkernel", "qscale"} instead of {"kernel"}; the layers dequantise on use, inside the scan
(one layer at a time). Formats, with the bound each element's error obeys (tested against
float64 in tests/models/test_lora.py):
  "int8": symmetric per output channel, scale = absmax over the input axes / 127, int8;
          |w - deq(q(w))| <= absmax_channel / 254  (8 bits + 32 bits per output channel).
  "int4": symmetric blockwise along the last (output) axis, blocks of min(64, last) values,
          scale = absmax_block / 7, values in [-7, 7] packed two per uint8;
          |w - deq(q(w))| <= absmax_block / 14  (4.5 bits per weight with blocks of 64).
(bounds up to float32 rounding of the stored scale, a relative 2^-23.)
`dequantize_base(qparams)` is the slow twin: plain float32 params.

Why not qwix (0.1.8, the JAX LoRA/quantization library Tunix uses), tried first on this
decoder with `qwix.apply_lora_to_model(Decoder(cfg), qwix.LoraProvider(module_path=...,
rank=4, alpha=8.0))`: (1) on the attention projections (jnp.einsum in decoder.Linear) init
fails inside the layer scan with flax.errors.SetAttributeFrozenModuleError "Can't set
kernel_lora_einsum_str=bse,er,rhd->bshd for Module of type Linear: Module instance is
frozen outside of setup method" (qwix's einsum path setattr()s on a compact linen module);
(2) on the MLP (module_path ".*mlp.*") init succeeds but creates NO adapter at all, silently:
qwix recognises a weight by finding the einsum's operand among the current module's params,
and our MLP passes its kernels through models.swiglu's custom_vjp, so the einsums see
non-param tracers. qwix's interception also works per flax module call, while the learner
needs the adapters as a separate pytree (the TrainState's params) beside a frozen base.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

Params = Any
# projection name -> (parent module in a layer, number of input axes of its kernel
# after the [layers] axis); the remaining axes are outputs.
PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("attn", 1), "k_proj": ("attn", 1), "v_proj": ("attn", 1), "o_proj": ("attn", 2),
    "gate_proj": ("mlp", 1), "up_proj": ("mlp", 1), "down_proj": ("mlp", 1),
}
QUANT_FORMATS = ("int8", "int4")
INT4_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (the update is scaled by alpha / r), targets: fnmatch patterns over
    the projection names q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (e.g.
    ("q_proj", "v_proj") or ("*_proj",)); dropout must stay 0 (none is applied);
    qlora: None (base in its own dtype), "int8" or "int4" (the base stored quantized,
    see the module docstring)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(PROJECTIONS)
    dropout: float = 0.0
    qlora: str | None = None

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be an int >= 1, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraConfig.alpha must be a finite number > 0, got {self.alpha}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ValueError("LoraConfig.targets is empty; name at least one projection "
                             f"pattern out of {tuple(PROJECTIONS)}")
        for pattern in self.targets:
            if not fnmatch.filter(PROJECTIONS, pattern):
                raise ValueError(f"LoraConfig.targets pattern {pattern!r} matches no projection;"
                                 f" the projections are {tuple(PROJECTIONS)}")
        if self.dropout != 0.0:
            raise ValueError(f"LoraConfig.dropout must be 0 (adapter dropout is not "
                             f"implemented), got {self.dropout}")
        if self.qlora is not None and self.qlora not in QUANT_FORMATS:
            raise ValueError(f"LoraConfig.qlora must be None or one of {QUANT_FORMATS}, "
                             f"got {self.qlora!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The targeted projection names, in PROJECTIONS order."""
        return tuple(p for p in PROJECTIONS if any(fnmatch.fnmatch(p, t) for t in self.targets))


# ----------------------------------------------------------------------------- quantization
def quantize_kernel(w: jax.Array, n_in: int, fmt: str) -> dict[str, jax.Array]:
    """{"qkernel", "qscale"} of a stacked kernel w [layers, in..., out...] (n_in input axes
    after [layers]) in format "int8" (per output channel) or "int4" (blockwise along the
    last axis). The error bounds are in the module docstring."""
    w = jnp.asarray(w, jnp.float32)
    if fmt == "int8":
        absmax = jnp.max(jnp.abs(w), axis=tuple(range(1, 1 + n_in)), keepdims=True)
        scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
        q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
        return {"qkernel": q, "qscale": scale}
    if fmt == "int4":
        last = w.shape[-1]
        block = min(INT4_BLOCK, last)
        if last % block or last % 2:
            raise ValueError(f"int4 quantization needs the kernel's last axis ({last}) even and "
                             f"a multiple of the block {block}; use qlora='int8'")
        blocks = w.reshape(w.shape[:-1] + (last // block, block))
        absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
        scale = jnp.where(absmax > 0, absmax / 7.0, 1.0)
        q = (jnp.clip(jnp.round(blocks / scale), -7, 7) + 8).astype(jnp.uint8).reshape(w.shape)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
        return {"qkernel": packed, "qscale": scale[..., 0]}
    raise ValueError(f"quantization format must be one of {QUANT_FORMATS}, got {fmt!r}")


def dequantize_kernel(qkernel: jax.Array, qscale: jax.Array) -> jax.Array:
    """float32 kernel from {"qkernel", "qscale"}; the format follows the dtype (int8: int8,
    uint8: packed int4). Works on a stacked kernel and on one layer's slice alike."""
    if qkernel.dtype == jnp.int8:
        return qkernel.astype(jnp.float32) * qscale
    if qkernel.dtype != jnp.uint8:
        raise ValueError(f"qkernel must be int8 or uint8 (packed int4), got {qkernel.dtype}")
    lo = (qkernel & 0xF).astype(jnp.int32) - 8
    hi = (qkernel >> 4).astype(jnp.int32) - 8
    q = jnp.stack([lo, hi], axis=-1).reshape(qkernel.shape[:-1] + (2 * qkernel.shape[-1],))
    nb = qscale.shape[-1]
    blocks = q.reshape(q.shape[:-1] + (nb, q.shape[-1] // nb)).astype(jnp.float32)
    return (blocks * qscale[..., None]).reshape(q.shape)


def _projection_nodes(params: Params):
    """(name, parent, n_in, node) of every projection in a params tree."""
    layers = params.get("layers") if isinstance(params, dict) else None
    if layers is None:
        raise ValueError("params have no 'layers' subtree; pass the decoder's params "
                         "(models.decoder.init_params / a loader)")
    for name, (parent, n_in) in PROJECTIONS.items():
        yield name, parent, n_in, layers[parent][name]


def _replace_nodes(params: Params, new: dict[tuple[str, str], dict]) -> Params:
    """A copy of params with layers/parent/name replaced by new[(parent, name)]."""
    layers = dict(params["layers"])
    for (parent, name), node in new.items():
        layers[parent] = {**layers[parent], name: node}
    return {**params, "layers": layers}


def kernel_value(node: dict) -> jax.Array:
    """The base weight of a projection node: its kernel, or the float32 dequantisation."""
    if "qkernel" in node:
        return dequantize_kernel(node["qkernel"], node["qscale"])
    return node["kernel"]


def quantize_base(params: Params, fmt: str) -> Params:
    """params with every projection kernel stored in format fmt ("int8" | "int4"); biases,
    norms, embeddings and the head are kept as they are."""
    new = {}
    for name, parent, n_in, node in _projection_nodes(params):
        if "kernel" not in node:
            raise ValueError(f"layers/{parent}/{name} holds no float kernel (already quantized?)")
        rest = {k: v for k, v in node.items() if k != "kernel"}
        new[(parent, name)] = {**rest, **quantize_kernel(node["kernel"], n_in, fmt)}
    return _replace_nodes(params, new)


def dequantize_base(params: Params) -> Params:
    """Plain params (float32 projection kernels) from a quantize_base tree: the slow twin
    of dequantise-on-use."""
    new = {}
    for name, parent, _, node in _projection_nodes(params):
        if "qkernel" in node:
            rest = {k: v for k, v in node.items() if k not in ("qkernel", "qscale")}
            new[(parent, name)] = {**rest, "kernel": kernel_value(node)}
    return _replace_nodes(params, new)


# ----------------------------------------------------------------------------- adapters
def _kernel_shape(node: dict) -> tuple[int, ...]:
    if "kernel" in node:
        return tuple(node["kernel"].shape)
    q = node["qkernel"]
    return tuple(q.shape[:-1]) + ((2 * q.shape[-1],) if q.dtype == jnp.uint8 else (q.shape[-1],))


def init_lora(params: Params, config: LoraConfig, rng) -> Params:
    """Fresh float32 adapters for config's targets on a base params tree (plain or
    quantized): A ~ N(0, 1 / prod(in)), B = 0. rng: a PRNG key or an int seed."""
    key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    out: dict[str, dict] = {}
    nodes = [n for n in _projection_nodes(params) if n[0] in config.projections]
    for k, (name, parent, n_in, node) in zip(jax.random.split(key, len(nodes)), nodes):
        shape = _kernel_shape(node)
        fan_in, fan_out = math.prod(shape[1:1 + n_in]), math.prod(shape[1 + n_in:])
        a = jax.random.normal(k, (shape[0], fan_in, config.rank), jnp.float32) / math.sqrt(fan_in)
        b = jnp.zeros((shape[0], config.rank, fan_out), jnp.float32)
        out.setdefault(parent, {})[name] = {"lora_a": a, "lora_b": b}
    return {"layers": out}


def _adapter_items(adapters: Params, config: LoraConfig):
    layers = adapters.get("layers") if isinstance(adapters, dict) else None
    if not isinstance(layers, dict):
        raise ValueError("adapters must be the tree init_lora returns: {'layers': {...}}")
    found = {name for parent in layers.values() for name in parent}
    if found != set(config.projections):
        raise ValueError(f"adapters hold {sorted(found)} but LoraConfig.targets select "
                         f"{sorted(config.projections)}; build them with init_lora(params, "
                         "config, rng) for this config")
    for name in config.projections:
        parent = PROJECTIONS[name][0]
        yield name, parent, layers[parent][name]


def compose(base: Params, adapters: Params, config: LoraConfig) -> Params:
    """The adapted model's params: base with each target's `lora_a` and `lora_b` * alpha/r
    inserted beside its kernel (nothing is merged; pure tree surgery plus one scaling of
    B, differentiable in the adapters). Feed it to any models.* entry point."""
    new = {}
    for name, parent, ad in _adapter_items(adapters, config):
        node = base["layers"][parent][name]
        shape = _kernel_shape(node)
        n_in = PROJECTIONS[name][1]
        want_a = (shape[0], math.prod(shape[1:1 + n_in]), config.rank)
        want_b = (shape[0], config.rank, math.prod(shape[1 + n_in:]))
        if tuple(ad["lora_a"].shape) != want_a or tuple(ad["lora_b"].shape) != want_b:
            raise ValueError(f"adapter {parent}/{name} has A {tuple(ad['lora_a'].shape)}, B "
                             f"{tuple(ad['lora_b'].shape)}; the base kernel {shape} at rank "
                             f"{config.rank} needs A {want_a}, B {want_b}")
        new[(parent, name)] = {**node, "lora_a": ad["lora_a"],
                               "lora_b": ad["lora_b"] * config.scale}
    return _replace_nodes(base, new)


def merge(base: Params, adapters: Params, config: LoraConfig) -> Params:
    """Full params with W + (alpha/r) A B for every target (the slow twin of the adapted
    forward; what the sampler and export use). A quantized base comes back dequantised
    (float32); a plain one keeps its kernels' dtype. Untargeted leaves ARE the base's
    arrays: copy the result before donating it (e.g. into a jitted train step)."""
    plain = dequantize_base(base)
    new = {}
    for name, parent, ad in _adapter_items(adapters, config):
        node = plain["layers"][parent][name]
        w = node["kernel"]
        delta = jnp.einsum("lir,lro->lio", ad["lora_a"], ad["lora_b"]) * config.scale
        merged = w.astype(jnp.float32) + delta.reshape(w.shape)
        new[(parent, name)] = {**node, "kernel": merged.astype(w.dtype)}
    return _replace_nodes(plain, new)


def base_shapes(params: Params) -> Params:
    """params as the plain decoder holds them, for shape checks (models.packed.check_params):
    adapter leaves dropped, a quantized kernel shown as its float kernel's ShapeDtypeStruct.
    Plain params come back as they are."""
    layers = params.get("layers") if isinstance(params, dict) else None
    if not isinstance(layers, dict):
        return params
    extra = ("lora_a", "lora_b", "qkernel", "qscale")
    new = {}
    for parent, sub in layers.items():
        for name, node in (sub.items() if isinstance(sub, dict) else ()):
            if isinstance(node, dict) and set(extra) & set(node):
                rest = {k: v for k, v in node.items() if k not in extra}
                if "qkernel" in node:
                    rest["kernel"] = jax.ShapeDtypeStruct(_kernel_shape(node), jnp.float32)
                new[(parent, name)] = rest
    return _replace_nodes(params, new) if new else params


def lora_logical_axes(param_axes: Params, config: LoraConfig) -> Params:
    """Logical axis names of init_lora's adapters from the params' (models.decoder.
    param_logical_axes): adapters shard by the rules of the kernel they adapt. For a
    kernel (layers, in..., out...): A (layers, first in axis, None) and B (layers, None,
    first out axis): a flattened axis takes its leading name's rule (its contiguous blocks
    are the blocks of that leading axis when the axis divides by the mesh axis)."""
    out: dict[str, dict] = {}
    for name in config.projections:
        parent, n_in = PROJECTIONS[name]
        axes = tuple(param_axes["layers"][parent][name]["kernel"])
        out.setdefault(parent, {})[name] = {"lora_a": (axes[0], axes[1], None),
                                            "lora_b": (axes[0], None, axes[1 + n_in])}
    return {"layers": out}


def quantized_logical_axes(param_axes: Params, fmt: str) -> Params:
    """Logical axes of quantize_base(params, fmt)'s tree: qkernel like the kernel (int4
    packs pairs along the last axis: the same name), qscale unsharded (small)."""
    new = {}
    for name, parent, _, node in _projection_nodes(param_axes):
        rest = {k: v for k, v in node.items() if k != "kernel"}
        new[(parent, name)] = {**rest, "qkernel": tuple(node["kernel"]),
                               "qscale": (None,) * len(node["kernel"])}
    return _replace_nodes(param_axes, new)


def count_bytes(tree: Params) -> int:
    """Bytes of a pytree's arrays (e.g. adapters, optimizer state, a quantized base)."""
    return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape)
                   for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------- layer side
# Called by models.decoder's Linear / _Kernel inside the layer scan: `module` is the
# projection's flax module, its variables one layer's slice.
def base_kernel(module: nn.Module, init, axes: tuple[str, ...], shape: tuple[int, ...],
                param_dtype) -> jax.Array:
    """The layer's base weight: dequantised on use when stored quantized, else its param
    "kernel" (declared, with its logical axes, as decoder.Linear always did)."""
    if module.has_variable("params", "qkernel"):
        return dequantize_kernel(module.get_variable("params", "qkernel"),
                                 module.get_variable("params", "qscale"))
    return module.param("kernel", nn.with_logical_partitioning(init, axes), shape, param_dtype)


def add_lowrank(module: nn.Module, x: jax.Array, y: jax.Array,
                out_shape: tuple[int, ...]) -> jax.Array:
    """y + (x A) B' for x [batch, seq, in...] when the layer carries an adapter (B' already
    scaled by alpha/r in `compose`), else y unchanged."""
    if not module.has_variable("params", "lora_a"):
        return y
    a = module.get_variable("params", "lora_a").astype(x.dtype)
    b = module.get_variable("params", "lora_b").astype(x.dtype)
    xa = jnp.einsum("bsi,ir->bsr", x.reshape(x.shape[:2] + (-1,)), a)
    delta = jnp.einsum("bsr,ro->bso", xa, b).reshape(x.shape[:2] + tuple(out_shape))
    return y + delta.astype(y.dtype)


def merge_on_use(module: nn.Module, w: jax.Array) -> jax.Array:
    """w + A B' (one layer's matrix) when the layer carries an adapter, else w."""
    if not module.has_variable("params", "lora_a"):
        return w
    a = module.get_variable("params", "lora_a")
    b = module.get_variable("params", "lora_b")
    return (w.astype(jnp.float32) + (a @ b).reshape(w.shape)).astype(w.dtype)
