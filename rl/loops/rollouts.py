"""Sampling groups of responses in the loops.

    RolloutSpec     what every rollout of one run shares, built once (`rollout_spec`): the
                    task, the sampler's model config (its compute dtype), group size,
                    segment length, response budget, sampling, the decode options and an
                    environment's time limits; `engine(num_slots, seed, first_group_id)` is
                    the rl.rollout.RolloutConfig of one call
    sample_groups   a batch of prompts, N samples each, through the rollout engine (or, for
                    an environment, multi-turn episodes): rows grouped in prompt order
    take_rows       rows of a Trajectory on the host
    rollout_seed    split a raw rng key: (seed of one rollout, the key to keep); next_seed
                    the same on a TrainState's rng
    rollout_model_config  the sampler's model config (a compute dtype of its own)

The train rollouts' spec comes from the run's config (`rollout_spec`); the evaluation pass
derives its own from it (greedy or train-temperature sampling, one sample per prompt, the
learner's dtype); the producer thread and APRIL build their engines from the same spec.
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
from rl.rollout.engine import RolloutConfig, RolloutEngine
from rl.rollout.latr import LatrConfig, TreeRequest, TreeRollout, sample_latr
from rl.rollout.multiturn import TimeLimits
from rl.rollout.pruning import Pruner
from rl.rollout.sampler_state import SamplingConfig
from rl.runtime.logging import NULL_PROFILE
from rl.runtime.preemption import abandon_point
from rl.tasks.base import Prompt, Task
from rl.trajectory import Trajectory, concat_trajectories


def take_rows(traj: Trajectory, rows: Sequence[int]) -> Trajectory:
    """The rows `rows` of `traj`, as host numpy arrays."""
    idx = np.asarray(rows, np.int64)
    return jax.tree.map(lambda x: np.asarray(x)[idx], traj)


def rollout_model_config(model_config: ModelConfig, compute_dtype: str | None) -> ModelConfig:
    """The sampler's model config: `model_config` with its compute dtype replaced by
    `compute_dtype` (RolloutOptions.dtype; None: unchanged). The params are not cast:
    each layer casts its weights to the compute dtype as it uses them."""
    if compute_dtype is None or compute_dtype == model_config.dtype:
        return model_config
    return dataclasses.replace(model_config, dtype=compute_dtype)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What every rollout of one kind shares (module doc). model_config is the learner's,
    compute_dtype the sampler's own (None: the model's; `sampler_config` applies it);
    max_new_tokens the response budget (the task's unless an eval overrides it);
    time_limits an environment's per-call and per-episode limits; max_concurrent_tool_calls
    and tool_latency how its calls run (rl.rollout.multiturn, rl.envs.latency); latr: grow
    each group as a LATR tree (rl.rollout.latr; None: independent samples, the engine)."""

    task: Task
    model_config: ModelConfig
    group_size: int
    segment_len: int
    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int | None = None
    layer_loop: str = "scan"
    bucket_slots: bool = False
    time_limits: TimeLimits = TimeLimits()
    compute_dtype: str | None = None
    max_concurrent_tool_calls: int = 0
    tool_latency: str = ""
    park_after_s: float | None = None
    latr: LatrConfig | None = None

    @property
    def sampler_config(self) -> ModelConfig:
        """The sampler's model config (rollout_model_config of compute_dtype)."""
        return rollout_model_config(self.model_config, self.compute_dtype)

    def engine(self, num_slots: int, seed: int, first_group_id: int = 0) -> RolloutConfig:
        """The RolloutConfig of one engine with `num_slots` rows, seeded by `seed`; rng keys
        follow the group ids from `first_group_id`."""
        t = self.task
        return RolloutConfig(num_slots=int(num_slots), group_size=self.group_size,
                             segment_len=self.segment_len, max_prompt_len=t.max_prompt_len,
                             max_new_tokens=int(self.max_new_tokens or t.max_new_tokens),
                             sampling=self.sampling,
                             stop_ids=tuple(t.stop_ids), seed=int(seed),
                             first_group_id=int(first_group_id), layer_loop=self.layer_loop,
                             bucket_slots=self.bucket_slots)

    def replace(self, **changes: Any) -> RolloutSpec:
        return dataclasses.replace(self, **changes)


def rollout_spec(model_config: ModelConfig, task: Task, config: Any) -> RolloutSpec:
    """The train rollouts' spec of a run, from its RunConfig `config`: the rollout section
    (segment length, decode options, dtype), train.temperature (the learner's log-probs are
    at the sampler's temperature), loop.group_size and how an environment's calls run
    (time limits, concurrency, emulated latency)."""
    ro, loop = config.rollout, config.loop
    return RolloutSpec(
        task=task, model_config=model_config, compute_dtype=ro.dtype,
        group_size=loop.group_size, segment_len=ro.segment_len,
        sampling=SamplingConfig(temperature=config.train.temperature),
        layer_loop=ro.layer_loop, bucket_slots=ro.bucket_slots,
        time_limits=TimeLimits(step_s=loop.env_step_timeout_s, episode_s=loop.episode_timeout_s),
        max_concurrent_tool_calls=loop.max_concurrent_tool_calls, tool_latency=loop.tool_latency,
        park_after_s=None if loop.park_after_s < 0 else float(loop.park_after_s),
        latr=config.latr)


def rollout_seed(rng: jax.Array) -> tuple[int, jax.Array]:
    """Split a raw key [2] uint32: (seed for one rollout, the key to keep)."""
    seed, key = _split_seed(rng)
    return int(seed), key


@jax.jit
def _split_seed(rng: jax.Array) -> tuple[jax.Array, jax.Array]:  # one launch, not three
    key, sub = jax.random.split(rng)
    return jax.random.randint(sub, (), 0, np.iinfo(np.int32).max), key


def next_seed(state: Any) -> tuple[int, Any]:
    """Split the state's rng: one half stays in the state, the other seeds this rollout."""
    seed, key = rollout_seed(state.rng)
    return seed, state.replace(rng=key)


def sample_groups(params: Any, version: int, spec: RolloutSpec, prompts: Sequence[Prompt], *,
                  seed: int, first_group_id: int = 0, profile=NULL_PROFILE,
                  pruner: Pruner | None = None) -> Trajectory:
    """Sample spec.group_size responses for each prompt with the rollout engine (all groups
    decode together), tokens stamped `version`. Rows come back grouped in prompt order: group
    g = prompts[g]. first_group_id: the global index of prompts[0] (a process's shard of a
    batch): the rng keys follow the global group ids, the returned group ids stay 0..G-1.
    profile: a StepProfile that gets the engine's prefill_s / decode_s and the rest as
    host_s. pruner: online pruning in the engine (rl.rollout.pruning; None = off; single-turn
    tasks only). A stop request inside an abandonable phase (rl.runtime.preemption) ends it
    between segments. An environment's task samples multi-turn episodes (rl.loops.episodes).
    spec.latr grows each group as a LATR tree (rl.rollout.latr) instead (`latr_groups`,
    which also returns the tree's counts)."""
    if not prompts:
        raise ValueError("no prompts to sample: the prompt list is empty")
    if episodes.is_episodic(spec.task):
        if pruner is not None:
            raise ValueError(f"{spec.task.name}: online rollout pruning (rl.rollout.pruning) is "
                             "for single-turn tasks; drop --prune for an environment")
        return episodes.sample_episodes(params, version, spec, prompts, seed=seed,
                                        first_group_id=first_group_id, profile=profile)
    if spec.latr is not None:
        return latr_groups(params, version, spec, prompts, seed=seed,
                           first_group_id=first_group_id, profile=profile)
    t0 = time.perf_counter()
    rc = spec.engine(len(prompts) * spec.group_size, seed, first_group_id)
    engine = RolloutEngine(spec.sampler_config, rc, pruner=pruner)
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


def latr_groups(params: Any, version: int, spec: RolloutSpec, prompts: Sequence[Prompt], *,
                seed: int, first_group_id: int = 0, profile=NULL_PROFILE,
                stats: dict | None = None) -> Trajectory:
    """`sample_groups` with spec.latr: one LATR tree per prompt (rl.rollout.latr), its
    rows (the leaves, then any independent samples) as a Trajectory grouped in prompt
    order; the tree's counts are added into `stats` (tree_* keys)."""
    t = spec.task
    t0 = time.perf_counter()
    request = TreeRequest(spec.group_size, int(spec.max_new_tokens or t.max_new_tokens),
                          sampling=spec.sampling, stop_ids=tuple(t.stop_ids))
    tree = sample_latr(params, spec.sampler_config, [p.ids for p in prompts], request,
                       latr=spec.latr, rng=seed, first_group_id=first_group_id,
                       version=int(version))
    profile.add("decode_s", time.perf_counter() - t0)
    if stats is not None:
        for key, value in tree_counts(tree).items():
            stats[key] = stats.get(key, 0.0) + value
    return tree_trajectory(tree, prompts, t.max_prompt_len,
                           int(spec.max_new_tokens or t.max_new_tokens), version)


def tree_counts(tree: TreeRollout) -> dict[str, float]:
    """The additive counts of a tree rollout (ratios: decoded / leaf, leaf / tree)."""
    s = tree.stats
    return {"tree_decoded_tokens": float(s.decoded_tokens),
            "tree_leaf_tokens": float(s.leaf_tokens), "tree_tokens": float(s.tree_tokens),
            "tree_branches": float(s.branches), "tree_pruned": float(s.pruned),
            "tree_filled": float(s.filled)}


def tree_trajectory(tree: TreeRollout, prompts: Sequence[Prompt], max_prompt_len: int,
                    max_new_tokens: int, version: int) -> Trajectory:
    """A TreeRollout's rows as a Trajectory (group g = prompts[g], its N rows in order)."""
    rows = [(g, i) for g in range(len(tree.tokens)) for i in range(len(tree.tokens[g]))]
    b = len(rows)
    out = {"prompt_ids": np.zeros((b, max_prompt_len), np.int32),
           "prompt_lengths": np.zeros((b,), np.int32),
           "response_ids": np.zeros((b, max_new_tokens), np.int32),
           "response_mask": np.zeros((b, max_new_tokens), bool),
           "behaviour_logprobs": np.zeros((b, max_new_tokens), np.float32),
           "versions": np.zeros((b, max_new_tokens), np.int32),
           "group_ids": np.array([g for g, _ in rows], np.int32),
           "finished": np.array([tree.finished[g][i] for g, i in rows], bool)}
    out["truncated"] = ~out["finished"]
    for r, (g, i) in enumerate(rows):
        p, toks = np.asarray(prompts[g].ids), tree.tokens[g][i]
        out["prompt_ids"][r, :p.size], out["prompt_lengths"][r] = p, p.size
        out["response_ids"][r, :len(toks)], out["response_mask"][r, :len(toks)] = toks, True
        out["behaviour_logprobs"][r, :len(toks)] = tree.logprobs[g][i]
        out["versions"][r, :len(toks)] = version
    return Trajectory.create(**out)
