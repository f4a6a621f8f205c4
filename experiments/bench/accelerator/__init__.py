"""The accelerator check: kernel correctness, kernel speed against the baselines, sampler and
train-step throughput, the tuning sweep; every part and baseline in its own process under
one time budget, every row written the moment it exists.

    python -m experiments.bench.accelerator                        # default parts, <= 8 min (H100)
    python -m experiments.bench.accelerator --parts dualkv --budget 200
    python -m experiments.bench.accelerator --parts tune --budget 300   # writes the tuned table
    python -m experiments.bench.accelerator --smoke                # tiny shapes on CPU (CI)
    python -m experiments.bench.accelerator --parts spa_kernel decode_kernel   # CPU micro
    python -m experiments.bench.accelerator --speed                # issue 33's speed check
    python -m experiments.bench.accelerator --speed --smoke        # the same, tiny, on CPU

Parts (GPU/TPU: the platform's kernels compiled; --smoke on CPU: Pallas in interpret mode):
  correctness  shared-prefix fwd+vjp of every impl (default, split_cudnn, pallas_triton,
               split_xla), segment decode, the Triton tree decode kernel (LATR's
               tree of segments) and the training tree attention's fwd+vjp (a packed
               tree of forking responses) vs the references, bf16 and fp32, head_dim
               64 and 128, ragged lengths: max error relative to max(1, |reference|).
  dualkv       fwd+bwd at (N, P, R) = (16, 4096, 1024) and (8, 2048, 512), bf16, 32 / 8
               heads, head_dim 128: cuDNN on N copies FIRST, then ours (default = split
               design on cuDNN), the Triton kernel, and the other N-copies baselines (XLA,
               jax's Pallas flash); a baseline whose memory estimate exceeds the device is
               skipped with the reason. Target >= 2.0x cuDNN on copies at (16, 4096, 1024).
  decode       one segment-decode step vs the replicated cache, N = 64, P = 1024 / 8192.
  train        train step (packed; default and Triton attention; unpacked) tokens/s, MFU;
               on a GPU first the model-path rows (the smallest model, packed and
               unpacked, at the long shape of issue 32's target).
  sampler      generate() tokens/s, random weights.
  tune         per-launch Triton configs and split knobs (tune.py); writes
               kernels/shared_prefix_attention/tuned/<device>.json (--tuned-dir).
  spa_kernel, decode_kernel   the CPU micro-benchmarks (micro.py); they rewrite
               experiments/results/bench_spa_kernel.json / bench_segment_decode_kernel.json.
--speed (parts decode_step, train, torch, sampler; speed.py plans them, model by model):
  decode_step  ms per decode step of the sampler's on-device loop, bytes read per step, the
               copy bandwidth measured in the same process and the roofline share, both
               layer loops, 64 and 256 rows (decode_parts.py).
  train        as above, plus peak device memory per row, each remat policy and the head
               chunk sized for the device.
  torch        the HF transformers + torch train step and HF generate on the same samples
               (torch_parts.py; "skipped" rows where torch is absent); every Tandem row of
               the JSON gets its peer ratio (speed.peer_ratios).
  sampler      generate() with unrolled layers and bucketed slots, and with the scan.
  The first model's decode_step and packed train tasks add a "decode trace" / "train trace"
  row: one call under the jax profiler, summarized (trace.py: device busy share, idle gaps,
  kernels per step and per layer-step, the top kernels by time).
Output: experiments/results/accelerator_<device>.json (accelerator_smoke_<device>.json with
--smoke), rewritten after every task, with the rows, per-part lists and a "headline"
{metric, value, target, machine}; the same rows as JSON lines in the .jsonl beside it (or
--jsonl) as they come. Compile and run time are separate fields of every timed row.
Without an accelerator it refuses unless --smoke (or only the CPU micro parts are asked).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from experiments.bench.accelerator.runner import WORKER_FLAG, RowLog, run_task, run_tasks, worker_main
from experiments.bench.accelerator.speed import (
    SPEED_FULL,
    SPEED_PARTS,
    SPEED_SMOKE,
    peer_ratios,
    plan_speed_tasks,
    speed_headline,
)

PARTS = ("correctness", "dualkv", "decode", "train", "sampler", "tune", "spa_kernel",
         "decode_kernel", "decode_step", "torch")
DEFAULT_PARTS = ("correctness", "dualkv", "decode", "train", "sampler")
CPU_PARTS = ("spa_kernel", "decode_kernel")
DEFAULT_BUDGET_S = 420.0      # + process and probe overhead: inside 8 minutes on an H100
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
TUNED_DIR = Path(__file__).resolve().parents[2] / "kernels" / "shared_prefix_attention" / "tuned"
HEADLINE_SHAPE = (16, 4096, 1024)
HEADLINE_TARGET = 2.0
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "l4": 121.0, "v6": 918.0,
               "v5p": 459.0, "v5 lite": 197.0, "v5e": 197.0, "v4": 275.0}
KP, MP, TP, MICRO = ("experiments.bench.accelerator.kernel_parts", "experiments.bench.accelerator.model_parts",
                     "experiments.bench.accelerator.tune", "experiments.bench.accelerator.micro")

FULL = dict(heads=32, kv_heads=8, head_dim=128, dualkv=((16, 4096, 1024), (8, 2048, 512)),
            correctness_shape=(2, 3, 77, 45), decode_n=64, decode_p=(1024, 8192), decode_r=256,
            models=("smollm2-135m", "qwen2.5-0.5b"), train=(8, 8, 256, 256),
            train_long=(1, 16, 4096, 1024), sampler=(8, 8, 256, 256), seconds=1.0,
            tune_shape=(8, 2048, 512), tune_dims=(("float32", 128), ("bfloat16", 128)),
            spa_kernel=((4, 256, 64), (16, 256, 64), (16, 512, 32)),
            decode_kernel=dict(ns=[8, 64], ps=[256, 1024], r_max=64))
SMOKE = dict(heads=4, kv_heads=2, head_dim=16, dualkv=((3, 40, 17),),
             correctness_shape=(2, 3, 13, 7), decode_n=4, decode_p=(37,), decode_r=9,
             models=("tiny",), train=(2, 2, 6, 5), train_long=None, sampler=(2, 2, 6, 5),
             seconds=0.05, tune_shape=(2, 12, 6), tune_dims=(("float32", 16),),
             spa_kernel=((2, 16, 8),), decode_kernel=dict(ns=[2], ps=[16], r_max=8))


def device_name(platform: str, kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", f"{platform} {kind}".lower()).strip("_")


def peak_for(kind: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in kind.lower()), None)


def copies_memory_bytes(impl: str, n: int, p: int, r: int, heads: int, kv_heads: int,
                        head_dim: int) -> int:
    """Rough peak memory of an N-copies baseline's fwd+bwd: q/k/v/o/dO/dq/dk/dv in bf16,
    plus, for XLA, the [N, heads, L, L] fp32 scores and their three fwd/bwd companions."""
    length = p + r
    tensors = 2 * n * length * head_dim * (4 * heads + 4 * kv_heads)
    if impl == "copies_xla":
        tensors += 4 * 4 * n * heads * length * length
    return tensors


# ----------------------------------------------------------------------------- planning

def _task(part, item, fn, cap_s, **args):
    return {"part": part, "item": item, "fn": fn, "args": args, "cap_s": cap_s}


def plan_tasks(parts, sz, platform: str, memory: int | None, smoke: bool, peak,
               legacy: bool) -> tuple[list[dict], list[dict]]:
    """(tasks in priority order, rows for what is skipped before running)."""
    gpu, cpu = platform == "gpu", platform == "cpu"
    interp = True if cpu else None
    h, kvh, d, sec = sz["heads"], sz["kv_heads"], sz["head_dim"], sz["seconds"]
    tasks, skipped = [], []
    kind = "gpu" if gpu else ("cpu" if cpu else "tpu")
    # ours and the N-copies baselines; `first` run before everything else
    ours = {"gpu": ["default", "pallas_triton"], "cpu": ["split_xla", "pallas_triton"],
            "tpu": ["default"]}[kind]
    baselines = {"gpu": ["copies_cudnn", "copies_pallas_flash", "copies_xla"],
                 "cpu": ["copies_xla"], "tpu": ["copies_xla", "copies_pallas_flash"]}[kind]
    first = [baselines[0], ours[0]]
    dual = dict(heads=h, kv_heads=kvh, head_dim=d, seconds=sec)

    def dualkv_task(shape, impl):
        n, p, r = shape
        if impl.startswith("copies_") and memory:
            need = copies_memory_bytes(impl, n, p, r, h, kvh, d)
            if need > 0.9 * memory:
                skipped.append({"part": "dualkv", "item": f"{impl} {n},{p},{r}", "N": n, "P": p,
                                "R": r, "impl": impl, "status": "skipped",
                                "reason": f"memory estimate {need / 2**30:.0f} GiB exceeds 90% "
                                          f"of the device's {memory / 2**30:.0f} GiB"})
                return
        interp_here = interp if impl == "pallas_triton" else None
        tasks.append(_task("dualkv", f"{impl} {n},{p},{r}", f"{KP}:dualkv", 90 if gpu else 120,
                           n=n, p=p, r=r, impl=impl, interpret=interp_here, **dual))

    if "dualkv" in parts:   # the baseline that matters and ours, at every shape, first
        for shape in sz["dualkv"]:
            for impl in first:
                dualkv_task(shape, impl)
    if "correctness" in parts:
        impls = ([[None, False], ["split_cudnn", False],
                  ["split_cudnn", False, {"joint_prompt": True}], ["pallas_triton", False],
                  ["split_xla", False]] if gpu else
                 [["pallas_triton", True], ["pallas_mosaic", True], ["split_xla", None]]
                 if cpu else [[None, False], ["split_xla", False]])
        for dtype, tol in (("bfloat16", 6e-2), ("float32", 2e-3)):
            dims = [64, 128] if not smoke else [sz["head_dim"]]
            tasks.append(_task("correctness", dtype, f"{KP}:correctness", 150 if gpu else 300,
                               dtype=dtype, head_dims=dims, heads=h, kv_heads=kvh, impls=impls,
                               shape=list(sz["correctness_shape"]), tol=tol))
    if "dualkv" in parts:
        for shape in sz["dualkv"]:
            for impl in [x for x in ours if x not in first]:
                dualkv_task(shape, impl)
    if "decode" in parts:
        for p in sz["decode_p"]:
            tasks.append(_task("decode", f"P={p}", f"{KP}:decode", 60 if gpu else 120,
                               n=sz["decode_n"], p=p, r=sz["decode_r"], heads=h, kv_heads=kvh,
                               head_dim=d, interpret=interp, seconds=sec))
    if "train" in parts:
        if sz["train_long"] and gpu:   # the model-path target's shape, smallest model: first
            g, n, p, r = sz["train_long"]
            for packed in (True, False):
                tasks.append(_task("train", f"{sz['models'][0]} long {packed}", f"{MP}:train", 90,
                                   model=sz["models"][0], groups=g, group_size=n, prompt=p,
                                   response=r, packed=packed, attn_impl=None, peak_tflops=peak))
        g, n, p, r = sz["train"]
        for model in sz["models"]:
            modes = [(True, None), (True, "pallas_triton")] if gpu else [(True, None)]
            for packed, attn in modes + [(False, None)]:
                item = f"{model} {'packed' if packed else 'unpacked'} {attn or 'default'}"
                tasks.append(_task("train", item, f"{MP}:train", 90 if gpu else 240,
                                   model=model, groups=g, group_size=n, prompt=p, response=r,
                                   packed=packed, attn_impl=attn, peak_tflops=peak))
    if "dualkv" in parts:
        for shape in sz["dualkv"]:
            for impl in [x for x in baselines if x not in first]:
                dualkv_task(shape, impl)
    if "sampler" in parts:
        g, n, p, r = sz["sampler"]
        for model in sz["models"]:
            tasks.append(_task("sampler", model, f"{MP}:sampler", 90 if gpu else 240,
                               model=model, groups=g, group_size=n, prompt=p, response=r))
    if "tune" in parts:
        n, p, r = sz["tune_shape"]
        for dtype, head_dim in sz["tune_dims"]:
            launches = (("dkdv_prompt",) if smoke else
                        ("fwd_resp", "dq_resp", "dkdv_prompt", "fwd_prompt", "dkdv_resp",
                         "dq_prompt"))
            for launch in launches:
                tasks.append(_task("tune", f"triton {launch} {dtype} d={head_dim}",
                                   f"{TP}:tune_triton", 120 if gpu else 300, launch=launch, n=n,
                                   p=p, r=r, heads=h, kv_heads=kvh, head_dim=head_dim,
                                   dtype=dtype, seconds=min(sec, 0.3), interpret=interp,
                                   tol=2e-3 if dtype == "float32" else 6e-2, smoke=smoke))
        split_impl = "split_cudnn" if gpu else "split_xla"
        tasks.append(_task("tune", f"split {split_impl}", f"{TP}:tune_split", 60 if gpu else 120,
                           impl=split_impl, n=n, p=p, r=r, heads=h, kv_heads=kvh,
                           head_dim=sz["head_dim"], dtype="bfloat16", seconds=min(sec, 0.3)))
    if "spa_kernel" in parts:
        out = str(RESULTS_DIR / "bench_spa_kernel.json") if legacy else None
        tasks.append(_task("spa_kernel", "cpu micro", f"{MICRO}:spa_kernel", 900,
                           shapes=[list(s) for s in sz["spa_kernel"]],
                           seconds=sec, legacy_out=out))
    if "decode_kernel" in parts:
        out = str(RESULTS_DIR / "bench_segment_decode_kernel.json") if legacy else None
        tasks.append(_task("decode_kernel", "cpu micro", f"{MICRO}:decode_kernel", 600,
                           seconds=min(sec, 0.3), legacy_out=out, **sz["decode_kernel"]))
    return tasks, skipped


# ----------------------------------------------------------------------------- results

def headline(rows: list[dict], machine: str, smoke: bool) -> dict:
    """Speed-up of ours (default impl) over cuDNN on N copies at the headline shape (in
    --smoke: over XLA on copies at the smoke shape); 0.0 when either side is missing."""
    dual = [x for x in rows if x.get("part") == "dualkv" and x.get("status") == "ok"]
    shape = HEADLINE_SHAPE if not smoke else tuple(SMOKE["dualkv"][0])
    base_impl, ours = ("copies_cudnn", "default") if not smoke else ("copies_xla", "split_xla")

    def ms(impl):
        return next((x["ms"] for x in dual if x["impl"] == impl
                     and (x["N"], x["P"], x["R"]) == shape), None)
    base, mine = ms(base_impl), ms(ours)
    return {"metric": f"DualKV fwd+bwd speed-up, ours ({ours}) over {base_impl} on N copies "
                      f"at (N,P,R)={shape}, bf16, 32/8 heads, d=128",
            "value": round(base / mine, 3) if base and mine else 0.0,
            "target": HEADLINE_TARGET, "machine": machine}


def write_json(path: Path, probe: dict, rows: list[dict], args, started: float,
               done: bool) -> None:
    by_part: dict[str, list] = {}
    rows = peer_ratios(rows)  # the JSON's rows carry their torch peer's ratio
    for row in rows:
        by_part.setdefault(row.get("part", "?"), []).append(row)
    head = (speed_headline if args.speed else headline)(rows, probe.get("machine") or "?",
                                                         args.smoke)
    status: dict[str, int] = {}
    for row in rows:
        if row.get("part") != "probe":
            status[row.get("status", "?")] = status.get(row.get("status", "?"), 0) + 1
    result = {"device": probe.get("device_kind"), "platform": probe.get("platform"),
              "jax_version": probe.get("jax_version"), "machine": probe.get("machine"),
              "smoke": args.smoke, "speed": args.speed, "budget_s": args.budget,
              "parts": list(args.parts),
              # complete: the run reached its end AND every row ran (none skipped on budget
              # or memory, none failed or timed out): row_status counts them
              "complete": done and set(status) <= {"ok"}, "row_status": status,
              "total_seconds": round(time.perf_counter() - started, 1),
              "date": time.strftime("%Y-%m-%d"), "headline": head, **by_part, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(path)


def print_row(row: dict) -> None:
    keys = ("impl", "kernel", "dtype", "head_dim", "N", "P", "R", "model", "side", "kind",
            "launch", "layer_loop", "rows", "remat", "ms", "ms_per_step", "step_s", "compile_s",
            "max_rel_err", "ok", "speedup", "tokens_per_s", "mfu", "roofline_share",
            "copy_gb_per_s", "peak_memory_per_row_mb", "reason")
    text = " ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None)
    status = row.get("status", "?")
    err = f" error: {row['error'].splitlines()[0][:160]}" if row.get("error") else ""
    print(f"[{row.get('part')}] {row.get('item')}: {status} {text}{err}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS))
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for all tasks together (default %(default)s)")
    parser.add_argument("--speed", action="store_true",
                        help="issue 33's speed check: parts decode_step train torch sampler "
                             "(or those of --parts among them), planned model by model")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; on CPU the Pallas kernels run in interpret mode")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bf16 dense peak for MFU (default: from the device kind)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON path")
    parser.add_argument("--jsonl", type=Path, default=None,
                        help="JSON-lines path (default: the results path with .jsonl)")
    parser.add_argument("--tuned-dir", type=Path, default=None,
                        help="where --parts tune writes its table (default: the kernel's "
                             "tuned/ folder; with --smoke: nowhere unless given)")
    return parser


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == WORKER_FLAG:
        sys.exit(worker_main(argv[1], argv[argv.index("--worker-out") + 1]))
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.speed and {"decode_step", "torch"} & set(args.parts):
        parser.error("the parts decode_step and torch belong to the speed check: add --speed")
    if args.speed:
        explicit = "--parts" in argv
        args.parts = [x for x in args.parts if x in SPEED_PARTS] if explicit else list(SPEED_PARTS)
        if not args.parts:
            parser.error(f"--speed runs only the parts {SPEED_PARTS}")
    started = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    probe_rows = run_task({"part": "probe", "item": "device", "fn": f"{KP}:probe"}, 120, env)
    probe = probe_rows[0] if probe_rows and probe_rows[0].get("status") == "ok" else {}
    if not probe:
        if args.jsonl:
            failed = RowLog(args.jsonl)
            for row in probe_rows:
                failed.add(row)
        sys.exit(f"bench accelerator: the device probe failed: {probe_rows}")
    platform = probe["platform"]
    only_cpu_parts = all(p in CPU_PARTS for p in args.parts)
    if platform == "cpu" and not args.smoke and not only_cpu_parts:
        sys.exit("bench accelerator: no accelerator here (jax's platform is 'cpu'). Run it on "
                 "a GPU or TPU host, or pass --smoke for the tiny interpret-mode version (a "
                 "test, not a measurement).")
    sz = SMOKE if args.smoke else FULL
    name = f"accelerator_{'speed_' if args.speed else ''}{'smoke_' if args.smoke else ''}"
    name += device_name(platform, probe["device_kind"])
    out = args.out or RESULTS_DIR / f"{name}.json"
    jsonl = args.jsonl or out.with_suffix(".jsonl")
    peak = args.peak_tflops or peak_for(probe["device_kind"])
    log = RowLog(jsonl)

    def on_row(row):
        print_row(row)
        write_json(out, probe, log.rows, args, started, done=False)

    log.on_row = on_row
    log.add({**probe, "part": "probe", "item": "device"})
    if args.speed:
        tasks, skipped = plan_speed_tasks(args.parts, SPEED_SMOKE if args.smoke else SPEED_FULL,
                                          platform, peak), []
    else:
        tasks, skipped = plan_tasks(args.parts, sz, platform, probe.get("memory_bytes"),
                                    args.smoke, peak, legacy=not args.smoke)
    for row in skipped:
        log.add(row)
    run_tasks(tasks, args.budget, log, env)
    if "tune" in args.parts:
        _write_tuned_table(args, probe, log)
    write_json(out, probe, log.rows, args, started, done=True)
    result = json.loads(out.read_text())
    head = result["headline"]
    print(f"headline: {head['value']} (target {head['target']}): {head['metric']}")
    print(f"wrote {out} and {jsonl} in {result['total_seconds']} s")
    return result


def _write_tuned_table(args, probe: dict, log: RowLog) -> None:
    from experiments.bench.accelerator.tune import best_table, write_table
    directory = args.tuned_dir or (None if args.smoke else TUNED_DIR)
    rows = [x for x in log.rows if x.get("part") == "tune"]
    table = best_table(rows, probe["device_kind"], probe["jax_version"])
    if table is None or directory is None:
        why = "no candidate beat the defaults" if table is None else "--smoke without --tuned-dir"
        log.add({"part": "tune", "item": "table", "status": "skipped", "reason": why})
        return
    path = write_table(table, directory)
    log.add({"part": "tune", "item": "table", "status": "ok", "path": str(path),
             "entries": len(table["entries"])})

