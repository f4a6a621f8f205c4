"""Prompt schedulers: which prompts to roll out next and how many rollouts each, from the
prompts' reward history (the interface between the task stream and the rollout side).

A leaf like rl.tasks: imports numpy and, from rl, nothing but rl.tasks (no model, no
loop); the loops import it.

  base     the PromptScheduler protocol (measure / select / update / follow_up / state /
           restore),
           uniform (today's behaviour: the next prompts of the stream, group_size each)
  dots     DOTS: every μ steps a random reference set is rolled out (measure), every
           prompt's adaptive difficulty predicted by attention-weighted similarity of
           prompt embeddings, μ·B prompts of moderate difficulty drawn
  dps      dynamics-predictive sampling: a hidden Markov model of each prompt's solving
           state with its own learned transitions, the predicted partially-solved first
  dars     DARS: extra rollouts for hard prompts in a second stage (the official ET / HW
           schedules), apportioned within a fixed budget

    from rl.schedulers import make_scheduler
    sched = make_scheduler("dps", prompts_per_step=8, group_size=8)
"""
from __future__ import annotations

from typing import Any

from rl.schedulers.base import Plan, PromptScheduler, UniformConfig, UniformScheduler
from rl.schedulers.dars import DarsConfig, DarsScheduler
from rl.schedulers.dots import DotsConfig, DotsScheduler
from rl.schedulers.dps import DpsConfig, DpsScheduler

SCHEDULERS = ("uniform", "dots", "dps", "dars")


def make_scheduler(name: str, *, embeddings: Any = None, **options) -> PromptScheduler:
    """A scheduler by name with its config's fields as keyword options (prompts_per_step,
    group_size, ...); "dots" also needs `embeddings` [P, h] (row = prompt id)."""
    if name == "uniform":
        return UniformScheduler(UniformConfig(**options))
    if name == "dps":
        return DpsScheduler(DpsConfig(**options))
    if name == "dars":
        return DarsScheduler(DarsConfig(**options))
    if name == "dots":
        if embeddings is None:
            raise ValueError("the dots scheduler needs prompt embeddings [P, h] (row = prompt "
                             "id); pass embeddings=...")
        return DotsScheduler(DotsConfig(**options), embeddings)
    raise ValueError(f"unknown prompt scheduler {name!r}; available: {list(SCHEDULERS)}")


__all__ = ["SCHEDULERS", "DarsConfig", "DarsScheduler", "DotsConfig", "DotsScheduler",
           "DpsConfig", "DpsScheduler", "Plan", "PromptScheduler", "UniformConfig",
           "UniformScheduler", "make_scheduler"]
