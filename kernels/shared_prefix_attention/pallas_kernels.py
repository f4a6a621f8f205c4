"""Kernel bodies of the Pallas-Triton shared-prefix attention (launched by `pallas.py`).

Conventions shared by every body:

  * scores in base 2: s2 = (q . k) * scale * log2(e), probabilities exp2(s2 - m2); the
    softmax scale is folded into that one multiply. The forward stores the base-2
    log-sum-exp lse2 = m2 + log2(l) as the backward's residual, and +inf for query rows
    beyond their sequence's length: exp2(s2 - inf) = 0, so such a row contributes exactly
    nothing to any gradient, and no backward body masks rows.
  * masks only on boundary tiles: each loop is split into the tiles every (query, key)
    pair of which is visible (no `where`) and the few that cross the causal diagonal or a
    length (masked). Keys beyond a length are masked where a valid row could see them
    (forward, dq); the dk/dv bodies zero the rows of such keys when they store.
  * dk/dv programs own one KV head: they loop over the `rep` query heads of its GQA group
    and write the group's sum in the input dtype (no per-query-head fp32 round trip). Their
    loops are flat (one loop over (head, tile) pairs), and the prompt's dk/dv walks the
    group's live response tiles from a table, so the pipeline never restarts per response.
Tile math is fp32 with fp32 accumulators; matmul operands in the input dtype.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.shared_prefix_attention.inputs import MASK_VALUE

_F32 = jnp.float32
LOG2E = 1.0 / math.log(2.0)


def cdiv(x, b: int):
    """Ceil-divide a non-negative traced int32 by a static int (Triton-friendly)."""
    return lax.div(x + (b - 1), b)


def dot_nt(a, b):
    """a `[m, d]` . b `[n, d]`^T -> `[m, n]` fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def dot_tn(a, b):
    """a `[m, n]`^T . b `[m, d]` -> `[n, d]` fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def dot_nn(a, b):
    """a `[m, n]` . b `[n, d]` -> `[m, d]` fp32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _two_loops(n_full, n_all, unmasked_body, masked_body, carry):
    """Tiles [0, n_full) without a mask, then [n_full, n_all) with one."""
    carry = lax.fori_loop(0, n_full, unmasked_body, carry)
    return lax.fori_loop(n_full, n_all, masked_body, carry)


# ----------------------------------------------------------------------------- forward

def softmax_step(carry, q, k, v, qk_scale, mask):
    """Fold one key tile into the running (acc `[bq, Dp]`, m2 `[bq]`, l `[bq]`)."""
    acc, m, l = carry
    s = dot_nt(q, k) * qk_scale
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[:, None] * acc + dot_nn(p.astype(v.dtype), v)
    return acc, m_new, l


def init_state(bq: int, dp: int):
    return (jnp.zeros((bq, dp), _F32), jnp.full((bq,), -jnp.inf, _F32),
            jnp.zeros((bq,), _F32))


def store_output(o_ref, lse_ref, state, row_valid):
    acc, m, l = state
    l_safe = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = jnp.where(row_valid[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(row_valid, m + jnp.log2(l_safe), jnp.inf)


def _causal_counts(row0, bq: int, bk: int, length, live):
    """(fully visible key tiles, all key tiles) of a causal query tile starting at row0
    over keys valid below `length`."""
    n_all = jnp.where(live, jnp.minimum(cdiv(row0 + bq, bk), cdiv(length, bk)), 0)
    n_full = jnp.minimum(jnp.minimum(lax.div(row0 + 1, bk), lax.div(length, bk)), n_all)
    return n_full, n_all


def fwd_prompt_kernel(plen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, plan, tiles):
    bq, bk = tiles.q_p, tiles.k_p
    qk_scale = plan.scale * LOG2E
    row0 = pl.program_id(2) * bq
    plen = plen_ref[()]
    rows = row0 + jnp.arange(bq)
    q = q_ref[...]
    n_full, n_all = _causal_counts(row0, bq, bk, plen, row0 < plen)

    def body(masked):
        def step(t, state):
            cols = t * bk + jnp.arange(bk)
            mask = ((cols[None, :] <= rows[:, None]) & (cols < plen)[None, :]) if masked else None
            return softmax_step(state, q, k_ref[pl.ds(t * bk, bk), :],
                                 v_ref[pl.ds(t * bk, bk), :], qk_scale, mask)
        return step

    state = _two_loops(n_full, n_all, body(False), body(True), init_state(bq, q.shape[-1]))
    store_output(o_ref, lse_ref, state, rows < plen)


def fwd_resp_kernel(plen_ref, rlen_ref, q_ref, kp_ref, vp_ref, kr_ref, vr_ref,
                    o_ref, lse_ref, *, plan, tiles):
    bq, bkp, bkr = tiles.q_r, tiles.k_p, tiles.k_r
    qk_scale = plan.scale * LOG2E
    row0 = pl.program_id(2) * bq
    plen, rlen = plen_ref[()], rlen_ref[()]
    rows = row0 + jnp.arange(bq)
    q = q_ref[...]
    live = row0 < rlen
    n_prompt = jnp.where(live, cdiv(plen, bkp), 0)
    n_prompt_full = jnp.minimum(lax.div(plen, bkp), n_prompt)
    n_own_full, n_own = _causal_counts(row0, bq, bkr, rlen, live)

    def prompt_body(masked):   # every valid prompt key, no causality
        def step(t, state):
            cols = t * bkp + jnp.arange(bkp)
            mask = jnp.broadcast_to((cols < plen)[None, :], (bq, bkp)) if masked else None
            return softmax_step(state, q, kp_ref[pl.ds(t * bkp, bkp), :],
                                 vp_ref[pl.ds(t * bkp, bkp), :], qk_scale, mask)
        return step

    def own_body(masked):      # own response keys, causal
        def step(t, state):
            cols = t * bkr + jnp.arange(bkr)
            mask = ((cols[None, :] <= rows[:, None]) & (cols < rlen)[None, :]) if masked else None
            return softmax_step(state, q, kr_ref[pl.ds(t * bkr, bkr), :],
                                 vr_ref[pl.ds(t * bkr, bkr), :], qk_scale, mask)
        return step

    state = _two_loops(n_prompt_full, n_prompt, prompt_body(False), prompt_body(True),
                       init_state(bq, q.shape[-1]))
    state = _two_loops(n_own_full, n_own, own_body(False), own_body(True), state)
    store_output(o_ref, lse_ref, state, rows < rlen)


# ----------------------------------------------------------------------------- backward

def _grad_tile(q, do, lse2, delta, k, v, qk_scale, mask):
    """Probabilities and score gradients `[bq, bk]` (without the softmax scale), fp32."""
    p = jnp.exp2(dot_nt(q, k) * qk_scale - lse2[:, None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    return p, p * (dot_nt(do, v) - delta[:, None])


def _dq_step(q, do, lse2, delta, k_ref, v_ref, bk, qk_scale, mask_fn):
    def step(t, dq):
        k = k_ref[pl.ds(t * bk, bk), :]
        _, ds = _grad_tile(q, do, lse2, delta, k, v_ref[pl.ds(t * bk, bk), :], qk_scale,
                           None if mask_fn is None else mask_fn(t * bk + jnp.arange(bk)))
        return dq + dot_nn(ds.astype(k.dtype), k)
    return step


def dq_prompt_kernel(plen_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref,
                     *, plan, tiles):
    bq, bk = tiles.q_p, tiles.k_p
    qk_scale = plan.scale * LOG2E
    row0 = pl.program_id(2) * bq
    plen = plen_ref[()]
    rows = row0 + jnp.arange(bq)
    q, do, lse2, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    n_full, n_all = _causal_counts(row0, bq, bk, plen, row0 < plen)

    def mask(cols):
        return (cols[None, :] <= rows[:, None]) & (cols < plen)[None, :]

    dq = _two_loops(n_full, n_all, _dq_step(q, do, lse2, delta, k_ref, v_ref, bk, qk_scale, None),
                    _dq_step(q, do, lse2, delta, k_ref, v_ref, bk, qk_scale, mask),
                    jnp.zeros(q.shape, _F32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def dq_resp_kernel(plen_ref, rlen_ref, q_ref, do_ref, lse_ref, delta_ref,
                   kp_ref, vp_ref, kr_ref, vr_ref, dq_ref, *, plan, tiles):
    bq, bkp, bkr = tiles.q_r, tiles.k_p, tiles.k_r
    qk_scale = plan.scale * LOG2E
    row0 = pl.program_id(2) * bq
    plen, rlen = plen_ref[()], rlen_ref[()]
    rows = row0 + jnp.arange(bq)
    q, do, lse2, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    live = row0 < rlen
    n_prompt = jnp.where(live, cdiv(plen, bkp), 0)
    n_prompt_full = jnp.minimum(lax.div(plen, bkp), n_prompt)
    n_own_full, n_own = _causal_counts(row0, bq, bkr, rlen, live)

    def prompt_mask(cols):
        return jnp.broadcast_to((cols < plen)[None, :], (bq, bkp))

    def own_mask(cols):
        return (cols[None, :] <= rows[:, None]) & (cols < rlen)[None, :]

    args = (q, do, lse2, delta)
    dq = _two_loops(n_prompt_full, n_prompt,
                    _dq_step(*args, kp_ref, vp_ref, bkp, qk_scale, None),
                    _dq_step(*args, kp_ref, vp_ref, bkp, qk_scale, prompt_mask),
                    jnp.zeros(q.shape, _F32))
    dq = _two_loops(n_own_full, n_own, _dq_step(*args, kr_ref, vr_ref, bkr, qk_scale, None),
                    _dq_step(*args, kr_ref, vr_ref, bkr, qk_scale, own_mask), dq)
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _accumulate_dkdv(carry, q, do, lse2, delta, k, v, qk_scale, mask):
    dk, dv = carry
    p, ds = _grad_tile(q, do, lse2, delta, k, v, qk_scale, mask)
    return dk + dot_tn(ds.astype(q.dtype), q), dv + dot_tn(p.astype(do.dtype), do)


def _head_tile_loop(rep: int, first, count, tile_body, carry):
    """One flat loop over the `rep` query heads x tiles [first, first + count)."""
    def step(f, carry):
        safe = jnp.maximum(count, 1)
        return tile_body(lax.div(f, safe), first + lax.rem(f, safe), carry)
    return lax.fori_loop(0, rep * count, step, carry)


def _causal_query_tiles(col0, bk: int, bq: int, length):
    """Query tiles that see the key tile starting at col0 causally: (first, first fully
    visible, end) over query rows valid below `length`."""
    first = lax.div(col0, bq)
    end = jnp.where(col0 < length, cdiv(length, bq), first)
    full = jnp.minimum(jnp.maximum(cdiv(col0 + bk - 1, bq), first), end)
    return first, full, end


def _causal_dkdv(rep, k, v, q_ref, do_ref, lse_ref, delta_ref, cols, bq, col0, bk, length,
                 qk_scale, carry):
    """dk/dv of one key tile from the causal queries of its own sequence, all heads."""
    first, full, end = _causal_query_tiles(col0, bk, bq, length)

    def tile_body(masked):
        def body(h, t, carry):
            rows = t * bq + jnp.arange(bq)
            sl = pl.ds(t * bq, bq)
            mask = (cols[None, :] <= rows[:, None]) if masked else None
            return _accumulate_dkdv(carry, q_ref[sl, h, :], do_ref[sl, h, :], lse_ref[h, sl],
                                    delta_ref[h, sl], k, v, qk_scale, mask)
        return body

    carry = _head_tile_loop(rep, first, full - first, tile_body(True), carry)
    return _head_tile_loop(rep, full, end - full, tile_body(False), carry)


def _store_dkdv(dk_ref, dv_ref, carry, cols, length, scale):
    dk, dv = carry
    valid = (cols < length)[:, None]
    dk_ref[...] = jnp.where(valid, dk * scale, 0.0).astype(dk_ref.dtype)
    dv_ref[...] = jnp.where(valid, dv, 0.0).astype(dv_ref.dtype)


def dkdv_resp_kernel(rlen_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref,
                     dk_ref, dv_ref, *, plan, tiles):
    bq, bk = tiles.q_r, tiles.k_r
    col0 = pl.program_id(2) * bk
    rlen = rlen_ref[()]
    cols = col0 + jnp.arange(bk)
    k, v = k_ref[...], v_ref[...]
    zeros = jnp.zeros(k.shape, _F32)
    carry = _causal_dkdv(plan.rep, k, v, q_ref, do_ref, lse_ref, delta_ref, cols, bq, col0,
                         bk, rlen, plan.scale * LOG2E, (zeros, zeros))
    _store_dkdv(dk_ref, dv_ref, carry, cols, rlen, plan.scale)


def dkdv_prompt_kernel(plen_ref, ids_ref, nlive_ref, k_ref, v_ref,
                       qp_ref, dop_ref, lsep_ref, deltap_ref,
                       qr_ref, dor_ref, lser_ref, deltar_ref,
                       dk_ref, dv_ref, *, plan, tiles):
    bqp, bqr, bk = tiles.q_p, tiles.q_r, tiles.k_p
    qk_scale = plan.scale * LOG2E
    col0 = pl.program_id(2) * bk
    plen = plen_ref[()]
    cols = col0 + jnp.arange(bk)
    k, v = k_ref[...], v_ref[...]
    zeros = jnp.zeros(k.shape, _F32)
    # the prompt's own queries, causal
    carry = _causal_dkdv(plan.rep, k, v, qp_ref, dop_ref, lsep_ref, deltap_ref, cols, bqp,
                         col0, bk, plen, qk_scale, (zeros, zeros))
    # every live response tile of the group (from the table) sees every prompt key
    tiles_per_resp = plan.r_pad // bqr
    n_live = jnp.where(col0 < plen, nlive_ref[()], 0)

    def resp_body(h, f, carry):
        tile_id = ids_ref[f]
        n, t = lax.div(tile_id, tiles_per_resp), lax.rem(tile_id, tiles_per_resp)
        sl = pl.ds(t * bqr, bqr)
        return _accumulate_dkdv(carry, qr_ref[n, sl, h, :], dor_ref[n, sl, h, :],
                                lser_ref[n, h, sl], deltar_ref[n, h, sl], k, v, qk_scale,
                                None)

    carry = _head_tile_loop(plan.rep, 0, n_live, resp_body, carry)
    _store_dkdv(dk_ref, dv_ref, carry, cols, plen, plan.scale)
