"""Meshes for training and sampling: named presets, one validation against a model, and
pytree -> NamedSharding helpers.

The logical axis names and the rules table live in `models.sharding` (one source of
truth); this module only builds meshes and places pytrees with them:

    mesh = make_mesh_preset("fsdp+tp", tensor=2)         # all devices, tensor=2, fsdp=rest
    validate_mesh(mesh, model_config, batch=64)          # clear ValueError, before compiling
    params = jax.device_put(params, param_shardings(model_config, mesh))

Presets over n devices (`tensor` / `data` pick the sizes of the split axes):
  single      (1, 1, 1) on the first device
  dp          data=n            fsdp        fsdp=n            tp        tensor=n
  dp+fsdp     data=2, fsdp=n/2  dp+tp       data=n/t, tensor=t
  fsdp+tp     fsdp=n/t, tensor=t (t=2 unless given)
  dp+fsdp+tp  data=2, fsdp=n/(2t), tensor=t
or an explicit "data=2,fsdp=2,tensor=2". Devices come in `jax.devices()` order, which
groups each process's devices together: a multi-process mesh then gives every process a
contiguous block of batch rows (what `rl.learner.global_batch` relies on).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np

from models.config import ModelConfig
from models.decoder import init_params, param_logical_axes
from models.sharding import (
    DEFAULT_RULES,
    MESH_AXES,
    LogicalRules,
    logical_to_mesh_sharding,
    logical_to_mesh_spec,
    make_mesh,
)

MESH_PRESETS = ("single", "dp", "fsdp", "tp", "dp+fsdp", "dp+tp", "fsdp+tp", "dp+fsdp+tp")

# Which ModelConfig field sets each logical axis's size (for error messages).
_AXIS_FIELDS = {"vocab": "vocab_size", "embed": "hidden_size", "heads": "num_heads",
                "kv_heads": "num_kv_heads", "head_dim": "head_dim", "mlp": "intermediate_size",
                "layers": "num_layers"}


def _split(n: int, k: int, what: str, name: str) -> int:
    if k < 1 or n % k:
        raise ValueError(f"mesh preset {name!r}: {what}={k} does not divide the {n} devices; "
                         f"pick {what} among the divisors of {n}")
    return n // k


def preset_axes(name: str, num_devices: int, *, tensor: int | None = None,
                data: int | None = None) -> dict[str, int]:
    """{"data", "fsdp", "tensor"} sizes of preset `name` (see the module docstring) or of
    an explicit "data=2,fsdp=2,tensor=2" over `num_devices` devices."""
    n = num_devices
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_devices must be an int >= 1, got {n!r}")
    if "=" in name:
        sizes = {"data": 1, "fsdp": 1, "tensor": 1}
        for part in name.split(","):
            key, _, val = part.partition("=")
            key = {"dp": "data", "tp": "tensor"}.get(key.strip(), key.strip())
            if key not in sizes or not val.strip().isdigit() or int(val) < 1:
                raise ValueError(f"mesh spec {name!r}: expected comma-separated data=N, fsdp=N, "
                                 f"tensor=N with N >= 1, got {part!r}")
            sizes[key] = int(val)
        return sizes
    t = 2 if tensor is None else tensor
    d = 2 if data is None else data
    if name == "single":
        return {"data": 1, "fsdp": 1, "tensor": 1}
    if name == "dp":
        return {"data": n, "fsdp": 1, "tensor": 1}
    if name == "fsdp":
        return {"data": 1, "fsdp": n, "tensor": 1}
    if name == "tp":
        return {"data": 1, "fsdp": 1, "tensor": n if tensor is None else tensor}
    if name == "dp+fsdp":
        return {"data": d, "fsdp": _split(n, d, "data", name), "tensor": 1}
    if name == "dp+tp":
        return {"data": _split(n, t, "tensor", name), "fsdp": 1, "tensor": t}
    if name == "fsdp+tp":
        return {"data": 1, "fsdp": _split(n, t, "tensor", name), "tensor": t}
    if name == "dp+fsdp+tp":
        return {"data": d, "fsdp": _split(n, d * t, "data*tensor", name), "tensor": t}
    raise ValueError(f"unknown mesh preset {name!r}; choose one of {MESH_PRESETS} or an explicit "
                     "'data=N,fsdp=N,tensor=N'")


def make_mesh_preset(name: str, devices: Sequence[jax.Device] | None = None, *,
                     tensor: int | None = None, data: int | None = None) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh by preset name over `devices` (default: all devices of
    all processes). "single", "tp" with a given `tensor` and explicit specs may use only
    the first devices. Raises ValueError when the preset does not fit the device count."""
    devices = list(jax.devices() if devices is None else devices)
    return make_mesh(**preset_axes(name, len(devices), tensor=tensor, data=data), devices=devices)


def mesh_axes(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> dict[str, int]:
    """{"data", "fsdp", "tensor"} sizes of a mesh (missing axes count as 1)."""
    return {a: int(mesh.shape.get(a, 1)) for a in MESH_AXES}


def describe_mesh(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> str:
    """E.g. 'data=2 fsdp=2 tensor=2 (8 devices, 1 process)'."""
    sizes = mesh_axes(mesh)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return " ".join(f"{k}={v}" for k, v in sizes.items()) + " (abstract)"
    procs = len({d.process_index for d in mesh.devices.flat})
    return (" ".join(f"{k}={v}" for k, v in sizes.items())
            + f" ({mesh.devices.size} devices, {procs} process{'es' if procs > 1 else ''})")


def _mesh_size(mesh: jax.sharding.Mesh, entry: Any) -> tuple[int, str]:
    """Product of the mesh-axis sizes one PartitionSpec entry shards over, and its name."""
    if entry is None:
        return 1, ""
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    size = 1
    for a in names:
        size *= int(mesh.shape.get(a, 1))
    return size, "*".join(names)


def validate_mesh(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, model_config: ModelConfig,
                  *, batch: int | None = None,
                  num_slots: int | None = None, groups: int | None = None,
                  rules: LogicalRules = DEFAULT_RULES) -> None:
    """Check, before anything compiles, that `mesh` can hold `model_config`: every
    parameter dimension (heads, kv_heads, mlp, vocab, embed, ...) divides by the mesh axes
    the rules shard it over, and the batch rows / sampler slots / sampler groups (of the
    segmented KV cache) divide by data*fsdp.
    Raises ValueError naming the axis, the sizes and what to change. An AbstractMesh
    (sizes without devices) is checked the same way, e.g. to vet a pod's mesh on a laptop."""
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    missing = [a for a in MESH_AXES if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}; build the mesh with "
                         "rl.runtime.mesh.make_mesh_preset or models.sharding.make_mesh")
    if not isinstance(model_config, ModelConfig):
        raise ValueError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    axes = param_logical_axes(model_config)
    shapes = jax.eval_shape(lambda: init_params(model_config, 0))
    problems = {}
    for names, leaf in zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
                           jax.tree.leaves(shapes)):
        spec = logical_to_mesh_spec(names, rules)
        for logical, dim, entry in zip(names, leaf.shape, tuple(spec) + (None,) * len(names)):
            size, over = _mesh_size(mesh, entry)
            if dim % size:
                problems[logical] = (dim, over, size)
    if problems:
        lines = []
        for logical, (dim, over, size) in sorted(problems.items()):
            field = _AXIS_FIELDS.get(logical, logical)
            lines.append(f"{logical} = {dim} (ModelConfig.{field}) is not divisible by mesh axis "
                         f"{over} = {size}")
        raise ValueError(f"mesh {describe_mesh(mesh)} does not fit the model: " + "; ".join(lines)
                         + ". Choose a mesh whose sharded axes divide these sizes (e.g. a "
                         "smaller tensor axis, or tensor=1)")
    rows = mesh_axes(mesh)["data"] * mesh_axes(mesh)["fsdp"]
    for what, value in (("batch", batch), ("num_slots", num_slots), ("groups", groups)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{what} must be an int >= 1, got {value!r}")
        if value % rows:
            raise ValueError(f"{what} = {value} is not divisible by data*fsdp = {rows} of mesh "
                             f"{describe_mesh(mesh)}; make {what} a multiple of {rows} or use "
                             "fewer data/fsdp devices")


# ----------------------------------------------------------------------------- shardings
def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """The same full array on every device of `mesh`."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def logical_sharding(mesh: jax.sharding.Mesh, axes: tuple[str | None, ...],
                     rules: LogicalRules = DEFAULT_RULES) -> jax.sharding.NamedSharding:
    """NamedSharding of one array from its logical axis names, e.g. ("batch", "seq")."""
    return jax.sharding.NamedSharding(mesh, logical_to_mesh_spec(axes, rules))


def param_shardings(model_config: ModelConfig, mesh: jax.sharding.Mesh,
                    rules: LogicalRules = DEFAULT_RULES) -> Any:
    """NamedSharding tree matching init_params(model_config, ...), from the logical rules."""
    return logical_to_mesh_sharding(param_logical_axes(model_config), mesh, rules)


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Rows of every batch field (packed fields: groups) over ("data", "fsdp"); the rest of
    each array whole."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))


def with_shardings(tree: Any, shardings: Any) -> Any:
    """jax.ShapeDtypeStruct tree (shape, dtype of `tree`'s leaves: arrays or abstract
    values) carrying `shardings` (a tree of the same structure, or one sharding for
    all). E.g. the target of an orbax restore onto another mesh."""
    def spec(x, s):
        x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=s)

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: spec(x, shardings), tree)
    return jax.tree.map(spec, tree, shardings)


# ----------------------------------------------------------------------------- compiled HLO
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE_RE = re.compile(r"=\s*(.*?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE_RE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Every collective of a compiled module's text (`jitted.lower(...).compile()
    .as_text()`), as (kind, result shapes); async pairs count once (their -start)."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE_RE.search(line)
        if m is None:
            continue
        shapes = [tuple(int(d) for d in dims.split(",") if d)
                  for _, dims in _SHAPE_RE.findall(m.group(1))]
        if m.group(3) and len(shapes) > 1:  # an async start's tuple is (operands, results)
            shapes = shapes[len(shapes) // 2:]
        out.append((m.group(2), shapes))
    return out


def count_collectives(hlo_text: str) -> dict[str, int]:
    """{kind: count} over COLLECTIVES for a compiled module's text."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for kind, _ in collectives(hlo_text):
        counts[kind] += 1
    return counts


def full_array_gathers(hlo_text: str, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Names in `shapes` ({name: full shape}) that some all-gather of the module produces
    whole, e.g. a whole parameter or the whole KV cache re-assembled on every device.
    Matching is by shape, so give shapes that nothing else in the program has."""
    gathered = {s for kind, result in collectives(hlo_text) if kind == "all-gather"
                for s in result}
    return sorted(name for name, shape in shapes.items() if tuple(shape) in gathered)
