"""The prompt-scheduler interface between the task stream and the rollout side, and the
uniform scheduler (today's behaviour).

A scheduler sees each prompt's reward history and decides, every step, which prompts to
sample next and how many rollouts each gets:

    probe = scheduler.measure(step, candidates)   # prompts to roll out only to measure (DOTS)
    ... sample and score probe, scheduler.update(probe, their rewards) ...
    plan = scheduler.select(step, candidates)     # [(prompt id, n_rollouts), ...]
    ... sample and score plan ...
    scheduler.update(ids, rewards)                # one reward array per sampled group
    extra = scheduler.follow_up(step)             # further rollouts this step (DARS), or []

Prompt ids are ints the caller chooses (a train-stream position, or an index into a finite
prompt pool); `candidates` is the ids the caller offers this step. `state()` is the
scheduler's whole mutable state as plain JSON values (lists, floats, ints) and `restore`
puts it back, so a checkpoint holds it and a resumed run decides exactly as before.
Randomness comes from `np.random.default_rng([seed, step])`, never from hidden state, so
it needs no saving.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

Plan = list[tuple[int, int]]


@runtime_checkable
class PromptScheduler(Protocol):
    """Which prompts to roll out and how many rollouts each (see the module docstring)."""

    name: str

    def measure(self, step: int, candidates: Sequence[int]) -> list[int]: ...

    def select(self, step: int, candidates: Sequence[int]) -> Plan: ...

    def update(self, prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]) -> None: ...

    def follow_up(self, step: int) -> Plan: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


def check_int(owner: str, name: str, value: Any, minimum: int) -> int:
    """An int >= minimum, or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_float(owner: str, name: str, value: Any, low: float, high: float,
                low_open: bool = False) -> float:
    """A float in [low, high] ((low, high] with low_open), or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    v = float(value)
    if not (low < v if low_open else low <= v) or v > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{owner}.{name} must be in {bracket}{low}, {high}], got {v}")
    return v


def check_updates(prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]
                  ) -> list[tuple[int, np.ndarray]]:
    """Pair ids with their groups' rewards as float64 [n] arrays; ValueError on a length
    mismatch, an empty group or a non-finite reward."""
    if len(prompt_ids) != len(rewards):
        raise ValueError(f"update: {len(prompt_ids)} prompt ids but {len(rewards)} reward "
                         "groups; give one reward array per sampled prompt")
    out = []
    for pid, r in zip(prompt_ids, rewards):
        r = np.asarray(r, np.float64).reshape(-1)
        if r.size == 0 or not np.isfinite(r).all():
            raise ValueError(f"update: prompt {pid}'s rewards must be a non-empty array of "
                             f"finite numbers, got {r!r}")
        out.append((int(pid), r))
    return out


def distinct_ids(candidates: Sequence[int]) -> list[int]:
    """The candidates as ints, duplicates dropped, first occurrence order kept."""
    return list(dict.fromkeys(int(q) for q in candidates))


def sample_without_replacement(weights: np.ndarray, count: int, rng: np.random.Generator
                               ) -> np.ndarray:
    """`count` distinct indices drawn with probability proportional to `weights` (> 0)."""
    p = np.asarray(weights, np.float64)
    return rng.choice(p.size, size=count, replace=False, p=p / p.sum())


@dataclasses.dataclass(frozen=True)
class UniformConfig:
    """prompts_per_step: groups per batch; group_size: rollouts per prompt."""

    prompts_per_step: int = 8
    group_size: int = 8

    def __post_init__(self):
        check_int("UniformConfig", "prompts_per_step", self.prompts_per_step, 1)
        check_int("UniformConfig", "group_size", self.group_size, 1)


class UniformScheduler:
    """Today's behaviour: the first prompts_per_step candidates (the next prompts of the
    stream, in order), group_size rollouts each; it keeps no history."""

    name = "uniform"

    def __init__(self, config: UniformConfig = UniformConfig()):
        self.config = config

    def measure(self, step: int, candidates: Sequence[int]) -> list[int]:
        return []

    def select(self, step: int, candidates: Sequence[int]) -> Plan:
        b = self.config.prompts_per_step
        if len(candidates) < b:
            raise ValueError(f"uniform: {len(candidates)} candidates offered, the batch needs "
                             f"prompts_per_step={b}")
        return [(int(c), self.config.group_size) for c in candidates[:b]]

    def update(self, prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]) -> None:
        check_updates(prompt_ids, rewards)

    def follow_up(self, step: int) -> Plan:
        return []

    def state(self) -> dict[str, Any]:
        return {"name": self.name}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"uniform: cannot restore the state of scheduler "
                             f"{state.get('name')!r}")
