"""`ParamSnapshots`: a bounded ring of parameter pytrees keyed by policy version.

The asynchronous loop keeps the params of the last few versions so that (a) the
deterministic staleness mode can sample step v's batch with exactly the params of
version v − k, and (b) `rl.learner.proximal.exact_proximal_logprobs` can recompute log π at each
token's own behaviour version (the "missing old logits"). It is a read-only `Mapping`
{version: params} for its readers, so it can be passed wherever a mapping is expected.

Stored params are copies (`copy=True`, the default): the learner's jitted step donates
its state, which would otherwise invalidate the arrays held here. Copies stay on the
device the source lives on unless `device` (a `jax.Device` or `jax.sharding.Sharding`)
says where to put them (e.g. the rollout devices). Thread-safe: the learner puts while
the rollout thread reads.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = Any


class ParamSnapshots(Mapping):
    """Keep the params of at most `capacity` versions; putting one more evicts the oldest.

    snaps = ParamSnapshots(capacity=3)
    snaps.put(0, params0); snaps.put(1, params1)
    snaps[1] is snaps.get(1); 0 in snaps; snaps.versions() == [0, 1]
    snaps.oldest, snaps.newest  # 0, 1 (None while empty)
    snaps.evicted               # how many versions the ring has dropped so far
    """

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ParamSnapshots capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._items: dict[int, Params] = {}
        self._lock = threading.Lock()
        self.evicted = 0
        self._max_evicted: int | None = None

    # ------------------------------------------------------------------ writing
    def put(self, version: int, params: Params, *, copy: bool = True,
            device: jax.Device | jax.sharding.Sharding | None = None) -> Params:
        """Store `params` as `version` (replacing an entry of the same version) and evict
        the oldest versions past capacity. Returns the stored pytree (the copy)."""
        version = _check_version(version)
        if device is not None:
            stored = jax.device_put(params, device)  # a transfer is a copy already
            if copy:
                stored = jax.tree.map(jnp.copy, stored)
        elif copy:
            stored = jax.tree.map(jnp.copy, params)
        else:
            stored = params
        with self._lock:
            self._items[version] = stored
            while len(self._items) > self.capacity:
                old = min(self._items)
                del self._items[old]
                self.evicted += 1
                self._max_evicted = old if self._max_evicted is None else max(self._max_evicted, old)
        return stored

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    # ------------------------------------------------------------------ reading
    def __getitem__(self, version: int) -> Params:
        version = _check_version(version)
        with self._lock:
            if version in self._items:
                return self._items[version]
            held = sorted(self._items)
            evicted = self._max_evicted is not None and version <= self._max_evicted \
                and (not held or version < held[0])
        if evicted:
            raise KeyError(f"params of version {version} were evicted from the snapshot ring "
                           f"(capacity {self.capacity}, holds versions {held}); raise the "
                           "snapshot capacity to at least max_staleness + 1")
        raise KeyError(f"no params snapshot of version {version} (the ring holds versions "
                       f"{held}); versions are put by the learner after each update")

    def get(self, version: int, default: Any = None) -> Params:
        """The params of `version`; unlike `self[version]`, `default` when absent."""
        try:
            return self[version]
        except KeyError:
            return default

    def __contains__(self, version: object) -> bool:
        with self._lock:
            return version in self._items

    def __iter__(self) -> Iterator[int]:
        return iter(self.versions())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def versions(self) -> list[int]:
        """Stored versions, oldest first."""
        with self._lock:
            return sorted(self._items)

    @property
    def oldest(self) -> int | None:
        v = self.versions()
        return v[0] if v else None

    @property
    def newest(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def __repr__(self) -> str:
        return f"ParamSnapshots(capacity={self.capacity}, versions={self.versions()})"


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"a policy version must be an int >= 0, got {version!r}")
    return int(version)
