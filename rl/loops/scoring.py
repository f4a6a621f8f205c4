"""The task rewards of sampled rows, as the loops score them (exported by rl.loops).

    score          {name: [B] float64} of a Trajectory's rows: the task's reward function
                   per response, validated (names, numbers, finiteness); an environment's
                   episodes (rl.loops.episodes) carry their outcomes instead
    total_reward   the named rewards combined with TrainConfig.reward_weights
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rl.learner.batch import NonFiniteError
from rl.learner.config import TrainConfig
from rl.loops import episodes
from rl.tasks.base import Prompt, Task
from rl.trajectory import Trajectory


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
    w = dict(config.reward_weights)
    return sum(w.get(n, 1.0) * v for n, v in rewards.items())
