"""The synchronous batch source (max_staleness = 0): every step samples with the current
params, scores, and the learner makes one update on exactly that data.

    prompts (the prompt scheduler's choice from the train stream, at the data position)
      -> rollout engine (rl.rollout, params version v)   -> Trajectory
      -> task rewards (validated: names, finiteness)     -> online pruning, DAPO dynamic
                                                            sampling, DARS / replay groups
      -> TrainBatch -> train_step (advantages, loss, one optimizer update) -> version v+1

The harness (rl.loops.harness) runs the rest: the periodic eval, metrics, checkpoints (a
resume continues exactly: params, optimizer state, step, rng (the source of every rollout
seed) and the data position are in the checkpoint, so 2 steps + resume + 2 steps == 4
steps, bit for bit on CPU), the stop signals. This source's side state, in every
checkpoint's meta: the prompt scheduler's (rl.loops.scheduling; uniform keeps none) and the
pruner's quality head (rl.rollout.pruning).
"""
from __future__ import annotations

from typing import Any

from rl.loops.batches import (
    StreamSampler,
    batch_metrics,
    build_batch,
    open_sampler,
    sample_batch_groups,
    sampler_can_abandon,
    sampler_meta,
)
from rl.loops.source import BatchSource, Taken


class SyncSource(BatchSource):
    """Each step's groups sampled at the learner's own params and version (module doc)."""

    def __init__(self, config: Any):
        self.can_abandon = sampler_can_abandon(config)
        self.sampler: StreamSampler | None = None

    def open(self, run: Any, params: Any) -> None:
        self.sampler = open_sampler(run, params)

    def take(self, run: Any, step: int) -> Taken:
        groups, state, pos, stats = sample_batch_groups(run.state, run.data_position,
                                                        self.sampler, run.prof)
        return Taken(groups, state, pos, stats)

    def train_batch(self, run: Any, taken: Taken) -> tuple[Any, dict]:
        with run.prof.phase("host_s"):
            batch = build_batch(taken.groups, run.spec, run.train)
            return batch, batch_metrics(run, batch)

    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        return state, sampler_meta(run, self.sampler)
