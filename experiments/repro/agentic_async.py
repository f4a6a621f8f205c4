"""Agentic async learning at tool latency: SmolLM2 on the calculator environment with an
emulated tool latency (lognormal p50 0.5 s / p99 3 s), the synchronous loop against the
threaded asynchronous loop (η = 2), paired over the same held-out problems and seeds.

    python -m experiments.repro.agentic_async run [--seeds 0 1] [--steps 6]   # resumable
    python -m experiments.repro.agentic_async report [--seeds 0 1 2]          # JSON, PNG, docs
    python -m experiments.repro.agentic_async docs     # the page and rows from the JSON

Arms (every one: `experiments.train --preset smollm2-calc --tool-latency
lognormal:0.5,3`, the same seed, steps and the same `--eval-prompts` greedy held-out
problems at step 0 and at the last step, per-problem results saved):

    sync_inline       the synchronous loop, tool calls one after another
                      (--max-concurrent-tool-calls 0: the loop of the previous main)
    sync_concurrent   the synchronous loop, tool calls on a pool of 32
    async             the threaded asynchronous loop, η = 2, tool calls on a pool of 32

Each run is its own process, one after another (one heavy job at a time); the order of the
arms alternates from seed to seed so that neither side always runs first. A run whose dir
holds summary.json is skipped (re-run the command after a stop; an unfinished run
resumes from its last checkpoint with --resume).

The rule, written before the runs. Wall time is the training time of a run: the sum of
its steps' `step_s` (rollouts, waits for the producer, the update; the two evals and the
model load excluded: both sides do the same ones). For async against a synchronous arm:
  - accuracy: d = mean over seeds x problems of (async - sync) final greedy accuracy;
    its standard error se_d = the std of the paired bootstrap replicates; async
    "reaches" the synchronous accuracy when d >= -2 se_d;
  - wall: r = mean async wall / mean sync wall over the seeds; the target is r <= 0.5.
The target is met when both hold. It is decided against both synchronous arms; the
headline is the comparison with sync_concurrent (the stronger baseline), the one with
sync_inline stands beside it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from experiments.common.benchmarking import machine, results_path
from experiments.common.docs_rows import replace_row
from experiments.common.paired import bootstrap, seed_problem_matrix
from experiments.common.seeds import is_finished, read_metrics, train_in_process
from rl.runtime.logging import atomic_write_json

OUT = results_path(__file__)
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/results/agentic-async.md"
README, INDEX = ROOT / "README.md", ROOT / "docs/results/index.md"
TITLE, ROW_AFTER = "Agentic async learning", "Agentic overlap"  # rows go after the latter
LATENCY = "lognormal:0.5,3"
ARMS = {
    "sync_inline": ["--max-concurrent-tool-calls", "0"],
    "sync_concurrent": ["--max-concurrent-tool-calls", "32"],
    "async": ["--max-concurrent-tool-calls", "32", "--max-staleness", "2",
              "--async-mode", "threaded"],
}
ORDER = ("async", "sync_inline", "sync_concurrent")


def run_order(seeds: list[int], inline_seeds: list[int] | None = None) -> list[tuple[str, int]]:
    """(arm, seed) in run order: the arm order reversed on every other seed; sync_inline
    only on `inline_seeds` (None: every seed)."""
    out = []
    for i, seed in enumerate(seeds):
        arms = ORDER if i % 2 == 0 else tuple(reversed(ORDER))
        out += [(arm, seed) for arm in arms
                if arm != "sync_inline" or inline_seeds is None or seed in inline_seeds]
    return out


def arm_seeds(arm: str, args) -> list[int]:
    """The seeds an arm runs on."""
    if arm == "sync_inline" and args.inline_seeds is not None:
        return [s for s in args.seeds if s in args.inline_seeds]
    return list(args.seeds)


def train_command(arm: str, seed: int, run_dir: Path, args) -> list[str]:
    """The experiments.train command line of one run."""
    return [sys.executable, "-m", "experiments.train", "--preset", "smollm2-calc",
            "--run-dir", str(run_dir), "--seed", str(seed), "--steps", str(args.steps),
            "--eval-every", str(args.steps), "--eval-prompts", str(args.eval_prompts),
            "--set", "loop.eval_sampled_prompts=0", "--set", f"loop.save_every={args.steps}",
            "--time-limit", "240", "--tool-latency", LATENCY, "--no-progress", *ARMS[arm]]


def cmd_run(args) -> None:
    work = Path(args.work_dir)
    for arm, seed in run_order(args.seeds, args.inline_seeds):
        run_dir = work / f"{arm}_s{seed}"
        train_in_process(run_dir, train_command(arm, seed, run_dir, args))


def read_run(run_dir: Path) -> dict:
    """One finished run: steps' training wall (sum of step_s), per-step timings and the
    tool metrics, first / last greedy eval."""
    train, evals = read_metrics(run_dir)
    # a resumed run logs the steps after its last checkpoint twice: keep each step's last
    train = list({r["step"]: r for r in train}.values())
    evals = list({r["step"]: r for r in evals}.values())
    if not is_finished(run_dir) or len(evals) < 2:
        raise ValueError(f"{run_dir}: not finished (needs summary.json and two evals)")

    def mean(key):
        vals = [r[key] for r in train if r.get(key) is not None]
        return round(statistics.fmean(vals), 4) if vals else None

    return {
        "run_dir": str(run_dir), "steps": len(train),
        "train_wall_s": round(sum(r["step_s"] for r in train), 1),
        "step_s": [round(r["step_s"], 2) for r in train],
        "initial_accuracy": evals[0]["greedy_accuracy"],
        "final_accuracy": evals[-1]["greedy_accuracy"],
        "final_accuracy_stderr": evals[-1].get("greedy_accuracy_stderr"),
        "rollout_s": mean("rollout_s"), "train_s": mean("train_s"),
        "tool_wait_share": mean("tool_wait_share"),
        "tool_calls_in_flight": mean("tool_calls_in_flight"),
        "slot_occupancy": mean("slot_occupancy"),
        "reward_correct": [r.get("reward_correct") for r in train],
        "version_lag_mean": mean("version_lag_mean"),
        "command": json.loads((run_dir / "summary.json").read_text()).get("command"),
    }


def compare(work: Path, arm: str, seeds: list[int], runs: dict) -> dict:
    """The rule (module doc) for async against the synchronous `arm` on `seeds` (paired by
    seed: row s of both tables is seed s)."""
    async_dirs = [work / f"async_s{s}" for s in seeds]
    sync_dirs = [work / f"{arm}_s{s}" for s in seeds]
    a = seed_problem_matrix(async_dirs)
    s = seed_problem_matrix(sync_dirs)
    reps: list[float] = []

    def diff(x, y):
        reps.append(float(x.mean() - y.mean()))
        return reps[-1]

    est = bootstrap([a, s], diff)
    se = float(np.std(reps[:-1], ddof=1))
    wall_a = statistics.fmean(runs[str(d)]["train_wall_s"] for d in async_dirs)
    wall_s = statistics.fmean(runs[str(d)]["train_wall_s"] for d in sync_dirs)
    reaches = est.value >= -2 * se
    ratio = wall_a / wall_s
    return {"accuracy_diff": est.as_dict(), "accuracy_diff_se": round(se, 4),
            "async_accuracy": round(float(a.mean()), 4), "sync_accuracy": round(float(s.mean()), 4),
            "reaches_sync_accuracy": bool(reaches), "async_wall_s": round(wall_a, 1),
            "sync_wall_s": round(wall_s, 1), "wall_ratio": round(ratio, 3),
            "wall_target": 0.5, "target_met": bool(reaches and ratio <= 0.5),
            "seeds": int(a.shape[0]), "problems": int(a.shape[1])}


def cmd_report(args) -> dict:
    work = Path(args.work_dir)
    dirs = {arm: [work / f"{arm}_s{s}" for s in arm_seeds(arm, args)] for arm in ARMS}
    runs = {str(d): read_run(d) for ds in dirs.values() for d in ds}
    comparisons = {arm: compare(work, arm, arm_seeds(arm, args), runs)
                   for arm in ("sync_concurrent", "sync_inline")}
    head = comparisons["sync_concurrent"]
    res = {
        "headline": {
            "metric": "async (η=2) training wall time / the synchronous loop's (tool calls "
                      "on a pool of 32), SmolLM2 on the calculator at lognormal p50 0.5 s / "
                      f"p99 3 s tool latency, {args.steps} steps, mean of "
                      f"{head['seeds']} seeds",
            "value": head["wall_ratio"], "target": 0.5,
            "reaches_sync_accuracy": head["reaches_sync_accuracy"],
            "vs_sync_inline": comparisons["sync_inline"]["wall_ratio"],
            "machine": machine()},
        "rule": __doc__.split("The rule, written before the runs.")[1].strip(),
        "tool_latency": LATENCY, "steps": args.steps,
        "seeds": {arm: arm_seeds(arm, args) for arm in ARMS},
        "comparisons": comparisons,
        "arms": {arm: {"train_wall_s": [runs[str(d)]["train_wall_s"] for d in ds],
                       "final_accuracy": [runs[str(d)]["final_accuracy"] for d in ds],
                       "initial_accuracy": [runs[str(d)]["initial_accuracy"] for d in ds]}
                 for arm, ds in dirs.items()},
        "runs": runs,
        "command": "python -m experiments.repro.agentic_async " + " ".join(sys.argv[1:]),
    }
    atomic_write_json(args.out, res)
    plot(res, Path(args.out).with_suffix(".png"))
    if Path(args.out) == OUT:
        write_docs(res)
    print(json.dumps(res["headline"], indent=1))
    for arm, c in comparisons.items():
        print(f"async vs {arm}: accuracy {c['async_accuracy']:.3f} vs {c['sync_accuracy']:.3f} "
              f"(d {c['accuracy_diff']['value']:+.3f}, se {c['accuracy_diff_se']:.3f}), wall "
              f"{c['async_wall_s']:.0f} s vs {c['sync_wall_s']:.0f} s = {c['wall_ratio']:.2f}x")
    return res


def plot(res: dict, path: Path) -> None:
    from experiments.common.plots import plt, save_png

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(res["arms"])
    colors = {"sync_inline": "gray", "sync_concurrent": "tab:blue", "async": "tab:green"}
    for i, arm in enumerate(names):
        walls = res["arms"][arm]["train_wall_s"]
        accs = res["arms"][arm]["final_accuracy"]
        a.bar(i, statistics.fmean(walls), color=colors[arm])
        a.plot([i] * len(walls), walls, "k.")
        b.bar(i, statistics.fmean(accs), color=colors[arm])
        b.plot([i] * len(accs), accs, "k.")
    for ax, label in ((a, "training wall time (s)"), (b, "final greedy accuracy")):
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel(label)
    b.set_ylim(0, 1.05)
    a.set_title(f"SmolLM2 calculator, tool latency {res['tool_latency']}")
    n = res["comparisons"]["sync_concurrent"]["problems"]
    b.set_title(f"{n} held-out problems (dots: seeds)")
    save_png(fig, path)


def verdict(c: dict) -> str:
    """The rule's verdict of one comparison, in words."""
    acc = "reaches" if c["reaches_sync_accuracy"] else "does not reach"
    wall = "met" if c["wall_ratio"] <= c["wall_target"] else "missed"
    return (f"{acc} its accuracy; wall {c['wall_ratio']:.2f}× "
            f"(target ≤ {c['wall_target']:g}×: {wall})")


def summary_row(res: dict, link: str, index: bool = False) -> str:
    """The result's line in the README's table (index: the results index's, with target
    and verdict columns)."""
    c, i = res["comparisons"]["sync_concurrent"], res["comparisons"]["sync_inline"]
    text = (f"| [{TITLE}]({link}) | SmolLM2 on the calculator at tool latency lognormal p50 "
            f"0.5 s / p99 3 s, {res['steps']} steps, {c['seeds']} seed(s), {c['problems']} "
            f"held-out problems: threaded async (η = 2) {c['async_accuracy']:.3f} vs sync "
            f"{c['sync_accuracy']:.3f} (d {c['accuracy_diff']['value']:+.3f}), training wall "
            f"{c['wall_ratio']:.2f}× sync with concurrent calls, {i['wall_ratio']:.2f}× sync "
            "with one call at a time |")
    if not index:
        return text
    met = c["target_met"]
    return text + f" reaches sync, wall ≤ 0.5× | {'met' if met else 'missed'} |"


def arm_rows(res: dict) -> str:
    """The page's per-arm table: means over seeds, each seed beside."""
    rows = []
    for arm, seeds in res["seeds"].items():
        runs = [res["runs"][r] for r in res["runs"] if Path(r).name.startswith(f"{arm}_s")]
        a = res["arms"][arm]

        def m(key, fmt, runs=runs):
            vals = [r[key] for r in runs if r.get(key) is not None]
            return format(statistics.fmean(vals), fmt) if vals else "–"
        rows.append(
            f"| {arm} | {', '.join(map(str, seeds))} | "
            f"{statistics.fmean(a['initial_accuracy']):.3f} | "
            f"{statistics.fmean(a['final_accuracy']):.3f} ("
            + ", ".join(f"{x:.3f}" for x in a["final_accuracy"]) + ") | "
            f"{statistics.fmean(a['train_wall_s']):.0f} ("
            + ", ".join(f"{x:.0f}" for x in a["train_wall_s"]) + ") | "
            f"{m('rollout_s', '.1f')} | {m('train_s', '.1f')} | {m('tool_wait_share', '.3f')} | "
            f"{m('tool_calls_in_flight', '.1f')} | {m('slot_occupancy', '.2f')} |")
    return "\n".join(rows)


def render_page(res: dict) -> str:
    """docs/results/agentic-async.md, every number from the JSON."""
    comps = "\n".join(
        f"| {arm} | {c['async_accuracy']:.3f} | {c['sync_accuracy']:.3f} | "
        f"{c['accuracy_diff']['value']:+.3f} [{c['accuracy_diff']['low']:+.3f}, "
        f"{c['accuracy_diff']['high']:+.3f}] | {c['accuracy_diff_se']:.3f} | "
        f"{c['async_wall_s']:.0f} / {c['sync_wall_s']:.0f} s | {verdict(c)} |"
        for arm, c in res["comparisons"].items())
    c = res["comparisons"]["sync_concurrent"]
    return f"""# Agentic async learning: SmolLM2 with a slow tool

<!-- generated by `python -m experiments.repro.agentic_async report` from
experiments/results/agentic_async.json; do not edit by hand -->

Does the asynchronous loop learn as well as the synchronous one when an agent's tool is
slow, and does it finish sooner? SmolLM2-135M-Instruct trains with GRPO on the calculator
environment (`--preset smollm2-calc`), every tool call behind an emulated latency
`{res['tool_latency']}` (p50 0.5 s, p99 3 s: a search API or a sandbox), {res['steps']}
steps; greedy accuracy on the same {c['problems']} held-out problems at step 0 and at the
last step, per problem, paired by seed and problem. Three arms, each run its own process,
one after another, the arm order alternating from seed to seed:

- **sync_inline**: the synchronous loop, one tool call at a time (the loop before the
  agentic work; slowest, so fewer seeds);
- **sync_concurrent**: the synchronous loop, tool calls on a pool of 32 while the other
  slots decode;
- **async**: the threaded asynchronous loop, η = 2, the same pool.

The rule, written before the runs (`experiments/repro/agentic_async.py`):

{res['rule']}

| arm | seeds | greedy accuracy, step 0 | final (each seed) | training wall s (each seed) | rollout s / step | update s / step | tool wait share | tool calls in flight | slot occupancy |
|---|---|---|---|---|---|---|---|---|---|
{arm_rows(res)}

Rollout s / step is the synchronous loop's rollout phase (async rolls out on a producer
thread beside the update, so its step is the update plus any wait for the producer);
sync_inline's calls block the rollout thread itself, which the tool wait share (time
blocked with no slot left to decode) does not count.

| async against | async accuracy | sync accuracy | d [95 % CI] | se_d | training wall, async / sync | verdict |
|---|---|---|---|---|---|---|
{comps}

![training wall time and final accuracy per arm](../../experiments/results/agentic_async.png)

{reading(res)}

Machine: {res['headline']['machine']}. Command: `{res['command']}` after
`python -m experiments.repro.agentic_async run` with the same seeds (about 17 min a run).
"""


def reading(res: dict) -> str:
    """The page's reading of the result; each claim follows from the JSON."""
    c, i = res["comparisons"]["sync_concurrent"], res["comparisons"]["sync_inline"]
    upd = {arm: [r["train_s"] for r in res["runs"].values()
                 if Path(r["run_dir"]).name.startswith(f"{arm}_s") and r.get("train_s")]
           for arm in ("async", "sync_concurrent")}
    upd_a, upd_s = (statistics.fmean(upd[a]) for a in ("async", "sync_concurrent"))
    d = c["accuracy_diff"]
    finals = ", ".join(f"{x:.3f}" for x in res["arms"]["async"]["final_accuracy"])
    acc = ((f"By the rule the asynchronous loop reaches the synchronous accuracy: d = "
            f"{d['value']:+.3f} against a margin of 2 se = {2 * c['accuracy_diff_se']:.3f}. "
            if c["reaches_sync_accuracy"] else
            f"By the rule the asynchronous loop does not reach the synchronous accuracy: d = "
            f"{d['value']:+.3f}, beyond 2 se = {2 * c['accuracy_diff_se']:.3f}. ")
           + f"The async seeds end at {finals}; the 95 % interval of d is [{d['low']:+.3f}, "
           f"{d['high']:+.3f}]" + (f", which does not exclude a loss of {-d['low']:.3f} "
                                   f"with {c['seeds']} seed(s): more seeds would narrow it."
                                   if d["low"] < 0 else "."))
    slower = (f"the async update runs slower than the synchronous one ({upd_a:.0f} s against "
              f"{upd_s:.0f} s a step)" if upd_a > upd_s else
              f"the async update is no slower ({upd_a:.0f} s against {upd_s:.0f} s a step)")
    inline = ("Against one call at a time the tool wait is real, and concurrency (not "
              "asynchrony) is what removes most of it"
              f" (sync_inline {i['sync_wall_s']:.0f} s against sync_concurrent "
              f"{c['sync_wall_s']:.0f} s)." if i["sync_wall_s"] > c["sync_wall_s"] else "")
    wall = ("The 0.5× target is met." if c["wall_ratio"] <= c["wall_target"] else
            "The 0.5× target is missed: it needs the producer and the learner on separate "
            "devices (rollout workers in their own processes, or a GPU learner), or a workload "
            "where the tool, not the update, dominates (the tiny model of "
            "[Agentic overlap](agentic-overlap.md), where it does).")
    return (f"Reading it. {acc} Wall time is the machine's story: on this machine the SmolLM2 "
            "update is most of every step and, with concurrent calls, the tool wait is a small "
            "share of it, so there is little for asynchrony to hide; the producer thread "
            f"competes with the learner for the same cores, and {slower}. {inline} {wall}")


def write_docs(res: dict) -> None:
    PAGE.write_text(render_page(res))
    replace_row(README, summary_row(res, "docs/results/agentic-async.md"), TITLE, ROW_AFTER)
    replace_row(INDEX, summary_row(res, "agentic-async.md", index=True), TITLE, ROW_AFTER)


def cmd_docs(args) -> dict:
    res = json.loads(Path(args.out).read_text())
    write_docs(res)
    return res


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m experiments.repro.agentic_async")
    p.add_argument("command", choices=("run", "report", "docs"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--inline-seeds", type=int, nargs="*", default=None,
                   help="the seeds sync_inline runs on (default: all; it is the slowest arm)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--work-dir", default="runs/agentic_async")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    return {"run": cmd_run, "report": cmd_report, "docs": cmd_docs}[args.command](args)


if __name__ == "__main__":
    main()
