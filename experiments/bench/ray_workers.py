"""Ray rollout workers against the synchronous loop on one machine, side by side.

    python -m experiments.bench.ray_workers [--configs rollout_heavy reverse32 default]
        [--reps 5] [--steps 12] [--eta 1]

Sides, each a fresh `experiments.train --preset tiny-synthetic` process:

  sync   the synchronous loop on every core of the machine
  ray    the learner pinned to core 0 (`taskset -c 0`), one Ray rollout worker pinned to
         core 1 (async.worker_affinity), the deterministic schedule at max staleness --eta
         (--async-backend ray): the worker samples step v + 1 while the learner trains v

Configs: "rollout_heavy" (reverse 128 symbols of an alphabet of 8, one prompt of 4
samples a step: 128-token responses and a small learner batch, the largest rollout share
of a synchronous step found on the tiny model; still under one half, see the page),
"reverse32" (reverse 32 symbols, the preset's 8 x 8 samples: the earlier "rollout_heavy",
where the learner takes two thirds of a step) and "default" (the preset's reverse-4
task). The first `--skip` steps compile and are left out; steps/hour = 3600 / mean step_s
of the others.

The ceiling. With a core each, a Ray step cannot be shorter than the longer of its two
phases: the learner's step on core 0 (train_s of the Ray side) and the worker's sampling
on core 1 (ray_sample_s). The page gives ceiling = sync step_s / max(the two), measured in
the same runs, beside the ratio: what perfect overlap would give on this machine.
The sides alternate (sync, ray, sync, ray, ... with the order flipped every rep) so load
from other processes hits both alike; the median rep is reported with each rep beside it.
Also: each side's phase shares (the record's *_s over step_s), the Ray side's version lag
and weight-sync bytes and seconds per step. Writes experiments/results/bench_ray_workers.json
(headline: ray / sync steps/hour on rollout_heavy, target 1.2), bench_ray_workers.png and
docs/results/ray-workers.md with its README and index rows.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.common.benchmarking import load_average, machine, results_path, write_results
from experiments.common.docs_rows import add_docs_only_flag, docs_from_json, write_page_and_rows
from experiments.common.seeds import read_metrics

RESULT = results_path(__file__)
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/results/ray-workers.md"
README, INDEX = ROOT / "README.md", ROOT / "docs/results/index.md"
TITLE, ROW_AFTER = "Ray rollout workers", "Agentic async learning"
CONFIGS = {
    "rollout_heavy": ["--task-option", "length=128", "--task-option", "alphabet=8",
                      "--set", "loop.prompts_per_step=1", "--set", "loop.group_size=4"],
    "reverse32": ["--task-option", "length=32", "--task-option", "alphabet=8"],
    "default": [],
}
PHASES = ("rollout_s", "wait_s", "train_s", "learner_s", "transfer_s", "host_s")


def side_command(side: str, config: str, run_dir: Path, args) -> list[str]:
    base = [sys.executable, "-m", "experiments.train", "--preset", "tiny-synthetic",
            "--run-dir", str(run_dir), "--steps", str(args.steps), "--eval-every", "0",
            "--set", "loop.save_every=0", "--no-progress", "--wandb", "disabled",
            *CONFIGS[config]]
    if side == "sync":
        return base
    return ["taskset", "-c", "0", *base, "--max-staleness", str(args.eta),
            "--async-mode", "deterministic", "--async-backend", "ray",
            "--set", "async.worker_affinity=[1]"]


def run_side(side: str, config: str, args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"ray_bench_{side}_"))
    try:
        subprocess.run(side_command(side, config, run_dir, args), check=True,
                       stdout=subprocess.DEVNULL)
        train, _ = read_metrics(run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    timed = train[args.skip:]
    step_s = statistics.fmean(r["step_s"] for r in timed)
    out = {"side": side, "config": config, "steps_per_hour": 3600.0 / step_s,
           "step_s": step_s, "reward_last": train[-1].get("reward_mean"),
           "shares": {p: statistics.fmean(r.get(p, 0.0) for r in timed) / step_s
                      for p in PHASES}}
    if side == "ray":
        last = train[-1]
        n = len(train)
        out.update(version_lag=last.get("version_lag_mean"),
                   learner_step_s=statistics.fmean(r["train_s"] for r in timed),
                   worker_sample_s=statistics.fmean(r["ray_sample_s"] for r in timed),
                   sync_bytes_per_step=last["ray_sync_bytes"] / n,
                   sync_s_per_step=last["ray_sync_s"] / n,
                   worker_restarts=last["ray_worker_restarts"])
    return out


def measure(args) -> dict:
    reps = []
    for config in args.configs:
        for rep in range(args.reps):
            order = ("sync", "ray") if rep % 2 == 0 else ("ray", "sync")
            for side in order:
                r = run_side(side, config, args)
                r["rep"], r["load_before"] = rep, load_average()
                reps.append(r)
                print(f"{config} {side} rep {rep}: {r['steps_per_hour']:.0f} steps/h", flush=True)
    summary = {}
    for config in args.configs:
        med = {}
        for side in ("sync", "ray"):
            runs = sorted((r for r in reps if r["config"] == config and r["side"] == side),
                          key=lambda r: r["steps_per_hour"])
            med[side] = runs[len(runs) // 2]
        pairs = paired_ratios([r for r in reps if r["config"] == config])
        summary[config] = {"median": med,
                           "ratio_of_medians": (med["ray"]["steps_per_hour"]
                                                / med["sync"]["steps_per_hour"]),
                           "paired": pairs, "ratio": statistics.median(pairs),
                           "ceiling": ceiling(med["sync"], med["ray"])}
    return {"reps": reps, "summary": summary}


def paired_ratios(runs: list[dict]) -> list[float]:
    """Ray / sync steps per hour of each rep's two runs (adjacent in time, so load from
    other processes hits both alike), in rep order."""
    by_rep: dict[int, dict] = {}
    for r in runs:
        by_rep.setdefault(r["rep"], {})[r["side"]] = r["steps_per_hour"]
    return [by_rep[k]["ray"] / by_rep[k]["sync"] for k in sorted(by_rep)]


def ceiling(sync: dict, ray: dict) -> float:
    """Ray / sync at perfect overlap: the sync step over the longer of the Ray side's two
    phases (the learner's step on its core, the worker's sampling on its own)."""
    return sync["step_s"] / max(ray["learner_step_s"], ray["worker_sample_s"])


def plot(result: dict, path: Path) -> None:
    from experiments.common.plots import plt, save_png

    configs = list(result["summary"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, config in enumerate(configs):
        for j, side in enumerate(("sync", "ray")):
            vals = [r["steps_per_hour"] for r in result["reps"]
                    if r["config"] == config and r["side"] == side]
            ax.bar(i * 3 + j, statistics.median(vals), color=("gray", "tab:green")[j],
                   label=side if i == 0 else None)
            ax.plot([i * 3 + j] * len(vals), vals, "k.")
    ax.set_xticks([i * 3 + 0.5 for i in range(len(configs))], configs)
    ax.set_ylabel("steps / hour")
    ax.set_title("sync on 2 cores vs learner + 1 Ray worker, a core each")
    ax.legend()
    save_png(fig, path)


def summary_row(result: dict, link: str, index: bool = False) -> str:
    """The result's line in the README's table (index: with target and verdict columns)."""
    h = result["headline"]
    ratios = ", ".join(f"{c} {s['ratio']:.2f}×" for c, s in result["summary"].items())
    text = (f"| [{TITLE}]({link}) | learner + 1 Ray rollout worker (a core each, η = "
            f"{result['config']['eta']}) against the synchronous loop on both cores, steps/hour: "
            f"{ratios} |")
    if not index:
        return text
    return text + f" ≥ {h['target']:g}× (rollout_heavy) | " + (
        "met |" if h["value"] >= h["target"] else "missed |")


def render_page(result: dict) -> str:
    """docs/results/ray-workers.md, every number from the JSON."""
    cfg, h = result["config"], result["headline"]
    rows = []
    for config, s in result["summary"].items():
        for side in ("sync", "ray"):
            m = s["median"][side]
            each = ", ".join(f"{r['steps_per_hour']:.0f}" for r in result["reps"]
                             if r["config"] == config and r["side"] == side)
            shares = ", ".join(f"{p.removesuffix('_s')} {m['shares'][p]:.2f}" for p in PHASES
                               if m["shares"][p] >= 0.01)
            extra = (f"learner {m['learner_step_s'] * 1e3:.0f} ms, worker sampling "
                     f"{m['worker_sample_s'] * 1e3:.0f} ms a step; lag {m['version_lag']:.2f}, "
                     f"{m['sync_bytes_per_step'] / 1e6:.2f} MB and "
                     f"{m['sync_s_per_step'] * 1e3:.1f} ms of weight sync a step"
                     if side == "ray" else "")
            rows.append(f"| {config} | {side} | {m['steps_per_hour']:.0f} | {each} | {shares} | "
                        f"{extra} |")
    ratios = "; ".join(
        f"{c}: {s['ratio']:.2f}× [{min(s['paired']):.2f}, {max(s['paired']):.2f}] (ratio of "
        f"medians {s['ratio_of_medians']:.2f}×, ceiling {s['ceiling']:.2f}×)"
        for c, s in result["summary"].items())
    verdict = "met" if h["value"] >= h["target"] else "missed"
    shares = "; ".join(f"{c} {s['median']['sync']['shares']['rollout_s']:.2f}"
                       for c, s in result["summary"].items())
    reading = (f"Reading it. The rollout's share of a synchronous step: {shares}. With one "
               "core each, the Ray side's step is at best the longer of the two phases, so "
               "the overlap pays most when they are about equal, and the side whose phase is "
               "longer sets the pace: where the learner's share is above one half, the "
               "learner on one core is the bottleneck and Ray can lose to the synchronous "
               "loop on two. The ceiling (the sync step over the longer of the Ray side's "
               "learner step and worker sampling, both measured in these runs) is what "
               "perfect overlap would give: the learner on one core is slower than on two "
               "while the sampling is not, so it is the rollout's share that lifts the "
               "ceiling; the measured ratio falls short of it by what the Ray side adds "
               "(the transfer of the groups, the weight sync, the learner's waits) and by "
               "the spread of this machine's load, which the paired reps show.")
    return f"""# Ray rollout workers on one machine

<!-- generated by `python -m experiments.bench.ray_workers` from
experiments/results/bench_ray_workers.json; do not edit by hand -->

The learner in one process pinned to core 0 (`taskset -c 0`) and one Ray rollout worker
pinned to core 1 (`--async-backend ray --set async.worker_affinity=[1]`, the deterministic
schedule at η = {cfg['eta']}: the worker samples step v + 1 while the learner trains step v),
against the synchronous loop on both cores. `tiny-synthetic`, {cfg['steps']} steps a run,
the first {cfg['skip']} left out (they compile), {cfg['reps']} reps, the sides alternating,
the median rep shown. Machine: {h['machine']}.

| config | side | steps / hour (median) | each rep | phase shares of a step | Ray |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Ray / sync, the median of the reps' paired ratios [their range]: {ratios} (target ≥
{h['target']:g}× on rollout_heavy: {verdict}).

{reading}

![steps per hour, sync and Ray](../../experiments/results/bench_ray_workers.png)

Command: `{result['command']}`.
"""


def write_docs(result: dict) -> None:
    write_page_and_rows(PAGE, render_page(result),
                        lambda link, index=False: summary_row(result, link, index=index),
                        TITLE, ROW_AFTER)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.ray_workers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--eta", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULT)
    add_docs_only_flag(p)
    args = p.parse_args(argv)
    if args.docs_only:
        return docs_from_json(RESULT, write_docs)
    if args.steps <= args.skip:
        raise SystemExit(f"--steps {args.steps} must exceed --skip {args.skip} (the compile steps)")
    res = measure(args)
    head_config = "rollout_heavy" if "rollout_heavy" in res["summary"] else args.configs[0]
    result = {"headline": {"metric": f"steps/hour, learner + 1 Ray rollout worker (a core "
                                     f"each, η={args.eta}) / the synchronous loop on both "
                                     f"cores, tiny-synthetic {head_config}",
                           "value": round(res["summary"][head_config]["ratio"], 3),
                           "target": 1.2, "machine": machine()},
              **res, "config": {k: v for k, v in vars(args).items() if k != "out"},
              "command": "python -m experiments.bench.ray_workers " + " ".join(sys.argv[1:])}
    write_results(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    if args.out == RESULT:
        write_docs(result)
    print(json.dumps(result["headline"], indent=1))
    for config, s in res["summary"].items():
        print(f"{config}: ray / sync = {s['ratio']:.2f}x")
    return result


if __name__ == "__main__":
    main()
