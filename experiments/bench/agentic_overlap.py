"""Agentic overlap: a tiny policy on episodes whose every environment step waits an emulated
tool latency, trained three ways side by side.

    python -m experiments.bench.agentic_overlap [--latency lognormal:0.5,3] [--reps 2]
        [--steps 8] [--inline-steps 2] [--prompts 8] [--group-size 8] [--turns 4]

The task: rl.envs.guess_number (k=8, --turns model turns; the tiny model from scratch,
token-level), 64 episodes a step (8 prompts x 8), every Episode.step behind
rl.envs.latency's lognormal latency (p50 0.5 s, p99 3 s; seeded). The sides:

  sync_inline      the synchronous loop with max_concurrent_tool_calls = 0: every tool
                   call one after another on the rollout thread (today's main before the
                   agentic issue)
  sync_concurrent  the synchronous loop, tool calls on a pool of 64 threads while the
                   other slots decode
  async            the threaded asynchronous loop, continuous rollouts (free slots refilled
                   at every segment boundary), max staleness --eta (2), the same pool

Each side is a fresh run of `--steps` optimizer steps (sync_inline: --inline-steps, as its
steps take minutes); the first step compiles and is left out; steps/hour = 3600 / mean
step_s of the others. The sides run round-robin --reps times (sync_concurrent, async,
sync_inline, ...) so load from other processes hits them alike; the median rep is
reported. From the episode metrics of the timed steps: tool wait share of wall time, tool
calls in flight, slot occupancy (share of slot-time decoding) and slot_held (share holding
an unfinished episode), tokens/s while tools run. Writes
experiments/results/bench_agentic_overlap.json (headline: async / sync_inline steps/hour,
target 3.0; the async / sync_concurrent ratio, target 1.5, and occupancy, target 0.8,
beside it) and bench_agentic_overlap.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from experiments.common.benchmarking import load_average, machine, results_path, write_results

RESULT = results_path(__file__)
SIDES = ("sync_concurrent", "async", "sync_inline")
ENGINE_KEYS = ("tool_wait_share", "tool_calls_in_flight", "slot_occupancy", "slot_held",
               "tokens_per_s_tools_running", "episode_turns")


def side_config(side: str, args: argparse.Namespace, run_dir: str):
    from rl.learner import OptimizerConfig, TrainConfig
    from rl.loops import AsyncConfig, LoopConfig, RolloutOptions
    from rl.objectives import LossConfig
    from rl.run import LoggingConfig, RunConfig, TaskSpec

    steps = args.inline_steps if side == "sync_inline" else args.steps
    loop = LoopConfig(steps=steps, prompts_per_step=args.prompts, group_size=args.group_size,
                      eval_every=0, eval_prompts=1, seed=args.seed,
                      max_concurrent_tool_calls=0 if side == "sync_inline" else args.pool,
                      tool_latency=args.latency)
    return RunConfig(
        task=TaskSpec("env:guess_number", {"k": 8, "max_turns": args.turns}),
        train=TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                          optimizer=OptimizerConfig(name="adamw", learning_rate=1e-3)),
        rollout=RolloutOptions(segment_len=1), loop=loop,
        asynchronous=(AsyncConfig(max_staleness=args.eta, mode="threaded", rollout="continuous")
                      if side == "async" else None),
        run_dir=run_dir, logging=LoggingConfig(progress=False, wandb="disabled"))


def run_side(side: str, args: argparse.Namespace) -> dict:
    import rl.loops
    from models.config import get_config
    from models.decoder import init_params
    from rl.run import make_task

    with tempfile.TemporaryDirectory() as tmp:
        cfg = side_config(side, args, tmp)
        task = make_task(cfg.task, seed=cfg.loop.seed)
        model = get_config("tiny", vocab_size=task.vocab_size)
        t0 = time.perf_counter()
        res = rl.loops.run(model, init_params(model, 0), task, cfg)
        wall = time.perf_counter() - t0
    timed = res.train[1:]
    step_s = statistics.fmean(r["step_s"] for r in timed)
    engine = {k: statistics.fmean(r[k] for r in timed if k in r)
              for k in ENGINE_KEYS if any(k in r for r in timed)}
    return {"side": side, "steps": len(res.train), "timed_steps": len(timed),
            "steps_per_hour": 3600.0 / step_s, "step_s_mean": step_s,
            "step_s": [r["step_s"] for r in res.train], "wall_s": wall, **engine,
            "reward_mean": statistics.fmean(r["reward_mean"] for r in res.train),
            "load_average": load_average()}


def summarize(reps: list[dict]) -> dict:
    by_side = {s: sorted((r for r in reps if r["side"] == s), key=lambda r: r["steps_per_hour"])
               for s in SIDES}
    med = {s: rs[len(rs) // 2] for s, rs in by_side.items() if rs}
    sph = {s: r["steps_per_hour"] for s, r in med.items()}
    return {"median": med, "steps_per_hour": sph,
            "async_over_inline": sph["async"] / sph["sync_inline"],
            "async_over_concurrent": sph["async"] / sph["sync_concurrent"],
            "concurrent_over_inline": sph["sync_concurrent"] / sph["sync_inline"]}


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sph = summary["steps_per_hour"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.bar(list(sph), list(sph.values()), color=["#4c72b0", "#dd8452", "#8c8c8c"])
    a.set_ylabel("steps / hour")
    a.set_title("64 episodes x 4 turns, tool latency lognormal p50 0.5 s / p99 3 s", fontsize=9)
    occ = {s: summary["median"][s].get("slot_occupancy", 0) for s in sph}
    held = {s: summary["median"][s].get("slot_held", 0) for s in sph}
    x = range(len(occ))
    b.bar([i - 0.2 for i in x], list(occ.values()), 0.4, label="decoding")
    b.bar([i + 0.2 for i in x], list(held.values()), 0.4, label="holding an episode")
    b.set_xticks(list(x), list(occ))
    b.set_ylim(0, 1)
    b.set_ylabel("share of slot-time")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.agentic_overlap",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", default="lognormal:0.5,3")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--inline-steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--eta", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    reps = []
    for rep in range(args.reps):
        for side in args.sides:
            got = run_side(side, args)
            got["rep"] = rep
            reps.append(got)
            print(f"rep {rep} {side:16s} {got['steps_per_hour']:8.1f} steps/h "
                  f"(step {got['step_s_mean']:.2f} s; occupancy "
                  f"{got.get('slot_occupancy', 0):.2f}, held {got.get('slot_held', 0):.2f})",
                  flush=True)
    summary = summarize(reps)
    occupancy = summary["median"]["async"].get("slot_occupancy", 0.0)
    result = {
        "headline": {"metric": "async (eta=2) / sync_inline steps per hour, 64 episodes x 4 "
                               "turns, tool latency lognormal p50 0.5 s p99 3 s",
                     "value": summary["async_over_inline"], "target": 3.0, "machine": machine()},
        "async_over_concurrent": {"value": summary["async_over_concurrent"], "target": 1.5},
        "async_slot_occupancy": {"value": occupancy, "target": 0.8},
        "concurrent_over_inline": summary["concurrent_over_inline"],
        "steps_per_hour": summary["steps_per_hour"], "median_reps": summary["median"],
        "reps": reps, "config": {k: (str(v) if isinstance(v, Path) else v)
                                 for k, v in vars(args).items()},
    }
    write_results(args.out, result)
    plot(summary, args.out.with_suffix(".png"))
    print(f"async / inline {summary['async_over_inline']:.2f}x (target 3), async / concurrent "
          f"{summary['async_over_concurrent']:.2f}x (target 1.5), async occupancy "
          f"{occupancy:.2f} (target 0.8) -> {args.out}")
    return result


if __name__ == "__main__":
    main()
