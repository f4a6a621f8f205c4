"""Public entry point: segment decode attention with `impl=` dispatch and input checks."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels.dispatch import dispatch
from kernels.segment_decode.mosaic import segment_decode_attention_mosaic
from kernels.segment_decode.pallas import segment_decode_attention_pallas
from kernels.segment_decode.reference import segment_decode_attention_reference
from kernels.segment_decode.xla import segment_decode_attention_xla


def _check_lengths(x, name: str, shape: tuple[int, ...], upper: int) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    if not isinstance(x, jax.core.Tracer):  # concrete values can be range-checked here
        arr = np.asarray(x)
        if arr.size and (arr.min() < 0 or arr.max() > upper):
            raise ValueError(
                f"{name} must lie in [0, {upper}] (the segment's stored length), "
                f"got values in [{arr.min()}, {arr.max()}]"
            )
    # Under jit the values cannot be checked; clipping keeps every access in bounds.
    return jnp.clip(x.astype(jnp.int32), 0, upper)


def _check_inputs(q, k_prompt, v_prompt, k_resp, v_resp) -> None:
    for name, x, nd in (("q", q, 4), ("k_prompt", k_prompt, 4), ("v_prompt", v_prompt, 4),
                        ("k_resp", k_resp, 5), ("v_resp", v_resp, 5)):
        if x.ndim != nd:
            raise ValueError(f"{name} must have {nd} dimensions, got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}")
    dtypes = {x.dtype for x in (q, k_prompt, v_prompt, k_resp, v_resp)}
    if len(dtypes) != 1:
        raise ValueError(
            f"q, k_prompt, v_prompt, k_resp and v_resp must share one dtype, got "
            f"{[str(x.dtype) for x in (q, k_prompt, v_prompt, k_resp, v_resp)]}")
    if k_prompt.shape != v_prompt.shape:
        raise ValueError(f"k_prompt and v_prompt shapes differ: {k_prompt.shape} vs {v_prompt.shape}")
    if k_resp.shape != v_resp.shape:
        raise ValueError(f"k_resp and v_resp shapes differ: {k_resp.shape} vs {v_resp.shape}")
    g, n, heads, d = q.shape
    if min(g, n, heads, d) == 0:
        raise ValueError(f"q must have non-empty groups, N, heads and head_dim, got {q.shape}")
    if k_prompt.shape[0] != g or k_prompt.shape[3] != d:
        raise ValueError(
            f"k_prompt must be [groups={g}, P, kv_heads, head_dim={d}], got {k_prompt.shape}")
    if k_resp.shape[:2] != (g, n) or k_resp.shape[4] != d:
        raise ValueError(
            f"k_resp must be [groups={g}, N={n}, R_max, kv_heads, head_dim={d}], got {k_resp.shape}")
    kv_heads = k_prompt.shape[2]
    if k_resp.shape[3] != kv_heads:
        raise ValueError(
            f"k_prompt and k_resp must have the same kv_heads, got {kv_heads} and {k_resp.shape[3]}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")


def _check_scale_and_new(q, k_prompt, sm_scale, k_new, v_new):
    """(sm_scale as a finite float, None = 1 / sqrt(head_dim); k_new, v_new checked to be
    [groups, N, kv_heads, head_dim] together, in q's dtype)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is not None:
        want = (*q.shape[:2], k_prompt.shape[2], q.shape[3])
        if k_new.shape != want or v_new.shape != want:
            raise ValueError(f"k_new and v_new must be [groups, N, kv_heads, head_dim] = {want}, "
                             f"got {k_new.shape} and {v_new.shape}")
        k_new, v_new = k_new.astype(q.dtype), v_new.astype(q.dtype)
    return sm_scale, k_new, v_new


def segment_decode_attention(
    q: jax.Array,
    k_prompt: jax.Array,
    v_prompt: jax.Array,
    k_resp: jax.Array,
    v_resp: jax.Array,
    *,
    prompt_lengths: jax.Array,
    resp_lengths: jax.Array,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    sm_scale: float | None = None,
    impl: str | None = None,
    block_k: int = 128,
    interpret: bool | None = None,
) -> jax.Array:
    """Decode attention over a shared prompt segment plus a per-sample response segment.

    Each of the N samples of a group has one new query token. It attends to the first
    prompt_lengths[g] keys of its group's prompt segment (stored once per group) and to
    the first resp_lengths[g, n] keys of its own response segment. No causal mask: the
    query is the newest token, whose K/V the caller has already written into the
    response segment -- or passes it as k_new / v_new instead, which saves writing it into
    a copy of the segment (decode then writes it into the cache once, after all layers).
    Softmax in float32; a query with no valid key outputs zeros.

    Args:
      q: [groups, N, heads, head_dim].
      k_prompt, v_prompt: [groups, P, kv_heads, head_dim].
      k_resp, v_resp: [groups, N, R_max, kv_heads, head_dim].
      prompt_lengths: [groups] int, in [0, P] (may be 0).
      resp_lengths: [groups, N] int, in [0, R_max] (may be 0). Under jit, values outside
        the range cannot be checked and are clipped.
      k_new, v_new: [groups, N, kv_heads, head_dim] (optional, together): one more key /
        value per sample, outside the segments, always valid (the query's own token).
      sm_scale: score scale; None means 1 / sqrt(head_dim).
      impl: "reference" | "xla" | "pallas" | "pallas_triton" | "pallas_mosaic" | None
        (kernels.dispatch: None = Triton when lowered for GPU, Mosaic for TPU, XLA else).
      block_k: Pallas key tile (power of two >= 16); the response segment is split-K in
        tiles of block_k keys. Checked for every impl, used by "pallas" only.
      interpret: Pallas interpret mode; None = compiled on the kernel's platform (Triton:
        GPU, Mosaic: TPU) and interpreted elsewhere.
    Returns:
      [groups, N, heads, head_dim] in q's dtype. GQA: query head h uses kv head
      h // (heads // kv_heads).
    """
    _check_inputs(q, k_prompt, v_prompt, k_resp, v_resp)
    g, n = q.shape[:2]
    prompt_lengths = _check_lengths(prompt_lengths, "prompt_lengths", (g,), k_prompt.shape[1])
    resp_lengths = _check_lengths(resp_lengths, "resp_lengths", (g, n), k_resp.shape[2])
    if isinstance(block_k, bool) or not isinstance(block_k, int) or block_k < 16 \
            or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k!r}")
    sm_scale, k_new, v_new = _check_scale_and_new(q, k_prompt, sm_scale, k_new, v_new)
    args = (q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lengths, k_new, v_new)
    return dispatch(
        args, impl, interpret,
        reference=lambda *a: segment_decode_attention_reference(*a, sm_scale=sm_scale),
        xla=lambda *a: segment_decode_attention_xla(*a, sm_scale=sm_scale),
        triton=lambda *a, interpret: segment_decode_attention_pallas(
            *a, sm_scale=sm_scale, block_k=block_k, interpret=interpret),
        mosaic=lambda *a, interpret: segment_decode_attention_mosaic(
            *a, sm_scale=sm_scale, block_k=block_k, interpret=interpret))
