"""Memory and time of the learner step per remat policy (TrainConfig.remat), on CPU.

    python -m experiments.bench.learner_memory                      # tiny + smollm2-135m
    python -m experiments.bench.learner_memory --models tiny --repeats 1
    python -m experiments.bench.learner_memory --variants none,full,full/mb2
    python -m experiments.bench.learner_memory --models smollm2-135m --variants '' \
        --round-robin none,full,full/c256 --repeats 3         # time alone, alternating

One packed GRPO step (rl.learner.make_train_step, fp32, PPO-clip token mean, AdamW) on the
smollm2-rg batch geometry: 8 groups x 8 samples, prompts of 100 tokens, responses of 48
(3,872 packed tokens), random weights with the model's real config. A variant is a remat
policy ("none", "dots", "full"), optionally "/mbK" for K micro-batches and "/cN" for a
vocabulary-head chunk of N tokens (TrainConfig.logprob_chunk; default 1024). Each variant runs
in its own process (one at a time): it compiles the step (XLA's compiled scratch size,
memory_analysis().temp_size_in_bytes, is read there), resets the resident high-water mark
(rl.runtime.logging.reset_peak_rss), runs --repeats steps and reports the median step
time and the peak resident memory of the steps (the process's whole peak, compile
included, from os.wait4, beside it). The load average before and after every run is kept:
this machine's cores are shared, so time moves with the load while memory does not.
--round-robin VARIANTS times those variants in ONE process, alternating step by step
(--repeats rounds after a compiling call each), so that load from other jobs hits them
alike: the time cost of a variant is read from there.

Writes experiments/results/bench_learner_memory.json (headline: smollm2-135m peak resident
memory of the step with remat "full", target 4 GB).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.common.benchmarking import load_average, machine, results_path, write_results

RESULT = results_path(__file__)
GROUPS, GROUP_SIZE, PROMPT, RESPONSE = 8, 8, 100, 48
TARGET_GB = 4.0
WORKER = "--worker"


def parse_variant(text: str) -> tuple[str, int, int]:
    """"full/mb2/c256" -> ("full", 2, 256); "none" -> ("none", 1, DEFAULT_CHUNK)."""
    from models.logprobs import DEFAULT_CHUNK
    remat, *opts = text.split("/")
    micro, chunk = 1, DEFAULT_CHUNK
    for opt in opts:
        if opt.startswith("mb") and opt[2:].isdigit():
            micro = int(opt[2:])
        elif opt.startswith("c") and opt[1:].isdigit():
            chunk = int(opt[1:])
        else:
            raise ValueError(f"variant {text!r}: want none|dots|full, then /mbK, /cN")
    if remat not in ("none", "dots", "full"):
        raise ValueError(f"variant {text!r}: want none|dots|full, then /mbK, /cN")
    return remat, micro, chunk


def build_step(model: str, variant: str):
    """(model config, jitted step, placed state, batch) of one variant."""
    from models.config import get_config
    from models.decoder import init_params
    from rl.learner import TrainConfig, init_train_state, make_train_step
    from rl.objectives import LossConfig

    remat, micro, chunk = parse_variant(variant)
    cfg = get_config(model)
    config = TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                         packed=True, remat=remat, micro_batches=micro, logprob_chunk=chunk)
    step = make_train_step(config, cfg)
    state = step.place_state(init_train_state(init_params(cfg, 0), config, 0))
    return cfg, step, state, packed_batch(cfg)


def packed_batch(cfg, seed: int = 0):
    """The smollm2-rg geometry with random token ids: (Trajectory, TrainBatch)."""
    import numpy as np

    from rl.learner import batch_from_trajectory
    from rl.trajectory import Trajectory

    b = GROUPS * GROUP_SIZE
    rng = np.random.default_rng(seed)
    traj = Trajectory.create(
        prompt_ids=np.repeat(rng.integers(3, cfg.vocab_size, (GROUPS, PROMPT)), GROUP_SIZE, axis=0),
        prompt_lengths=np.full(b, PROMPT),
        response_ids=rng.integers(3, cfg.vocab_size, (b, RESPONSE)),
        response_mask=np.ones((b, RESPONSE), bool), behaviour_logprobs=-np.ones((b, RESPONSE)),
        versions=np.zeros((b, RESPONSE)), group_ids=np.repeat(np.arange(GROUPS), GROUP_SIZE),
        finished=np.ones(b, bool), truncated=np.zeros(b, bool),
        rewards={"r": rng.normal(size=b)})
    return batch_from_trajectory(traj, group_size=GROUP_SIZE, model_config=cfg, packed=True)


def worker(model: str, variant: str, repeats: int) -> dict:
    """One variant in this process: compile, scratch size, step times, step peak RSS."""
    import jax

    from rl.runtime.logging import peak_rss_mb, reset_peak_rss

    remat, micro, chunk = parse_variant(variant)
    _, step, state, batch = build_step(model, variant)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    scratch = compiled.memory_analysis().temp_size_in_bytes
    del compiled
    state, metrics = step(state, batch)  # the jit call compiles again (cache); not timed
    jax.block_until_ready(state.params)
    per_step = reset_peak_rss()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - t0)
    return {"model": model, "variant": variant, "remat": remat, "micro_batches": micro,
            "logprob_chunk": chunk, "tokens": GROUPS * (PROMPT + GROUP_SIZE * RESPONSE),
            "compile_s": round(compile_s, 2), "scratch_mb": round(scratch / 1e6, 1),
            "step_s": round(statistics.median(times), 3), "step_s_all": [round(t, 3) for t in times],
            "step_peak_rss_mb": round(peak_rss_mb(), 1) if per_step else None,
            "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


def round_robin(model: str, variants: list[str], repeats: int) -> dict:
    """Step seconds of `variants` alternating in this process (a compiling call each first)."""
    import jax

    steps = {v: build_step(model, v) for v in variants}
    states = {}
    for v, (_, step, state, batch) in steps.items():
        states[v], _ = step(state, batch)
        jax.block_until_ready(states[v].params)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v, (_, step, _, batch) in steps.items():
            t0 = time.perf_counter()
            states[v], _ = step(states[v], batch)
            jax.block_until_ready(states[v].params)
            times[v].append(round(time.perf_counter() - t0, 3))
    return {"model": model, "repeats": repeats, "step_s_all": times,
            "step_s_median": {v: statistics.median(t) for v, t in times.items()}}


def run_variant(model: str, variant: str, repeats: int) -> dict:
    """worker() in a fresh process; adds its whole-process peak RSS and the load."""
    load = load_average()
    with subprocess.Popen([sys.executable, "-m", "experiments.bench.learner_memory", WORKER,
                           model, variant, str(repeats)], stdout=subprocess.PIPE, text=True,
                          env={**os.environ}) as proc:
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{model} {variant} failed (exit {proc.returncode}): {out[-2000:]}")
    row = json.loads(out.strip().splitlines()[-1])
    row.update(process_peak_rss_mb=round(usage.ru_maxrss * 1024 / 1e6, 1),
               load_average_before=load, load_average_after=load_average())
    return row


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == WORKER:
        print(json.dumps(worker(argv[1], argv[2], int(argv[3]))), flush=True)
        return {}
    if argv and argv[0] == WORKER + "-rr":
        print(json.dumps(round_robin(argv[1], argv[2].split(","), int(argv[3]))), flush=True)
        return {}
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2-135m")
    p.add_argument("--variants", default="none,dots,full")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per variant")
    p.add_argument("--round-robin", default="", metavar="VARIANTS",
                   help="also time these variants alternating in one process (per model)")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    alternating = [v for v in args.round_robin.split(",") if v]
    for v in variants + alternating:
        parse_variant(v)
    rows, timed = [], []
    for model in args.models.split(","):
        for variant in variants:
            row = run_variant(model, variant, args.repeats)
            rows.append(row)
            print(f"{model:14s} {variant:9s} step {row['step_s']:7.2f} s  step peak "
                  f"{(row['step_peak_rss_mb'] or 0) / 1e3:6.2f} GB  process peak "
                  f"{row['process_peak_rss_mb'] / 1e3:6.2f} GB  scratch {row['scratch_mb']:8.1f} MB"
                  f"  load {row['load_average_before'][0]:.1f}", flush=True)
        if alternating:
            load = load_average()
            out = subprocess.run([sys.executable, "-m", "experiments.bench.learner_memory",
                                  WORKER + "-rr", model, ",".join(alternating), str(args.repeats)],
                                 capture_output=True, text=True, check=True).stdout
            rr = {**json.loads(out.strip().splitlines()[-1]), "load_average_before": load,
                  "load_average_after": load_average()}
            timed.append(rr)
            print(f"{model:14s} alternating: " + "  ".join(
                f"{v} {t:.2f} s" for v, t in rr["step_s_median"].items())
                + f"  load {load[0]:.1f}", flush=True)
    head = next((r for r in rows if r["model"] == "smollm2-135m" and r["variant"] == "full"), None)
    if args.out.exists() and not head:  # a time-only run: keep the memory rows already there
        old = json.loads(args.out.read_text())
        rows = old.get("rows", []) + rows
        head = next((r for r in rows if r["model"] == "smollm2-135m"
                     and r["variant"] == "full"), None)
    result = {
        "headline": {"metric": "smollm2-135m learner step peak resident GB, remat full "
                               "(8x8 packed, P=100, R=48)",
                     "value": round((head["step_peak_rss_mb"] or head["process_peak_rss_mb"])
                                    / 1e3, 2) if head else 0.0,
                     "target": TARGET_GB, "machine": machine()},
        "command": "python -m experiments.bench.learner_memory " + " ".join(argv),
        "geometry": {"groups": GROUPS, "group_size": GROUP_SIZE, "prompt": PROMPT,
                     "response": RESPONSE},
        "rows": rows, "round_robin": timed,
    }
    write_results(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
