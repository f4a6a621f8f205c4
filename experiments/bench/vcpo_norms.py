"""VCPO's exact per-trajectory gradient norms: the ghost norms (one batched pass,
models.ghost_norms) against their vmap(grad) twin (rl.learner.vcpo), side by side.

    python -m experiments.bench.vcpo_norms                       # smollm2-135m, 64 rows
    python -m experiments.bench.vcpo_norms --model tiny --rows 8 --repeats 1 --out /tmp/x.json

Three sides compute (log-probs [B, T-1], ‖∇_θ Σ_t log π(y_t)‖² [B]) of the same rows: the
ghost pass as the VCPO step runs it on a packed batch (the vocabulary head only on the
response width from each row's first loss token), the ghost pass with the head on every
position, and the vmap(grad) twin. The rows: the
staleness sweep's VCPO batch geometry by default (64 rows = 8 prompts x 8 samples, a
100-token prompt and 48 response tokens, the loss on the response), random weights with
the model's real config, fp32. Each side is compiled first (its XLA scratch size read from
memory_analysis()), then they are timed alternating (--repeats rounds), so that load
from other jobs hits both alike. Reported: median seconds per call, the time ratio, the
largest relative difference of the (windowed) ghost norms from the twin's, and the XLA
scratch bytes of each program.

Writes experiments/results/bench_vcpo_norms.json (headline: twin time / ghost time; target
1.5, the share of work the ghost pass leaves out: no weight gradient is formed).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

from experiments.common.benchmarking import load_average, machine, results_path, write_results

RESULT = results_path(__file__)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a models.config preset")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--ghost-chunk", type=int, default=8, help="rows per ghost pass")
    ap.add_argument("--vmap-chunk", type=int, default=2,
                    help="rows per vmap(grad) chunk (2: what fits beside a SmolLM2 step)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.config import get_config
    from models.decoder import init_params
    from models.ghost_norms import ghost_logprob_grads
    from rl.learner.vcpo import per_trajectory_logprob_grads

    cfg = get_config(args.model)
    params = init_params(cfg, 0)
    t = args.prompt + args.response
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (args.rows, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (args.rows, t))
    mask = jnp.asarray(np.arange(t)[None] >= args.prompt).repeat(args.rows, 0)
    windowed = partial(ghost_logprob_grads, window=args.response)
    sides = {  # what the step runs on a packed batch (the head on R positions), the full
        "ghost": (windowed, args.ghost_chunk),  # ghost pass, the twin
        "ghost_full_head": (ghost_logprob_grads, args.ghost_chunk),
        "vmap": (per_trajectory_logprob_grads, args.vmap_chunk),
    }
    compiled, scratch, compile_s, outs = {}, {}, {}, {}
    for name, (fn, chunk) in sides.items():
        start = time.perf_counter()
        lowered = jax.jit(lambda p, fn=fn, chunk=chunk: fn(p, cfg, tokens, positions, mask, 0.8,
                                                             chunk)).lower(params)
        compiled[name] = lowered.compile()
        compile_s[name] = time.perf_counter() - start
        mem = compiled[name].memory_analysis()
        scratch[name] = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
        outs[name] = jax.block_until_ready(compiled[name](params))  # first run, untimed
    times: dict[str, list[float]] = {name: [] for name in sides}
    load_before = load_average()
    for _ in range(args.repeats):
        for name in sides:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](params))
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    ghost_n, vmap_n = (np.asarray(outs[k][1], np.float64) for k in ("ghost", "vmap"))
    rel = float(np.max(np.abs(ghost_n - vmap_n) / np.maximum(np.abs(vmap_n), 1e-30)))
    on_loss = np.asarray(mask)[:, 1:]  # the windowed pass's log-probs are 0 off the window
    logp_diff = float(np.max(np.abs(np.where(on_loss, np.asarray(outs["ghost"][0]), 0.0)
                                    - np.where(on_loss, np.asarray(outs["vmap"][0]), 0.0))))
    speedup = median["vmap"] / median["ghost"]
    shape = f"{args.rows}x{t}"
    result = {
        "headline": {"metric": f"VCPO exact gradient norms, {args.model} {shape}: "
                               f"vmap(grad) twin time / ghost time",
                     "value": round(speedup, 3), "target": 1.5, "machine": machine()},
        "table": [{"side": name, "chunk": sides[name][1], "median_s": round(median[name], 3),
                   "times_s": [round(x, 3) for x in times[name]],
                   "compile_s": round(compile_s[name], 1),
                   "xla_scratch_gb": None if scratch[name] is None else round(scratch[name] / 1e9, 3)}
                  for name in sides],
        "max_relative_norm_difference": rel, "max_logp_difference": logp_diff,
        "model": args.model, "rows": args.rows, "prompt": args.prompt,
        "response": args.response, "repeats": args.repeats,
        "load_average": {"before": load_before, "after": load_average()},
        "command": "python -m experiments.bench.vcpo_norms " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(f"{'side':<16} {'chunk':>5} {'median s':>9} {'compile s':>9} {'XLA scratch GB':>15}")
    for row in result["table"]:
        print(f"{row['side']:<16} {row['chunk']:>5} {row['median_s']:>9.2f} {row['compile_s']:>9.1f} "
              f"{row['xla_scratch_gb'] if row['xla_scratch_gb'] is not None else 'n/a':>15}")
    print(f"twin / ghost: {speedup:.2f}x; norms agree to {rel:.1e} (relative), log-probs to {logp_diff:.1e}")
    write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
