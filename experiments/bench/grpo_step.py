"""Steps per hour of the main job, this tree against an older commit, side by side.

    python -m experiments.bench.grpo_step                 # smollm2-rg, 6 steps, vs 2991625
    python -m experiments.bench.grpo_step --steps 3 --repeats 1 --baseline HEAD
    python -m experiments.bench.grpo_step --preset tiny-synthetic --steps 2 --baseline none
    python -m experiments.bench.grpo_step --steps 4 --repeats 2 --baseline self \
        --old-arg=--remat --old-arg=full --new-arg=--low-memory --headline memory

Each run is `python -m experiments.train --preset P --steps N --seed S --eval-every 0
--save-every 0 --eval-prompts E --wandb disabled --no-progress` in a subprocess, one at a
time (a real-model run holds many GB; two at once would also share the cores): "new" in
this working tree, "old" in a `git worktree` of --baseline (default 2991625, the commit
issue 17 starts from) made in a temp dir and removed at the end; with `--baseline self`
both sides run this tree and differ by their --old-arg / --new-arg flags (an option's cost
and memory measured side by side). Runs alternate old, new,
old, new, ... (--repeats pairs), with the same seeds, so load from other processes hits
both sides alike.

What both sides log is compared: the wall time of each step from metrics.jsonl (time_s of
its train record minus time_s of the record before it: the step plus the previous
record's logging; the start and end evals and the final checkpoint lie outside every
step), rollout_s / train_s, and each step's reward_mean (same seeds: the learning curves
must agree within noise; the table gives the mean absolute difference per step). Steps
per hour = 3600 / mean step wall time over every run's steps after the first (which
compiles). The new side also has the step profile (prefill, decode, reward, learner,
host, transfer, other, peak memory per step; rl.runtime.logging), summarised from its
summary.json; each side's process peak resident memory and user / system CPU seconds come
from os.wait4 (CPU seconds move less than walls when other jobs share the cores; the step
profile resets the kernel's high-water mark at every step, so that peak covers the last
step, the final eval and the save).

Writes experiments/results/bench_grpo_step.json (--out): "headline" {"metric": "steps/hour
new/old", "value", "target": 2.0, "machine"}; with `--headline memory` the new side's
per-step peak resident GB against 4.0), the per-side table, every run's per-step
walls and rewards, and the load average before and after each run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from experiments.common.benchmarking import load_average, machine, results_path, write_results
from rl.runtime.logging import atomic_write_json, read_jsonl

ROOT = Path(__file__).resolve().parents[2]  # the repository
RESULT = results_path(__file__)
DEFAULT_BASELINE = "2991625"  # the commit issue 17 starts from
TARGET = 2.0  # issue 17: steps per hour at least doubled
MEMORY_TARGET_GB = 4.0  # issue 33: the smollm2-rg step's peak resident memory on CPU
PHASE_KEYS = ("prefill_s", "decode_s", "reward_s", "learner_s", "host_s", "transfer_s", "other_s")


# ----------------------------------------------------------------------------- one run
def train_command(preset: str, steps: int, seed: int, eval_prompts: int, run_dir: Path,
                  extra: list[str]) -> list[str]:
    """The experiments.train command line of one run (the same on both sides)."""
    return [sys.executable, "-m", "experiments.train", "--preset", preset, "--steps", str(steps),
            "--seed", str(seed), "--run-dir", str(run_dir), "--eval-every", "0",
            "--save-every", "0", "--eval-prompts", str(eval_prompts), "--wandb", "disabled",
            "--no-progress", *extra]


def step_walls(records: list[dict]) -> list[float]:
    """Wall seconds of each train step: its record's time_s minus the time_s of the record
    before it (train or eval); ValueError if a train record has no time_s."""
    walls, prev = [], None
    for r in records:
        t = r.get("time_s")
        if t is None:
            raise ValueError(f"record {r.get('kind')} step {r.get('step')} has no time_s; "
                             "cannot time the steps")
        if r.get("kind") == "train":
            if prev is None:
                raise ValueError("the first train record has no record before it to time from")
            walls.append(float(t) - prev)
        prev = float(t)
    return walls


def run_once(root: Path, command: list[str], run_dir: Path) -> dict[str, Any]:
    """Run `command` in `root` (PYTHONPATH=root, so that tree's code is imported), its
    output into run_dir/train.log; returns what the run measured (per-step walls, rewards,
    rollout_s / train_s, the step profile if the code logs one, process peak memory)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root)}
    load_before = load_average()
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "wb") as log:
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (run_dir / "train.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"run in {root} failed (exit {proc.returncode}): "
                           f"{' '.join(command)}\n{tail}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    out: dict[str, Any] = {
        "process_wall_s": wall,
        "process_peak_rss_mb": usage.ru_maxrss * 1024 / 1e6,  # Linux: KiB
        "cpu_user_s": usage.ru_utime, "cpu_sys_s": usage.ru_stime,
        "load_average_before": load_before, "load_average_after": load_average(),
        "step_wall_s": step_walls(records),
        "reward_mean": [r["reward_mean"] for r in train],
        "rollout_s": [r.get("rollout_s") for r in train],
        "train_s": [r.get("train_s") for r in train],
    }
    if train and "step_s" in train[0]:  # the step profile (new code)
        out["profile"] = [{k: r.get(k) for k in ("step_s", *PHASE_KEYS, "peak_rss_mb")}
                          for r in train]
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            out["profile_summary"] = json.loads(summary_path.read_text()).get("step_profile")
    return out


# ----------------------------------------------------------------------------- sides
@contextlib.contextmanager
def baseline_tree(commit: str) -> Iterator[tuple[Path, str]]:
    """A detached `git worktree` of `commit` in a temp dir (removed afterwards):
    (its root, the full commit hash)."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if full.returncode != 0:
        raise ValueError(f"--baseline {commit!r} is not a commit of {ROOT}: {full.stderr.strip()}")
    sha = full.stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-baseline-"))
    path = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield path, sha
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                       capture_output=True, check=False)
        with contextlib.suppress(OSError):
            tmp.rmdir()


def check_imports_from(root: Path) -> None:
    """RuntimeError unless a subprocess in `root` imports rl and experiments from it."""
    code = "import experiments.train, rl; print(rl.__file__); print(experiments.train.__file__)"
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, check=False)
    files = res.stdout.split()
    if res.returncode != 0 or not files or not all(
            Path(f).resolve().is_relative_to(root.resolve()) for f in files):
        raise RuntimeError(f"a subprocess in {root} does not import its own code: "
                           f"{res.stdout.strip()} {res.stderr.strip()[-500:]}")


def side_table(runs: list[dict]) -> dict[str, Any]:
    """One side's numbers over its runs: steps/hour from the steps after each run's first,
    the first steps' mean, rollout_s / train_s means (same steps), the mean reward curve,
    process peak memory, and the step-profile means (new code only)."""
    later = [w for r in runs for w in r["step_wall_s"][1:]]
    if not later:
        raise ValueError("every run has a single step: nothing to time after the compiling "
                         "step; use --steps >= 2")
    mean = statistics.fmean(later)

    def later_mean(key):
        vals = [v for r in runs for v in r[key][1:] if v is not None]
        return statistics.fmean(vals) if vals else None

    steps = len(runs[0]["reward_mean"])
    out: dict[str, Any] = {
        "runs": len(runs),
        "steps_timed": len(later),
        "step_wall_s_mean": mean,
        "step_wall_s_stdev": statistics.stdev(later) if len(later) > 1 else 0.0,
        "steps_per_hour": 3600.0 / mean,
        "first_step_wall_s_mean": statistics.fmean(r["step_wall_s"][0] for r in runs),
        "rollout_s_mean": later_mean("rollout_s"),
        "train_s_mean": later_mean("train_s"),
        "reward_mean_per_step": [statistics.fmean(r["reward_mean"][i] for r in runs)
                                 for i in range(steps)],
        "process_peak_rss_mb": max(r["process_peak_rss_mb"] for r in runs),
        # CPU seconds of the whole process (compile and evals included): less sensitive to
        # other load on the machine than the walls
        "cpu_user_s_mean": statistics.fmean(r.get("cpu_user_s", 0.0) for r in runs),
        "cpu_sys_s_mean": statistics.fmean(r.get("cpu_sys_s", 0.0) for r in runs),
    }
    prof = [p for r in runs for p in r.get("profile", [])[1:]]
    if prof:
        out["phases_mean_s"] = {k: statistics.fmean(float(p[k] or 0.0) for p in prof)
                                for k in ("step_s", *PHASE_KEYS)}
        out["phases_share"] = {k: out["phases_mean_s"][k] / out["phases_mean_s"]["step_s"]
                               for k in PHASE_KEYS}
        mem = [p["peak_rss_mb"] for r in runs for p in r["profile"] if p["peak_rss_mb"]]
        out["peak_rss_mb_per_step_max"] = max(mem) if mem else None
    return out


def compare(new: dict, old: dict | None) -> dict[str, Any]:
    """new/old steps per hour and the reward curves' agreement. first_step_reward_equal:
    step 1 samples from the same initial params on both sides, so equal rewards there mean
    the two samplers draw the same tokens; if not, the curves can agree only statistically
    (within the sampling noise of one batch)."""
    if old is None:
        return {}
    a, b = new["reward_mean_per_step"], old["reward_mean_per_step"]
    diffs = [abs(x - y) for x, y in zip(a, b)]
    cpu = {side: s["cpu_user_s_mean"] + s["cpu_sys_s_mean"] for side, s in (("new", new),
                                                                           ("old", old))}
    return {"steps_per_hour_ratio": new["steps_per_hour"] / old["steps_per_hour"],
            "train_s_ratio": (new["train_s_mean"] / old["train_s_mean"]
                              if new["train_s_mean"] and old["train_s_mean"] else None),
            "process_cpu_s_ratio": cpu["new"] / cpu["old"] if cpu["old"] else None,
            "reward_mean_abs_diff": statistics.fmean(diffs) if diffs else None,
            "reward_max_abs_diff": max(diffs) if diffs else None,
            "first_step_reward_equal": bool(diffs) and diffs[0] == 0.0}


def format_table(result: dict) -> str:
    sides = result["sides"]
    header = (f"{'side':<5} {'steps/h':>8} {'s/step':>8} {'first':>8} {'rollout':>8} "
              f"{'train':>8} {'peak GB':>8} {'cpu usr':>8} {'cpu sys':>8}  rewards per step")
    lines = [header]
    for name, s in sides.items():
        rewards = " ".join(f"{x:.3f}" for x in s["reward_mean_per_step"])
        lines.append(
            f"{name:<5} {s['steps_per_hour']:8.1f} {s['step_wall_s_mean']:8.2f} "
            f"{s['first_step_wall_s_mean']:8.2f} {s['rollout_s_mean'] or 0:8.2f} "
            f"{s['train_s_mean'] or 0:8.2f} {s['process_peak_rss_mb'] / 1e3:8.2f} "
            f"{s['cpu_user_s_mean']:8.1f} {s['cpu_sys_s_mean']:8.1f}  {rewards}")
    new = sides["new"]
    if "phases_mean_s" in new:
        lines.append("new step profile (mean s, share; steps after the first):")
        for k in PHASE_KEYS:
            lines.append(f"  {k[:-2]:<9} {new['phases_mean_s'][k]:8.3f} s "
                         f"{100 * new['phases_share'][k]:5.1f} %")
        if new.get("peak_rss_mb_per_step_max"):
            lines.append(f"  peak memory in a step {new['peak_rss_mb_per_step_max'] / 1e3:.2f} GB")
    c = result["comparison"]
    if c:
        lines.append(f"new/old steps/hour {c['steps_per_hour_ratio']:.3f}; train_s "
                     f"{c['train_s_ratio'] or float('nan'):.3f}; process CPU seconds "
                     f"{c['process_cpu_s_ratio'] or float('nan'):.3f}; reward per step mean "
                     f"|new-old| {c['reward_mean_abs_diff']:.4f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.grpo_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-rg", help="experiments.train preset")
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is not timed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="old/new pairs of runs")
    p.add_argument("--baseline", default=DEFAULT_BASELINE,
                   help=f"commit to compare against (default {DEFAULT_BASELINE}); 'none': only "
                        "this tree; 'self': this tree on both sides (set them apart with "
                        "--old-arg / --new-arg)")
    p.add_argument("--eval-prompts", type=int, default=8,
                   help="prompts of the start and end evals (outside the timed steps)")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="an extra experiments.train argument for both sides (repeatable)")
    p.add_argument("--old-arg", action="append", default=[], metavar="ARG",
                   help="an extra experiments.train argument for the old side only")
    p.add_argument("--new-arg", action="append", default=[], metavar="ARG",
                   help="an extra experiments.train argument for the new side only")
    p.add_argument("--headline", choices=("speed", "memory"), default="speed",
                   help="speed: new/old steps per hour (target 2, issue 17); memory: the new "
                        "side's per-step peak resident GB (target 4, issue 33)")
    p.add_argument("--work-dir", help="where the runs' dirs go (default: a temp dir, removed)")
    p.add_argument("--out", default=str(RESULT), help="results JSON")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.steps < 2:
        build_parser().error("--steps must be >= 2 (the first step compiles and is not timed)")
    if args.repeats < 1:
        build_parser().error("--repeats must be >= 1")
    baseline = None if args.baseline.lower() == "none" else args.baseline
    if baseline is None and args.old_arg:
        build_parser().error("--old-arg needs an old side: --baseline COMMIT or self")
    command_line = "python -m experiments.bench.grpo_step " + " ".join(
        sys.argv[1:] if argv is None else argv)
    load_start = load_average()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir) if args.work_dir else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-grpo-step-")))
        roots = {"new": ROOT}
        sha = None
        if baseline == "self":
            roots["old"], sha = ROOT, "self"
        elif baseline is not None:
            roots["old"], sha = stack.enter_context(baseline_tree(baseline))
        for root in roots.values():
            check_imports_from(root)
        order = [side for _ in range(args.repeats) for side in ("old", "new") if side in roots]
        bar = tqdm(order, desc="bench_grpo_step", unit="run", dynamic_ncols=True)
        for i, side in enumerate(bar):
            bar.set_postfix(side=side)
            run_dir = work / f"{i:02d}-{side}"
            side_args = args.new_arg if side == "new" else args.old_arg
            cmd = train_command(args.preset, args.steps, args.seed, args.eval_prompts, run_dir,
                                [*args.train_arg, *side_args])
            rec = run_once(roots[side], cmd, run_dir)
            rec["order"] = i
            runs[side].append(rec)
            bar.write(f"{side}: {len(rec['step_wall_s'])} steps, walls "
                      + " ".join(f"{w:.1f}" for w in rec["step_wall_s"]) + " s; rewards "
                      + " ".join(f"{x:.3f}" for x in rec["reward_mean"]))
    sides = {"new": side_table(runs["new"])}
    if runs["old"]:
        sides["old"] = side_table(runs["old"])
    comparison = compare(sides["new"], sides.get("old"))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.strip() != ""
    if args.headline == "memory":
        peak = sides["new"].get("peak_rss_mb_per_step_max") or sides["new"]["process_peak_rss_mb"]
        headline = {"metric": "new side's peak resident GB in a step", "value": round(peak / 1e3, 3),
                    "target": MEMORY_TARGET_GB}
    else:
        headline = {
            "metric": "steps/hour new/old" if comparison else "steps/hour (no baseline)",
            "value": round(comparison["steps_per_hour_ratio"], 4) if comparison
            else round(sides["new"]["steps_per_hour"], 2),
            "target": TARGET if comparison else None}
    result = {
        "headline": {**headline, "machine": machine()},
        "command": command_line,
        "preset": args.preset, "steps": args.steps, "seed": args.seed, "repeats": args.repeats,
        "eval_prompts": args.eval_prompts, "train_args": args.train_arg,
        "old_args": args.old_arg, "new_args": args.new_arg,
        "new": {"commit": head.stdout.strip(), "uncommitted_changes": dirty},
        "old": None if sha is None else {
            "commit": head.stdout.strip() if sha == "self" else sha, "asked": baseline},
        "load_average_1_5_15min": {"before": load_start, "after": load_average()},
        "sides": sides,
        "comparison": comparison,
        "runs": runs,
        "how": "step wall = time_s of a step's train record minus the previous record's; "
               "steps/hour = 3600 / mean step wall over the steps after each run's first "
               "(compiling) step; runs alternate old, new with the same seeds",
    }
    out = Path(args.out)
    if result["headline"]["target"] is not None:
        write_results(out, result)
    else:  # no ratio to headline: write_results wants a numeric target
        atomic_write_json(out, result)
    print(format_table(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
