"""Long prompts on SmolLM2-135M: one-shot prefill against chunked prefill.

    python -m experiments.bench_long_prefill                       # 1k, 4k, 8k tokens, chunk 512
    python -m experiments.bench_long_prefill --lengths 1024 --chunk 256 --time-cap 120

Each case (prompt length T, side) runs in its own subprocess (`--case T --side S`), so the
memory figure is that case's alone: the child loads the model, resets its resident
high-water mark (VmHWM, /proc/self/clear_refs), then runs what experiments.generate runs
for the first token: rl.rollout.prefill of a T-token prompt (batch 1) and one decode step,
"one-shot" with prefill_chunk=None (models.decoder.prefill over the whole prompt) and
"chunked" with prefill_chunk=C (models/chunked_prefill.py). It reports the time to first
token from a cold start (compilation included), the seconds jax spent compiling in it
(experiments.generate.compile_seconds) and the rest, the peak resident memory above the
loaded model (VmHWM after minus RSS before), the first token and its log-prob (both sides
must agree). Sides alternate (one-shot first at 1k, chunked first at 4k, ...) and run one
at a time. The parent kills a case that runs past --time-cap seconds or whose resident
memory passes --mem-cap GB and reports it as "did not finish within ...".

Writes experiments/results/bench_long_prefill.json: "headline" {"metric": "peak memory
one-shot / chunked at the longest T" (a case that did not finish counts with the cap,
so the ratio is then a lower bound), "value", "target": 4.0, "machine"} and the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from experiments.common.benchmarking import RESULTS_DIR, load_average, machine, write_results

ROOT = Path(__file__).resolve().parent.parent
RESULT = RESULTS_DIR / "bench_long_prefill.json"
LENGTHS = (1024, 4096, 8000)  # 8000 + the first token fits max_position_embeddings=8192
TARGET = 4.0  # peak memory one-shot / chunked at the longest prompt
TEXT = ("The committee met on a grey morning to discuss the budget for the coming year, "
        "the repairs to the old bridge, and the schedule of the spring festival. ")


# ----------------------------------------------------------------------------- the child
def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_case(length: int, side: str, chunk: int) -> dict[str, Any]:
    """One case in this process: prefill + first token of a `length`-token prompt."""
    import jax

    from experiments.generate import compile_seconds
    from models.assets import load_model
    from rl import rollout
    from rl.runtime.logging import peak_rss_mb, reset_peak_rss

    config, params, tok = load_model("smollm2-135m")
    ids = tok.encode(TEXT * (length // 20 + 1))[:length]
    if len(ids) != length:
        raise RuntimeError(f"the text gave {len(ids)} tokens, fewer than {length}")
    state = rollout.init_state(config, num_slots=1, max_prompt_len=length, max_new_tokens=1,
                               sampling=rollout.SamplingConfig(greedy=True),
                               prefill_chunk=None if side == "one-shot" else chunk)
    keys = rollout.sample_keys(0, [0], 1)
    jax.block_until_ready(params)
    base = _rss_mb()
    reset = reset_peak_rss()
    with compile_seconds() as compiled:
        t0 = time.perf_counter()
        live = jax.block_until_ready(rollout.prefill(params, state, [ids], [[0]], keys))
        t_prefill, c_prefill = time.perf_counter() - t0, compiled[0]
        live = jax.block_until_ready(rollout.decode_segment(params, live, 1, 0))
        ttft = time.perf_counter() - t0
    sample = rollout.read_slots(live, [0])[0]
    return {"tokens": length, "side": side, "chunk": None if side == "one-shot" else chunk,
            "ttft_s": ttft, "compile_s": compiled[0], "ttft_minus_compile_s": ttft - compiled[0],
            "prefill_s": t_prefill, "prefill_compile_s": c_prefill,
            "peak_rss_mb": peak_rss_mb(), "base_rss_mb": base,
            "peak_above_model_mb": peak_rss_mb() - base if reset else None,
            "first_token": int(sample.response_ids[0]), "logprob": float(sample.logprobs[0])}


# ----------------------------------------------------------------------------- the parent
def _child_rss_mb(pid: int) -> float:
    """Resident MB of a running child; 0.0 once it has exited (its /proc entry is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.readlines()
    except OSError:
        return 0.0
    rss = [int(line.split()[1]) for line in lines if line.startswith("VmRSS:")]
    return rss[0] * 1024 / 1e6 if rss else 0.0


def spawn_case(length: int, side: str, chunk: int, time_cap: float, mem_cap_gb: float
               ) -> dict[str, Any]:
    """Run one case in a subprocess, watching it: past time_cap seconds or mem_cap_gb GB
    resident it is killed and reported as not finished."""
    cmd = [sys.executable, "-m", "experiments.bench_long_prefill", "--case", str(length),
           "--side", side, "--chunk", str(chunk)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load_before = load_average()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed, max_rss = None, 0.0
    while proc.poll() is None:
        time.sleep(0.25)
        max_rss = max(max_rss, _child_rss_mb(proc.pid))
        if time.perf_counter() - t0 > time_cap:
            killed = f"did not finish within {time_cap:.0f} s"
        elif max_rss > mem_cap_gb * 1e3:
            killed = f"killed above {mem_cap_gb:.0f} GB resident"
        if killed:
            proc.kill()
            break
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    base = {"tokens": length, "side": side, "chunk": None if side == "one-shot" else chunk,
            "process_wall_s": wall, "watched_max_rss_mb": max_rss,
            "load_average_before": load_before, "load_average_after": load_average()}
    if killed:
        return {**base, "finished": False, "status": killed}
    if proc.returncode != 0:
        raise RuntimeError(f"case {length} {side} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return {**base, **json.loads(out.strip().splitlines()[-1]), "finished": True, "status": "ok"}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [(f"{'tokens':>7} {'side':>9} {'TTFT s':>8} {'compile s':>9} {'rest s':>7} "
              f"{'peak MB':>8} {'above model MB':>14} {'token':>6}")]
    for r in rows:
        if not r["finished"]:
            lines.append(f"{r['tokens']:>7} {r['side']:>9}  {r['status']} "
                         f"(resident {r['watched_max_rss_mb']:.0f} MB when stopped)")
            continue
        lines.append(f"{r['tokens']:>7} {r['side']:>9} {r['ttft_s']:>8.1f} {r['compile_s']:>9.1f} "
                     f"{r['ttft_minus_compile_s']:>7.1f} {r['peak_rss_mb']:>8.0f} "
                     f"{r['peak_above_model_mb'] or float('nan'):>14.0f} {r['first_token']:>6}")
    return "\n".join(lines)


def headline_ratio(rows: list[dict[str, Any]], length: int, mem_cap_gb: float
                   ) -> tuple[float, bool]:
    """Peak memory (above the model) one-shot / chunked at `length`; a one-shot case that
    did not finish counts with the largest resident size seen (a lower bound: flagged)."""
    one = next(r for r in rows if r["tokens"] == length and r["side"] == "one-shot")
    chk = next(r for r in rows if r["tokens"] == length and r["side"] == "chunked")
    if not chk["finished"]:
        raise RuntimeError(f"the chunked case at {length} tokens did not finish: {chk['status']}")
    if one["finished"]:
        return one["peak_above_model_mb"] / chk["peak_above_model_mb"], False
    return (one["watched_max_rss_mb"] - chk["base_rss_mb"]) / chk["peak_above_model_mb"], True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--time-cap", type=float, default=420.0, help="seconds per case")
    p.add_argument("--mem-cap", type=float, default=12.0, help="GB resident per case")
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # child: run one case
    p.add_argument("--side", choices=("one-shot", "chunked"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case is not None:
        print(json.dumps(run_case(args.case, args.side, args.chunk)))
        return {}
    plan = []
    for i, length in enumerate(args.lengths):
        sides = ("one-shot", "chunked") if i % 2 == 0 else ("chunked", "one-shot")
        plan += [(length, s) for s in sides]
    rows = []
    for length, side in tqdm(plan, desc="cases", unit="case"):
        rows.append(spawn_case(length, side, args.chunk, args.time_cap, args.mem_cap))
        tqdm.write(table(rows[-1:]).splitlines()[-1])
    longest = max(args.lengths)
    ratio, lower_bound = headline_ratio(rows, longest, args.mem_cap)
    for length in args.lengths:
        done = [r for r in rows if r["tokens"] == length and r["finished"]]
        if len(done) == 2 and done[0]["first_token"] != done[1]["first_token"]:
            raise RuntimeError(f"first tokens differ at {length} tokens: {done}")
    print(table(rows))
    result = {
        "headline": {"metric": f"peak memory above the model, one-shot / chunked prefill at "
                               f"{longest} tokens" + (" (lower bound)" if lower_bound else ""),
                     "value": round(ratio, 2), "target": TARGET, "machine": machine()},
        "chunk": args.chunk, "time_cap_s": args.time_cap, "mem_cap_gb": args.mem_cap,
        "rows": rows,
    }
    write_results(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
