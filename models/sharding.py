"""Logical axis names for model arrays and the default rules mapping them onto a mesh.

Params and activations are annotated with logical names (see LOGICAL_AXES); a rules table
maps each name onto mesh axes of a ("data", "fsdp", "tensor") mesh. Rules are applied in
order and a mesh axis is used at most once per array (flax semantics), so activations
[batch, seq, embed] shard batch over (data, fsdp) and leave embed whole, while a weight
[embed, mlp] shards embed over fsdp and mlp over tensor.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import linen as nn

MESH_AXES = ("data", "fsdp", "tensor")
LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
                "samples")

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("samples", None),  # the N samples of a group in the sampler's segmented KV cache
)


def make_mesh(
    data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over the first data*fsdp*tensor devices."""
    for name, size in (("data", data), ("fsdp", fsdp), ("tensor", tensor)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = data * fsdp * tensor
    if need > len(devices):
        raise ValueError(
            f"make_mesh: data*fsdp*tensor = {need} devices needed but only {len(devices)} "
            "available (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    grid = np.array(devices[:need], dtype=object).reshape(data, fsdp, tensor)
    return jax.sharding.Mesh(grid, MESH_AXES)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def logical_to_mesh_spec(
    axes: tuple[str | None, ...], rules: LogicalRules = DEFAULT_RULES
) -> jax.sharding.PartitionSpec:
    """PartitionSpec for one array's logical axes, e.g. ("embed", "mlp") -> P("fsdp", "tensor")."""
    unknown = [a for a in axes if a is not None and a not in {r[0] for r in rules}]
    if unknown:
        raise ValueError(f"logical axes {unknown} have no rule; known: {[r[0] for r in rules]}")
    return nn.logical_to_mesh_axes(axes, rules)


def logical_to_mesh_sharding(
    logical_axes_tree: Any, mesh: jax.sharding.Mesh, rules: LogicalRules = DEFAULT_RULES
) -> Any:
    """NamedSharding tree from a tree whose leaves are tuples of logical axis names
    (e.g. decoder.param_logical_axes(config))."""
    return jax.tree.map(
        lambda axes: jax.sharding.NamedSharding(mesh, logical_to_mesh_spec(axes, rules)),
        logical_axes_tree,
        is_leaf=_is_axes,
    )


@contextlib.contextmanager
def mesh_context(mesh: jax.sharding.Mesh, rules: LogicalRules = DEFAULT_RULES) -> Iterator[None]:
    """Activate `mesh` and the logical rules so the models' activation annotations
    (nn.with_logical_constraint) become sharding constraints in code traced inside.
    Flax's rules are not part of jit's cache key: trace a function under one context only."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
