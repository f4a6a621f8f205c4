"""Evaluate a model on a task's eval split: accuracy with its standard error, every named
reward, pass@k, response lengths and truncation, a few example completions.

    python -m experiments.evaluate --model smollm2-135m --task reasoning_gym:chain_sum --n 256 --k 4
    python -m experiments.evaluate --model runs/tiny-synthetic --n 64        # a training run
    python -m experiments.evaluate --model model.Q8_0.gguf --task reasoning_gym:chain_sum \\
        --task-option max_new_tokens=256 --out eval.json

--model: a registered name (models.assets), a .gguf file, an HF directory, a training
run dir (model.json + checkpoints/: experiments.export.load_run, latest checkpoint or
--step; the task, its options and the seed default to the run's, so the eval split is the
one the run held out) or "tiny" (random init, for tokenizer-free tasks). --task: a
rl.tasks.make_task spec ("synthetic", "reasoning_gym:basic_arithmetic", "reasoning_gym:chain_sum=1,...").

The numbers come from rl.loops.sync.eval_report, the function the training loops'
periodic eval calls: one greedy response per prompt -> accuracy (mean of the task's
"correct" reward, else of the total reward) ± standard error, each reward's mean, mean
length, the fraction cut at the token budget; with --k K > 0 also K samples per prompt at
--temperature -> pass@K (fraction of prompts with a fully correct sample) and best-of-K.
Prints a table; writes the JSON report to --out (default for a run dir:
RUN_DIR/evals/step<N>-<task>.json).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from experiments.train_env import make_any_task
from rl.loops import eval_report
from rl.rollout import SamplingConfig
from rl.runtime.logging import atomic_write_json

SEGMENT_LEN = 32  # decode tokens per sampler call


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


def is_run_dir(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "model.json").is_file() and (p / "checkpoints").is_dir()


def load(args: argparse.Namespace) -> dict:
    """{"model_config", "params", "task", "task_spec", "task_options", "seed", "step",
    "kind"} for the command line (ValueError with a clear message otherwise)."""
    options = parse_options(args.task_option)
    meta, step, tokenizer = {}, None, None
    if is_run_dir(args.model):
        from experiments.export import load_run

        policy = load_run(args.model, args.step)
        config, params, tokenizer, meta, step = policy
        kind = "run"
    elif args.step is not None:
        raise ValueError(f"--step is for a training run dir; {args.model!r} is not one "
                         "(no model.json + checkpoints/)")
    elif args.model == "tiny":
        kind = "tiny"
    else:
        from models.assets import load_model

        config, params, tokenizer = load_model(args.model)
        kind = "model"
    spec = args.task or meta.get("task")
    if not spec:
        raise ValueError("--task is required (a rl.tasks.make_task spec, e.g. 'reasoning_gym:chain_sum')")
    if spec == meta.get("task"):
        options = {**(meta.get("task_options") or {}), **options}
    # a run's task split seed (model.json "task_seed", else its seed), so a run is
    # evaluated on the problems it held out
    seed = args.seed if args.seed is not None else int(meta.get("task_seed", meta.get("seed", 0)))
    kw = {} if tokenizer is None else {"tokenizer": tokenizer}
    task = make_any_task(spec, seed=seed, **kw, **options)  # an "env:NAME" spec too
    if kind == "tiny":
        from models.config import get_config
        from models.decoder import init_params

        if not hasattr(task, "vocab_size"):
            raise ValueError(f"--model tiny needs a tokenizer-free task with its own vocabulary "
                             f"(e.g. synthetic); {spec!r} has none")
        config = get_config("tiny", vocab_size=task.vocab_size)
        params = init_params(config, seed)
    vocab = getattr(task, "vocab_size", None)
    if tokenizer is None and vocab is not None and vocab > config.vocab_size:
        raise ValueError(f"task {spec!r} has {vocab} token ids but the model only "
                         f"{config.vocab_size} embeddings")
    return {"model_config": config, "params": params, "task": task, "task_spec": spec,
            "task_options": options, "seed": seed, "step": step, "kind": kind,
            "tokenizer": tokenizer is not None}


def _pm(value: float, err: float | None) -> str:
    return f"{value:.4f}" + ("" if err is None else f" ± {err:.4f}")


def format_report(r: dict) -> str:
    """The report as a text table plus its example completions."""
    mode = "greedy" if r["greedy"] else f"T={r['temperature']}"
    rows = [(f"accuracy ({r['accuracy_reward']}, {mode})", _pm(r["accuracy"], r["accuracy_stderr"])),
            ("reward (weighted total)", f"{r['reward']:.4f}")]
    rows += [(f"reward {name}", f"{v:.4f}") for name, v in r["rewards"].items()]
    rows += [("mean length (tokens)", f"{r['mean_length']:.1f}"),
             ("truncated (at budget, no stop)", f"{100 * r['truncated_frac']:.1f}%")]
    pk = r.get("pass_at_k")
    if pk:
        t = f"T={pk['temperature']}"
        rows += [(f"pass@{pk['k']} ({t})", _pm(pk["pass_at_k"], pk["pass_at_k_stderr"])),
                 (f"best-of-{pk['k']} accuracy ({t})", f"{pk['best_of_k']:.4f}"),
                 (f"sampled accuracy ({t}, {pk['n']} samples)",
                  _pm(pk["accuracy"], pk["accuracy_stderr"])),
                 (f"sampled mean length / truncated ({t})",
                  f"{pk['mean_length']:.1f} / {100 * pk['truncated_frac']:.1f}%")]
    step = "" if r.get("step") is None else f" (step {r['step']})"
    lines = [(f"model {r['model']}{step}  task {r['task']}  n={r['n']}  seed={r['seed']}  "
              f"max_new_tokens={r['max_new_tokens']}")]
    width = max(len(a) for a, _ in rows)
    lines += [f"  {a:<{width}}  {b}" for a, b in rows]
    for i, ex in enumerate(r["examples"]):
        rewards = ", ".join(f"{k}={v:g}" for k, v in ex["rewards"].items())
        lines.append(f"--- example {i}: {rewards}, {ex['length']} tokens"
                     + (" (truncated)" if ex["truncated"] else ""))
        if r.get("tokenizer", True):
            lines += [f"prompt:   {ex['prompt']}", f"response: {ex['response']!r}",
                      f"answer:   {ex['answer']}"]
        else:  # token ids mean nothing to a reader: the task's own rendering
            lines.append(ex["describe"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be >= 1 (eval prompts), got {args.n}")
    if args.k < 0:
        parser.error(f"--k must be >= 0 (0 skips pass@k), got {args.k}")
    if args.k and not args.temperature > 0:
        parser.error(f"--temperature must be > 0 for pass@k sampling, got {args.temperature}")
    if args.examples < 0 or args.max_slots < 1:
        parser.error("--examples must be >= 0 and --max-slots >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    t0 = time.perf_counter()
    try:
        got = load(args)
        task = got["task"]
        prompts = task.eval_prompts(args.n)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    budget = args.max_new_tokens or task.max_new_tokens
    report = eval_report(got["params"], 0, got["model_config"], task, prompts,
                         sampling=SamplingConfig(greedy=True), segment_len=min(SEGMENT_LEN, budget),
                         seed=got["seed"], k=args.k, temperature=args.temperature,
                         max_new_tokens=budget, examples=args.examples, max_slots=args.max_slots,
                         progress=not args.no_progress)
    out = {"model": args.model, "model_kind": got["kind"], "tokenizer": got["tokenizer"],
           "step": got["step"],
           "task": got["task_spec"], "task_options": got["task_options"], "seed": got["seed"],
           "max_new_tokens": budget, **report, "wall_s": round(time.perf_counter() - t0, 2)}
    print(format_report(out))
    path = args.out
    if path is None and got["kind"] == "run":
        slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", got["task_spec"])
        path = Path(args.model) / "evals" / f"step{got['step']}-{slug}.json"
    if path is not None:
        atomic_write_json(path, out)
        print(f"report written to {path}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
