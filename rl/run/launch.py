"""train(cfg): a whole run from its RunConfig, the way `python -m experiments.train` runs it.

    from rl.run import PRESETS, RunConfig, train
    result = train(PRESETS["tiny-synthetic"].override("loop.steps", 20))
    result.summary["headline"]          # final / initial eval reward
    train(RunConfig.load(result.run_dir).override("loop.steps", 40), resume=True)

Two stages, so that everything that can be refused is refused before anything compiles:
  prepare(cfg, resume)   validate the config, join the multi-process run
                         (cfg.distributed), set the host allocator (loop.host_malloc,
                         rl.runtime.host_memory), check the run dir (no checkpoints unless
                         resuming, no other writer), load the policy and task
                         (rl.run.policy.load_policy: the model, prompt file and reward
                         function checks), give the task's logged-only rewards weight 0,
                         build and check the mesh, print the plan with its memory
                         estimate (rl.run.plan; with logging.progress), write the run
                         record (model.json, run_config.json: rl.run.record)
  PreparedRun.run()      the run harness (rl.loops.harness.run_loop) over the batch source
                         the config picks (rl.loops.make_source: synchronous, or with
                         cfg.asynchronous set deterministic / threaded); then summary.json
                         (rl.run.summary), returned as RunResult.summary

The config is validated once, in prepare (the harness asserts what it relies on instead).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from models.config import ModelConfig
from rl.loops import make_source, run_loop
from rl.loops.config import Resume, RunConfig, RunHooks, as_resume
from rl.loops.context import resolve_mesh
from rl.loops.harness import RunResult
from rl.loops.validation import ConfigError
from rl.run.plan import format_plan
from rl.run.policy import load_policy, with_logged_reward_weights
from rl.run.record import write_record
from rl.run.summary import summarize
from rl.runtime.distributed import initialize_distributed, is_main_process
from rl.runtime.host import load_average, machine
from rl.runtime.host_memory import apply_malloc_policy, release_cycles
from rl.runtime.logging import atomic_write_json
from rl.runtime.runlock import check_run_dir_free


@dataclasses.dataclass
class PreparedRun:
    """A run ready to start (prepare): its config (run_dir set), resume options, the
    loaded policy and task, the checked mesh (None: one device), and when it started."""

    cfg: RunConfig
    resume: Resume | None
    model_config: ModelConfig
    params: Any
    task: Any
    mesh: Any
    started: float
    load_before: list[float]

    def run(self, hooks: RunHooks | None = None, command: str | None = None) -> RunResult:
        """The loop the config picks, then the summary (module docstring). command: how
        the run was started, for the summary (default: the experiments.train command that
        repeats it from the run's run_config.json)."""
        hooks = hooks or RunHooks()
        if hooks.mesh is None and self.mesh is not None:
            hooks = dataclasses.replace(hooks, mesh=self.mesh)
        # the loop trains its own copy of the weights: hand ours over instead of keeping a
        # second copy in memory for the whole run (a PreparedRun runs once)
        if self.params is None:
            raise RuntimeError("this PreparedRun has run already; prepare() the run again")
        handed, self.params = [self.params], None
        result = run_loop(self.model_config, handed.pop(), self.task, self.cfg,
                          make_source(self.cfg), resume=self.resume, hooks=hooks)
        if is_main_process():  # process 0 writes the results files
            run_dir = self.cfg.output_dir
            command = command or f"python -m experiments.train --config {run_dir}/run_config.json"
            result.summary = summarize(
                result, self.cfg, self.task, wall_s=time.perf_counter() - self.started,
                command=command, machine=machine(),
                load={"before": self.load_before, "after": load_average()})
            atomic_write_json(run_dir / "summary.json", result.summary)
        return result


def prepare(cfg: RunConfig, resume: bool | Resume = False) -> PreparedRun:
    """Everything before the loop (module docstring). ConfigError / ValueError for a
    config, run dir, model, task or mesh that cannot run; RunLockError when another
    process trains in the run dir."""
    cfg.validate()
    resume_opts = as_resume(resume)
    initialize_distributed(cfg.distributed)  # before any other JAX computation
    apply_malloc_policy(cfg.loop.host_malloc)  # before the weights are allocated
    run_dir = cfg.output_dir
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    ckpts = run_dir / "checkpoints"
    if resume_opts is None and ckpts.is_dir() and any(ckpts.iterdir()):
        raise ConfigError(f"run dir {str(run_dir)!r} already holds checkpoints; resume it "
                          "(--resume, resume=True) or choose another run dir (--run-dir)")
    if is_main_process():  # fail before loading the model; the loop holds the lock
        check_run_dir_free(run_dir)
    load_before, started = load_average(), time.perf_counter()
    model_config, params, task = load_policy(cfg)
    release_cycles()  # loading traced and compiled: free what its cycles hold (host_memory)
    cfg = with_logged_reward_weights(cfg, task)
    mesh = resolve_mesh(cfg, model_config, RunHooks())
    if is_main_process():  # what rl.run.load_run / evaluate / export rebuild the policy from
        if cfg.logging.progress:
            print(format_plan(cfg, model_config, task), file=sys.stderr, flush=True)
        write_record(run_dir, cfg, model_config)
    return PreparedRun(cfg=cfg, resume=resume_opts, model_config=model_config, params=params,
                       task=task, mesh=mesh, started=started, load_before=load_before)


def train(cfg: RunConfig, *, resume: bool | Resume = False, hooks: RunHooks | None = None,
          command: str | None = None) -> RunResult:
    """prepare(cfg, resume).run(hooks, command): the whole run (module docstring). Raises
    ConfigError / ValueError before anything compiles for a run that cannot run, and
    CheckpointError, RunLockError, NonFiniteError as the loops do."""
    return prepare(cfg, resume).run(hooks, command)
