"""Sampler benchmarks, in parts (`--parts`, comma-separated; default all three):

    python -m experiments.bench.sampler --parts throughput [--batches 16,64] [--new-tokens 64]
        [--repeats 3] [--chat] [--omp-wait-policy PASSIVE|ACTIVE|default]
    python -m experiments.bench.sampler --parts segment-decode [--groups 2] [--layers 4] [--steps 8]
    python -m experiments.bench.sampler --parts long-prefill [--lengths 1024 4096 8000]
        [--chunk 512] [--time-cap 420] [--mem-cap 12]

Each part writes its own results file (`--out PATH` instead, with one part):

throughput -> experiments/results/bench_sampler.json: Tandem's rollout sampler vs
transformers `generate`, SmolLM2-135M (the same GGUF file, float32) on CPU, batch B = B
distinct prompts (short questions, or chat-formatted with --chat), temperature 1, no
top-k/top-p, no early stop: every row makes exactly --new-tokens tokens, timed end to end
(prefill + decode). transformers: torch.inference_mode(), left padding with an attention
mask, min_new_tokens = max_new_tokens, torch.set_num_threads(cores), in its own process
with OMP_WAIT_POLICY=ACTIVE by default (faster for torch here: 226 vs 192 tok/s at batch
64), SIGSTOPped while Tandem runs so its spinning threads leave the cores to XLA (default
CPU pool, one thread per core). Only meaningful at low load (other jobs collapse torch's
threads far more than XLA's): the load average is recorded before, during and after. Each
side gets a warm-up call (Tandem compiles); timed repeats alternate; the best repeat of
each side is reported (all kept). FLOP floor: 2 x params FLOPs per generated token over
the float32 matmul rate of a jitted [64, 576] x [576, 1536] jnp.dot measured in the same
run (also given counting prompt tokens). Headline: tokens/s ratio tandem / transformers at
batch 64, target 1.5 (also at batch 16, and the FLOP-floor fraction at 64, target 0.6).

segment-decode -> experiments/results/bench_segment_decode.json: decode tokens/s and KV
bytes, segmented vs replicated cache, for N in {8, 64} samples per prompt and P in {256,
1024} prompt tokens: one sampler state per KV layout (rl.rollout.init_state(kv_layout=...),
max_new_tokens = R_MAX) prefills `groups` random P-token prompts; `decode_segment`
advancing every sample by `steps` tokens is timed (median of round-robin repeats from the
same prefilled state, compile excluded):
  replicated  dense cache [layers, groups*N, P + R_MAX, kv_heads, d], the prompt KV copied
              into every sample's row (plain masked decode attention);
  segmented   prompt segment [layers, groups, P, ...] once per group + response segments
              [layers, groups, N, R_MAX, ...] (kernels.segment_decode, impl=None).
Model: SmolLM2-135M's architecture (fp32) cut to `layers` layers, random weights; the two
layouts' tokens and log-probs are compared on every row. Headline: segmented / replicated
decode tokens/s at N=64, P=1024 (target 2.0).

long-prefill -> experiments/results/bench_long_prefill.json: one-shot vs chunked prefill of
long prompts on SmolLM2-135M. Each case (length T, side) runs in its own subprocess
(`--case T --side S`): it loads the model, resets its resident high-water mark (VmHWM,
/proc/self/clear_refs), then runs what experiments.generate runs for the first token
(rl.rollout.prefill of a T-token prompt, batch 1, and one decode step), "one-shot" with
prefill_chunk=None and "chunked" with prefill_chunk=C (models/chunked_prefill.py). It
reports the time to first token from a cold start, the seconds jax spent compiling in it
(benchmarking.compile_seconds) and the rest, the peak resident memory above the loaded
model, the first token and its log-prob (both sides must agree). Sides alternate and run
one at a time; a case past --time-cap seconds or --mem-cap GB resident is killed and
reported as not finished. Headline: peak memory one-shot / chunked at the longest T (a
case that did not finish counts with the cap: a lower bound), target 4.0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments.common.benchmarking import (
    RESULTS_DIR,
    compile_seconds,
    load_average,
    machine,
    results_path,
    time_calls,
    write_results,
)
from models.assets import load_model, smollm2_gguf_path
from models.config import get_config
from models.decoder import init_params
from models.kv_cache import cache_bytes
from rl.rollout import (
    SamplingConfig,
    decode_segment,
    generate,
    init_state,
    prefill,
    read_slots,
    sample_keys,
)
from experiments.common.flags import add_distributed_flags, distributed_from_args
from rl.runtime.distributed import initialize_distributed, is_main_process
from rl.runtime.logging import peak_rss_mb, reset_peak_rss

ROOT = Path(__file__).resolve().parents[2]  # the repository
RESULTS = {"throughput": results_path(__file__),  # bench_sampler.json
           "segment-decode": RESULTS_DIR / "bench_segment_decode.json",
           "long-prefill": RESULTS_DIR / "bench_long_prefill.json"}
NS, PS, R_MAX = (8, 64), (256, 1024), 64  # segment-decode
LAYOUTS = ("replicated", "segmented")
LENGTHS = (1024, 4096, 8000)  # long-prefill; 8000 + the first token fits 8192 positions
TARGET = 4.0  # peak memory one-shot / chunked at the longest prompt
TEXT = ("The committee met on a grey morning to discuss the budget for the coming year, "
        "the repairs to the old bridge, and the schedule of the spring festival. ")


# ----------------------------------------------------------------------------- throughput
QUESTIONS = [  # one sentence each: ~5-10 tokens
    "What is 7 times 6?", "Name three prime numbers.", "Write a haiku about rain.",
    "Why is the sky blue?", "Explain gravity to a child.", "What is the capital of France?",
    "Give me a word that rhymes with cat.", "How many legs does a spider have?",
]


def matmul_gflops(seconds: float = 2.0) -> float:
    """float32 matmul rate of a jitted jnp.dot of shape [64, 576] x [576, 1536] (the MLP
    up-projection at batch 64), chained 32 times per call to hide dispatch."""
    a = jax.random.normal(jax.random.PRNGKey(0), (64, 576), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (576, 1536), jnp.float32) / 24.0
    w2 = jax.random.normal(jax.random.PRNGKey(2), (1536, 576), jnp.float32) / 40.0

    @jax.jit
    def chain(x):
        for _ in range(16):
            x = jnp.dot(jnp.dot(x, w), w2)
        return x

    jax.block_until_ready(chain(a))
    times = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        jax.block_until_ready(chain(a))
        times.append(time.perf_counter() - t)
    flops = 32 * 2 * 64 * 576 * 1536
    return flops / min(times) / 1e9


def make_prompts(tokenizer, batch: int, chat: bool) -> list[list[int]]:
    texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]
    if chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
                 for t in texts]
    return [tokenizer.encode(t) for t in texts]


def tandem_runner(params, config, prompts, new_tokens):
    def run(seed):
        res = generate(params, config, prompts, max_new_tokens=new_tokens,
                       sampling=SamplingConfig(temperature=1.0), stop_ids=(), rng=seed,
                       segment_len=new_tokens)
        assert res.num_tokens == len(prompts) * new_tokens
        return res.num_tokens
    return run


def transformers_runner(model, prompts, new_tokens, pad_id):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generate expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def run(seed):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad_id)
        made = out.shape[1] - width
        assert made == new_tokens, made
        return len(prompts) * made
    return run


def torch_worker(threads: int) -> None:
    """transformers side in its own process (--torch-worker): reads one JSON request per
    line {"prompts", "new_tokens", "seed"} and answers {"seconds", "tokens"}. Its OpenMP
    threads must not share a process with XLA's: with OMP_WAIT_POLICY=ACTIVE they spin
    between calls, so the parent stops this process (SIGSTOP) while Tandem runs."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    print(json.dumps({"ready": True, "threads": torch.get_num_threads(),
                      "torch": torch.__version__,
                      "transformers": __import__("transformers").__version__}), flush=True)
    runners = {}
    for line in sys.stdin:
        req = json.loads(line)
        key = (json.dumps(req["prompts"]), req["new_tokens"])
        if key not in runners:
            runners[key] = transformers_runner(hf, req["prompts"], req["new_tokens"], req["pad_id"])
        t = time.perf_counter()
        made = runners[key](req["seed"])
        print(json.dumps({"seconds": time.perf_counter() - t, "tokens": made}), flush=True)


class _TorchProcess:
    """The transformers side as a child process (see torch_worker), stopped between calls."""

    def __init__(self, threads: int, wait_policy: str):
        env = dict(os.environ)
        if wait_policy != "default":
            env["OMP_WAIT_POLICY"] = wait_policy
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.bench.sampler", "--torch-worker",
             "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=str(ROOT))
        self.info = self._read()
        self.pause()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the transformers worker exited")
            if line.startswith("{"):
                return json.loads(line)

    def pause(self):
        os.kill(self.proc.pid, signal.SIGSTOP)

    def run(self, prompts, new_tokens, seed, pad_id) -> tuple[float, int]:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens,
                                          "seed": seed, "pad_id": pad_id}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        self.pause()
        return out["seconds"], out["tokens"]

    def close(self):
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_throughput(args: argparse.Namespace, out: Path) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    cores = os.cpu_count() or 1
    load_before = load_average()
    config, params, tokenizer = load_model("smollm2-135m")
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    hf = _TorchProcess(cores, args.omp_wait_policy)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0

    gflops = matmul_gflops()
    floor_tok_s = gflops * 1e9 / (2 * n_params)
    rows = []
    for b in batches:
        prompts = make_prompts(tokenizer, b, args.chat)
        tandem = tandem_runner(params, config, prompts, args.new_tokens)
        t0 = time.perf_counter()
        tandem(0)  # warm-up: compiles prefill and the decode loop
        warm_tandem = time.perf_counter() - t0
        hf.run(prompts, args.new_tokens, 0, pad_id)
        times = {"tandem": [], "transformers": []}
        for r in range(args.repeats):
            t = time.perf_counter()
            tandem(r + 1)
            times["tandem"].append(time.perf_counter() - t)
            times["transformers"].append(hf.run(prompts, args.new_tokens, r + 1, pad_id)[0])
        tok = b * args.new_tokens
        prompt_tok = sum(len(p) for p in prompts)
        best = {k: min(v) for k, v in times.items()}
        row = {"batch": b, "new_tokens": args.new_tokens,
               "prompt_tokens": [min(len(p) for p in prompts), max(len(p) for p in prompts)],
               "tandem_tok_s": tok / best["tandem"],
               "transformers_tok_s": tok / best["transformers"],
               "tandem_tok_s_median": tok / statistics.median(times["tandem"]),
               "transformers_tok_s_median": tok / statistics.median(times["transformers"]),
               "tandem_first_call_s": warm_tandem,
               "times_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
               "load_average": load_average()}
        row["ratio"] = row["tandem_tok_s"] / row["transformers_tok_s"]
        row["tandem_fraction_of_flop_floor"] = row["tandem_tok_s"] / floor_tok_s
        row["tandem_fraction_of_flop_floor_incl_prompt"] = (tok + prompt_tok) / best["tandem"] / floor_tok_s
        rows.append(row)
        print(f"batch {b:3d}: tandem {row['tandem_tok_s']:8.1f} tok/s  transformers "
              f"{row['transformers_tok_s']:8.1f} tok/s  ratio {row['ratio']:.2f}  "
              f"floor fraction {row['tandem_fraction_of_flop_floor']:.2f}", flush=True)

    print(f"\nmatmul rate {gflops:.1f} GFLOP/s -> FLOP floor {floor_tok_s:.1f} tok/s "
          f"(2 x {n_params / 1e6:.1f}M params per token)")
    print(f"{'batch':>5} | {'tandem tok/s':>12} | {'transformers tok/s':>18} | {'ratio':>5} | {'of floor':>8}")
    for r in rows:
        print(f"{r['batch']:5d} | {r['tandem_tok_s']:12.1f} | {r['transformers_tok_s']:18.1f} | "
              f"{r['ratio']:5.2f} | {100 * r['tandem_fraction_of_flop_floor']:7.1f}%")
    last = next((r for r in rows if r["batch"] == 64), rows[-1])
    b16 = next((r for r in rows if r["batch"] == 16), None)
    result = {
        "headline": {"metric": f"tokens/s ratio tandem/transformers at batch {last['batch']}",
                     "value": round(last["ratio"], 3), "target": 1.5, "machine": machine()},
        "ratio_batch16": None if b16 is None else round(b16["ratio"], 3),
        "ratio_batch16_target": 1.5,
        "flop_floor_fraction_at_64": round(last["tandem_fraction_of_flop_floor"], 3),
        "flop_floor_fraction_target": 0.6,
        "omp_wait_policy": args.omp_wait_policy,
        "rows": rows,
        "matmul_gflops": gflops, "flop_floor_tok_s": floor_tok_s, "params": n_params,
        "threads": {"torch": hf.info["threads"], "xla": f"default CPU pool ({cores} cores)",
                    "torch_process": "separate, SIGSTOPped while Tandem runs"},
        "dtype": "float32", "sampling": "temperature 1.0, no top-k/top-p, no early stop",
        "prompts": "chat template" if args.chat else "plain one-sentence questions",
        "timing": "best of repeats (alternating tandem / transformers); medians in rows",
        "load_average_before": load_before, "load_average_after": load_average(),
        "versions": {"jax": jax.__version__, "torch": hf.info["torch"],
                     "transformers": hf.info["transformers"]},
    }
    hf.close()
    if is_main_process():
        print(f"wrote {write_results(out, result)}")
    return result


# ----------------------------------------------------------------------------- segment-decode
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


def run_segment_decode(args: argparse.Namespace, out: Path) -> dict:
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
                   "command": "python -m experiments.bench.sampler --parts segment-decode "
                              f"--groups {args.groups} --layers {args.layers} --steps {args.steps}"},
        "load_average": load_average(),
        "uptime": uptime,
        "rows": rows,
    }
    write_results(out, result)
    print(f"\nheadline: {head['speedup']:.2f}x (target 2.0); {uptime}; wrote {out}")
    return result


# ----------------------------------------------------------------------------- long-prefill
def run_case(length: int, side: str, chunk: int) -> dict[str, Any]:
    """One case in this process: prefill + first token of a `length`-token prompt."""
    config, params, tok = load_model("smollm2-135m")
    ids = tok.encode(TEXT * (length // 20 + 1))[:length]
    if len(ids) != length:
        raise RuntimeError(f"the text gave {len(ids)} tokens, fewer than {length}")
    state = init_state(config, num_slots=1, max_prompt_len=length, max_new_tokens=1,
                       sampling=SamplingConfig(greedy=True),
                       prefill_chunk=None if side == "one-shot" else chunk)
    keys = sample_keys(0, [0], 1)
    jax.block_until_ready(params)
    base = rss_mb("self")
    reset = reset_peak_rss()
    with compile_seconds() as compiled:
        t0 = time.perf_counter()
        live = jax.block_until_ready(prefill(params, state, [ids], [[0]], keys))
        t_prefill, c_prefill = time.perf_counter() - t0, compiled[0]
        live = jax.block_until_ready(decode_segment(params, live, 1, 0))
        ttft = time.perf_counter() - t0
    sample = read_slots(live, [0])[0]
    return {"tokens": length, "side": side, "chunk": None if side == "one-shot" else chunk,
            "ttft_s": ttft, "compile_s": compiled[0], "ttft_minus_compile_s": ttft - compiled[0],
            "prefill_s": t_prefill, "prefill_compile_s": c_prefill,
            "peak_rss_mb": peak_rss_mb(), "base_rss_mb": base,
            "peak_above_model_mb": peak_rss_mb() - base if reset else None,
            "first_token": int(sample.response_ids[0]), "logprob": float(sample.logprobs[0])}


def rss_mb(pid: int | str) -> float:
    """Resident MB of process `pid` ("self": this one); 0.0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.readlines()
    except OSError:
        return 0.0
    rss = [int(line.split()[1]) for line in lines if line.startswith("VmRSS:")]
    return rss[0] * 1024 / 1e6 if rss else 0.0


def spawn_case(length: int, side: str, chunk: int, time_cap: float, mem_cap_gb: float
               ) -> dict[str, Any]:
    """Run one case in a subprocess, watching it: past time_cap seconds or mem_cap_gb GB
    resident it is killed and reported as not finished."""
    cmd = [sys.executable, "-m", "experiments.bench.sampler", "--case", str(length),
           "--side", side, "--chunk", str(chunk)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load_before = load_average()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed, max_rss = None, 0.0
    while proc.poll() is None:
        time.sleep(0.25)
        max_rss = max(max_rss, rss_mb(proc.pid))
        if time.perf_counter() - t0 > time_cap:
            killed = f"did not finish within {time_cap:.0f} s"
        elif max_rss > mem_cap_gb * 1e3:
            killed = f"killed above {mem_cap_gb:.0f} GB resident"
        if killed:
            proc.kill()
            break
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    base = {"tokens": length, "side": side, "chunk": None if side == "one-shot" else chunk,
            "process_wall_s": wall, "watched_max_rss_mb": max_rss,
            "load_average_before": load_before, "load_average_after": load_average()}
    if killed:
        return {**base, "finished": False, "status": killed}
    if proc.returncode != 0:
        raise RuntimeError(f"case {length} {side} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return {**base, **json.loads(out.strip().splitlines()[-1]), "finished": True, "status": "ok"}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [(f"{'tokens':>7} {'side':>9} {'TTFT s':>8} {'compile s':>9} {'rest s':>7} "
              f"{'peak MB':>8} {'above model MB':>14} {'token':>6}")]
    for r in rows:
        if not r["finished"]:
            lines.append(f"{r['tokens']:>7} {r['side']:>9}  {r['status']} "
                         f"(resident {r['watched_max_rss_mb']:.0f} MB when stopped)")
            continue
        lines.append(f"{r['tokens']:>7} {r['side']:>9} {r['ttft_s']:>8.1f} {r['compile_s']:>9.1f} "
                     f"{r['ttft_minus_compile_s']:>7.1f} {r['peak_rss_mb']:>8.0f} "
                     f"{r['peak_above_model_mb'] or float('nan'):>14.0f} {r['first_token']:>6}")
    return "\n".join(lines)


def headline_ratio(rows: list[dict[str, Any]], length: int, mem_cap_gb: float
                   ) -> tuple[float, bool]:
    """Peak memory (above the model) one-shot / chunked at `length`; a one-shot case that
    did not finish counts with the largest resident size seen (a lower bound: flagged)."""
    one = next(r for r in rows if r["tokens"] == length and r["side"] == "one-shot")
    chk = next(r for r in rows if r["tokens"] == length and r["side"] == "chunked")
    if not chk["finished"]:
        raise RuntimeError(f"the chunked case at {length} tokens did not finish: {chk['status']}")
    if one["finished"]:
        return one["peak_above_model_mb"] / chk["peak_above_model_mb"], False
    return (one["watched_max_rss_mb"] - chk["base_rss_mb"]) / chk["peak_above_model_mb"], True


def run_long_prefill(args: argparse.Namespace, out: Path) -> dict:
    plan = []
    for i, length in enumerate(args.lengths):
        sides = ("one-shot", "chunked") if i % 2 == 0 else ("chunked", "one-shot")
        plan += [(length, s) for s in sides]
    rows = []
    for length, side in tqdm(plan, desc="cases", unit="case"):
        rows.append(spawn_case(length, side, args.chunk, args.time_cap, args.mem_cap))
        tqdm.write(table(rows[-1:]).splitlines()[-1])
    longest = max(args.lengths)
    ratio, lower_bound = headline_ratio(rows, longest, args.mem_cap)
    for length in args.lengths:
        done = [r for r in rows if r["tokens"] == length and r["finished"]]
        if len(done) == 2 and done[0]["first_token"] != done[1]["first_token"]:
            raise RuntimeError(f"first tokens differ at {length} tokens: {done}")
    print(table(rows))
    result = {
        "headline": {"metric": f"peak memory above the model, one-shot / chunked prefill at "
                               f"{longest} tokens" + (" (lower bound)" if lower_bound else ""),
                     "value": round(ratio, 2), "target": TARGET, "machine": machine()},
        "chunk": args.chunk, "time_cap_s": args.time_cap, "mem_cap_gb": args.mem_cap,
        "rows": rows,
    }
    write_results(out, result)
    print(f"wrote {out}")
    return result


# ----------------------------------------------------------------------------- main
PARTS = {"throughput": run_throughput, "segment-decode": run_segment_decode,
         "long-prefill": run_long_prefill}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.sampler",
                                 description=__doc__.split("\n\nEach part")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (with one part)")
    g = ap.add_argument_group("throughput")
    g.add_argument("--batches", default="16,64")
    g.add_argument("--omp-wait-policy", default="ACTIVE", choices=["PASSIVE", "ACTIVE", "default"],
                   help="OMP_WAIT_POLICY of the transformers worker process")
    g.add_argument("--new-tokens", type=int, default=64)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--chat", action="store_true", help="chat-formatted prompts (~35 tokens)")
    g.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--threads", type=int, default=os.cpu_count() or 1, help=argparse.SUPPRESS)
    add_distributed_flags(ap)
    g = ap.add_argument_group("segment-decode")
    g.add_argument("--groups", type=int, default=2)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    g.add_argument("--reps-seconds", type=float, default=1.0)
    g = ap.add_argument_group("long-prefill")
    g.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    g.add_argument("--chunk", type=int, default=512)
    g.add_argument("--time-cap", type=float, default=420.0, help="seconds per case")
    g.add_argument("--mem-cap", type=float, default=12.0, help="GB resident per case")
    g.add_argument("--case", type=int, help=argparse.SUPPRESS)  # child: run one case
    g.add_argument("--side", choices=("one-shot", "chunked"), help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """{part: its results} for the parts asked for, one after another."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.torch_worker:
        torch_worker(args.threads)
        return {}
    if args.case is not None:
        print(json.dumps(run_case(args.case, args.side, args.chunk)))
        return {}
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        ap.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    if args.out is not None and len(parts) != 1:
        ap.error("--out names one part's results file: pass exactly one --parts")
    if "throughput" in parts:
        try:  # multi-process: every process benchmarks its own devices; process 0 writes
            initialize_distributed(distributed_from_args(args))
        except ValueError as err:
            ap.error(str(err))
    return {p: PARTS[p](args, args.out or RESULTS[p]) for p in parts}


if __name__ == "__main__":
    main()
