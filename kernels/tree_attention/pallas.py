"""The Pallas-Triton tree attention for training: a flash attention whose mask is one int
per key (module doc of kernels.tree_attention), forward and backward.

Layout inside: q, do [B, H, T, D], k, v [B, KVH, T, D] (T padded to a multiple of the
tile, D to a power of two >= 16), kend [B, T] int32. One tile size for queries and keys,
so the diagonal tile of query tile i is key tile i.

  forward   grid (B, H, query tiles): key tiles 0 .. i (causal bound), each masked by
            j <= i < kend[j]; writes o and the base-2 log-sum-exp (+inf for a row that
            sees no key: it then adds nothing to any gradient)
  dq        grid (B, H, query tiles): the same tiles, p = exp2(s - lse), ds = p (dp - δ)
            with δ = rowsum(do · o) (computed by XLA before the launch)
  dk, dv    grid (B, H, key tiles): query tiles from the diagonal up to the tile holding
            the largest kend of the key tile (no query past it sees these keys); one q
            head per program, summed over each GQA group by XLA afterwards

Scores in base 2 and tile math in fp32, as kernels.shared_prefix_attention.pallas_kernels
(whose softmax step, output store and dot helpers are reused).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels.shared_prefix_attention.pallas_kernels import (
    LOG2E,
    cdiv,
    dot_nn,
    dot_nt,
    dot_tn,
    init_state,
    softmax_step,
    store_output,
)

_F32 = jnp.float32


def _compiler_params():
    # the Triton backend when lowered for GPU; interpret mode ignores it
    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _visible(rows, cols, kend):
    """bool [bq, bk]: query row i sees key j (j <= i < kend[j])."""
    return (cols[None, :] <= rows[:, None]) & (rows[:, None] < kend[None, :])


def _fwd_kernel(kend_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block):
    i = pl.program_id(2)
    rows = i * block + jnp.arange(block)
    q = q_ref[...]

    def step(t, state):
        cols = t * block + jnp.arange(block)
        mask = _visible(rows, cols, kend_ref[pl.ds(t * block, block)])
        return softmax_step(state, q, k_ref[pl.ds(t * block, block), :],
                            v_ref[pl.ds(t * block, block), :], scale * LOG2E, mask)

    state = lax.fori_loop(0, i + 1, step, init_state(block, q.shape[-1]))
    store_output(o_ref, lse_ref, state, state[2] > 0.0)


def _dq_kernel(kend_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale,
               block):
    i = pl.program_id(2)
    rows = i * block + jnp.arange(block)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def step(t, dq):
        cols = t * block + jnp.arange(block)
        k, v = k_ref[pl.ds(t * block, block), :], v_ref[pl.ds(t * block, block), :]
        mask = _visible(rows, cols, kend_ref[pl.ds(t * block, block)])
        p = jnp.where(mask, jnp.exp2(dot_nt(q, k) * (scale * LOG2E) - lse[:, None]), 0.0)
        ds = p * (dot_nt(do, v) - delta[:, None])
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, i + 1, step, jnp.zeros(q.shape, _F32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(kend_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                scale, block, n_tiles):
    j = pl.program_id(2)
    cols = j * block + jnp.arange(block)
    k, v = k_ref[...], v_ref[...]
    kend = kend_ref[pl.ds(j * block, block)]
    last = jnp.minimum(cdiv(jnp.max(kend), block), n_tiles)  # no row at or past kend sees

    def step(t, carry):
        dk, dv = carry
        rows = t * block + jnp.arange(block)
        q, do = q_ref[pl.ds(t * block, block), :], do_ref[pl.ds(t * block, block), :]
        lse, delta = lse_ref[pl.ds(t * block, block)], delta_ref[pl.ds(t * block, block)]
        mask = _visible(rows, cols, kend)
        p = jnp.where(mask, jnp.exp2(dot_nt(q, k) * (scale * LOG2E) - lse[:, None]), 0.0)
        dv = dv + dot_tn(p.astype(do.dtype), do)
        ds = p * (dot_nt(do, v) - delta[:, None])
        return dk + dot_tn(ds.astype(q.dtype), q), dv

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(j, last, step, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(block, t_pad, d, rep):
    """BlockSpecs over grid (b, h, tile): a tile of a q-head array, the whole T of the kv
    head serving q head h, a tile / the whole T of a [B, H, T] row array, kend's row."""
    tile = pl.BlockSpec((None, None, block, d), lambda b, h, i: (b, h, i, 0))
    whole_kv = pl.BlockSpec((None, None, t_pad, d), lambda b, h, i: (b, h // rep, 0, 0))
    whole_q = pl.BlockSpec((None, None, t_pad, d), lambda b, h, i: (b, h, 0, 0))
    kv_tile = pl.BlockSpec((None, None, block, d), lambda b, h, i: (b, h // rep, i, 0))
    row_tile = pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i))
    row_whole = pl.BlockSpec((None, None, t_pad), lambda b, h, i: (b, h, 0))
    kend = pl.BlockSpec((None, t_pad), lambda b, h, i: (b, 0))
    return tile, whole_kv, whole_q, kv_tile, row_tile, row_whole, kend


def tree_flash_forward(q, k, v, kend, *, scale, block, interpret):
    """(o [B, H, T, D], lse2 [B, H, T] f32) of the padded layout (module doc)."""
    b, h, t_pad, d = q.shape
    rep = h // k.shape[1]
    tile, whole_kv, _, _, row_tile, _, kend_spec = _specs(block, t_pad, d, rep)
    return pl.pallas_call(
        partial(_fwd_kernel, scale=scale, block=block),
        grid=(b, h, t_pad // block),
        in_specs=[kend_spec, tile, whole_kv, whole_kv],
        out_specs=[tile, row_tile],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, t_pad), _F32)],
        compiler_params=_compiler_params(), interpret=interpret, name="tree_attention_fwd",
    )(kend, q, k, v)


def tree_flash_backward(q, k, v, kend, o, lse, do, *, scale, block, interpret):
    """(dq, dk, dv) of the padded layout; dk, dv summed over each kv head's q heads."""
    b, h, t_pad, d = q.shape
    kvh = k.shape[1]
    rep = h // kvh
    tile, whole_kv, whole_q, kv_tile, row_tile, row_whole, kend_spec = _specs(
        block, t_pad, d, rep)
    delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1)  # [B, H, T]
    grid = (b, h, t_pad // block)
    dq = pl.pallas_call(
        partial(_dq_kernel, scale=scale, block=block), grid=grid,
        in_specs=[kend_spec, tile, whole_kv, whole_kv, tile, row_tile, row_tile],
        out_specs=tile, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(), interpret=interpret, name="tree_attention_dq",
    )(kend, q, k, v, do, lse, delta)
    dk, dv = pl.pallas_call(
        partial(_dkv_kernel, scale=scale, block=block, n_tiles=t_pad // block), grid=grid,
        in_specs=[kend_spec, whole_q, kv_tile, kv_tile, whole_q, row_whole, row_whole],
        out_specs=[tile, tile],
        out_shape=[jax.ShapeDtypeStruct(q.shape, k.dtype)] * 2,
        compiler_params=_compiler_params(), interpret=interpret, name="tree_attention_dkv",
    )(kend, q, k, v, do, lse, delta)

    def per_kv_head(x):  # [B, H, T, D] -> [B, KVH, T, D]: a GQA group's q heads summed
        return x.reshape(b, kvh, rep, t_pad, d).astype(_F32).sum(2).astype(k.dtype)

    return dq, per_kv_head(dk), per_kv_head(dv)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def tree_flash(q, k, v, kend, scale, block, interpret):
    """o [B, H, T, D] of the padded layout, differentiable in q, k, v."""
    return tree_flash_forward(q, k, v, kend, scale=scale, block=block, interpret=interpret)[0]


def _tree_flash_fwd(q, k, v, kend, scale, block, interpret):
    o, lse = tree_flash_forward(q, k, v, kend, scale=scale, block=block, interpret=interpret)
    return o, (q, k, v, kend, o, lse)


def _tree_flash_bwd(scale, block, interpret, residuals, do):
    q, k, v, kend, o, lse = residuals
    dq, dk, dv = tree_flash_backward(q, k, v, kend, o, lse, do, scale=scale, block=block,
                                     interpret=interpret)
    return dq, dk, dv, None


tree_flash.defvjp(_tree_flash_fwd, _tree_flash_bwd)
