"""Memory and time of the learner step per remat policy (TrainConfig.remat), on CPU.

    python -m experiments.bench.learner_memory                      # tiny + smollm2-135m
    python -m experiments.bench.learner_memory --models tiny --repeats 1
    python -m experiments.bench.learner_memory --variants none,full,full/mb2

One packed GRPO step (rl.learner.make_train_step, fp32, PPO-clip token mean, AdamW) on the
smollm2-rg batch geometry: 8 groups x 8 samples, prompts of 100 tokens, responses of 48
(3,872 packed tokens), random weights with the model's real config. A variant is a remat
policy ("none", "dots", "full"), optionally "/mbK" for K micro-batches. Each variant runs
in its own process (one at a time): it compiles the step (XLA's compiled scratch size,
memory_analysis().temp_size_in_bytes, is read there), resets the resident high-water mark
(rl.runtime.logging.reset_peak_rss), runs --repeats steps and reports the median step
time and the peak resident memory of the steps (the process's whole peak, compile
included, from os.wait4, beside it). The load average before and after every run is kept:
this machine's cores are shared, so time moves with the load while memory does not.

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


def parse_variant(text: str) -> tuple[str, int]:
    """"full/mb2" -> ("full", 2); "none" -> ("none", 1)."""
    remat, _, mb = text.partition("/")
    if remat not in ("none", "dots", "full") or (mb and not mb.startswith("mb")):
        raise ValueError(f"variant {text!r}: want none|dots|full, optionally /mbK")
    return remat, int(mb[2:]) if mb else 1


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

    from models.config import get_config
    from models.decoder import init_params
    from rl.learner import TrainConfig, init_train_state, make_train_step
    from rl.objectives import LossConfig
    from rl.runtime.logging import peak_rss_mb, reset_peak_rss

    remat, micro = parse_variant(variant)
    cfg = get_config(model)
    config = TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                         packed=True, remat=remat, micro_batches=micro)
    batch = packed_batch(cfg)
    step = make_train_step(config, cfg)
    state = step.place_state(init_train_state(init_params(cfg, 0), config, 0))
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
            "tokens": GROUPS * (PROMPT + GROUP_SIZE * RESPONSE),
            "compile_s": round(compile_s, 2), "scratch_mb": round(scratch / 1e6, 1),
            "step_s": round(statistics.median(times), 3), "step_s_all": [round(t, 3) for t in times],
            "step_peak_rss_mb": peak_rss_mb() if per_step else None,
            "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2-135m")
    p.add_argument("--variants", default="none,dots,full")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per variant")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        parse_variant(v)
    rows = []
    for model in args.models.split(","):
        for variant in variants:
            row = run_variant(model, variant, args.repeats)
            rows.append(row)
            print(f"{model:14s} {variant:9s} step {row['step_s']:7.2f} s  step peak "
                  f"{(row['step_peak_rss_mb'] or 0) / 1e3:6.2f} GB  process peak "
                  f"{row['process_peak_rss_mb'] / 1e3:6.2f} GB  scratch {row['scratch_mb']:8.1f} MB"
                  f"  load {row['load_average_before'][0]:.1f}", flush=True)
    head = next((r for r in rows if r["model"] == "smollm2-135m" and r["variant"] == "full"), None)
    result = {
        "headline": {"metric": "smollm2-135m learner step peak resident GB, remat full "
                               "(8x8 packed, P=100, R=48)",
                     "value": round((head["step_peak_rss_mb"] or head["process_peak_rss_mb"])
                                    / 1e3, 2) if head else 0.0,
                     "target": TARGET_GB, "machine": machine()},
        "command": "python -m experiments.bench.learner_memory " + " ".join(argv),
        "geometry": {"groups": GROUPS, "group_size": GROUP_SIZE, "prompt": PROMPT,
                     "response": RESPONSE},
        "rows": rows,
    }
    write_results(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
