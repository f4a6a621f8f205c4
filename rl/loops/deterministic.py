"""The deterministic k-stale batch source (AsyncConfig.mode = "deterministic"): no threads;
step v samples its batch with the params of version max(v − k, 0), k = η, from a
`rl.learner.snapshots.ParamSnapshots` ring, so every token of step v has version exactly
v − k (v ≥ k) and runs are reproducible on one CPU.

    static rollouts  one call of rl.loops.batches.sample_batch_groups with the ring's
                     params of version max(v − k, 0): the prompt scheduler, rollout
                     replay, online pruning and DAPO's dynamic sampling work as in the
                     synchronous source; environments run their episodes here
    APRIL rollouts   `rl.rollout.april.AprilRollout` rounds (⌈over_provision·b⌉ groups
                     started, the round ends when b are complete, the unfinished ones wait
                     whole in a FIFO drained first next round) until the buffer yields a
                     batch, at most 4·(η + 1) rounds; resumed groups carry prefixes of older
                     versions: with stale_policy "drop" those older than η versions are
                     dropped (counted), with "downweight" none is discarded; an
                     environment's episodes run in rl.rollout.april_episodes rounds (the
                     unfinished ones carried in the engine, mid-turn)

The ring holds k + 2 versions: (k + 2) × the params' bytes of memory with
AsyncConfig.snapshot_store="memory" (the default), or files under run_dir/snapshots/ring/
and at most 2 versions in memory with "disk" (the same run, bit for bit; one params write
and one read per step; deleted at the run's end). With η = 0 it reproduces the synchronous
source exactly (the same rng splits, the same sampling calls).

Resume is exact with static rollouts: the ring's versions max(v − η, 0) .. v are saved
beside each checkpoint under run_dir/snapshots/STEP/ (one file per version, hard links to a
disk ring's files); with APRIL its FIFO is saved under run_dir/rollout_state/ and restored
whole, but rl.rollout.april reseeds new groups on a restore, so the continuation is
statistically, not bitwise, the same (episodes: the carried groups start again from their
prompts, counted in april_lost / april_restarted). A stop during an APRIL round is left
to finish (its FIFO moves), during static sampling it drops the step's rollouts.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from rl.loops.asynchronous import AsyncSource
from rl.loops.batches import (
    StreamSampler,
    open_sampler,
    sample_batch_groups,
    sampler_can_abandon,
    sampler_meta,
)
from rl.loops.source import Taken


class DeterministicSource(AsyncSource):
    """Each step's groups sampled with the ring's params of version max(v − k, 0) (module
    doc)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.can_abandon = self.acfg.rollout != "april" and sampler_can_abandon(config)
        self.sampler: StreamSampler | None = None

    def open(self, run: Any, params: Any) -> None:
        super().open(run, params)
        if self.april is None:
            self.sampler = open_sampler(run, params)

    def restore_ring(self, run: Any) -> None:
        self.restore_saved_ring(run)

    def take(self, run: Any, step: int) -> Taken:
        """Sample with the ring's params of bv = max(v - η, 0), put the groups into the
        buffer and take a batch (module doc)."""
        b, v = run.loop.prompts_per_step, int(run.state.version)
        bv = max(v - self.k, 0)
        st, pos = run.state, run.data_position
        got, stats, rounds = None, {"sampled_tokens": 0}, 0
        while got is None:
            if self.april is None:
                sampler_state = st.replace(params=self.snaps[bv],
                                           version=jnp.asarray(bv, jnp.int32))
                groups, sampler_state, pos, stats = sample_batch_groups(
                    sampler_state, pos, self.sampler, run.prof)
                st = st.replace(rng=sampler_state.rng)
            else:
                with run.prof.phase("wait_s"):  # a whole APRIL round
                    groups = self.april.round(run.ctx.policy(self.snaps[bv]), bv,
                                              b - self.buffer.stats()["queued_groups"])
                pos = self.april.position
                stats["sampled_tokens"] += self.april.generated_tokens
            got = self.buffered(run, groups, v)
            rounds += 1
            if got is None and (self.april is None or rounds > 4 * (self.k + 1)):
                raise RuntimeError(
                    f"step {step + 1}: the buffer dropped every group as older than "
                    f"max_staleness={self.k} versions ({self.buffer.stats()}); use "
                    "stale_policy='downweight' or a larger max_staleness")
        return Taken(got.groups, st, pos, stats, got.token_weights)

    def close(self, run: Any) -> None:
        super().close(run)
        if self.april is not None:
            self.april.close()

    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        state, meta = super().checkpoint(run, step, state)
        self.save_ring(run, step, state)
        if self.sampler is not None:
            meta.update(sampler_meta(run, self.sampler))
        return state, meta

