"""The decode-step part of the accelerator check (run inside a task process): ms per
decode step of the sampler's on-device decode loop, bytes it must read per step, the
copy bandwidth measured in the same process, and the share of the memory roofline.

One step feeds one token per row through the whole model and draws the next one (the
sampler's `decode_segment_jit`: a while loop over tokens on the device, sampling fused, the
bounded KV read); the steps are timed over a segment of `steps` tokens right after a
prefill of `prompt` tokens per group (segmented cache, group_size samples per prompt).
Bytes per step (`decode_bytes_per_step`): every weight once (the embedding table of an
untied model only through the gathered rows, i.e. not counted) plus the valid keys and
values the step attends to (each group's prompt once, each row's response so far; the
mean over the segment). Roofline share = (bytes / copy bandwidth) / step time: 1.0 would be
a step that does nothing but stream what it must read at the rate this device copies.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def copy_bandwidth(nbytes: int, seconds: float) -> dict:
    """The device's streaming rate: x + 1 over an fp32 array of nbytes (reads nbytes,
    writes nbytes); median over >= 5 calls and `seconds`. GB/s = 2 nbytes / time."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    compiled = jax.jit(lambda a: a + 1.0).lower(x).compile()
    jax.block_until_ready(compiled(x))
    times, start = [], time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(x))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"copy_bytes": 2 * x.nbytes, "copy_ms": round(1e3 * t, 4),
            "copy_gb_per_s": round(2 * x.nbytes / t / 1e9, 1)}


def weight_bytes(params, config) -> int:
    """Bytes of the weights a decode step reads: every leaf once, less the embedding table
    of an untied model (only the fed tokens' rows are gathered from it)."""
    total = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not config.tie_word_embeddings:
        emb = params["embed"]["embedding"]
        total -= int(emb.size) * emb.dtype.itemsize
    return total


def decode_bytes_per_step(config, *, weights: int, rows: int, group_size: int,
                          prompt_tokens: float, response_tokens: float,
                          kv_itemsize: int) -> dict:
    """Bytes one decode step of `rows` rows must read on the segmented cache: the weights,
    each group's prompt keys and values once (prompt_tokens valid entries per group) and
    each row's own (response_tokens valid entries, e.g. the mean over a segment)."""
    per_entry = 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_itemsize
    prompt_kv = (rows // group_size) * prompt_tokens * per_entry
    resp_kv = rows * response_tokens * per_entry
    kv = int(round(prompt_kv + resp_kv))
    return {"weight_bytes": int(weights), "kv_bytes": kv, "bytes_per_step": int(weights) + kv}


def decode_step(emit, *, model: str, rows: list, group_size: int, prompt: int, steps: int,
                layer_loops: list, seconds: float, copy_mb: int,
                xla_flags: str | None = None, trace: bool = False) -> None:
    """One row per (rows, layer_loop): ms per decode step, tokens/s, bytes per step and
    the roofline share, compile time apart; a first row with the copy bandwidth. trace:
    after each timing, one segment under the jax profiler, summarized in a "decode trace"
    row (experiments.common.trace: device busy share, gaps, kernels per step
    and per layer-step, the top kernels)."""
    from models.config import get_config
    from models.decoder import init_params
    from rl.rollout import SamplingConfig, init_state, prefill, sample_keys
    from rl.rollout.sampler import kv_bucket
    from rl.rollout.sampler_core import decode_segment_jit

    cfg = get_config(model, dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, 0)
    bw = copy_bandwidth(copy_mb * 2**20, seconds)
    emit({"status": "ok", "kind": "copy bandwidth", "model": model, "xla_flags": xla_flags,
          **bw})
    weights = weight_bytes(params, cfg)
    rng = np.random.default_rng(0)
    for n_rows in rows:
        groups = n_rows // group_size
        prompts = rng.integers(3, cfg.vocab_size, (groups, prompt)).tolist()
        for loop in layer_loops:
            st = init_state(cfg, num_slots=n_rows, max_prompt_len=prompt,
                            max_new_tokens=steps, sampling=SamplingConfig(), stop_ids=(),
                            group_size=group_size, layer_loop=loop, bucket_slots=True)
            st = prefill(params, st, prompts, np.arange(groups * group_size).reshape(
                groups, group_size), sample_keys(0, range(groups), group_size))
            bound = kv_bucket(steps, steps)  # response lengths 0 .. steps - 1 during the segment
            args = (params, st, jnp.int32(steps), jnp.int32(0))
            t0 = time.perf_counter()
            compiled = decode_segment_jit.lower(*args, kv_bound=bound).compile()
            compile_s = time.perf_counter() - t0
            out = compiled(*args)
            jax.block_until_ready(out.response_ids)
            made = int(np.asarray(out.num_generated).sum())
            times, start = [], time.perf_counter()
            while len(times) < 3 or time.perf_counter() - start < seconds:
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*args).response_ids)
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times) / steps
            moved = decode_bytes_per_step(cfg, weights=weights, rows=n_rows,
                                          group_size=group_size, prompt_tokens=prompt - 1,
                                          response_tokens=(steps + 1) / 2,
                                          kv_itemsize=st.cache.k_resp.dtype.itemsize)
            roofline_ms = 1e3 * moved["bytes_per_step"] / (bw["copy_gb_per_s"] * 1e9)
            emit({"status": "ok", "kind": "decode step", "model": model, "rows": n_rows,
                  "slots": st.num_slots, "layer_loop": loop, "xla_flags": xla_flags,
                  "P": prompt, "steps": steps, "kv_bound": bound, "tokens_made": made,
                  "compile_s": round(compile_s, 2), "ms_per_step": round(ms, 4),
                  "tokens_per_s": round(n_rows * 1e3 / ms, 1), **moved,
                  "copy_gb_per_s": bw["copy_gb_per_s"],
                  "roofline_ms": round(roofline_ms, 4),
                  "roofline_share": round(roofline_ms / ms, 4)})
            if trace:
                from experiments.common.trace import traced
                summary = traced(lambda: jax.block_until_ready(  # noqa: B023 - called now
                    compiled(*args).response_ids), steps)
                emit({"status": "ok", "kind": "decode trace", "model": model, "rows": n_rows,
                      "layer_loop": loop, "xla_flags": xla_flags, "num_layers": cfg.num_layers,
                      "events_per_layer_step": summary["events_per_step"] / cfg.num_layers,
                      **summary})
