"""One flash-attention call in plain XLA, with its log-sum-exp and an external-residual
backward: the XLA backend of the split design (`split.py`), the exact twin of the cuDNN
backend (`cudnn.py`) with the same contract.

Contract of a flash backend (both functions):
  q `[B, T, H, D]`, k/v `[B, S, KH, D]` with H % KH == 0 (grouped-query attention, query
  head h reads kv head h // (H // KH)); kv_lengths `[B]` int32 or None: keys j >= length
  are masked; causal: query i sees keys j <= i (top-left aligned, also when T != S).
  forward -> (o `[B, T, H, D]` in q's dtype, lse `[B, H, T]` float32, or float64 for
    float64 inputs; a row with no visible key gets o = 0 and lse = -inf).
  backward(q, k, v, kv_lengths, o, lse, do) -> (dq, dk, dv) in the inputs' dtype, computed
    from the GIVEN o and lse (not recomputed): p = exp(s - lse), dS = p * (dO V^T -
    rowsum(dO * o)). Fed a merged o / lse / dO it returns this part's share of the merged
    attention's gradient (`merge.py`).
Scores and softmax in float32 (or float64); bf16 probabilities are rounded to bf16 before
the PV product, as flash kernels do.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _scores_and_mask(q, k, kv_lengths, causal: bool, scale: float):
    """Scaled scores `[B, KH, rep, T, S]` in the accumulation dtype and the visibility mask
    `[B, 1, 1, T, S]`."""
    b, t, h, d = q.shape
    s_len, kvh = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkrd,bskd->bkrts", qg, k, preferred_element_type=_acc_dtype(q.dtype),
                   precision=jax.lax.Precision.HIGHEST) * scale
    mask = jnp.ones((1, t, s_len), bool)
    if causal:
        mask = mask & (jnp.arange(t)[:, None] >= jnp.arange(s_len)[None, :])[None]
    if kv_lengths is not None:
        mask = mask & (jnp.arange(s_len)[None, None, :] < kv_lengths[:, None, None])
    return s, mask[:, None, None]


def flash_forward_xla(q, k, v, kv_lengths, *, causal: bool, scale: float):
    """(o `[B, T, H, D]`, lse `[B, H, T]`); see the module docstring."""
    b, t, h, d = q.shape
    s, mask = _scores_and_mask(q, k, kv_lengths, causal, scale)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    seen = l > 0.0
    p = e / jnp.where(seen, l, 1.0)
    o = jnp.einsum("bkrts,bskd->btkrd", p.astype(v.dtype) if v.dtype.itemsize < 4 else p, v,
                   preferred_element_type=s.dtype, precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)[..., 0]
    return o.reshape(b, t, h, d).astype(q.dtype), lse.reshape(b, h, t)


def flash_backward_xla(q, k, v, kv_lengths, o, lse, do, *, causal: bool, scale: float):
    """(dq, dk, dv) of one part, from the given (possibly merged) o, lse and dO."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    rep = h // kvh
    hp = jax.lax.Precision.HIGHEST
    s, mask = _scores_and_mask(q, k, kv_lengths, causal, scale)
    acc = s.dtype
    lse = lse.astype(acc).reshape(b, kvh, rep, t)[..., None]
    ok = mask & (lse > -jnp.inf)
    p = jnp.where(ok, jnp.exp(s - jnp.where(ok, lse, 0.0)), 0.0)
    dog = do.reshape(b, t, kvh, rep, d)
    og = o.reshape(b, t, kvh, rep, d)
    qg = q.reshape(b, t, kvh, rep, d)
    low = q.dtype.itemsize < 4   # bf16 / fp16: matmul operands rounded like a flash kernel
    cast = (lambda x: x.astype(q.dtype)) if low else (lambda x: x)
    dv = jnp.einsum("bkrts,btkrd->bskd", cast(p), dog, preferred_element_type=acc,
                    precision=hp)
    dp = jnp.einsum("btkrd,bskd->bkrts", dog, v, preferred_element_type=acc, precision=hp)
    delta = jnp.einsum("btkrd,btkrd->bkrt", dog.astype(acc), og.astype(acc),
                       precision=hp)[..., None]
    ds = p * (dp - delta)
    dq = jnp.einsum("bkrts,bskd->btkrd", cast(ds), k, preferred_element_type=acc,
                    precision=hp) * scale
    dk = jnp.einsum("bkrts,btkrd->bskd", cast(ds), qg, preferred_element_type=acc,
                    precision=hp) * scale
    return (dq.reshape(b, t, h, d).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


def _backend():
    from kernels.shared_prefix_attention.split import FlashBackend
    return FlashBackend("xla", flash_forward_xla, flash_backward_xla)


XLA_FLASH = _backend()
