"""The loops' entry points: the run harness (rl.loops.harness) over the batch source the
config picks.

    run(model_config, params, task, config, *, resume=False, hooks=None) -> RunResult
        config.asynchronous None: the synchronous source (rl.loops.sync); set: the
        deterministic k-stale source (mode "deterministic", rl.loops.deterministic) or
        the threaded producer (mode "threaded", rl.loops.threaded)
    run_async(...)   the same, for a config whose asynchronous section is set (an alias
                     that says so when it is not)
    make_source(config)  the BatchSource of a config

Both validate the config once (RunConfig.validate) before anything loads or compiles;
rl.run.train validates in its prepare step and calls `run_loop` itself.
"""
from __future__ import annotations

from typing import Any

from models.config import ModelConfig
from rl.loops.config import Resume, RunConfig, RunHooks
from rl.loops.deterministic import DeterministicSource
from rl.loops.harness import RunResult, run_loop
from rl.loops.source import BatchSource
from rl.loops.sync import SyncSource
from rl.loops.threaded import ThreadedSource
from rl.tasks.base import Task


def make_source(config: RunConfig) -> BatchSource:
    """The batch source of `config` (module doc)."""
    acfg = config.asynchronous
    if acfg is None:
        return SyncSource(config)
    if acfg.backend == "ray":  # ray is an optional extra
        if acfg.mode == "threaded":
            from rl.loops.ray_workers import RayStreamSource
            return RayStreamSource(config)
        from rl.loops.ray_workers import RaySource
        return RaySource(config)
    if acfg.mode == "deterministic":
        return DeterministicSource(config)
    return ThreadedSource(config)


def run(model_config: ModelConfig, params: Any, task: Task, config: RunConfig, *,
        resume: bool | Resume = False, hooks: RunHooks | None = None) -> RunResult:
    """Train `params` on `task` for config.loop.steps optimizer steps (config.train: the
    learner; config.scheduler: the prompt scheduler and rollout replay; config.prune:
    online rollout pruning; config.asynchronous: the asynchronous sources, None =
    synchronous).

    Writes into config.output_dir: metrics.jsonl (train + eval records), checkpoints/
    (orbax), wandb files (config.logging.wandb "offline" / "online"). resume (True or a
    Resume) restores the latest checkpoint of the run dir (CheckpointError if there is none
    or it is damaged; Resume.from_last_good: skip a damaged one for the one before) and
    continues to loop.steps; the checkpoint's recorded config must equal this one but for
    steps, the time limit and Resume.allow_changes (rl.loops.validation). A second process
    training in the run dir is a RunLockError (rl.runtime.runlock). hooks: an explicit mesh
    (else config.mesh, or "dp" across processes), XLA compiler options for the train step,
    on_eval / on_step callbacks (raise KeyboardInterrupt in on_step to stop the run like
    Ctrl-C). `params` are the initial weights (also the frozen KL reference when
    config.train.loss.kl_coef > 0); they are copied, never donated.
    """
    config.validate()
    return run_loop(model_config, params, task, config, make_source(config), resume=resume,
                    hooks=hooks)


def run_async(model_config: ModelConfig, params: Any, task: Task, config: RunConfig, *,
              resume: bool | Resume = False, hooks: RunHooks | None = None) -> RunResult:
    """`run` for a config with config.asynchronous set (ValueError otherwise). Train records
    add buffer_* counters, behaviour_version_* / version_lag_*, rollout_wait_s (time the
    learner waited for data) and the step profile's wait_s / proximal_s."""
    if config.asynchronous is None:
        raise ValueError("config.asynchronous is None: set it (e.g. "
                         "cfg.override('async.max_staleness', 1)) or call rl.loops.run")
    return run(model_config, params, task, config, resume=resume, hooks=hooks)
