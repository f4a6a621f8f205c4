"""The one adapter to jax's PRIVATE cuDNN fused-attention module (NVIDIA only).

The split design (`split.py`) needs a flash kernel that returns its log-sum-exp and whose
backward takes an external residual (the MERGED output and lse). The public
`jax.nn.dot_product_attention` does not expose that backward, so this module binds the
two primitives of `jax._src.cudnn.fused_attention_stablehlo` directly:
  `_dot_product_attention_fwd_p_wrapper` (is_training=True -> output, softmax stats), and
  `_dot_product_attention_bwd_p_wrapper` (q, k, v, ..., stats, output, dO -> dq, dk, dv),
whose cuDNN graphs compute dS = P * (dP - rowsum(dO * O)) from the O and stats they are
GIVEN. The stats are the natural-log log-sum-exp of the scaled scores, `[B, H, T]` float32
(jax's tests compare them with `logsumexp`). Checked against the module of jax 0.10.2
(this CPU) and of jax's main branch at 0.11.1.dev (the GPU box runs 0.11.2): the
primitives, their parameters and operand order are the same. Nothing else in the project
may import the private module; if a jax version moves it, `cudnn_available()` turns
False and the dispatcher takes the Triton kernel instead.

Lowering: only for "cuda" (cuDNN custom calls `__cudnn$fmhaSoftmax` and
`__cudnn$fmhaSoftmaxBackward`); exportable from a CPU host (tests/kernels).
Limits (the dispatcher checks `cudnn_supports`): fp16 / bf16, head_dim a multiple of 8,
<= 128, or <= 256 on Hopper and later.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.shared_prefix_attention.split import FlashBackend

try:  # private module: pinned here and nowhere else
    from jax._src.cudnn import fused_attention_stablehlo as _fused
except ImportError:  # pragma: no cover - a jax without it: the dispatcher falls back
    _fused = None

CUDNN_CUSTOM_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
_NEEDED = ("_dot_product_attention_fwd_p_wrapper", "_dot_product_attention_bwd_p_wrapper",
           "MaskType", "AttentionLayout")


def cudnn_available() -> bool:
    """True when this jax has the private primitives the adapter binds."""
    return _fused is not None and all(hasattr(_fused, name) for name in _NEEDED)


def _local_gpu_is_hopper_or_later() -> bool:
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return False
    cap = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or not cap:
        return False
    return tuple(int(x) for x in str(cap).split(".")[:2]) >= (9, 0)


def cudnn_supports(dtype, head_dim: int) -> bool:
    """Whether the cuDNN backend takes inputs of this dtype and head dim. Head dims in
    (128, 256] only when this process sees a Hopper-or-later GPU (a CPU host lowering for
    cuda cannot know the chip, so it stays with <= 128)."""
    if not cudnn_available() or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16),
                                                         jnp.dtype(jnp.float16)):
        return False
    if head_dim % 8 or head_dim > 256:
        return False
    return head_dim <= 128 or _local_gpu_is_hopper_or_later()


def _mask_and_lengths(q, k, kv_lengths, causal: bool):
    mask_types = _fused.MaskType
    if kv_lengths is None:
        empty = jnp.zeros((0,), q.dtype)
        return (mask_types.CAUSAL if causal else mask_types.NO_MASK), empty, empty
    b, t = q.shape[:2]
    q_len = jnp.full((b,), t, jnp.int32)  # every query row is computed (padding: zeroed later)
    kv_len = jnp.clip(kv_lengths.astype(jnp.int32), 0, k.shape[1])
    return (mask_types.PADDING_CAUSAL if causal else mask_types.PADDING), q_len, kv_len


def _params(mask_type, scale: float) -> dict:
    return dict(scale=float(scale), seed=0, dropout_rate=0.0, variadic_args=(False, False),
                mask_type=mask_type, layout=_fused.AttentionLayout.BTNH.value,
                sliding_window_length=None)


def cudnn_forward(q, k, v, kv_lengths, *, causal: bool, scale: float):
    """(o `[B, T, H, D]`, lse `[B, H, T]` float32); the flash_xla contract."""
    mask_type, q_len, kv_len = _mask_and_lengths(q, k, kv_lengths, causal)
    unused = jnp.zeros((0,), q.dtype)
    o, lse = _fused._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, unused, q_len, kv_len, unused, unused, unused, unused,
        is_training=True, **_params(mask_type, scale))
    return o, lse


def cudnn_backward(q, k, v, kv_lengths, o, lse, do, *, causal: bool, scale: float):
    """(dq, dk, dv) from the given o, lse and dO; the flash_xla contract."""
    mask_type, q_len, kv_len = _mask_and_lengths(q, k, kv_lengths, causal)
    unused = jnp.zeros((0,), q.dtype)
    dq, dk, dv = _fused._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, q_len, kv_len, unused, unused, unused, unused,
        lse.astype(jnp.float32), o.astype(q.dtype), do.astype(q.dtype),
        **_params(mask_type, scale))
    return dq, dk, dv


CUDNN_FLASH = FlashBackend("cudnn", cudnn_forward, cudnn_backward)
