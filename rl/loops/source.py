"""The batch-source protocol: what the run harness (rl.loops.harness) asks of the thing
that decides where each step's groups come from and with which params version.

    source.devices(mesh)          the learner's mesh (a threaded producer takes devices)
    source.train_config(train)    the TrainConfig the jitted step runs with
    source.record_config()        its entries of the run's config record (resume compares)
    source.open(run, params)      before the step-0 eval: restore its side state (scheduler,
                                  pruner, param ring, APRIL's FIFO), publish version v0
    source.start(run)             after the step-0 eval: start producing (a thread)
    source.can_abandon            whether a stop may drop a half-sampled step (nothing but
                                  the rollouts is lost)
    source.take(run, step)        the step's groups -> Taken
    source.train_batch(run, taken)  -> (TrainBatch, the batch's own metrics)
    source.after_update(run, step)  the learner's new version is run.state's: publish it
    source.record_fields(run, step) its fields of the step's train record
    source.eval_policy(run)       (params, version) the evals sample
    source.checkpoint(run, step, state)  its side files; -> (state to save, meta entries)
    source.after_save(run)        after a periodic checkpoint (prune side files)
    source.final_save_due(run, err)  an error after which the last step is checkpointed
    source.stop()                 stop producing (a stop signal or a fault)
    source.close(run)             always, at the end: join threads, delete scratch files

`BatchSource` holds the defaults (a source overrides what it does differently). `run` is
the harness's `Run` (its context, configs, rollout spec, state, data position, profile).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

from rl.runtime.distributed import process_local
from rl.runtime.logging import PHASES


@dataclasses.dataclass
class Taken:
    """A step's groups from BatchSource.take: the groups (rl.loops.buffer.ScoredGroup, in
    batch order) and their optional per-token loss weights (one [N, R] per group), the
    state to train (with the rollouts' rng advanced), the data position after them and the
    sampling counters for the record ({"sampled_tokens": n, ...})."""

    groups: list
    state: Any
    data_position: int
    stats: dict
    token_weights: list | None = None


class BatchSource(abc.ABC):
    """The defaults of the protocol (module doc): a source that keeps no side state,
    publishes nothing and evaluates the state's own params; take and train_batch are each
    source's own."""

    label = "grpo"  # the progress bar's
    phases: tuple[str, ...] = PHASES  # the step profile's phases
    wait_metric = "rollout_s"  # the record's field for the time take() took
    can_abandon = True

    def devices(self, mesh: Any) -> Any:
        return mesh

    def train_config(self, train: Any) -> Any:
        return train

    def record_config(self) -> dict:
        return {}

    def open(self, run: Any, params: Any) -> None:
        """Restore side state and publish the first version (nothing by default)."""

    def start(self, run: Any) -> None:
        """Start producing after the step-0 eval (nothing by default)."""

    @abc.abstractmethod
    def take(self, run: Any, step: int) -> Taken:
        """The groups of step `step` (0-based) at the learner's version run.state.version."""

    @abc.abstractmethod
    def train_batch(self, run: Any, taken: Taken) -> tuple[Any, dict]:
        """(TrainBatch of the taken groups, the batch's own metrics for the record)."""

    def after_update(self, run: Any, step: int) -> None:
        """The learner made run.state (nothing to publish by default)."""

    def record_fields(self, run: Any, step: int) -> dict:
        return {}

    def eval_policy(self, run: Any) -> tuple[Any, int]:
        return process_local(run.ctx.policy(run.state.params)), int(run.state.version)

    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        return state, {}

    def after_save(self, run: Any) -> None:
        """After a periodic checkpoint (nothing by default)."""

    def final_save_due(self, run: Any, err: BaseException) -> bool:
        return False

    def stop(self) -> None:
        """Stop producing (nothing by default)."""

    def close(self, run: Any) -> None:
        """Release what the source holds (nothing by default)."""
