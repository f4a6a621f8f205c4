"""The asynchronous section of a run's config (`RunConfig.asynchronous`, `async.*` in dotted
paths): `AsyncConfig`, the staleness knob and how the asynchronous sources run
(rl.loops.deterministic, rl.loops.threaded, rl.loops.ray_workers), and the names its
fields take. rl.loops.config re-exports all of it.
"""
from __future__ import annotations

import dataclasses

from rl.loops.buffer import STALE_POLICIES
from rl.rollout.april import AprilConfig

MODES = ("threaded", "deterministic")
ROLLOUTS = ("static", "continuous", "april")
PROXIMAL = ("current", "exact", "versions", "ewma")
SNAPSHOT_STORES = ("memory", "disk")
BACKENDS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """max_staleness η: data may be at most η versions older than the learner (0 =
    synchronous). mode "threaded" | "deterministic" (module doc). stale_policy "drop" |
    "downweight" (per stale token, factor stale_weight) for data older than η (see
    rl.loops.buffer). rollout "static" | "continuous" (threaded mode only) | "april" (+
    over_provision, mask_offpolicy_prefix).
    proximal "current" | "exact" | "versions" | "ewma" (+ ewma_beta). snapshot_capacity:
    versions kept in the param ring (default η + 2; at least η + 1). snapshot_store: where
    the ring keeps them: "memory" (the default; ring_capacity × the trained params' bytes
    of RAM, e.g. 34 × 0.54 GB = 18 GB for SmolLM2-135M in fp32 at η = 32) or "disk"
    (mode="deterministic" only: each version is also written to
    run_dir/snapshots/ring/v{version}.npz and memory holds at most 2 versions, the newest
    and the last one read back; reads of the others load their file, bit-exact; a
    checkpoint hard-links the files instead of writing them; costs one params write per
    step and one read per sampling step; rl.learner.snapshots). rollout_devices:
    devices given to the sampler in threaded mode (None: half of them when there are
    several, 0 when there is one: rollout and training share it). join_timeout_s: how long
    shutdown waits for the producer thread. backend "local" (the sampler in this process)
    | "ray" (the sampling done by `rollout_workers` Ray actors, on the deterministic
    schedule (rl.loops.ray_workers) or streaming with the newest version under the buffer's
    admission rule (mode="threaded"; with rollout="continuous" each request picks up newer
    versions at its segment boundaries; rl.loops.ray_workers), each asking
    Ray for worker_cpus CPUs and worker_gpus GPUs (Ray then sets the actor's
    CUDA_VISIBLE_DEVICES), on the cluster at ray_address, or a local one started when it
    is ""); worker_affinity: CPU cores a worker process pins itself to (os.sched_setaffinity; () = as started), e.g. the learner
    under `taskset -c 0` and the worker on core 1 of a 2-core machine; sync_dtype: the
    dtype float32 params travel to the workers in (None: as they are; "bfloat16": half the
    bytes, the workers then sample with bf16-rounded weights, a deliberate train/inference
    mismatch the mismatch_* metrics show); worker_requests: requests one worker samples at
    once (threads of the actor; more than 1 pays when sampling waits on tools, not on the
    cores), so up to rollout_workers × worker_requests steps are sampled together (and at
    most max_staleness ahead of the learner)."""

    max_staleness: int = 1
    mode: str = "threaded"
    stale_policy: str = "drop"
    stale_weight: float = 0.5
    rollout: str = "static"
    over_provision: float = 1.5
    mask_offpolicy_prefix: bool = False
    proximal: str = "current"
    ewma_beta: float = 0.9
    snapshot_capacity: int | None = None
    snapshot_store: str = "memory"
    rollout_devices: int | None = None
    join_timeout_s: float = 30.0
    backend: str = "local"
    rollout_workers: int = 1
    ray_address: str = ""
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    worker_affinity: tuple[int, ...] = ()
    sync_dtype: str | None = None
    worker_requests: int = 1

    def __post_init__(self):
        k = self.max_staleness
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"AsyncConfig.max_staleness must be an int >= 0, got {k!r}")
        for name, allowed in (("mode", MODES), ("stale_policy", STALE_POLICIES),
                              ("rollout", ROLLOUTS), ("proximal", PROXIMAL),
                              ("snapshot_store", SNAPSHOT_STORES), ("backend", BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"AsyncConfig.{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        if self.mode == "deterministic" and self.rollout == "continuous":
            raise ValueError("AsyncConfig.rollout='continuous' needs mode='threaded' (the "
                             "deterministic mode samples each batch in one go with the params "
                             "of version v - k); use rollout='static' or 'april'")
        AprilConfig(over_provision=self.over_provision,
                    mask_offpolicy_prefix=self.mask_offpolicy_prefix)  # validates both
        if self.mask_offpolicy_prefix and self.rollout != "april":
            raise ValueError("AsyncConfig.mask_offpolicy_prefix needs rollout='april'")
        if isinstance(self.stale_weight, bool) or not isinstance(self.stale_weight, (int, float)) \
                or not (0.0 <= self.stale_weight <= 1.0):
            raise ValueError(f"AsyncConfig.stale_weight must be in [0, 1], got {self.stale_weight}")
        if isinstance(self.ewma_beta, bool) or not isinstance(self.ewma_beta, (int, float)) \
                or not (0.0 <= self.ewma_beta < 1.0):
            raise ValueError(f"AsyncConfig.ewma_beta must be in [0, 1), got {self.ewma_beta}")
        cap = self.snapshot_capacity
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < k + 1):
            raise ValueError(f"AsyncConfig.snapshot_capacity must be an int >= max_staleness + 1 "
                             f"= {k + 1} (the ring must hold every admissible version), got {cap!r}")
        if self.snapshot_store == "disk" and self.mode != "deterministic":
            raise ValueError("AsyncConfig.snapshot_store='disk' needs mode='deterministic' (the "
                             "mode that samples from the ring and saves it with each "
                             "checkpoint); use snapshot_store='memory' in threaded mode")
        if self.proximal == "exact" and self.stale_policy != "drop":
            raise ValueError("AsyncConfig.proximal='exact' needs stale_policy='drop': down-weighted "
                             "stale tokens can be older than any snapshot in the ring")
        r = self.rollout_devices
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ValueError(f"AsyncConfig.rollout_devices must be None or an int >= 0, got {r!r}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"AsyncConfig.join_timeout_s must be > 0, got {self.join_timeout_s}")
        self._check_ray()

    def _check_ray(self) -> None:
        n = self.rollout_workers
        for name in ("rollout_workers", "worker_requests"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"AsyncConfig.{name} must be an int >= 1, got {x!r}")
        for name in ("worker_cpus", "worker_gpus"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0:
                raise ValueError(f"AsyncConfig.{name} must be a number >= 0, got {x!r}")
        object.__setattr__(self, "worker_affinity", tuple(self.worker_affinity))
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                   for c in self.worker_affinity):
            raise ValueError(f"AsyncConfig.worker_affinity must be CPU core ids (ints >= 0), "
                             f"got {self.worker_affinity!r}")
        if self.sync_dtype not in (None, "bfloat16"):
            raise ValueError(f"AsyncConfig.sync_dtype must be None or 'bfloat16', got "
                             f"{self.sync_dtype!r}")
        if self.backend != "ray":
            if n != 1 or self.worker_requests != 1 or self.ray_address or self.sync_dtype:
                raise ValueError("AsyncConfig.rollout_workers / worker_requests / ray_address "
                                 "/ sync_dtype are for backend='ray' (--async-backend ray)")
            return
        if self.rollout == "april":
            raise ValueError("AsyncConfig.backend='ray' runs static rollouts (--rollout "
                             "static: the deterministic schedule or streaming, --async-mode "
                             "threaded) or, streaming, continuous ones (--rollout continuous: "
                             "in-flight weight updates); APRIL rounds on Ray are not built "
                             "yet (their unfinished groups live with one sampler)")

    @property
    def ring_capacity(self) -> int:
        return self.snapshot_capacity or self.max_staleness + 2

    @property
    def resident_snapshots(self) -> int:
        """How many ring versions are held in memory at most (rl.run.plan's estimate)."""
        return self.ring_capacity if self.snapshot_store == "memory" else min(self.ring_capacity, 2)
