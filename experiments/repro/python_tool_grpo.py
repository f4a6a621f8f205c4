"""SmolLM2-135M-Instruct trained with GRPO on the sandboxed Python tool environment
(rl.envs.python_tool): greedy accuracy with the tool on the same held-out problems before
and after training, over seeds, paired.

    python -m experiments.repro.python_tool_grpo run [--seeds 0 1 2] [--steps 6]   # resumable
    python -m experiments.repro.python_tool_grpo report [--seeds 0 1 2]   # JSON, PNG, docs
    python -m experiments.repro.python_tool_grpo docs     # the page and row from the JSON

Each seed is one `experiments.train --preset smollm2-calc --env python` run in its own
process (the calculator preset's learner: GRPO, PPO-clip 0.2 / 0.28, AdamW 2e-5, 4 prompts
x 8 episodes a step; the environment's turn budgets, 256 prompt tokens (its prompts take
at most 201) and 640 episode tokens (the learner's rows stay under 900 tokens; the base
model's episodes average 40), with a greedy eval of the same
`--eval-prompts` eval-split problems at step 0 and at the last step, per problem saved
(and the preset's sampled pass on 16 of them). A
run whose dir holds summary.json is skipped; an unfinished one resumes from its checkpoint.

The rule, written before the runs. The measure is greedy accuracy with the tool at the
last step against step 0 of the same run, on the same problems: gain = the mean over
seeds x problems of (final - initial), with a 95 % interval from the paired bootstrap over
seeds and problems (experiments.common.paired). GRPO improves the tool-using model when
the interval's low end is above 0; the target is gain > 0 so decided. Beside it: the tool
calls per episode at both evals (does training teach the model to call the tool, or to
stop calling it?) and each step's batch reward.
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
from experiments.common.paired import paired_bootstrap, problem_results, seed_problem_matrix
from experiments.common.seeds import is_finished, read_metrics, train_in_process
from rl.runtime.logging import atomic_write_json

OUT = results_path(__file__)
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/results/python-tool-grpo.md"
INDEX = ROOT / "docs/results/index.md"
TITLE, ROW_AFTER = "Python tool after GRPO", "Python tool, base model"


def train_command(seed: int, run_dir: Path, args) -> list[str]:
    """The experiments.train command line of one seed's run."""
    return [sys.executable, "-m", "experiments.train", "--preset", "smollm2-calc",
            "--env", "python", "--env-option", f"dataset={args.dataset}",
            "--env-option", "max_prompt_len=256", "--env-option", "max_episode_tokens=640",
            "--run-dir", str(run_dir), "--seed", str(seed), "--steps", str(args.steps),
            "--eval-every", str(args.steps), "--eval-prompts", str(args.eval_prompts),
            "--set", "loop.save_every=2",
            "--time-limit", "240", "--no-progress"]


def read_run(run_dir: Path) -> dict:
    """One finished run: the first / last greedy eval (accuracy, tool calls per episode,
    and each problem's greedy result at both, by prompt index: what the paired comparison
    rests on), each step's batch reward (a resumed run's repeated steps counted once)."""
    train, evals = read_metrics(run_dir)
    train = sorted({r["step"]: r for r in train}.values(), key=lambda r: r["step"])
    evals = sorted({r["step"]: r for r in evals}.values(), key=lambda r: r["step"])
    if not is_finished(run_dir) or len(evals) < 2:
        raise ValueError(f"{run_dir}: not finished (needs summary.json and two evals)")
    first, last = evals[0], evals[-1]
    per = problem_results(run_dir)
    at0, at1 = per[first["step"]]["greedy"], per[last["step"]]["greedy"]
    index = sorted(at1)
    return {"run_dir": str(run_dir), "steps": len(train), "final_step": last["step"],
            "problems": {"index": index, "initial": [at0[i] for i in index],
                         "final": [at1[i] for i in index]},
            "initial_accuracy": first["greedy_accuracy"],
            "final_accuracy": last["greedy_accuracy"],
            "initial_tool_calls": first.get("greedy_episode_tool_calls"),
            "final_tool_calls": last.get("greedy_episode_tool_calls"),
            "reward": [r.get("reward_correct", r.get("reward_mean")) for r in train],
            "train_wall_s": round(sum(r["step_s"] for r in train), 1)}


def summarize(run_dirs: list[Path]) -> dict:
    """The rule (module doc) over the runs, paired by seed and problem."""
    final = seed_problem_matrix(run_dirs)
    initial = seed_problem_matrix(run_dirs, step=0)
    gain = paired_bootstrap(final, initial).as_dict()
    return {"gain": gain, "initial_accuracy": round(float(initial.mean()), 4),
            "final_accuracy": round(float(final.mean()), 4),
            "improves": bool(gain["low"] is not None and gain["low"] > 0),
            "seeds": int(final.shape[0]), "problems": int(final.shape[1])}


def cmd_run(args) -> None:
    for seed in args.seeds:
        run_dir = Path(args.work_dir) / f"s{seed}"
        train_in_process(run_dir, train_command(seed, run_dir, args))


def cmd_report(args) -> dict:
    dirs = [Path(args.work_dir) / f"s{s}" for s in args.seeds]
    runs = {str(d): read_run(d) for d in dirs}
    summary = summarize(dirs)
    from rl.envs.sandbox import sandbox_info

    res = {"headline": {"metric": f"SmolLM2-135M greedy accuracy with the Python tool, after - "
                                  f"before {args.steps} GRPO steps ({args.dataset}, paired, "
                                  f"{summary['problems']} problems x {summary['seeds']} seeds)",
                        "value": summary["gain"]["value"], "target": 0.0,
                        "improves": summary["improves"], "machine": machine()},
           "rule": __doc__.split("The rule, written before the runs.")[1].strip(),
           "dataset": args.dataset, "steps": args.steps, "seeds": list(args.seeds),
           "summary": summary, "runs": runs, "sandbox": sandbox_info(),
           "command": "python -m experiments.repro.python_tool_grpo " + " ".join(sys.argv[1:])}
    atomic_write_json(args.out, res)
    plot(res, Path(args.out).with_suffix(".png"))
    if Path(args.out) == OUT:
        write_docs(res)
    print(json.dumps(res["headline"], indent=1))
    return res


def plot(res: dict, path: Path) -> None:
    from experiments.common.plots import plt, save_png

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for run in res["runs"].values():
        seed = Path(run["run_dir"]).name
        a.plot(range(1, len(run["reward"]) + 1), run["reward"], ".-", label=seed)
        b.plot([0, run["final_step"]], [run["initial_accuracy"], run["final_accuracy"]], "o-",
               label=seed)
    a.set(xlabel="step", ylabel="batch reward (correct)", title="GRPO on --env python")
    b.set(xlabel="step", ylabel="greedy accuracy with the tool",
          title=f"{res['summary']['problems']} held-out problems")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    save_png(fig, path)


def fmt_ci(est: dict) -> str:
    return f"{est['value']:+.3f} [{est['low']:+.3f}, {est['high']:+.3f}]"


def index_row(res: dict) -> str:
    s = res["summary"]
    return (f"| [{TITLE}](python-tool-grpo.md) | SmolLM2-135M, {res['steps']} GRPO steps on "
            f"{res['dataset']} with the sandboxed tool, {s['seeds']} seed(s): greedy accuracy "
            f"{s['initial_accuracy']:.3f} → {s['final_accuracy']:.3f} on {s['problems']} "
            "held-out "
            f"problems (paired gain {fmt_ci(s['gain'])}) | gain > 0 (95 % CI) | "
            f"{'met' if s['improves'] else 'not shown'} |")


def render_page(res: dict) -> str:
    """docs/results/python-tool-grpo.md, every number from the JSON."""
    s = res["summary"]

    def calls(x):
        return "–" if x is None else f"{x:.2f}"
    rows = "\n".join(
        f"| {Path(r['run_dir']).name} | {r['initial_accuracy']:.3f} | {r['final_accuracy']:.3f} | "
        f"{calls(r['initial_tool_calls'])} → {calls(r['final_tool_calls'])} | "
        + ", ".join("–" if x is None else f"{x:.2f}" for x in r["reward"])
        + f" | {r['train_wall_s']:.0f} |" for r in res["runs"].values())
    verdict = ("GRPO improves the tool-using model: the interval is above 0." if s["improves"]
               else "Not shown: the interval reaches 0 or below.")
    if s["seeds"] == 1:
        verdict += (" With 1 seed so far the interval resamples the problems only, not the "
                    "training run: the result is one run's, and the driver resumes with more "
                    "seeds (`run --seeds 0 1 2`).")
    elif s["seeds"] < 3:
        verdict += (f" {s['seeds']} seeds so far (the interval resamples seeds and problems; "
                    "the project's rule for a learning result wants at least 3: `run --seeds "
                    "0 1 2` adds the rest).")
    return f"""# The sandboxed Python tool after GRPO

<!-- generated by `python -m experiments.repro.python_tool_grpo report` from
experiments/results/python_tool_grpo.json; do not edit by hand -->

SmolLM2-135M-Instruct trained with GRPO on `--env python` ({res['dataset']}): every
```` ```python ```` block the model writes runs in the sandbox (isolation on this machine:
`{res['sandbox']['isolation']}`) and its output comes back as the next message. The untrained
model is on [Python tool, base model](python-tool.md); here each seed trains
{res['steps']} steps and is evaluated greedily, with the tool, on the same
{s['problems']} held-out problems at step 0 and at the end.

The rule, written before the runs (`experiments/repro/python_tool_grpo.py`):

{res['rule']}

| run | accuracy, step 0 | final | tool calls per episode, step 0 → final | batch reward per step | training wall s |
|---|---|---|---|---|---|
{rows}

Over {s['seeds']} seed(s) x {s['problems']} problems: {s['initial_accuracy']:.3f} →
{s['final_accuracy']:.3f}, paired gain {fmt_ci(s['gain'])}. {verdict}

![batch reward per step and accuracy before / after](../../experiments/results/python_tool_grpo.png)

Machine: {res['headline']['machine']}. Command: `{res['command']}` after
`python -m experiments.repro.python_tool_grpo run` with the same seeds.
"""


def write_docs(res: dict) -> None:
    PAGE.write_text(render_page(res))
    replace_row(INDEX, index_row(res), TITLE, ROW_AFTER)


def cmd_docs(args) -> dict:
    res = json.loads(Path(args.out).read_text())
    write_docs(res)
    return res


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m experiments.repro.python_tool_grpo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("run", "report", "docs"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--dataset", default="basic_arithmetic")
    p.add_argument("--work-dir", default="runs/python_tool_grpo")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    return {"run": cmd_run, "report": cmd_report, "docs": cmd_docs}[args.command](args)


if __name__ == "__main__":
    main()
