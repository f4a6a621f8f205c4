"""The torch side of the accelerator check (run inside task processes): the HF
transformers + torch train step and HF `generate` on the same samples as Tandem's train
and sampler parts (model_parts.train_samples / sampler_prompts), random weights with the
same config (models.config.config_to_hf), so that each Tandem row has its peer.

  train     one step: forward with sdpa attention under bf16 autocast (fp32 master
            weights), the vocabulary head only at the positions that predict response
            tokens (logits_to_keep), their log-probs in fp32, the GRPO-style
            policy-gradient loss -mean(A * log p) over response tokens, backward,
            clip_grad_norm_(1.0), AdamW (fused where torch offers it, else foreach);
            samples unpacked (each row holds its prompt: what plain torch does). Where the
            whole batch does not fit the device (qwen2.5-0.5b's 64 x 512 tokens on an
            80 GB H100 ran out of memory), gradients are accumulated over 2, 4, ...
            micro-batches, as a torch user would; the row says how many.
  generate  model.generate(do_sample=True) in bf16 with sdpa, N samples per prompt,
            exactly R new tokens (min_new_tokens = max_new_tokens = R, top_k 0).

torch and transformers are imported inside the tasks only: this module imports without
them, and where they are missing the task writes a "skipped" row saying so.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from experiments.bench.accelerator.model_parts import sampler_prompts, train_flops, train_samples


def _torch_or_skip(emit, what: str):
    """(torch, transformers), or None after writing a skipped row."""
    try:
        import torch
        import transformers
    except ImportError as e:
        emit({"status": "skipped", "side": "torch", "kind": what,
              "reason": f"torch / transformers not importable here: {e}"})
        return None
    return torch, transformers


def hf_model(torch, transformers, model: str, dtype):
    """A randomly initialised HF model of preset `model` on the best device, sdpa attention."""
    from models.config import config_to_hf, get_config
    cfg = get_config(model)
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}
    hf_cfg = classes[cfg.arch](**config_to_hf(cfg))
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # transformers >= 4.56 names it dtype (torch_dtype: deprecated)
        net = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa",
                                                            dtype=dtype)
    except TypeError:
        net = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa",
                                                            torch_dtype=dtype)
    return cfg, net.to(device), device


def _sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_memory(torch, device) -> tuple[int | None, str]:
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    from rl.runtime.logging import peak_rss_mb
    rss = peak_rss_mb()
    return (None if rss is None else int(rss * 1e6)), "process peak resident memory"


def _adamw(torch, params, device):
    """(AdamW, which flavour): fused where this torch has it for the device, else foreach."""
    try:
        return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, fused=True), "fused"
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, foreach=True), "foreach"


def train(emit, *, model: str, groups: int, group_size: int, prompt: int, response: int,
          peak_tflops, repeats: int = 3) -> None:
    """One HF + torch train step on the train part's samples (unpacked): step time, the
    same useful-FLOP count as Tandem's packed row (so TFLOP/s compare), peak memory."""
    mods = _torch_or_skip(emit, "train")
    if mods is None:
        return
    torch, transformers = mods
    import torch.nn.functional as F  # noqa: N812
    g, n, p, r = groups, group_size, prompt, response
    b = g * n
    cfg, net, device = hf_model(torch, transformers, model, torch.float32)
    net.train()
    s = train_samples(cfg.vocab_size, g, n, p, r)
    tokens = torch.from_numpy(np.concatenate([s["prompt_ids"], s["response_ids"]], axis=1)
                              ).long().to(device)
    targets = tokens[:, p:]  # the response tokens, predicted by positions P-1 .. P+R-2
    rew = s["rewards"].reshape(g, n)
    adv = ((rew - rew.mean(1, keepdims=True)) / (rew.std(1, keepdims=True) + 1e-6)).reshape(-1)
    adv = torch.from_numpy(adv).float().to(device)
    opt, flavour = _adamw(torch, net.parameters(), device)

    micro = 1

    def step():
        rows = b // micro
        for i in range(0, b, rows):
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                # the head only where a response token is predicted (as Tandem's learner)
                logits = net(input_ids=tokens[i:i + rows], logits_to_keep=r + 1).logits[:, :-1]
            logp = -F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                    targets[i:i + rows].reshape(-1),
                                    reduction="none").view(rows, r)
            # the batch's token mean, accumulated over micro-batches of equal size
            loss = -(adv[i:i + rows, None] * logp).sum() / (b * r)
            loss.backward()
            del logits, logp
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    oom = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    while True:
        try:
            t0 = time.perf_counter()
            step()
            _sync(torch, device)
            first = time.perf_counter() - t0
            break
        except oom:
            opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if micro >= b or b % (2 * micro):
                raise
            micro *= 2
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    flops = train_flops(cfg, g, n, p, r)
    peak, source = _peak_memory(torch, device)
    emit({"status": "ok", "side": "torch", "kind": "train", "model": model,
          "device": device, "torch_version": torch.__version__,
          "transformers_version": transformers.__version__, "adamw": flavour,
          "groups": g, "group_size": n, "P": p, "R": r, "samples": b, "micro_batches": micro,
          "tokens_unpacked": b * (p + r), "step_s": round(sec, 4),
          "first_call_s": round(first, 2), "tflops_per_s": round(flops / sec / 1e12, 3),
          "mfu": None if not peak_tflops else round(flops / sec / (peak_tflops * 1e12), 4),
          "peak_memory_bytes": peak, "peak_memory_source": source,
          "peak_memory_per_row_mb": None if peak is None else round(peak / b / 1e6, 2)})


def generate(emit, *, model: str, groups: int, group_size: int, prompt: int,
             response: int) -> None:
    """HF generate on the sampler part's prompts: tokens/s and ms per decode step."""
    mods = _torch_or_skip(emit, "generate")
    if mods is None:
        return
    torch, transformers = mods
    cfg, net, device = hf_model(torch, transformers, model, torch.bfloat16)
    net.eval()
    ids = torch.tensor(sampler_prompts(cfg.vocab_size, groups, prompt), device=device)

    def run():
        with torch.no_grad():
            out = net.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=response, min_new_tokens=response,
                               num_return_sequences=group_size, pad_token_id=0)
        _sync(torch, device)
        return out

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run()
    sec = time.perf_counter() - t0
    made = int(out.shape[0]) * (int(out.shape[1]) - prompt)
    emit({"status": "ok", "side": "torch", "kind": "generate", "model": model,
          "device": device, "torch_version": torch.__version__,
          "transformers_version": transformers.__version__, "groups": groups,
          "group_size": group_size, "P": prompt, "R": response, "tokens": made,
          "seconds": round(sec, 3), "first_call_seconds": round(first, 2),
          "tokens_per_s": round(made / sec, 1), "ms_per_step": round(1e3 * sec / response, 3)})
