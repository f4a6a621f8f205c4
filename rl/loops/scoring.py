"""The rewards of sampled rows, as the loops score and summarise them (exported by rl.loops).

    score                 {name: [B] float64} of a Trajectory's rows: the task's reward
                          function per response, validated (names, numbers, finiteness); an
                          environment's episodes (rl.loops.episodes) carry their outcomes
    total_reward          the named rewards combined with TrainConfig.reward_weights
    accuracy_name         which reward accuracy (and a scheduler's signal) is read from:
                          "correct" when the task has it, else "reward" (the weighted total)
    zero_spread_fraction  the share of groups whose rewards are all equal (no GRPO signal)
    batch_reward_metrics  a train batch's reward metrics (its zero-spread fraction)
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl.learner.batch import NonFiniteError
from rl.learner.config import TrainConfig
from rl.loops import episodes
from rl.tasks.base import Prompt, Task
from rl.trajectory import Trajectory

ACCURACY_REWARD = "correct"  # the named reward accuracy is read from, when a task has it


def score(task: Task, prompts: Sequence[Prompt], traj: Trajectory) -> dict[str, np.ndarray]:
    """Task rewards for every row of `traj` (row's prompt = prompts[group_id]) as
    {name: [B] float64}. ValueError if the task returns other names than its
    reward_names, or a NaN / inf / non-number. Episodes: their outcomes (rl.loops.episodes)."""
    if episodes.is_episodic(task):
        return episodes.episode_rewards(task, traj)
    names = tuple(task.reward_names)
    b = traj.batch_size
    out = {n: np.zeros((b,), np.float64) for n in names}
    gids = np.asarray(traj.group_ids)
    resp, mask = np.asarray(traj.response_ids), np.asarray(traj.response_mask)
    for i in range(b):
        prompt = prompts[int(gids[i])]
        r = task.reward(prompt, resp[i, :int(mask[i].sum())].tolist())
        if set(r) != set(names):
            raise ValueError(f"task {task.name!r} returned rewards {sorted(r)} for row {i}, "
                             f"expected exactly {sorted(names)}")
        for n in names:
            v = r[n]
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"reward {n!r} of row {i} is not a number: {v!r}") from None
            if not math.isfinite(f):
                raise NonFiniteError(f"reward {n!r} of row {i} (group {int(gids[i])}) is {f} "
                                     "(NaN/inf): the task's reward function must return finite "
                                     "numbers")
            out[n][i] = f
    return out


def total_reward(rewards: dict[str, np.ndarray], config: TrainConfig) -> np.ndarray:
    """The named rewards [B] combined with config.reward_weights (missing weights are 1)."""
    w = dict(config.reward_weights)
    return sum(w.get(n, 1.0) * v for n, v in rewards.items())


def accuracy_name(reward_names: Sequence[str]) -> str:
    """The reward accuracy is computed from: "correct" if the task has it, else "reward"
    (the weighted total)."""
    return ACCURACY_REWARD if ACCURACY_REWARD in tuple(reward_names) else "reward"


def zero_spread_fraction(total: Any, group_size: int) -> float:
    """total [G * N] rewards (groups = contiguous blocks of N) -> the fraction of groups
    whose rewards are all equal (no GRPO learning signal)."""
    r = np.asarray(total, np.float64).reshape(-1)
    if group_size < 1 or r.size == 0 or r.size % group_size:
        raise ValueError(f"zero_spread_fraction: {r.size} rewards do not split into groups of "
                         f"{group_size}")
    g = r.reshape(-1, group_size)
    return float(np.mean(g.max(axis=1) - g.min(axis=1) == 0.0))


def batch_reward_metrics(reward_names: Sequence[str], rewards: Any, group_size: int,
                         reward_weights: Mapping[str, float] | None = None) -> dict:
    """Train metrics of a batch's rewards [B, K] (columns = reward_names):
    zero_spread_frac of the weighted total (missing weights are 1)."""
    w = dict(reward_weights or {})
    cols = np.asarray(rewards, np.float64).reshape(-1, len(reward_names))
    total = cols @ np.asarray([w.get(n, 1.0) for n in reward_names], np.float64)
    return {"zero_spread_frac": zero_spread_fraction(total, group_size)}
