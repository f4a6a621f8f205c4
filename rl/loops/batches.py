"""A step's groups from the task's train stream, and the learner's batch built from groups:
what every batch source uses.

    StreamSampler        how one batch of groups is drawn and scored: the rollout spec, the
                         prompt scheduler (rl.loops.scheduling.PromptSource), online pruning,
                         DAPO's dynamic sampling, the sampler's params (LoRA: composed)
    sample_batch_groups  one batch of scored groups at the state's params and version
    build_batch          groups -> TrainBatch (group ids renumbered; optional per-token
                         loss weights; groups marked not live are masked out)
    collect_batch        sample_batch_groups, then build_batch

In a run (the sources of rl.loops.sync and rl.loops.deterministic): `open_sampler` (the
run's StreamSampler, its scheduler and pruner restored on resume), `sampler_meta` (their
state for a checkpoint), `sampler_can_abandon`, `batch_metrics` (a batch's record fields).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from models.tree import tree_groups_stats
from rl.learner.batch import TrainBatch, TrainState, batch_from_trajectory
from rl.learner.config import TrainConfig
from rl.loops import episodes
from rl.loops.buffer import ScoredGroup
from rl.loops.rollouts import RolloutSpec, latr_groups, next_seed, sample_groups, take_rows
from rl.loops.scheduling import PromptSource, SchedulerOptions, make_prompt_source
from rl.loops.scoring import accuracy_name, batch_reward_metrics, score, total_reward
from rl.loops.trace_rollouts import TraceRound, trace_groups, trace_metrics
from rl.objectives.offpolicy import kept_group_indices
from rl.rollout.pruning import Pruner, make_pruner, settle_rollouts
from rl.rollout.trace import TraceAllocator, make_allocator
from rl.runtime.distributed import process_local, process_shard
from rl.runtime.logging import NULL_PROFILE
from rl.trajectory import Trajectory, concat_trajectories


@dataclasses.dataclass
class StreamSampler:
    """How a step's groups come from the train stream (module doc). spec: the train
    rollouts (rl.loops.rollouts.rollout_spec); config: the TrainConfig (reward weights);
    loop: the LoopConfig (prompts_per_step, dynamic_sampling, max_resample_rounds); source:
    the prompt scheduler (None: uniform, the next prompts of the stream); pruner: online
    pruning (rl.rollout.pruning); policy: state.params -> the sampler's params (a LoRA
    run's, rl.loops.adapters; None: as they are); trace: TRACE's predictor (an
    environment's batches grown as turn-level trees, rl.loops.trace_rollouts); shard:
    (process index, process count) whose share of each step's prompts this sampler
    samples (None: this JAX process's; a Ray rollout worker samples its learner
    process's)."""

    spec: RolloutSpec
    config: TrainConfig
    loop: Any
    source: PromptSource | None = None
    pruner: Pruner | None = None
    policy: Callable[[Any], Any] | None = None
    trace: TraceAllocator | None = None
    shard: tuple[int, int] | None = None

    def __post_init__(self):
        if self.source is None:
            self.source = make_prompt_source(SchedulerOptions(), self.spec.task, self.loop, None)

    @property
    def signal_name(self) -> str:
        """The reward a scheduler learns from: "correct", else the weighted total."""
        return accuracy_name(self.spec.task.reward_names)

    def signal(self, rewards: dict[str, np.ndarray]) -> np.ndarray:
        name = self.signal_name
        return rewards[name] if name in rewards else total_reward(rewards, self.config)


def groups_of(traj: Trajectory, rewards: dict, reward_names: Sequence[str], group_size: int,
              picks: Sequence[tuple[int, bool]]) -> list[ScoredGroup]:
    """ScoredGroups of the row blocks `picks` = [(group index in traj, live)]."""
    out = []
    for grp, live in picks:
        rows = list(range(grp * group_size, (grp + 1) * group_size))
        out.append(ScoredGroup(traj=take_rows(traj, rows), live=live,
                               rewards={name: rewards[name][rows] for name in reward_names}))
    return out


def sample_batch_groups(state: TrainState, data_position: int, sampler: StreamSampler,
                        profile=NULL_PROFILE) -> tuple[list[ScoredGroup], TrainState, int, dict]:
    """Sample and score loop.prompts_per_step groups from the train stream at
    `data_position` with state.params (tokens stamped state.version). Returns (groups in
    prompt order, state with advanced rng, new data position, rollout stats). With
    dynamic sampling, groups whose rewards are all equal are dropped and more prompts
    sampled (up to loop.max_resample_rounds extra rounds); if too few groups survive,
    dropped groups fill the batch with live=False (their loss mask is cleared); if none
    survive, ValueError. In a multi-process run each process samples its own contiguous
    share of the prompts (rl.runtime.distributed.process_shard; rng keys by global group id).
    profile: a StepProfile timing the phases (rl.runtime.logging). The scheduler gets each
    sampled group's "correct" rewards (else the weighted totals); pruned rows get an empty
    response and their group's survivors' mean rewards (rl.rollout.pruning.settle_rollouts)."""
    loop, spec = sampler.loop, sampler.spec
    if loop.dynamic_sampling and jax.process_count() > 1:
        raise ValueError("dynamic sampling is not supported across processes (each would "
                         "resample a different number of rounds); run it in one process")
    with profile.phase("transfer_s"):
        params = process_local(state.params if sampler.policy is None
                               else sampler.policy(state.params))
    source, version = sampler.source, int(state.version)

    def draw(state, prompts):  # sample and score whole groups (rl.loops.scheduling.Draw)
        seed, state = next_seed(state)
        traj = sample_groups(params, version, spec, prompts, seed=seed, profile=profile)
        with profile.phase("reward_s"):
            r = score(spec.task, prompts, traj)
        groups = groups_of(traj, r, spec.task.reward_names, spec.group_size,
                           [(g, True) for g in range(len(prompts))])
        signal = sampler.signal(r)
        n = spec.group_size
        return groups, [signal[g * n:(g + 1) * n] for g in range(len(prompts))], \
            traj.num_tokens(), state

    if source.mixes_batches:  # DARS's extra groups / rollout replay (rl.loops.scheduling)
        return source.sample_batch(int(state.step), state, data_position, draw)
    # DOTS's reference rollouts at a selection round's start (never trained on; counted)
    state, sampled_tokens, ref_stats = source.measure(int(state.step), state, draw)
    state, data_position, g, kept, dropped, stats = stream_rounds(state, data_position, sampler,
                                                                  params, profile)
    picks = [(t, r, grp, True) for t, r, gs in kept for grp in gs][:g]
    if len(picks) < g:  # fill the fixed batch shape with masked-out dropped groups
        picks += [(t, r, grp, False) for t, r, gs in dropped for grp in gs][:g - len(picks)]
    with profile.phase("host_s"):
        groups = [group for t, r, grp, live in picks for group in groups_of(
            t, r, spec.task.reward_names, spec.group_size, [(grp, live)])]
    stats["sampled_tokens"] += sampled_tokens
    return groups, state, data_position, {**stats, **ref_stats}


def tree_ratios(counts: dict[str, float]) -> dict[str, float]:
    """A batch's LATR counts with their ratios: tokens decoded per leaf token (< 1: the
    shared prefixes were decoded once) and the packing ratio (leaf tokens / distinct tree
    tokens: what a tree-packed learner would save); {} without a tree."""
    if not counts:
        return {}
    leaf = max(counts["tree_leaf_tokens"], 1.0)
    return {**counts, "tree_decoded_per_leaf_token": counts["tree_decoded_tokens"] / leaf,
            "tree_packing_ratio": leaf / max(counts["tree_tokens"], 1.0)}


def stream_rounds(state: TrainState, data_position: int, sampler: StreamSampler, params: Any,
                  profile) -> tuple:
    """The sampling rounds of one batch (sample_batch_groups): one round of the scheduler's
    next prompts, or with dynamic sampling more rounds until enough groups have unequal
    rewards. Returns (state, data position, G groups per round, kept and dropped
    [(traj, rewards, group indices)], stats)."""
    loop, spec, source = sampler.loop, sampler.spec, sampler.source
    n, version = spec.group_size, int(state.version)
    kept, dropped = [], []
    n_kept = rounds = sampled_tokens = 0
    pstats: dict[str, float] = {}
    tstats: dict[str, float] = {}  # a LATR tree's counts (rl.loops.rollouts.latr_groups)
    trace_counts: dict[str, float] = {}  # TRACE's (rl.loops.trace_rollouts)
    while True:
        with profile.phase("host_s"):
            chosen, data_position = source.next(int(state.step), data_position)
            index, count = sampler.shard or (None, None)
            offset, prompts = process_shard(chosen, process_index=index, process_count=count)
            g = len(prompts)
            seed, state = next_seed(state)
        if spec.latr is not None:  # a tree per prompt, its counts kept for the record
            traj = latr_groups(params, version, spec, prompts, seed=seed,
                               first_group_id=offset, profile=profile, stats=tstats)
        elif sampler.trace is not None:  # roots, then the roots / prefixes most mixed
            traj, c = trace_groups(params, version, spec, prompts, seed=seed,
                                   first_group_id=offset, profile=profile,
                                   trace=TraceRound(sampler.trace, sampler.signal))
            trace_counts = {k: trace_counts.get(k, 0.0) + v for k, v in c.items()}
        else:
            traj = sample_groups(params, version, spec, prompts, seed=seed,
                                 first_group_id=offset, profile=profile, pruner=sampler.pruner)
        sampled_tokens += traj.num_tokens()
        with profile.phase("reward_s"):
            rewards = score(spec.task, prompts, traj)
        if sampler.pruner is not None:
            traj, rewards, st = settle_rollouts(sampler.pruner, traj, rewards,
                                                sampler.signal(rewards), n)
            pstats = {k: pstats.get(k, 0.0) + v for k, v in st.items()}
        if not loop.dynamic_sampling:
            kept.append((traj, rewards, list(range(g))))
            r = sampler.signal(rewards)
            source.record(prompts, [r[i * n:(i + 1) * n] for i in range(g)])
            break
        keep = kept_group_indices(total_reward(rewards, sampler.config), n).tolist()
        kept.append((traj, rewards, keep))
        dropped.append((traj, rewards, sorted(set(range(g)) - set(keep))))
        n_kept += len(keep)
        if n_kept >= g or rounds >= loop.max_resample_rounds:
            break
        rounds += 1
    if loop.dynamic_sampling and n_kept == 0:
        raise ValueError(
            f"empty batch after dynamic sampling: all {g * (rounds + 1)} sampled groups had "
            "equal rewards within their group (no learning signal); raise max_resample_rounds, "
            "the group size or the temperature, or turn dynamic sampling off")
    stats = {"sampled_tokens": sampled_tokens, "resample_rounds": rounds,
             "kept_groups": n_kept if loop.dynamic_sampling else loop.prompts_per_step,
             **{f"prune_{k}": v for k, v in pstats.items()}, **tree_ratios(tstats),
             **trace_metrics(trace_counts)}
    return state, data_position, g, kept, dropped, stats


def build_batch(groups: Sequence[ScoredGroup], spec: RolloutSpec, config: TrainConfig,
                token_weights: Sequence[np.ndarray] | None = None) -> TrainBatch:
    """One TrainBatch from whole groups of spec.group_size rows (rows in the given order,
    group ids renumbered 0..G-1, width task.max_prompt_len + task.max_new_tokens of
    spec.task: one compiled step; the learner's spec.model_config). Groups with live=False
    get their loss mask cleared. token_weights: None or one [N, R] per-token factor per
    group, aligned with its response tokens; they become TrainBatch.loss_weights [B, T] (1
    outside the responses)."""
    if not groups:
        raise ValueError("build_batch: no groups given; a batch needs at least one group")
    n, task = spec.group_size, spec.task
    trajs = [gr.traj for gr in groups]
    traj = trajs[0] if len(trajs) == 1 else concat_trajectories(trajs)
    rewards = {name: np.concatenate([np.asarray(gr.rewards[name]) for gr in groups])
               for name in task.reward_names}
    # Row blocks are whole groups; renumber so group ids are contiguous and distinct.
    traj = traj.replace(group_ids=np.repeat(np.arange(len(groups), dtype=np.int32), n))
    width = task.max_prompt_len + task.max_new_tokens
    batch = batch_from_trajectory(traj, group_size=n, model_config=spec.model_config,
                                  rewards=rewards, seq_len=width, packed=config.packed,
                                  turn_credit=episodes.turn_credit_of(task), tree=config.tree)
    live = np.repeat(np.asarray([gr.live for gr in groups]), n)
    if not live.all():
        batch = batch.replace(loss_mask=batch.loss_mask & live[:, None])
    if token_weights is not None:
        batch = batch.replace(loss_weights=response_weights(traj, batch, token_weights,
                                                            len(groups)))
    return batch


def response_weights(traj: Trajectory, batch: TrainBatch, token_weights: Sequence[np.ndarray],
                     n_groups: int) -> np.ndarray:
    """[B, T] loss weights: each group's [N, R] factors on its rows' response tokens, 1
    elsewhere."""
    if len(token_weights) != n_groups:
        raise ValueError(f"build_batch: {len(token_weights)} token_weights for "
                         f"{n_groups} groups; give one [N, R] array per group")
    w_resp = np.concatenate([np.asarray(w, np.float32) for w in token_weights])
    weights = np.ones(batch.tokens.shape, np.float32)
    plen = np.asarray(traj.prompt_lengths)
    rlen = np.asarray(traj.response_mask).sum(axis=1)
    for i in range(weights.shape[0]):
        p, r = int(plen[i]), int(rlen[i])
        weights[i, p:p + r] = w_resp[i, :r]
    return weights


def collect_batch(state: TrainState, data_position: int, sampler: StreamSampler,
                  profile=NULL_PROFILE) -> tuple[TrainBatch, TrainState, int, dict]:
    """Sample and score one batch of loop.prompts_per_step groups from the train stream
    at `data_position` (sample_batch_groups, then build_batch). Returns (batch, state
    with advanced rng, new data position, rollout stats); profile times the phases."""
    groups, state, data_position, stats = sample_batch_groups(state, data_position, sampler,
                                                              profile)
    with profile.phase("host_s"):
        batch = build_batch(groups, sampler.spec, sampler.config)
    return batch, state, data_position, stats


# ----------------------------------------------------------------------------- in a run
def open_sampler(run: Any, params: Any) -> StreamSampler:
    """The run's StreamSampler: its prompt scheduler (built from the initial `params`: DOTS
    embeds prompts with them) and pruner, restored from the checkpoint on resume; the
    sampler's params through the run's policy (LoRA: the adapters composed)."""
    config, ctx = run.config, run.ctx
    source = make_prompt_source(config.scheduler, run.task, run.loop, params, seed=run.loop.seed,
                                config=run.train)
    if run.resumed and "scheduler" in ctx.meta:
        source.restore(ctx.meta["scheduler"])
    elif run.resumed and not config.scheduler.is_default:
        raise ValueError(f"the checkpoint holds no {config.scheduler.name!r} scheduler state")
    pruner = make_pruner(config.prune, run.model_config.hidden_size)
    if pruner is not None and run.resumed:
        pruner.restore(ctx.meta.get("pruner"))
    trace = make_allocator(config.trace, run.model_config.hidden_size)
    if trace is not None and run.resumed:
        trace.restore(ctx.meta.get("trace"))
    return StreamSampler(spec=run.spec, config=run.train, loop=run.loop, source=source,
                         pruner=pruner, policy=ctx.policy, trace=trace)


def sampler_meta(run: Any, sampler: StreamSampler) -> dict:
    """The sampler's side state for a checkpoint: the scheduler's (not uniform's, which keeps
    none) and the pruner's."""
    out = {}
    if not run.config.scheduler.is_default:
        out["scheduler"] = sampler.source.state()
    if sampler.pruner is not None:
        out["pruner"] = sampler.pruner.state()
    if sampler.trace is not None:
        out["trace"] = sampler.trace.state()
    return out


def sampler_can_abandon(config: Any) -> bool:
    """Dropping a half-sampled step loses nothing unless sampling moves other state (a
    scheduler's history, the pruner's or TRACE's head)."""
    return (config.scheduler.is_default and config.prune is None
            and config.trace is None)


def batch_metrics(run: Any, batch: Any) -> dict:
    """A train batch's metrics for its record: an environment's episodes, the reward spread,
    and with TrainConfig.tree the tokens the learner's trees hold (learner_tree_tokens,
    learner_leaf_tokens: the rows as independent sequences, learner_packing_ratio)."""
    out = episodes.take_episode_metrics(run.task)
    out.update(batch_reward_metrics(batch.reward_names, batch.rewards, run.loop.group_size,
                                    run.train.reward_weights))
    if getattr(batch, "tree", None) is not None:
        tree = tree_groups_stats(batch.tree)
        out.update(learner_tree_tokens=tree["tree_tokens"],
                   learner_leaf_tokens=tree["tree_leaf_tokens"],
                   learner_packing_ratio=tree["tree_packing_ratio"])
    return out
