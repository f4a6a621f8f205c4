"""Model parts of the accelerator check (run inside task processes): sampler throughput
and train-step throughput / MFU, random weights with the real configs, bf16."""
from __future__ import annotations

import time

import jax
import numpy as np


def _model(name: str, param_dtype: str):
    from models.config import get_config
    from models.decoder import init_params
    cfg = get_config(name, dtype="bfloat16", param_dtype=param_dtype)
    return cfg, init_params(cfg, 0)


def sampler(emit, *, model: str, groups: int, group_size: int, prompt: int,
            response: int) -> None:
    """generate() tokens/s for `groups` prompts x `group_size` samples."""
    from rl.rollout import generate
    cfg, params = _model(model, "bfloat16")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, prompt).tolist() for _ in range(groups)]

    def run():
        return generate(params, cfg, prompts, max_new_tokens=response, stop_ids=(),
                        num_samples=group_size)
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = run()
    sec = time.perf_counter() - t0
    tokens = sum(len(t) for group in res.tokens for t in group)
    emit({"model": model, "status": "ok", "tokens": tokens, "seconds": round(sec, 3),
          "first_call_seconds": round(first, 1), "tokens_per_s": round(tokens / sec, 1)})


def train_flops(cfg, groups: int, n: int, p: int, r: int) -> float:
    """Model FLOPs of one packed step: 6 x matmul params x tokens (+ vocab head) plus the
    attention of the packed layout (prompt causal once, each response over prompt + own)."""
    e, h, k, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f
    tokens = groups * (p + n * r)
    dense = 6 * (cfg.num_layers * layer + e * cfg.vocab_size) * tokens
    pairs = groups * (p * p / 2 + n * (r * p + r * r / 2))   # attended (query, key) pairs
    return dense + 12 * pairs * h * d * cfg.num_layers


def train(emit, *, model: str, groups: int, group_size: int, prompt: int, response: int,
          packed: bool, attn_impl, peak_tflops) -> None:
    """One train step's time: packed (shared-prefix attention, `attn_impl`) or the same
    samples unpacked; tokens/s of the packed token count, TFLOP/s and MFU."""
    from rl.learner import TrainConfig, batch_from_trajectory, init_train_state, make_train_step
    from rl.trajectory import Trajectory
    g, n, p, r = groups, group_size, prompt, response
    b = g * n
    cfg, params = _model(model, "float32")
    rng = np.random.default_rng(0)
    traj = Trajectory.create(
        prompt_ids=np.repeat(rng.integers(3, cfg.vocab_size, (g, p)), n, axis=0),
        prompt_lengths=np.full(b, p), response_ids=rng.integers(3, cfg.vocab_size, (b, r)),
        response_mask=np.ones((b, r), bool), behaviour_logprobs=-np.ones((b, r)),
        versions=np.zeros((b, r)), group_ids=np.repeat(np.arange(g), n),
        finished=np.ones(b, bool), truncated=np.zeros(b, bool),
        rewards={"r": rng.normal(size=b)})
    config = TrainConfig(packed=packed, attn_impl=attn_impl)
    batch = batch_from_trajectory(traj, group_size=n, model_config=cfg, packed=packed)
    step = make_train_step(config, cfg)
    state = init_train_state(params, config, 0)
    t0 = time.perf_counter()
    state, _ = step(state, batch)
    jax.block_until_ready(state.params)
    first = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times))
    flops = train_flops(cfg, g, n, p, r)
    mfu = None if not peak_tflops else flops / sec / (peak_tflops * 1e12)
    emit({"model": model, "status": "ok", "packed": packed, "attn_impl": attn_impl or "default",
          "groups": g, "group_size": n, "P": p, "R": r, "tokens": g * (p + n * r),
          "step_s": round(sec, 4), "first_call_s": round(first, 1),
          "tokens_per_s": round(g * (p + n * r) / sec, 1),
          "tflops_per_s": round(flops / sec / 1e12, 3),
          "mfu": None if mfu is None else round(mfu, 4)})
