"""The stages of the asynchronous loop's learner side (`rl.loops.asynchronous.run_async`
calls them in this order; its module docstring says what each stage means for the modes,
rollouts and proximal options), and `AsyncRun`, the loop's state they share.

  prepare            the param ring, the buffer at the state's version, the resume note
  start              restored ring (deterministic resume), v0 published, the APRIL source
                     (its FIFO restored), the EWMA params, the step-0 eval, the producer
                     thread (threaded), the progress bar and step profile
  take_batch         b groups for step v: sampled here with the params of max(v - η, 0)
                     (static: one sample_batch_groups; APRIL: rounds until the buffer gives
                     a batch), or waited for from the producer thread (its errors raised)
  build_train_batch  the TrainBatch (+ off-policy prefix mask), its proximal log-probs
                     (exact from the ring, or the EWMA params'), the batch's own metrics
  update_learner     the jitted step, the EWMA update, v + 1 published, the buffer's version
  record_step        the train record (step metrics, sampling and buffer counters, APRIL's,
                     the resume note, the step profile), the progress bar
  evaluate_and_save  at the step boundary every process agrees on (rl.runtime.preemption):
                     stop at a signal (a checkpoint of the step, raise Preempted), eval and
                     checkpoint (+ side files, pruned) on their schedule or by time, then
                     the non-blocking check of the checkpoint writer
  stop_after_fault   producer stopped, buffer closed, a final checkpoint on KeyboardInterrupt
                     or a producer error; a storage failure becomes one StorageError
  shut_down          producer stopped and joined (with a timeout), the run context closed

`split_devices` (which devices sample, which train) runs before `open_run`; `save_checkpoint`
writes a checkpoint with its meta and side files (rl.loops.side_files).
"""
from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from models.config import ModelConfig
from models.sharding import make_mesh
from rl.learner.batch import NonFiniteError, TrainBatch, TrainState
from rl.learner.config import TrainConfig
from rl.learner.proximal import ewma_update, exact_proximal_logprobs, policy_logprobs
from rl.learner.snapshots import ParamSnapshots, copy_params
from rl.loops import episodes
from rl.loops.buffer import TrajectoryBuffer
from rl.loops.config import AsyncConfig, LoopConfig
from rl.loops.context import RunContext
from rl.loops.evaluation import batch_reward_metrics
from rl.loops.evaluator import make_evaluator
from rl.loops.producer import AprilSource, RolloutProducer, offpolicy_prefix_batch
from rl.loops.side_files import (
    iter_snapshots,
    load_rollout_state,
    prune_side_files,
    save_rollout_state,
    save_snapshots,
)
from rl.loops.sync import (
    RunResult,
    build_batch,
    rollout_seed,
    sample_batch_groups,
)
from rl.rollout.april import AprilConfig
from rl.runtime.logging import EXTRA_PHASES, PHASES, StepProfile
from rl.runtime.preemption import Preempted, StepAbandoned, abandon_point
from rl.runtime.storage import StorageError
from rl.tasks.base import Task


@dataclasses.dataclass
class AsyncRun:
    """What the stages share. Fixed for the run: the context (rl.loops.context.RunContext),
    the configs (`config` is the TrainConfig as the caller gave it, which sampling, batches
    and evals use; the step runs `rl.loops.asynchronous.train_config_for` of it), the param
    ring and the buffer. Mutable: `state` and `data_position` (the learner's, after its last
    step: what a final checkpoint saves), `published` ((sampler params, version), replaced in
    one assignment), the APRIL source, producer and its thread, the EWMA params, and the
    evaluator, progress bar and step profile `start` makes."""

    ctx: RunContext
    model_config: ModelConfig
    task: Task
    config: TrainConfig
    loop: LoopConfig
    acfg: AsyncConfig
    run_dir: Path
    rollout_device: jax.Device | None
    snapshot_device: jax.Device | None  # where restored snapshots go (None: their mesh)
    progress: bool
    snaps: ParamSnapshots
    buffer: TrajectoryBuffer
    state: TrainState
    data_position: int
    resume_note: dict
    published: tuple[Any, int] | None = None
    april: AprilSource | None = None
    producer: RolloutProducer | None = None
    thread: threading.Thread | None = None
    ewma: Any = None
    do_eval: Any = None
    bar: Any = None
    prof: StepProfile | None = None
    producer_tokens: int = 0  # producer.sampled_tokens at the last step

    @property
    def k(self) -> int:
        return self.acfg.max_staleness

    def latest(self) -> tuple[Any, int]:
        """(sampler params, version) last published (the producer thread calls this)."""
        return self.published


class Taken(NamedTuple):
    """A step's batch from take_batch: the buffer's batch (groups, token_weights), the state
    (deterministic static: with the sampler's rng), the data position after it, and the
    sampling counters for the record ({"sampled_tokens": n, ...})."""

    got: Any
    state: TrainState
    data_position: int
    stats: dict


# ----------------------------------------------------------------------------- setup
def split_devices(acfg: AsyncConfig, mesh: jax.sharding.Mesh | None
                  ) -> tuple[jax.Device | None, jax.sharding.Mesh | None]:
    """(rollout device or None = share the default one, training mesh or None)."""
    if acfg.mode != "threaded":
        return None, mesh
    devices = jax.devices()
    if mesh is not None:
        used = set(mesh.devices.flat)
        rest = [d for d in devices if d not in used]
        return (rest[0] if rest else None), mesh
    n_roll = acfg.rollout_devices
    if n_roll is None:
        n_roll = len(devices) // 2 if len(devices) > 1 else 0
    if n_roll == 0:
        return None, None
    if n_roll >= len(devices):
        raise ValueError(f"AsyncConfig.rollout_devices={n_roll} leaves no training device out of "
                         f"{len(devices)}; use at most {len(devices) - 1}")
    train = devices[:len(devices) - n_roll]
    roll = devices[len(devices) - n_roll:]
    return roll[0], (make_mesh(data=len(train), devices=train) if len(train) > 1 else None)


def prepare(ctx: RunContext, model_config: ModelConfig, task: Task, config: TrainConfig,
            loop: LoopConfig, acfg: AsyncConfig, run_dir: Path, *, rollout_device: jax.Device | None,
            mesh: jax.sharding.Mesh | None, resume: bool, progress: bool) -> AsyncRun:
    """The run's state before anything samples: a ring of acfg.ring_capacity versions (in
    memory, or with snapshot_store "disk" under run_dir/snapshots/ring), the buffer (b
    groups, bound η, starting at the state's version), and on resume the note for the
    first record (the in-flight groups the checkpoint could not keep)."""
    state = ctx.state
    v0 = int(state.version)
    snaps = ParamSnapshots(acfg.ring_capacity, directory=None if acfg.snapshot_store == "memory"
                           else run_dir / "snapshots" / "ring")
    buffer = TrajectoryBuffer(loop.prompts_per_step, acfg.max_staleness,
                              stale_policy=acfg.stale_policy, stale_weight=acfg.stale_weight,
                              start_version=v0)
    resume_note = {}
    if resume:
        meta_async = dict(ctx.meta.get("async") or {})
        resume_note["dropped_on_resume_groups"] = int(meta_async.get("in_flight_groups", 0))
    return AsyncRun(ctx=ctx, model_config=model_config, task=task, config=config, loop=loop,
                    acfg=acfg, run_dir=run_dir, rollout_device=rollout_device,
                    snapshot_device=jax.devices()[0] if mesh is None else None,
                    progress=progress, snaps=snaps, buffer=buffer, state=state,
                    data_position=ctx.data_position, resume_note=resume_note)


def start(run: AsyncRun, *, resume: bool, on_eval: Any) -> None:
    """Everything the first step needs, in this order: the ring's saved versions
    (deterministic resume), the state's params published, the APRIL source (fresh from the
    data position, or its saved FIFO and base), the EWMA params (a copy of the state's),
    the evaluator, the stop check before the first step, the step-0 eval of the published
    policy (or on resume the eval a stop left undone), the producer thread (threaded
    mode), the progress bar and the step profile."""
    ctx, acfg, state = run.ctx, run.acfg, run.state
    if resume and acfg.mode == "deterministic":
        for v, p in iter_snapshots(run.run_dir, ctx.start, state.params):  # one at a time
            run.snaps.put(v, p, copy=False, device=run.snapshot_device)
    publish(run, state)
    if acfg.rollout == "april":
        saved, base = None, ctx.data_position
        if resume:
            saved = load_rollout_state(run.run_dir, ctx.start)
            base = int(saved["base"])
        run.april = AprilSource(run.model_config, run.task, run.config, run.loop,
                                AprilConfig(over_provision=acfg.over_provision,
                                            mask_offpolicy_prefix=acfg.mask_offpolicy_prefix),
                                base=base,
                                seed=rollout_seed(state.rng)[0],
                                saved=None if saved is None else saved["april"])
    if acfg.proximal == "ewma":
        run.ewma = copy_params(state.params)
    run.do_eval = make_evaluator(run.model_config, run.task, run.config, run.loop,
                                 ctx.logger, on_eval)
    pending = 0 if not resume else ctx.pending_eval()
    ctl = ctx.control
    if ctl.boundary(ctx.start).stop:  # a signal before the first step
        raise stop_run(run, pending_eval=pending)
    if pending is not None:
        try:
            with ctl.abandonable():
                run.do_eval(pending, *run.published)
        except StepAbandoned:
            raise stop_run(run, f"the eval of step {pending}", pending) from None
    if acfg.mode == "threaded":
        run.producer = RolloutProducer(model_config=run.model_config, task=run.task,
                                       config=run.config, loop=run.loop, rollout=acfg.rollout,
                                       buffer=run.buffer, latest=run.latest,
                                       data_position=ctx.data_position,
                                       rng=np.asarray(jax.device_get(state.rng)),
                                       device=run.rollout_device, april=run.april)
        run.thread = threading.Thread(target=run.producer.run, name="tandem-rollout", daemon=True)
        run.thread.start()
    run.bar = tqdm(total=run.loop.steps, initial=ctx.start, disable=not run.progress,
                   desc=f"async η={run.k}", dynamic_ncols=True)
    run.prof = StepProfile((*PHASES, *EXTRA_PHASES))


def publish(run: AsyncRun, st: TrainState) -> None:
    """Put st.params into the ring as version st.version (on the rollout device) and make
    them the sampler's params, in one assignment: the producer never sees new params with
    an old version (LoRA: the ring keeps adapter versions; the sampler gets ctx.policy's)."""
    v = int(st.version)
    run.published = (run.ctx.policy(run.snaps.put(v, st.params, device=run.rollout_device)), v)


# ----------------------------------------------------------------------------- one step
def take_batch(run: AsyncRun, step: int, st: TrainState, pos: int) -> Taken:
    """Step `step`'s b groups at the learner's version v = st.version (threaded: from the
    producer; deterministic: sampled here with the params of max(v - η, 0))."""
    if run.producer is None:
        return sample_deterministic(run, step, st, pos)
    return wait_for_producer(run, step, st, pos)


def sample_deterministic(run: AsyncRun, step: int, st: TrainState, pos: int) -> Taken:
    """Deterministic mode: sample with the ring's params of bv = max(v - η, 0), put the
    groups into the buffer and take a batch. Static: one call of
    rl.loops.sync.sample_batch_groups (its versions are exactly bv, never stale; its rng
    becomes the state's); APRIL: rounds of the remaining groups until the buffer gives a
    batch (resumed prefixes may be older than η and dropped), at most 4·(η + 1) rounds."""
    loop, buffer, prof, k = run.loop, run.buffer, run.prof, run.k
    b = loop.prompts_per_step
    v = int(st.version)
    bv = max(v - k, 0)
    got, stats, rounds = None, {"sampled_tokens": 0}, 0
    while got is None:
        if run.april is None:
            sampler = st.replace(params=run.snaps[bv], version=jnp.asarray(bv, jnp.int32))
            try:
                groups, sampler, pos, stats = sample_batch_groups(
                    sampler, run.model_config, run.task, run.config, loop, pos, prof,
                    policy=run.ctx.policy)
            except NonFiniteError as err:  # a task's reward: name the step too
                raise NonFiniteError(f"step {step + 1}: {err}") from None
            st = st.replace(rng=sampler.rng)
        else:
            with prof.phase("wait_s"):  # a whole APRIL round
                groups = run.april.round(run.ctx.policy(run.snaps[bv]), bv,
                                         b - buffer.stats()["queued_groups"])
            pos = run.april.position
            stats["sampled_tokens"] += run.april.generated_tokens
        if not buffer.reserve(len(groups)):
            raise RuntimeError(f"admission refused {len(groups)} groups at version "
                               f"{v}: {buffer.stats()}")
        with prof.phase("host_s"):
            for g in groups:
                buffer.put(g)
            got = buffer.get_batch(b, v, timeout=0)
        rounds += 1
        if got is None and (run.april is None or rounds > 4 * (k + 1)):
            raise RuntimeError(
                f"step {step + 1}: the buffer dropped every group as older than "
                f"max_staleness={k} versions ({buffer.stats()}); use "
                "stale_policy='downweight' or a larger max_staleness")
    return Taken(got, st, pos, stats)


def wait_for_producer(run: AsyncRun, step: int, st: TrainState, pos: int) -> Taken:
    """Threaded mode: poll the buffer for b groups admissible at version v; a producer
    error stops the wait (NonFiniteError, a task's reward, named with the step;
    anything else as RuntimeError chained to it), and so does a producer thread that ended
    without one. The wait is the profile's wait_s; sampled_tokens is what the producer
    sampled since the last step."""
    producer, v = run.producer, int(st.version)
    got, t_wait = None, time.perf_counter()
    while got is None:
        abandon_point()  # a stop request while waiting (rl.runtime.preemption)
        got = run.buffer.get_batch(run.loop.prompts_per_step, v, timeout=0.1)
        if isinstance(producer.error, NonFiniteError):  # a task's reward
            raise NonFiniteError(f"step {step + 1}: {producer.error}")
        if producer.error is not None:
            raise RuntimeError(
                f"step {step + 1}: the rollout thread failed: "
                f"{type(producer.error).__name__}: {producer.error}") from producer.error
        if got is None and not run.thread.is_alive():
            raise RuntimeError(f"step {step + 1}: the rollout thread stopped without an "
                               "error before the run was complete")
    run.prof.add("wait_s", time.perf_counter() - t_wait)
    total = producer.sampled_tokens  # read once: tokens sampled meanwhile count next step
    stats = {"sampled_tokens": total - run.producer_tokens}
    run.producer_tokens = total
    return Taken(got, st, pos, stats)


def build_train_batch(run: AsyncRun, got: Any, version: int) -> tuple[TrainBatch, dict]:
    """(TrainBatch of the taken groups, the batch's own metrics). The batch carries the
    buffer's token weights (down-weighted stale tokens), the off-policy prefix mask with
    mask_offpolicy_prefix, and proximal_logprobs with proximal "exact" (each token under its
    own behaviour version's params from the ring) or "ewma" (under the EWMA params). The
    metrics: behaviour versions and lag against `version`, an environment's episode
    metrics, the reward metrics and the run clock's time_s."""
    model_config, config, loop, acfg, prof = run.model_config, run.config, run.loop, run.acfg, run.prof
    ctx = run.ctx
    with prof.phase("host_s"):
        batch = build_batch(got.groups, model_config=model_config, task=run.task,
                            config=config, group_size=loop.group_size,
                            token_weights=got.token_weights)
        if acfg.mask_offpolicy_prefix:
            batch = offpolicy_prefix_batch(batch, loop.group_size)
    with prof.phase("proximal_s"):
        if acfg.proximal == "exact":
            batch = batch.replace(proximal_logprobs=jax.block_until_ready(
                exact_proximal_logprobs(run.snaps if ctx.lora is None else
                                        ctx.lora.snapshots(run.snaps), model_config, batch,
                                        config.temperature, config.attn_impl)))
        elif acfg.proximal == "ewma":
            batch = batch.replace(proximal_logprobs=jax.block_until_ready(
                policy_logprobs(run.ewma if ctx.lora is None else ctx.lora.composed(run.ewma),
                                model_config, batch, config.temperature, config.attn_impl)))
    with prof.phase("host_s"):
        extra = batch_version_metrics(batch, version)
        extra.update(episodes.take_episode_metrics(run.task))  # an environment: its episodes
        extra.update(batch_reward_metrics(batch.reward_names, batch.rewards,
                                          loop.group_size, config.reward_weights),
                     time_s=run.do_eval.clock())
    return batch, extra


def update_learner(run: AsyncRun, step: int, st: TrainState, batch: TrainBatch,
                   pos: int) -> dict[str, float]:
    """One optimizer step; the new state and data position become the run's (what a
    final checkpoint saves); the EWMA params follow; version v + 1 is published and,
    unless this was the last step, the buffer admits against it. The step's metrics as
    floats."""
    prof = run.prof
    with prof.phase("learner_s"):
        st, metrics = jax.block_until_ready(run.ctx.step_fn(st, batch, run.ctx.ref))
    run.state, run.data_position = st, pos
    with prof.phase("proximal_s"):
        if run.ewma is not None:
            run.ewma = jax.block_until_ready(ewma_update(run.ewma, st.params, run.acfg.ewma_beta))
    with prof.phase("transfer_s"):
        publish(run, st)
        if step + 1 < run.loop.steps:  # after the last step, admit nothing more
            run.buffer.set_version(int(st.version))
        metrics = jax.device_get(metrics)
    return {kk: float(x) for kk, x in metrics.items()}


def record_step(run: AsyncRun, step: int, metrics: dict, stats: dict, extra: dict, *,
                rollout_wait_s: float, train_s: float, busy_s: float) -> dict:
    """Log the train record of step + 1: the step's metrics, the sampling counters, the
    batch's metrics, rollout_wait_s / train_s / tokens_per_s (sampled tokens over busy_s),
    data_position (threaded: where the producer is), buffer_* counters, APRIL's metrics,
    the resume note (first step after a resume) and the step profile; advance the bar."""
    if run.producer is not None:
        run.data_position = run.producer.position()[0]
    metrics.update(stats)
    metrics.update(extra, rollout_wait_s=rollout_wait_s, train_s=train_s,
                   tokens_per_s=stats["sampled_tokens"] / max(busy_s, 1e-9),
                   data_position=run.data_position,
                   **{f"buffer_{kk}": x for kk, x in run.buffer.stats().items()})
    if run.april is not None:
        metrics.update(run.april.metrics())
    if step == run.ctx.start:
        metrics.update(run.resume_note)
    metrics.update(run.prof.finish())
    record = run.ctx.logger.log(step + 1, metrics, kind="train")
    run.bar.update(1)
    run.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                        lag=f"{extra.get('version_lag_mean', 0):.1f}")
    return record


def evaluate_and_save(run: AsyncRun, done: int) -> None:
    """After `done` steps, at the boundary all processes agree on (RunControl.boundary):
    a stop signal raises Preempted after checkpointing this step (a due eval left for the
    resumed run); else eval the published policy (= the state's version) every
    loop.eval_every steps and at the end (a stop request during it abandons it the same
    way); checkpoint every loop.save_every steps, by time (loop.save_every_minutes) and at
    the end, then prune side files of checkpoints orbax dropped; then raise the failure of
    a finished background save, if any."""
    loop, ctl = run.loop, run.ctx.control
    when = ctl.boundary(done)
    is_last = done == loop.steps
    if is_last or (loop.eval_every and done % loop.eval_every == 0):
        if when.stop:
            raise stop_run(run, f"the eval of step {done}", done)
        try:
            with ctl.abandonable():
                ev = run.do_eval(done, *run.published)  # the policy of st.version
        except StepAbandoned:
            raise stop_run(run, f"the eval of step {done}", done) from None
        if run.progress:
            run.bar.write(f"step {done}: eval reward {ev['reward']:.3f}")
    if when.stop:
        raise stop_run(run)
    if is_last or when.save or (loop.save_every and done % loop.save_every == 0):
        save_checkpoint(run, done, run.state)
        ctl.saved()
        prune_side_files(run.run_dir, run.ctx.ckpt)
    run.ctx.ckpt.poll()  # a failed background write stops the run here


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(run: AsyncRun, step: int, st: TrainState,
                    pending_eval: int | None = None) -> None:
    """Checkpoint `st` at `step` (asynchronous orbax save). Meta: task, config record,
    async {mode, max_staleness, buffer counters, threaded: in_flight_groups}, data
    position (and pending_eval: the eval a stop left undone). Side files first: APRIL's
    state (threaded: as of the producer's last finished round), deterministic: the ring's
    versions max(v - η, 0) .. v. Threaded: the data position and rng are the producer's
    (consistent with each other)."""
    ctx, acfg, buffer, producer = run.ctx, run.acfg, run.buffer, run.producer
    meta = {"task": run.task.name, "config": ctx.config,
            "async": {"mode": acfg.mode, "max_staleness": run.k, "buffer": buffer.stats()}}
    if pending_eval is not None:
        meta["pending_eval"] = int(pending_eval)
    if run.april is not None:  # the FIFO of unfinished groups is restored on resume
        april_state = run.april.state() if producer is None else producer.april_snapshot[0]
        save_rollout_state(run.run_dir, step, april_state)
    if producer is not None:  # threaded: the producer's position and rng chain
        pos, rng = producer.position()
        st = st.replace(rng=jax.device_put(rng, st.rng.sharding))
        stats = buffer.stats()
        # queued groups are lost on resume; APRIL re-samples its running round's new
        # prompts and restores its FIFO, so only the queued ones count there
        meta["async"]["in_flight_groups"] = stats["queued_groups"] + (
            0 if run.april is not None else stats["running_groups"])
    else:
        pos = run.data_position
        versions = [v for v in range(max(int(st.version) - run.k, 0), int(st.version) + 1)
                    if v in run.snaps]
        save_snapshots(run.run_dir, step, run.snaps, versions)
    meta["data_position"] = int(pos)
    ctx.ckpt.save(step, st, meta)


def final_checkpoint(run: AsyncRun, pending_eval: int | None = None) -> None:
    """After a stop or a fault: checkpoint the run's state (the last completed step)
    unless that step is already saved or the state was consumed (donated) by an
    interrupted step (a warning then); wait until it is on disk."""
    st = run.state
    step = int(st.step)
    run.ctx.ckpt.wait()
    if step in run.ctx.ckpt.all_steps():
        return
    if not alive(st):
        warnings.warn("the train state was consumed by an interrupted step; no final "
                      "checkpoint written (the last periodic one stands)")
        return
    save_checkpoint(run, step, st, pending_eval)
    run.ctx.ckpt.wait()


def stop_run(run: AsyncRun, abandoned: str = "", pending_eval: int | None = None) -> Preempted:
    """A stop signal: the producer stopped, the last completed step checkpointed (with the
    eval left undone, if any); the Preempted error to raise."""
    if run.producer is not None:
        run.producer.stop()
    final_checkpoint(run, pending_eval)
    return run.ctx.preempted(int(run.state.step), abandoned)


# ----------------------------------------------------------------------------- the end
def stop_after_fault(run: AsyncRun, err: BaseException) -> StorageError | None:
    """Any exception out of a stage: stop the producer and close the buffer; on
    KeyboardInterrupt or a producer error, write a final checkpoint (its own failure is a
    warning, so the original error is the one that surfaces). Returns the StorageError
    to raise instead of `err` when `err` is a storage failure; else the caller re-raises."""
    if run.producer is not None:
        run.producer.stop()
    run.buffer.close()
    if isinstance(err, Preempted):
        return None
    failure = run.ctx.storage_failure(err) if isinstance(err, Exception) else None
    if failure is None and (isinstance(err, KeyboardInterrupt) or (
            run.producer is not None and run.producer.error is not None)):
        try:
            final_checkpoint(run)
        except Exception as save_err:  # keep the original error the one that surfaces
            warnings.warn(f"final checkpoint failed: {type(save_err).__name__}: {save_err}")
    return None if failure is err else failure


def shut_down(run: AsyncRun, *, quiet: bool = False) -> None:
    """Always, error or not: stop the producer, close the buffer, join the thread (after
    acfg.join_timeout_s a warning: it is a daemon thread), delete a disk ring's files
    (each checkpoint links its own), close the run context (quiet: an error is on its way
    out, so a failure to close is a warning)."""
    if run.producer is not None:
        run.producer.stop()
    run.buffer.close()
    if run.snaps.directory is not None:
        run.snaps.clear()
    if run.thread is not None:
        run.thread.join(run.acfg.join_timeout_s)
        if run.thread.is_alive():
            warnings.warn(f"the rollout thread did not stop within {run.acfg.join_timeout_s} s; "
                          "it is a daemon thread and ends with the process")
    run.ctx.close(quiet=quiet)


def result(run: AsyncRun) -> RunResult:
    """The RunResult: final state, the train and eval records, run dir, data position."""
    records = run.ctx.logger.records
    return RunResult(state=run.state, train=[r for r in records if r["kind"] == "train"],
                     eval=[r for r in records if r["kind"] == "eval"], run_dir=run.run_dir,
                     data_position=run.data_position)


# ----------------------------------------------------------------------------- helpers
def batch_version_metrics(batch: TrainBatch, version: int) -> dict[str, float]:
    """Behaviour-version statistics of a batch's loss tokens: min/max version and the lag
    version − v_b (mean, max); {} for a batch without loss tokens."""
    mask = np.asarray(batch.loss_mask)
    vers = np.asarray(batch.versions)[mask]
    if vers.size == 0:
        return {}
    lag = version - vers
    return {"behaviour_version_min": float(vers.min()), "behaviour_version_max": float(vers.max()),
            "version_lag_mean": float(lag.mean()), "version_lag_max": float(lag.max())}


def alive(tree: Any) -> bool:
    """False if any leaf of `tree` was deleted (donated to a jitted step)."""
    return not any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree))
