"""Pallas shared-prefix attention: fused forward and backward kernels, one custom_vjp.

Layout inside the kernels (after padding in the wrapper): prompt arrays `[G, Pp, h, Dp]`,
response arrays flattened to `[B = G*N, Rp, h, Dp]`, log-sum-exp `[*, H, len]` in fp32.

Launches (grids are `(sequence, query head, tile)`, written for the Triton lowering:
power-of-two tiles, ref slicing with `pl.ds`, fp32 online-softmax state in registers):
  forward  1. prompt queries: causal flash attention over the prompt tiles.
           2. response queries: iterate the prompt tiles, then the own-response tiles,
              carrying (acc, m, l); store o and lse = m + log l.
  backward 3. response dq: same two regions, p = exp(s - lse).
           4. response dk/dv: own response queries only (nobody else sees these keys).
           5. prompt dk/dv: the prompt's own causal queries, then all N responses' queries,
              accumulated in fp32 registers in one program per prompt key tile.
           6. prompt dq: causal over the prompt tiles.
dk/dv are produced per query head in fp32 and summed over each GQA group in XLA.
Masks inside the tiles handle ragged lengths; loops stop at the last live tile.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.dispatch import by_platform
from kernels.shared_prefix_attention.config import BlockSizes
from kernels.shared_prefix_attention.inputs import MASK_VALUE

_F32 = jnp.float32


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _cdiv(x, b: int):
    """Ceil-divide a non-negative traced int32 by a static int (Triton-friendly)."""
    return lax.div(x + (b - 1), b)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static launch plan (hashable: it is a nondiff argument of the custom_vjp)."""

    n_resp: int
    rep: int            # query heads per kv head
    scale: float
    p_pad: int
    r_pad: int
    bq_p: int           # forward tiles on the prompt sequence
    bk_p: int
    bq_r: int           # forward tiles on the response sequences
    bk_r: int
    bq_p_bwd: int       # backward tiles
    bk_p_bwd: int
    bq_r_bwd: int
    bk_r_bwd: int
    interpret: bool
    num_warps: int | None
    num_stages: int


def _make_plan(p: int, r: int, n: int, rep: int, scale: float, bs: BlockSizes,
               interpret: bool) -> _Plan:
    def tiles(length, bq, bk, bq_b, bk_b):
        cap = _next_pow2(length)
        sizes = tuple(min(b, cap) for b in (bq, bk, bq_b, bk_b))
        return sizes, _round_up(length, max(sizes))  # powers of two: max is a common multiple

    (bq_p, bk_p, bqb_p, bkb_p), p_pad = tiles(p, bs.block_q, bs.block_k,
                                               bs.block_q_bwd, bs.block_k_bwd)
    (bq_r, bk_r, bqb_r, bkb_r), r_pad = tiles(r, bs.block_q, bs.block_k,
                                               bs.block_q_bwd, bs.block_k_bwd)
    return _Plan(n, rep, scale, p_pad, r_pad, bq_p, bk_p, bq_r, bk_r,
                 bqb_p, bkb_p, bqb_r, bkb_r, interpret, bs.num_warps, bs.num_stages)


# ----------------------------------------------------------------------------- tile math

def _dot_nt(a, b):
    """a `[m, d]` · b `[n, d]`ᵀ -> `[m, n]` fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _dot_tn(a, b):
    """a `[m, n]`ᵀ · b `[m, d]` -> `[n, d]` fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot_nn(a, b):
    """a `[m, n]` · b `[n, d]` -> `[m, d]` fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _online_softmax_step(carry, q, k, v, mask, scale):
    """Fold one key tile into the running (acc `[bq, Dp]`, m `[bq]`, l `[bq]`)."""
    acc, m, l = carry
    s = jnp.where(mask, _dot_nt(q, k) * scale, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[:, None] * acc + _dot_nn(p.astype(v.dtype), v)
    return acc, m_new, l


def _init_state(bq: int, dp: int):
    return (jnp.zeros((bq, dp), _F32), jnp.full((bq,), -jnp.inf, _F32),
            jnp.zeros((bq,), _F32))


def _store_output(o_ref, lse_ref, state, row_valid):
    acc, m, l = state
    # padded rows saw no key (l == 0) or are zeroed anyway: divide safely, then zero
    l_safe = jnp.where(l == 0.0, 1.0, l)
    o = jnp.where(row_valid[:, None], acc / l_safe[:, None], 0.0)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(row_valid, m + jnp.log(l_safe), 0.0)


def _grad_tile(q, do, lse, delta, k, v, mask, scale):
    """Probabilities and score gradients of one (query tile, key tile) pair.

    Returns p `[bq, bk]` and ds `[bq, bk]` (ds without the softmax scale), fp32.
    """
    s = _dot_nt(q, k) * scale
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    dp = _dot_nt(do, v)
    return p, p * (dp - delta[:, None])


# ----------------------------------------------------------------------------- forward

def _fwd_prompt_kernel(plen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, plan: _Plan):
    bq, bk = plan.bq_p, plan.bk_p
    i = pl.program_id(2)
    plen = plen_ref[()]
    rows = i * bq + jnp.arange(bq)
    q = q_ref[...]
    n_tiles = jnp.where(i * bq < plen,
                        jnp.minimum(_cdiv((i + 1) * bq, bk), _cdiv(plen, bk)), 0)

    def body(t, state):
        cols = t * bk + jnp.arange(bk)
        mask = (cols[None, :] <= rows[:, None]) & (cols < plen)[None, :]
        return _online_softmax_step(state, q, k_ref[pl.ds(t * bk, bk), :],
                                    v_ref[pl.ds(t * bk, bk), :], mask, plan.scale)

    state = lax.fori_loop(0, n_tiles, body, _init_state(bq, q.shape[-1]))
    _store_output(o_ref, lse_ref, state, rows < plen)


def _fwd_resp_kernel(plen_ref, rlen_ref, q_ref, kp_ref, vp_ref, kr_ref, vr_ref,
                     o_ref, lse_ref, *, plan: _Plan):
    bq, bkp, bkr = plan.bq_r, plan.bk_p, plan.bk_r
    i = pl.program_id(2)
    plen, rlen = plen_ref[()], rlen_ref[()]
    rows = i * bq + jnp.arange(bq)
    q = q_ref[...]
    live = i * bq < rlen
    n_prompt = jnp.where(live, _cdiv(plen, bkp), 0)
    n_own = jnp.where(live, jnp.minimum(_cdiv((i + 1) * bq, bkr), _cdiv(rlen, bkr)), 0)

    def prompt_body(t, state):  # every valid prompt key, no causality
        cols = t * bkp + jnp.arange(bkp)
        mask = jnp.broadcast_to((cols < plen)[None, :], (bq, bkp))
        return _online_softmax_step(state, q, kp_ref[pl.ds(t * bkp, bkp), :],
                                    vp_ref[pl.ds(t * bkp, bkp), :], mask, plan.scale)

    def own_body(t, state):     # own response keys, causal
        cols = t * bkr + jnp.arange(bkr)
        mask = (cols[None, :] <= rows[:, None]) & (cols < rlen)[None, :]
        return _online_softmax_step(state, q, kr_ref[pl.ds(t * bkr, bkr), :],
                                    vr_ref[pl.ds(t * bkr, bkr), :], mask, plan.scale)

    state = lax.fori_loop(0, n_prompt, prompt_body, _init_state(bq, q.shape[-1]))
    state = lax.fori_loop(0, n_own, own_body, state)
    _store_output(o_ref, lse_ref, state, rows < rlen)


# ----------------------------------------------------------------------------- backward

def _dq_prompt_kernel(plen_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref,
                      *, plan: _Plan):
    bq, bk = plan.bq_p_bwd, plan.bk_p_bwd
    i = pl.program_id(2)
    plen = plen_ref[()]
    rows = i * bq + jnp.arange(bq)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    n_tiles = jnp.where(i * bq < plen,
                        jnp.minimum(_cdiv((i + 1) * bq, bk), _cdiv(plen, bk)), 0)

    def body(t, dq):
        k = k_ref[pl.ds(t * bk, bk), :]
        cols = t * bk + jnp.arange(bk)
        mask = (cols[None, :] <= rows[:, None]) & (rows < plen)[:, None]
        _, ds = _grad_tile(q, do, lse, delta, k, v_ref[pl.ds(t * bk, bk), :], mask,
                           plan.scale)
        return dq + _dot_nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, n_tiles, body, jnp.zeros(q.shape, _F32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dq_resp_kernel(plen_ref, rlen_ref, q_ref, do_ref, lse_ref, delta_ref,
                    kp_ref, vp_ref, kr_ref, vr_ref, dq_ref, *, plan: _Plan):
    bq, bkp, bkr = plan.bq_r_bwd, plan.bk_p_bwd, plan.bk_r_bwd
    i = pl.program_id(2)
    plen, rlen = plen_ref[()], rlen_ref[()]
    rows = i * bq + jnp.arange(bq)
    row_ok = (rows < rlen)[:, None]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    live = i * bq < rlen
    n_prompt = jnp.where(live, _cdiv(plen, bkp), 0)
    n_own = jnp.where(live, jnp.minimum(_cdiv((i + 1) * bq, bkr), _cdiv(rlen, bkr)), 0)

    def prompt_body(t, dq):
        k = kp_ref[pl.ds(t * bkp, bkp), :]
        cols = t * bkp + jnp.arange(bkp)
        mask = row_ok & (cols < plen)[None, :]
        _, ds = _grad_tile(q, do, lse, delta, k, vp_ref[pl.ds(t * bkp, bkp), :], mask,
                           plan.scale)
        return dq + _dot_nn(ds.astype(k.dtype), k)

    def own_body(t, dq):
        k = kr_ref[pl.ds(t * bkr, bkr), :]
        cols = t * bkr + jnp.arange(bkr)
        mask = row_ok & (cols[None, :] <= rows[:, None])
        _, ds = _grad_tile(q, do, lse, delta, k, vr_ref[pl.ds(t * bkr, bkr), :], mask,
                           plan.scale)
        return dq + _dot_nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, n_prompt, prompt_body, jnp.zeros(q.shape, _F32))
    dq = lax.fori_loop(0, n_own, own_body, dq)
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _accumulate_dkdv(carry, q, do, lse, delta, k, v, mask, scale):
    dk, dv = carry
    p, ds = _grad_tile(q, do, lse, delta, k, v, mask, scale)
    return dk + _dot_tn(ds.astype(q.dtype), q), dv + _dot_tn(p.astype(do.dtype), do)


def _dkdv_resp_kernel(rlen_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref,
                      dk_ref, dv_ref, *, plan: _Plan):
    bq, bk = plan.bq_r_bwd, plan.bk_r_bwd
    j = pl.program_id(2)
    rlen = rlen_ref[()]
    cols = j * bk + jnp.arange(bk)
    k, v = k_ref[...], v_ref[...]
    first = lax.div(j * bk, bq)                   # causal: earlier query tiles see nothing
    last = jnp.where(j * bk < rlen, _cdiv(rlen, bq), first)

    def body(t, carry):
        rows = t * bq + jnp.arange(bq)
        sl = pl.ds(t * bq, bq)
        mask = (cols[None, :] <= rows[:, None]) & (rows < rlen)[:, None]
        return _accumulate_dkdv(carry, q_ref[sl, :], do_ref[sl, :], lse_ref[sl],
                                delta_ref[sl], k, v, mask, plan.scale)

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(first, last, body, (zeros, zeros))
    dk_ref[...] = dk * plan.scale
    dv_ref[...] = dv


def _dkdv_prompt_kernel(plen_ref, rlen_ref, k_ref, v_ref,
                        qp_ref, dop_ref, lsep_ref, deltap_ref,
                        qr_ref, dor_ref, lser_ref, deltar_ref,
                        dk_ref, dv_ref, *, plan: _Plan):
    bqp, bqr, bk = plan.bq_p_bwd, plan.bq_r_bwd, plan.bk_p_bwd
    j = pl.program_id(2)
    plen = plen_ref[()]
    cols = j * bk + jnp.arange(bk)
    col_ok = (cols < plen)[None, :]
    live = j * bk < plen
    k, v = k_ref[...], v_ref[...]
    zeros = jnp.zeros(k.shape, _F32)

    def prompt_body(t, carry):  # the prompt's own queries, causal
        rows = t * bqp + jnp.arange(bqp)
        sl = pl.ds(t * bqp, bqp)
        mask = (cols[None, :] <= rows[:, None]) & (rows < plen)[:, None]
        return _accumulate_dkdv(carry, qp_ref[sl, :], dop_ref[sl, :], lsep_ref[sl],
                                deltap_ref[sl], k, v, mask, plan.scale)

    first = lax.div(j * bk, bqp)
    carry = lax.fori_loop(first, jnp.where(live, _cdiv(plen, bqp), first), prompt_body,
                          (zeros, zeros))

    def resp_body(n, carry):    # every response sees every valid prompt key
        rlen = rlen_ref[n]

        def tile_body(t, carry):
            rows = t * bqr + jnp.arange(bqr)
            sl = pl.ds(t * bqr, bqr)
            mask = (rows < rlen)[:, None] & col_ok
            return _accumulate_dkdv(carry, qr_ref[n, sl, :], dor_ref[n, sl, :],
                                    lser_ref[n, sl], deltar_ref[n, sl], k, v, mask,
                                    plan.scale)

        return lax.fori_loop(0, jnp.where(live, _cdiv(rlen, bqr), 0), tile_body, carry)

    dk, dv = lax.fori_loop(0, plan.n_resp, resp_body, carry)
    dk_ref[...] = dk * plan.scale
    dv_ref[...] = dv


# ----------------------------------------------------------------------------- launches

def _call(kernel, plan: _Plan, grid, in_specs, out_specs, out_shape, name):
    kwargs = {}
    if not plan.interpret:  # compiled: this kernel is lowered for GPU (Triton) only
        from jax.experimental.pallas import triton as plgpu
        big = plan.bq_r * plan.bk_r >= 64 * 64
        kwargs["compiler_params"] = plgpu.CompilerParams(
            num_warps=plan.num_warps or (8 if big else 4), num_stages=plan.num_stages)
    return pl.pallas_call(functools.partial(kernel, plan=plan), grid=grid,
                          in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=plan.interpret, name=name, **kwargs)


def _seq_specs(plan: _Plan, dp: int):
    """BlockSpec factories shared by the launches (grid = (seq, head, tile))."""
    n, rep = plan.n_resp, plan.rep

    def tile(b):      # one tile of rows of a [S, L, h, Dp] array, query head h
        return pl.BlockSpec((None, b, None, dp), lambda s, h, i: (s, i, h, 0))

    def kv_tile(b):   # one tile of rows, kv head of query head h
        return pl.BlockSpec((None, b, None, dp), lambda s, h, i: (s, i, lax.div(h, rep), 0))

    def full_kv(length, of_group=False):  # whole sequence of a kv head
        if of_group:
            return pl.BlockSpec((None, length, None, dp),
                                lambda s, h, i: (lax.div(s, n), 0, lax.div(h, rep), 0))
        return pl.BlockSpec((None, length, None, dp),
                            lambda s, h, i: (s, 0, lax.div(h, rep), 0))

    def full_q(length):   # whole sequence of a query head
        return pl.BlockSpec((None, length, None, dp), lambda s, h, i: (s, 0, h, 0))

    def row_stat(b):      # [S, H, L] statistics, one tile
        return pl.BlockSpec((None, None, b), lambda s, h, i: (s, h, i))

    def full_stat(length):
        return pl.BlockSpec((None, None, length), lambda s, h, i: (s, h, 0))

    def scalar(of_group=False):
        if of_group:
            return pl.BlockSpec((None,), lambda s, h, i: (lax.div(s, n),))
        return pl.BlockSpec((None,), lambda s, h, i: (s,))

    return tile, kv_tile, full_kv, full_q, row_stat, full_stat, scalar


def _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan: _Plan):
    g, pp, h, dp = qp.shape
    b, rp = qr.shape[:2]
    tile, _, full_kv, _, row_stat, _, scalar = _seq_specs(plan, dp)
    o_p, lse_p = _call(
        _fwd_prompt_kernel, plan, (g, h, pp // plan.bq_p),
        [scalar(), tile(plan.bq_p), full_kv(pp), full_kv(pp)],
        [tile(plan.bq_p), row_stat(plan.bq_p)],
        [jax.ShapeDtypeStruct(qp.shape, qp.dtype), jax.ShapeDtypeStruct((g, h, pp), _F32)],
        "spa_fwd_prompt")(plen, qp, kp, vp)
    o_r, lse_r = _call(
        _fwd_resp_kernel, plan, (b, h, rp // plan.bq_r),
        [scalar(of_group=True), scalar(), tile(plan.bq_r), full_kv(pp, of_group=True),
         full_kv(pp, of_group=True), full_kv(rp), full_kv(rp)],
        [tile(plan.bq_r), row_stat(plan.bq_r)],
        [jax.ShapeDtypeStruct(qr.shape, qr.dtype), jax.ShapeDtypeStruct((b, h, rp), _F32)],
        "spa_fwd_resp")(plen, rlen, qr, kp, vp, kr, vr)
    return o_p, o_r, lse_p, lse_r


def _backward(plan: _Plan, res, cts):
    qp, kp, vp, qr, kr, vr, plen, rlen, o_p, o_r, lse_p, lse_r = res
    do_p, do_r = cts
    g, pp, h, dp = qp.shape
    b, rp = qr.shape[:2]
    kvh = kp.shape[2]
    n = plan.n_resp
    tile, kv_tile, full_kv, full_q, row_stat, full_stat, scalar = _seq_specs(plan, dp)
    # delta = rowsum(dO * O): the softmax-jacobian term, [S, H, L] fp32
    delta_p = jnp.einsum("gphd,gphd->ghp", do_p.astype(_F32), o_p.astype(_F32))
    delta_r = jnp.einsum("bphd,bphd->bhp", do_r.astype(_F32), o_r.astype(_F32))

    dq_p = _call(
        _dq_prompt_kernel, plan, (g, h, pp // plan.bq_p_bwd),
        [scalar(), tile(plan.bq_p_bwd), tile(plan.bq_p_bwd), row_stat(plan.bq_p_bwd),
         row_stat(plan.bq_p_bwd), full_kv(pp), full_kv(pp)],
        tile(plan.bq_p_bwd), jax.ShapeDtypeStruct(qp.shape, qp.dtype),
        "spa_bwd_dq_prompt")(plen, qp, do_p, lse_p, delta_p, kp, vp)
    dq_r = _call(
        _dq_resp_kernel, plan, (b, h, rp // plan.bq_r_bwd),
        [scalar(of_group=True), scalar(), tile(plan.bq_r_bwd), tile(plan.bq_r_bwd),
         row_stat(plan.bq_r_bwd), row_stat(plan.bq_r_bwd), full_kv(pp, of_group=True),
         full_kv(pp, of_group=True), full_kv(rp), full_kv(rp)],
        tile(plan.bq_r_bwd), jax.ShapeDtypeStruct(qr.shape, qr.dtype),
        "spa_bwd_dq_resp")(plen, rlen, qr, do_r, lse_r, delta_r, kp, vp, kr, vr)

    def per_head(seqs, length):  # fp32 dk/dv per query head, summed per kv head below
        return jax.ShapeDtypeStruct((seqs, length, h, dp), _F32)

    dk_r, dv_r = _call(
        _dkdv_resp_kernel, plan, (b, h, rp // plan.bk_r_bwd),
        [scalar(), kv_tile(plan.bk_r_bwd), kv_tile(plan.bk_r_bwd), full_q(rp), full_q(rp),
         full_stat(rp), full_stat(rp)],
        [tile(plan.bk_r_bwd), tile(plan.bk_r_bwd)], [per_head(b, rp), per_head(b, rp)],
        "spa_bwd_dkdv_resp")(rlen, kr, vr, qr, do_r, lse_r, delta_r)

    # all N responses of group s: blocks of N along the flattened [G*N] axis
    group_q = pl.BlockSpec((n, rp, None, dp), lambda s, hh, i: (s, 0, hh, 0))
    group_stat = pl.BlockSpec((n, None, rp), lambda s, hh, i: (s, hh, 0))
    group_len = pl.BlockSpec((n,), lambda s, hh, i: (s,))
    dk_p, dv_p = _call(
        _dkdv_prompt_kernel, plan, (g, h, pp // plan.bk_p_bwd),
        [scalar(), group_len, kv_tile(plan.bk_p_bwd), kv_tile(plan.bk_p_bwd),
         full_q(pp), full_q(pp), full_stat(pp), full_stat(pp),
         group_q, group_q, group_stat, group_stat],
        [tile(plan.bk_p_bwd), tile(plan.bk_p_bwd)], [per_head(g, pp), per_head(g, pp)],
        "spa_bwd_dkdv_prompt")(plen, rlen, kp, vp, qp, do_p, lse_p, delta_p,
                               qr, do_r, lse_r, delta_r)

    def sum_group(x, dtype):  # per-query-head fp32 [S, L, H, Dp] -> [S, L, KH, Dp]
        s, length = x.shape[:2]
        return x.reshape(s, length, kvh, plan.rep, dp).sum(axis=3).astype(dtype)

    dt = qp.dtype
    return (dq_p, sum_group(dk_p, dt), sum_group(dv_p, dt),
            dq_r, sum_group(dk_r, dt), sum_group(dv_r, dt), None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _spa_core(qp, kp, vp, qr, kr, vr, plen, rlen, plan: _Plan):
    o_p, o_r, _, _ = _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan)
    return o_p, o_r


def _spa_core_fwd(qp, kp, vp, qr, kr, vr, plen, rlen, plan: _Plan):
    o_p, o_r, lse_p, lse_r = _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan)
    return (o_p, o_r), (qp, kp, vp, qr, kr, vr, plen, rlen, o_p, o_r, lse_p, lse_r)


_spa_core.defvjp(_spa_core_fwd, _backward)


def shared_prefix_attention_pallas(
    q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp,
    prompt_lengths, resp_lengths, sm_scale: float,
    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
):
    """Pallas kernels; same contract as `shared_prefix_attention_reference`.

    Args: q_prompt `[G, P, H, D]`, k_prompt/v_prompt `[G, P, KH, D]`, q_resp
      `[G, N, R, H, D]`, k_resp/v_resp `[G, N, R, KH, D]`, prompt_lengths `[G]` int32,
      resp_lengths `[G, N]` int32 (validated), sm_scale float, block_sizes (default
      `BlockSizes()`), interpret (None: compiled when lowered for GPU, else interpreted).
    Returns: (o_prompt `[G, P, H, D]`, o_resp `[G, N, R, H, D]`) in the input dtype.
    """
    bs = BlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes or None, got {type(bs).__name__}")
    if interpret is None:
        args = (q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp, prompt_lengths,
                resp_lengths)

        def run(interp):
            return lambda *a: shared_prefix_attention_pallas(
                *a, sm_scale, block_sizes=bs, interpret=interp)
        return by_platform(*args, gpu=run(False), tpu=run(True), default=run(True))
    interpret = bool(interpret)
    g, p, h, d = q_prompt.shape
    n, r = q_resp.shape[1], q_resp.shape[2]
    kvh = k_prompt.shape[2]
    plan = _make_plan(p, r, n, h // kvh, sm_scale, bs, interpret)
    dp = _next_pow2(d)  # Triton loads need power-of-two tiles; zero columns change nothing

    def pad(x, length, target):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, target - length)
        widths[-1] = (0, dp - d)
        return jnp.pad(x, widths) if target != length or dp != d else x

    def flat(x):  # [G, N, R, ...] -> [G*N, R, ...]
        return x.reshape((g * n,) + x.shape[2:])

    o_p, o_r = _spa_core(
        pad(q_prompt, p, plan.p_pad), pad(k_prompt, p, plan.p_pad),
        pad(v_prompt, p, plan.p_pad), pad(flat(q_resp), r, plan.r_pad),
        pad(flat(k_resp), r, plan.r_pad), pad(flat(v_resp), r, plan.r_pad),
        prompt_lengths.astype(jnp.int32), resp_lengths.reshape(g * n).astype(jnp.int32),
        plan)
    return o_p[:, :p, :, :d], o_r[:, :r, :, :d].reshape(g, n, r, h, d)
