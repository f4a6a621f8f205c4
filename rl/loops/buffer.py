"""`TrajectoryBuffer`: the thread-safe queue of scored groups between the rollout side
and the learner, with AReaL's staleness admission rule and per-token version checks.

Admission (AReaL, "Staleness admission" in ALGORITHMS.md). With b groups per learner
step, current policy version v and staleness bound η, the rollout side may have at most
(η + v + 1)·b groups accepted + running. Here "accepted" counts every group put into the
buffer since version 0 (the learner has consumed v·b of them), minus groups dropped as
stale (a dropped group frees its place; otherwise every drop would shrink the producer's
budget for good); "running" counts reservations not yet put. The producer calls
`reserve(n)` (or `can_admit(n)` first) before it starts sampling n groups, then `put`s
each finished group, or `release`s a reservation it will not fill (a group filtered
out by dynamic sampling, a run that stops). With η = 0 this admits exactly one batch
per version: synchronous on-policy training.

Consumption. `get_batch(b, v)` takes the b oldest groups (FIFO) whose tokens are all
within η versions of v, i.e. every token version ≥ v − η. A group with an older token
(possible when groups finish out of order, or with partial rollouts resumed across
versions) is handled by `stale_policy`:

  - "drop": the whole group is removed and counted (dropped_stale_groups / _tokens);
  - "downweight": the group is kept and each STALE TOKEN (not the whole group: tokens
    produced after an in-flight weight swap are fresh) gets loss weight `stale_weight`,
    returned as per-group [N, R] arrays for `TrainBatch.loss_weights`.
Nothing is lost silently: `stats()` counts admitted, consumed, dropped, down-weighted,
released, queued and running groups (and tokens).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from typing import Mapping

import numpy as np

from rl.trajectory import Trajectory

STALE_POLICIES = ("drop", "downweight")


@dataclasses.dataclass(frozen=True)
class ScoredGroup:
    """One group ready for the learner. traj: the N samples of one prompt (numpy
    fields, rows of one group id); rewards: {name: [N] float64}; live: False for a filler
    group (dynamic sampling could not find enough informative groups) whose loss mask the
    batch clears."""

    traj: Trajectory
    rewards: Mapping[str, np.ndarray]
    live: bool = True

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.traj.response_mask).sum())

    def token_versions(self) -> np.ndarray:
        """Versions of the group's response tokens (flat, masked positions only)."""
        return np.asarray(self.traj.versions)[np.asarray(self.traj.response_mask)]


@dataclasses.dataclass(frozen=True)
class BufferBatch:
    """What `get_batch` hands the learner: b groups (FIFO order) and, with the
    "downweight" policy, one [N, R] float32 per-token loss-weight array per group
    (aligned with the group's response tokens; None with "drop")."""

    groups: list[ScoredGroup]
    token_weights: list[np.ndarray] | None


class TrajectoryBuffer:
    """FIFO of `ScoredGroup`s under the staleness admission rule (see the module doc).

    buf = TrajectoryBuffer(batch_groups=b, max_staleness=eta)
    if buf.reserve(n): ... sample n groups ...; buf.put(group) for each
    out = buf.get_batch(b, version, timeout=1.0)   # None on timeout
    buf.set_version(version + 1)                   # after the learner's update
    """

    def __init__(self, batch_groups: int, max_staleness: int, *, stale_policy: str = "drop",
                 stale_weight: float = 0.5, start_version: int = 0):
        for name, v, low in (("batch_groups", batch_groups, 1), ("max_staleness", max_staleness, 0),
                             ("start_version", start_version, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"TrajectoryBuffer {name} must be an int >= {low}, got {v!r}")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"TrajectoryBuffer stale_policy must be one of {STALE_POLICIES}, "
                             f"got {stale_policy!r}")
        if not (isinstance(stale_weight, (int, float)) and math.isfinite(stale_weight)
                and 0.0 <= stale_weight <= 1.0):
            raise ValueError(f"TrajectoryBuffer stale_weight must be a number in [0, 1], got "
                             f"{stale_weight!r}")
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        self.stale_policy, self.stale_weight = stale_policy, float(stale_weight)
        self._cond = threading.Condition()
        self._queue: collections.deque[ScoredGroup] = collections.deque()
        self._version = start_version
        # A resumed run starts at version v0 as if v0·b groups had been accepted and consumed.
        self._base = start_version * batch_groups
        self._closed = False
        self._c = collections.Counter()

    # ------------------------------------------------------------------ admission
    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def _capacity(self) -> int:
        c = self._c
        accepted = self._base + c["admitted_groups"] - c["dropped_stale_groups"]
        running = c["reserved_groups"] - c["admitted_groups"] - c["released_groups"]
        return (self.max_staleness + self._version + 1) * self.batch_groups - accepted - running

    def capacity(self) -> int:
        """How many more groups the producer may start now (may be <= 0)."""
        with self._cond:
            return self._capacity()

    def can_admit(self, n: int = 1) -> bool:
        with self._cond:
            return self._capacity() >= _count("n", n)

    def reserve(self, n: int = 1) -> bool:
        """Atomically reserve n running groups if the rule allows it; False otherwise."""
        n = _count("n", n)
        with self._cond:
            if self._closed or self._capacity() < n:
                return False
            self._c["reserved_groups"] += n
            return True

    def wait_for_capacity(self, n: int = 1, timeout: float | None = None) -> bool:
        """Block until n groups could be admitted (True), the timeout passes or the buffer
        is closed (False)."""
        n = _count("n", n)
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or self._capacity() >= n,
                                       timeout) and not self._closed

    def release(self, n: int = 1, reason: str = "cancelled") -> None:
        """Give back n reservations that will not be put. reason "filtered" (dynamic
        sampling threw the group away) or "cancelled" (the run stopped mid-rollout)."""
        n = _count("n", n)
        if reason not in ("filtered", "cancelled"):
            raise ValueError(f"release reason must be 'filtered' or 'cancelled', got {reason!r}")
        with self._cond:
            if n > self._running():
                raise ValueError(f"release({n}): only {self._running()} groups are reserved")
            self._c["released_groups"] += n
            self._c[f"{reason}_groups"] += n
            self._cond.notify_all()

    def _running(self) -> int:
        c = self._c
        return c["reserved_groups"] - c["admitted_groups"] - c["released_groups"]

    def put(self, group: ScoredGroup) -> None:
        """Queue a finished group that was reserved before (ValueError otherwise)."""
        if not isinstance(group, ScoredGroup):
            raise ValueError(f"put expects a ScoredGroup, got {type(group).__name__}")
        with self._cond:
            if self._running() < 1:
                raise ValueError("put without a reservation: call reserve(n) before sampling "
                                 "(the staleness admission rule counts running groups)")
            self._queue.append(group)
            self._c["admitted_groups"] += 1
            self._c["admitted_tokens"] += group.num_tokens
            self._cond.notify_all()

    # ------------------------------------------------------------------ consumption
    def set_version(self, version: int) -> None:
        """The learner's current version (after an update); may widen the capacity."""
        version = _count("version", version)
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def _stale_mask(self, group: ScoredGroup, version: int) -> np.ndarray:
        """[N, R] True at response tokens older than version − η."""
        mask = np.asarray(group.traj.response_mask)
        return mask & (np.asarray(group.traj.versions) < version - self.max_staleness)

    def get_batch(self, b: int, current_version: int, timeout: float | None = None
                  ) -> BufferBatch | None:
        """The b oldest admissible groups for a learner at `current_version` (also recorded
        as the buffer's version). Blocks until there are b of them; returns None when the
        timeout passes or the buffer is closed first (stale groups met while waiting are
        dropped and counted either way; fresh ones stay queued)."""
        b = _count("b", b)
        current_version = _count("current_version", current_version)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._version = current_version
            while True:
                if self.stale_policy == "drop":
                    self._drop_stale(current_version)
                if len(self._queue) >= b:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if self._closed or (left is not None and left <= 0):
                    return None
                self._cond.wait(left)
            groups = [self._queue.popleft() for _ in range(b)]
            weights = None
            if self.stale_policy == "downweight":
                weights = []
                for g in groups:
                    stale = self._stale_mask(g, current_version)
                    weights.append(np.where(stale, np.float32(self.stale_weight),
                                            np.float32(1.0)).astype(np.float32))
                    if stale.any():
                        self._c["downweighted_groups"] += 1
                        self._c["downweighted_tokens"] += int(stale.sum())
            self._c["consumed_groups"] += b
            self._c["consumed_tokens"] += sum(g.num_tokens for g in groups)
            self._cond.notify_all()
        return BufferBatch(groups=groups, token_weights=weights)

    def _drop_stale(self, version: int) -> None:
        keep = collections.deque()
        for g in self._queue:
            if self._stale_mask(g, version).any():
                self._c["dropped_stale_groups"] += 1
                self._c["dropped_stale_tokens"] += g.num_tokens
            else:
                keep.append(g)
        if len(keep) != len(self._queue):
            self._queue = keep
            self._cond.notify_all()  # dropped groups free admission capacity

    # ------------------------------------------------------------------ shutdown / stats
    def close(self) -> None:
        """Wake every waiter; further reserves fail and waits return at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def stats(self) -> dict[str, int]:
        """Counters (cumulative since construction) and the current levels:
        admitted/consumed/dropped_stale/downweighted/filtered/cancelled groups (+ tokens
        where meaningful), queued_groups, running_groups, capacity, version."""
        with self._cond:
            out = {k: int(self._c[k]) for k in (
                "reserved_groups", "admitted_groups", "admitted_tokens", "consumed_groups",
                "consumed_tokens", "dropped_stale_groups", "dropped_stale_tokens",
                "downweighted_groups", "downweighted_tokens", "released_groups",
                "filtered_groups", "cancelled_groups")}
            out.update(queued_groups=len(self._queue),
                       queued_tokens=sum(g.num_tokens for g in self._queue),
                       running_groups=self._running(), capacity=self._capacity(),
                       version=self._version)
        return out


def _count(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return int(v)
