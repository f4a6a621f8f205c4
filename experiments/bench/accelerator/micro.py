"""The two CPU micro-benchmarks that were separate scripts (bench_spa_kernel,
bench_segment_decode_kernel), now parts `spa_kernel` and `decode_kernel` of
experiments.bench.accelerator. Each runs in its task process, emits one row per shape and,
unless told not to (`legacy_out=None`, as in --smoke), rewrites its old results file
(experiments/results/bench_spa_kernel.json / bench_segment_decode_kernel.json) in the same
format as before: {"headline", "config", "rows"}.

spa_kernel: shared-prefix attention fwd+bwd, fp32, 1 group, 4 heads / 2 kv heads, head_dim
  64, full lengths: the naive reference (N copies inside the call), the naive batch held
  as a model would ([N, P+R] sequences, plain masked causal attention) and impl="xla"
  (prompt once). Headline: reference / xla at the last shape, target 0.7 * rho,
  rho = N(P+R)/(P+NR).
decode_kernel: one decode-attention step, fp32, SmolLM2-135M attention shape (9 / 3 heads,
  head_dim 64), 2 groups: the replicated cache (two layouts; the faster is the baseline)
  vs the shared prompt segment (impl="xla"; "pallas" too off CPU). Headline: replicated /
  xla at N = 64, P = 1024, target 2.0.
"""
from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common.benchmarking import machine, time_calls
from kernels.segment_decode import segment_decode_attention
from kernels.shared_prefix_attention import shared_prefix_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def rho(n: int, p: int, r: int) -> float:
    """Token-count ratio of the naive batch to the packed layout."""
    return n * (p + r) / (p + n * r)


def naive_dense_attention(q, k, v):
    """Causal GQA attention over pre-replicated sequences.

    q `[B, L, heads, d]`, k/v `[B, L, kv_heads, d]` -> `[B, L, heads, d]`.
    """
    b, length, h, d = q.shape
    kvh = k.shape[2]
    q5 = q.reshape(b, length, kvh, h // kvh, d)
    s = jnp.einsum("bqkrd,bskd->bkrqs", q5, k) / np.sqrt(d)
    causal = jnp.tril(jnp.ones((length, length), bool))
    w = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    return jnp.einsum("bkrqs,bskd->bqkrd", w, v).reshape(b, length, h, d)


def _write(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def spa_kernel(emit, *, shapes: list, seconds: float, legacy_out: str | None) -> None:
    load_before = os.getloadavg()[0]
    rows = []
    for n, p, r in shapes:
        rng = np.random.default_rng(0)
        normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
        packed = (normal(1, p, HEADS, HEAD_DIM), normal(1, p, KV_HEADS, HEAD_DIM),
                  normal(1, p, KV_HEADS, HEAD_DIM), normal(1, n, r, HEADS, HEAD_DIM),
                  normal(1, n, r, KV_HEADS, HEAD_DIM), normal(1, n, r, KV_HEADS, HEAD_DIM))
        packed_cts = (normal(1, p, HEADS, HEAD_DIM), normal(1, n, r, HEADS, HEAD_DIM))

        def replicate(prompt, resp):  # [1, P, h, d] + [1, N, R, h, d] -> [N, P+R, h, d]
            return jnp.concatenate([jnp.broadcast_to(prompt, (n,) + prompt.shape[1:]),
                                    resp[0]], 1)

        naive = tuple(replicate(packed[i], packed[i + 3]) for i in range(3))
        naive_cts = normal(n, p + r, HEADS, HEAD_DIM)

        def fwd_bwd(fn, args, cts):
            run = jax.jit(lambda a, c: (lambda out, vjp: (out, vjp(c)))(*jax.vjp(fn, *a)))
            jax.block_until_ready(run(args, cts))
            return lambda: run(args, cts)

        ms = time_calls({
            "reference": fwd_bwd(lambda *a: shared_prefix_attention(*a, impl="reference"),
                                 packed, packed_cts),
            "naive_dense": fwd_bwd(naive_dense_attention, naive, naive_cts),
            "xla": fwd_bwd(lambda *a: shared_prefix_attention(*a, impl="xla"), packed,
                           packed_cts)}, seconds, min_reps=3)
        row = {"N": n, "P": p, "R": r, "rho": rho(n, p, r), "ms": ms,
               "reference_over_xla": ms["reference"] / ms["xla"],
               "naive_dense_over_xla": ms["naive_dense"] / ms["xla"]}
        rows.append(row)
        emit({"status": "ok", **row})
    last = rows[-1]
    _write(legacy_out, {
        "headline": {"metric": (f"fwd+bwd time ratio naive reference / xla at N={last['N']}, "
                                f"P={last['P']}, R={last['R']} (target 0.7*rho)"),
                     "value": round(last["reference_over_xla"], 3),
                     "target": round(0.7 * last["rho"], 3), "machine": machine()},
        "config": {"groups": 1, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                   "dtype": "float32", "min_seconds": seconds,
                   "written_by": "python -m experiments.bench.accelerator --parts spa_kernel",
                   "load_average_1m": {"before": round(load_before, 2),
                                       "after": round(os.getloadavg()[0], 2)}},
        "rows": rows})


@partial(jax.jit, static_argnames=("sm_scale", "kv_major"))
def replicated_decode(q, k_rep, v_rep, lengths, *, sm_scale, kv_major):
    """Decode attention over a replicated cache; valid keys of sample (g, n) are the
    prefix lengths[g, n] of its row. q [G, N, heads, d]; k_rep, v_rep [G, N, L, kv, d], or
    [G, N, kv, L, d] when kv_major. Returns [G, N, heads, d]."""
    g, n, h, d = q.shape
    kv = "gnkld" if kv_major else "gnlkd"
    length = k_rep.shape[3 if kv_major else 2]
    q5 = q.reshape(g, n, k_rep.shape[2 if kv_major else 3], -1, d)
    s = jnp.einsum(f"gnkhd,{kv}->gnkhl", q5, k_rep) * sm_scale
    valid = (jnp.arange(length)[None, None, :] < lengths[:, :, None])[:, :, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
    return jnp.einsum(f"gnkhl,{kv}->gnkhd", p, v_rep).reshape(g, n, h, d)


def decode_kernel(emit, *, ns: list, ps: list, r_max: int, seconds: float,
                  legacy_out: str | None, groups: int = 2, heads: int = 9, kv_heads: int = 3,
                  head_dim: int = 64) -> None:
    rng = np.random.default_rng(0)
    rows = []
    for n in ns:
        for p in ps:
            normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa
            g = groups
            q = normal(g, n, heads, head_dim)
            k_p, v_p = normal(g, p, kv_heads, head_dim), normal(g, p, kv_heads, head_dim)
            k_r, v_r = normal(g, n, r_max, kv_heads, head_dim), normal(g, n, r_max, kv_heads,
                                                                        head_dim)
            p_len = jnp.full((g,), p, jnp.int32)
            r_len = jnp.asarray(rng.integers(r_max // 2, r_max + 1, (g, n)), jnp.int32)
            tile = lambda x: jnp.broadcast_to(x[:, None], (g, n) + x.shape[1:])  # noqa
            k_rep, v_rep = jnp.concatenate([tile(k_p), k_r], 2), jnp.concatenate([tile(v_p),
                                                                                 v_r], 2)
            k_t, v_t = k_rep.transpose(0, 1, 3, 2, 4), v_rep.transpose(0, 1, 3, 2, 4)
            scale = 1.0 / head_dim ** 0.5
            seg = lambda impl: (lambda: segment_decode_attention(  # noqa: E731
                q, k_p, v_p, k_r, v_r, prompt_lengths=p_len, resp_lengths=r_len, impl=impl))
            calls = {"replicated": lambda: replicated_decode(q, k_rep, v_rep, p + r_len,
                                                             sm_scale=scale, kv_major=False),
                     "replicated_kv_major": lambda: replicated_decode(
                         q, k_t, v_t, p + r_len, sm_scale=scale, kv_major=True),
                     "reference": seg("reference"), "xla": seg("xla")}
            if jax.default_backend() != "cpu":
                calls["pallas"] = seg("pallas")
            outs = {name: np.asarray(fn()) for name, fn in calls.items()}  # also compiles
            diff = max(float(np.abs(o - outs["replicated"]).max()) for o in outs.values())
            ms = time_calls(calls, seconds)
            shared = sum(x.nbytes for x in (k_p, v_p, k_r, v_r))
            row = {"N": n, "P": p, "R_max": r_max,
                   **{f"{name}_ms": round(t, 4) for name, t in ms.items()},
                   "speedup_vs_replicated": round(
                       min(ms["replicated"], ms["replicated_kv_major"]) / ms["xla"], 3),
                   "speedup_vs_reference": round(ms["reference"] / ms["xla"], 3),
                   "kv_bytes_shared": shared, "kv_bytes_replicated": k_rep.nbytes + v_rep.nbytes,
                   "kv_bytes_ratio": round((k_rep.nbytes + v_rep.nbytes) / shared, 3),
                   "prompt_kv_bytes_shared": k_p.nbytes + v_p.nbytes,
                   "prompt_kv_bytes_replicated": (k_p.nbytes + v_p.nbytes) * n,
                   "max_abs_diff_vs_replicated": diff}
            rows.append(row)
            emit({"status": "ok", **row})
    head = next((x for x in rows if x["N"] == 64 and x["P"] == 1024), rows[-1])
    _write(legacy_out, {
        "headline": {"metric": f"decode-attention time, replicated cache (faster layout) / "
                               f"shared prompt segment (impl=xla), N={head['N']}, "
                               f"P={head['P']}, R={r_max}",
                     "value": head["speedup_vs_replicated"], "target": 2.0,
                     "machine": machine()},
        "config": {"groups": groups, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": head_dim, "R_max": r_max, "dtype": "float32",
                   "resp_lengths": "uniform in [R_max/2, R_max]", "timing": "median ms",
                   "written_by": "python -m experiments.bench.accelerator --parts "
                                 "decode_kernel",
                   "load_average_1min_at_end": round(os.getloadavg()[0], 2)},
        "rows": rows})
