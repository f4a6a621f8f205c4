"""Sampling groups of responses in the loops: `sample_groups` (a batch of prompts, N
samples each, through the rollout engine or, for an environment, multi-turn episodes),
`take_rows` (rows of a Trajectory on the host), `loop_time_limits` (an environment's
time limits from the LoopConfig) and `rollout_model_config` (the sampler's compute
dtype). Used by the synchronous loop (rl.loops.sync), the evaluation pass
(rl.loops.evaluator) and the asynchronous producer (rl.loops.producer).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from models.config import ModelConfig
from rl.loops import episodes
from rl.loops.config import LoopConfig
from rl.rollout.engine import RolloutConfig, RolloutEngine
from rl.rollout.multiturn import TimeLimits
from rl.rollout.pruning import Pruner
from rl.rollout.sampler_state import SamplingConfig
from rl.runtime.logging import NULL_PROFILE
from rl.runtime.preemption import abandon_point
from rl.tasks.base import Prompt, Task
from rl.trajectory import Trajectory, concat_trajectories


def take_rows(traj: Trajectory, rows: Sequence[int]) -> Trajectory:
    idx = np.asarray(rows, np.int64)
    return jax.tree.map(lambda x: np.asarray(x)[idx], traj)


def rollout_model_config(model_config: ModelConfig, compute_dtype: str | None) -> ModelConfig:
    """The sampler's model config: `model_config` with its compute dtype replaced by
    `compute_dtype` (LoopConfig.rollout_dtype; None: unchanged). The params are not cast:
    each layer casts its weights to the compute dtype as it uses them."""
    if compute_dtype is None or compute_dtype == model_config.dtype:
        return model_config
    return dataclasses.replace(model_config, dtype=compute_dtype)


def sample_groups(params: Any, version: int, model_config: ModelConfig, task: Task,
                  prompts: Sequence[Prompt], *, group_size: int, sampling: SamplingConfig,
                  segment_len: int, seed: int, first_group_id: int = 0,
                  max_new_tokens: int | None = None, profile=NULL_PROFILE,
                  pruner: Pruner | None = None, time_limits: TimeLimits | None = None,
                  layer_loop: str = "scan", bucket_slots: bool = False,
                  compute_dtype: str | None = None) -> Trajectory:
    """Sample `group_size` responses for each prompt with the rollout engine (all groups
    decode together). Rows come back grouped in prompt order: group g = prompts[g].
    first_group_id: the global index of prompts[0] (a process's shard of a batch): the
    rng keys follow the global group ids, the returned group ids stay 0..G-1.
    max_new_tokens: the response budget (default task.max_new_tokens). profile: a
    StepProfile that gets the engine's prefill_s / decode_s and the rest as host_s.
    pruner: online pruning in the engine (rl.rollout.pruning; None = off). time_limits: an
    environment's step / episode time limits (rl.rollout.multiturn.TimeLimits). A stop
    request inside an abandonable phase (rl.runtime.preemption) ends it between segments.
    layer_loop, bucket_slots: the engine's decode options (rl.rollout.RolloutConfig; same
    tokens). compute_dtype: the sampler's compute dtype (`rollout_model_config`; None: the
    model's)."""
    model_config = rollout_model_config(model_config, compute_dtype)
    if episodes.is_episodic(task):  # an environment: multi-turn episodes (rl.loops.episodes)
        return episodes.sample_episodes(
            params, version, model_config, task, prompts, group_size=group_size,
            sampling=sampling, segment_len=segment_len, seed=seed,
            first_group_id=first_group_id, profile=profile, pruner=pruner,
            time_limits=time_limits)
    if not prompts:
        raise ValueError("no prompts to sample: the prompt list is empty")
    t0 = time.perf_counter()
    rc = RolloutConfig(num_slots=len(prompts) * group_size, group_size=group_size,
                       segment_len=segment_len, max_prompt_len=task.max_prompt_len,
                       max_new_tokens=int(max_new_tokens or task.max_new_tokens),
                       sampling=sampling,
                       stop_ids=tuple(task.stop_ids), seed=int(seed),
                       first_group_id=int(first_group_id), layer_loop=layer_loop,
                       bucket_slots=bucket_slots)
    engine = RolloutEngine(model_config, rc, pruner=pruner)
    engine.submit([p.ids for p in prompts])
    parts = []
    while not engine.idle:
        abandon_point()
        engine.step(params, int(version))
        part = engine.harvest()
        if part is not None:
            parts.append(part)
    abandon_point()
    traj = parts[0] if len(parts) == 1 else concat_trajectories(parts)
    order = np.argsort(np.asarray(traj.group_ids), kind="stable")
    traj = take_rows(traj, order)
    traj = traj.replace(group_ids=np.asarray(traj.group_ids) - first_group_id)
    fill, dec = engine.timings["prefill_s"], engine.timings["decode_s"]
    profile.add("prefill_s", fill)
    profile.add("decode_s", dec)
    profile.add("host_s", time.perf_counter() - t0 - fill - dec)
    return traj


def loop_time_limits(loop: LoopConfig) -> TimeLimits:  # an environment's, from the loop's
    return TimeLimits(step_s=loop.env_step_timeout_s, episode_s=loop.episode_timeout_s)
