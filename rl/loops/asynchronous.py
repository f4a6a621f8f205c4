"""What the asynchronous batch sources share (rl.loops.deterministic, rl.loops.threaded):
a buffer between rollouts and the learner under one staleness knob η = max_staleness
(0 = synchronous on-policy, 1 = one-step overlap, larger = fully asynchronous), the param
ring, the published policy, the proximal log-probs and the checkpoint's side files.

    AsyncSource.open        the param ring (AsyncConfig.ring_capacity versions, in memory
                            or on disk), the buffer at the state's version, the resume note
                            (in-flight groups a checkpoint could not keep), the ring's saved
                            versions (`restore_ring`: deterministic resume), version v0
                            published, the APRIL source (its FIFO restored on resume), the
                            EWMA params
    AsyncSource.train_batch the TrainBatch (the buffer's token weights, APRIL's off-policy
                            prefix mask), its proximal log-probs (proximal "exact": each
                            token under its own behaviour version's params from the ring;
                            "ewma": under the EWMA params), the batch's metrics (behaviour
                            versions and lag, episodes, reward spread)
    AsyncSource.after_update  the EWMA update, v + 1 published to the sampler (in one
                            assignment: the producer never sees new params with an old
                            version), the buffer's admission version moved on
    AsyncSource.checkpoint  meta "async" {mode, max_staleness, buffer counters}; APRIL's
                            state beside the checkpoint (rl.loops.side_files); the ring's
                            versions (deterministic)

Proximal policy (AsyncConfig.proximal): "current" keeps the TrainConfig as given;
"versions" sets old_logp="versions" (AReaL's log-linear interpolation from per-token
versions); "exact" computes TrainBatch.proximal_logprobs with
`rl.learner.proximal.exact_proximal_logprobs` from the snapshot ring (log π at each token's own
behaviour version) and sets old_logp="proximal", so the PPO ratio is π_θ / π_v(b) (pure
staleness) and π_prox/μ is the pure train–inference discrepancy; "ewma" keeps PPO-EWMA
params θ_prox ← β θ_prox + (1 − β) θ (rl.learner.proximal.ewma_update) and uses their
log-probs (old_logp="proximal"). The trainer logs both factors of the ratio (mismatch_* =
π_prox/μ, staleness_* = π_θ/π_prox), the buffer's counters (buffer_*) and the
behaviour-version lag of each batch; the buffer_* counters count from the (re)start of the
process, a checkpoint's meta holds them at its save ("async"/"buffer").

The module doc of rl.loops.deterministic and rl.loops.threaded say what each mode does.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from models.sharding import make_mesh
from rl.learner.batch import TrainBatch
from rl.learner.config import TrainConfig
from rl.learner.proximal import ewma_update, exact_proximal_logprobs, policy_logprobs
from rl.learner.snapshots import ParamSnapshots, copy_params
from rl.loops.batches import batch_metrics, build_batch
from rl.loops.buffer import TrajectoryBuffer
from rl.loops.producer import AprilSource, offpolicy_prefix_batch
from rl.loops.rollouts import rollout_seed
from rl.loops.side_files import (
    iter_snapshots,
    load_rollout_state,
    prune_side_files,
    save_rollout_state,
    save_snapshots,
)
from rl.loops.source import BatchSource, Taken
from rl.rollout.april import AprilConfig
from rl.runtime.distributed import is_main_process, process_local
from rl.runtime.logging import EXTRA_PHASES, PHASES


def local_groups(loop: Any) -> int:
    """The groups of a step this process trains: its share of loop.prompts_per_step (all
    of them in one process; a Ray learner group's process its contiguous share)."""
    return loop.prompts_per_step // jax.process_count()


def train_config_for(config: TrainConfig, async_config: Any) -> TrainConfig:
    """The TrainConfig the learner runs with: old_logp set by the proximal option."""
    old = {"current": config.old_logp, "versions": "versions", "exact": "proximal",
           "ewma": "proximal"}[async_config.proximal]
    return config if old == config.old_logp else dataclasses.replace(config, old_logp=old)


def batch_version_metrics(batch: TrainBatch, version: int) -> dict[str, float]:
    """Behaviour-version statistics of a batch's loss tokens: min/max version, the lag
    version − v_b (mean, max) and mixed_version_rows, the share of rows with loss tokens
    drawn under more than one version (in-flight weight updates, APRIL resumes); {} for
    a batch without loss tokens."""
    mask = np.asarray(batch.loss_mask)
    all_vers = np.asarray(batch.versions, np.int64)
    vers = all_vers[mask]
    if vers.size == 0:
        return {}
    lag = version - vers
    lo = np.where(mask, all_vers, vers.max()).min(axis=-1)
    hi = np.where(mask, all_vers, vers.min()).max(axis=-1)
    rows = mask.any(axis=-1)
    return {"behaviour_version_min": float(vers.min()), "behaviour_version_max": float(vers.max()),
            "version_lag_mean": float(lag.mean()), "version_lag_max": float(lag.max()),
            "mixed_version_rows": float((hi[rows] > lo[rows]).mean())}


def split_devices(acfg: Any, mesh: jax.sharding.Mesh | None
                  ) -> tuple[jax.Device | None, jax.sharding.Mesh | None]:
    """(rollout device or None = share the default one, training mesh or None): threaded
    mode gives AsyncConfig.rollout_devices of jax.devices() (default: half when there are
    several) to the sampler and the rest to a data-parallel training mesh."""
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


class AsyncSource(BatchSource):
    """The shared part of the asynchronous sources (module doc). Fixed for the run: the
    AsyncConfig (`acfg`), the rollout device, the param ring and the buffer (made in open).
    Mutable: `published` ((sampler params, version), replaced in one assignment), the APRIL
    source, the EWMA params."""

    phases = (*PHASES, *EXTRA_PHASES)
    wait_metric = "rollout_wait_s"

    def __init__(self, config: Any):
        self.acfg = config.asynchronous
        self.k = self.acfg.max_staleness
        self.label = f"async η={self.k}"
        self.rollout_device: jax.Device | None = None
        self.snaps: ParamSnapshots | None = None
        self.buffer: TrajectoryBuffer | None = None
        self.published: tuple[Any, int] | None = None
        self.april: AprilSource | None = None
        self.ewma: Any = None
        self.resume_note: dict = {}

    # -------------------------------------------------------------- setup
    def devices(self, mesh: Any) -> Any:
        self.rollout_device, mesh = split_devices(self.acfg, mesh)
        return mesh

    def train_config(self, train: TrainConfig) -> TrainConfig:
        return train_config_for(train, self.acfg)

    def record_config(self) -> dict:
        return {"async": self.acfg}

    def open(self, run: Any, params: Any) -> None:
        acfg, state = self.acfg, run.state
        self.snaps = ParamSnapshots(acfg.ring_capacity, directory=None if acfg.snapshot_store
                                    == "memory" else run.config.output_dir / "snapshots" / "ring")
        self.buffer = TrajectoryBuffer(local_groups(run.loop), self.k,
                                       stale_policy=acfg.stale_policy,
                                       stale_weight=acfg.stale_weight,
                                       start_version=int(state.version))
        if run.resumed:
            meta_async = dict(run.ctx.meta.get("async") or {})
            self.resume_note = {"dropped_on_resume_groups":
                                int(meta_async.get("in_flight_groups", 0))}
        self.restore_ring(run)
        self.publish(run, state)
        if acfg.rollout == "april":
            self.april = self.open_april(run)
        if acfg.proximal == "ewma":
            self.ewma = copy_params(state.params)

    def restore_ring(self, run: Any) -> None:
        """The ring's versions saved beside the checkpoint (deterministic resume only)."""

    def restore_saved_ring(self, run: Any) -> None:
        """On resume, the ring's versions `save_ring` kept beside the checkpoint (the
        deterministic schedule's exact resume)."""
        if not run.resumed:
            return
        device = jax.devices()[0] if run.mesh is None else None  # else: onto their mesh
        for v, p in iter_snapshots(run.config.output_dir, run.ctx.start, run.state.params):
            self.snaps.put(v, p, copy=False, device=device)  # one at a time

    def save_ring(self, run: Any, step: int, state: Any) -> None:
        """The versions max(v − η, 0) .. v of the ring beside checkpoint `step`."""
        v = int(state.version)
        versions = [u for u in range(max(v - self.k, 0), v + 1) if u in self.snaps]
        snaps = self.snaps
        if jax.process_count() > 1:  # a learner group's global arrays: gathered (every
            snaps = ParamSnapshots(max(len(versions), 1))  # process), written by process 0
            for u in versions:
                snaps.put(u, process_local(self.snaps[u]), copy=False)
            if not is_main_process():
                return
        save_snapshots(run.config.output_dir, step, snaps, versions)

    def buffered(self, run: Any, groups: list, version: int) -> Any:
        """Put `groups` into the buffer and take a batch admissible at `version` (or None)."""
        if not self.buffer.reserve(len(groups)):
            raise RuntimeError(f"admission refused {len(groups)} groups at version "
                               f"{version}: {self.buffer.stats()}")
        with run.prof.phase("host_s"):
            for g in groups:
                self.buffer.put(g)
            return self.buffer.get_batch(local_groups(run.loop), version, timeout=0)

    def open_april(self, run: Any) -> AprilSource:
        """The APRIL source: fresh from the data position, or its saved FIFO and base."""
        saved, base = None, run.ctx.data_position
        if run.resumed:
            saved = load_rollout_state(run.config.output_dir, run.ctx.start)
            base = int(saved["base"])
        april = AprilConfig(over_provision=self.acfg.over_provision,
                            mask_offpolicy_prefix=self.acfg.mask_offpolicy_prefix)
        return AprilSource(run.spec, run.train, run.loop, april, base=base,
                           seed=rollout_seed(run.state.rng)[0],
                           saved=None if saved is None else saved["april"])

    def publish(self, run: Any, state: Any) -> None:
        """Put state.params into the ring as version state.version (on the rollout device)
        and make them the sampler's params, in one assignment (LoRA: the ring keeps adapter
        versions; the sampler gets the run's policy of them)."""
        v = int(state.version)
        params = self.snaps.put(v, state.params, device=self.rollout_device)
        self.published = (run.ctx.policy(params), v)

    def latest(self) -> tuple[Any, int]:
        """(sampler params, version) last published (the producer thread calls this)."""
        return self.published

    # -------------------------------------------------------------- one step
    def train_batch(self, run: Any, taken: Taken) -> tuple[TrainBatch, dict]:
        prof, loop, train = run.prof, run.loop, run.train
        with prof.phase("host_s"):
            batch = build_batch(taken.groups, run.spec, train, taken.token_weights)
            if self.acfg.mask_offpolicy_prefix:
                batch = offpolicy_prefix_batch(batch, loop.group_size)
        with prof.phase("proximal_s"):
            batch = self.with_proximal(run, batch)
        with prof.phase("host_s"):
            extra = batch_version_metrics(batch, int(run.state.version))
            extra.update(batch_metrics(run, batch))
        return batch, extra

    def with_proximal(self, run: Any, batch: TrainBatch) -> TrainBatch:
        """The batch with proximal_logprobs for proximal "exact" (the ring) or "ewma"."""
        lora, train, mc = run.ctx.lora, run.train, run.model_config
        if self.acfg.proximal == "exact":
            ring = self.snaps if lora is None else lora.snapshots(self.snaps)
            return batch.replace(proximal_logprobs=jax.block_until_ready(exact_proximal_logprobs(
                ring, mc, batch, train.temperature, train.attn_impl)))
        if self.acfg.proximal == "ewma":
            params = self.ewma if lora is None else lora.composed(self.ewma)
            return batch.replace(proximal_logprobs=jax.block_until_ready(policy_logprobs(
                params, mc, batch, train.temperature, train.attn_impl)))
        return batch

    def after_update(self, run: Any, step: int) -> None:
        state, prof = run.state, run.prof
        with prof.phase("proximal_s"):
            if self.ewma is not None:
                self.ewma = jax.block_until_ready(ewma_update(self.ewma, state.params,
                                                              self.acfg.ewma_beta))
        with prof.phase("transfer_s"):
            self.publish(run, state)
            if step + 1 < run.loop.steps:  # after the last step, admit nothing more
                self.buffer.set_version(int(state.version))

    def record_fields(self, run: Any, step: int) -> dict:
        out = {f"buffer_{k}": x for k, x in self.buffer.stats().items()}
        if self.april is not None:
            out.update(self.april.metrics())
        if step == run.ctx.start:
            out.update(self.resume_note)
        return out

    def eval_policy(self, run: Any) -> tuple[Any, int]:
        params, version = self.published  # the policy of run.state.version
        return process_local(params), version  # a learner group's: whole on every process

    # -------------------------------------------------------------- checkpoints
    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        meta = {"async": {"mode": self.acfg.mode, "max_staleness": self.k,
                          "buffer": self.buffer.stats()}}
        if self.april is not None:  # the FIFO of unfinished groups is restored on resume
            save_rollout_state(run.config.output_dir, step, self.april_state())
        return state, meta

    def april_state(self) -> dict:
        """APRIL's state between rounds, as a checkpoint keeps it."""
        return self.april.state()

    def after_save(self, run: Any) -> None:
        prune_side_files(run.config.output_dir, run.ctx.ckpt)

    def close(self, run: Any) -> None:
        if self.buffer is not None:
            self.buffer.close()
        if self.snaps is not None and self.snaps.directory is not None:
            self.snaps.clear()  # a disk ring's files (each checkpoint links its own)
