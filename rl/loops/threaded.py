"""The threaded batch source (AsyncConfig.mode = "threaded"): a producer thread
(rl.loops.producer.RolloutProducer) samples with the latest published params, picking them
up at every segment boundary (in-flight weight updates: tokens after a swap carry the new
version), scores finished groups and puts them into the buffer under AReaL's admission
rule; the learner (the harness, main thread) takes b groups per step, trains, and
publishes the new params (a copy, on the rollout device) to the producer. With more than
one device, jax.devices() is split into training devices (a data-parallel mesh for the
train step) and rollout devices (the sampler runs on the first of them; new params are
resharded onto it before publishing); with one device they interleave.

Rollouts (AsyncConfig.rollout): "static" samples whole rounds of up to b groups and hands
them over sorted by prompt (one engine per round); "continuous" keeps one engine whose
free slots are refilled with new prompts at every segment boundary while the admission
rule allows; "april" runs APRIL rounds (rl.loops.deterministic's doc), each under one
params version (its weight swaps happen at round boundaries). With dynamic sampling the
filter runs in the producer (filtered groups are counted and replaced; no filler groups).
With η = 0 and static rollouts it reproduces the synchronous source exactly (and with
continuous rollouts on equal-length responses).

Faults: an exception in the producer thread stops the run at the step the learner waits
for: the harness writes a final checkpoint and raises RuntimeError ("step N: the rollout
thread failed: ...") chained to the original exception (a task's NonFiniteError keeps its
type); the producer is always stopped and joined (AsyncConfig.join_timeout_s, then it is a
daemon thread, so it can never keep the process alive). Resume restarts the producer at
the data position (and rng) it had reached when the checkpoint was written: groups that
were queued or still being sampled then are NOT restored and are counted as dropped
(`dropped_on_resume_groups` in the first record); with APRIL the FIFO of unfinished groups
as of the producer's last finished round IS restored (partial responses, log-probs,
versions), the queued groups count as dropped and the prompts of the round then running
are sampled again.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import jax
import numpy as np

from rl.learner.batch import NonFiniteError
from rl.loops.asynchronous import AsyncSource
from rl.loops.producer import RolloutProducer
from rl.loops.source import Taken
from rl.runtime.preemption import abandon_point


class ThreadedSource(AsyncSource):
    """Each step's groups from the producer thread's buffer (module doc)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.producer: RolloutProducer | None = None
        self.thread: threading.Thread | None = None
        self.producer_tokens = 0  # producer.sampled_tokens at the last step

    def start(self, run: Any) -> None:
        self.producer = RolloutProducer(
            run.spec, run.train, run.loop, rollout=self.acfg.rollout, buffer=self.buffer,
            latest=self.latest, start=(run.ctx.data_position,
                                       np.asarray(jax.device_get(run.state.rng))),
            device=self.rollout_device, april=self.april)
        self.thread = threading.Thread(target=self.producer.run, name="tandem-rollout",
                                       daemon=True)
        self.thread.start()

    def take(self, run: Any, step: int) -> Taken:
        """Poll the buffer for b groups admissible at version v; a producer error stops the
        wait (module doc), and so does a producer thread that ended without one. The wait is
        the profile's wait_s; sampled_tokens is what the producer sampled since the last
        step."""
        producer, v = self.producer, int(run.state.version)
        got, t_wait = None, time.perf_counter()
        while got is None:
            abandon_point()  # a stop request while waiting (rl.runtime.preemption)
            got = self.buffer.get_batch(run.loop.prompts_per_step, v, timeout=0.1)
            if isinstance(producer.error, NonFiniteError):  # a task's reward
                raise NonFiniteError(str(producer.error))
            if producer.error is not None:
                raise RuntimeError(
                    f"step {step + 1}: the rollout thread failed: "
                    f"{type(producer.error).__name__}: {producer.error}") from producer.error
            if got is None and not self.thread.is_alive():
                raise RuntimeError(f"step {step + 1}: the rollout thread stopped without an "
                                   "error before the run was complete")
        run.prof.add("wait_s", time.perf_counter() - t_wait)
        total = producer.sampled_tokens  # read once: tokens sampled meanwhile count next step
        stats = {"sampled_tokens": total - self.producer_tokens}
        self.producer_tokens = total
        return Taken(got.groups, run.state, run.data_position, stats, got.token_weights)

    def record_fields(self, run: Any, step: int) -> dict:
        run.data_position = self.producer.position()[0]  # where the producer is
        return {**super().record_fields(run, step), "data_position": run.data_position}

    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        """The producer's data position and rng chain (consistent with each other) are the
        checkpoint's; queued groups are lost on resume (APRIL re-samples its running round's
        new prompts and restores its FIFO, so only the queued ones count there)."""
        state, meta = super().checkpoint(run, step, state)
        if self.producer is None:  # a stop before the producer started
            return state, meta
        pos, rng = self.producer.position()
        state = state.replace(rng=jax.device_put(rng, state.rng.sharding))
        stats = self.buffer.stats()
        meta["async"]["in_flight_groups"] = stats["queued_groups"] + (
            0 if self.april is not None else stats["running_groups"])
        meta["data_position"] = int(pos)
        return state, meta

    def april_state(self) -> dict:
        return self.producer.april_snapshot[0] if self.producer is not None else super().april_state()

    def final_save_due(self, run: Any, err: BaseException) -> bool:
        return self.producer is not None and self.producer.error is not None

    def stop(self) -> None:
        if self.producer is not None:
            self.producer.stop()

    def close(self, run: Any) -> None:
        self.stop()
        super().close(run)
        if self.thread is not None:
            self.thread.join(self.acfg.join_timeout_s)
            if self.thread.is_alive():
                warnings.warn(f"the rollout thread did not stop within "
                              f"{self.acfg.join_timeout_s} s; it is a daemon thread and ends "
                              "with the process")
        if self.april is not None:  # after the thread: its round may still use the pool
            self.april.close()
