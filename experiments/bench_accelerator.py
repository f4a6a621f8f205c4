"""One command for an accelerator session: kernel correctness, kernel speed, sampler and
train-step throughput on whatever GPU / TPU is present.

    python -m experiments.bench_accelerator                   # every part (<= ~8 min, H100)
    python -m experiments.bench_accelerator --parts dualkv decode
    python -m experiments.bench_accelerator --smoke           # tiny shapes, interpret mode (CPU)

Parts (the platform's own kernels, impl=None: Triton on GPU, Mosaic on TPU; compiled,
interpret=False):
  correctness  shared-prefix attention forward + vjp and segment decode vs the references
               (bf16 and fp32, ragged lengths): max error (relative to max(1, |reference|)
               per output) and pass/fail.
  dualkv       DualKV fwd+bwd (vjp w.r.t. q/k/v) vs N copies of [prompt, response_n]
               through jax.nn.dot_product_attention (cudnn, xla) and jax's own Pallas flash
               attention (GPU: pallas.ops.gpu.attention.mha; TPU: ops.tpu.flash_attention),
               at (N, P, R) = (16, 4096, 1024), (28, 4096, 2048), (8, 2048, 512), bf16,
               32 query / 8 kv heads, head_dim 128. Copies are built before timing.
               Target: >= 1.65x the best baseline at (16, 4096, 1024).
  decode       one segment-decode step vs the replicated cache (models.attention
               decode_attention) at N = 64, P = 1024 and 8192, R = 256 (bf16, 32/8 heads,
               head_dim 128). Target: >= 2x at P = 1024.
  sampler      generate() tokens/s, smollm2-135m and qwen2.5-0.5b, random weights, bf16.
  train        train-step tokens/s (packed=True) and model FLOP utilisation (MFU) against
               the chip's bf16 dense peak (--peak-tflops overrides). Target: 40% (0.5B).
Baselines and sides are timed alternating (round-robin, median). Writes
experiments/results/accelerator_<device>.json (a headline: the DualKV speed-up) and prints
a table. On a CPU host it refuses unless --smoke (tiny shapes, Pallas interpret mode).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments.benchmarking import RESULTS_DIR, load_average, machine, time_calls, write_results
from kernels.segment_decode import segment_decode_attention
from kernels.shared_prefix_attention import shared_prefix_attention
from models.attention import decode_attention

PARTS = ("correctness", "dualkv", "decode", "sampler", "train")
# bf16 dense peak TFLOP/s by device kind (substring, lower case), for MFU
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "l4": 121.0, "v6": 918.0,
               "v5p": 459.0, "v5 lite": 197.0, "v5e": 197.0, "v4": 275.0}
FULL = dict(heads=32, kv_heads=8, head_dim=128, dualkv=((16, 4096, 1024), (28, 4096, 2048),
            (8, 2048, 512)), decode_n=64, decode_p=(1024, 8192), decode_r=256,
            models=("smollm2-135m", "qwen2.5-0.5b"), groups=8, group_size=8, prompt=256,
            response=256, seconds=1.0)
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, dualkv=((3, 40, 17),), decode_n=4,
             decode_p=(37,), decode_r=9, models=("tiny",), groups=2, group_size=2, prompt=6,
             response=5, seconds=0.05)


def _rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _max_err(a, b) -> float:
    """Largest |a - b| over the leaves, each relative to max(1, max |b|) of its leaf."""
    def err(x, y):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        return float(jnp.max(jnp.abs(x - y)) / jnp.maximum(1.0, jnp.max(jnp.abs(y))))
    return max(err(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- parts
def part_correctness(sz, impls) -> list[dict]:
    """Each kernel impl vs the reference, fwd+vjp (DualKV) and decode, bf16 and fp32."""
    rows = []
    g, n, p, r = 2, 3, 77, 45
    h, kvh, d = sz["heads"], sz["kv_heads"], sz["head_dim"]
    plen, rlen = jnp.array([p, 9]), jnp.array([[r, 0, 1], [17, r, 30]])
    for dtype, tol in (("float32", 2e-3), ("bfloat16", 6e-2)):
        ks = jax.random.split(jax.random.PRNGKey(1), 8)
        qkv = [_rand(ks[i], s, dtype) for i, s in enumerate(
            [(g, p, h, d), (g, p, kvh, d), (g, p, kvh, d), (g, n, r, h, d), (g, n, r, kvh, d),
             (g, n, r, kvh, d)])]
        cts = (_rand(ks[6], (g, p, h, d), dtype), _rand(ks[7], (g, n, r, h, d), dtype))

        def spa(impl, interpret):
            def fwd_vjp(*a):
                out, vjp = jax.vjp(lambda *x: shared_prefix_attention(
                    *x, prompt_lengths=plen, resp_lengths=rlen, impl=impl,
                    interpret=interpret), *a)
                return out, vjp(cts)
            return jax.jit(fwd_vjp)(*qkv)

        def dec(impl, interpret):
            q = qkv[3][:, :, 0]
            return jax.jit(lambda *a: segment_decode_attention(
                *a, prompt_lengths=plen, resp_lengths=rlen, impl=impl, interpret=interpret))(
                q, qkv[1], qkv[2], qkv[4], qkv[5])

        ref_spa, ref_dec = spa("reference", None), dec("reference", None)
        for impl, interpret in impls:
            for kernel, got, want in (("shared_prefix fwd+vjp", spa(impl, interpret), ref_spa),
                                      ("segment_decode", dec(impl, interpret), ref_dec)):
                err = _max_err(got, want)
                rows.append({"kernel": kernel, "impl": impl or "default", "dtype": dtype,
                             "max_rel_err": err, "tol": tol, "ok": err <= tol})
    return rows


def _n_copies(qp, kp, vp, qr, kr, vr):
    """[1, P, h, d] + [1, N, R, h, d] -> [N, P + R, h, d] (the naive batch)."""
    n = qr.shape[1]

    def cat(a, b):
        return jnp.concatenate([jnp.broadcast_to(a, (n,) + a.shape[1:]), b[0]], axis=1)
    return cat(qp, qr), cat(kp, kr), cat(vp, vr)


def _baselines(platform: str, kvh: int, h: int):
    def sdpa(kind):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation=kind)
    out = {"copies_xla": sdpa("xla")}
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu.attention import mha
        out["copies_cudnn"] = sdpa("cudnn")
        out["copies_pallas_flash"] = lambda q, k, v: mha(
            q, jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2), None,
            sm_scale=1 / math.sqrt(q.shape[-1]), causal=True)
    elif platform == "tpu":
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

        def tpu_flash(q, k, v):
            t = lambda x: jnp.repeat(x, h // x.shape[2], axis=2).transpose(0, 2, 1, 3)  # noqa
            return flash_attention(t(q), t(k), t(v), causal=True,
                                   sm_scale=1 / math.sqrt(q.shape[-1])).transpose(0, 2, 1, 3)
        out["copies_pallas_flash"] = tpu_flash
    return out


def _fwd_bwd(fn, args, cts):
    def run(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(cts)
    compiled = jax.jit(run).lower(*args).compile()
    return lambda: compiled(*args)


def part_dualkv(sz, platform: str, kernel_impl) -> list[dict]:
    h, kvh, d = sz["heads"], sz["kv_heads"], sz["head_dim"]
    rows = []
    for n, p, r in tqdm(sz["dualkv"], desc="dualkv shapes", leave=False):
        ks = jax.random.split(jax.random.PRNGKey(n), 8)
        dt = jnp.bfloat16
        packed = [_rand(ks[i], s, dt) for i, s in enumerate(
            [(1, p, h, d), (1, p, kvh, d), (1, p, kvh, d), (1, n, r, h, d), (1, n, r, kvh, d),
             (1, n, r, kvh, d)])]
        cts_packed = (_rand(ks[6], (1, p, h, d), dt), _rand(ks[7], (1, n, r, h, d), dt))
        copies = _n_copies(*packed)
        cts_copies = _rand(ks[6], copies[0].shape, dt)
        calls, errors = {}, {}
        calls["dualkv"] = _fwd_bwd(lambda *a: shared_prefix_attention(
            *a, impl=kernel_impl[0], interpret=kernel_impl[1]), packed, cts_packed)
        for name, fn in _baselines(platform, kvh, h).items():
            try:
                calls[name] = _fwd_bwd(fn, copies, cts_copies)
                jax.block_until_ready(calls[name]())
            except Exception as e:  # a baseline this chip / jax cannot run: recorded
                calls.pop(name, None)
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
        ms = time_calls(calls, sz["seconds"], min_reps=3)
        best = min((v, k) for k, v in ms.items() if k != "dualkv")
        rows.append({"N": n, "P": p, "R": r, "ms": {k: round(v, 3) for k, v in ms.items()},
                     "best_baseline": best[1], "speedup": round(best[0] / ms["dualkv"], 3),
                     "errors": errors})
    return rows


def part_decode(sz, kernel_impl) -> list[dict]:
    h, kvh, d, n, r = sz["heads"], sz["kv_heads"], sz["head_dim"], sz["decode_n"], sz["decode_r"]
    rows = []
    for p in sz["decode_p"]:
        ks = jax.random.split(jax.random.PRNGKey(p), 7)
        dt = jnp.bfloat16
        q = _rand(ks[0], (1, n, h, d), dt)
        kp, vp = _rand(ks[1], (1, p, kvh, d), dt), _rand(ks[2], (1, p, kvh, d), dt)
        kr, vr = _rand(ks[3], (1, n, r, kvh, d), dt), _rand(ks[4], (1, n, r, kvh, d), dt)
        kn, vn = _rand(ks[5], (1, n, kvh, d), dt), _rand(ks[6], (1, n, kvh, d), dt)
        plen = jnp.array([p], jnp.int32)
        rlen = jnp.full((1, n), r, jnp.int32)
        seg = jax.jit(lambda *a: segment_decode_attention(
            *a, prompt_lengths=plen, resp_lengths=rlen, k_new=kn, v_new=vn,
            impl=kernel_impl[0], interpret=kernel_impl[1]))
        k_rep = jnp.concatenate([jnp.broadcast_to(kp, (n, p, kvh, d)), kr[0]], axis=1)
        v_rep = jnp.concatenate([jnp.broadcast_to(vp, (n, p, kvh, d)), vr[0]], axis=1)
        rep = jax.jit(lambda q, k, v: decode_attention(
            q, k, v, jnp.full((n,), p + r, jnp.int32), kn[0], vn[0], impl="xla"))
        a, b = seg(q, kp, vp, kr, vr), rep(q[0][:, None], k_rep, v_rep)
        err = _max_err(a[0], b[:, 0])
        ms = time_calls({"segment": lambda: seg(q, kp, vp, kr, vr),
                         "replicated": lambda: rep(q[0][:, None], k_rep, v_rep)},
                        sz["seconds"], min_reps=5)
        rows.append({"N": n, "P": p, "R": r, "ms": {k: round(v, 4) for k, v in ms.items()},
                     "speedup": round(ms["replicated"] / ms["segment"], 3),
                     "max_abs_diff": err})
    return rows


def _model(name: str, param_dtype: str):
    from models.config import get_config
    from models.decoder import init_params
    cfg = get_config(name, dtype="bfloat16", param_dtype=param_dtype)
    return cfg, init_params(cfg, 0)


def part_sampler(sz, attn_impl) -> list[dict]:
    from rl.rollout import generate
    rows = []
    for name in sz["models"]:
        cfg, params = _model(name, "bfloat16")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg.vocab_size, sz["prompt"]).tolist()
                   for _ in range(sz["groups"])]

        def run():
            return generate(params, cfg, prompts, max_new_tokens=sz["response"], stop_ids=(),
                            num_samples=sz["group_size"], attn_impl=attn_impl)
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = run()
        sec = time.perf_counter() - t0
        tokens = sum(len(t) for group in res.tokens for t in group)
        rows.append({"model": name, "tokens": tokens, "seconds": round(sec, 3),
                     "first_call_seconds": round(first, 1), "tokens_per_s": round(tokens / sec, 1)})
    return rows


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


def part_train(sz, attn_impl, peak_tflops) -> list[dict]:
    from rl.learner import TrainConfig, batch_from_trajectory, init_train_state, make_train_step
    from rl.trajectory import Trajectory
    rows = []
    g, n, p, r = sz["groups"], sz["group_size"], sz["prompt"], sz["response"]
    b = g * n
    for name in sz["models"]:
        cfg, params = _model(name, "float32")
        rng = np.random.default_rng(0)
        traj = Trajectory.create(
            prompt_ids=np.repeat(rng.integers(3, cfg.vocab_size, (g, p)), n, axis=0),
            prompt_lengths=np.full(b, p), response_ids=rng.integers(3, cfg.vocab_size, (b, r)),
            response_mask=np.ones((b, r), bool), behaviour_logprobs=-np.ones((b, r)),
            versions=np.zeros((b, r)), group_ids=np.repeat(np.arange(g), n),
            finished=np.ones(b, bool), truncated=np.zeros(b, bool),
            rewards={"r": rng.normal(size=b)})
        config = TrainConfig(packed=True, attn_impl=attn_impl)
        batch = batch_from_trajectory(traj, group_size=n, model_config=cfg, packed=True)
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
        rows.append({"model": name, "tokens": g * (p + n * r), "step_s": round(sec, 4),
                     "first_call_s": round(first, 1),
                     "tokens_per_s": round(g * (p + n * r) / sec, 1),
                     "tflops_per_s": round(flops / sec / 1e12, 3),
                     "mfu": None if mfu is None else round(mfu, 4)})
    return rows


# ----------------------------------------------------------------------------- main
def device_name() -> str:
    dev = jax.devices()[0]
    return re.sub(r"[^a-z0-9]+", "_", f"{dev.platform} {dev.device_kind}".lower()).strip("_")


def peak_for(kind: str) -> float | None:
    kind = kind.lower()
    return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


def print_table(result: dict) -> None:
    for row in result.get("correctness", []):
        print(f"correctness {row['kernel']:24s} {row['impl']:14s} {row['dtype']:9s} "
              f"err {row['max_rel_err']:.2e} (tol {row['tol']:.0e}) "
              f"{'ok' if row['ok'] else 'FAIL'}")
    for row in result.get("dualkv", []):
        times = "  ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items())
        print(f"dualkv N={row['N']} P={row['P']} R={row['R']}: {times}  "
              f"speed-up {row['speedup']:.2f}x vs {row['best_baseline']}")
    for row in result.get("decode", []):
        print(f"decode N={row['N']} P={row['P']} R={row['R']}: segment "
              f"{row['ms']['segment']:.3f} ms, replicated {row['ms']['replicated']:.3f} ms, "
              f"speed-up {row['speedup']:.2f}x")
    for row in result.get("sampler", []):
        print(f"sampler {row['model']:14s} {row['tokens_per_s']:10.0f} tokens/s")
    for row in result.get("train", []):
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        print(f"train   {row['model']:14s} {row['tokens_per_s']:10.0f} tokens/s  "
              f"{row['tflops_per_s']:.1f} TFLOP/s  MFU {mfu}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; on CPU the Pallas kernels run in interpret mode")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bf16 dense peak for MFU (default: from the device kind)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    platform = jax.default_backend()
    if platform == "cpu" and not args.smoke:
        sys.exit("bench_accelerator: no accelerator here (jax.default_backend() is 'cpu'). "
                 "Run it on a GPU or TPU host, or pass --smoke for the tiny interpret-mode "
                 "version (a test, not a measurement).")
    sz = SMOKE if args.smoke else FULL
    if platform == "cpu":   # smoke: both kernel families interpreted; models stay on XLA
        impls = [("pallas_triton", True), ("pallas_mosaic", True)]
        kernel_impl, attn_impl = ("pallas_triton", True), None
    else:
        impls, kernel_impl, attn_impl = [(None, False)], (None, False), None
    kind = jax.devices()[0].device_kind
    peak = args.peak_tflops or peak_for(kind)
    result = {"device": kind, "machine": machine(), "smoke": args.smoke,
              "load_average_start": load_average(), "peak_tflops": peak}
    start = time.perf_counter()
    for part in tqdm(args.parts, desc="bench_accelerator"):
        t0 = time.perf_counter()
        if part == "correctness":
            result[part] = part_correctness(sz, impls)
        elif part == "dualkv":
            result[part] = part_dualkv(sz, platform, kernel_impl)
        elif part == "decode":
            result[part] = part_decode(sz, kernel_impl)
        elif part == "sampler":
            result[part] = part_sampler(sz, attn_impl)
        else:
            result[part] = part_train(sz, attn_impl, peak)
        result.setdefault("part_seconds", {})[part] = round(time.perf_counter() - t0, 1)
    result["total_seconds"] = round(time.perf_counter() - start, 1)
    result["load_average_end"] = load_average()
    first = (result.get("dualkv") or [{}])[0]
    result["headline"] = {
        "metric": f"DualKV fwd+bwd speed-up vs best N-copies baseline at "
                  f"(N,P,R)=({first.get('N')},{first.get('P')},{first.get('R')})",
        "value": float(first.get("speedup", 0.0)), "target": 1.65, "machine": machine()}
    print_table(result)
    name = f"accelerator_{'smoke_' if args.smoke else ''}{device_name()}.json"
    out = write_results(args.out or RESULTS_DIR / name, result)
    print(f"wrote {out} in {result['total_seconds']} s")
    return result


if __name__ == "__main__":
    main()
