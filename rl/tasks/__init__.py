"""Verifiable tasks: prompts with deterministic train/eval splits and reward functions.

A leaf: imports nothing else from `rl` (a task needs no model; tokenizers come in as
arguments). Single-turn tasks live here; multi-turn environments (an episode of model
turns and observations, tools) get their own leaf beside it, `rl.envs` (which
tests/test_layout.py already places: rollout and loops may import it).

  base           the Task protocol, Prompt, the hash split
  synthetic      token-level tasks a tiny random model learns from scratch
  reasoning_gym  any reasoning-gym dataset or weighted mixture, by name (rewards
                 "correct" via a strict verifier, "format" = one final \\boxed{}, the
                 dataset's own partial-credit score logged as "dataset")
  file_task      a prompt file of your own (JSONL, JSON, CSV, Parquet): column mapping,
                 GSM8K / \\boxed{} answer parsing, hashed or two-file split
  verifiers      named verifiers (exact, numeric, math, regex) and the answer parsers
  rewards        a user's reward function ("module:function" or registered) with a time
                 limit and checked results, wrapped around any single-turn task
  math_answers   final-\\boxed{} extraction and math-verify equality with a timeout
  callables      a callable named 'module:name' / 'file.py:name' (reward functions,
                 environment factories)

    from rl.tasks import make_task
    task = make_task("synthetic", kind="reverse", length=4)
    task = make_task("reasoning_gym:chain_sum=1,leg_counting=1", tokenizer=tok)
    task = make_task("file:data/train.jsonl", tokenizer=tok, answer="solution")
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl.tasks.base import Prompt, Task, in_eval_split
from rl.tasks.synthetic import SyntheticTask

TASKS: dict[str, Callable[..., Any]] = {"synthetic": SyntheticTask}


def _reasoning_gym(datasets: Any = None, **kw):
    from rl.tasks.reasoning_gym import make_reasoning_gym_task  # imports reasoning-gym

    if not datasets:
        raise ValueError("reasoning_gym needs datasets: write 'reasoning_gym:NAME' or "
                         "'reasoning_gym:NAME=WEIGHT,NAME=WEIGHT'")
    return make_reasoning_gym_task(datasets, **kw)


def _file(path: str = "", **kw):
    from rl.tasks.file_task import make_file_task  # imports HF datasets when it reads

    return make_file_task(path, **kw)


TASKS["reasoning_gym"] = _reasoning_gym
TASKS["file"] = _file


def make_task(spec: str, **kwargs) -> Task:
    """Build a task from a spec: a registered name ("synthetic", "reasoning_gym", "file")
    or "name:args", e.g. "reasoning_gym:basic_arithmetic" or
    "reasoning_gym:chain_sum=1,leg_counting=1" (the part after ':' is the task's
    `datasets`), "file:PATH" (a prompt file: rl.tasks.file_task; the path is kept as
    written). kwargs: the task's options (tokenizer, seed, dataset options, ...)."""
    if spec.startswith("file:"):
        return TASKS["file"](spec[len("file:"):], **kwargs)
    name, _, rest = spec.replace(" ", "").partition(":")
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {sorted(TASKS)}")
    if rest:
        if name != "reasoning_gym":
            raise ValueError(f"task {name!r} takes no ':' arguments (got {spec!r})")
        kwargs = {"datasets": rest, **kwargs}
    return TASKS[name](**kwargs)


__all__ = ["TASKS", "Prompt", "SyntheticTask", "Task", "in_eval_split", "make_task"]
