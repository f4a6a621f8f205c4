"""Micro-benchmark: one decode-attention step, shared prompt segment vs replicated cache.

    python -m experiments.bench_segment_decode_kernel [--reps-seconds 0.4]

For N in {8, 64} samples per prompt, P in {256, 1024} prompt tokens and R = 64 response
tokens (SmolLM2-135M attention shape: 9 heads, 3 kv heads, head_dim 64, 2 groups, fp32)
it times
  replicated  the replicated layout the segment kernel replaces: a cache holding
              [groups, N, P + R, kv_heads, d] (the prompt copied into every sample,
              built beforehand), plain masked-softmax decode attention per sample;
  replicated_kv_major  the same with the cache stored [groups, N, kv_heads, P + R, d],
              which spares XLA a transpose on CPU (the faster of the two replicated
              timings is the baseline of the headline, to be conservative);
  reference   impl="reference": replicates and concatenates inside the call (slow twin);
  xla         impl="xla": prompt segment stored once per group, the N queries folded
              into one matrix against it (Hydragen), response segment per sample;
  pallas      impl="pallas" (only when an accelerator is the default backend),
and the KV-cache bytes of both layouts. Writes
experiments/results/bench_segment_decode_kernel.json; the headline is the
best replicated / xla time ratio at N = 64, P = 1024 (target 2.0).
"""
from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarking import machine, time_calls
from kernels.segment_decode import segment_decode_attention

GROUPS, HEADS, KV_HEADS, HEAD_DIM, R_MAX = 2, 9, 3, 64, 64
NS, PS = (8, 64), (256, 1024)
RESULT = Path(__file__).parent / "results" / "bench_segment_decode_kernel.json"


@partial(jax.jit, static_argnames=("sm_scale", "kv_major"))
def replicated_decode(q, k_rep, v_rep, lengths, *, sm_scale, kv_major):
    """Decode attention over a replicated cache, the valid keys of sample (g, n) being the
    prefix lengths[g, n] of its row (the prompt is full here).

    q [groups, N, heads, d]; k_rep, v_rep [groups, N, L, kv_heads, d], or
    [groups, N, kv_heads, L, d] when kv_major. Returns [groups, N, heads, d].
    """
    g, n, h, d = q.shape
    kv = "gnkld" if kv_major else "gnlkd"
    length = k_rep.shape[3 if kv_major else 2]
    q5 = q.reshape(g, n, k_rep.shape[2 if kv_major else 3], -1, d)
    s = jnp.einsum(f"gnkhd,{kv}->gnkhl", q5, k_rep) * sm_scale
    valid = (jnp.arange(length)[None, None, :] < lengths[:, :, None])[:, :, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
    return jnp.einsum(f"gnkhl,{kv}->gnkhd", p, v_rep).reshape(g, n, h, d)


def bench_one(n: int, p: int, reps_seconds: float, rng: np.random.Generator) -> dict:
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q = normal(GROUPS, n, HEADS, HEAD_DIM)
    k_p, v_p = normal(GROUPS, p, KV_HEADS, HEAD_DIM), normal(GROUPS, p, KV_HEADS, HEAD_DIM)
    k_r = normal(GROUPS, n, R_MAX, KV_HEADS, HEAD_DIM)
    v_r = normal(GROUPS, n, R_MAX, KV_HEADS, HEAD_DIM)
    p_len = jnp.full((GROUPS,), p, jnp.int32)
    r_len = jnp.asarray(rng.integers(R_MAX // 2, R_MAX + 1, (GROUPS, n)), jnp.int32)
    tile = lambda x: jnp.broadcast_to(x[:, None], (GROUPS, n) + x.shape[1:])
    k_rep = jnp.concatenate([tile(k_p), k_r], axis=2)  # the replicated cache, built once
    v_rep = jnp.concatenate([tile(v_p), v_r], axis=2)
    k_rep_t, v_rep_t = k_rep.transpose(0, 1, 3, 2, 4), v_rep.transpose(0, 1, 3, 2, 4)
    sm_scale = 1.0 / HEAD_DIM ** 0.5

    seg = lambda impl: (lambda: segment_decode_attention(
        q, k_p, v_p, k_r, v_r, prompt_lengths=p_len, resp_lengths=r_len, impl=impl))
    calls = {"replicated": lambda: replicated_decode(q, k_rep, v_rep, p + r_len,
                                                     sm_scale=sm_scale, kv_major=False),
             "replicated_kv_major": lambda: replicated_decode(
                 q, k_rep_t, v_rep_t, p + r_len, sm_scale=sm_scale, kv_major=True),
             "reference": seg("reference"), "xla": seg("xla")}
    if jax.default_backend() != "cpu":
        calls["pallas"] = seg("pallas")
    outs = {name: np.asarray(fn()) for name, fn in calls.items()}  # also compiles
    max_diff = max(float(np.abs(o - outs["replicated"]).max()) for o in outs.values())
    ms = time_calls(calls, reps_seconds)

    shared_bytes = sum(x.nbytes for x in (k_p, v_p, k_r, v_r))
    replicated_bytes = k_rep.nbytes + v_rep.nbytes
    return {
        "N": n, "P": p, "R_max": R_MAX,
        **{f"{name}_ms": round(t, 4) for name, t in ms.items()},
        "speedup_vs_replicated": round(
            min(ms["replicated"], ms["replicated_kv_major"]) / ms["xla"], 3),
        "speedup_vs_reference": round(ms["reference"] / ms["xla"], 3),
        "kv_bytes_shared": shared_bytes,
        "kv_bytes_replicated": replicated_bytes,
        "kv_bytes_ratio": round(replicated_bytes / shared_bytes, 3),
        "prompt_kv_bytes_shared": k_p.nbytes + v_p.nbytes,
        "prompt_kv_bytes_replicated": (k_p.nbytes + v_p.nbytes) * n,
        "max_abs_diff_vs_replicated": max_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps-seconds", type=float, default=0.3,
                        help="time budget per measurement (at least 5 timed calls)")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = [bench_one(n, p, args.reps_seconds, rng) for n in NS for p in PS]

    cols = [c for c in ("replicated_ms", "replicated_kv_major_ms", "reference_ms", "xla_ms",
                        "pallas_ms") if c in rows[0]]
    print(f"{'N':>4} {'P':>5} " + " ".join(f"{c:>{len(c)}}" for c in cols)
          + f" {'rep/xla':>8} {'KV MiB shared':>14} {'KV MiB repl.':>13}")
    for r in rows:
        print(f"{r['N']:>4} {r['P']:>5} " + " ".join(f"{r[c]:>{len(c)}.3f}" for c in cols)
              + f" {r['speedup_vs_replicated']:>8.2f} {r['kv_bytes_shared'] / 2**20:>14.2f}"
              f" {r['kv_bytes_replicated'] / 2**20:>13.2f}")

    head = next(r for r in rows if r["N"] == 64 and r["P"] == 1024)
    result = {
        "headline": {
            "metric": "decode-attention time, replicated cache (faster layout) / shared "
                      "prompt segment (impl=xla), N=64, P=1024, R=64",
            "value": head["speedup_vs_replicated"],
            "target": 2.0,
            "machine": machine(),
        },
        "config": {"groups": GROUPS, "heads": HEADS, "kv_heads": KV_HEADS,
                   "head_dim": HEAD_DIM, "R_max": R_MAX, "dtype": "float32",
                   "resp_lengths": "uniform in [R_max/2, R_max]", "timing": "median ms",
                   # Other processes share the CPU; the load says how noisy the times are.
                   "load_average_1min_at_end": round(os.getloadavg()[0], 2)},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"headline: {result['headline']['value']:.2f}x (target 2.0) -> {args.out}")


if __name__ == "__main__":
    main()
