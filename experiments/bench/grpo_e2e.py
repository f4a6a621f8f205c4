"""The whole GRPO step end to end on whatever device jax has: N steps of the synchronous
loop (rl.loops.run) with random weights of a real model config on a synthetic verifiable
task, reporting steps/hour, the step profile and peak device memory.

    python -m experiments.bench.grpo_e2e                          # smollm2-135m, 8 steps
    python -m experiments.bench.grpo_e2e --model qwen2.5-0.5b --steps 6 --layer-loop unrolled
    python -m experiments.bench.grpo_e2e --smoke                  # tiny, 3 steps, CPU (a test)
    python -m experiments.bench.grpo_e2e --async-staleness 4      # the threaded async loop
    python -m experiments.bench.grpo_e2e --steps 10 --trace-steps 2  # + host launches per step

Needs only jax, flax, optax, orbax-checkpoint, chex and numpy (no wandb, gguf,
reasoning-gym or math-verify: none is imported). The model: `--model` preset, random
weights (models.decoder.init_params), bf16 compute with fp32 master weights (--dtype).
The task (`LongReverseTask`): each prompt is BOS, `--prompt-len` - k - 2 filler tokens, k
symbols and SEP; every response runs its `--response-len` budget (no stop id, so each step
does the same work) and earns the fraction of its first k tokens that reverse the symbols.
The step is the library's: rollout engine (segmented KV, bounded decode; --layer-loop and
--bucket-slots are LoopConfig's decode options), rewards, packed learner (--remat), one
AdamW update, the vocabulary head's chunk sized for the device's memory (--head-chunk);
wandb disabled, evals of one prompt at the start and the end (outside the
steps), one checkpoint at the end (also outside). `--async-staleness K` runs the same
config through rl.loops.run_async in threaded mode at max staleness K (issue 35's time
dimension: steps/hour of async beside sync on one device, where rollout and learner
interleave on the one device's streams as jax dispatches them from two threads); its
records' phases are the learner thread's view (wait_s = time waiting on the producer).

Reported per step (rl.runtime.logging's step profile, every step after the first, which
compiles): step_s and its phases prefill, decode, reward, learner, host, transfer, other;
steps/hour = 3600 / mean step_s; the host + transfer + other share (issue 33's target:
< 5 % on a GPU); decode tokens/s; peak device memory (the device's peak_bytes_in_use after
the run, where jax reports it; the process's peak resident memory beside it).
`--trace-steps K` runs the K steps before the last under the jax profiler (left out of the
timing) and adds `trace`: the host's compiled-program launches per step by name
(experiments.common.trace.host_launches) and the device lanes' busy share and gaps.
Writes experiments/results/bench_grpo_e2e_<device>.json (--out); --smoke writes
bench_grpo_e2e_smoke_<device>.json. Headline: steps/hour.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.common.benchmarking import RESULTS_DIR, load_average, machine
from rl.runtime.logging import PHASES, atomic_write_json, peak_rss_mb
from rl.tasks.base import Prompt, check_count

BOS, SEP, FIRST_SYMBOL = 1, 3, 4
OVERHEAD = ("host_s", "transfer_s", "other_s")
HOST_SHARE_TARGET = 0.05


@dataclasses.dataclass(frozen=True)
class LongReverseTask:
    """A verifiable task with long prompts and responses for timing (any vocabulary of at
    least FIRST_SYMBOL + alphabet + 1 ids): prompt = [BOS] + filler + k symbols + [SEP]
    (prompt_len tokens), the answer is the symbols reversed; reward "correct" = fraction of
    the first k response tokens equal to it. Filler and symbols are seeded by (seed, split,
    index); the eval split uses its own stream."""

    prompt_len: int = 256
    response_len: int = 256
    k: int = 8
    alphabet: int = 16
    vocab_size: int = 256
    seed: int = 0
    name: str = "long-reverse"

    def __post_init__(self):
        check_count("LongReverseTask.k", self.k, 1)
        check_count("LongReverseTask.prompt_len", self.prompt_len, self.k + 2)
        check_count("LongReverseTask.response_len", self.response_len, self.k)
        check_count("LongReverseTask.vocab_size", self.vocab_size,
                    FIRST_SYMBOL + self.alphabet + 1)

    reward_names = ("correct",)
    stop_ids: tuple[int, ...] = ()

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self.response_len

    def _prompt(self, split: int, index: int) -> Prompt:
        rng = np.random.default_rng([self.seed, split, index])
        symbols = rng.integers(0, self.alphabet, self.k)
        filler = rng.integers(FIRST_SYMBOL + self.alphabet, self.vocab_size,
                              self.prompt_len - self.k - 2)
        ids = (BOS, *map(int, filler), *(FIRST_SYMBOL + int(s) for s in symbols), SEP)
        return Prompt(ids=ids, answer=tuple(int(s) for s in symbols[::-1]), index=index)

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        return [self._prompt(0, i) for i in range(check_count("start", start),
                                                  start + check_count("count", count))]

    def eval_prompts(self, count: int) -> list[Prompt]:
        return [self._prompt(1, i) for i in range(check_count("count", count))]

    def reward(self, prompt: Prompt, response: Sequence[int] | str) -> dict[str, float]:
        if isinstance(response, str):
            raise ValueError("LongReverseTask.reward takes response token ids, not text")
        want = [FIRST_SYMBOL + s for s in prompt.answer]
        got = [int(t) for t in response][:self.k]
        return {"correct": sum(int(a == b) for a, b in zip(got, want)) / self.k}

    def describe(self, prompt: Prompt, response: Sequence[int]) -> str:
        return f"reverse {prompt.answer[::-1]} -> {list(response)[:self.k]}"


def device_peak_bytes() -> int | None:
    """The default device's peak_bytes_in_use so far (None where jax does not report it)."""
    import jax
    try:
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - CPU devices may not report memory
        return None


def summarize(records: list[dict], tokens_per_step: int, staleness: int = 0) -> dict:
    """Steps/hour, per-phase means and shares and decode tokens/s of the steady state: the
    records after 2 + `staleness` (the compiling step, the up-to-K batches the async
    producer sampled ahead while it compiled, steps that take pre-made data, and one more),
    the figure that compares the async loop with the sync one; the mean over every step
    but the compiling one is reported apart (`all_timed_*`). ValueError with fewer than two
    steps; the steady figures fall back to all timed steps when no record is left (and
    `steady_steps` says 0)."""
    timed = records[1:]
    if not timed:
        raise ValueError("one step only: nothing to time after the compiling step; use "
                         "--steps >= 2")
    late = records[2 + staleness:]
    basis = late or timed

    def means(recs):
        return {k: statistics.fmean(float(r.get(k) or 0.0) for r in recs)
                for k in ("step_s", *PHASES, "other_s")}

    mean = means(basis)
    share = {k: mean[k] / mean["step_s"] for k in (*PHASES, "other_s")}
    return {"steps_timed": len(timed), "steady_steps": len(late),
            "steps_per_hour": 3600.0 / mean["step_s"],
            "all_timed_steps_per_hour": 3600.0 / means(timed)["step_s"],
            "first_step_s": float(records[0]["step_s"]), "phases_mean_s": mean,
            "phases_share": share, "host_transfer_other_share": sum(share[k] for k in OVERHEAD),
            "decode_tokens_per_s": tokens_per_step / mean["decode_s"] if mean["decode_s"] else None,
            "reward_mean_per_step": [float(r["reward_mean"]) for r in records]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.grpo_e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model preset (random weights)")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps (the first is not timed)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--segment-len", type=int, default=64, help="decode tokens per sampler call")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="compute dtype (params stay fp32)")
    p.add_argument("--remat", default=None, choices=("none", "dots", "full"))
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--head-chunk", default="device", choices=("device", "default"),
                   help="vocabulary-head chunk of the learner: sized for the device's memory "
                        "(models.logprobs.head_chunk_for_memory; a CPU gets the default) or "
                        "the default 1024 tokens")
    p.add_argument("--layer-loop", default="scan", choices=("scan", "unrolled"))
    p.add_argument("--bucket-slots", action="store_true")
    p.add_argument("--async-staleness", type=int, default=None, metavar="K",
                   help="run the threaded async loop (rl.loops.run_async) at max staleness K "
                        "instead of the synchronous loop")
    p.add_argument("--trace-steps", type=int, default=0, metavar="K",
                   help="run the K steps before the last under the jax profiler and report "
                        "the host's program launches per step (by name) and the device "
                        "lanes' busy share; those steps are left out of the timing")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 3 steps, 2 x 2 samples of 12 + 6 tokens (CPU test)")
    p.add_argument("--run-dir", help="the run's directory (default: a temp dir, removed)")
    p.add_argument("--out", help="results JSON (default experiments/results/"
                                 "bench_grpo_e2e[_smoke]_<device>.json)")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.model, args.prompts_per_step, args.group_size = "tiny", 2, 2
        args.prompt_len, args.response_len, args.segment_len = 12, 6, 4
        args.steps = min(args.steps, 3 + args.trace_steps)
    if args.steps < 2:
        build_parser().error("--steps must be >= 2 (the first step compiles and is not timed)")
    if args.trace_steps < 0 or (args.trace_steps and args.steps < args.trace_steps + 3):
        build_parser().error(f"--trace-steps {args.trace_steps} needs --steps >= "
                             f"{args.trace_steps + 3} (two untraced steps before the traced "
                             "ones and one after) and must be >= 0")
    import jax

    from models.config import get_config
    from models.decoder import init_params
    from models.logprobs import DEFAULT_CHUNK, head_chunk_for_memory
    from rl.learner.config import OptimizerConfig, TrainConfig
    from rl.loops import run, run_async
    from rl.loops.config import (LoggingConfig, LoopConfig, ModelSpec, RolloutOptions, RunConfig,
                                 RunHooks)
    from rl.objectives import AdvantageConfig, LossConfig

    cfg = get_config(args.model, dtype=args.dtype, param_dtype="float32")
    task = LongReverseTask(prompt_len=args.prompt_len, response_len=args.response_len,
                           k=4 if args.smoke else 8, alphabet=8 if args.smoke else 16,
                           vocab_size=cfg.vocab_size)
    dev = jax.devices()[0]
    try:
        limit = (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - CPU devices may not report memory
        limit = None
    chunk = (head_chunk_for_memory(cfg.vocab_size, limit) if args.head_chunk == "device"
             else DEFAULT_CHUNK)
    config = RunConfig(
        name="grpo-e2e", description="bench: the whole GRPO step, random weights",
        model=ModelSpec(args.model),
        train=TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                          advantage=AdvantageConfig("grpo"),
                          optimizer=OptimizerConfig(name="adamw", learning_rate=1e-5),
                          packed=True, remat=args.remat, micro_batches=args.micro_batches,
                          logprob_chunk=chunk),
        loop=LoopConfig(steps=args.steps, prompts_per_step=args.prompts_per_step,
                        group_size=args.group_size, eval_every=0, eval_prompts=1, save_every=0),
        rollout=RolloutOptions(segment_len=args.segment_len, layer_loop=args.layer_loop,
                               bucket_slots=args.bucket_slots),
        logging=LoggingConfig(wandb="disabled", progress=False))
    loop_fn = run
    if args.async_staleness is not None:
        config = config.overrides({"async.max_staleness": args.async_staleness,
                                   "async.mode": "threaded"})
        loop_fn = run_async
    load_before = load_average()
    tracer = StepTracer(args.steps - 1 - args.trace_steps, args.steps - 1) \
        if args.trace_steps else None
    with tempfile.TemporaryDirectory(prefix="grpo-e2e-") as tmp:
        run_dir = Path(args.run_dir or tmp)
        t0 = time.perf_counter()
        params = init_params(cfg, 0)
        result = loop_fn(cfg, params, task, config.override("run_dir", str(run_dir)),
                         hooks=RunHooks(on_step=tracer))
        wall = time.perf_counter() - t0
    tokens = args.prompts_per_step * args.group_size * args.response_len
    records = result.train if tracer is None else [
        r for r in result.train if not tracer.first < r["step"] <= tracer.last]
    summary = summarize(records, tokens, args.async_staleness or 0)
    peak = device_peak_bytes()
    rss = peak_rss_mb()
    device = re.sub(r"[^a-z0-9]+", "_", f"{dev.platform} {dev.device_kind}".lower()).strip("_")
    tag = "" if args.async_staleness is None else f"async{args.async_staleness}_"
    out = Path(args.out) if args.out else RESULTS_DIR / (
        f"bench_grpo_e2e_{'smoke_' if args.smoke else ''}{tag}{device}.json")
    loop_name = ("sync" if args.async_staleness is None
                 else f"threaded async, max staleness {args.async_staleness}")
    payload = {
        "headline": {"metric": f"steady-state GRPO steps/hour ({loop_name}), {args.model} random weights, "
                               f"{args.prompts_per_step}x{args.group_size}, "
                               f"P={args.prompt_len} R={args.response_len}",
                     "value": round(summary["steps_per_hour"], 1), "target": None,
                     "machine": machine()},
        "command": "python -m experiments.bench.grpo_e2e " + " ".join(argv),
        "device": dev.device_kind, "platform": dev.platform, "jax_version": jax.__version__,
        "date": time.strftime("%Y-%m-%d"), "args": vars(args),
        "tokens_per_step": tokens, "wall_s": round(wall, 1), "logprob_chunk": chunk,
        "peak_device_bytes": peak, "process_peak_rss_mb": rss,
        "host_transfer_other_target": HOST_SHARE_TARGET,
        "load_average_1_5_15min": {"before": load_before, "after": load_average()},
        **summary,
        "trace": None if tracer is None else tracer.summary(),
        "steps": [{k: r.get(k) for k in ("step", "step_s", *PHASES, "wait_s", "other_s",
                                         "version_lag_mean", "peak_rss_mb",
                                         "reward_mean", "tokens_per_s")} for r in result.train],
    }
    atomic_write_json(out, payload)
    print(format_summary(payload))
    print(f"wrote {out}")
    return payload


class StepTracer:
    """A RunHooks.on_step that runs the jax profiler from the end of step `first` to the
    end of step `last` (the steps first+1..last) and summarizes that trace: the host's
    program launches per step and the device lanes (experiments.common.trace). A profiler
    that fails (no CUPTI on a GPU image, no device lane in the trace) becomes an "error"
    entry of the summary, never a failed run: the timing is what the run is for."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self._dir = tempfile.TemporaryDirectory(prefix="grpo-e2e-trace-")
        self._result: dict = {"steps": list(range(first + 1, last + 1))}
        self._tracing = False

    def _failed(self, what: str, err: Exception) -> None:
        self._result.setdefault("errors", []).append(f"{what}: {type(err).__name__}: {err}"[:500])

    def __call__(self, record: dict) -> None:
        import jax
        if record["step"] == self.first:
            try:
                jax.profiler.start_trace(self._dir.name, create_perfetto_trace=True)
                self._tracing = True
            except Exception as err:  # noqa: BLE001 - see the class doc
                self._failed("start_trace", err)
        elif record["step"] == self.last and self._tracing:
            self._tracing = False
            try:
                jax.profiler.stop_trace()
                self._summarize()
            except Exception as err:  # noqa: BLE001 - see the class doc
                self._failed("stop_trace / reading the trace", err)
            finally:
                self._dir.cleanup()

    def _summarize(self) -> None:
        from experiments.common.trace import device_events, host_launches, read_perfetto
        from experiments.common.trace import summarize as device_summary
        trace, k = read_perfetto(Path(self._dir.name)), self.last - self.first
        self._result["host_launches"] = host_launches(trace, k)
        try:
            device = device_summary(device_events(trace), k)
            self._result["device"] = {key: device[key] for key in (
                "events_per_step", "window_us_per_step", "busy_us_per_step", "busy_share",
                "gaps")}
        except Exception as err:  # noqa: BLE001 - see the class doc
            self._failed("device lanes", err)

    def summary(self) -> dict:
        return self._result


def format_summary(p: dict) -> str:
    lines = [f"{p['headline']['metric']} on {p['device']}: {p['steps_per_hour']:.1f} steps/hour "
             f"({p['phases_mean_s']['step_s']:.3f} s/step over the last {p['steady_steps']} "
             f"steps; first {p['first_step_s']:.1f} s); over all {p['steps_timed']} timed steps "
             f"{p['all_timed_steps_per_hour']:.1f} steps/hour"]
    for k in (*PHASES, "other_s"):
        lines.append(f"  {k[:-2]:<9} {p['phases_mean_s'][k]:8.4f} s {100 * p['phases_share'][k]:5.1f} %")
    lines.append(f"  host + transfer + other {100 * p['host_transfer_other_share']:.1f} % "
                 f"(target < {100 * HOST_SHARE_TARGET:.0f} % on a GPU)")
    if p["decode_tokens_per_s"]:
        lines.append(f"  decode {p['decode_tokens_per_s']:.0f} tokens/s")
    if p.get("trace") and "host_launches" in p["trace"]:
        hl = p["trace"]["host_launches"]
        top = ", ".join(f"{d['name']} {d['per_step']:.1f}" for d in hl["by_name"][:6])
        lines.append(f"  traced steps {p['trace']['steps']}: {hl['per_step']:.1f} program "
                     f"launches per step from the host ({top})")
    for err in (p.get("trace") or {}).get("errors", []):
        lines.append(f"  trace not summarized: {err}")
    mem = p["peak_device_bytes"]
    lines.append(f"  peak device memory {'n/a' if mem is None else f'{mem / 1e9:.2f} GB'}; "
                 f"process peak resident {(p['process_peak_rss_mb'] or 0) / 1e3:.2f} GB")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
