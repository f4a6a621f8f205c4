"""Verifiable tasks: prompts with deterministic train/eval splits and reward functions.

A leaf: imports nothing else from `rl` (a task needs no model; tokenizers come in as
arguments). Single-turn tasks live here; multi-turn environments (an episode of model
turns and observations, tools) get their own leaf beside it, `rl.envs` (which
tests/test_layout.py already places: rollout and loops may import it).

    from rl.tasks import make_task
    task = make_task("synthetic", kind="reverse", length=4)
"""
from __future__ import annotations

from typing import Any, Callable

from rl.tasks.base import Prompt, Task, in_eval_split
from rl.tasks.synthetic import SyntheticTask

TASKS: dict[str, Callable[..., Any]] = {"synthetic": SyntheticTask}


def _arithmetic(**kw):
    from rl.tasks.arithmetic import ArithmeticTask  # needs no model, but keep imports light
    return ArithmeticTask(**kw)


TASKS["arithmetic"] = _arithmetic


def make_task(name: str, **kwargs) -> Task:
    """Build a registered task by name ("synthetic", "arithmetic")."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {sorted(TASKS)}")
    return TASKS[name](**kwargs)


__all__ = ["Prompt", "Task", "SyntheticTask", "TASKS", "make_task", "in_eval_split"]
