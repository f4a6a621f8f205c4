"""Mosaic-TPU segment decode attention: the two kernels of `pallas.py` for the TPU rules.

* Prompt kernel (Hydragen): grid (groups, query blocks, prompt splits). The group's N
  queries are folded per kv head ([kv_heads, N * heads_per_kv, head_dim]); each program
  DMAs one split of the prompt cache, `[split, kv_heads, head_dim]` (the cache's own
  layout: its last two dims are whole, as the TPU tiling rule asks, so no transposed copy
  of the cache is made), and runs an online softmax per kv head (a static loop) over the
  split's block_k tiles that hold valid keys.
* Response kernel (split-K): grid (groups, N, response tiles); one block_k tile of one
  sample's response segment, all kv heads; tiles past the ragged length report the
  empty state without computing.
Row statistics are `[rows, 1]` columns, lengths live in SMEM, query rows are padded to
16 (bf16 sublane tile). Split states are reduced and the segments merged in XLA
(`merge.py`), as for the Triton kernels. Tested in Pallas' TPU interpret mode on CPU and
lowered for "tpu" with jax.export in CI.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.dispatch import by_platform
from kernels.segment_decode.layout import fold_for_prompt, split_heads, unfold_from_prompt
from kernels.segment_decode.merge import (
    merge_attention_states, new_token_state, reduce_attention_states)

MIN_ROWS = 16
_F32 = jnp.float32
_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _pad_axis(x, axis, size):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _nt(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _params(interpret: bool, semantics: tuple[str, ...]):
    if interpret:
        return {"interpret": pltpu.InterpretParams()}
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=semantics)}


def _prompt_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, sm_scale, block_k,
                   blocks_per_split):
    """q_ref [kvh, bq, d]; k_ref, v_ref [split, kvh, d]; o_ref [kvh, bq, d]; m_ref, l_ref [kvh, bq, 1]."""
    length = len_ref[pl.program_id(0)]
    start = pl.program_id(2) * (blocks_per_split * block_k)
    n_tiles = jnp.clip(lax.div(length - start + block_k - 1, block_k), 0, blocks_per_split)
    kvh, rows, d = q_ref.shape
    for hi in range(kvh):
        q = q_ref[hi]

        def body(j, carry, hi=hi, q=q):
            acc, m, den = carry
            off = pl.multiple_of(j * block_k, block_k)
            k = k_ref[pl.ds(off, block_k), hi, :]
            s = _nt(q, k) * sm_scale
            valid = (start + off + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < length
            s = jnp.where(valid, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m - m_new)   # exp(-inf) = 0 on the first tile
            p = jnp.exp(s - m_new)
            v = v_ref[pl.ds(off, block_k), hi, :]
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=_F32)
            return alpha * acc + pv, m_new, alpha * den + jnp.sum(p, axis=1, keepdims=True)

        init = (jnp.zeros((rows, d), _F32), jnp.full((rows, 1), -jnp.inf, _F32),
                jnp.zeros((rows, 1), _F32))
        acc, m, den = lax.fori_loop(0, n_tiles, body, init)
        o_ref[hi] = acc / jnp.where(den > 0, den, 1.0)
        m_ref[hi] = m
        l_ref[hi] = den


def _response_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, sm_scale, block_k,
                     n_resp):
    """q_ref [kvh, rows, d]; k_ref, v_ref [block_k, kvh, d]; o_ref [kvh, rows, d]."""
    length = len_ref[pl.program_id(0) * n_resp + pl.program_id(1)]
    start = pl.program_id(2) * block_k
    kvh, rows, d = q_ref.shape

    @pl.when(start < length)
    def _compute():
        valid = (start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < length
        for hi in range(kvh):
            s = jnp.where(valid, _nt(q_ref[hi], k_ref[:, hi, :]) * sm_scale, -jnp.inf)
            m = jnp.max(s, axis=1, keepdims=True)   # finite: the tile holds a valid key
            p = jnp.exp(s - m)
            den = jnp.sum(p, axis=1, keepdims=True)
            v = v_ref[:, hi, :]
            o = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                preferred_element_type=_F32)
            o_ref[hi] = o / den
            m_ref[hi] = m
            l_ref[hi] = den

    @pl.when(start >= length)
    def _empty():
        o_ref[...] = jnp.zeros(o_ref.shape, _F32)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)


def prompt_state_mosaic(q, k_prompt, v_prompt, prompt_lengths, *, sm_scale, block_k,
                        blocks_per_split, block_q, interpret):
    """Partial state over the shared prompt, [groups, N, kv_heads, heads_per_kv(, d)]."""
    g, n, h, d = q.shape
    p, kvh = k_prompt.shape[1], k_prompt.shape[2]
    qf = fold_for_prompt(q, kvh)   # [g, kvh, M, d]
    m_rows = qf.shape[2]
    bq = min(block_q, max(MIN_ROWS, _next_pow2(m_rows)))
    m_pad = pl.cdiv(m_rows, bq) * bq
    qf = _pad_axis(qf, 2, m_pad)
    bps = min(blocks_per_split, pl.cdiv(p, block_k))
    split = bps * block_k
    p_pad = pl.cdiv(p, split) * split
    k_prompt, v_prompt = _pad_axis(k_prompt, 1, p_pad), _pad_axis(v_prompt, 1, p_pad)
    splits = p_pad // split
    kernel = partial(_prompt_kernel, sm_scale=sm_scale, block_k=block_k, blocks_per_split=bps)
    stat = pl.BlockSpec((None, kvh, None, bq, 1), lambda gi, qi, si: (gi, 0, si, qi, 0))
    o, m, den = pl.pallas_call(
        kernel, grid=(g, m_pad // bq, splits),
        in_specs=[_SMEM,
                  pl.BlockSpec((None, kvh, bq, d), lambda gi, qi, si: (gi, 0, qi, 0)),
                  pl.BlockSpec((None, split, kvh, d), lambda gi, qi, si: (gi, si, 0, 0)),
                  pl.BlockSpec((None, split, kvh, d), lambda gi, qi, si: (gi, si, 0, 0))],
        out_specs=[pl.BlockSpec((None, kvh, None, bq, d), lambda gi, qi, si: (gi, 0, si, qi, 0)),
                   stat, stat],
        out_shape=[jax.ShapeDtypeStruct((g, kvh, splits, m_pad, d), _F32),
                   jax.ShapeDtypeStruct((g, kvh, splits, m_pad, 1), _F32),
                   jax.ShapeDtypeStruct((g, kvh, splits, m_pad, 1), _F32)],
        name="segment_decode_prompt_mosaic",
        **_params(interpret, ("parallel", "parallel", "parallel")),
    )(prompt_lengths.astype(jnp.int32), qf, k_prompt, v_prompt)
    o, m, den = reduce_attention_states(o, m[..., 0], den[..., 0], axis=2)
    o, m, den = o[:, :, :m_rows], m[:, :, :m_rows], den[:, :, :m_rows]
    return unfold_from_prompt(o, n), unfold_from_prompt(m, n), unfold_from_prompt(den, n)


def response_state_mosaic(q, k_resp, v_resp, resp_lengths, *, sm_scale, block_k, interpret):
    """Split-K partial state over each sample's response, [groups, N, kv_heads, hpk(, d)]."""
    g, n, h, d = q.shape
    r_max, kvh = k_resp.shape[2], k_resp.shape[3]
    hpk = h // kvh
    rows = max(MIN_ROWS, _next_pow2(hpk))
    q5 = _pad_axis(split_heads(q, kvh), 3, rows)   # [g, n, kvh, rows, d]
    r_pad = pl.cdiv(r_max, block_k) * block_k
    k_resp, v_resp = _pad_axis(k_resp, 2, r_pad), _pad_axis(v_resp, 2, r_pad)
    splits = r_pad // block_k
    kernel = partial(_response_kernel, sm_scale=sm_scale, block_k=block_k, n_resp=n)
    kv = pl.BlockSpec((None, None, block_k, kvh, d), lambda gi, ni, si: (gi, ni, si, 0, 0))
    stat = pl.BlockSpec((None, None, kvh, None, rows, 1),
                        lambda gi, ni, si: (gi, ni, 0, si, 0, 0))
    o, m, den = pl.pallas_call(
        kernel, grid=(g, n, splits),
        in_specs=[_SMEM,
                  pl.BlockSpec((None, None, kvh, rows, d), lambda gi, ni, si: (gi, ni, 0, 0, 0)),
                  kv, kv],
        out_specs=[pl.BlockSpec((None, None, kvh, None, rows, d),
                                lambda gi, ni, si: (gi, ni, 0, si, 0, 0)), stat, stat],
        out_shape=[jax.ShapeDtypeStruct((g, n, kvh, splits, rows, d), _F32),
                   jax.ShapeDtypeStruct((g, n, kvh, splits, rows, 1), _F32),
                   jax.ShapeDtypeStruct((g, n, kvh, splits, rows, 1), _F32)],
        name="segment_decode_response_mosaic",
        **_params(interpret, ("parallel", "parallel", "parallel")),
    )(resp_lengths.reshape(g * n).astype(jnp.int32), q5, k_resp, v_resp)
    o, m, den = reduce_attention_states(o, m[..., 0], den[..., 0], axis=3)
    return o[:, :, :, :hpk], m[:, :, :, :hpk], den[:, :, :, :hpk]


def _empty_state(g, n, kvh, hpk, d):
    return (jnp.zeros((g, n, kvh, hpk, d), _F32), jnp.full((g, n, kvh, hpk), -jnp.inf, _F32),
            jnp.zeros((g, n, kvh, hpk), _F32))


@partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "blocks_per_split",
                                   "block_q"))
def _mosaic(q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lengths, k_new, v_new,
            *, sm_scale, block_k, interpret, blocks_per_split, block_q):
    g, n, h, d = q.shape
    kvh = k_prompt.shape[2]
    if k_prompt.shape[1] == 0:
        prompt = _empty_state(g, n, kvh, h // kvh, d)
    else:
        prompt = prompt_state_mosaic(q, k_prompt, v_prompt, prompt_lengths, sm_scale=sm_scale,
                                     block_k=block_k, blocks_per_split=blocks_per_split,
                                     block_q=block_q, interpret=interpret)
    if k_resp.shape[2] == 0:
        resp = _empty_state(g, n, kvh, h // kvh, d)
    else:
        resp = response_state_mosaic(q, k_resp, v_resp, resp_lengths, sm_scale=sm_scale,
                                     block_k=block_k, interpret=interpret)
    o, m, den = merge_attention_states(*prompt, *resp)
    if k_new is not None:
        o, _, _ = merge_attention_states(o, m, den, *new_token_state(q, k_new, v_new, sm_scale))
    return o.reshape(g, n, h, d).astype(q.dtype)


def segment_decode_attention_mosaic(
    q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lengths, k_new=None,
    v_new=None, *, sm_scale: float, block_k: int = 128, interpret: bool | None = None,
    blocks_per_split: int = 4, block_q: int = 64,
):
    """Mosaic-TPU segment decode attention (inputs validated by the public entry).

    Shapes as in `kernels.segment_decode.segment_decode_attention`; returns
    [groups, N, heads, head_dim] in q's dtype. interpret: None = compiled when lowered
    for TPU, TPU interpret mode elsewhere.
    """
    args = (q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lengths, k_new, v_new)
    kw = dict(sm_scale=sm_scale, block_k=block_k, blocks_per_split=blocks_per_split,
              block_q=block_q)
    if interpret is None:
        def run(interp):
            return lambda *a: _mosaic(*a, interpret=interp, **kw)
        return by_platform(*args, gpu=run(True), tpu=run(False), default=run(True))
    return _mosaic(*args, interpret=bool(interpret), **kw)
