"""Micro-benchmark: shared-prefix attention fwd+bwd, naive N copies vs the XLA kernel (CPU).

    python -m experiments.bench_spa_kernel [--min-seconds 1.0] [--shapes 4,256,64 16,1024,64]

For each (N, P, R) (1 group, 4 heads, 2 kv heads, head_dim 64, fp32, full lengths) it
times one jitted forward + backward (vjp w.r.t. all six q/k/v inputs, random cotangent) of
  reference    impl="reference": N copies of [prompt, resp_n], dense causal mask;
  naive_dense  the naive batch as a model would hold it: [N, P+R] sequences built
               beforehand, plain masked causal attention (no copying inside the timing);
  xla          impl="xla": prompt attended once, responses over [prompt | own] keys,
and prints the ratios with rho = N(P+R)/(P+NR). Writes
experiments/results/bench_spa_kernel.json; the headline is reference/xla at the largest
shape, with target 0.7 * rho for that shape (the issue's step-time target).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarking import machine
from kernels.shared_prefix_attention import shared_prefix_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
DEFAULT_SHAPES = ((4, 256, 64), (16, 256, 64), (16, 512, 32))
RESULT = Path(__file__).parent / "results" / "bench_spa_kernel.json"


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


def _fwd_bwd(fn):
    def run(args, cts):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cts)
    return jax.jit(run)


def _time(fn, args, cts, min_seconds: float) -> float:
    """Median wall time of fn(args, cts) in seconds (after one compile/warm-up call)."""
    jax.block_until_ready(fn(args, cts))
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_seconds and len(times) < 50):
        t = time.perf_counter()
        jax.block_until_ready(fn(args, cts))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_shape(n: int, p: int, r: int, min_seconds: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    packed = (normal(1, p, HEADS, HEAD_DIM), normal(1, p, KV_HEADS, HEAD_DIM),
              normal(1, p, KV_HEADS, HEAD_DIM), normal(1, n, r, HEADS, HEAD_DIM),
              normal(1, n, r, KV_HEADS, HEAD_DIM), normal(1, n, r, KV_HEADS, HEAD_DIM))
    packed_cts = (normal(1, p, HEADS, HEAD_DIM), normal(1, n, r, HEADS, HEAD_DIM))

    def replicate(prompt, resp):  # [1, P, h, d] + [1, N, R, h, d] -> [N, P+R, h, d]
        return jnp.concatenate([jnp.broadcast_to(prompt, (n,) + prompt.shape[1:]), resp[0]], 1)

    naive = tuple(replicate(packed[i], packed[i + 3]) for i in range(3))
    naive_cts = normal(n, p + r, HEADS, HEAD_DIM)

    seconds = {
        "reference": _time(_fwd_bwd(lambda *a: shared_prefix_attention(*a, impl="reference")),
                           packed, packed_cts, min_seconds),
        "naive_dense": _time(_fwd_bwd(naive_dense_attention), naive, naive_cts, min_seconds),
        "xla": _time(_fwd_bwd(lambda *a: shared_prefix_attention(*a, impl="xla")),
                     packed, packed_cts, min_seconds),
    }
    return {
        "N": n, "P": p, "R": r, "rho": rho(n, p, r),
        "ms": {k: 1e3 * v for k, v in seconds.items()},
        "reference_over_xla": seconds["reference"] / seconds["xla"],
        "naive_dense_over_xla": seconds["naive_dense"] / seconds["xla"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="time each variant for at least this long (median reported)")
    parser.add_argument("--shapes", nargs="+", default=[",".join(map(str, s))
                                                        for s in DEFAULT_SHAPES],
                        help="N,P,R triples; the last one is the headline shape")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise ValueError(f"--shapes must be positive N,P,R triples, got {args.shapes}")

    load_before = os.getloadavg()[0]  # the CPU may be shared: record how busy it was
    rows = []
    print(f"{'N':>4} {'P':>6} {'R':>5} {'rho':>6} {'reference ms':>13} {'naive_dense ms':>15} "
          f"{'xla ms':>9} {'ref/xla':>8} {'dense/xla':>10}")
    for n, p, r in shapes:
        row = bench_shape(n, p, r, args.min_seconds)
        rows.append(row)
        ms = row["ms"]
        print(f"{n:>4} {p:>6} {r:>5} {row['rho']:>6.2f} {ms['reference']:>13.1f} "
              f"{ms['naive_dense']:>15.1f} {ms['xla']:>9.1f} {row['reference_over_xla']:>8.2f} "
              f"{row['naive_dense_over_xla']:>10.2f}", flush=True)

    last = rows[-1]
    result = {
        "headline": {
            "metric": (f"fwd+bwd time ratio naive reference / xla at N={last['N']}, "
                       f"P={last['P']}, R={last['R']} (target 0.7*rho)"),
            "value": round(last["reference_over_xla"], 3),
            "target": round(0.7 * last["rho"], 3),
            "machine": machine(),
        },
        "config": {"groups": 1, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                   "dtype": "float32", "min_seconds": args.min_seconds,
                   "load_average_1m": {"before": round(load_before, 2),
                                       "after": round(os.getloadavg()[0], 2)}},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"headline: {result['headline']['value']:.2f}x (target "
          f"{result['headline']['target']:.2f}x) -> {args.out}")
    return result


if __name__ == "__main__":
    main()
