"""The run harness: what every training loop does the same way, around a batch source
(rl.loops.source) that says where each step's groups come from.

    run_loop(model_config, params, task, config, source, *, resume, hooks) -> RunResult

 1. open the run (rl.loops.context.open_run: stop signals, run-dir lock, state fresh or
    restored, logger, the checked jitted step), the rollout spec built once
    (rl.loops.rollouts.rollout_spec), `source.open` (its side state), the evaluator;
 2. the stop check before the first step, the step-0 eval (or, on resume, the eval a stop
    left undone), `source.start`;
 3. per step (`one_step`): `source.take` (abandonable where the source allows), its
    `train_batch`, the jitted learner step, `source.after_update`, the train record
    (step metrics, sampling counters, the batch's metrics, the source's fields, the step
    profile), the progress bar;
 4. the step boundary every process agrees on (`step_boundary`): a stop signal
    checkpoints the step and raises Preempted (a due eval left to the resumed run); the
    eval and checkpoint cadence (loop.eval_every, loop.save_every, time-based saves,
    the end), the check of the background checkpoint write, hooks.on_step, the time limit;
 5. faults (`fail`): the source stopped; a storage failure becomes one StorageError; a
    KeyboardInterrupt (or the source's own fatal errors) checkpoints the last completed
    step first; any other error is noted with what the run was doing; teardown always
    (`source.close`, the run context closed); then the RunResult.

A checkpoint's meta is the harness's (data position, task, config record, pending eval)
plus the source's own entries (`source.checkpoint`: scheduler, pruner, async counters and
the side files beside it).
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

import jax
from tqdm.auto import tqdm

from models.config import ModelConfig
from rl.learner.batch import NonFiniteError, TrainState, global_batch
from rl.loops import episodes
from rl.loops.config import Resume, RunConfig, RunHooks, as_resume
from rl.loops.context import RunContext, open_run, resolve_mesh, run_clock
from rl.loops.evaluation import make_evaluator
from rl.loops.rollouts import RolloutSpec, rollout_spec
from rl.loops.source import BatchSource, Taken
from rl.runtime.logging import StepProfile
from rl.runtime.preemption import Preempted, StepAbandoned
from rl.tasks.base import Task


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


@dataclasses.dataclass
class Run:
    """What the harness and its source share. Fixed: the context (rl.loops.context), the
    run's config, the learner's TrainConfig as given (`train`: sampling, batches and evals
    read it; the step runs source.train_config of it), the train rollouts' spec, the hooks,
    the mesh and whether the run resumed. Mutable: `state` and `data_position` (the last
    completed step's: what a final checkpoint saves), the evaluator, bar and profile,
    `in_step` (between a step's take and its update) and `doing` (for error notes)."""

    ctx: RunContext
    config: RunConfig
    train: Any
    spec: RolloutSpec
    hooks: RunHooks
    mesh: Any
    resumed: bool
    state: TrainState
    data_position: int
    do_eval: Any = None
    clock: Any = None  # the run's wall clock (context.run_clock: a resumed run continues it)
    bar: Any = None
    prof: StepProfile | None = None
    in_step: bool = False
    doing: str = "setup"

    @property
    def loop(self) -> Any:
        return self.config.loop

    @property
    def task(self) -> Task:
        return self.spec.task

    @property
    def model_config(self) -> ModelConfig:
        return self.spec.model_config


def record_config(config: RunConfig, task: Task, source: BatchSource) -> dict:
    """The extra entries of the run's config record (resume compares them): the source's,
    the rollout options, the task, the reward, an environment's episode options, a
    scheduler and pruning when set."""
    out = {**source.record_config(), "rollout": config.rollout, "task": task.name,
           "reward": config.reward, **episodes.episode_config(task)}
    if not config.scheduler.is_default:
        out["scheduler"] = config.scheduler
    if config.prune is not None:
        out["prune"] = config.prune
    return out


def run_loop(model_config: ModelConfig, params: Any, task: Task, config: RunConfig,
             source: BatchSource, *, resume: bool | Resume = False,
             hooks: RunHooks | None = None) -> RunResult:
    """Train `params` on `task` for config.loop.steps optimizer steps with the groups
    `source` gives (module doc). The config must be validated (RunConfig.validate; rl.run
    and rl.loops.run do it once, before anything loads). `params` are the initial
    weights (also the frozen KL reference when config.train.loss.kl_coef > 0); they are
    copied, never donated."""
    hooks = hooks or RunHooks()
    resume_opts = as_resume(resume)
    mesh = source.devices(resolve_mesh(config, model_config, hooks))
    ctx = open_run(model_config, params, config, train=source.train_config(config.train),
                   resume=resume_opts, mesh=mesh, hooks=hooks,
                   extra_config=record_config(config, task, source))
    run = Run(ctx=ctx, config=config, train=config.train, hooks=hooks, mesh=mesh,
              spec=rollout_spec(model_config, task, config),
              resumed=resume_opts is not None, state=ctx.state,
              data_position=ctx.data_position)
    try:
        source.open(run, params)
        # the state trains its own copy (open_run): drop this frame's reference to the
        # caller's, so that a caller that handed them over (rl.run.launch) holds no second
        # copy of the weights through the run
        del params
        begin(run, source)
        for step in range(ctx.start, run.loop.steps):
            record = one_step(run, source, step)
            if step_boundary(run, source, step + 1, record):
                break
        run.bar.close()
    except BaseException as err:
        fail(run, source, err)
        raise
    close(run, source)
    records = ctx.logger.records
    return RunResult(state=run.state, train=[r for r in records if r["kind"] == "train"],
                     eval=[r for r in records if r["kind"] == "eval"], run_dir=config.output_dir,
                     data_position=run.data_position)


def begin(run: Run, source: BatchSource) -> None:
    """Before the first step: the evaluator, the stop check, the step-0 eval (or the one
    a stop left undone), the source started, the progress bar and the step profile."""
    ctx = run.ctx
    run.clock = run_clock(ctx.logger)
    run.do_eval = make_evaluator(run.spec, run.loop, ctx.logger, on_eval=run.hooks.on_eval,
                                 reward_weights=run.train.reward_weights, clock=run.clock)
    pending = 0 if not run.resumed else ctx.pending_eval()
    if ctx.control.boundary(ctx.start).stop:  # a signal before the first step
        raise stop(run, source, pending_eval=pending)
    if pending is not None:  # the step-0 eval, or the one a stop left undone
        evaluate(run, source, pending)
    source.start(run)
    run.bar = tqdm(total=run.loop.steps, initial=ctx.start, disable=not run.config.logging.progress,
                   desc=source.label, dynamic_ncols=True)
    run.prof = StepProfile(source.phases)


def evaluate(run: Run, source: BatchSource, step: int) -> dict:
    """The eval of `step` with the source's policy; a stop request during it abandons it:
    the last completed step is checkpointed with this eval pending (Preempted)."""
    run.doing = f"the eval of step {step}"
    try:
        with run.ctx.control.abandonable():
            return run.do_eval(step, *source.eval_policy(run))
    except StepAbandoned:
        raise stop(run, source, f"the eval of step {step}", step) from None


def one_step(run: Run, source: BatchSource, step: int) -> dict:
    """Step `step` + 1: take, build the batch, update, record (module doc). Returns the
    logged train record."""
    prof, ctx = run.prof, run.ctx
    prof.start()
    t0 = time.perf_counter()
    run.in_step, run.doing = True, f"step {step + 1}"
    try:
        with ctx.control.abandonable(source.can_abandon):
            taken = source.take(run, step)
    except NonFiniteError as err:  # a task's reward: name the step too
        raise NonFiniteError(f"step {step + 1}: {err}") from None
    except StepAbandoned:  # the state and data position are still the last step's
        raise stop(run, source, f"step {step + 1}'s rollouts") from None
    t1 = time.perf_counter()
    batch, extra = source.train_batch(run, taken)
    metrics = update(run, taken, place_batch(run, batch))
    source.after_update(run, step)
    with prof.phase("transfer_s"):
        metrics = jax.device_get(metrics)
    t2 = time.perf_counter()
    with prof.phase("host_s"):
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics.update(taken.stats)
        metrics.update(extra)
        metrics.update({source.wait_metric: t1 - t0, "train_s": t2 - t1,
                        "tokens_per_s": taken.stats["sampled_tokens"] / max(t2 - t0, 1e-9),
                        "data_position": run.data_position, "time_s": run.clock()})
        metrics.update(source.record_fields(run, step))
    metrics.update(prof.finish())
    record = ctx.logger.log(step + 1, metrics, kind="train")
    run.bar.update(1)
    run.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                        tok_s=f"{metrics['tokens_per_s']:.0f}")
    return record


def place_batch(run: Run, batch: Any) -> Any:
    """Each process's rows -> one global batch; on one device, on it before the step (so
    the transfer is timed here)."""
    with run.prof.phase("transfer_s"):
        if jax.process_count() > 1:
            return global_batch(batch, run.mesh)
        if run.mesh is None:
            return jax.device_put(batch, jax.devices()[0])
        return batch


def update(run: Run, taken: Taken, batch: Any) -> dict:
    """One optimizer step on the taken state; its result becomes the run's state (and the
    taken data position the run's): what a stop or a fault checkpoints from now on."""
    ctx = run.ctx
    with run.prof.phase("learner_s"):
        state, metrics = jax.block_until_ready(ctx.step_fn(taken.state, batch, ctx.ref))
    run.state, run.data_position, run.in_step = state, taken.data_position, False
    return metrics


def step_boundary(run: Run, source: BatchSource, done: int, record: dict) -> bool:
    """After `done` steps (module doc, 4). Returns True when the time limit ended the run."""
    loop, ctl, ctx = run.loop, run.ctx.control, run.ctx
    when = ctl.boundary(done, record["time_s"])
    is_last = done == loop.steps or when.out_of_time
    if is_last or (loop.eval_every and done % loop.eval_every == 0):
        if when.stop:  # the resumed run evaluates first
            raise stop(run, source, f"the eval of step {done}", done)
        ev = evaluate(run, source, done)
        if run.config.logging.progress:
            run.bar.write(f"step {done}: eval reward {ev['reward']:.3f}")
    if when.stop:
        raise stop(run, source)
    if is_last or when.save or (loop.save_every and done % loop.save_every == 0):
        save(run, source, done, run.state)
        ctl.saved()
        source.after_save(run)
    ctx.ckpt.poll()  # a failed background write stops the run here
    if run.hooks.on_step is not None:
        run.hooks.on_step(record)
    if when.out_of_time:
        run.bar.write(f"time limit {loop.time_limit_s:.0f} s reached after step {done}")
        return True
    return False


# ----------------------------------------------------------------------------- checkpoints
def save(run: Run, source: BatchSource, step: int, state: TrainState,
         pending_eval: int | None = None) -> None:
    """Checkpoint `state` as `step` (an asynchronous orbax save): the source writes its side
    files and gives its meta entries (and the state to save: a threaded producer's rng)."""
    state, extra = source.checkpoint(run, step, state)
    meta = {"data_position": int(run.data_position), "task": run.task.name,
            "config": run.ctx.config, **extra}
    if pending_eval is not None:
        meta["pending_eval"] = int(pending_eval)
    run.ctx.ckpt.save(step, state, meta)


def final_save(run: Run, source: BatchSource, pending_eval: int | None = None) -> None:
    """After a stop or a fault: checkpoint the run's state (the last completed step)
    unless that step is saved already or the state was consumed (donated) by an
    interrupted step (a warning then); wait until it is on disk."""
    state, ckpt = run.state, run.ctx.ckpt
    ckpt.wait()
    if int(state.step) in ckpt.all_steps():
        return
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
        warnings.warn("the train state was consumed by an interrupted step; no final "
                      "checkpoint written (the last periodic one stands)")
        return
    save(run, source, int(state.step), state, pending_eval)
    ckpt.wait()


def stop(run: Run, source: BatchSource, abandoned: str = "",
         pending_eval: int | None = None) -> Preempted:
    """A stop signal: the source stopped, the last completed step checkpointed (with the
    eval left undone, if any); the Preempted error to raise."""
    source.stop()
    final_save(run, source, pending_eval)
    return run.ctx.preempted(int(run.state.step), abandoned)


# ----------------------------------------------------------------------------- the end
def fail(run: Run, source: BatchSource, err: BaseException) -> None:
    """Any exception out of the run (module doc, 5): the source stopped, the last step
    checkpointed after a KeyboardInterrupt (when no half-taken step moved the source's
    state: not in a step, or the source can drop one) or a fault the source names, the run
    closed quietly (a failure to close is then a warning); a storage failure is raised as
    one StorageError naming the last good checkpoint; the caller re-raises `err` otherwise."""
    source.stop()
    if isinstance(err, Preempted):
        close(run, source)
        return
    failure = run.ctx.storage_failure(err) if isinstance(err, Exception) else None
    interrupted = isinstance(err, KeyboardInterrupt) and (not run.in_step or source.can_abandon)
    if failure is None and (interrupted or source.final_save_due(run, err)):
        try:
            final_save(run, source)
        except Exception as save_err:  # noqa: BLE001 - keep the original error the one raised
            warnings.warn(f"final checkpoint failed: {type(save_err).__name__}: {save_err}")
    close(run, source, quiet=True)
    if failure is not None and failure is not err:
        raise failure from err
    if failure is None and isinstance(err, Exception):  # e.g. the task's reward function
        err.add_note(f"(during {run.doing} of the run in {str(run.config.output_dir)!r})")


def close(run: Run, source: BatchSource, *, quiet: bool = False) -> None:
    """Always, error or not: the source's teardown, then the run context's (quiet: an
    error is on its way out, so a failure to close is a warning)."""
    try:
        source.close(run)
    finally:
        run.ctx.close(quiet=quiet)
