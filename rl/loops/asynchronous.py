"""The asynchronous GRPO loop: a rollout producer and the learner with a
`rl.loops.buffer.TrajectoryBuffer` between them, under one staleness knob η = max_staleness
(0 = synchronous on-policy, 1 = one-step overlap, larger = fully asynchronous).

`run_async` runs the learner side as named stages (rl.loops.async_stages; their shared
state is an `AsyncRun`; the rollout thread is rl.loops.producer):

 1. setup: `split_devices` (threaded: which devices sample, which train), `open_run` (run
    dir, state fresh or restored, logger, jitted step), `prepare` (the param ring, the
    buffer at the state's version, the resume note), then `start`: the ring's saved
    versions (deterministic resume), version v0 published, the APRIL source (its FIFO
    restored on resume), the EWMA params, the step-0 eval, the producer thread;
 2. per step v, `take_batch`: b groups, sampled here with the ring's params of
    max(v − η, 0) (deterministic: one static sampling call, or APRIL rounds until the
    buffer yields a batch), or waited for from the producer thread (threaded; a producer
    error or a dead thread stops the wait);
 3. `build_train_batch`: the TrainBatch (+ the off-policy prefix mask), its proximal
    log-probs (exact from the ring, or the EWMA params'), the batch's own metrics;
 4. `update_learner`: the jitted step, the EWMA update, version v + 1 published to the
    sampler, the buffer's admission version moved on;
 5. `record_step`: the train record (step metrics, sampling and buffer counters, version
    lag, APRIL's counters, the step profile) and the progress bar;
 6. `evaluate_and_save`: eval and checkpoint (+ side files, rl.loops.side_files) on their
    schedule; then the caller's on_step(record);
 7. faults and teardown: `stop_after_fault` (any exception: producer stopped, buffer
    closed, a final checkpoint on KeyboardInterrupt or a producer error; then re-raised),
    `shut_down` (always: producer joined, run context closed), `result`.
What the modes, rollouts and proximal options mean in these stages:

Two modes (AsyncConfig.mode):
  * "threaded": a producer thread samples with the latest published params, picking
    them up at every segment boundary (in-flight weight updates: tokens after a swap carry
    the new version), scores finished groups and puts them into the buffer under AReaL's
    admission rule; the learner (main thread) takes b groups per step, trains, and
    publishes the new params (a copy, on the rollout device) to the producer. With more
    than one device, jax.devices() is split into training devices (a data-parallel mesh
    for the train step) and rollout devices (the sampler runs on the first of them; new
    params are resharded onto it before publishing); with one device they interleave.
  * "deterministic": no threads; step v samples its batch with the params of version
    max(v − k, 0), k = η, from a `rl.learner.snapshots.ParamSnapshots` ring, so every token of
    step v has version exactly v − k (v ≥ k) and runs are reproducible on one CPU. The ring
    holds k + 2 versions: (k + 2) × the params' bytes of memory with
    AsyncConfig.snapshot_store="memory" (the default), or files under
    run_dir/snapshots/ring/ and at most 2 versions in memory with "disk" (the same run, bit
    for bit; one params write and one read per step; deleted at the run's end).
With η = 0 both modes reproduce `rl.loops.run` exactly (same rng splits, same
sampling calls; rollout "static" in threaded mode, and "continuous" on equal-length
responses).

Rollouts (AsyncConfig.rollout): "static" samples whole rounds of up to b groups and
hands them over sorted by prompt (threaded: one engine per round; deterministic: exactly
`rl.loops.sync.sample_batch_groups`, DAPO dynamic sampling included); "continuous"
(threaded only) keeps one engine whose free slots are refilled with new prompts at every
segment boundary while the admission rule allows; "april" runs `rl.rollout.april.AprilRollout`
rounds (⌈over_provision·b⌉ groups started, the round ends when b are complete, the
unfinished ones wait whole in a FIFO drained first next round). An APRIL round samples
under one params version (rl.rollout.april's collect takes the params per round), so its weight
swaps happen at round boundaries, and resumed groups carry prefixes of older versions:
with stale_policy="drop" the groups with a prefix older than η versions are dropped
(counted), with "downweight" none is discarded. mask_offpolicy_prefix removes, per
group, the tokens older than the group's newest token from the loss. In threaded mode
the dynamic-sampling filter runs in the producer (filtered groups are counted and
replaced; no filler groups).

Proximal policy (AsyncConfig.proximal): "current" keeps the TrainConfig as given;
"versions" sets old_logp="versions" (AReaL's log-linear interpolation from per-token
versions); "exact" computes TrainBatch.proximal_logprobs with
`rl.learner.proximal.exact_proximal_logprobs` from the snapshot ring (log π at each token's own
behaviour version) and sets old_logp="proximal", so the PPO ratio is π_θ / π_v(b) (pure
staleness) and π_prox/μ is the pure train–inference discrepancy; "ewma" keeps PPO-EWMA
params θ_prox ← β θ_prox + (1 − β) θ (rl.learner.proximal.ewma_update) and uses their log-probs
(old_logp="proximal"). The trainer logs both factors of the ratio (mismatch_* =
π_prox/μ, staleness_* = π_θ/π_prox), plus the buffer's counters (buffer_*) and the
behaviour-version lag of each batch.

Faults: an exception in the producer thread stops the run at the step the learner waits
for: the learner writes a final checkpoint and raises RuntimeError ("step N: the rollout
thread failed: ...") chained to the original exception (its traceback intact); SIGTERM /
Ctrl-C (rl.runtime.preemption) stop it as they stop rl.loops.run: at the next safe point
(waiting for or sampling a batch: dropped, except inside deterministic APRIL rounds; an
eval: left to the resumed run), with a checkpoint of the last completed step, raising
Preempted; a KeyboardInterrupt (a second Ctrl-C, or raised from a hook) writes a final
checkpoint and re-raises; a failed write is one StorageError; the producer is always
stopped and joined (timeout, then it is a daemon thread, so it can never keep the
process alive). Resume: deterministic mode resumes
exactly with static rollouts (the snapshot ring is saved beside each checkpoint under
run_dir/snapshots/STEP/, one file per version, hard links to a disk ring's files); with
APRIL its FIFO is saved under run_dir/rollout_state/ and restored whole, but
rl.rollout.april reseeds new groups on a restore, so the continuation is statistically,
not bitwise, the same. Threaded mode restarts the producer at
the data position it had reached when the checkpoint was written: groups that were
queued or still being sampled then are NOT restored and are counted as dropped
(`dropped_on_resume_groups` in the first record); with APRIL the FIFO of unfinished
groups as of the producer's last finished round IS restored (partial responses,
log-probs, versions), the queued groups count as dropped and the prompts of the round
then running are sampled again. The buffer_* counters count from the (re)start of
the process; a checkpoint's meta holds the counters at its save ("async"/"buffer").
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from models.config import ModelConfig
from rl.learner.config import TrainConfig
from rl.loops import episodes
from rl.loops.async_stages import (
    build_train_batch,
    evaluate_and_save,
    prepare,
    record_step,
    result,
    shut_down,
    split_devices,
    start,
    stop_after_fault,
    stop_run,
    take_batch,
    update_learner,
)
from rl.loops.config import (  # noqa: F401  (MODES, PROXIMAL, ROLLOUTS re-exported)
    MODES, PROXIMAL, ROLLOUTS, AsyncConfig, Resume, RunConfig, RunHooks, as_resume)
from rl.loops.context import open_run, resolve_mesh
from rl.loops.sync import RunResult
from rl.runtime.preemption import Preempted, StepAbandoned
from rl.tasks.base import Task

def train_config_for(config: TrainConfig, async_config: AsyncConfig) -> TrainConfig:
    """The TrainConfig the learner runs with: old_logp set by the proximal option."""
    old = {"current": config.old_logp, "versions": "versions", "exact": "proximal",
           "ewma": "proximal"}[async_config.proximal]
    return config if old == config.old_logp else dataclasses.replace(config, old_logp=old)


# ----------------------------------------------------------------------------- the loop
def run_async(model_config: ModelConfig, params: Any, task: Task, config: RunConfig, *,
              resume: bool | Resume = False, hooks: RunHooks | None = None) -> RunResult:
    """Train with the asynchronous loop (module doc) under config.asynchronous for
    config.loop.steps optimizer steps. The same parameters, outputs and run dir as
    rl.loops.run (metrics.jsonl, checkpoints/, wandb, RunResult; the same run-dir lock and
    Resume options; the AsyncConfig is part of the recorded config); train records add
    buffer_* counters, behaviour_version_* / version_lag_*, and rollout_wait_s (time the
    learner waited for data), and the step profile (rl.runtime.logging.StepProfile, the
    learner thread's view: step_s, prefill_s / decode_s / reward_s when it samples itself
    (deterministic, static), wait_s (waiting on the producer thread, or a deterministic
    APRIL round), host_s, proximal_s (exact / EWMA proximal log-probs and the EWMA
    update), learner_s, transfer_s, other_s, peak_rss_mb; in threaded mode the producer's
    sampling overlaps these phases and is not split). hooks.on_step(record) is called
    after each train record (raise KeyboardInterrupt there to stop the run like Ctrl-C).
    In threaded mode with several devices and no mesh, the training devices get a
    data-parallel mesh (the batch's rows must divide by their number)."""
    acfg = config.asynchronous
    if acfg is None:
        raise ValueError("config.asynchronous is None: set it (e.g. "
                         "cfg.override('async.max_staleness', 1)) or call rl.loops.run")
    config.validate()
    hooks = hooks or RunHooks()
    resume_opts = as_resume(resume)
    resume = resume_opts is not None
    train, loop = config.train, config.loop
    episodes.check_episode_loop(task, acfg.mode, acfg.rollout)  # environments: which modes
    run_dir = config.output_dir
    mesh = resolve_mesh(config, model_config, hooks)
    rollout_device, mesh = split_devices(acfg, mesh)
    ctx = open_run(model_config, params, train_config_for(train, acfg), loop, run_dir,
                   resume=resume_opts, wandb_mode=config.logging.wandb,
                   run_config=config.to_dict(), mesh=mesh,
                   compiler_options=hooks.compiler_options,
                   extra_config={"async": acfg, "task": task.name, "reward": config.reward,
                                 **episodes.episode_config(task)})
    run = prepare(ctx, model_config, task, train, loop, acfg, run_dir,
                  rollout_device=rollout_device, mesh=mesh, resume=resume,
                  progress=config.logging.progress)
    # dropping a half-sampled step loses nothing but in APRIL rounds (their FIFO moves)
    can_abandon = acfg.rollout != "april" or acfg.mode == "threaded"
    try:
        start(run, resume=resume, on_eval=hooks.on_eval)
        for step in range(ctx.start, loop.steps):
            run.prof.start()
            st, pos = run.state, run.data_position
            version = int(st.version)
            t0 = time.perf_counter()
            try:
                with ctx.control.abandonable(can_abandon):
                    got, st, pos, stats = take_batch(run, step, st, pos)
            except StepAbandoned:  # run.state is still the last completed step's
                raise stop_run(run, f"step {step + 1}'s rollouts") from None
            t1 = time.perf_counter()
            batch, extra = build_train_batch(run, got, version)
            t2 = time.perf_counter()
            metrics = update_learner(run, step, st, batch, pos)
            t3 = time.perf_counter()
            record = record_step(run, step, metrics, stats, extra, rollout_wait_s=t1 - t0,
                                 train_s=t3 - t2, busy_s=t3 - t0)
            evaluate_and_save(run, step + 1)
            if hooks.on_step is not None:
                hooks.on_step(record)
        run.bar.close()
    except BaseException as err:
        failure = stop_after_fault(run, err)
        shut_down(run, quiet=not isinstance(err, Preempted))
        if failure is not None:
            raise failure from err
        raise
    shut_down(run)
    return result(run)
