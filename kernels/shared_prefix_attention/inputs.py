"""Boundary checks shared by every implementation of shared-prefix attention.

All shape errors are raised here, once, with a message that names the argument, so the
reference / XLA / Pallas paths can assume consistent shapes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity" for masked logits: exp() of it underflows to exactly 0, and a
# fully masked row (only ever a padded query row) stays finite instead of becoming NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class Dims(NamedTuple):
    groups: int
    n_resp: int
    prompt_len: int
    resp_len: int
    heads: int
    kv_heads: int
    head_dim: int


def _shape_error(name: str, expected: str, got) -> ValueError:
    return ValueError(f"{name} must have shape {expected}, got {tuple(got)}")


def check_dims(q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp) -> Dims:
    """Check ranks, matching sizes, GQA divisibility and dtypes; return the sizes."""
    arrays = dict(q_prompt=q_prompt, k_prompt=k_prompt, v_prompt=v_prompt,
                  q_resp=q_resp, k_resp=k_resp, v_resp=v_resp)
    for name, x in arrays.items():
        want = 4 if name.endswith("prompt") else 5
        if getattr(x, "ndim", None) != want:
            layout = ("[groups, P, heads, head_dim]" if want == 4
                      else "[groups, N, R, heads, head_dim]")
            raise ValueError(f"{name} must be a rank-{want} array {layout}, got "
                             f"{type(x).__name__} with shape {getattr(x, 'shape', None)}")
    g, p, h, d = q_prompt.shape
    _, n, r, _, _ = q_resp.shape
    kvh = k_prompt.shape[2]
    if g == 0 or p == 0:
        raise ValueError(f"q_prompt needs groups >= 1 and P >= 1, got shape {q_prompt.shape}")
    if n == 0:
        raise ValueError(f"q_resp has N = 0 responses (shape {q_resp.shape}); pass N >= 1")
    if r == 0:
        raise ValueError(f"q_resp has R = 0 response tokens (shape {q_resp.shape}); "
                         "pass R >= 1 and mark short responses with resp_lengths")
    if kvh == 0 or h % kvh != 0:
        raise ValueError(f"heads ({h}, from q_prompt) must be a positive multiple of kv_heads "
                         f"({kvh}, from k_prompt) for grouped-query attention")
    expect = {
        "k_prompt": ((g, p, kvh, d), "[groups, P, kv_heads, head_dim]"),
        "v_prompt": ((g, p, kvh, d), "[groups, P, kv_heads, head_dim]"),
        "q_resp": ((g, n, r, h, d), "[groups, N, R, heads, head_dim]"),
        "k_resp": ((g, n, r, kvh, d), "[groups, N, R, kv_heads, head_dim]"),
        "v_resp": ((g, n, r, kvh, d), "[groups, N, R, kv_heads, head_dim]"),
    }
    for name, (shape, layout) in expect.items():
        got = arrays[name].shape
        if got != shape:
            what = ", ".join(
                f"{axis} {gv} != {ev}"
                for axis, gv, ev in zip(layout.strip("[]").split(", "), got, shape)
                if gv != ev
            )
            raise ValueError(
                f"{name} must have shape {layout} = {shape} to match q_prompt "
                f"{q_prompt.shape} and q_resp {q_resp.shape}, got {got} ({what})")
    dtypes = {name: jnp.dtype(x.dtype) for name, x in arrays.items()}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"q/k/v inputs must share one dtype, got {dtypes}")
    if not jnp.issubdtype(dtypes["q_prompt"], jnp.floating):
        raise ValueError(f"q/k/v must be floating point, got {dtypes['q_prompt']}")
    return Dims(g, n, p, r, h, kvh, d)


def _check_length_values(name: str, x, upper: int) -> None:
    """Range-check lengths when they are concrete (under jit they are clipped instead)."""
    if isinstance(x, jax.core.Tracer):
        return
    values = np.asarray(x)
    if values.size and (values.min() < 0 or values.max() > upper):
        raise ValueError(f"{name} must lie in [0, {upper}], got min {values.min()} "
                         f"and max {values.max()}")


def _as_lengths(name: str, x, shape: tuple[int, ...], layout: str, upper: int):
    if not isinstance(x, (jax.Array, np.ndarray)):   # lists / tuples of ints
        x = np.asarray(x)
    if x.shape != shape:
        raise _shape_error(name, f"{layout} = {shape}", x.shape)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be integers, got dtype {x.dtype}")
    _check_length_values(name, x, upper)
    return jnp.clip(jnp.asarray(x, jnp.int32), 0, upper)


def normalize_lengths(prompt_lengths, resp_lengths, dims: Dims):
    """Return int32 lengths `[groups]`, `[groups, N]`, filling None with full lengths."""
    g, n, p, r = dims.groups, dims.n_resp, dims.prompt_len, dims.resp_len
    if prompt_lengths is None:
        prompt_lengths = jnp.full((g,), p, jnp.int32)
    else:
        prompt_lengths = _as_lengths("prompt_lengths", prompt_lengths, (g,), "[groups]", p)
    if resp_lengths is None:
        resp_lengths = jnp.full((g, n), r, jnp.int32)
    else:
        resp_lengths = _as_lengths("resp_lengths", resp_lengths, (g, n), "[groups, N]", r)
    return prompt_lengths, resp_lengths


def normalize_scale(sm_scale, head_dim: int) -> float:
    """Default 1/sqrt(head_dim); reject non-positive or non-finite scales."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(sm_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")
    return scale
