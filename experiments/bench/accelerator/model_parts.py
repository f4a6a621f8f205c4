"""Model parts of the accelerator check (run inside task processes): sampler throughput
and train-step throughput / MFU / peak device memory, random weights with the real
configs, bf16 compute (the train step keeps fp32 master weights: param_dtype float32, so
the optimizer updates fp32 params while every matmul runs in bf16 and the log-softmax of
the vocabulary head in fp32). The samples both build (`train_samples`, `sampler_prompts`)
are the ones the torch side (torch_parts.py) runs, so the two are comparable row by row."""
from __future__ import annotations

import time

import jax
import numpy as np


def _model(name: str, param_dtype: str):
    from models.config import get_config
    from models.decoder import init_params
    cfg = get_config(name, dtype="bfloat16", param_dtype=param_dtype)
    return cfg, init_params(cfg, 0)


def device_memory() -> tuple[int | None, str]:
    """(peak bytes this process used on the device, what it is): the device's
    peak_bytes_in_use where jax reports it (GPU/TPU), else the process's peak resident
    memory (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices may not report memory
        stats = {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device peak_bytes_in_use"
    from rl.runtime.logging import peak_rss_mb
    rss = peak_rss_mb()
    return (None if rss is None else int(rss * 1e6)), "process peak resident memory"


def device_memory_limit() -> int | None:
    """The device's memory in bytes (bytes_limit), None where jax does not report it."""
    try:
        return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001
        return None


def sampler_prompts(vocab_size: int, groups: int, prompt: int) -> list[list[int]]:
    """The sampler part's prompts (seeded): `groups` lists of `prompt` token ids."""
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab_size, prompt).tolist() for _ in range(groups)]


def train_samples(vocab_size: int, groups: int, n: int, p: int, r: int) -> dict:
    """The train part's samples (seeded): prompt_ids [B, P] (each group's prompt repeated
    N times), response_ids [B, R], rewards [B], B = groups * n."""
    rng = np.random.default_rng(0)
    b = groups * n
    return {"prompt_ids": np.repeat(rng.integers(3, vocab_size, (groups, p)), n, axis=0),
            "response_ids": rng.integers(3, vocab_size, (b, r)), "rewards": rng.normal(size=b)}


def sampler(emit, *, model: str, groups: int, group_size: int, prompt: int,
            response: int, layer_loop: str = "scan", bucket_slots: bool = False) -> None:
    """generate() tokens/s for `groups` prompts x `group_size` samples (layer_loop and
    bucket_slots: the decode options of rl.rollout.init_state)."""
    from rl.rollout import generate
    cfg, params = _model(model, "bfloat16")
    prompts = sampler_prompts(cfg.vocab_size, groups, prompt)

    def run():
        return generate(params, cfg, prompts, max_new_tokens=response, stop_ids=(),
                        num_samples=group_size, layer_loop=layer_loop,
                        bucket_slots=bucket_slots)
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = run()
    sec = time.perf_counter() - t0
    tokens = sum(len(t) for group in res.tokens for t in group)
    emit({"model": model, "status": "ok", "side": "tandem", "layer_loop": layer_loop,
          "bucket_slots": bucket_slots, "groups": groups, "group_size": group_size,
          "P": prompt, "R": response, "tokens": tokens, "seconds": round(sec, 3),
          "first_call_seconds": round(first, 1), "tokens_per_s": round(tokens / sec, 1),
          "ms_per_step": round(1e3 * sec / response, 3)})


def train_flops(cfg, groups: int, n: int, p: int, r: int) -> float:
    """Model FLOPs of one packed train step (forward + backward = 3 x the forward's 2 FLOPs
    per multiply-add), counting what the step computes: the layers' matmuls on every packed
    token (each prompt once, then its n responses), the vocabulary head only where a
    log-prob is taken (the n·r positions whose next token is a response token, not the
    prompt's), and the attention of the packed layout: the prompt causal once (p(p+1)/2
    query-key pairs), each response over the prompt and its own causal part
    (r·p + r(r+1)/2), 4·d FLOPs a pair and head forward (scores and values)."""
    e, h, k, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f  # q, k, v, o, gate, up, down
    tokens = groups * (p + n * r)
    scored = groups * n * r  # the head's positions
    dense = 6 * (cfg.num_layers * layer * tokens + e * cfg.vocab_size * scored)
    pairs = groups * (p * (p + 1) / 2 + n * (r * p + r * (r + 1) / 2))
    return dense + 3 * 4 * d * h * pairs * cfg.num_layers


def train(emit, *, model: str, groups: int, group_size: int, prompt: int, response: int,
          packed: bool, attn_impl, peak_tflops, remat: str | None = None,
          head_chunk: str = "default", trace: bool = False) -> None:
    """One train step's time: packed (shared-prefix attention, `attn_impl`) or the same
    samples unpacked; tokens/s of the packed token count, TFLOP/s and MFU; remat
    (TrainConfig.remat); head_chunk "device": the vocabulary head's chunk sized for the
    device's memory (models.logprobs.head_chunk_for_memory), "default": DEFAULT_CHUNK;
    peak device memory in all and per row. trace: one more step under the jax profiler,
    summarized in a "train trace" row (experiments.common.trace)."""
    from models.logprobs import DEFAULT_CHUNK, head_chunk_for_memory
    from rl.learner import TrainConfig, batch_from_trajectory, init_train_state, make_train_step
    from rl.trajectory import Trajectory
    g, n, p, r = groups, group_size, prompt, response
    b = g * n
    cfg, params = _model(model, "float32")
    s = train_samples(cfg.vocab_size, g, n, p, r)
    traj = Trajectory.create(
        prompt_ids=s["prompt_ids"], prompt_lengths=np.full(b, p),
        response_ids=s["response_ids"], response_mask=np.ones((b, r), bool),
        behaviour_logprobs=-np.ones((b, r)), versions=np.zeros((b, r)),
        group_ids=np.repeat(np.arange(g), n), finished=np.ones(b, bool),
        truncated=np.zeros(b, bool), rewards={"r": s["rewards"]})
    chunk = (head_chunk_for_memory(cfg.vocab_size, device_memory_limit())
             if head_chunk == "device" else DEFAULT_CHUNK)
    config = TrainConfig(packed=packed, attn_impl=attn_impl, remat=remat, logprob_chunk=chunk)
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
    peak, source = device_memory()
    emit({"model": model, "status": "ok", "side": "tandem", "packed": packed,
          "attn_impl": attn_impl or "default", "remat": remat or "none", "logprob_chunk": chunk,
          "peak_memory_bytes": peak, "peak_memory_per_row_mb": None if peak is None
          else round(peak / b / 1e6, 2), "peak_memory_source": source,
          "groups": g, "group_size": n, "P": p, "R": r, "tokens": g * (p + n * r),
          "step_s": round(sec, 4), "first_call_s": round(first, 1),
          "tokens_per_s": round(g * (p + n * r) / sec, 1),
          "tflops_per_s": round(flops / sec / 1e12, 3),
          "mfu": None if mfu is None else round(mfu, 4)})
    if trace:
        from experiments.common.trace import traced
        holder = [state]

        def one_step():  # the state is donated: carry the new one
            holder[0], _ = step(holder[0], batch)
            jax.block_until_ready(holder[0].params)
        emit({"model": model, "status": "ok", "side": "tandem", "kind": "train trace",
              "packed": packed, "remat": remat or "none", "groups": g, "group_size": n,
              "P": p, "R": r, "num_layers": cfg.num_layers, **traced(one_step, 1)})
