"""Sampler benchmark: decode tokens/s and KV-cache bytes, segmented vs replicated cache.

    python -m experiments.bench_segment_decode [--groups 2] [--layers 4] [--steps 8]

For N in {8, 64} samples per prompt and P in {256, 1024} prompt tokens it builds one
sampler state per KV layout (rl.rollout.init_state(kv_layout=...), max_new_tokens =
R_MAX), prefills `groups` random prompts of exactly P tokens, and times the real
`rl.rollout.decode_segment` advancing every sample by `steps` tokens (median of
round-robin repeats from the same prefilled state, compile excluded):
  replicated  dense cache [layers, groups*N, P + R_MAX, kv_heads, d], the prompt KV copied
              into every sample's row (plain masked decode attention);
  segmented   prompt segment [layers, groups, P, ...] stored once per group + response
              segments [layers, groups, N, R_MAX, ...] (kernels.segment_decode, impl=None:
              XLA on CPU, Pallas on GPU).
Model: the SmolLM2-135M architecture (hidden 576, 9 heads / 3 kv heads, head_dim 64,
vocab 49152, fp32) cut to `layers` layers, random weights (speed does not depend on the
weights). The two layouts' tokens and log-probs are compared on every row. Writes
experiments/results/bench_segment_decode.json; headline = segmented / replicated decode
tokens/s at N=64, P=1024 (target 2.0).
"""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments.common.benchmarking import load_average, machine, time_calls, write_results
from models.config import get_config
from models.decoder import init_params
from models.kv_cache import cache_bytes
from rl.rollout import SamplingConfig, decode_segment, init_state, prefill, read_slots, sample_keys

NS, PS, R_MAX = (8, 64), (256, 1024), 64
RESULT = Path(__file__).parent / "results" / "bench_segment_decode.json"
LAYOUTS = ("replicated", "segmented")


def started_state(params, config, layout: str, groups: int, n: int, p: int, prompts):
    state = init_state(config, num_slots=groups * n, max_prompt_len=p, max_new_tokens=R_MAX,
                       sampling=SamplingConfig(temperature=1.0), group_size=n, kv_layout=layout)
    return prefill(params, state, prompts, np.arange(groups * n).reshape(groups, n),
                   sample_keys(0, range(groups), n))


def compare_samples(seg, rep) -> dict:
    """How far the two layouts agree: samples with identical tokens, and the largest
    log-prob difference over each sample's tokens before its first differing token. (With
    random weights the next-token distribution is nearly flat over 49152 tokens, so a
    rounding-level logit difference can move an inverse-CDF draw to a neighbour token.)"""
    same, worst = 0, 0.0
    for a, b in zip(seg, rep):
        diff = np.flatnonzero(a.response_ids != b.response_ids)
        upto = diff[0] if diff.size else a.response_ids.size
        if upto == 0:
            continue
        same += int(diff.size == 0)
        worst = max(worst, float(np.abs(a.logprobs[:upto] - b.logprobs[:upto]).max()))
    return {"identical_samples": f"{same}/{len(seg)}", "max_logprob_diff": worst}


def bench_one(params, config, groups: int, n: int, p: int, steps: int, reps_seconds: float,
              rng: np.random.Generator) -> dict:
    prompts = [rng.integers(3, config.vocab_size, p).tolist() for _ in range(groups)]
    states = {lay: started_state(params, config, lay, groups, n, p, prompts) for lay in LAYOUTS}
    calls = {lay: (lambda st=st: decode_segment(params, st, steps, 0).num_generated)
             for lay, st in states.items()}
    outs = {lay: decode_segment(params, st, steps, 0) for lay, st in states.items()}  # compile
    agree = compare_samples(read_slots(outs["segmented"], range(groups * n)),
                            read_slots(outs["replicated"], range(groups * n)))
    ms = time_calls(calls, reps_seconds, min_reps=3)
    tokens = groups * n * steps
    row = {"N": n, "P": p, "R_max": R_MAX, "groups": groups, "steps": steps, **agree}
    for lay in LAYOUTS:
        row[f"{lay}_ms"] = round(ms[lay], 2)
        row[f"{lay}_tok_s"] = round(tokens / ms[lay] * 1e3, 1)
        row[f"{lay}_kv_bytes"] = int(cache_bytes(states[lay].cache)["total"])
    seg_bytes = cache_bytes(states["segmented"].cache)
    # The replicated rows hold P prompt positions of P + R_MAX per sample.
    rep_prompt = row["replicated_kv_bytes"] * p // (p + R_MAX)
    row["segmented_prompt_kv_bytes"] = int(seg_bytes["prompt"])
    row["replicated_prompt_kv_bytes"] = int(rep_prompt)
    row["prompt_kv_ratio"] = round(rep_prompt / seg_bytes["prompt"], 3)
    row["speedup"] = round(ms["replicated"] / ms["segmented"], 3)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    ap.add_argument("--reps-seconds", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args(argv)
    config = get_config("smollm2-135m").replace(num_layers=args.layers)
    params = init_params(config, 0)
    rng = np.random.default_rng(0)
    rows = []
    grid = [(n, p) for n in NS for p in PS]
    for n, p in tqdm(grid, desc="N x P"):
        rows.append(bench_one(params, config, args.groups, n, p, args.steps, args.reps_seconds, rng))
    mib = 1 / 2 ** 20
    print(f"\n{'N':>3} {'P':>5} | {'replicated tok/s':>16} {'segmented tok/s':>15} {'speed-up':>8} | "
          f"{'KV MiB rep':>10} {'KV MiB seg':>10} {'prompt-KV ratio':>15} | identical samples, max |dlogp|")
    for r in rows:
        print(f"{r['N']:>3} {r['P']:>5} | {r['replicated_tok_s']:>16.1f} {r['segmented_tok_s']:>15.1f} "
              f"{r['speedup']:>7.2f}x | {r['replicated_kv_bytes'] * mib:>10.1f} "
              f"{r['segmented_kv_bytes'] * mib:>10.1f} {r['prompt_kv_ratio']:>15.1f} | {r['identical_samples']}, {r['max_logprob_diff']:.1e}")
    head = next(r for r in rows if r["N"] == 64 and r["P"] == 1024)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    result = {
        "headline": {"metric": "decode tokens/s segmented/replicated at N=64,P=1024",
                     "value": head["speedup"], "target": 2.0, "machine": machine()},
        "config": {"model": f"smollm2-135m architecture, {args.layers} layers, random fp32 "
                            "weights", "groups": args.groups, "R_max": R_MAX,
                   "steps_per_call": args.steps, "sampling": "temperature 1.0",
                   "attn_impl": "None (segment decode: XLA on CPU, Pallas on GPU)",
                   "timing": "median ms of round-robin decode_segment calls, compile excluded",
                   "command": "python -m experiments.bench_segment_decode "
                              f"--groups {args.groups} --layers {args.layers} --steps {args.steps}"},
        "load_average": load_average(),
        "uptime": uptime,
        "rows": rows,
    }
    write_results(args.out, result)
    print(f"\nheadline: {head['speedup']:.2f}x (target 2.0); {uptime}; wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
