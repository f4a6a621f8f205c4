"""LoRA / QLoRA vs full fine-tuning: bytes of what the learner trains and keeps, and the
train-step time.

    python -m experiments.bench.lora [--time-models smollm2-135m] [--shape 8x128]
        [--seconds 20] [--out PATH]

Bytes (both presets, smollm2-135m and qwen2.5-0.5b, from shapes alone: nothing is
allocated): trainable params, their AdamW state (two moments; the int32 count left out)
and the frozen base as stored, for the sides
  full       every param trained (the library's default learner);
  lora-r8    adapters of rank 8 (alpha 16) on q/k/v/o/gate/up/down, base float32, frozen;
  lora-r32   the same at rank 32;
  qlora-int8 / qlora-int4   lora-r8 on a base stored int8 per channel / int4 in blocks of
             64 (models.lora.quantize_base), dequantised on use inside the layer scan.
Step time (the --time-models presets, random weights): one jitted rl.learner step
(forward, backward, AdamW with clipping) on B x T random tokens, GRPO advantages from
random rewards in groups of 4, PPO-clip token-mean, float32, unpacked; the sides are
timed round-robin (experiments.common.benchmarking.time_calls) after a warm-up (compile) call.
Decode (the sampler, --decode-batch rows, timed presets): one decode step with the merged
weights (one merge per policy version, whose time is reported too) vs base + adapters on
the fly (float32 / int8 / int4 base), round-robin.
Writes experiments/results/bench_lora.json; headline: full / lora-r8 optimizer-state
bytes for smollm2-135m (target >= 20).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments.common.benchmarking import (
    load_average,
    machine,
    results_path,
    time_calls,
    write_results,
)
from models.config import get_config
from models.decoder import decode_step, init_params, prefill
from models.kv_cache import init_cache
from models.lora import LoraConfig, compose, count_bytes, init_lora, quantize_base
from rl.learner import (
    OptimizerConfig,
    TrainConfig,
    batch_from_trajectory,
    init_train_state,
    make_train_step,
)
from rl.loops.adapters import merged_params
from rl.objectives import LossConfig
from rl.trajectory import Trajectory

RESULT = results_path(__file__)
MODELS = ("smollm2-135m", "qwen2.5-0.5b")
GROUP = 4
SIDES = {  # name -> (LoraConfig or None for the full fine-tune)
    "full": None,
    "lora-r8": LoraConfig(rank=8, alpha=16.0),
    "lora-r32": LoraConfig(rank=32, alpha=64.0),
    "qlora-int8": LoraConfig(rank=8, alpha=16.0, qlora="int8"),
    "qlora-int4": LoraConfig(rank=8, alpha=16.0, qlora="int4"),
}


def train_config(lora: LoraConfig | None) -> TrainConfig:
    return TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                       optimizer=OptimizerConfig(learning_rate=1e-6), lora=lora)


def side_inputs(model_config, lora: LoraConfig | None, params):
    """(trainable params, frozen base or None) of one side."""
    if lora is None:
        return params, None
    base = params if lora.qlora is None else quantize_base(params, lora.qlora)
    return init_lora(base, lora, 1), base


def byte_table(name: str) -> dict:
    """Bytes per side from abstract shapes (jax.eval_shape: nothing allocated)."""
    mc = get_config(name)
    rows = {}
    for side, lora in SIDES.items():
        def build(lora=lora):
            trainable, base = side_inputs(mc, lora, init_params(mc, 0))
            return trainable, base, init_train_state(trainable, train_config(lora)).opt_state

        trainable, base, opt = jax.eval_shape(build)
        moments = [x for x in jax.tree.leaves(opt) if x.ndim > 0]
        full_base = jax.eval_shape(lambda: init_params(mc, 0))
        rows[side] = {"trainable_bytes": count_bytes(trainable),
                      "optimizer_state_bytes": count_bytes(moments),
                      "frozen_base_bytes": count_bytes(base if base is not None else full_base)}
    return rows


def make_batch(model_config, b: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    p, r = t // 4, t - t // 4
    v = model_config.vocab_size
    rlen = rng.integers(r // 2, r + 1, b)
    rmask = np.arange(r)[None] < rlen[:, None]
    return batch_from_trajectory(Trajectory.create(
        prompt_ids=rng.integers(3, v, (b, p)), prompt_lengths=np.full(b, p),
        response_ids=rng.integers(3, v, (b, r)) * rmask, response_mask=rmask,
        behaviour_logprobs=np.where(rmask, -rng.random((b, r)) * 3, 0.0),
        versions=np.zeros((b, r)), group_ids=np.repeat(np.arange(b // GROUP), GROUP),
        finished=np.zeros(b, bool), truncated=np.ones(b, bool),
        rewards={"r": rng.normal(size=b)}), group_size=GROUP, model_config=model_config)


def time_table(name: str, b: int, t: int, seconds: float) -> dict:
    mc = get_config(name)
    params = init_params(mc, 0)
    batch = make_batch(mc, b, t)
    calls, compile_s = {}, {}
    for side, lora in tqdm(SIDES.items(), desc=f"{name}: compile"):
        trainable, base = side_inputs(mc, lora, params)
        if lora is None:  # the full step donates its state: give it its own copy
            trainable = jax.tree.map(jnp.array, trainable)
        step = make_train_step(train_config(lora), mc)
        holder = {"state": init_train_state(trainable, train_config(lora))}

        def call(step=step, holder=holder, base=base):
            args = (holder["state"], batch) + (() if base is None else (base,))
            holder["state"], metrics = step(*args)
            return metrics["loss"]

        start = time.perf_counter()
        jax.block_until_ready(call())
        compile_s[side] = round(time.perf_counter() - start, 1)
        calls[side] = call
    ms = time_calls(calls, seconds, min_reps=3)
    return {side: {"step_ms": round(ms[side], 1), "first_call_s": compile_s[side]}
            for side in SIDES}


def decode_table(name: str, b: int, seconds: float, prompt: int = 64, max_len: int = 256
                 ) -> dict:
    """The sampler's two options for a LoRA policy: one decode step (b rows, a cache of
    max_len holding `prompt` tokens) with merged weights (one merge per policy version,
    timed too) vs base + adapters on the fly (models.lora.compose), base float32 / int8 /
    int4. The cache is not donated, so every call decodes the same position."""
    mc = get_config(name)
    params = init_params(mc, 0)
    lora = SIDES["lora-r8"]
    ad = init_lora(params, lora, 1)
    variants = {"merged": merged_params(params, ad, lora),  # what the loops' sampler runs
                "on-the-fly": compose(params, ad, lora)}
    for fmt in ("int8", "int4"):
        q = quantize_base(params, fmt)
        variants[f"on-the-fly-{fmt}"] = compose(q, ad, lora)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, mc.vocab_size, (b, prompt)),
                         jnp.int32)
    _, cache = prefill(variants["merged"], mc, tokens, jnp.full((b,), prompt, jnp.int32),
                       init_cache(mc, b, max_len))
    calls = {k: (lambda p=p: decode_step(p, mc, tokens[:, 0], cache)[0])
             for k, p in variants.items()}
    calls["merge (per version)"] = lambda: merged_params(params, ad, lora)
    for fn in tqdm(calls.values(), desc=f"{name}: decode compile"):
        jax.block_until_ready(fn())
    ms = time_calls(calls, seconds, min_reps=5)
    return {k: round(v, 2) for k, v in ms.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-models", default="smollm2-135m",
                    help="comma-separated presets to time ('' = bytes only)")
    ap.add_argument("--shape", default="8x128", help="B x T tokens of the timed batch")
    ap.add_argument("--seconds", type=float, default=20.0, help="timing budget per side")
    ap.add_argument("--decode-batch", type=int, default=8,
                    help="rows of the decode comparison on the timed presets (0 = skip)")
    ap.add_argument("--decode-models", help="comma-separated presets of the decode comparison "
                    "(default: the timed presets; 'tiny' allowed), e.g. tiny,smollm2-135m")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    b, t = (int(x) for x in args.shape.split("x"))
    if b % GROUP:
        raise ValueError(f"--shape rows B={b} must be a multiple of the group size {GROUP}")
    load_before = load_average()
    result = {"models": {}}
    for name in MODELS:
        result["models"][name] = {"bytes": byte_table(name)}
    for name in [m for m in args.time_models.split(",") if m]:
        if name not in MODELS:
            raise ValueError(f"--time-models: {name!r} is not one of {MODELS}")
        result["models"][name]["step"] = time_table(name, b, t, args.seconds)
    decode_models = args.time_models if args.decode_models is None else args.decode_models
    for name in [m for m in decode_models.split(",") if m and args.decode_batch]:
        if name not in MODELS + ("tiny",):
            raise ValueError(f"--decode-models: {name!r} is not one of {MODELS + ('tiny',)}")
        row = result["models"].setdefault(name, {})
        row["decode_ms"] = decode_table(name, args.decode_batch, args.seconds / 2)
    print(f"{'model':14} {'side':11} {'trainable MB':>12} {'opt state MB':>12} "
          f"{'base MB':>8} {'opt ratio':>9} {'step ms':>8}")
    for name, res in result["models"].items():
        full_opt = res.get("bytes", {}).get("full", {}).get("optimizer_state_bytes")
        for side, row in res.get("bytes", {}).items():
            row["optimizer_state_ratio_full_over_side"] = round(
                full_opt / row["optimizer_state_bytes"], 1)
            step = res.get("step", {}).get(side, {}).get("step_ms", float("nan"))
            print(f"{name:14} {side:11} {row['trainable_bytes'] / 2**20:12.2f} "
                  f"{row['optimizer_state_bytes'] / 2**20:12.2f} "
                  f"{row['frozen_base_bytes'] / 2**20:8.1f} "
                  f"{row['optimizer_state_ratio_full_over_side']:9.1f} {step:8.1f}")
    for name, res in result["models"].items():
        for k, v in res.get("decode_ms", {}).items():
            print(f"{name:14} decode b={args.decode_batch}: {k:20} {v:8.2f} ms")
    ratio = result["models"]["smollm2-135m"]["bytes"]["lora-r8"][
        "optimizer_state_ratio_full_over_side"]
    result.update(
        headline={"metric": "optimizer-state bytes, full fine-tune / LoRA r=8 (smollm2-135m)",
                  "value": ratio, "target": 20.0, "machine": machine()},
        shape=f"{b}x{t}", load_average_before=load_before, load_average_after=load_average())
    write_results(Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
