"""What every loop sets up the same way and tears down at the end: `open_run` starts
recording stop signals (rl.runtime.preemption.stop_signals: SIGTERM / SIGINT stop the run
at its next safe point with a checkpoint), takes the run dir's lock (rl.runtime.runlock), copies the params, starts fresh or
restores the latest good checkpoint (checking its recorded config; leftovers of an
unfinished save are deleted), opens the metrics logger and jits the (checked) train step;
`RunContext` holds those pieces, the run's `RunControl` (stop and time-based save
decisions) and the stop / storage helpers; `close()` releases them; `run_clock` is the
run's wall clock (a resumed run continues it); `resolve_mesh` the learner's mesh. Used by
the run harness (rl.loops.harness).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from rl.learner.batch import TrainState, init_train_state
from rl.learner.config import TrainConfig
from rl.learner.jitted import make_train_step, ref_shardings, state_shardings
from rl.loops.adapters import (
    BASE_KEY,
    LoraRun,
    check_base,
    latest_record,
    lora_run,
    policy_fn,
)
from rl.loops.config import Resume, RunConfig, RunHooks
from rl.loops.validation import (
    ConfigError,
    check_allowed_changes,
    check_resume_config,
    config_record,
    record_defaults,
)
from rl.runtime import preemption
from rl.runtime.checkpoint import Checkpointer, CheckpointError
from rl.runtime.distributed import is_main_process
from rl.runtime.logging import MetricsLogger
from rl.runtime.mesh import make_mesh_preset, validate_mesh
from rl.runtime.preemption import Preempted, RunControl
from rl.runtime.runlock import RunLock
from rl.runtime.storage import StorageError


@dataclasses.dataclass
class RunContext:
    """The pieces every loop sets up the same way (see open_run): the placed state, the
    KL reference (or None), checkpointer, logger, jitted step, data position to start
    from, the first step and the restored checkpoint's meta ({} for a fresh run)."""

    state: TrainState
    ref: Any
    ckpt: Checkpointer
    logger: MetricsLogger
    step_fn: Any
    data_position: int
    start: int
    meta: dict
    config: dict  # config_record of this run: every checkpoint's meta carries it
    lora: LoraRun | None = None  # a LoRA run's frozen base (= ref) and sampler params
    control: RunControl | None = None  # stop / time-based save decisions (open_run)
    signals: contextlib.ExitStack | None = None  # stop_signals(), left by close()

    @property
    def policy(self) -> Callable[[Any], Any]:
        """state.params -> the sampler's / evals' params (rl.loops.adapters.policy_fn)."""
        return policy_fn(self.lora)

    def pending_eval(self) -> int | None:
        """The step whose eval a preempted run left undone (checkpoint meta "pending_eval"),
        unless the metrics already hold it; None otherwise."""
        step = self.meta.get("pending_eval")
        if step is None or any(r["kind"] == "eval" and r["step"] == step
                               for r in self.logger.records):
            return None
        return int(step)

    def save_final(self, step: int, state: Any, meta: dict) -> None:
        """Checkpoint `state` as `step` unless that step is saved already, and wait until
        it is on disk (a stop or an interrupt)."""
        self.ckpt.wait()
        if step not in self.ckpt.all_steps():
            self.ckpt.save(step, state, meta)
            self.ckpt.wait()

    def save_after_interrupt(self, state: Any, meta: Callable[[], dict]) -> None:
        """After a KeyboardInterrupt: checkpoint `state` (the last completed step; meta()
        its record) unless that step is saved or the state was consumed (donated) by an
        interrupted step; a failure here is a warning, so the interrupt surfaces."""
        try:
            if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
                warnings.warn("the train state was consumed by an interrupted step; no final "
                              "checkpoint written (the last periodic one stands)")
                return
            self.save_final(int(state.step), state, meta())
        except Exception as err:  # noqa: BLE001 - the interrupt is the error to surface
            warnings.warn(f"final checkpoint failed: {type(err).__name__}: {err}")

    def preempted(self, step: int, abandoned: str = "") -> Preempted:
        """The Preempted error of a run that stopped after `step` (its checkpoint saved)."""
        return Preempted(self.control.signal_name, step, str(self.ckpt.directory), abandoned)

    def storage_failure(self, err: BaseException) -> StorageError | None:
        """The StorageError for `err` (a failed write anywhere in the run dir) naming the
        last good checkpoint; None if `err` is not a storage failure."""
        if isinstance(err, StorageError):
            return err if err.last_good is not None else err.with_last_good(
                self.ckpt.last_good())
        where = getattr(err, "filename", None) or self.ckpt.directory.parent
        return StorageError.of(err, what="a run file", path=where,
                               last_good=self.ckpt.last_good())

    def close(self, *, quiet: bool = False) -> None:
        """Release the checkpointer (waiting for its last save), the run lock, the logger
        and the stop signals. quiet=True (an error is on its way out): a failure here is a
        warning, so it does not hide that error."""
        try:
            try:
                self.ckpt.close()
            finally:
                try:
                    self.logger.close()
                finally:
                    if self.signals is not None:
                        self.signals.close()
        except Exception as err:  # re-raised unless quiet
            if not quiet:
                raise
            warnings.warn(f"while closing the run after an error: {type(err).__name__}: {err}")


def open_run(model_config: ModelConfig, params: Any, config: RunConfig, *, train: TrainConfig,
             resume: Resume | None, mesh: jax.sharding.Mesh | None, hooks: RunHooks,
             extra_config: dict | None = None) -> RunContext:
    """Run dir (config.output_dir; process 0 holds its lock, rl.runtime.runlock, until
    ckpt.close()), own copy of the params (+ frozen reference with KL), fresh or restored
    state placed for the jitted step of `train` (the TrainConfig the step runs: a source's
    view of config.train), checkpointer and logger (config.logging.wandb, the config as the
    wandb config), the step compiled with hooks.compiler_options. The config was validated
    before (RunConfig.validate); a resume must match the checkpoint's recorded config (but
    for resume.allow_changes) and have steps left to run (resume=None: a fresh run). With
    train.lora (rl.loops.adapters): `params` are the frozen base (quantized with qlora,
    placed on the mesh), which becomes ctx.ref (the step's third argument) and ctx.lora; the
    state holds fresh or restored adapters; the base hash joins the config record, checked
    before restoring."""
    loop, run_dir = config.loop, config.output_dir
    record = config_record(train, loop, extra_config)
    signals = contextlib.ExitStack()  # a stop signal from here on stops the run cleanly
    signals.enter_context(preemption.stop_signals())
    try:
        allow = check_allowed_changes(() if resume is None else resume.allow_changes)
        ckpt = locked_checkpointer(run_dir, loop, resume)
    except BaseException:
        signals.close()
        raise
    logger = None
    try:  # any failure from here on releases the checkpointer and with it the lock
        state, ref, lora, data_position, meta = initial_state(
            model_config, params, train, loop, _Opening(
                mesh=mesh, resume=resume, ckpt=ckpt, record=record, allow=allow,
                defaults=record_defaults(train, loop, extra_config)))
        start = int(state.step)
        if jax.process_count() > 1 and mesh is None:
            raise ValueError("a multi-process run needs a mesh over the devices of all "
                             "processes (e.g. rl.runtime.mesh.make_mesh_preset('dp'))")
        logger = MetricsLogger(run_dir, wandb_mode=config.logging.wandb, config=config.to_dict(),
                               resume_step=start if resume else None, run_name=run_dir.name)
        step_fn = make_train_step(train, model_config, mesh,
                                  compiler_options=hooks.compiler_options, checked=loop.checked)
        state = step_fn.place_state(state)
        control = RunControl(save_every_minutes=loop.save_every_minutes,
                             time_limit_s=loop.time_limit_s)
    except BaseException:
        try:
            ckpt.close()
        finally:
            try:
                if logger is not None:
                    logger.close()
            finally:
                signals.close()
        raise
    return RunContext(state=state, ref=ref, ckpt=ckpt, logger=logger, step_fn=step_fn,
                      data_position=data_position, start=start, meta=meta, config=record,
                      lora=lora, control=control, signals=signals)


def locked_checkpointer(run_dir: Path, loop: Any, resume: Resume | None) -> Checkpointer:
    """The run dir made (a resume needs its checkpoints/), its lock taken by process 0
    (before anything compiles), and its Checkpointer (which holds the lock; leftovers of an
    unfinished save are deleted, since no other writer can be at work)."""
    if resume and not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(f"cannot resume: {str(run_dir)!r} has no checkpoints/ "
                              "directory (run without resume first, or point at an "
                              "existing run dir)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        failure = StorageError.of(err, what="the run dir", path=run_dir)
        if failure is None:
            raise
        raise failure from err
    lock = RunLock(run_dir, enabled=is_main_process())  # one writer; before any compile
    try:  # the lock is held: leftovers of an unfinished save can go
        return Checkpointer(run_dir / "checkpoints", keep=loop.keep_checkpoints, lock=lock,
                            cleanup_tmp=True)
    except BaseException:
        lock.release()
        raise


@dataclasses.dataclass
class _Opening:
    """What initial_state needs besides the policy and configs."""

    mesh: Any
    resume: Resume | None
    ckpt: Checkpointer
    record: dict
    allow: set
    defaults: dict


def initial_state(model_config: ModelConfig, params: Any, train: TrainConfig, loop: Any,
                  how: _Opening) -> tuple[TrainState, Any, LoraRun | None, int, dict]:
    """(state, KL reference or LoRA base, LoRA run, data position, checkpoint meta): a fresh
    state of its own copy of `params` (or of fresh adapters on the frozen base), or the
    latest good checkpoint restored straight onto the mesh after its recorded config (and a
    LoRA run's base hash) matched this run's."""
    resume, ckpt_dir = how.resume, how.ckpt.directory
    lora = None
    if train.lora is not None:  # state = adapters; the frozen base is the step's ref
        lora, params = lora_run(params, train, loop.seed)
        if how.mesh is not None:  # the base sharded like the params (qkernel like kernel)
            lora.base = jax.device_put(lora.base, ref_shardings(model_config, train, how.mesh))
        ref, how.record[BASE_KEY] = lora.base, lora.base_hash
    else:
        params = jax.tree.map(jnp.array, params)  # own copy: the step donates its state
        ref = jax.tree.map(jnp.array, params) if train.loss.kl_coef > 0 else None
    state = init_train_state(params, train, loop.seed)
    if not resume:
        return state, ref, lora, 0, {}
    if lora is not None:  # before the adapters' shapes meet the checkpoint
        check_base(latest_record(ckpt_dir), how.record)
        check_resume_config(latest_record(ckpt_dir), how.record, how.allow, how.defaults)
    # straight onto the mesh (no one-device copy; needed across processes)
    shardings = None if how.mesh is None else state_shardings(model_config, train, how.mesh)
    state, meta = how.ckpt.restore(state, shardings=shardings, fallback=resume.from_last_good)
    check_base(meta.get("config"), how.record)
    check_resume_config(meta.get("config"), how.record, how.allow, how.defaults)
    start = int(state.step)
    if start >= loop.steps and meta.get("pending_eval") is None:
        raise ConfigError(f"nothing to resume: the checkpoint is at step {start} and "
                          f"steps is {loop.steps}; pass a larger --steps to go on")
    return state, ref, lora, int(meta["data_position"]), meta


def run_clock(logger: MetricsLogger) -> Callable[[], float]:
    """Wall seconds of the run: since this call, plus the last time_s the logger holds (a
    resumed run continues its clock)."""
    offset = max((float(r.get("time_s") or 0.0) for r in logger.records), default=0.0)
    t0 = time.perf_counter()
    return lambda: offset + time.perf_counter() - t0


def resolve_mesh(config: RunConfig, model_config: ModelConfig, hooks: RunHooks
                 ) -> jax.sharding.Mesh | None:
    """The learner's mesh: hooks.mesh as given, else config.mesh built by
    rl.runtime.mesh.make_mesh_preset ("dp" when several processes run and none is named),
    else None (one device). A built mesh is checked against the model and the batch rows
    (rl.runtime.mesh.validate_mesh) before anything compiles."""
    if hooks.mesh is not None:
        return hooks.mesh
    spec = config.mesh or ("dp" if jax.process_count() > 1 else None)
    if spec is None:
        return None
    mesh = make_mesh_preset(spec)
    loop = config.loop
    validate_mesh(mesh, model_config,
                  batch=config.scheduler.batch_rows(loop.prompts_per_step, loop.group_size))
    return mesh
