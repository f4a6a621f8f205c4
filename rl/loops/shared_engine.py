"""One continuous engine that several concurrent requests feed: a Ray rollout worker's
requests under AsyncConfig.rollout = "continuous" (RolloutWorker.sample_inflight).

A request alone is one round (rl.loops.producer.sample_round): a fresh engine of its b
groups, whose slots idle from the moment their group finishes until the request's last
group does. Here a worker's requests share one engine of R × b × G slots (R =
AsyncConfig.worker_requests, G the group size):

    arrive      a request queues its b prompts into the engine (a fresh engine, seeded from
                the request's own rng, when nothing is live or queued in it)
    step        whichever request thread holds the engine runs one segment for every
                group in it, with the newest version the worker knows (its latest()),
                and hands each finished group to the request that queued it
    answer      a request returns once its b groups are back, in the order it queued
                them, with the tokens of the segments it stepped

A slot freed by one request's finished group takes the next queued prompt of any request
at the next segment: continuous batching across requests, as the in-process producer
refills its engine from the prompt stream, and one batched decode for all of a worker's
requests instead of one per request. Requests that never overlap (η = 0: one request at a
time) each find the engine idle and sample exactly what sample_round samples (tested).
Environments' episodes keep one round per request (their episode records are per request).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from rl.loops.buffer import ScoredGroup
from rl.loops.producer import retire_engine, round_engine, segment_groups, submit_prompts
from rl.loops.rollouts import RolloutSpec
from rl.rollout.engine import RolloutEngine

POLL_S = 0.005  # how often a request waiting on another thread's segment looks for its groups


class SharedEngine:
    """One RolloutEngine of `slots` slots for the requests of one worker (module doc).
    spec: the worker's rollout spec (a task that is not an environment)."""

    def __init__(self, spec: RolloutSpec, slots: int):
        self.spec, self.slots = spec, int(slots)
        self._step = threading.Lock()  # one thread steps the engine at a time
        self._state = threading.Lock()  # guards the maps below
        self._engine: RolloutEngine | None = None
        self._pending: dict[int, Any] = {}  # engine group id -> prompt (for scoring)
        self._owner: dict[int, int] = {}  # engine group id -> request id
        self._done: dict[int, list[tuple[int, ScoredGroup]]] = {}  # request -> its groups
        self._next_request = 0
        self._want: dict[int, int] = {}  # request -> groups it queued
        self._failed: dict[int, BaseException] = {}  # request -> the error it fails with

    def _arrive(self, seed: int, prompts: list) -> int:
        """Queue a request's prompts (under the step lock); its id."""
        if self._engine is None or self._engine.idle:
            self._engine = round_engine(self.spec, self.slots, seed)
        ids = submit_prompts(self._engine, self.spec.task, prompts)
        with self._state:
            rid, self._next_request = self._next_request, self._next_request + 1
            self._pending.update(ids)
            self._owner.update({g: rid for g in ids})
            self._done[rid], self._want[rid] = [], len(ids)
        return rid

    def _segment(self, latest: Callable[[], tuple[Any, int]]) -> int:
        """One segment for every group in the engine (under the step lock); each finished
        group to its request; the tokens harvested."""
        params, version = latest()
        got, tokens = segment_groups(self._engine, self.spec.task, self._pending, params,
                                     version, self.spec.group_size)
        with self._state:
            for gid, group in got:
                self._done[self._owner.pop(gid)].append((gid, group))
        return tokens

    def _ready(self, rid: int, want: int) -> bool:
        with self._state:
            if rid in self._failed:
                err = self._failed.pop(rid)
                self._want.pop(rid, None)
                raise RuntimeError("the worker's shared engine failed in another request's "
                                   f"segment: {err!r}") from err
            return len(self._done[rid]) >= want

    def _take(self, rid: int) -> list[ScoredGroup]:
        with self._state:
            groups = self._done.pop(rid)
            del self._want[rid]
        return [g for _, g in sorted(groups, key=lambda x: x[0])]

    def _fail(self, err: BaseException) -> None:
        """A segment raised: every request with groups still in the engine fails with it;
        the next request starts a fresh engine."""
        with self._state:  # a request whose groups are all back keeps them
            for rid in [r for r, got in self._done.items() if len(got) < self._want[r]]:
                self._failed[rid] = err
                del self._done[rid]
            self._pending, self._owner = {}, {}
        retire_engine(self._engine, self.spec.task)
        self._engine = None

    def queue(self, seed: int, prompts: list) -> tuple[int, int]:
        """Queue a request's prompts (a fresh engine seeded `seed` when the engine is idle);
        its ticket for wait()."""
        with self._step:
            return self._arrive(seed, prompts), len(prompts)

    def wait(self, ticket: tuple[int, int], latest: Callable[[], tuple[Any, int]]
             ) -> tuple[list[ScoredGroup], int]:
        """A queued request's groups, in the order it queued them, and the tokens of the
        segments this thread stepped for the engine meanwhile (with latest()'s params and
        version)."""
        rid, want = ticket
        tokens = 0
        while not self._ready(rid, want):
            if not self._step.acquire(timeout=POLL_S):
                continue
            try:
                if self._ready(rid, want):
                    continue
                try:
                    tokens += self._segment(latest)
                except BaseException as err:  # every request in the engine fails with it
                    self._fail(err)
                    with self._state:
                        self._failed.pop(rid, None)
                        self._want.pop(rid, None)
                    raise
            finally:
                self._step.release()
        return self._take(rid), tokens

    def sample(self, seed: int, prompts: list, latest: Callable[[], tuple[Any, int]]
               ) -> tuple[list[ScoredGroup], int]:
        """queue() then wait(): len(prompts) groups sampled in the shared engine (module
        doc). A segment takes the stepping thread's latest(): on a Ray worker the newest
        version published to the worker, so a request's groups may be stepped by another
        request's thread with the same newest version."""
        if not prompts:
            return [], 0
        return self.wait(self.queue(seed, prompts), latest)

    def close(self) -> None:
        retire_engine(self._engine, self.spec.task)
        self._engine = None
