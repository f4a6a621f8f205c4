"""DARS: difficulty-adaptive rollout sampling (Yang et al., "Depth-Breadth Synergy in RLVR:
Unlocking LLM Reasoning Gains with Adaptive Exploration", 2025; official code
yangzhch6/DARS, verl/trainer/ppo/ray_dars_trainer.py, `resample_func1` / `resample_func2`
selected by data.resampling_func, and experiments/DARS-*.sh): more rollouts for hard
prompts in a second stage.

Why: the official runs use un-normalised group advantages Â_i = r_i − mean(r)
(algorithm.grpo_use_std=False). With binary rewards a group of N rollouts at accuracy a
then has cumulative advantage Σ_i |Â_i| = 2 N a (1 − a), largest at a = 1/2: low-accuracy
(hard) prompts are under-weighted. DARS per step:

  stage 1: n rollouts for each of the B prompts; accuracy â_j = mean reward of prompt j
  stage 2: N_j − n more rollouts of prompt j, N_j from a re-balancing schedule:
    equal treatment (ET, resampling_func=1): lift a hard prompt's cumulative advantage to
        that of a = 1/2 with n rollouts, 2 N_j â_j (1 − â_j) = n / 2, i.e.
        N_j = min(N_max, round(n / (4 â_j (1 − â_j)))),  N_j = N_max at â_j = 0;
        for n = 8, N_max = 32 this is exactly the official table (â = 0, 1/8, 2/8, 3/8 ->
        32, 18, 11, 9 rollouts; 8 from â = 4/8 up).
    hardness weighted (HW, resampling_func=2): the official table for n = 8, N_max = 48:
        â = 0, <= 1/8, <= 2/8, <= 3/8 -> 48, 24, 12, 9 rollouts, else 8. No closed form is
        given in the code and we could not check the paper's text; for n != 8 we scale
        the table by n/8 (our extension).
  Only hard prompts (â_j < `hard_below` = 1/2) get extra rollouts (both tables give N_j = n
  from â = 4/8 up). N_max (algorithm.n_max: 32 for ET, 48 for HW in the official scripts)
  = n + max_extra here (default max_extra: 3n for ET, 5n for HW).
  The official trainer pools each prompt's n + (N_j − n) rollouts into ONE group (same
  uid) and drops groups whose pooled accuracy is 0 or 1 before the update.

Our adaptations (the learner needs a fixed batch shape): a step spends exactly T
rollouts (`budget`). Stage 1 takes B·n; the remaining E = T − B·n are apportioned over
the prompts in proportion to their schedule's wanted Δn_j = N_j − n by the
largest-remainder rule (Σ_j Δn_j = E exactly, a harder prompt never gets fewer than an
easier one); if no prompt is hard the E rollouts are spread evenly. The official trainer
instead spends Σ_j (N_j − n), a number that varies from step to step.

Whole groups (`unit`): with unit = u the E extra rollouts are apportioned in blocks of u
(E/u blocks by the same rule, each prompt's Δn_j a multiple of u). The synchronous loop
uses u = n, so each extra block is one more group of n rollouts of the same prompt with
its own group-normalised advantages (not pooled with stage 1), and every batch has the
fixed shape T/n groups (rl.loops.scheduling).

Hyper-parameters (DarsConfig): B = prompts_per_step, n = group_size (8 officially), T =
budget (default 2·B·n), N_max − n = max_extra, the schedule ("et" | "hw"), the hardness
threshold 1/2 (`hard_below`), u = unit.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.schedulers.base import Plan, check_float, check_int, check_updates

SCHEDULES = ("et", "hw")
# the official resample_func2 (HW) for n = 8: accuracy upper bounds -> total rollouts
HW_TABLE = ((0.0, 48), (1 / 8, 24), (2 / 8, 12), (3 / 8, 9))
DEFAULT_EXTRA = {"et": 3, "hw": 5}  # N_max = (1 + this) · n: 32 and 48 for n = 8


def _round_half_up(x: np.ndarray) -> np.ndarray:
    return np.floor(np.asarray(x, np.float64) + 0.5)


def schedule_total(accuracy: np.ndarray, n: int, schedule: str, n_max: int,
                   hard_below: float = 0.5) -> np.ndarray:
    """N_j [B]: the schedule's total rollouts per prompt (both stages) from the stage-1
    accuracies; n for prompts at or above `hard_below`."""
    a = np.asarray(accuracy, np.float64)
    if schedule == "et":
        with np.errstate(divide="ignore"):
            want = np.where(a > 0, _round_half_up(n / (4.0 * a * (1.0 - a))), np.inf)
    elif schedule == "hw":
        want = np.full_like(a, float(n))
        for bound, total in reversed(HW_TABLE):  # the tightest bound wins
            want = np.where(a <= bound + 1e-6, _round_half_up(total * n / 8.0), want)
    else:
        raise ValueError(f"unknown DARS schedule {schedule!r}; use one of {SCHEDULES}")
    return np.where(a < hard_below, np.clip(want, n, n_max), float(n))


def schedule_extra(accuracy: np.ndarray, n: int, schedule: str, max_extra: int = 0,
                   hard_below: float = 0.5) -> np.ndarray:
    """The schedule's wanted extra rollouts Δn_j = N_j − n [B] (before the budget), 0 for
    prompts at or above `hard_below`; max_extra = N_max − n (0: the schedule's default)."""
    extra = max_extra or DEFAULT_EXTRA.get(schedule, 0) * n
    return schedule_total(accuracy, n, schedule, n + extra, hard_below) - n


def apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers [B] >= 0 summing to `total`, proportional to `weights` (>= 0) by the
    largest-remainder rule (ties to the lower index); equal shares if all weights are 0."""
    w = np.asarray(weights, np.float64)
    if (w < 0).any() or not np.isfinite(w).all():
        raise ValueError(f"apportion: weights must be finite and >= 0, got {w}")
    if w.sum() <= 0:
        w = np.ones_like(w)
    quota = total * w / w.sum()
    out = np.floor(quota).astype(np.int64)
    rest = int(total - out.sum())
    order = np.lexsort((np.arange(w.size), -(quota - out)))
    out[order[:rest]] += 1
    return out


def dars_allocation(accuracy: np.ndarray, n: int, extra_budget: int, schedule: str = "et",
                    max_extra: int = 0, hard_below: float = 0.5) -> np.ndarray:
    """Stage-2 rollouts per prompt [B] (ints summing to extra_budget) from the stage-1
    accuracies."""
    return apportion(int(extra_budget),
                     schedule_extra(accuracy, n, schedule, max_extra, hard_below))


@dataclasses.dataclass(frozen=True)
class DarsConfig:
    """See the module docstring for the symbols. budget: rollouts per step, both stages
    (0 = 2 · prompts_per_step · group_size); unit: extra rollouts come in blocks of it
    (budget − prompts_per_step · group_size must be a multiple)."""

    prompts_per_step: int = 8
    group_size: int = 8
    budget: int = 0
    schedule: str = "et"
    max_extra: int = 0
    hard_below: float = 0.5
    unit: int = 1

    def __post_init__(self):
        b = check_int("DarsConfig", "prompts_per_step", self.prompts_per_step, 1)
        n = check_int("DarsConfig", "group_size", self.group_size, 1)
        t = check_int("DarsConfig", "budget", self.budget, 0)
        if t == 0:
            object.__setattr__(self, "budget", 2 * b * n)
        elif t < b * n:
            raise ValueError(f"DarsConfig.budget={t} is below stage 1's prompts_per_step * "
                             f"group_size = {b * n}; raise it or use 0 (= twice stage 1)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"DarsConfig.schedule must be one of {SCHEDULES}, got "
                             f"{self.schedule!r}")
        check_int("DarsConfig", "max_extra", self.max_extra, 0)
        check_float("DarsConfig", "hard_below", self.hard_below, 0.0, 1.0, low_open=True)
        u = check_int("DarsConfig", "unit", self.unit, 1)
        if (self.budget - b * n) % u:
            raise ValueError(f"DarsConfig: the extra budget budget - prompts_per_step * "
                             f"group_size = {self.budget - b * n} is not a multiple of unit={u}; "
                             "make the budget a whole number of units")


class DarsScheduler:
    """Stage 1 = the first prompts_per_step candidates (stream order), group_size each;
    `update` with stage 1's rewards, then `follow_up` gives stage 2; rewards of stage-2
    rollouts passed to `update` afterwards are accepted and not used."""

    name = "dars"

    def __init__(self, config: DarsConfig = DarsConfig()):
        self.config = config
        self.pending_ids: list[int] = []
        self.pending_accuracy: list[float] = []
        self.awaiting_stage1 = False

    def measure(self, step: int, candidates: Sequence[int]) -> list[int]:
        return []

    def select(self, step: int, candidates: Sequence[int]) -> Plan:
        c = self.config
        if len(candidates) < c.prompts_per_step:
            raise ValueError(f"dars: {len(candidates)} candidates offered, the batch needs "
                             f"prompts_per_step={c.prompts_per_step}")
        self.pending_ids, self.pending_accuracy = [], []
        self.awaiting_stage1 = True
        return [(int(q), c.group_size) for q in candidates[:c.prompts_per_step]]

    def update(self, prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]) -> None:
        pairs = check_updates(prompt_ids, rewards)
        if not self.awaiting_stage1:
            return
        self.pending_ids = [pid for pid, _ in pairs]
        self.pending_accuracy = [float(np.clip(r, 0.0, 1.0).mean()) for _, r in pairs]
        self.awaiting_stage1 = False

    def follow_up(self, step: int) -> Plan:
        c = self.config
        if self.awaiting_stage1 or not self.pending_ids:
            raise ValueError("dars: follow_up needs stage 1's rewards first: call select, "
                             "sample, then update with the rewards, then follow_up")
        extra = c.unit * dars_allocation(np.asarray(self.pending_accuracy), c.group_size,
                                         (c.budget - c.prompts_per_step * c.group_size) // c.unit,
                                         c.schedule, c.max_extra, c.hard_below)
        plan = [(pid, int(k)) for pid, k in zip(self.pending_ids, extra) if k > 0]
        self.pending_ids, self.pending_accuracy = [], []
        return plan

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "pending_ids": list(self.pending_ids),
                "pending_accuracy": list(self.pending_accuracy),
                "awaiting_stage1": self.awaiting_stage1}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"dars: cannot restore the state of scheduler {state.get('name')!r}")
        self.pending_ids = [int(i) for i in state["pending_ids"]]
        self.pending_accuracy = [float(a) for a in state["pending_accuracy"]]
        self.awaiting_stage1 = bool(state["awaiting_stage1"])
