"""Learner throughput: one full training step of SmolLM2-135M-Instruct, Tandem vs its
plain-JAX floor vs transformers + torch, on CPU.

    python -m experiments.bench.learner [--shapes 16x128,32x256] [--repeats 3]
        [--sides tandem,jax,torch,preset] [--preset smollm2-rg]
        [--breakdown 16x128] [--variants eigen] [--merge] [--out PATH]

One step = forward, backward and one AdamW update (with global-norm clipping at 1.0,
weight decay 0, lr 1e-6) on the same batch of B rows x T tokens (float32 everywhere):

  tandem  the library's jitted step (rl.learner.make_train_step): GRPO advantages from
          per-row rewards (groups of 8), PPO-clip token-mean loss, old_logp="current"
          (ratio 1), no KL, unpacked rows;
  jax     the floor the library should approach: jax.jit of jax.value_and_grad of
          -mean(A * logp) over the masked tokens through models.decoder.forward, then an
          optax clip + adamw update (same FLOPs: PPO-clip at ratio 1 has this gradient),
          compiled with the library's own CPU compiler defaults so that the two differ
          only in what they compute;
  tandem[preset]  the --preset's TrainConfig (smollm2-rg: packed groups, its clip range,
          temperature and reward weights) on the same samples, built into a batch by
          batch_from_trajectory as a run builds it (packing computes less than the floor);
  torch   transformers' LlamaForCausalLM loaded from the same GGUF file, the same loss,
          torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW (foreach), 2 threads
          (torch.set_num_threads(cores)); OMP_WAIT_POLICY is left to libgomp's default
          unless --omp-wait-policy is given (it must be set before torch starts: the
          script sets it in os.environ before importing torch).

Each row also holds every JAX side's matmul GFLOP per step counted from its jaxpr
(experiments.common.jaxpr_flops: equal counts = no extra forward or recomputed head) and
each side's time over the floor's and over torch's round by round (the calls alternate:
median, min, max of the paired ratios). The headline is the library's paired time over
the floor's at the largest shape (target <= 1.1, issue 56); the machine names its CPU
family.

Rows: a prompt of T/4 tokens shared by each group of 8 rows, then a response of random
length in [T/2, 3T/4], right padding; random token ids (seeded). Every side computes
full-vocabulary logits for all B x T positions (no packing), so the FLOPs are the same.

The sides are timed round-robin (each gets a warm-up call first: XLA compiles there) and
the median of the repeats is reported (all kept in the JSON). FLOPs per step:
6 x (matmul params) x B x T + 12 x B x T^2 x (heads x head_dim) x layers, i.e. forward +
backward (x3) of every projection and of the vocabulary head (tied: 576 x 49152), plus
QK^T and PV over the full T x T square (what the masked XLA attention computes). The
matmul peak is measured in the same run: the best median rate of float32 matmuls in JAX
(XLA's default dot library and Eigen, `xla_cpu_experimental_ynn_fusion_type=""`) and in
torch, on a 2048^3 square and the model's own shapes ([B*T, 576] x [576, 1536] and the
head [B*T, 576] x [576, 49152]).

--breakdown SHAPE also times, for that shape, each side's forward only (jax / torch:
loss without gradient), forward + backward (no update), the optimizer update alone, the
vocabulary head's forward + backward alone (from a fixed final hidden state, incl. the
log-softmax-gather loss), and the library's log-prob forward (models.logprobs) — so that
the gap is located (layers vs head vs optimizer vs library overhead).
--variants eigen adds sides "tandem[eigen]" and "jax[eigen]" compiled with
compiler_options {"xla_cpu_experimental_ynn_fusion_type": ""} (dots by Eigen instead of
YNNPACK: see the README/JSON for why). Writes experiments/results/bench_learner.json
and, from it, docs/results/learner-floor.md (--docs-only: the page from the committed JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.common.benchmarking import (  # imports no jax: torch's env first
    paired_ratios,
    results_path,
    round_robin,
)
from experiments.common.docs_rows import add_docs_only_flag, docs_from_json
from experiments.common.learner_floor_page import write_docs
from experiments.common.learner_sides import GROUP, JaxSides, TorchSide, make_batch

RESULT = results_path(__file__)
EIGEN = {"xla_cpu_experimental_ynn_fusion_type": ""}
FLOOR_TARGET = 1.1  # issue 56: the library's step within 1.1x of its plain-JAX floor


def micro_batches(b: int, t: int, micro_tokens: int) -> int:
    """Number of micro-batches: whole groups of GROUP rows, about micro_tokens tokens each."""
    if micro_tokens <= 0:
        return 1
    m = max(1, min(b // GROUP, (b * t) // micro_tokens))
    while (b // GROUP) % m:
        m -= 1
    return m


def parse_shape(s: str) -> tuple[int, int]:
    b, t = s.lower().split("x")
    return int(b), int(t)


# ----------------------------------------------------------------------------- batch
def flop_count(cfg, b: int, t: int) -> dict[str, float]:
    """Training FLOPs of one step (see the module docstring)."""
    e, h, k, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f
    matmul_params = cfg.num_layers * layer + e * cfg.vocab_size
    tokens = b * t
    dense = 6 * matmul_params * tokens
    attn = 12 * b * t * t * h * d * cfg.num_layers
    head = 6 * e * cfg.vocab_size * tokens
    return {"matmul_params": matmul_params, "dense": dense, "attention": attn, "head": head,
            "total": dense + attn}


# ----------------------------------------------------------------------------- timing
def matmul_rates(tokens_list: list[int], seconds: float = 1.0) -> dict[str, dict[str, float]]:
    """GFLOP/s (median) of float32 matmuls in JAX (default dot library and Eigen) and torch."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    shapes = {"square 2048^3": ((2048, 2048), (2048, 2048))}
    for n in tokens_list:
        shapes[f"mlp [{n},576]x[576,1536]"] = ((n, 576), (576, 1536))
        shapes[f"head [{n},576]x[576,49152]"] = ((n, 576), (576, 49152))
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for name, (sa, sb) in shapes.items():
        a = rng.standard_normal(sa, dtype=np.float32)
        w = rng.standard_normal(sb, dtype=np.float32) / 24.0
        flops = 2 * sa[0] * sa[1] * sb[1]
        ja, jw = jnp.asarray(a), jnp.asarray(w)
        ta, tw = torch.from_numpy(a), torch.from_numpy(w)
        calls = {}
        for label, opts in (("jax", None), ("jax[eigen]", EIGEN)):
            c = jax.jit(jnp.dot, compiler_options=opts).lower(ja, jw).compile()
            calls[label] = (lambda c=c, ja=ja, jw=jw: c(ja, jw).block_until_ready())
        calls["torch"] = lambda ta=ta, tw=tw: torch.matmul(ta, tw)
        for fn in calls.values():
            fn()
        times = {k: [] for k in calls}
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds * len(calls) or len(times["torch"]) < 3:
            for k, fn in calls.items():
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
        out[name] = {k: round(flops / statistics.median(v) / 1e9, 1) for k, v in times.items()}
        print(f"  matmul {name:32s} " + "  ".join(f"{k} {v:6.1f}" for k, v in out[name].items()),
              flush=True)
    return out


# ----------------------------------------------------------------------------- sides
def side_calls(args, js: JaxSides, ts: TorchSide, jvar: dict) -> dict[str, Callable[[], Any]]:
    """The timed calls of the sides --sides names (and the --variants' JAX sides)."""
    sides = args.sides.split(",")
    calls: dict[str, Callable[[], Any]] = {}
    for name, side, fn in (("tandem", "tandem", js.run_tandem), ("jax", "jax", js.run_plain),
                           ("torch", "torch", ts.run_step),
                           ("tandem[preset]", "preset", js.run_preset)):
        if side in sides:
            calls[name] = fn
    for v, s in jvar.items():
        if "tandem" in sides:
            calls[f"tandem[{v}]"] = s.run_tandem
        if "jax" in sides:
            calls[f"jax[{v}]"] = s.run_plain
    return calls


def timing_row(b: int, t: int, batch: dict, m: int, fl: dict, first: dict,
               times: dict[str, list[float]]) -> dict:
    """One shape's row: medians, every time, rates and the ratios paired by round."""
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"shape": f"{b}x{t}", "batch": b, "seq": t, "tokens": b * t, "micro_batches": m,
           "loss_tokens": int(batch["mask"][:, 1:].sum()), "flops": fl,
           "step_s": {k: round(v, 3) for k, v in med.items()},
           "times_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
           "first_call_s": first,
           "tokens_per_s": {k: round(b * t / v, 1) for k, v in med.items()},
           "gflops": {k: round(fl["total"] / v / 1e9, 1) for k, v in med.items()}}
    if "torch" in med:
        row["ratio_vs_torch"] = {k: round(med["torch"] / v, 3) for k, v in med.items()
                                 if k != "torch"}
        row["paired_time_vs_torch"] = paired_ratios(times, "torch")
    if "jax" in med:  # time / the floor's, round by round: <= 1.1 is the target
        row["paired_time_vs_floor"] = paired_ratios(times, "jax")
    return row


def measure_shape(args, config, params, hf, shape: tuple[int, int], breakdown: set) -> dict:
    """Build every side for one B x T batch, warm each up, time them round-robin."""
    from experiments.common.benchmarking import load_average

    b, t = shape
    batch = make_batch(b, t, config.vocab_size)
    fl = flop_count(config, b, t)
    m = micro_batches(b, t, args.micro_tokens)
    js = JaxSides(config, params, batch, None, m,
                  preset=args.preset if "preset" in args.sides.split(",") else None)
    jvar = {v: JaxSides(config, params, batch, EIGEN, m)
            for v in args.variants.split(",") if v == "eigen"}
    ts = TorchSide(hf, batch, m)
    calls = side_calls(args, js, ts, jvar)
    first = {}
    for name, fn in calls.items():  # warm-up: compiles the JAX sides
        t0 = time.perf_counter()
        fn()
        first[name] = round(time.perf_counter() - t0, 2)
        print(f"  {b}x{t} warm-up {name}: {first[name]:.1f} s", flush=True)
    row = timing_row(b, t, batch, m, fl, first, round_robin(calls, args.repeats))
    row["matmul_gflop"] = js.matmul_gflop()
    print(f"  {b}x{t} matmul GFLOP per step (jaxpr): {row['matmul_gflop']}; formula "
          f"{fl['total'] / 1e9:.1f}", flush=True)
    for k, v in row.get("paired_time_vs_floor", {}).items():
        print(f"  {b}x{t} {k} / floor: median {v['median']:.3f} "
              f"[{v['min']:.3f}, {v['max']:.3f}]", flush=True)
    print(f"  {b}x{t}: " + "  ".join(f"{k} {v:.2f}s ({row['tokens_per_s'][k]:.0f} tok/s, "
                                     f"{row['gflops'][k]:.0f} GF/s)"
                                     for k, v in row["step_s"].items()), flush=True)
    if (b, t) in breakdown and m == 1:  # the pieces run on the whole batch at once
        row["breakdown_s"] = run_breakdown(js, ts, jvar, args.repeats)
    row["load_average"] = load_average()
    row["max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.learner",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16x128,32x256", help="comma list of BxT")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--breakdown", default="16x128", help="shape(s) to break down ('' = none)")
    ap.add_argument("--variants", default="", help="'eigen': also time the JAX sides with "
                    "compiler_options xla_cpu_experimental_ynn_fusion_type=''")
    ap.add_argument("--sides", default="tandem,jax,torch,preset",
                    help="tandem (default TrainConfig), jax (the plain-JAX floor), torch, "
                         "preset (the --preset's learner options on the same samples)")
    ap.add_argument("--preset", default="smollm2-rg",
                    help="the run preset whose TrainConfig the 'preset' side uses")
    ap.add_argument("--micro-tokens", type=int, default=2048,
                    help="gradient accumulation: micro-batches of about this many tokens (whole "
                         "groups of 8 rows) on every side, so 32x256 fits in memory; 0 = none")
    ap.add_argument("--omp-wait-policy", default=None, help="PASSIVE | ACTIVE (torch's OpenMP)")
    ap.add_argument("--model", default="smollm2-135m", help="a registered GGUF model name")
    ap.add_argument("--matmul-seconds", type=float, default=1.0)
    ap.add_argument("--merge", action="store_true",
                    help="keep rows of other shapes already in the results file")
    ap.add_argument("--out", default=str(RESULT))
    add_docs_only_flag(ap)
    args = ap.parse_args(argv)
    if args.docs_only:
        return docs_from_json(RESULT, write_docs)
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy

    import jax
    import torch

    from experiments.common.benchmarking import load_average, machine

    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    load_before = load_average()
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    breakdown = {parse_shape(s) for s in args.breakdown.split(",") if s}

    config, params, hf = load_models(args.model)
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    print(f"model {args.model}: {n_params / 1e6:.1f}M params; load {load_before}", flush=True)

    rows = [measure_shape(args, config, params, hf, shape, breakdown) for shape in shapes]

    print("measuring the matmul peak ...", flush=True)
    mm = matmul_rates(sorted({b * t for b, t in shapes}), args.matmul_seconds)
    peak = max(v for r in mm.values() for v in r.values())
    for row in rows:
        row["fraction_of_peak"] = {k: round(v / peak, 3) for k, v in row["gflops"].items()}

    print_table(rows, peak)
    result = run_record(args, rows, mm, peak, load_before, n_params)
    out = Path(args.out)
    if args.merge and out.exists():
        old = json.loads(out.read_text())
        mine = {r["shape"] for r in rows}
        result["rows"] = [r for r in old.get("rows", []) if r["shape"] not in mine] + rows
        result["rows"].sort(key=lambda r: r["tokens"])
        result["headline"] = floor_headline(result["rows"], machine(), result["headline"]["load"])
    from experiments.common.benchmarking import write_results
    write_results(out, result)
    print(f"wrote {out}")
    if out.resolve() == RESULT.resolve():  # the committed result: its page and rows too
        write_docs(result)
    return result


def run_record(args, rows: list[dict], mm: dict, peak: float, load_before, n_params: int
               ) -> dict[str, Any]:
    """The JSON record of a run: headline, rows, the matmul peak and how it all was measured."""
    import jax
    import torch

    from experiments.common.benchmarking import load_average, machine

    cores = os.cpu_count() or 1
    return {
        "headline": floor_headline(rows, machine(),
                                   {"before": load_before, "after": load_average()}),
        "targets": {"tandem_vs_floor_time": FLOOR_TARGET, "tandem_vs_torch": 1.0,
                    "fraction_of_peak": 0.6},
        "rows": rows,
        "matmul_gflops": mm, "peak_gflops": peak,
        "peak_definition": "best median GFLOP/s over the matmuls measured in this run "
                           "(JAX default / JAX Eigen / torch; square and model shapes)",
        "flop_formula": "6 x matmul_params x B x T + 12 x B x T^2 x heads x head_dim x layers "
                        "(matmul_params = layers x (E*H*D + 2*E*K*D + H*D*E + 3*E*F) + E*V, head "
                        "included; attention over the full T x T square)",
        "params": n_params, "model": args.model, "dtype": "float32",
        "threads": {"torch": torch.get_num_threads(),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "default (unset)"),
                    "xla": f"default CPU pool ({cores} cores)"},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "variants": {"eigen": EIGEN} if "eigen" in args.variants.split(",") else {},
        "timing": "median of --repeats calls per side, round-robin after one warm-up call each",
        "load_average_before": load_before, "load_average_after": load_average(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
    }


def floor_headline(rows: list[dict], machine_name: str, load: dict) -> dict:
    """The headline: the library step's time over the plain-JAX floor's on the same batch
    (median of the paired rounds) at the largest shape both ran; lower is better."""
    have = [r for r in rows if "tandem" in r.get("paired_time_vs_floor", {})]
    if not have:
        return {"metric": "library step time / plain-JAX floor (not measured: no jax side)",
                "value": float("nan"), "target": FLOOR_TARGET, "machine": machine_name,
                "load": load}
    last = max(have, key=lambda r: r["tokens"])
    pair = last["paired_time_vs_floor"]["tandem"]
    return {"metric": f"library train step time / the plain-JAX floor's on the same batch, "
                      f"{last['shape']} (median of {len(pair['all'])} paired rounds; lower "
                      "is better)",
            "value": pair["median"], "range": [pair["min"], pair["max"]],
            "target": FLOOR_TARGET, "machine": machine_name, "load": load}


def run_breakdown(js: JaxSides, ts: TorchSide, jvar: dict, repeats: int) -> dict:
    calls = {"jax fwd": js.run_fwd, "torch fwd": ts.run_fwd,
             "jax fwd+bwd": js.run_fwd_bwd, "torch fwd+bwd": ts.run_fwd_bwd,
             "jax opt": js.run_opt, "torch opt": ts.run_opt,
             "jax head fwd+bwd": js.run_head, "torch head fwd+bwd": ts.run_head,
             "tandem logprobs fwd": js.run_logprobs}
    for v, s in jvar.items():
        calls.update({f"jax[{v}] fwd": s.run_fwd, f"jax[{v}] fwd+bwd": s.run_fwd_bwd,
                      f"jax[{v}] head fwd+bwd": s.run_head})
    for fn in calls.values():
        fn()
    times = round_robin(calls, repeats)
    out = {k: round(statistics.median(v), 3) for k, v in times.items()}
    for side in ["jax", "torch"] + [f"jax[{v}]" for v in jvar]:
        if f"{side} fwd+bwd" in out and f"{side} head fwd+bwd" in out:
            out[f"{side} layers fwd+bwd (derived)"] = round(
                out[f"{side} fwd+bwd"] - out[f"{side} head fwd+bwd"], 3)
    for k, v in out.items():
        print(f"    breakdown {k:32s} {v:7.3f} s", flush=True)
    return out


def load_models(name: str):
    """(ModelConfig, JAX params, transformers model) with the same float32 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.assets import load_model, smollm2_gguf_path

    config, params, _ = load_model(name)
    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32)
    return config, params, hf


def print_table(rows: list[dict], peak: float) -> None:
    print(f"\nmeasured matmul peak {peak:.1f} GFLOP/s")
    print(f"{'shape':>7} | {'side':>14} | {'step s':>7} | {'tok/s':>7} | {'GFLOP/s':>7} | "
          f"{'of peak':>7} | {'vs torch':>8}")
    for r in rows:
        for k in r["step_s"]:
            ratio = r.get("ratio_vs_torch", {}).get(k, 1.0 if k == "torch" else float("nan"))
            print(f"{r['shape']:>7} | {k:>14} | {r['step_s'][k]:7.2f} | {r['tokens_per_s'][k]:7.0f} | "
                  f"{r['gflops'][k]:7.1f} | {100 * r['fraction_of_peak'][k]:6.1f}% | {ratio:8.2f}")


if __name__ == "__main__":
    main()
