"""Ray rollout workers on episodes that wait on tools: two worker processes against the
synchronous loop, at an emulated tool latency, side by side.

    python -m experiments.bench.ray_agentic [--latency lognormal:0.5,3] [--reps 2]
        [--steps 12] [--skip 4]

The task is experiments.bench.agentic_overlap's: rl.envs.guess_number (k=8, 4 model
turns; the tiny model from scratch, token-level), 64 episodes a step (8 prompts x 8),
every Episode.step behind rl.envs.latency's lognormal latency (p50 0.5 s, p99 3 s;
seeded). The sides, each a fresh run in this process:

  sync        the synchronous loop, tool calls on a pool of 64 threads while the other
              slots decode (the agentic issue's sync_concurrent)
  ray         2 Ray rollout workers, one request each, the deterministic schedule at η = 2
              (--async-backend ray --rollout-workers 2): steps v + 1 and v + 2 are sampled
              while the learner trains v
  ray_x2      2 workers sampling 2 requests each at once (--worker-requests 2), η = 4:
              4 steps in flight, the way a worker whose time is tool waits, not compute,
              is used

The rule, written before the runs: steps/hour = timed steps / their summed step_s, the
first --skip steps left out (they compile, and the Ray sides fill their pipeline: --skip
and the timed count are multiples of the 4 requests ray_x2 has in flight, so the window
holds whole pipeline rounds); the sides alternate (the order flipped every rep) and the
median rep is reported. Headline: ray_x2 / sync, target 3.0 (the Ray issue's "with the
agentic issue's tool latency (p50 0.5 s): >= 3x sync with 2 workers"); ray / sync beside
it (with one request per worker, two steps in flight bound it by about 2x). Also the
tool wait share, tool calls in flight and slot occupancy the workers' engines report, and
the version lag. Writes experiments/results/bench_ray_agentic.json, .png and
docs/results/ray-agentic.md with its README and index rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from experiments.common.benchmarking import load_average, machine, results_path, write_results
from experiments.common.docs_rows import add_docs_only_flag, docs_from_json, write_page_and_rows

RESULT = results_path(__file__)
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/results/ray-agentic.md"
README, INDEX = ROOT / "README.md", ROOT / "docs/results/index.md"
TITLE, ROW_AFTER = "Ray workers on tool latency", "Ray rollout workers"
SIDES = {"sync": None, "ray": (2, 1, 2), "ray_x2": (2, 2, 4)}  # (workers, requests each, η)
ENGINE_KEYS = ("tool_wait_share", "tool_calls_in_flight", "slot_occupancy",
               "episode_turns", "version_lag_mean")


def side_config(side: str, args: argparse.Namespace, run_dir: str):
    """The RunConfig of one side (module doc)."""
    from rl.learner import OptimizerConfig, TrainConfig
    from rl.loops import AsyncConfig, LoopConfig, RolloutOptions
    from rl.objectives import LossConfig
    from rl.run import LoggingConfig, RunConfig, TaskSpec

    ray = SIDES[side]
    acfg = None if ray is None else AsyncConfig(
        max_staleness=ray[2], mode="deterministic", backend="ray", rollout_workers=ray[0],
        worker_requests=ray[1])
    return RunConfig(
        task=TaskSpec("env:guess_number", {"k": 8, "max_turns": 4}),
        train=TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                          optimizer=OptimizerConfig(name="adamw", learning_rate=1e-3)),
        rollout=RolloutOptions(segment_len=1),
        loop=LoopConfig(steps=args.steps, prompts_per_step=8, group_size=8, eval_every=0,
                        eval_prompts=1, save_every=0, max_concurrent_tool_calls=64,
                        tool_latency=args.latency),
        asynchronous=acfg, run_dir=run_dir, logging=LoggingConfig(progress=False,
                                                                  wandb="disabled"))


def run_side(side: str, args: argparse.Namespace) -> dict:
    import rl.loops
    from models.config import get_config
    from models.decoder import init_params
    from rl.run import make_task

    with tempfile.TemporaryDirectory() as tmp:
        cfg = side_config(side, args, tmp)
        task = make_task(cfg.task, seed=cfg.loop.seed)
        model = get_config("tiny", vocab_size=task.vocab_size)
        res = rl.loops.run(model, init_params(model, 0), task, cfg)
    timed = res.train[args.skip:]
    window = sum(r["step_s"] for r in timed)
    out = {"side": side, "timed_steps": len(timed), "steps_per_hour": 3600.0 * len(timed) / window,
           "step_s": [r["step_s"] for r in res.train], "load_average": load_average(),
           "reward_mean": statistics.fmean(r["reward_mean"] for r in res.train)}
    for k in ENGINE_KEYS:
        vals = [r[k] for r in timed if k in r]
        if vals:
            out[k] = statistics.fmean(vals)
    if SIDES[side] is not None:
        last = res.train[-1]
        out.update(worker_restarts=last["ray_worker_restarts"],
                   sync_s_per_step=last["ray_sync_s"] / len(res.train))
    return out


def measure(args) -> dict:
    reps = []
    for rep in range(args.reps):
        order = list(SIDES) if rep % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            r = run_side(side, args)
            r["rep"] = rep
            reps.append(r)
            print(f"rep {rep} {side}: {r['steps_per_hour']:.0f} steps/h", flush=True)
    median = {}
    for side in SIDES:
        runs = sorted((r for r in reps if r["side"] == side), key=lambda r: r["steps_per_hour"])
        median[side] = runs[len(runs) // 2]
    sph = {s: m["steps_per_hour"] for s, m in median.items()}
    return {"reps": reps, "median": median,
            "ratios": {s: sph[s] / sph["sync"] for s in SIDES if s != "sync"}}


def plot(result: dict, path: Path) -> None:
    from experiments.common.plots import plt, save_png

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, side in enumerate(SIDES):
        vals = [r["steps_per_hour"] for r in result["reps"] if r["side"] == side]
        ax.bar(i, result["median"][side]["steps_per_hour"],
               color=("gray", "tab:green", "tab:olive")[i])
        ax.plot([i] * len(vals), vals, "k.")
    ax.set_xticks(range(len(SIDES)), list(SIDES))
    ax.set_ylabel("steps / hour")
    ax.set_title(f"guess_number, tool latency {result['config']['latency']}")
    save_png(fig, path)


def summary_row(result: dict, link: str, index: bool = False) -> str:
    h, r = result["headline"], result["ratios"]
    text = (f"| [{TITLE}]({link}) | 2 Ray rollout workers on episodes whose every tool call "
            f"waits {result['config']['latency']} s, steps/hour against the synchronous loop "
            f"(concurrent tool calls): {r['ray_x2']:.2f}× (2 requests a worker, η = 4), "
            f"{r['ray']:.2f}× (1 a worker, η = 2) |")
    if not index:
        return text
    return text + f" ≥ {h['target']:g}× | " + ("met |" if h["value"] >= h["target"] else "missed |")


def render_page(result: dict) -> str:
    """docs/results/ray-agentic.md, every number from the JSON."""
    cfg, h = result["config"], result["headline"]
    rows = []
    for side, (label) in (("sync", "synchronous, 64 tool threads"),
                          ("ray", "2 workers × 1 request, η = 2"),
                          ("ray_x2", "2 workers × 2 requests, η = 4")):
        m = result["median"][side]
        each = ", ".join(f"{r['steps_per_hour']:.0f}" for r in result["reps"] if r["side"] == side)
        eng = ", ".join(f"{k} {m[k]:.2f}" for k in ENGINE_KEYS if k in m)
        rows.append(f"| {side} | {label} | {m['steps_per_hour']:.0f} | {each} | {eng} |")
    verdict = "met" if h["value"] >= h["target"] else "missed"
    ratios = result["ratios"]
    return f"""# Ray rollout workers on tool latency

<!-- generated by `python -m experiments.bench.ray_agentic` from
experiments/results/bench_ray_agentic.json; do not edit by hand -->

guess_number episodes (64 a step, 4 model turns, the tiny model), every environment step
behind an emulated tool latency `{cfg['latency']}` (p50, p99 seconds; seeded), trained by the
synchronous loop (tool calls on 64 threads while the other slots decode) and by Ray rollout
workers on the deterministic schedule. {cfg['steps']} steps a run, the first {cfg['skip']}
left out (compiling and filling the pipeline), {cfg['reps']} reps, the sides alternating,
the median rep shown. Machine: {h['machine']}.

| side | what | steps / hour (median) | each rep | engine and lag (timed steps) |
|---|---|---|---|---|
{chr(10).join(rows)}

Ray / sync: {ratios['ray_x2']:.2f}× with 2 requests a worker, {ratios['ray']:.2f}× with one
(target ≥ {h['target']:g}× with 2 workers: {verdict}).

Reading it. A synchronous step waits for its slowest episode's four tool calls while the
learner idles; a Ray worker's episodes wait the same, but other steps are sampled
meanwhile: the speedup is bounded by the steps in flight (workers × requests each, at most
η), as long as the cores keep up with the decoding. The price is staleness: at η = 4 the
batch trained at step v was sampled by version v − 4 (the version lag column).

![steps per hour, sync and Ray on tool latency](../../experiments/results/bench_ray_agentic.png)

Command: `{result['command']}`.
"""


def write_docs(result: dict) -> None:
    write_page_and_rows(PAGE, render_page(result),
                        lambda link, index=False: summary_row(result, link, index=index),
                        TITLE, ROW_AFTER)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.ray_agentic",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--latency", default="lognormal:0.5,3")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULT)
    add_docs_only_flag(p)
    args = p.parse_args(argv)
    if args.docs_only:
        return docs_from_json(RESULT, write_docs)
    if args.skip % 4 or (args.steps - args.skip) % 4 or args.steps <= args.skip:
        raise SystemExit(f"--skip {args.skip} and --steps - --skip must be positive multiples "
                         "of 4 (the requests ray_x2 has in flight; module doc)")
    res = measure(args)
    result = {"headline": {"metric": "steps/hour, 2 Ray rollout workers x 2 requests (eta=4) / "
                                     f"the synchronous loop, guess_number at tool latency "
                                     f"{args.latency}",
                           "value": round(res["ratios"]["ray_x2"], 3), "target": 3.0,
                           "machine": machine()},
              **res, "config": {k: (str(v) if isinstance(v, Path) else v)
                                for k, v in vars(args).items() if k != "out"},
              "command": "python -m experiments.bench.ray_agentic " + " ".join(sys.argv[1:])}
    write_results(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    if args.out == RESULT:
        write_docs(result)
    print(json.dumps(result["headline"], indent=1))
    return result


if __name__ == "__main__":
    main()
