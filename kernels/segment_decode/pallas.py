"""Pallas segment decode attention: two kernels producing partial (o, m, l) states.

* Prompt kernel (Hydragen): grid (groups, kv_heads, query blocks, prompt splits). The
  group's N queries are folded into a [N * heads_per_kv, head_dim] matrix per kv head, so
  each prompt key tile is loaded once and multiplied against all N samples' queries. Each
  program runs an online softmax over its split of the prompt, stopping at the valid
  prompt length (tiles past it are never loaded).
* Response kernel (split-K / flash-decoding): grid (groups, N, kv_heads, response tiles);
  one program per block_k tile of one sample's response segment; tiles past the sample's
  ragged length are skipped and report the empty state.
Split states are reduced, and the two segments merged, in float32 by `merge.py`.

Written for the Triton backend on GPU (power-of-two tiles, >= 16 rows per dot, scalar
lengths read from a ref); on CPU it runs with interpret=True, which is how it is tested.
The Mosaic-TPU twin is `mosaic.py`.
P and R_max are zero-padded up to a multiple of block_k when needed (a copy): allocate
caches in multiples of block_k to avoid it.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels.segment_decode.layout import fold_for_prompt, split_heads, unfold_from_prompt
from kernels.segment_decode.merge import (
    merge_attention_states,
    new_token_state,
    reduce_attention_states,
)

MIN_ROWS = 16  # Triton's tl.dot needs at least 16 rows; query rows are zero-padded up to it.


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _compiler_params():
    # Selects the Triton backend when lowered for GPU; interpret mode ignores it.
    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _prompt_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                   sm_scale: float, block_k: int, blocks_per_split: int):
    """q_ref [block_q, d]; k_ref, v_ref [P_pad, d] (one group, one kv head); len_ref [1].

    Writes o_ref [block_q, d] (normalised), m_ref, l_ref [block_q] for this prompt split.
    """
    length = len_ref[0]
    start = pl.program_id(3) * (blocks_per_split * block_k)
    # Only tiles holding at least one valid key are visited, so m stays finite inside.
    n_tiles = jnp.clip((length - start + block_k - 1) // block_k, 0, blocks_per_split)
    q = q_ref[...]
    rows = q.shape[0]

    def body(j, carry):
        acc, m, l = carry
        off = start + j * block_k
        k = k_ref[pl.ds(off, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale
        valid = (off + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < length
        s = jnp.where(valid, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)  # exp(-inf) = 0 on the first tile
        p = jnp.exp(s - m_new[:, None])
        v = v_ref[pl.ds(off, block_k), :]
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, q.shape[1]), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_tiles, body, init)
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    m_ref[...] = m
    l_ref[...] = l


def tile_state(q_ref, k_ref, v_ref, valid, sm_scale: float):
    """The normalised partial state (o [rows, d], m, l [rows]) of one key tile: q_ref
    [rows, d], k_ref, v_ref [block_k, d], valid [1, block_k] (at least one True)."""
    s = jnp.dot(q_ref[...], k_ref[...].T, preferred_element_type=jnp.float32) * sm_scale
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=1)  # finite: the tile holds at least one valid key
    p = jnp.exp(s - m[:, None])
    l = jnp.sum(p, axis=1)
    v = v_ref[...]
    o = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o / l[:, None], m, l


def _response_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                     sm_scale: float, block_k: int):
    """q_ref [rows, d]; k_ref, v_ref [block_k, d] (one tile of one sample); len_ref [1].

    Writes the tile's partial state o_ref [rows, d], m_ref, l_ref [rows].
    """
    length = len_ref[0]
    start = pl.program_id(3) * block_k
    rows, d = q_ref.shape

    def compute():
        valid = (start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < length
        return tile_state(q_ref, k_ref, v_ref, valid, sm_scale)

    def empty():
        return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                jnp.zeros((rows,), jnp.float32))

    o, m, l = lax.cond(start < length, compute, empty)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def prompt_state_pallas(q, k_prompt, v_prompt, prompt_lengths, *, sm_scale, block_k,
                        blocks_per_split, block_q, interpret):
    """Partial state over the shared prompt segment, [groups, N, kv_heads, heads_per_kv(, d)]."""
    g, n, h, d = q.shape
    p, kvh = k_prompt.shape[1], k_prompt.shape[2]
    qf = fold_for_prompt(q, kvh)  # [g, kvh, M, d], M = n * heads_per_kv
    m_rows = qf.shape[2]
    bq = min(block_q, max(MIN_ROWS, _next_pow2(m_rows)))
    m_pad = pl.cdiv(m_rows, bq) * bq
    qf = _pad_axis(qf, 2, m_pad)
    p_pad = pl.cdiv(p, block_k) * block_k
    k_prompt = _pad_axis(k_prompt, 1, p_pad)
    v_prompt = _pad_axis(v_prompt, 1, p_pad)
    splits = pl.cdiv(p_pad // block_k, blocks_per_split)
    lengths = prompt_lengths.astype(jnp.int32)[:, None]  # [g, 1]

    kernel = partial(_prompt_kernel, sm_scale=sm_scale, block_k=block_k,
                     blocks_per_split=blocks_per_split)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(g, kvh, m_pad // bq, splits),
        in_specs=[
            pl.BlockSpec((None, 1), lambda gi, hi, qi, si: (gi, 0)),
            pl.BlockSpec((None, None, bq, d), lambda gi, hi, qi, si: (gi, hi, qi, 0)),
            pl.BlockSpec((None, p_pad, None, d), lambda gi, hi, qi, si: (gi, 0, hi, 0)),
            pl.BlockSpec((None, p_pad, None, d), lambda gi, hi, qi, si: (gi, 0, hi, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bq, d), lambda gi, hi, qi, si: (gi, hi, si, qi, 0)),
            pl.BlockSpec((None, None, None, bq), lambda gi, hi, qi, si: (gi, hi, si, qi)),
            pl.BlockSpec((None, None, None, bq), lambda gi, hi, qi, si: (gi, hi, si, qi)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((g, kvh, splits, m_pad, d), jnp.float32),
            jax.ShapeDtypeStruct((g, kvh, splits, m_pad), jnp.float32),
            jax.ShapeDtypeStruct((g, kvh, splits, m_pad), jnp.float32),
        ],
        compiler_params=_compiler_params(),
        interpret=interpret,
        name="segment_decode_prompt",
    )(lengths, qf, k_prompt, v_prompt)
    o, m, l = reduce_attention_states(o, m, l, axis=2)  # [g, kvh, m_pad(, d)]
    o, m, l = o[:, :, :m_rows], m[:, :, :m_rows], l[:, :, :m_rows]
    return unfold_from_prompt(o, n), unfold_from_prompt(m, n), unfold_from_prompt(l, n)


def response_state_pallas(q, k_resp, v_resp, resp_lengths, *, sm_scale, block_k, interpret):
    """Split-K partial state over each sample's response, [groups, N, kv_heads, heads_per_kv(, d)]."""
    g, n, h, d = q.shape
    r_max, kvh = k_resp.shape[2], k_resp.shape[3]
    hpk = h // kvh
    rows = max(MIN_ROWS, _next_pow2(hpk))
    q5 = _pad_axis(split_heads(q, kvh), 3, rows)  # [g, n, kvh, rows, d]
    r_pad = pl.cdiv(r_max, block_k) * block_k
    k_resp = _pad_axis(k_resp, 2, r_pad)
    v_resp = _pad_axis(v_resp, 2, r_pad)
    splits = r_pad // block_k
    lengths = resp_lengths.astype(jnp.int32)[:, :, None]  # [g, n, 1]

    kernel = partial(_response_kernel, sm_scale=sm_scale, block_k=block_k)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(g, n, kvh, splits),
        in_specs=[
            pl.BlockSpec((None, None, 1), lambda gi, ni, hi, si: (gi, ni, 0)),
            pl.BlockSpec((None, None, None, rows, d), lambda gi, ni, hi, si: (gi, ni, hi, 0, 0)),
            pl.BlockSpec((None, None, block_k, None, d), lambda gi, ni, hi, si: (gi, ni, si, hi, 0)),
            pl.BlockSpec((None, None, block_k, None, d), lambda gi, ni, hi, si: (gi, ni, si, hi, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, None, rows, d),
                         lambda gi, ni, hi, si: (gi, ni, hi, si, 0, 0)),
            pl.BlockSpec((None, None, None, None, rows), lambda gi, ni, hi, si: (gi, ni, hi, si, 0)),
            pl.BlockSpec((None, None, None, None, rows), lambda gi, ni, hi, si: (gi, ni, hi, si, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((g, n, kvh, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((g, n, kvh, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((g, n, kvh, splits, rows), jnp.float32),
        ],
        compiler_params=_compiler_params(),
        interpret=interpret,
        name="segment_decode_response",
    )(lengths, q5, k_resp, v_resp)
    o, m, l = reduce_attention_states(o, m, l, axis=3)  # [g, n, kvh, rows(, d)]
    return o[:, :, :, :hpk], m[:, :, :, :hpk], l[:, :, :, :hpk]


def _empty_state(g: int, n: int, kvh: int, hpk: int, d: int):
    return (jnp.zeros((g, n, kvh, hpk, d), jnp.float32),
            jnp.full((g, n, kvh, hpk), -jnp.inf, jnp.float32),
            jnp.zeros((g, n, kvh, hpk), jnp.float32))


@partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "blocks_per_split",
                                   "block_q"))
def segment_decode_attention_pallas(
    q: jax.Array, k_prompt: jax.Array, v_prompt: jax.Array, k_resp: jax.Array,
    v_resp: jax.Array, prompt_lengths: jax.Array, resp_lengths: jax.Array,
    k_new: jax.Array | None = None, v_new: jax.Array | None = None, *,
    sm_scale: float, block_k: int = 128, interpret: bool = False,
    blocks_per_split: int = 4, block_q: int = 64,
) -> jax.Array:
    """Pallas segment decode attention (inputs already validated by the public entry).

    Shapes as in `kernels.segment_decode.segment_decode_attention`; returns
    [groups, N, heads, head_dim] in q's dtype. `blocks_per_split` is the number of
    block_k tiles of the prompt one program handles (more splits = more parallelism for
    long prompts); `block_q` caps the folded query rows per program (power of two >= 16).
    k_new, v_new [groups, N, kv_heads, d] (optional): one more key per sample, merged as a
    third state (see merge.new_token_state). A head_dim that is not a power of two >= 16
    is zero-padded to one (Triton's tile rule).
    """
    g, n, h, d = q.shape
    dp = max(MIN_ROWS, _next_pow2(d))
    if dp != d:  # Triton tiles: head_dim a power of two >= 16; zero columns change nothing
        q, k_prompt, v_prompt, k_resp, v_resp, k_new, v_new = (
            None if x is None else _pad_axis(x, x.ndim - 1, dp)
            for x in (q, k_prompt, v_prompt, k_resp, v_resp, k_new, v_new))
        out = segment_decode_attention_pallas(
            q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lengths, k_new, v_new,
            sm_scale=sm_scale, block_k=block_k, interpret=interpret,
            blocks_per_split=blocks_per_split, block_q=block_q)
        return out[..., :d]
    p, kvh = k_prompt.shape[1], k_prompt.shape[2]
    r_max = k_resp.shape[2]
    if p == 0:
        prompt = _empty_state(g, n, kvh, h // kvh, d)
    else:
        prompt = prompt_state_pallas(
            q, k_prompt, v_prompt, prompt_lengths, sm_scale=sm_scale, block_k=block_k,
            blocks_per_split=blocks_per_split, block_q=block_q, interpret=interpret)
    if r_max == 0:
        resp = _empty_state(g, n, kvh, h // kvh, d)
    else:
        resp = response_state_pallas(q, k_resp, v_resp, resp_lengths, sm_scale=sm_scale,
                                     block_k=block_k, interpret=interpret)
    o, m, l = merge_attention_states(*prompt, *resp)
    if k_new is not None:
        o, _, _ = merge_attention_states(o, m, l, *new_token_state(q, k_new, v_new, sm_scale))
    return o.reshape(g, n, h, d).astype(q.dtype)
