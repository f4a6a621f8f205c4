"""Streaming Ray rollout workers (AsyncConfig.backend = "ray", mode = "threaded", static
rollouts): the threaded producer's counterpart, with the sampling in N worker processes.

Where rl.loops.ray_workers follows the deterministic schedule (step v trains on version
max(v − η, 0), fixed in advance), here the workers sample with the newest published
version whenever the buffer's admission rule lets them, as the producer thread does:

    submit      while fewer than N × worker_requests requests are in flight and the
                buffer reserves one step's b groups (AReaL's rule: at most (η + v + 1)·b
                groups accepted + running at learner version v), request r goes to the
                least busy worker with (the newest version's params ref, that version,
                rng_r, position_r): the learner keeps the data stream's rng chain and
                positions, so no two requests sample the same prompts
    answer      the scored groups into the buffer (its reservation filled); an
                environment's episode records to the learner's task
    take        the b oldest groups admissible at v (every token within η versions;
                older ones dropped or down-weighted by AsyncConfig.stale_policy, counted in
                buffer_*), waiting on the first answers to come back while there are
                fewer

So η means what it means in-process: with η = 0 one batch is admitted per version and the
run is the synchronous one (bit for bit, tested); with η >= 1 up to η + 1 steps' groups
are sampled or queued ahead of the learner. Weight sync is rl.loops.ray_workers' (a put
per version a request is sent with, bf16 and LoRA adapters as there); a version's ref is
released when no request in flight holds it and a newer one exists. A worker that dies is
restarted by Ray and its request sent again with the same inputs (counted:
ray_worker_restarts). A checkpoint keeps the chain's next rng and position; the groups
then queued or in flight are not restored and count as dropped on resume
(`dropped_on_resume_groups`), as in threaded mode.
"""
from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.loops.ray_workers import RaySource
from rl.loops.rollouts import rollout_seed
from rl.loops.source import Taken


class RayStreamSource(RaySource):
    """Ray workers sampling with the newest version under the buffer's admission rule
    (module doc)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.label = (f"async η={self.k}, streaming, {self.acfg.rollout_workers} ray "
                      "worker(s)")
        self.request_id = 0
        self.next_rng: np.ndarray | None = None
        self.next_position = 0
        self.steps_left = 0  # steps still to train, this one included

    def devices(self, mesh: Any) -> Any:
        return mesh  # the sampler is in the workers: every local device trains

    def open(self, run: Any, params: Any) -> None:
        super().open(run, params)
        self.next_rng, self.next_position = self.chain[int(run.state.version)]
        self.chain = {}

    def restore_ring(self, run: Any) -> None:
        """Nothing: a streaming run's resume restarts sampling from the saved chain."""

    # -------------------------------------------------------------- requests
    def _busy(self, worker: int) -> int:
        return sum(1 for w, _, _ in self.inflight.values() if w == worker)

    def _fill(self, run: Any, v: int) -> None:
        """Submit requests with the newest version while workers have room and the buffer
        admits one more step's groups (no request past what the run can train)."""
        b = self.prompts_per_step
        while len(self.inflight) < self.max_inflight and self._wanted(run) > 0 and \
                self.buffer.reserve(b):
            worker = min(range(len(self.workers)), key=self._busy)
            rng, pos = self.next_rng, self.next_position
            request = (v, rng, pos)
            fut = self.workers[worker].sample.remote(self._params_ref(run, v), v, rng, pos,
                                                     self.lora_ref)
            self.inflight[self.request_id] = (worker, fut, request)
            self.request_id += 1
            _, key = rollout_seed(jnp.asarray(rng))
            self.next_rng, self.next_position = np.asarray(key, np.uint32), pos + b

    def _wanted(self, run: Any) -> int:
        """Groups the remaining steps still need beyond those queued and in flight."""
        stats = self.buffer.stats()
        return self.steps_left * self.prompts_per_step - stats["queued_groups"] - \
            stats["running_groups"]

    def _collect(self, run: Any) -> None:
        """Wait for the first request in flight to answer; its groups into the buffer."""
        futs = {fut: rid for rid, (_, fut, _) in self.inflight.items()}
        ready, _ = self.ray.wait(list(futs), num_returns=1)
        rid = futs[ready[0]]
        groups, rng, pos, stats, seconds, episodes = self.answer(run, rid)
        _, _, (version, rng_in, pos_in) = self.inflight.pop(rid)
        want_rng = np.asarray(rollout_seed(jnp.asarray(rng_in))[1], np.uint32)
        if not (np.array_equal(rng, want_rng) and pos == pos_in + self.prompts_per_step):
            raise RuntimeError(f"rollout worker answered request {rid} with rng / position "
                               f"{rng.tolist()} / {pos}, expected {want_rng.tolist()} / "
                               f"{pos_in + self.prompts_per_step}")
        if episodes is not None:
            run.task.add_records(*episodes)
        for g in groups:
            self.buffer.put(g)
        self.sample_s += seconds
        self.sampled_tokens += int(stats.get("sampled_tokens", 0))

    # -------------------------------------------------------------- the step
    def take(self, run: Any, step: int) -> Taken:
        v = int(run.state.version)
        self.sample_s, self.sampled_tokens = 0.0, 0
        self.steps_left = run.loop.steps - step
        self._fill(run, v)
        t0 = time.perf_counter()
        while True:
            with run.prof.phase("host_s"):
                got = self.buffer.get_batch(run.loop.prompts_per_step, v, timeout=0)
            if got is not None:
                break
            if not self.inflight:
                raise RuntimeError(f"step {step + 1}: no batch admissible at version {v} "
                                   f"and nothing in flight ({self.buffer.stats()})")
            self._collect(run)
            self._fill(run, v)
        run.prof.add("wait_s", time.perf_counter() - t0)
        self._fill(run, v)  # the workers go on while the learner trains
        versions = np.concatenate([g.token_versions() for g in got.groups])
        self.last_lag = v - int(versions.min()) if versions.size else 0
        stats = {"sampled_tokens": self.sampled_tokens, "ray_sample_s": self.sample_s}
        return Taken(got.groups, run.state, self.next_position, stats, got.token_weights)

    def after_update(self, run: Any, step: int) -> None:
        super(RaySource, self).after_update(run, step)  # publish, the buffer's version
        v = int(run.state.version)
        self.steps_left = run.loop.steps - step - 1
        held = {req[0] for _, _, req in self.inflight.values()}
        for old in [u for u in self.refs if u < v and u not in held]:
            del self.refs[old]
        self._fill(run, v)

    def record_fields(self, run: Any, step: int) -> dict:
        run.data_position = self.next_position
        return {**super().record_fields(run, step), "data_position": self.next_position}

    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        state, meta = super(RaySource, self).checkpoint(run, step, state)
        state = state.replace(rng=jax.device_put(self.next_rng, state.rng.sharding))
        stats = self.buffer.stats()
        meta["async"]["in_flight_groups"] = stats["queued_groups"] + stats["running_groups"]
        meta["async"]["ray_workers"] = len(self.workers)
        meta["data_position"] = int(self.next_position)
        return state, meta
