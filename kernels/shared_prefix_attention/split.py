"""Split (cascade) shared-prefix attention: calls of a flash kernel merged by log-sum-exp.

The attention of a group splits along the keys into parts that plain flash calls handle:
  prompt   the prompt's queries against the prompt's keys, causal;
  cross    all N*R response queries (as one sequence of the group) against the prompt's
           keys, every valid prompt key visible (kv_lengths = prompt_lengths);
  own      each response's queries against its own keys, causal (batch G*N).
With `SplitOptions(joint_prompt=True)` prompt and cross are ONE call: the queries
[prompt | all responses] against the prompt's keys with a top-left causal mask, under
which every response row (index >= P) sees every prompt key.
A response's output merges cross and own by their log-sum-exp (`merge.py`); the prompt
needs no merge. Backward: each call's flash backward fed the merged output, lse and dO;
dq of the responses and dk/dv of the prompt add over the calls.

Padding needs no mask in the causal calls: a padded key j >= length is visible only to
query rows >= j, which are padding rows themselves; their outputs are zeroed and their
dO is zeroed before the backward, so they contribute exactly nothing. Only the cross call
masks keys (kv_lengths); a group with an empty prompt gets its cross part dropped
(lse = -inf) whatever the backend returned for rows that saw no key.

The flash calls come from a `FlashBackend`: `flash_xla` (exact twin, every platform) or
`cudnn` (NVIDIA). Both follow the contract in `flash_xla`'s docstring.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels.shared_prefix_attention.merge import merge_by_lse


@dataclasses.dataclass(frozen=True)
class SplitOptions:
    """Knobs of the split design (the tuning sweep may set them per device).

    Attributes:
      joint_prompt: one call for the prompt's and the responses' queries against the
        prompt's keys (top-left causal), instead of two calls (prompt causal + cross).
    """

    joint_prompt: bool = False


@dataclasses.dataclass(frozen=True)
class FlashBackend:
    """A flash-attention kernel with lse output and external-residual backward.

    `forward(q, k, v, kv_lengths, *, causal, scale) -> (o, lse)` and
    `backward(q, k, v, kv_lengths, o, lse, do, *, causal, scale) -> (dq, dk, dv)`, shapes
    and semantics as in `kernels.shared_prefix_attention.flash_xla`. Hashable (module
    level functions), so it can be a static argument.
    """

    name: str
    forward: Callable
    backward: Callable


def _valid_rows(lengths, size: int):
    """`[..., size]` bool: position < length."""
    return jnp.arange(size) < lengths[..., None]


def _split_forward(backend: FlashBackend, opts: SplitOptions, scale: float,
                   qp, kp, vp, qr, kr, vr, plen, rlen):
    g, p, h, d = qp.shape
    n, r = qr.shape[1], qr.shape[2]
    kvh = kp.shape[2]
    qx = qr.reshape(g, n * r, h, d)           # the group's responses as one query sequence
    if opts.joint_prompt:
        o_a, lse_a = backend.forward(jnp.concatenate([qp, qx], axis=1), kp, vp, plen,
                                     causal=True, scale=scale)
        o_p, lse_p, o_x, lse_x = o_a[:, :p], lse_a[..., :p], o_a[:, p:], lse_a[..., p:]
    else:
        o_p, lse_p = backend.forward(qp, kp, vp, None, causal=True, scale=scale)
        o_x, lse_x = backend.forward(qx, kp, vp, plen, causal=False, scale=scale)
    o_o, lse_o = backend.forward(qr.reshape(g * n, r, h, d), kr.reshape(g * n, r, kvh, d),
                                 vr.reshape(g * n, r, kvh, d), None, causal=True,
                                 scale=scale)
    # lse [G, H, N*R] / [G*N, H, R] -> [G, N, R, H], next to o [G, N, R, H, D]
    lse_x = jnp.where((plen > 0)[:, None, None], lse_x, -jnp.inf)
    lse_x = lse_x.reshape(g, h, n, r).transpose(0, 2, 3, 1)
    lse_o = lse_o.reshape(g, n, h, r).transpose(0, 1, 3, 2)
    o_r, lse_r = merge_by_lse(o_x.reshape(g, n, r, h, d), lse_x,
                              o_o.reshape(g, n, r, h, d), lse_o)
    valid_p = _valid_rows(plen, p)[:, :, None, None]
    valid_r = _valid_rows(rlen, r)[..., None, None]
    o_p = jnp.where(valid_p, o_p, 0.0).astype(qp.dtype)
    o_r = jnp.where(valid_r, o_r, 0.0).astype(qp.dtype)
    return o_p, o_r, lse_p, lse_r


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _split_core(backend, opts, scale, qp, kp, vp, qr, kr, vr, plen, rlen):
    o_p, o_r, _, _ = _split_forward(backend, opts, scale, qp, kp, vp, qr, kr, vr, plen, rlen)
    return o_p, o_r


def _split_core_fwd(backend, opts, scale, qp, kp, vp, qr, kr, vr, plen, rlen):
    o_p, o_r, lse_p, lse_r = _split_forward(backend, opts, scale, qp, kp, vp, qr, kr, vr,
                                            plen, rlen)
    return (o_p, o_r), (qp, kp, vp, qr, kr, vr, plen, rlen, o_p, o_r, lse_p, lse_r)


def _split_core_bwd(backend, opts, scale, res, cts):
    qp, kp, vp, qr, kr, vr, plen, rlen, o_p, o_r, lse_p, lse_r = res
    g, p, h, d = qp.shape
    n, r = qr.shape[1], qr.shape[2]
    kvh = kp.shape[2]
    valid_p = _valid_rows(plen, p)[:, :, None, None]
    valid_r = _valid_rows(rlen, r)[..., None, None]
    do_p = jnp.where(valid_p, cts[0], 0.0).astype(qp.dtype)
    do_r = jnp.where(valid_r, cts[1], 0.0).astype(qp.dtype)
    # the merged response state in each call's layout
    qx, ox, dox = (x.reshape(g, n * r, h, d) for x in (qr, o_r, do_r))
    lse_x = lse_r.transpose(0, 3, 1, 2).reshape(g, h, n * r)
    lse_o = lse_r.transpose(0, 1, 3, 2).reshape(g * n, h, r)
    f32 = jnp.promote_types(qp.dtype, jnp.float32)

    if opts.joint_prompt:
        dq_a, dkp, dvp = backend.backward(
            jnp.concatenate([qp, qx], axis=1), kp, vp, plen,
            jnp.concatenate([o_p, ox], axis=1), jnp.concatenate([lse_p, lse_x], axis=2),
            jnp.concatenate([do_p, dox], axis=1), causal=True, scale=scale)
        dqp, dqx = dq_a[:, :p], dq_a[:, p:]
        dkp, dvp = dkp.astype(f32), dvp.astype(f32)
    else:
        dqp, dkp1, dvp1 = backend.backward(qp, kp, vp, None, o_p, lse_p, do_p, causal=True,
                                           scale=scale)
        dqx, dkp2, dvp2 = backend.backward(qx, kp, vp, plen, ox, lse_x, dox, causal=False,
                                           scale=scale)
        dkp = dkp1.astype(f32) + dkp2.astype(f32)
        dvp = dvp1.astype(f32) + dvp2.astype(f32)
    dqo, dkr, dvr = backend.backward(
        qr.reshape(g * n, r, h, d), kr.reshape(g * n, r, kvh, d),
        vr.reshape(g * n, r, kvh, d), None, o_r.reshape(g * n, r, h, d), lse_o,
        do_r.reshape(g * n, r, h, d), causal=True, scale=scale)
    # a group with an empty prompt has no cross part: drop whatever its kernel returned
    dqx = jnp.where((plen > 0)[:, None, None, None], dqx.astype(f32), 0.0)
    dqr = dqx.reshape(g, n, r, h, d) + dqo.reshape(g, n, r, h, d).astype(f32)

    def clean(x, valid, like):  # exact zeros at padding (also drops whatever a kernel
        return jnp.where(valid, x, 0.0).astype(like.dtype)  # left in rows that saw no key)

    return (clean(dqp, valid_p, qp), clean(dkp, valid_p, kp), clean(dvp, valid_p, vp),
            clean(dqr, valid_r, qr), clean(dkr.reshape(kr.shape), valid_r, kr),
            clean(dvr.reshape(vr.shape), valid_r, vr), None, None)


_split_core.defvjp(_split_core_fwd, _split_core_bwd)


def shared_prefix_attention_split(
    q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp,
    prompt_lengths, resp_lengths, sm_scale: float, *,
    backend: FlashBackend, options: SplitOptions | None = None,
):
    """Split-design shared-prefix attention; same contract as the reference.

    Args: q_prompt `[G, P, H, D]`, k_prompt/v_prompt `[G, P, KH, D]`, q_resp
      `[G, N, R, H, D]`, k_resp/v_resp `[G, N, R, KH, D]`, prompt_lengths `[G]` int32,
      resp_lengths `[G, N]` int32 (validated), sm_scale float, backend (the flash
      kernel), options (`SplitOptions`, default two prompt-key calls).
    Returns: (o_prompt `[G, P, H, D]`, o_resp `[G, N, R, H, D]`) in the input dtype.
    """
    opts = SplitOptions() if options is None else options
    return _split_core(backend, opts, float(sm_scale), q_prompt, k_prompt, v_prompt,
                       q_resp, k_resp, v_resp, prompt_lengths.astype(jnp.int32),
                       resp_lengths.astype(jnp.int32))
