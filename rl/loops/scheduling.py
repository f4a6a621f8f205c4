"""The prompt scheduler (rl.schedulers) inside the synchronous loop: which train prompts
a step samples, and the rewards it learns from.

    options = SchedulerOptions("dps", pool_size=256)
    source = make_prompt_source(options, task, loop, params)
    prompts, data_position = source.next(step, data_position)   # the step's prompts
    source.record(prompts, group_rewards)   # their "correct" rewards (else weighted totals)

"uniform" takes the next prompts_per_step prompts of the train stream from the data
position, exactly as the loop always did (same prompts, same order: bit-identical runs).
"dps" and "dots" choose among a fixed pool, the first `pool_size` prompts of the train
stream (prompt id = stream position), so a prompt's history accumulates; the data
position still advances by prompts_per_step per step (prompts consumed). DOTS's frozen
encoder here is the mean of the initial policy's input-embedding rows over the prompt's
tokens, and its reference set the pool's first `reference_size` prompts.
"dars" gives prompts groups of different sizes, which the loop's fixed-shape batch does
not take yet: asking for it is a ValueError.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rl.schedulers import SCHEDULERS, PromptScheduler, make_scheduler
from rl.tasks.base import Prompt, Task

LOOP_SCHEDULERS = ("uniform", "dots", "dps")


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
    """name: "uniform" | "dots" | "dps"; pool_size: the candidate pool (dots, dps);
    reference_size / reference_per_step: DOTS's K and the reference prompts re-measured
    per step; temperature: DOTS's τ; forgetting: DPS's λ."""

    name: str = "uniform"
    pool_size: int = 256
    reference_size: int = 16
    reference_per_step: int = 1
    temperature: float = 0.1
    forgetting: float = 1.0

    def __post_init__(self):
        if self.name not in SCHEDULERS:
            raise ValueError(f"unknown prompt scheduler {self.name!r}; available: "
                             f"{list(SCHEDULERS)}")
        if self.name not in LOOP_SCHEDULERS:
            raise ValueError(f"the {self.name!r} scheduler gives prompts groups of different "
                             "sizes, which the synchronous loop's fixed-shape batch does not "
                             f"take yet; use one of {list(LOOP_SCHEDULERS)}")
        for field, low in (("pool_size", 1), ("reference_size", 1), ("reference_per_step", 0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"SchedulerOptions.{field} must be an int >= {low}, got {v!r}")
        if self.name == "dots" and self.reference_size > self.pool_size:
            raise ValueError(f"SchedulerOptions.reference_size {self.reference_size} exceeds "
                             f"pool_size {self.pool_size}")


def prompt_embeddings(params: Any, prompts: Sequence[Prompt]) -> np.ndarray:
    """[P, h] float64: the mean input-embedding row over each prompt's token ids."""
    try:
        table = np.asarray(params["embed"]["embedding"], np.float64)
    except (KeyError, TypeError):
        raise ValueError("dots in the loop embeds prompts with the policy's input embedding "
                         "params['embed']['embedding'], which these params lack") from None
    return np.stack([table[np.asarray(p.ids, np.int64)].mean(axis=0) for p in prompts])


class PromptSource:
    """A scheduler bound to a task's train stream (see the module docstring)."""

    def __init__(self, scheduler: PromptScheduler, task: Task, prompts_per_step: int,
                 pool: list[Prompt] | None):
        self.scheduler, self.task, self.pool = scheduler, task, pool
        self.prompts_per_step = prompts_per_step

    def next(self, step: int, data_position: int) -> tuple[list[Prompt], int]:
        """The step's prompts (in the scheduler's order) and the advanced data position."""
        b = self.prompts_per_step
        if self.pool is None:
            stream = self.task.train_prompts(data_position, b)
            plan = self.scheduler.select(step, [p.index for p in stream])
            by_id = {p.index: p for p in stream}
        else:
            plan = self.scheduler.select(step, list(range(len(self.pool))))
            by_id = dict(enumerate(self.pool))
        group_size = self.scheduler.config.group_size
        if len(plan) != b or any(n != group_size for _, n in plan):
            raise ValueError(f"scheduler {self.scheduler.name!r} planned {plan}; the loop "
                             f"needs {b} prompts of {group_size} rollouts each")
        return [by_id[pid] for pid, _ in plan], data_position + b

    def record(self, prompts: Sequence[Prompt], rewards: Sequence[np.ndarray]) -> None:
        self.scheduler.update([p.index for p in prompts], rewards)


def make_prompt_source(options: SchedulerOptions, task: Task, loop: Any, params: Any,
                       seed: int = 0) -> PromptSource:
    """The PromptSource of `options` for a LoopConfig-like `loop` (prompts_per_step,
    group_size); `params`: the initial policy (DOTS's embeddings)."""
    b, n = loop.prompts_per_step, loop.group_size
    if options.name != "uniform" and (loop.dynamic_sampling or jax.process_count() > 1):
        raise ValueError(f"the {options.name!r} prompt scheduler runs without dynamic "
                         "sampling, in one process; drop one of them")
    if options.name == "uniform":
        return PromptSource(make_scheduler("uniform", prompts_per_step=b, group_size=n),
                            task, b, None)
    if options.pool_size < b:
        raise ValueError(f"SchedulerOptions.pool_size {options.pool_size} is below "
                         f"prompts_per_step {b}")
    pool = task.train_prompts(0, options.pool_size)
    if options.name == "dps":
        sched = make_scheduler("dps", prompts_per_step=b, group_size=n,
                               forgetting=options.forgetting, seed=seed)
    else:
        sched = make_scheduler("dots", embeddings=prompt_embeddings(params, pool),
                               reference_ids=tuple(range(options.reference_size)),
                               prompts_per_step=b, group_size=n,
                               reference_per_step=min(options.reference_per_step, b),
                               temperature=options.temperature, seed=seed)
    return PromptSource(sched, task, b, pool)
