"""Evaluate a model on a task's eval split: accuracy with its standard error, every named
reward, pass@k, response lengths and truncation, a few example completions.

    python -m experiments.evaluate --model smollm2-135m --task reasoning_gym:chain_sum --n 256 --k 4
    python -m experiments.evaluate --model runs/tiny-synthetic --n 64        # a training run
    python -m experiments.evaluate --model model.Q8_0.gguf --task reasoning_gym:chain_sum \\
        --task-option max_new_tokens=256 --out eval.json
    python -m experiments.evaluate --model checkpoints/Qwen2.5-0.5B-Instruct \\
        --task file:data/test.jsonl --verifier numeric --reward my_rewards:score

--model: a registered name (models.assets), a .gguf file, an HF directory, a training
run dir (model.json + checkpoints/: rl.run.load_run, latest checkpoint or --step; the
task, its options and the seed default to the run's, so the eval split is the one the run
held out) or "tiny" (random init, for tokenizer-free tasks). --task: a rl.tasks.make_task
spec ("synthetic", "reasoning_gym:basic_arithmetic", "reasoning_gym:chain_sum=1,...") or
"env:NAME" or a prompt file "file:PATH" (rl.tasks.file_task). --verifier names what
"correct" is and --reward adds your reward function (rl.tasks.rewards), as in training; a
run dir's own reward settings (its run_config.json) apply when its task is evaluated.

The report is rl.run.evaluate's (the numbers come from rl.loops.evaluation.eval_report, the
function the training loops' periodic eval calls): one greedy response per prompt ->
accuracy (mean of the task's "correct" reward, else of the total reward) ± standard
error, each reward's mean, mean length, the fraction cut at the token budget; with --k
K > 0 also K samples per prompt at --temperature -> pass@K and best-of-K. Prints a table;
writes the JSON report to --out (default for a run dir: RUN_DIR/evals/step<N>-<task>.json).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rl.loops.config import RewardConfig
from rl.run.evaluation import EvalOptions, default_report_path, evaluate, format_report
from rl.runtime.logging import atomic_write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.evaluate",
                                description="Evaluate a model on a task's eval split.")
    p.add_argument("--model", required=True, help="registered name, FILE.gguf, HF dir, training "
                   "run dir (model.json + checkpoints/) or 'tiny' (random init)")
    p.add_argument("--step", type=int, help="run dir: checkpoint step (default: the latest)")
    p.add_argument("--task", help="task spec for rl.tasks.make_task (default for a run dir: its "
                   "task)")
    p.add_argument("--task-option", action="append", default=[], metavar="K=V",
                   help="task option (JSON value or string), repeatable")
    p.add_argument("--verifier", choices=("strict", "dataset", "exact", "numeric", "math",
                                          "regex"),
                   help="what 'correct' is (default: the task's, or the run's)")
    p.add_argument("--reward", metavar="MODULE:FUNCTION",
                   help="your reward function fn(prompt, response, entry) -> {name: float}")
    p.add_argument("--n", type=int, default=256, help="eval prompts (default 256)")
    p.add_argument("--k", type=int, default=0, help="samples per prompt for pass@k (0: skip)")
    p.add_argument("--temperature", type=float, default=1.0, help="pass@k temperature")
    p.add_argument("--max-new-tokens", type=int, help="response budget (default: the task's)")
    p.add_argument("--seed", type=int, help="task split and sampling seed (default: the run's "
                   "seed, else 0)")
    p.add_argument("--examples", type=int, default=4, help="example completions to show/save")
    p.add_argument("--max-slots", type=int, default=256, help="responses decoded at once")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def parse_options(items: list[str]) -> dict[str, Any]:
    """["k=v", ...] -> {k: JSON value of v, or v as a string}."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--task-option takes KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    reward = None
    if args.verifier or args.reward:
        reward = RewardConfig(verifier=args.verifier, function=args.reward)
    try:
        options = EvalOptions(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              examples=args.examples, max_slots=args.max_slots,
                              progress=not args.no_progress, reward=reward)
        report = evaluate(args.model, task=args.task, task_options=parse_options(args.task_option),
                          n=args.n, k=args.k, seed=args.seed, step=args.step, options=options)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    print(format_report(report))
    path = args.out or default_report_path(report)
    if path is not None:
        atomic_write_json(path, report)
        print(f"report written to {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
