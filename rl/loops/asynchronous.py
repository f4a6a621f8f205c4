"""The asynchronous GRPO loop: a rollout producer and the learner with a
`rl.loops.buffer.TrajectoryBuffer` between them, under one staleness knob η = max_staleness
(0 = synchronous on-policy, 1 = one-step overlap, larger = fully asynchronous).

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
    step v has version exactly v − k (v ≥ k) and runs are reproducible on one CPU.
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

Faults: an exception in the producer thread stops the run: the learner writes a final
checkpoint and raises RuntimeError chained to the original exception (its traceback
intact); KeyboardInterrupt (Ctrl-C, or raised from a hook) writes a final checkpoint and
re-raises; the producer is always stopped and joined (timeout, then it is a daemon
thread, so it can never keep the process alive). Resume: deterministic mode resumes
exactly with static rollouts (the snapshot ring is saved beside each checkpoint under
run_dir/snapshots/); with APRIL its FIFO is saved under run_dir/rollout_state/ and
restored whole, but rl.rollout.april reseeds new groups on a restore, so the continuation is
statistically, not bitwise, the same. Threaded mode restarts the producer at
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
import io
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from models.config import ModelConfig
from models.sharding import make_mesh
from rl.learner.batch import NonFiniteError, TrainBatch, TrainState
from rl.learner.config import TrainConfig
from rl.learner.proximal import ewma_update, exact_proximal_logprobs, policy_logprobs
from rl.learner.snapshots import ParamSnapshots
from rl.loops import episodes
from rl.loops.buffer import TrajectoryBuffer
from rl.loops.config import (  # noqa: F401  (MODES, PROXIMAL, ROLLOUTS re-exported)
    MODES, PROXIMAL, ROLLOUTS, AsyncConfig, Resume, RunConfig, RunHooks, as_resume)
from rl.loops.context import open_run, resolve_mesh
from rl.loops.evaluation import batch_reward_metrics
from rl.loops.producer import (
    AprilSource,
    RolloutProducer,
    flatten_arrays,
    offpolicy_prefix_batch,
    unflatten_arrays,
)
from rl.loops.sync import (
    LoopConfig,
    RunResult,
    build_batch,
    make_evaluator,
    rollout_seed,
    sample_batch_groups,
)
from rl.rollout.april import AprilConfig
from rl.runtime.checkpoint import CheckpointError
from rl.runtime.logging import EXTRA_PHASES, PHASES, StepProfile, atomic_write_bytes
from rl.tasks.base import Task

def train_config_for(config: TrainConfig, async_config: AsyncConfig) -> TrainConfig:
    """The TrainConfig the learner runs with: old_logp set by the proximal option."""
    old = {"current": config.old_logp, "versions": "versions", "exact": "proximal",
           "ewma": "proximal"}[async_config.proximal]
    return config if old == config.old_logp else dataclasses.replace(config, old_logp=old)


# ----------------------------------------------------------------------------- helpers
def _batch_metrics(batch: TrainBatch, version: int) -> dict[str, float]:
    """Behaviour-version statistics of a batch: min/max version and the lag v − v_b."""
    mask = np.asarray(batch.loss_mask)
    vers = np.asarray(batch.versions)[mask]
    if vers.size == 0:
        return {}
    lag = version - vers
    return {"behaviour_version_min": float(vers.min()), "behaviour_version_max": float(vers.max()),
            "version_lag_mean": float(lag.mean()), "version_lag_max": float(lag.max())}


def _alive(tree: Any) -> bool:
    return not any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree))


def _save_snapshots(path: Path, snaps: ParamSnapshots, versions: list[int]) -> None:
    """The ring's params of `versions` as one .npz (leaves in tree order per version)."""
    arrays = {}
    for v in versions:
        for i, leaf in enumerate(jax.tree.leaves(snaps[v])):
            arrays[f"v{v}_{i}"] = np.asarray(jax.device_get(leaf))
    atomic_write_bytes(path, _npz_bytes({"versions": np.asarray(versions, np.int64), **arrays}))


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _load_npz(path: Path):
    if not path.exists():
        raise CheckpointError(f"cannot resume the async run: {str(path)!r}, written beside the "
                              "checkpoint, is missing")
    return np.load(path)


def _load_snapshots(path: Path, template: Any) -> dict[int, Any]:
    data = _load_npz(path)
    leaves, treedef = jax.tree.flatten(template)
    out = {}
    for v in data["versions"].tolist():
        out[int(v)] = jax.tree.unflatten(
            treedef, [jnp.asarray(data[f"v{v}_{i}"], dtype=leaf.dtype) for i, leaf in enumerate(leaves)])
    return out


# ----------------------------------------------------------------------------- the loop
def run_async(model_config: ModelConfig, params: Any, task: Task, config: RunConfig, *,
              resume: bool | Resume = False, hooks: RunHooks | None = None) -> RunResult:
    """Train with the asynchronous loop (module doc) under config.asynchronous for
    config.loop.steps optimizer steps; the same parameters, outputs and run dir as
    rl.loops.run (see run_async_loop for the records and the profile)."""
    if config.asynchronous is None:
        raise ValueError("config.asynchronous is None: set it (e.g. "
                         "cfg.override('async.max_staleness', 1)) or call rl.loops.run")
    config.validate()
    hooks = hooks or RunHooks()
    opts = as_resume(resume)
    return run_async_loop(
        model_config, params, task, config.train, config.loop, config.asynchronous,
        config.output_dir, resume=opts, wandb_mode=config.logging.wandb,
        run_config=config.to_dict(), mesh=resolve_mesh(config, model_config, hooks),
        progress=config.logging.progress, on_eval=hooks.on_eval, on_step=hooks.on_step,
        compiler_options=hooks.compiler_options)


def run_async_loop(
    model_config: ModelConfig,
    params: Any,
    task: Task,
    config: TrainConfig,
    loop: LoopConfig,
    async_config: AsyncConfig,
    run_dir: str | Path,
    *,
    resume: Resume | None = None,
    wandb_mode: str = "disabled",
    run_config: dict | None = None,
    mesh: jax.sharding.Mesh | None = None,
    progress: bool = True,
    on_eval: Callable[[dict], Any] | None = None,
    on_step: Callable[[dict], Any] | None = None,
    compiler_options: dict | None = None,
) -> RunResult:
    """Train with the asynchronous loop (module doc) for loop.steps optimizer steps.

    Same outputs as rl.loops.run (metrics.jsonl, checkpoints/, wandb, RunResult; the
    same run-dir lock and resume_from_last_good);
    train records add buffer_* counters, behaviour_version_* / version_lag_*, and
    rollout_wait_s (time the learner waited for data), and the step profile
    (rl.runtime.logging.StepProfile, the learner thread's view: step_s, prefill_s /
    decode_s / reward_s when it samples itself (deterministic, static), wait_s (waiting
    on the producer thread, or a deterministic APRIL round), host_s, proximal_s (exact /
    EWMA proximal log-probs and the EWMA update), learner_s, transfer_s, other_s,
    peak_rss_mb; in threaded mode the producer's sampling overlaps these phases and is
    not split). resume / allow_config_changes: as rl.loops.run (the AsyncConfig is part
    of the recorded config). on_step(record) is called after
    each train record (raise KeyboardInterrupt there to stop the run like Ctrl-C). In
    threaded mode with several devices and mesh=None, the training devices get a
    data-parallel mesh (the batch's rows must divide by their number)."""
    if loop.time_limit_s:
        raise ValueError("LoopConfig.time_limit_s is implemented by the synchronous loop only "
                         "(rl.loops.run); the asynchronous loop runs loop.steps steps: set "
                         "time_limit_s=0 or drop the async flags")
    if not isinstance(async_config, AsyncConfig):
        raise ValueError(f"async_config must be an AsyncConfig, got {type(async_config).__name__}")
    acfg = async_config
    episodes.check_episode_loop(task, acfg.mode, acfg.rollout)  # environments: which modes
    train_cfg = train_config_for(config, acfg)
    run_dir = Path(run_dir)
    rollout_device, mesh = _split_devices(acfg, mesh)
    ctx = open_run(model_config, params, train_cfg, loop, run_dir, resume=resume,
                   wandb_mode=wandb_mode, run_config=run_config, mesh=mesh,
                   compiler_options=compiler_options,
                   extra_config={"async": acfg, "task": task.name,
                                 **episodes.episode_config(task)})
    state, logger, ckpt = ctx.state, ctx.logger, ctx.ckpt
    b, k = loop.prompts_per_step, acfg.max_staleness
    v0 = int(state.version)
    snaps = ParamSnapshots(acfg.ring_capacity)
    buffer = TrajectoryBuffer(b, k, stale_policy=acfg.stale_policy, stale_weight=acfg.stale_weight,
                              start_version=v0)
    resume_note = {}
    if resume:
        meta_async = dict(ctx.meta.get("async") or {})
        resume_note["dropped_on_resume_groups"] = int(meta_async.get("in_flight_groups", 0))
    producer: RolloutProducer | None = None
    thread: threading.Thread | None = None
    holder = {"state": state, "data_position": ctx.data_position}
    published: dict[str, Any] = {}
    ewma = None
    april: AprilSource | None = None

    def publish(st: TrainState) -> None:
        v = int(st.version)
        # one assignment: the producer never sees new params with an old version
        # (LoRA: the ring keeps adapter versions; the sampler gets ctx.policy's params)
        published["latest"] = (ctx.policy(snaps.put(v, st.params, device=rollout_device)), v)

    def latest() -> tuple[Any, int]:
        return published["latest"]

    def save(step: int, st: TrainState) -> None:
        meta = {"task": task.name, "config": ctx.config,
                "async": {"mode": acfg.mode, "max_staleness": k, "buffer": buffer.stats()}}
        if april is not None:  # the FIFO of unfinished groups is restored on resume
            april_state = april.state() if producer is None else producer.april_snapshot[0]
            atomic_write_bytes(run_dir / "rollout_state" / f"{step}.npz",
                               _npz_bytes(flatten_arrays(april_state)))
        if producer is not None:  # threaded: the producer's position and rng chain
            pos, rng = producer.position()
            st = st.replace(rng=jax.device_put(rng, st.rng.sharding))
            stats = buffer.stats()
            # queued groups are lost on resume; APRIL re-samples its running round's new
            # prompts and restores its FIFO, so only the queued ones count there
            meta["async"]["in_flight_groups"] = stats["queued_groups"] + (
                0 if april is not None else stats["running_groups"])
        else:
            pos = holder["data_position"]
            versions = [v for v in range(max(int(st.version) - k, 0), int(st.version) + 1)
                        if v in snaps]
            _save_snapshots(run_dir / "snapshots" / f"{step}.npz", snaps, versions)
        meta["data_position"] = int(pos)
        ckpt.save(step, st, meta)

    def final_checkpoint() -> None:
        st = holder["state"]
        step = int(st.step)
        ckpt.wait()
        if step in ckpt.all_steps():
            return
        if not _alive(st):
            warnings.warn("the train state was consumed by an interrupted step; no final "
                          "checkpoint written (the last periodic one stands)")
            return
        save(step, st)
        ckpt.wait()

    try:
        if resume and acfg.mode == "deterministic":
            for v, p in _load_snapshots(run_dir / "snapshots" / f"{ctx.start}.npz",
                                        state.params).items():
                snaps.put(v, p, copy=False, device=jax.devices()[0] if mesh is None else None)
        publish(state)
        if acfg.rollout == "april":
            saved, base = None, ctx.data_position
            if resume:
                saved = unflatten_arrays(_load_npz(run_dir / "rollout_state" / f"{ctx.start}.npz"))
                base = int(saved["base"])
            april = AprilSource(model_config, task, config, loop,
                                 AprilConfig(over_provision=acfg.over_provision,
                                             mask_offpolicy_prefix=acfg.mask_offpolicy_prefix),
                                 base=base,
                                 seed=rollout_seed(state.rng)[0],
                                 saved=None if saved is None else saved["april"])
        if acfg.proximal == "ewma":
            ewma = jax.tree.map(jnp.copy, state.params)
        do_eval = make_evaluator(model_config, task, config, loop, logger, on_eval)
        if not resume:
            do_eval(0, *published["latest"])
        if acfg.mode == "threaded":
            producer = RolloutProducer(model_config=model_config, task=task, config=config, loop=loop,
                                 rollout=acfg.rollout, buffer=buffer, latest=latest,
                                 data_position=ctx.data_position,
                                 rng=np.asarray(jax.device_get(state.rng)), device=rollout_device,
                                 april=april)
            thread = threading.Thread(target=producer.run, name="tandem-rollout", daemon=True)
            thread.start()
        bar = tqdm(total=loop.steps, initial=ctx.start, disable=not progress,
                   desc=f"async η={k}", dynamic_ncols=True)
        last_tokens = 0
        prof = StepProfile((*PHASES, *EXTRA_PHASES))
        for step in range(ctx.start, loop.steps):
            prof.start()
            st = holder["state"]
            v = int(st.version)
            pos = holder["data_position"]
            t0 = time.perf_counter()
            if producer is None:  # deterministic: sample with the params of v - k
                bv = max(v - k, 0)
                got, stats, rounds = None, {"sampled_tokens": 0}, 0
                while got is None:
                    if april is None:
                        sampler = st.replace(params=snaps[bv], version=jnp.asarray(bv, jnp.int32))
                        try:
                            groups, sampler, pos, stats = sample_batch_groups(
                                sampler, model_config, task, config, loop, pos, prof,
                                policy=ctx.policy)
                        except NonFiniteError as err:  # a task's reward: name the step too
                            raise NonFiniteError(f"step {step + 1}: {err}") from None
                        st = st.replace(rng=sampler.rng)
                    else:
                        with prof.phase("wait_s"):  # a whole APRIL round
                            groups = april.round(ctx.policy(snaps[bv]), bv,
                                                 b - buffer.stats()["queued_groups"])
                        pos = april.position
                        stats["sampled_tokens"] += april.generated_tokens
                    if not buffer.reserve(len(groups)):
                        raise RuntimeError(f"admission refused {len(groups)} groups at version "
                                           f"{v}: {buffer.stats()}")
                    with prof.phase("host_s"):
                        for g in groups:
                            buffer.put(g)
                        got = buffer.get_batch(b, v, timeout=0)
                    rounds += 1
                    # static: versions are exactly v - k, never stale; APRIL's resumed
                    # prefixes may be (dropped with stale_policy="drop"): sample more
                    if got is None and (april is None or rounds > 4 * (k + 1)):
                        raise RuntimeError(
                            f"step {step + 1}: the buffer dropped every group as older than "
                            f"max_staleness={k} versions ({buffer.stats()}); use "
                            "stale_policy='downweight' or a larger max_staleness")
            else:
                got, t_wait = None, time.perf_counter()
                while got is None:
                    got = buffer.get_batch(b, v, timeout=0.1)
                    if isinstance(producer.error, NonFiniteError):  # a task's reward
                        raise NonFiniteError(f"step {step + 1}: {producer.error}")
                    if producer.error is not None:
                        raise RuntimeError(
                            f"the rollout thread failed: {type(producer.error).__name__}: "
                            f"{producer.error}") from producer.error
                    if got is None and not thread.is_alive():
                        raise RuntimeError("the rollout thread stopped without an error before "
                                           "the run was complete")
                prof.add("wait_s", time.perf_counter() - t_wait)
                stats = {"sampled_tokens": producer.sampled_tokens - last_tokens}
                last_tokens = producer.sampled_tokens
            t1 = time.perf_counter()
            with prof.phase("host_s"):
                batch = build_batch(got.groups, model_config=model_config, task=task,
                                    config=config, group_size=loop.group_size,
                                    token_weights=got.token_weights)
                if acfg.mask_offpolicy_prefix:
                    batch = offpolicy_prefix_batch(batch, loop.group_size)
            with prof.phase("proximal_s"):
                if acfg.proximal == "exact":
                    batch = batch.replace(proximal_logprobs=jax.block_until_ready(
                        exact_proximal_logprobs(snaps if ctx.lora is None else
                                                ctx.lora.snapshots(snaps), model_config, batch,
                                                config.temperature, config.attn_impl)))
                elif acfg.proximal == "ewma":
                    batch = batch.replace(proximal_logprobs=jax.block_until_ready(
                        policy_logprobs(ewma if ctx.lora is None else ctx.lora.composed(ewma),
                                        model_config, batch, config.temperature, config.attn_impl)))
            with prof.phase("host_s"):
                extra = _batch_metrics(batch, v)
                extra.update(episodes.take_episode_metrics(task))  # an environment: its episodes
                extra.update(batch_reward_metrics(batch.reward_names, batch.rewards,
                                                  loop.group_size, config.reward_weights),
                             time_s=do_eval.clock())
            t2 = time.perf_counter()
            with prof.phase("learner_s"):
                st, metrics = jax.block_until_ready(ctx.step_fn(st, batch, ctx.ref))
            holder.update(state=st, data_position=pos)
            with prof.phase("proximal_s"):
                if ewma is not None:
                    ewma = jax.block_until_ready(ewma_update(ewma, st.params, acfg.ewma_beta))
            with prof.phase("transfer_s"):
                publish(st)
                if step + 1 < loop.steps:  # after the last step, admit nothing more
                    buffer.set_version(int(st.version))
                metrics = jax.device_get(metrics)
            metrics = {kk: float(x) for kk, x in metrics.items()}
            t3 = time.perf_counter()
            if producer is not None:
                holder["data_position"] = producer.position()[0]
            metrics.update(stats)
            metrics.update(extra, rollout_wait_s=t1 - t0, train_s=t3 - t2,
                           tokens_per_s=stats["sampled_tokens"] / max(t3 - t0, 1e-9),
                           data_position=holder["data_position"],
                           **{f"buffer_{kk}": x for kk, x in buffer.stats().items()})
            if april is not None:
                metrics.update(april.metrics())
            if step == ctx.start:
                metrics.update(resume_note)
            metrics.update(prof.finish())
            done = step + 1
            record = logger.log(done, metrics, kind="train")
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                            lag=f"{extra.get('version_lag_mean', 0):.1f}")
            is_last = done == loop.steps
            if is_last or (loop.eval_every and done % loop.eval_every == 0):
                ev = do_eval(done, *published["latest"])  # the policy of st.version
                if progress:
                    bar.write(f"step {done}: eval reward {ev['reward']:.3f}")
            if is_last or (loop.save_every and done % loop.save_every == 0):
                save(done, st)
                _prune_snapshot_files(run_dir, ckpt)
            if on_step is not None:
                on_step(record)
        bar.close()
    except BaseException as err:
        if producer is not None:
            producer.stop()
        buffer.close()
        if isinstance(err, KeyboardInterrupt) or (producer is not None and producer.error is not None):
            try:
                final_checkpoint()
            except Exception as save_err:  # keep the original error the one that surfaces
                warnings.warn(f"final checkpoint failed: {type(save_err).__name__}: {save_err}")
        raise
    finally:
        if producer is not None:
            producer.stop()
        buffer.close()
        if thread is not None:
            thread.join(acfg.join_timeout_s)
            if thread.is_alive():
                warnings.warn(f"the rollout thread did not stop within {acfg.join_timeout_s} s; "
                              "it is a daemon thread and ends with the process")
        ctx.close()
    train = [r for r in logger.records if r["kind"] == "train"]
    evals = [r for r in logger.records if r["kind"] == "eval"]
    return RunResult(state=holder["state"], train=train, eval=evals, run_dir=run_dir,
                     data_position=holder["data_position"])


def _prune_snapshot_files(run_dir: Path, ckpt) -> None:
    """Delete side files (snapshots/, rollout_state/) of checkpoints orbax no longer keeps."""
    steps = ckpt.all_steps()
    if not steps:
        return
    for name in ("snapshots", "rollout_state"):
        folder = run_dir / name
        for f in folder.glob("*.npz") if folder.is_dir() else ():
            if f.stem.isdigit() and int(f.stem) < steps[0]:
                f.unlink(missing_ok=True)


def _split_devices(acfg: AsyncConfig, mesh: jax.sharding.Mesh | None
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
