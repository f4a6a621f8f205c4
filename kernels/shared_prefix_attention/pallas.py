"""Pallas shared-prefix attention: fused forward and backward kernels, one custom_vjp.

Layout inside the kernels (after padding in the wrapper): prompt arrays `[G, Pp, h, Dp]`,
response arrays flattened to `[B = G*N, Rp, h, Dp]`, base-2 log-sum-exp `[*, H, len]` fp32.

Launches (written for the Triton lowering: power-of-two tiles, ref slicing with `pl.ds`,
fp32 online-softmax state in registers), each with its own tiles, warps and stages
(`BlockSizes.launch`):
  forward  1. fwd_prompt   prompt queries: causal flash attention over the prompt tiles.
           2. fwd_resp     response queries: the prompt tiles, then the own-response
                           tiles, carrying (acc, m, l); store o and lse.
  backward 3. dq_prompt    causal over the prompt tiles, p = exp2(s - lse).
           4. dq_resp      same two regions as fwd_resp.
           5. dkdv_resp    per KV head: own response queries of its query heads.
           6. dkdv_prompt  per KV head: the prompt's causal queries, then the group's live
                           response tiles (one flat loop from a table), fp32 registers.
Grids are `(sequence, query head, tile)` for 1-4 and `(sequence, kv head, tile)` for 5-6.
The tile bodies (exp2 with folded scale, masks on boundary tiles only) are in
`pallas_kernels.py`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.dispatch import by_platform
from kernels.shared_prefix_attention import pallas_kernels as kern
from kernels.shared_prefix_attention.config import LAUNCHES, BlockSizes

_F32 = jnp.float32


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One launch's tiles, each clamped to the sequence it tiles, and its Triton knobs."""

    q_p: int            # query rows per tile on the prompt
    q_r: int            # query rows per tile on a response
    k_p: int            # key rows per tile on the prompt
    k_r: int            # key rows per tile on a response
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static launch plan (hashable: it is a nondiff argument of the custom_vjp)."""

    n_resp: int
    rep: int            # query heads per kv head
    scale: float
    p_pad: int
    r_pad: int
    interpret: bool
    launches: tuple[tuple[str, Tiles], ...]

    def tiles(self, name: str) -> Tiles:
        return dict(self.launches)[name]


def make_plan(p: int, r: int, n: int, rep: int, scale: float, bs: BlockSizes,
              interpret: bool) -> Plan:
    cap_p, cap_r = _next_pow2(p), _next_pow2(r)
    launches = []
    for name in LAUNCHES:
        cfg = bs.launch(name)
        tiles = Tiles(min(cfg.block_q, cap_p), min(cfg.block_q, cap_r),
                      min(cfg.block_k, cap_p), min(cfg.block_k, cap_r), cfg.warps,
                      cfg.num_stages)
        launches.append((name, tiles))
    # powers of two: the largest tile on a sequence is a multiple of every other one
    p_pad = _round_up(p, max(max(t.q_p, t.k_p) for _, t in launches))
    r_pad = _round_up(r, max(max(t.q_r, t.k_r) for _, t in launches))
    return Plan(n, rep, scale, p_pad, r_pad, interpret, tuple(launches))


# ----------------------------------------------------------------------------- launches

def kernel_name(launch: str) -> str:
    """The Triton kernel's name of a launch in lowered modules: spa_fwd_prompt, ...,
    spa_bwd_dkdv_prompt."""
    return f"spa_{launch}" if launch.startswith("fwd") else f"spa_bwd_{launch}"


def _call(kernel, plan: Plan, name: str, grid, in_specs, out_specs, out_shape):
    tiles = plan.tiles(name)
    kwargs = {}
    if not plan.interpret:  # compiled: this kernel is lowered for GPU (Triton) only
        from jax.experimental.pallas import triton as plgpu
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=tiles.num_warps,
                                                         num_stages=tiles.num_stages)
    return pl.pallas_call(functools.partial(kernel, plan=plan, tiles=tiles), grid=grid,
                          in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=plan.interpret, name=kernel_name(name), **kwargs)


class _Specs:
    """BlockSpec factories (grid = (seq, head, tile); head = query head for the forward
    and dq launches, kv head for the dk/dv launches)."""

    def __init__(self, plan: Plan, dp: int):
        self.n, self.rep, self.dp = plan.n_resp, plan.rep, dp

    def tile(self, b):        # one tile of rows of a [S, L, h, Dp] array, head h
        return pl.BlockSpec((None, b, None, self.dp), lambda s, h, i: (s, i, h, 0))

    def full_kv(self, length, of_group=False):   # whole sequence, kv head of query head h
        n, rep = self.n, self.rep
        if of_group:
            return pl.BlockSpec((None, length, None, self.dp),
                                lambda s, h, i: (lax.div(s, n), 0, lax.div(h, rep), 0))
        return pl.BlockSpec((None, length, None, self.dp),
                            lambda s, h, i: (s, 0, lax.div(h, rep), 0))

    def heads_of_kv(self, length):   # whole sequence, the rep query heads of kv head h
        return pl.BlockSpec((None, length, self.rep, self.dp), lambda s, h, i: (s, 0, h, 0))

    def row_stat(self, b):    # [S, H, L] statistics, one tile
        return pl.BlockSpec((None, None, b), lambda s, h, i: (s, h, i))

    def stats_of_kv(self, length):   # [S, H, L] statistics, the rep heads of kv head h
        return pl.BlockSpec((None, self.rep, length), lambda s, h, i: (s, h, 0))

    def scalar(self, of_group=False):
        n = self.n
        if of_group:
            return pl.BlockSpec((None,), lambda s, h, i: (lax.div(s, n),))
        return pl.BlockSpec((None,), lambda s, h, i: (s,))


def _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan: Plan):
    g, pp, h, dp = qp.shape
    b, rp = qr.shape[:2]
    sp = _Specs(plan, dp)
    bq_p, bq_r = plan.tiles("fwd_prompt").q_p, plan.tiles("fwd_resp").q_r
    o_p, lse_p = _call(
        kern.fwd_prompt_kernel, plan, "fwd_prompt", (g, h, pp // bq_p),
        [sp.scalar(), sp.tile(bq_p), sp.full_kv(pp), sp.full_kv(pp)],
        [sp.tile(bq_p), sp.row_stat(bq_p)],
        [jax.ShapeDtypeStruct(qp.shape, qp.dtype), jax.ShapeDtypeStruct((g, h, pp), _F32)],
    )(plen, qp, kp, vp)
    o_r, lse_r = _call(
        kern.fwd_resp_kernel, plan, "fwd_resp", (b, h, rp // bq_r),
        [sp.scalar(of_group=True), sp.scalar(), sp.tile(bq_r), sp.full_kv(pp, of_group=True),
         sp.full_kv(pp, of_group=True), sp.full_kv(rp), sp.full_kv(rp)],
        [sp.tile(bq_r), sp.row_stat(bq_r)],
        [jax.ShapeDtypeStruct(qr.shape, qr.dtype), jax.ShapeDtypeStruct((b, h, rp), _F32)],
    )(plen, rlen, qr, kp, vp, kr, vr)
    return o_p, o_r, lse_p, lse_r


def _live_response_tiles(rlen, g: int, n: int, r_pad: int, bq: int):
    """Per group: the flat ids n * (r_pad // bq) + t of the response query tiles holding a
    valid row, first (ascending), then the dead ones; and how many are live.
    Returns (ids `[G, N * tiles]` int32, n_live `[G]` int32)."""
    per_resp = r_pad // bq
    live = (jnp.arange(per_resp)[None, None, :]
            < kern.cdiv(rlen.reshape(g, n), bq)[..., None]).reshape(g, n * per_resp)
    ids = jnp.argsort(~live, axis=1, stable=True).astype(jnp.int32)
    return ids, jnp.sum(live, axis=1, dtype=jnp.int32)


def _backward(plan: Plan, res, cts):
    qp, kp, vp, qr, kr, vr, plen, rlen, o_p, o_r, lse_p, lse_r = res
    do_p, do_r = cts
    g, pp, h, dp = qp.shape
    b, rp = qr.shape[:2]
    kvh = kp.shape[2]
    n = plan.n_resp
    sp = _Specs(plan, dp)
    # delta = rowsum(dO * O): the softmax-jacobian term, [S, H, L] fp32
    delta_p = jnp.einsum("gphd,gphd->ghp", do_p.astype(_F32), o_p.astype(_F32))
    delta_r = jnp.einsum("bphd,bphd->bhp", do_r.astype(_F32), o_r.astype(_F32))

    bq = plan.tiles("dq_prompt").q_p
    dq_p = _call(
        kern.dq_prompt_kernel, plan, "dq_prompt", (g, h, pp // bq),
        [sp.scalar(), sp.tile(bq), sp.tile(bq), sp.row_stat(bq), sp.row_stat(bq),
         sp.full_kv(pp), sp.full_kv(pp)],
        sp.tile(bq), jax.ShapeDtypeStruct(qp.shape, qp.dtype),
    )(plen, qp, do_p, lse_p, delta_p, kp, vp)
    bq = plan.tiles("dq_resp").q_r
    dq_r = _call(
        kern.dq_resp_kernel, plan, "dq_resp", (b, h, rp // bq),
        [sp.scalar(of_group=True), sp.scalar(), sp.tile(bq), sp.tile(bq), sp.row_stat(bq),
         sp.row_stat(bq), sp.full_kv(pp, of_group=True), sp.full_kv(pp, of_group=True),
         sp.full_kv(rp), sp.full_kv(rp)],
        sp.tile(bq), jax.ShapeDtypeStruct(qr.shape, qr.dtype),
    )(plen, rlen, qr, do_r, lse_r, delta_r, kp, vp, kr, vr)

    bk = plan.tiles("dkdv_resp").k_r
    dk_r, dv_r = _call(
        kern.dkdv_resp_kernel, plan, "dkdv_resp", (b, kvh, rp // bk),
        [sp.scalar(), sp.tile(bk), sp.tile(bk), sp.heads_of_kv(rp), sp.heads_of_kv(rp),
         sp.stats_of_kv(rp), sp.stats_of_kv(rp)],
        [sp.tile(bk), sp.tile(bk)],
        [jax.ShapeDtypeStruct(kr.shape, kr.dtype), jax.ShapeDtypeStruct(vr.shape, vr.dtype)],
    )(rlen, kr, vr, qr, do_r, lse_r, delta_r)

    tiles = plan.tiles("dkdv_prompt")
    ids, n_live = _live_response_tiles(rlen, g, n, rp, tiles.q_r)
    # all N responses of group s: blocks of N along the flattened [G*N] axis
    group_q = pl.BlockSpec((n, rp, plan.rep, dp), lambda s, hh, i: (s, 0, hh, 0))
    group_stat = pl.BlockSpec((n, plan.rep, rp), lambda s, hh, i: (s, hh, 0))
    ids_spec = pl.BlockSpec((None, ids.shape[1]), lambda s, hh, i: (s, 0))
    bk = tiles.k_p
    dk_p, dv_p = _call(
        kern.dkdv_prompt_kernel, plan, "dkdv_prompt", (g, kvh, pp // bk),
        [sp.scalar(), ids_spec, sp.scalar(), sp.tile(bk), sp.tile(bk),
         sp.heads_of_kv(pp), sp.heads_of_kv(pp), sp.stats_of_kv(pp), sp.stats_of_kv(pp),
         group_q, group_q, group_stat, group_stat],
        [sp.tile(bk), sp.tile(bk)],
        [jax.ShapeDtypeStruct(kp.shape, kp.dtype), jax.ShapeDtypeStruct(vp.shape, vp.dtype)],
    )(plen, ids, n_live, kp, vp, qp, do_p, lse_p, delta_p, qr, do_r, lse_r, delta_r)
    return dq_p, dk_p, dv_p, dq_r, dk_r, dv_r, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _spa_core(qp, kp, vp, qr, kr, vr, plen, rlen, plan: Plan):
    o_p, o_r, _, _ = _forward(qp, kp, vp, qr, kr, vr, plen, rlen, plan)
    return o_p, o_r


def _spa_core_fwd(qp, kp, vp, qr, kr, vr, plen, rlen, plan: Plan):
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
    plan = make_plan(p, r, n, h // kvh, sm_scale, bs, interpret)
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
