"""Sampler throughput: Tandem's rollout sampler vs transformers `generate`, SmolLM2-135M on CPU.

    python -m experiments.bench_sampler [--batches 16,64] [--new-tokens 64] [--repeats 3] [--chat]
                                        [--omp-wait-policy PASSIVE|ACTIVE|default]

Both sides load the same GGUF file (SmolLM2-135M-Instruct, dequantised to float32), get
the same prompts (batch B = B distinct prompts, one sample each; short plain-text
questions by default so the time measures sampling rather than prompt prefill, or
chat-formatted with --chat), sample at temperature 1 with no top-k/top-p and no early
stop, so every row makes exactly --new-tokens tokens; the time is end to end (prefill +
decode). transformers runs under torch.inference_mode() with an explicit attention mask
(left padding), min_new_tokens = max_new_tokens, torch.set_num_threads(cores), in its own
process with OMP_WAIT_POLICY=ACTIVE by default (the faster setting for torch here: 226 vs
192 tok/s at batch 64; its spinning threads would steal the cores from XLA, so that
process is SIGSTOPped while Tandem runs); XLA uses its default CPU thread pool (one thread
per core). The comparison is only meaningful at low load (other
jobs collapse torch's threads far more than XLA's): the JSON records the load average
before, during and after. Each side gets a warm-up call
(compilation for Tandem); the timed repeats alternate between the two so load from other
processes hits both alike, and the best repeat of each side is reported (all are kept in
the JSON).

FLOP floor: 2 x params FLOPs per generated token over a float32 matmul rate measured in
the same run with a jitted jnp.dot of the model's MLP shape at batch 64 ([64, 576] x
[576, 1536]). Prompt tokens cost FLOPs too, so the JSON also gives the fraction counting
them. Writes experiments/results/bench_sampler.json (headline: the batch-64 tokens/s
ratio tandem / transformers, target 1.5; also the batch-16 ratio and the fraction of the
FLOP floor at batch 64, target 0.6).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.common.benchmarking import load_average, machine
from models.assets import load_model, smollm2_gguf_path
from rl.rollout import SamplingConfig, generate
from rl.runtime.distributed import add_distributed_flags, initialize_distributed, is_main_process

RESULT = Path(__file__).parent / "results" / "bench_sampler.json"
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
        import subprocess
        env = dict(os.environ)
        if wait_policy != "default":
            env["OMP_WAIT_POLICY"] = wait_policy
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.bench_sampler", "--torch-worker",
             "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=str(Path(__file__).resolve().parents[1]))
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
        import signal
        os.kill(self.proc.pid, signal.SIGSTOP)

    def run(self, prompts, new_tokens, seed, pad_id) -> tuple[float, int]:
        import signal
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens,
                                          "seed": seed, "pad_id": pad_id}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        self.pause()
        return out["seconds"], out["tokens"]

    def close(self):
        import signal
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench_sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--omp-wait-policy", default="ACTIVE", choices=["PASSIVE", "ACTIVE", "default"],
                    help="OMP_WAIT_POLICY of the transformers worker process")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help=argparse.SUPPRESS)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chat", action="store_true", help="chat-formatted prompts (~35 tokens)")
    ap.add_argument("--out", default=str(RESULT))
    add_distributed_flags(ap)
    args = ap.parse_args(argv)
    if args.torch_worker:
        torch_worker(args.threads)
        return {}
    try:  # multi-process: every process benchmarks its own devices; process 0 writes
        initialize_distributed(args)
    except ValueError as err:
        ap.error(str(err))
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
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
