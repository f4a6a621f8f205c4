"""Kernel parts of the accelerator check, each run inside a task process
(`runner.worker_main`): the device probe, correctness against the references, DualKV
fwd+bwd (ours and the N-copies baselines, one implementation per process) and segment
decode. Every function takes `emit` (writes one row) and JSON-able keyword arguments.
"""
from __future__ import annotations

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp

from kernels.segment_decode import segment_decode_attention, tree_decode_attention
from kernels.shared_prefix_attention import SplitOptions, shared_prefix_attention
from kernels.tree_attention import tree_attention


def _rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def max_rel_err(a, b) -> float:
    """Largest |a - b| over the leaves, each relative to max(1, max |b|) of its leaf."""
    def err(x, y):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        return float(jnp.max(jnp.abs(x - y)) / jnp.maximum(1.0, jnp.max(jnp.abs(y))))
    return max(err(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compile_and_time(fn, args, seconds: float, min_reps: int = 3) -> dict:
    """Compile `jax.jit(fn)` for `args` (timed apart), run once, then time calls for at
    least `seconds` (and `min_reps` calls): median ms."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    first_s = time.perf_counter() - t0
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < seconds and len(times) < 200):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return {"compile_s": round(compile_s, 2), "first_call_s": round(first_s, 3),
            "ms": round(1e3 * statistics.median(times), 4), "reps": len(times)}


def probe(emit) -> None:
    """The device this process sees: platform, kind, memory, jax version."""
    from experiments.common.benchmarking import machine
    dev = jax.devices()[0]
    stats = {}
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices may not report memory
        stats = {}
    emit({"status": "ok", "platform": dev.platform, "device_kind": dev.device_kind,
          "compute_capability": getattr(dev, "compute_capability", None),
          "memory_bytes": stats.get("bytes_limit"), "jax_version": jax.__version__,
          "machine": machine()})


# ----------------------------------------------------------------------------- correctness

def _spa_inputs(g, n, p, r, h, kvh, d, dtype, seed=1):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    qkv = [_rand(ks[i], s, dtype) for i, s in enumerate(
        [(g, p, h, d), (g, p, kvh, d), (g, p, kvh, d), (g, n, r, h, d), (g, n, r, kvh, d),
         (g, n, r, kvh, d)])]
    cts = (_rand(ks[6], (g, p, h, d), dtype), _rand(ks[7], (g, n, r, h, d), dtype))
    return qkv, cts


def correctness(emit, *, dtype: str, head_dims: list, heads: int, kv_heads: int,
                impls: list, shape: list, tol: float) -> None:
    """Each impl's shared-prefix fwd+vjp, the platform's segment decode and (Triton) the
    tree decode kernel (`fork_spans`) and the training tree attention's fwd+vjp
    (`packed_tree_kend`) against the references, at ragged lengths; one row per (kernel,
    impl, head_dim). `impls` holds
    [impl, interpret] or [impl, interpret, SplitOptions fields]."""
    from kernels.shared_prefix_attention.cudnn import cudnn_supports
    g, n, p, r = shape
    plen = jnp.array([p, max(1, p // 8)], jnp.int32)[:g]
    rlen = jnp.array([[r, 0, 1], [r // 3, r, r // 2 + 1]], jnp.int32)[:g, :n]
    for d in head_dims:
        qkv, cts = _spa_inputs(g, n, p, r, heads, kv_heads, d, dtype)

        def spa(impl, interpret, options=None):
            opts = None if options is None else SplitOptions(**options)

            def fwd_vjp(*a):
                out, vjp = jax.vjp(lambda *x: shared_prefix_attention(
                    *x, prompt_lengths=plen, resp_lengths=rlen, impl=impl,
                    interpret=interpret, split_options=opts), *a)
                return out, vjp(cts)
            return jax.jit(fwd_vjp)(*qkv)

        def dec(impl, interpret):
            return jax.jit(lambda *a: segment_decode_attention(
                *a, prompt_lengths=plen, resp_lengths=rlen, impl=impl, interpret=interpret))(
                qkv[3][:, :, 0], qkv[1], qkv[2], qkv[4], qkv[5])

        lo, hi = fork_spans(rlen)

        def tree(impl, interpret):
            return jax.jit(lambda *a: tree_decode_attention(
                *a, prompt_lengths=plen, resp_lo=lo, resp_hi=hi, impl=impl,
                interpret=interpret))(qkv[3][:, :, 0], qkv[1], qkv[2], qkv[4], qkv[5])

        kend = packed_tree_kend(g, n, p, r)
        ks = jax.random.split(jax.random.PRNGKey(d), 4)
        t_len = kend.shape[1]
        tq, tct = (_rand(ks[i], (g, t_len, heads, d), dtype) for i in (0, 1))
        tk, tv = (_rand(ks[i], (g, t_len, kv_heads, d), dtype) for i in (2, 3))

        def train_tree(impl, interpret):
            def fwd_vjp(*a):
                out, vjp = jax.vjp(lambda *x: tree_attention(*x, kend, impl=impl,
                                                             interpret=interpret), *a)
                return out, vjp(tct)
            return jax.jit(fwd_vjp)(tq, tk, tv)

        want = {"shared_prefix fwd+vjp": spa("reference", None),
                "segment_decode": dec("reference", None), "tree_decode": tree("reference", None),
                "tree_attention fwd+vjp": train_tree("reference", None)}
        for impl, interpret, *options in impls:
            options = options[0] if options else None
            kernels = [("shared_prefix fwd+vjp", functools.partial(spa, options=options))]
            if impl in (None, "pallas", "pallas_triton", "pallas_mosaic", "xla"):
                kernels.append(("segment_decode", dec))
            if impl in ("pallas", "pallas_triton"):
                kernels += [("tree_decode", tree), ("tree_attention fwd+vjp", train_tree)]
            for kernel, run in kernels:
                row = {"kernel": kernel, "impl": impl or "default", "dtype": dtype,
                       "head_dim": d, "tol": tol}
                if options:
                    row["split_options"] = options
                if impl == "split_cudnn" and not cudnn_supports(dtype, d):
                    emit({**row, "status": "skipped", "ok": None,
                          "reason": f"cuDNN takes bf16/fp16 at head dims it supports, not "
                                    f"{dtype} at {d}"})
                    continue
                t0 = time.perf_counter()
                try:
                    err = max_rel_err(run(impl, interpret), want[kernel])
                    emit({**row, "status": "ok", "max_rel_err": err, "ok": err <= tol,
                          "seconds": round(time.perf_counter() - t0, 2)})
                except Exception as e:  # noqa: BLE001 - a failing kernel is a row
                    emit({**row, "status": "error", "ok": False,
                          "error": f"{type(e).__name__}: {str(e)[:600]}"})


def packed_tree_kend(g: int, n: int, p: int, r: int) -> jax.Array:
    """kend [g, T] of g packed trees (models.tree): a prompt of p tokens and n responses
    of r, response i > 0 forking off response i - 1 after i * r // (n + 1) tokens."""
    import numpy as np

    from models.tree import pack_tree, stack_trees, visible_until

    rng = np.random.default_rng(0)
    trees = []
    for _ in range(g):
        prompt = rng.integers(0, 1000, p).tolist()
        rows = [rng.integers(0, 1000, r).tolist()]
        for i in range(1, n):
            cut = i * r // (n + 1)
            rows.append(rows[-1][:cut] + rng.integers(0, 1000, r - cut).tolist())
        trees.append(pack_tree([prompt + x for x in rows]))
    st = stack_trees(trees)
    return visible_until(jnp.asarray(st["segment_ids"]), jnp.asarray(st["parents"]))


def fork_spans(resp_lengths):
    """A rollout tree's spans (kernels.segment_decode.tree) for the correctness rows: sample
    i > 0 of each group forked from sample 0 at half their shorter length."""
    g, n = resp_lengths.shape
    fork = jnp.minimum(resp_lengths, resp_lengths[:, :1]) // 2
    eye = jnp.eye(n, dtype=bool)[None]
    child = jnp.arange(n)[None, :, None] > 0
    lo = jnp.where(eye & child, fork[:, :, None], 0)
    hi = jnp.where(eye, resp_lengths[:, :, None], 0)
    hi = jnp.where(child & (jnp.arange(n)[None, None, :] == 0), fork[:, :, None], hi)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


# ----------------------------------------------------------------------------- DualKV

def n_copies(qp, kp, vp, qr, kr, vr):
    """[1, P, h, d] + [1, N, R, h, d] -> [N, P + R, h, d] (the naive batch)."""
    n = qr.shape[1]

    def cat(a, b):
        return jnp.concatenate([jnp.broadcast_to(a, (n,) + a.shape[1:]), b[0]], axis=1)
    return cat(qp, qr), cat(kp, kr), cat(vp, vr)


def _copies_fn(impl: str, heads: int, kv_heads: int):
    rep = heads // kv_heads
    if impl in ("copies_cudnn", "copies_xla"):
        kind = impl.split("_")[1]
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation=kind)
    if impl == "copies_pallas_flash" and jax.default_backend() == "gpu":
        from jax.experimental.pallas.ops.gpu.attention import mha
        return lambda q, k, v: mha(q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2),
                                   None, sm_scale=1 / math.sqrt(q.shape[-1]), causal=True)
    if impl == "copies_pallas_flash" and jax.default_backend() == "tpu":
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

        def tpu_flash(q, k, v):
            t = lambda x: jnp.repeat(x, heads // x.shape[2], axis=2).transpose(0, 2, 1, 3)  # noqa
            return flash_attention(t(q), t(k), t(v), causal=True,
                                   sm_scale=1 / math.sqrt(q.shape[-1])).transpose(0, 2, 1, 3)
        return tpu_flash
    raise ValueError(f"no baseline {impl!r} on {jax.default_backend()}")


def dualkv(emit, *, n: int, p: int, r: int, heads: int, kv_heads: int, head_dim: int,
           impl: str, interpret, seconds: float, dtype: str = "bfloat16") -> None:
    """fwd+bwd (vjp w.r.t. q/k/v) of one implementation at (N, P, R): ours on the packed
    layout (impl = "default" or a shared_prefix_attention impl), or a baseline on N
    copies of [prompt, response_n] (impl = "copies_*", copies built before timing)."""
    packed, cts = _spa_inputs(1, n, p, r, heads, kv_heads, head_dim, dtype, seed=n)
    if impl.startswith("copies_"):
        args = n_copies(*packed)
        ct = _rand(jax.random.PRNGKey(7), args[0].shape, dtype)
        fn = _copies_fn(impl, heads, kv_heads)
    else:
        args, ct = packed, cts
        kernel_impl = None if impl == "default" else impl

        def fn(*a):
            return shared_prefix_attention(*a, impl=kernel_impl, interpret=interpret)

    def fwd_bwd(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(ct)

    emit({"N": n, "P": p, "R": r, "impl": impl, "dtype": dtype, "status": "ok",
          **compile_and_time(fwd_bwd, tuple(args), seconds)})


# ----------------------------------------------------------------------------- decode

def decode(emit, *, n: int, p: int, r: int, heads: int, kv_heads: int, head_dim: int,
           interpret, seconds: float) -> None:
    """One segment-decode step (the platform's kernel) vs decode over a replicated cache."""
    from models.attention import decode_attention
    h, kvh, d = heads, kv_heads, head_dim
    ks = jax.random.split(jax.random.PRNGKey(p), 7)
    dt = jnp.bfloat16
    q = _rand(ks[0], (1, n, h, d), dt)
    kp, vp = _rand(ks[1], (1, p, kvh, d), dt), _rand(ks[2], (1, p, kvh, d), dt)
    kr, vr = _rand(ks[3], (1, n, r, kvh, d), dt), _rand(ks[4], (1, n, r, kvh, d), dt)
    kn, vn = _rand(ks[5], (1, n, kvh, d), dt), _rand(ks[6], (1, n, kvh, d), dt)
    plen = jnp.array([p], jnp.int32)
    rlen = jnp.full((1, n), r, jnp.int32)
    k_rep = jnp.concatenate([jnp.broadcast_to(kp, (n, p, kvh, d)), kr[0]], axis=1)
    v_rep = jnp.concatenate([jnp.broadcast_to(vp, (n, p, kvh, d)), vr[0]], axis=1)

    def segment(q, kp, vp, kr, vr):
        return segment_decode_attention(q, kp, vp, kr, vr, prompt_lengths=plen,
                                        resp_lengths=rlen, k_new=kn, v_new=vn,
                                        interpret=interpret)

    def replicated(q, k, v):
        return decode_attention(q[0][:, None], k, v, jnp.full((n,), p + r, jnp.int32),
                                kn[0], vn[0], impl="xla")

    seg = compile_and_time(segment, (q, kp, vp, kr, vr), seconds, min_reps=5)
    rep = compile_and_time(replicated, (q, k_rep, v_rep), seconds, min_reps=5)
    diff = max_rel_err(jax.jit(segment)(q, kp, vp, kr, vr),
                       jax.jit(replicated)(q, k_rep, v_rep)[:, 0][None])
    emit({"N": n, "P": p, "R": r, "status": "ok", "ms": {"segment": seg["ms"],
                                                         "replicated": rep["ms"]},
          "compile_s": {"segment": seg["compile_s"], "replicated": rep["compile_s"]},
          "speedup": round(rep["ms"] / seg["ms"], 3), "max_rel_err": diff})
