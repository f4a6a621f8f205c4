"""`tree_attention`: the entry point, its checks and the choice of implementation."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from kernels.dispatch import by_platform
from kernels.tree_attention.pallas import tree_flash
from kernels.tree_attention.reference import tree_attention_reference

IMPLS = ("reference", "pallas", "pallas_triton")


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _flash(q, k, v, kend, *, sm_scale, block, interpret):
    """The kernel on the decoder's layout: [B, T, heads, D] -> padded [B, heads, T, D]."""
    b, t, _, d = q.shape
    t_pad = -(-t // block) * block
    d_pad = max(16, 1 << (d - 1).bit_length())

    def inside(x):
        return _pad(_pad(jnp.swapaxes(x, 1, 2), 2, t_pad), 3, d_pad)

    kend = _pad(kend.astype(jnp.int32), 1, t_pad)  # padded keys: kend 0, seen by nobody
    o = tree_flash(inside(q), inside(k), inside(v), kend, sm_scale, block, interpret)
    return jnp.swapaxes(o[:, :, :t, :d], 1, 2)


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, kend: jax.Array, *,
                   sm_scale: float | None = None, impl: str | None = None, block: int = 64,
                   interpret: bool | None = None) -> jax.Array:
    """Attention over packed trees (module doc of kernels.tree_attention).

    Args:
      q: [batch, T, heads, head_dim]; k, v: [batch, T, kv_heads, head_dim] (heads a
        multiple of kv_heads).
      kend: [batch, T] int: key j is seen by the queries j <= i < kend[b, j] (0: by none).
      sm_scale: None = 1 / sqrt(head_dim). impl: "reference" (the dense mask) | "pallas" |
        "pallas_triton" (the Triton kernel, fwd and bwd) | None (= "reference": the kernel
        has not run on a GPU yet). block: the kernel's query and key tile (a power of two
        >= 16). interpret: the kernel in interpret mode; None = compiled when lowered for
        a GPU, interpreted elsewhere.
    Returns:
      [batch, T, heads, head_dim] in q's dtype; zeros for a query that sees no key.
    """
    impl = "reference" if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"tree_attention: impl must be one of {IMPLS} or None (no Mosaic "
                         f"kernel attends a tree yet), got {impl!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"tree_attention: block must be a power of two >= 16, got {block!r}")
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[:2] != k.shape[:2] \
            or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"tree_attention: q [B, T, H, D] and k, v [B, T, KVH, D] with H a "
                         f"multiple of KVH, got q {q.shape}, k {k.shape}, v {v.shape}")
    if kend.shape != q.shape[:2]:
        raise ValueError(f"tree_attention: kend must be [batch, T] = {q.shape[:2]}, got "
                         f"{kend.shape}")
    scale = float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    if impl == "reference":
        return tree_attention_reference(q, k, v, kend, scale)
    kernel = partial(_flash, sm_scale=scale, block=block)
    if interpret is not None:
        return kernel(q, k, v, kend, interpret=interpret)
    interpreted = partial(kernel, interpret=True)
    return by_platform(q, k, v, kend, gpu=partial(kernel, interpret=False), tpu=interpreted,
                       default=interpreted)
