"""The synchronous GRPO loop (max_staleness = 0): every iteration samples with the
current params, scores, and makes one learner update on exactly that data.

    prompts (task train stream, from the data position)
      -> rollout engine (rl.rollout, params version v)   -> Trajectory
      -> task rewards (validated: names, finiteness)     -> optional DAPO dynamic sampling
      -> TrainBatch -> train_step (advantages, loss, one optimizer update) -> version v+1
with a periodic eval on the task's eval split, metrics to JSONL (+ wandb), a tqdm bar,
and orbax checkpoints from which `resume=True` continues exactly: the checkpoint holds
params, optimizer state, step, rng (the source of every rollout seed) and the data
position, so 2 steps + resume + 2 steps == 4 steps, bit for bit on CPU. SIGTERM / Ctrl-C
stop it at a safe point with a checkpoint (rl.runtime.preemption; docs: guides/faults.md).

Its pieces are shared with the asynchronous loop (rl.loops.asynchronous): open_run (run
dir, state, checkpointer, logger, jitted step: rl.loops.context), sample_batch_groups (one
batch of scored groups) and build_batch (groups -> TrainBatch, with optional per-token loss
weights), rollout_seed. Sampling groups is rl.loops.rollouts (sample_groups), the periodic
eval rl.loops.evaluator (make_evaluator, eval_report), the rewards rl.loops.scoring.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from models.config import ModelConfig
from rl.learner.batch import (
    NonFiniteError,
    TrainBatch,
    TrainState,
    batch_from_trajectory,
    global_batch,
)
from rl.learner.config import TrainConfig
from rl.loops import episodes
from rl.loops.buffer import ScoredGroup
from rl.loops.config import LoopConfig, Resume, RunConfig, RunHooks, as_resume
from rl.loops.context import open_run, resolve_mesh
from rl.loops.evaluation import accuracy_name, batch_reward_metrics
from rl.loops.evaluator import make_evaluator
from rl.loops.rollouts import loop_time_limits, sample_groups, take_rows
from rl.loops.scheduling import PromptSource, SchedulerOptions, make_prompt_source
from rl.loops.scoring import score, total_reward
from rl.objectives.offpolicy import kept_group_indices
from rl.rollout.pruning import Pruner, make_pruner, settle_rollouts
from rl.rollout.sampler_state import SamplingConfig
from rl.runtime.distributed import process_local, process_shard
from rl.runtime.logging import NULL_PROFILE, StepProfile
from rl.runtime.preemption import Preempted, StepAbandoned
from rl.tasks.base import Task
from rl.trajectory import Trajectory, concat_trajectories


@dataclasses.dataclass
class RunResult:
    """What a run produced: the final state, train/eval records (as in metrics.jsonl),
    the run dir, the data position reached, and (rl.run.train) the run's summary."""

    state: TrainState
    train: list[dict]
    eval: list[dict]
    run_dir: Path
    data_position: int
    summary: dict | None = None


# ----------------------------------------------------------------------------- the loop
def rollout_seed(rng: jax.Array) -> tuple[int, jax.Array]:
    """Split a raw key [2] uint32: (seed for one rollout, the key to keep)."""
    seed, key = _split_seed(rng)
    return int(seed), key


@jax.jit
def _split_seed(rng: jax.Array) -> tuple[jax.Array, jax.Array]:  # one launch, not three
    key, sub = jax.random.split(rng)
    return jax.random.randint(sub, (), 0, np.iinfo(np.int32).max), key


def _rollout_seed(state: TrainState) -> tuple[int, TrainState]:
    """Split the state's rng: one half stays in the state, the other seeds this rollout."""
    seed, key = rollout_seed(state.rng)
    return seed, state.replace(rng=key)


def sample_batch_groups(state: TrainState, model_config: ModelConfig, task: Task,
                        config: TrainConfig, loop: LoopConfig, data_position: int,
                        profile=NULL_PROFILE, source: PromptSource | None = None,
                        pruner: Pruner | None = None, policy: Callable | None = None
                        ) -> tuple[list[ScoredGroup], TrainState, int, dict]:
    """Sample and score loop.prompts_per_step groups from the train stream at
    `data_position` with state.params (tokens stamped state.version). Returns (groups in
    prompt order, state with advanced rng, new data position, rollout stats). With
    dynamic sampling, groups whose rewards are all equal are dropped and more prompts
    sampled (up to loop.max_resample_rounds extra rounds); if too few groups survive,
    dropped groups fill the batch with live=False (their loss mask is cleared); if none
    survive, ValueError. In a multi-process run each process samples its own contiguous
    share of the prompts (rl.runtime.distributed.process_shard; rng keys by global group id).
    profile: a StepProfile timing the phases (rl.runtime.logging). source: the prompt
    scheduler (rl.loops.scheduling; None = uniform, the next prompts of the stream); it
    gets each sampled group's "correct" rewards (else the weighted totals). pruner: online
    pruning (rl.rollout.pruning.settle_rollouts: pruned rows get an empty response and
    their group's survivors' mean rewards; the head learns from the survivors). policy:
    state.params -> the sampler's params (a LoRA run's: rl.loops.adapters; None: as they are)."""
    n = loop.group_size
    if source is None:
        source = make_prompt_source(SchedulerOptions(), task, loop, None)
    if loop.dynamic_sampling and jax.process_count() > 1:
        raise ValueError("dynamic sampling is not supported across processes (each would "
                         "resample a different number of rounds); run it in one process")
    sampling, limits = SamplingConfig(temperature=config.temperature), loop_time_limits(loop)
    with profile.phase("transfer_s"):
        params = process_local(state.params if policy is None else policy(state.params))

    def draw(state, prompts):  # sample and score whole groups (rl.loops.scheduling.Draw)
        seed, state = _rollout_seed(state)
        traj = sample_groups(params, int(state.version), model_config, task, prompts,
                             group_size=n, sampling=sampling, segment_len=loop.segment_len,
                             seed=seed, profile=profile, time_limits=limits,
                             layer_loop=loop.layer_loop, bucket_slots=loop.bucket_slots,
                             compute_dtype=loop.rollout_dtype)
        with profile.phase("reward_s"):
            r = score(task, prompts, traj)
        acc = accuracy_name(task.reward_names)
        signal = r[acc] if acc in r else total_reward(r, config)
        blocks = [list(range(g * n, (g + 1) * n)) for g in range(len(prompts))]
        return ([ScoredGroup(traj=take_rows(traj, rows), rewards={
            name: r[name][rows] for name in task.reward_names}) for rows in blocks],
            [signal[rows] for rows in blocks], traj.num_tokens(), state)

    if source.mixes_batches:  # DARS's extra groups / rollout replay (rl.loops.scheduling)
        return source.sample_batch(int(state.step), state, data_position, draw)
    kept: list[tuple[Trajectory, dict, list[int]]] = []
    dropped: list[tuple[Trajectory, dict, list[int]]] = []
    n_kept = rounds = 0
    pstats: dict[str, float] = {}
    # DOTS's reference rollouts at a selection round's start (never trained on; counted)
    state, sampled_tokens, ref_stats = source.measure(int(state.step), state, draw)
    while True:
        with profile.phase("host_s"):
            chosen, data_position = source.next(int(state.step), data_position)
            offset, prompts = process_shard(chosen)
            g = len(prompts)
            seed, state = _rollout_seed(state)
        traj = sample_groups(params, int(state.version), model_config, task, prompts,
                             group_size=n, sampling=sampling, segment_len=loop.segment_len,
                             seed=seed, first_group_id=offset, profile=profile, pruner=pruner,
                             time_limits=limits, layer_loop=loop.layer_loop,
                             bucket_slots=loop.bucket_slots, compute_dtype=loop.rollout_dtype)
        sampled_tokens += traj.num_tokens()
        with profile.phase("reward_s"):
            rewards = score(task, prompts, traj)
        acc = accuracy_name(task.reward_names)  # "correct", else the weighted total
        if pruner is not None:
            r = rewards[acc] if acc in rewards else total_reward(rewards, config)
            traj, rewards, st = settle_rollouts(pruner, traj, rewards, r, n)
            pstats = {k: pstats.get(k, 0.0) + v for k, v in st.items()}
        if not loop.dynamic_sampling:
            kept.append((traj, rewards, list(range(g))))
            r = rewards[acc] if acc in rewards else total_reward(rewards, config)
            source.record(prompts, [r[i * n:(i + 1) * n] for i in range(g)])
            break
        keep = kept_group_indices(total_reward(rewards, config), n).tolist()
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
    picks = [(t, r, grp, True) for t, r, gs in kept for grp in gs][:g]
    if len(picks) < g:  # fill the fixed batch shape with masked-out dropped groups
        picks += [(t, r, grp, False) for t, r, gs in dropped for grp in gs][:g - len(picks)]
    groups = []
    with profile.phase("host_s"):
        for t, r, grp, use in picks:
            rows = list(range(grp * n, (grp + 1) * n))
            groups.append(ScoredGroup(traj=take_rows(t, rows), live=use,
                                      rewards={name: r[name][rows] for name in task.reward_names}))
    stats = {"sampled_tokens": sampled_tokens, "resample_rounds": rounds,
             "kept_groups": n_kept if loop.dynamic_sampling else loop.prompts_per_step,
             **{f"prune_{k}": v for k, v in pstats.items()},
             **ref_stats}
    return groups, state, data_position, stats


def build_batch(groups: Sequence[ScoredGroup], *, model_config: ModelConfig, task: Task,
                config: TrainConfig, group_size: int,
                token_weights: Sequence[np.ndarray] | None = None) -> TrainBatch:
    """One TrainBatch from whole groups (rows in the given order, group ids renumbered
    0..G-1, width task.max_prompt_len + task.max_new_tokens: one compiled step).
    Groups with live=False get their loss mask cleared. token_weights: None or one
    [N, R] per-token factor per group, aligned with its response tokens; they become
    TrainBatch.loss_weights [B, T] (1 outside the responses)."""
    if not groups:
        raise ValueError("build_batch: no groups given; a batch needs at least one group")
    n = group_size
    trajs = [gr.traj for gr in groups]
    traj = trajs[0] if len(trajs) == 1 else concat_trajectories(trajs)
    rewards = {name: np.concatenate([np.asarray(gr.rewards[name]) for gr in groups])
               for name in task.reward_names}
    # Row blocks are whole groups; renumber so group ids are contiguous and distinct.
    traj = traj.replace(group_ids=np.repeat(np.arange(len(groups), dtype=np.int32), n))
    width = task.max_prompt_len + task.max_new_tokens
    batch = batch_from_trajectory(traj, group_size=n, model_config=model_config,
                                  rewards=rewards, seq_len=width, packed=config.packed,
                                  turn_credit=episodes.turn_credit_of(task))
    live = np.repeat(np.asarray([gr.live for gr in groups]), n)
    if not live.all():
        batch = batch.replace(loss_mask=batch.loss_mask & live[:, None])
    if token_weights is not None:
        if len(token_weights) != len(groups):
            raise ValueError(f"build_batch: {len(token_weights)} token_weights for "
                             f"{len(groups)} groups; give one [N, R] array per group")
        w_resp = np.concatenate([np.asarray(w, np.float32) for w in token_weights])
        weights = np.ones(batch.tokens.shape, np.float32)
        plen = np.asarray(traj.prompt_lengths)
        rlen = np.asarray(traj.response_mask).sum(axis=1)
        for i in range(weights.shape[0]):
            p, r = int(plen[i]), int(rlen[i])
            weights[i, p:p + r] = w_resp[i, :r]
        batch = batch.replace(loss_weights=weights)
    return batch


def collect_batch(state: TrainState, model_config: ModelConfig, task: Task, config: TrainConfig,
                  loop: LoopConfig, data_position: int, profile=NULL_PROFILE,
                  source: PromptSource | None = None, pruner: Pruner | None = None,
                  policy: Callable | None = None
                  ) -> tuple[TrainBatch, TrainState, int, dict]:
    """Sample and score one batch of loop.prompts_per_step groups from the train stream
    at `data_position` (sample_batch_groups, then build_batch). Returns (batch, state
    with advanced rng, new data position, rollout stats); profile times the phases."""
    groups, state, data_position, stats = sample_batch_groups(state, model_config, task, config,
                                                              loop, data_position, profile, source,
                                                              pruner, policy)
    with profile.phase("host_s"):
        batch = build_batch(groups, model_config=model_config, task=task, config=config,
                            group_size=loop.group_size)
    return batch, state, data_position, stats


def run(model_config: ModelConfig, params: Any, task: Task, config: RunConfig, *,
        resume: bool | Resume = False, hooks: RunHooks | None = None) -> RunResult:
    """Train `params` on `task` with synchronous GRPO for config.loop.steps optimizer steps
    (config.train: the learner; config.scheduler: the prompt scheduler and rollout replay,
    rl.loops.scheduling; config.prune: online rollout pruning, rl.rollout.pruning, None =
    off; config.asynchronous must be None: rl.loops.run_async runs that).

    Writes into config.output_dir: metrics.jsonl (train + eval records), checkpoints/
    (orbax), wandb files (config.logging.wandb "offline" / "online"). resume (True or a
    Resume) restores the latest checkpoint of the run dir (CheckpointError if there is none
    or it is damaged; Resume.from_last_good: skip a damaged one for the one before) and
    continues to loop.steps; the checkpoint's recorded config must equal this one but for
    steps, the time limit and Resume.allow_changes (rl.loops.validation). A second process
    training in the run dir is a RunLockError (rl.runtime.runlock). The scheduler's state
    (but uniform's, which keeps none) and the pruner's quality head go into every
    checkpoint and come back on resume. hooks: an explicit mesh (else config.mesh, or "dp"
    across processes), XLA compiler options for the train step, on_eval / on_step callbacks.
    `params` are the initial weights (also the frozen KL reference when
    config.train.loss.kl_coef > 0); they are copied, never donated.
    """
    if config.asynchronous is not None:
        raise ValueError("config.asynchronous is set: rl.loops.run_async runs asynchronous "
                         "training (rl.run.train picks the loop by the config)")
    config.validate()
    hooks = hooks or RunHooks()
    resume_opts = as_resume(resume)
    resume = resume_opts is not None
    train, loop, scheduler, prune = config.train, config.loop, config.scheduler, config.prune
    progress, on_eval = config.logging.progress, hooks.on_eval
    run_dir = config.output_dir
    mesh = resolve_mesh(config, model_config, hooks)
    ctx = open_run(model_config, params, train, loop, run_dir, resume=resume_opts,
                   wandb_mode=config.logging.wandb, run_config=config.to_dict(), mesh=mesh,
                   compiler_options=hooks.compiler_options,
                   extra_config={"task": task.name, "reward": config.reward,
                                 **episodes.episode_config(task), **(
                       {} if scheduler.is_default else {"scheduler": scheduler}),
                       **({} if prune is None else {"prune": prune})})
    state, ref, ckpt, logger, step_fn = ctx.state, ctx.ref, ctx.ckpt, ctx.logger, ctx.step_fn
    data_position, start, ctl = ctx.data_position, ctx.start, ctx.control
    last = (state, data_position)  # the last completed step's: what a stop saves
    in_step, doing = False, "setup"  # in a step (between sampling and its record); what for
    try:
        source = make_prompt_source(scheduler, task, loop, params, seed=loop.seed,
                                    config=train)
        # the state trains its own copy (open_run): drop this frame's reference to the
        # caller's, so that a caller that handed them over (rl.run.launch) holds no second
        # copy of the weights through the run
        del params
        if resume and "scheduler" in ctx.meta:
            source.restore(ctx.meta["scheduler"])
        elif resume and not scheduler.is_default:
            raise ValueError(f"the checkpoint holds no {scheduler.name!r} scheduler state")
        pruner = make_pruner(prune, model_config.hidden_size)
        if pruner is not None and resume:
            pruner.restore(ctx.meta.get("pruner"))
        # dropping a half-sampled step loses nothing unless sampling moves other state
        can_abandon = scheduler.is_default and pruner is None

        def meta(pending_eval=None):
            out = {"data_position": data_position, "task": task.name, "config": ctx.config}
            if not scheduler.is_default:
                out["scheduler"] = source.state()  # uniform keeps no state
            if pruner is not None:
                out["pruner"] = pruner.state()
            return out if pending_eval is None else {**out, "pending_eval": pending_eval}

        def stop(step, abandoned="", pending_eval=None):  # save the last completed step
            ctx.save_final(step, state, meta(pending_eval))
            return ctx.preempted(step, abandoned)

        do_eval = make_evaluator(model_config, task, train, loop, logger, on_eval)
        pending = 0 if not resume else ctx.pending_eval()
        if ctl.boundary(start).stop:  # a signal before the first step
            raise stop(start, pending_eval=pending)
        if pending is not None:  # the step-0 eval, or the one a stop left undone
            doing = f"the eval of step {pending}"
            try:
                with ctl.abandonable():
                    do_eval(pending, process_local(ctx.policy(state.params)),
                            int(state.version))
            except StepAbandoned:
                raise stop(start, f"the eval of step {pending}", pending) from None
        bar = tqdm(total=loop.steps, initial=start, disable=not progress, desc="grpo",
                   dynamic_ncols=True)
        prof = StepProfile()
        for step in range(start, loop.steps):
            prof.start()
            t0 = time.perf_counter()
            in_step, doing = True, f"step {step + 1}"
            try:
                with ctl.abandonable(can_abandon):
                    batch, state, data_position, stats = collect_batch(
                        state, model_config, task, train, loop, data_position, prof, source,
                        pruner, ctx.policy)
            except NonFiniteError as err:  # a task's reward: name the step too
                raise NonFiniteError(f"step {step + 1}: {err}") from None
            except StepAbandoned:  # state and data position are still the last step's
                raise stop(step, f"step {step + 1}'s rollouts") from None
            stats.update(episodes.take_episode_metrics(task))  # an environment: its episodes
            t1 = time.perf_counter()
            with prof.phase("host_s"):
                stats.update(batch_reward_metrics(batch.reward_names, batch.rewards,
                                                  loop.group_size, train.reward_weights))
            with prof.phase("transfer_s"):  # each process's rows -> one global batch
                if jax.process_count() > 1:
                    batch = global_batch(batch, mesh)
                elif mesh is None:  # on the device before the step, so it is timed here
                    batch = jax.device_put(batch, jax.devices()[0])
            with prof.phase("learner_s"):
                state, metrics = jax.block_until_ready(step_fn(state, batch, ref))
            with prof.phase("transfer_s"):
                metrics = jax.device_get(metrics)
            t2 = time.perf_counter()
            with prof.phase("host_s"):
                metrics = {k: float(v) for k, v in metrics.items()}
                metrics.update(stats, rollout_s=t1 - t0, train_s=t2 - t1,
                               tokens_per_s=stats["sampled_tokens"] / max(t2 - t0, 1e-9),
                               data_position=data_position, time_s=do_eval.clock())
            metrics.update(prof.finish())
            done = step + 1
            record = logger.log(done, metrics, kind="train")
            last, in_step = (state, data_position), False
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
            # every process: stop (a signal), a time-based save, the time limit
            when = ctl.boundary(done, metrics["time_s"])
            is_last = done == loop.steps or when.out_of_time
            if is_last or (loop.eval_every and done % loop.eval_every == 0):
                if when.stop:  # the resumed run evaluates first
                    raise stop(done, f"the eval of step {done}", done)
                doing = f"the eval of step {done}"
                try:
                    with ctl.abandonable():
                        ev = do_eval(done, process_local(ctx.policy(state.params)),
                                     int(state.version))
                except StepAbandoned:
                    raise stop(done, f"the eval of step {done}", done) from None
                if progress:
                    bar.write(f"step {done}: eval reward {ev['reward']:.3f}")
            if when.stop:
                raise stop(done)
            if is_last or when.save or (loop.save_every and done % loop.save_every == 0):
                ckpt.save(done, state, meta())
                ctl.saved()
            ckpt.poll()  # a failed background write stops the run here
            if hooks.on_step is not None:
                hooks.on_step(record)
            if when.out_of_time:
                bar.write(f"time limit {loop.time_limit_s:.0f} s reached after step {done}")
                break
        bar.close()
    except Preempted:
        ctx.close()
        raise
    except KeyboardInterrupt:  # from a hook, or a second Ctrl-C: keep the last step
        state, data_position = last
        if not in_step or can_abandon:  # else the scheduler's state is half a step on
            ctx.save_after_interrupt(state, meta)
        ctx.close(quiet=True)
        raise
    except Exception as err:
        failure = ctx.storage_failure(err)
        ctx.close(quiet=True)
        if failure is not None and failure is not err:
            raise failure from err
        if failure is None:  # e.g. the task's reward function (or its worker) failed
            err.add_note(f"(during {doing} of the run in {str(run_dir)!r})")
        raise
    ctx.close()
    return RunResult(state=state, train=[r for r in logger.records if r["kind"] == "train"],
                     eval=[r for r in logger.records if r["kind"] == "eval"], run_dir=run_dir,
                     data_position=data_position)
