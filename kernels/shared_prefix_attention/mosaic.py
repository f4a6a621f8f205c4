"""Mosaic-TPU shared-prefix attention (DualKV): forward and backward kernels, one custom_vjp.

The same six launches as `pallas.py` (the Triton kernels), written for the TPU tiling rules:

  * heads-major layout inside the kernels, `[S, H, L, D]` (transposed in the wrapper), so
    every block's last two dims are (rows, head_dim) with rows a multiple of 16 and
    head_dim the full array dim (no head-dim padding);
  * 2-D values only: row statistics are `[rows, 1]` columns (`lse`, `delta`), iotas are
    2-D, and the online-softmax state is (acc `[bq, D]`, m `[bq, 1]`, den `[bq, 1]`);
  * sequence lengths live in SMEM (whole arrays) and are read with the program ids;
  * key/query tiles inside a resident block are sliced with `pl.ds(pl.multiple_of(...))`;
  * the prompt dk/dv launch iterates the group's N responses on the last grid axis
    ("arbitrary") and accumulates into its fp32 output block, which stays resident.
Tested on CPU in Pallas' TPU interpret mode (`pltpu.InterpretParams()`) and lowered for
"tpu" with jax.export in CI; the Mosaic compiler itself only runs on a TPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.dispatch import by_platform
from kernels.shared_prefix_attention.config import BlockSizes
from kernels.shared_prefix_attention.inputs import MASK_VALUE

_F32 = jnp.float32
MIN_TILE = 16   # bf16 packs 16 rows per (sublane) tile; f32 needs 8


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _cdiv(x, b: int):
    return lax.div(x + (b - 1), b)


@dataclasses.dataclass(frozen=True)
class _Plan:
    n_resp: int
    rep: int
    scale: float
    p_pad: int
    r_pad: int
    bq_p: int
    bk_p: int
    bq_r: int
    bk_r: int
    bq_p_bwd: int
    bk_p_bwd: int
    bq_r_bwd: int
    bk_r_bwd: int
    interpret: bool


def _make_plan(p, r, n, rep, scale, bs: BlockSizes, interpret: bool) -> _Plan:
    def tiles(length):
        cap = max(MIN_TILE, _next_pow2(length))
        sizes = tuple(min(max(b, MIN_TILE), cap) for b in
                      (bs.block_q, bs.block_k, bs.block_q_bwd, bs.block_k_bwd))
        return sizes, _round_up(length, max(sizes))

    (bq_p, bk_p, bqb_p, bkb_p), p_pad = tiles(p)
    (bq_r, bk_r, bqb_r, bkb_r), r_pad = tiles(r)
    return _Plan(n, rep, scale, p_pad, r_pad, bq_p, bk_p, bq_r, bk_r,
                 bqb_p, bkb_p, bqb_r, bkb_r, interpret)


# ----------------------------------------------------------------------------- tile math

def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=_F32)


def _nt(a, b):   # a [m, d] · b [n, d]ᵀ
    return _dot(a, b, ((1,), (1,)))


def _nn(a, b):   # a [m, n] · b [n, d]
    return _dot(a, b, ((1,), (0,)))


def _tn(a, b):   # a [m, n]ᵀ · b [m, d]
    return _dot(a, b, ((0,), (0,)))


def _rows(i, b):
    return i * b + lax.broadcasted_iota(jnp.int32, (b, 1), 0)


def _cols(t, b):
    return t * b + lax.broadcasted_iota(jnp.int32, (1, b), 1)


def _tile(ref, t, b):
    return ref[pl.ds(pl.multiple_of(t * b, b), b), :]


def _softmax_step(state, q, k, v, mask, scale):
    acc, m, den = state
    s = jnp.where(mask, _nt(q, k) * scale, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    den = alpha * den + jnp.sum(p, axis=1, keepdims=True)
    return alpha * acc + _nn(p.astype(v.dtype), v), m_new, den


def _init_state(bq, d):
    return (jnp.zeros((bq, d), _F32), jnp.full((bq, 1), MASK_VALUE, _F32),
            jnp.zeros((bq, 1), _F32))


def _store(o_ref, lse_ref, state, row_valid):
    acc, m, den = state
    l_safe = jnp.where(den == 0.0, 1.0, den)
    o_ref[...] = jnp.where(row_valid, acc / l_safe, 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(row_valid, m + jnp.log(l_safe), 0.0)


def _grad_tile(q, do, lse, delta, k, v, mask, scale):
    p = jnp.where(mask, jnp.exp(_nt(q, k) * scale - lse), 0.0)
    return p, p * (_nt(do, v) - delta)


def _lengths(plen_ref, rlen_ref, n):
    s = pl.program_id(0)
    return plen_ref[lax.div(s, n)], rlen_ref[s]


# ----------------------------------------------------------------------------- forward

def _fwd_prompt_kernel(plen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, plan: _Plan):
    bq, bk = plan.bq_p, plan.bk_p
    i = pl.program_id(2)
    plen = plen_ref[pl.program_id(0)]
    rows, q = _rows(i, bq), q_ref[...]
    n_tiles = jnp.where(i * bq < plen, jnp.minimum(_cdiv((i + 1) * bq, bk), _cdiv(plen, bk)), 0)

    def body(t, state):
        cols = _cols(t, bk)
        mask = (cols <= rows) & (cols < plen)
        return _softmax_step(state, q, _tile(k_ref, t, bk), _tile(v_ref, t, bk), mask,
                             plan.scale)

    state = lax.fori_loop(0, n_tiles, body, _init_state(bq, q.shape[1]))
    _store(o_ref, lse_ref, state, rows < plen)


def _fwd_resp_kernel(plen_ref, rlen_ref, q_ref, kp_ref, vp_ref, kr_ref, vr_ref, o_ref,
                     lse_ref, *, plan: _Plan):
    bq, bkp, bkr = plan.bq_r, plan.bk_p, plan.bk_r
    i = pl.program_id(2)
    plen, rlen = _lengths(plen_ref, rlen_ref, plan.n_resp)
    rows, q = _rows(i, bq), q_ref[...]
    live = i * bq < rlen
    n_prompt = jnp.where(live, _cdiv(plen, bkp), 0)
    n_own = jnp.where(live, jnp.minimum(_cdiv((i + 1) * bq, bkr), _cdiv(rlen, bkr)), 0)

    def prompt_body(t, state):
        mask = jnp.broadcast_to(_cols(t, bkp) < plen, (bq, bkp))
        return _softmax_step(state, q, _tile(kp_ref, t, bkp), _tile(vp_ref, t, bkp), mask,
                             plan.scale)

    def own_body(t, state):
        cols = _cols(t, bkr)
        mask = (cols <= rows) & (cols < rlen)
        return _softmax_step(state, q, _tile(kr_ref, t, bkr), _tile(vr_ref, t, bkr), mask,
                             plan.scale)

    state = lax.fori_loop(0, n_prompt, prompt_body, _init_state(bq, q.shape[1]))
    state = lax.fori_loop(0, n_own, own_body, state)
    _store(o_ref, lse_ref, state, rows < rlen)


# ----------------------------------------------------------------------------- backward

def _dq_prompt_kernel(plen_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, *,
                      plan: _Plan):
    bq, bk = plan.bq_p_bwd, plan.bk_p_bwd
    i = pl.program_id(2)
    plen = plen_ref[pl.program_id(0)]
    rows = _rows(i, bq)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    n_tiles = jnp.where(i * bq < plen, jnp.minimum(_cdiv((i + 1) * bq, bk), _cdiv(plen, bk)), 0)

    def body(t, dq):
        k = _tile(k_ref, t, bk)
        mask = (_cols(t, bk) <= rows) & (rows < plen)
        _, ds = _grad_tile(q, do, lse, delta, k, _tile(v_ref, t, bk), mask, plan.scale)
        return dq + _nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, n_tiles, body, jnp.zeros(q.shape, _F32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dq_resp_kernel(plen_ref, rlen_ref, q_ref, do_ref, lse_ref, delta_ref, kp_ref, vp_ref,
                    kr_ref, vr_ref, dq_ref, *, plan: _Plan):
    bq, bkp, bkr = plan.bq_r_bwd, plan.bk_p_bwd, plan.bk_r_bwd
    i = pl.program_id(2)
    plen, rlen = _lengths(plen_ref, rlen_ref, plan.n_resp)
    rows = _rows(i, bq)
    row_ok = rows < rlen
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    live = i * bq < rlen
    n_prompt = jnp.where(live, _cdiv(plen, bkp), 0)
    n_own = jnp.where(live, jnp.minimum(_cdiv((i + 1) * bq, bkr), _cdiv(rlen, bkr)), 0)

    def prompt_body(t, dq):
        k = _tile(kp_ref, t, bkp)
        mask = row_ok & (_cols(t, bkp) < plen)
        _, ds = _grad_tile(q, do, lse, delta, k, _tile(vp_ref, t, bkp), mask, plan.scale)
        return dq + _nn(ds.astype(k.dtype), k)

    def own_body(t, dq):
        k = _tile(kr_ref, t, bkr)
        mask = row_ok & (_cols(t, bkr) <= rows)
        _, ds = _grad_tile(q, do, lse, delta, k, _tile(vr_ref, t, bkr), mask, plan.scale)
        return dq + _nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, n_prompt, prompt_body, jnp.zeros(q.shape, _F32))
    dq = lax.fori_loop(0, n_own, own_body, dq)
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _accumulate(carry, q, do, lse, delta, k, v, mask, scale):
    dk, dv = carry
    p, ds = _grad_tile(q, do, lse, delta, k, v, mask, scale)
    return dk + _tn(ds.astype(q.dtype), q), dv + _tn(p.astype(do.dtype), do)


def _dkdv_resp_kernel(rlen_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref,
                      dv_ref, *, plan: _Plan):
    bq, bk = plan.bq_r_bwd, plan.bk_r_bwd
    j = pl.program_id(2)
    rlen = rlen_ref[pl.program_id(0)]
    cols = _cols(j, bk)
    k, v = k_ref[...], v_ref[...]
    first = lax.div(j * bk, bq)
    last = jnp.where(j * bk < rlen, _cdiv(rlen, bq), first)

    def body(t, carry):
        rows = _rows(t, bq)
        mask = (cols <= rows) & (rows < rlen)
        return _accumulate(carry, _tile(q_ref, t, bq), _tile(do_ref, t, bq),
                           _tile(lse_ref, t, bq), _tile(delta_ref, t, bq), k, v, mask,
                           plan.scale)

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(first, last, body, (zeros, zeros))
    dk_ref[...] = dk * plan.scale
    dv_ref[...] = dv


def _dkdv_prompt_kernel(plen_ref, rlen_ref, k_ref, v_ref, qp_ref, dop_ref, lsep_ref,
                        deltap_ref, qr_ref, dor_ref, lser_ref, deltar_ref, dk_ref, dv_ref, *,
                        plan: _Plan):
    """Grid (G, H, key tiles, N): the prompt's own queries at n == 0, then response n's."""
    bqp, bqr, bk = plan.bq_p_bwd, plan.bq_r_bwd, plan.bk_p_bwd
    g, j, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    plen = plen_ref[g]
    rlen = rlen_ref[g * plan.n_resp + n]
    cols = _cols(j, bk)
    live = j * bk < plen
    k, v = k_ref[...], v_ref[...]
    zeros = jnp.zeros(k.shape, _F32)

    @pl.when(n == 0)
    def _prompt_queries():
        def body(t, carry):
            rows = _rows(t, bqp)
            mask = (cols <= rows) & (rows < plen)
            return _accumulate(carry, _tile(qp_ref, t, bqp), _tile(dop_ref, t, bqp),
                               _tile(lsep_ref, t, bqp), _tile(deltap_ref, t, bqp), k, v,
                               mask, plan.scale)

        first = lax.div(j * bk, bqp)
        dk, dv = lax.fori_loop(first, jnp.where(live, _cdiv(plen, bqp), first), body,
                               (zeros, zeros))
        dk_ref[...] = dk * plan.scale
        dv_ref[...] = dv

    def resp_body(t, carry):   # every response query sees every valid prompt key
        rows = _rows(t, bqr)
        mask = (rows < rlen) & (cols < plen)
        return _accumulate(carry, _tile(qr_ref, t, bqr), _tile(dor_ref, t, bqr),
                           _tile(lser_ref, t, bqr), _tile(deltar_ref, t, bqr), k, v, mask,
                           plan.scale)

    dk, dv = lax.fori_loop(0, jnp.where(live, _cdiv(rlen, bqr), 0), resp_body, (zeros, zeros))
    dk_ref[...] += dk * plan.scale
    dv_ref[...] += dv


# ----------------------------------------------------------------------------- launches

def _call(kernel, plan: _Plan, grid, in_specs, out_specs, out_shape, name, semantics=None):
    if plan.interpret:
        kwargs = {"interpret": pltpu.InterpretParams()}
    else:
        sem = semantics or ("parallel",) * len(grid)
        kwargs = {"compiler_params": pltpu.CompilerParams(dimension_semantics=sem)}
    return pl.pallas_call(functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, name=name, **kwargs)


_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)


def _specs(plan: _Plan, d: int):
    n, rep = plan.n_resp, plan.rep

    def tile(b, last=None):   # [S, H, L, d|1] tile of rows i, query head h
        return pl.BlockSpec((None, None, b, last or d), lambda s, h, i, *_: (s, h, i, 0))

    def kv_tile(b):
        return pl.BlockSpec((None, None, b, d), lambda s, h, i, *_: (s, lax.div(h, rep), i, 0))

    def full_kv(length, of_group=False):
        if of_group:
            return pl.BlockSpec((None, None, length, d),
                                lambda s, h, i: (lax.div(s, n), lax.div(h, rep), 0, 0))
        return pl.BlockSpec((None, None, length, d), lambda s, h, i: (s, lax.div(h, rep), 0, 0))

    def full_q(length, last=None):
        return pl.BlockSpec((None, None, length, last or d), lambda s, h, i, *_: (s, h, 0, 0))

    return tile, kv_tile, full_kv, full_q


def _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan: _Plan):
    g, h, pp, d = qp.shape
    b, _, rp, _ = qr.shape
    tile, _, full_kv, _ = _specs(plan, d)
    o_p, lse_p = _call(
        _fwd_prompt_kernel, plan, (g, h, pp // plan.bq_p),
        [_SMEM, tile(plan.bq_p), full_kv(pp), full_kv(pp)],
        [tile(plan.bq_p), tile(plan.bq_p, 1)],
        [jax.ShapeDtypeStruct(qp.shape, qp.dtype), jax.ShapeDtypeStruct((g, h, pp, 1), _F32)],
        "spa_mosaic_fwd_prompt")(plen, qp, kp, vp)
    o_r, lse_r = _call(
        _fwd_resp_kernel, plan, (b, h, rp // plan.bq_r),
        [_SMEM, _SMEM, tile(plan.bq_r), full_kv(pp, True), full_kv(pp, True), full_kv(rp),
         full_kv(rp)],
        [tile(plan.bq_r), tile(plan.bq_r, 1)],
        [jax.ShapeDtypeStruct(qr.shape, qr.dtype), jax.ShapeDtypeStruct((b, h, rp, 1), _F32)],
        "spa_mosaic_fwd_resp")(plen, rlen, qr, kp, vp, kr, vr)
    return o_p, o_r, lse_p, lse_r


def _backward(plan: _Plan, res, cts):
    qp, kp, vp, qr, kr, vr, plen, rlen, o_p, o_r, lse_p, lse_r = res
    do_p, do_r = cts
    g, h, pp, d = qp.shape
    b, _, rp, _ = qr.shape
    kvh, n = kp.shape[1], plan.n_resp
    tile, kv_tile, full_kv, full_q = _specs(plan, d)
    delta_p = jnp.sum(do_p.astype(_F32) * o_p.astype(_F32), axis=-1, keepdims=True)
    delta_r = jnp.sum(do_r.astype(_F32) * o_r.astype(_F32), axis=-1, keepdims=True)
    bqp, bqr = plan.bq_p_bwd, plan.bq_r_bwd

    dq_p = _call(
        _dq_prompt_kernel, plan, (g, h, pp // bqp),
        [_SMEM, tile(bqp), tile(bqp), tile(bqp, 1), tile(bqp, 1), full_kv(pp), full_kv(pp)],
        tile(bqp), jax.ShapeDtypeStruct(qp.shape, qp.dtype),
        "spa_mosaic_bwd_dq_prompt")(plen, qp, do_p, lse_p, delta_p, kp, vp)
    dq_r = _call(
        _dq_resp_kernel, plan, (b, h, rp // bqr),
        [_SMEM, _SMEM, tile(bqr), tile(bqr), tile(bqr, 1), tile(bqr, 1), full_kv(pp, True),
         full_kv(pp, True), full_kv(rp), full_kv(rp)],
        tile(bqr), jax.ShapeDtypeStruct(qr.shape, qr.dtype),
        "spa_mosaic_bwd_dq_resp")(plen, rlen, qr, do_r, lse_r, delta_r, kp, vp, kr, vr)

    def per_head(seqs, length):
        return jax.ShapeDtypeStruct((seqs, h, length, d), _F32)

    bkr = plan.bk_r_bwd
    dk_r, dv_r = _call(
        _dkdv_resp_kernel, plan, (b, h, rp // bkr),
        [_SMEM, kv_tile(bkr), kv_tile(bkr), full_q(rp), full_q(rp), full_q(rp, 1),
         full_q(rp, 1)],
        [tile(bkr), tile(bkr)], [per_head(b, rp), per_head(b, rp)],
        "spa_mosaic_bwd_dkdv_resp")(rlen, kr, vr, qr, do_r, lse_r, delta_r)

    def resp_of_group(last=None):   # response n of group s, whole sequence, query head h
        return pl.BlockSpec((None, None, rp, last or d), lambda s, hh, j, m: (s * n + m, hh, 0, 0))

    bkp = plan.bk_p_bwd
    dk_p, dv_p = _call(
        _dkdv_prompt_kernel, plan, (g, h, pp // bkp, n),
        [_SMEM, _SMEM, kv_tile(bkp), kv_tile(bkp), full_q(pp), full_q(pp), full_q(pp, 1),
         full_q(pp, 1), resp_of_group(), resp_of_group(), resp_of_group(1), resp_of_group(1)],
        [tile(bkp), tile(bkp)], [per_head(g, pp), per_head(g, pp)],
        "spa_mosaic_bwd_dkdv_prompt",
        semantics=("parallel", "parallel", "parallel", "arbitrary"),
    )(plen, rlen, kp, vp, qp, do_p, lse_p, delta_p, qr, do_r, lse_r, delta_r)

    def sum_group(x, dtype):   # [S, H, L, D] fp32 per query head -> [S, KH, L, D]
        s, _, length, _ = x.shape
        return x.reshape(s, kvh, plan.rep, length, d).sum(axis=2).astype(dtype)

    dt = qp.dtype
    return (dq_p, sum_group(dk_p, dt), sum_group(dv_p, dt),
            dq_r, sum_group(dk_r, dt), sum_group(dv_r, dt), None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _core(qp, kp, vp, qr, kr, vr, plen, rlen, plan: _Plan):
    o_p, o_r, _, _ = _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan)
    return o_p, o_r


def _core_fwd(qp, kp, vp, qr, kr, vr, plen, rlen, plan: _Plan):
    o_p, o_r, lse_p, lse_r = _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan)
    return (o_p, o_r), (qp, kp, vp, qr, kr, vr, plen, rlen, o_p, o_r, lse_p, lse_r)


_core.defvjp(_core_fwd, _backward)


def shared_prefix_attention_mosaic(
    q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp, prompt_lengths, resp_lengths,
    sm_scale: float, block_sizes: BlockSizes | None = None, interpret: bool | None = None,
):
    """Mosaic-TPU kernels; same contract as `shared_prefix_attention_reference`.

    Args: as `shared_prefix_attention_pallas` (validated inputs). Tiles are powers of two
      of at least 16 rows (BlockSizes' Triton knobs are ignored). interpret: None =
      compiled when lowered for TPU, TPU interpret mode elsewhere.
    Returns: (o_prompt `[G, P, H, D]`, o_resp `[G, N, R, H, D]`) in the input dtype.
    """
    bs = BlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes or None, got {type(bs).__name__}")
    args = (q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp, prompt_lengths, resp_lengths)
    if interpret is None:
        def run(interp):
            return lambda *a: shared_prefix_attention_mosaic(*a, sm_scale, bs, interp)
        return by_platform(*args, gpu=run(True), tpu=run(False), default=run(True))
    g, p, h, d = q_prompt.shape
    n, r = q_resp.shape[1], q_resp.shape[2]
    plan = _make_plan(p, r, n, h // k_prompt.shape[2], sm_scale, bs, bool(interpret))

    def heads_major(x, length, target):   # [S, L, h, D] -> [S, h, target, D]
        x = jnp.pad(x, ((0, 0), (0, target - length), (0, 0), (0, 0)))
        return x.transpose(0, 2, 1, 3)

    def flat(x):
        return x.reshape((g * n,) + x.shape[2:])

    o_p, o_r = _core(
        heads_major(q_prompt, p, plan.p_pad), heads_major(k_prompt, p, plan.p_pad),
        heads_major(v_prompt, p, plan.p_pad), heads_major(flat(q_resp), r, plan.r_pad),
        heads_major(flat(k_resp), r, plan.r_pad), heads_major(flat(v_resp), r, plan.r_pad),
        prompt_lengths.astype(jnp.int32), resp_lengths.reshape(g * n).astype(jnp.int32), plan)
    o_p = o_p[:, :, :p].transpose(0, 2, 1, 3)
    o_r = o_r[:, :, :r].transpose(0, 2, 1, 3).reshape(g, n, r, h, d)
    return o_p, o_r
