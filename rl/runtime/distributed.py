"""Multi-process runs through JAX's own runtime (`jax.distributed.initialize`).

One Python process per host (GPU cluster) or per TPU VM; every process runs the same
script. Each one samples its own share of the prompts, and the learner sees one global
batch whose rows live on the devices of the process that produced them:

    initialize_distributed(distributed_config(coordinator="10.0.0.1:1234", num_processes=2,
                                              process_id=0))   # before any other JAX call
    mesh = rl.runtime.mesh.make_mesh_preset("fsdp")  # over the devices of all processes
    offset, my_prompts = process_shard(prompts)  # contiguous slice; group ids stay global
    batch = global_batch(local_batch, mesh)      # a global jax.Array per field
    sampler_params = process_local(state.params) # full values, for a per-process sampler
    if is_main_process(): write results

Coordinates (RunConfig.distributed; on the command line the flags of
experiments.common.flags) or environment variables: coordinator HOST:PORT
(JAX_COORDINATOR_ADDRESS), num_processes K (JAX_NUM_PROCESSES), process_id I
(JAX_PROCESS_ID); a given value wins over the variable. auto=True calls
`jax.distributed.initialize()` with no arguments, so JAX detects the cluster itself (TPU
pod slices, SLURM, Open MPI).
On CPU the cross-process collectives use gloo.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence, TypeVar

import jax
from jax.experimental import multihost_utils

T = TypeVar("T")

ENV_VARS = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
            "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the coordinator is and who this process is. All None (and auto False) =
    a single-process run; auto = let JAX detect the cluster (TPU pods, SLURM)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    timeout_s: int = 300

    def __post_init__(self):
        given = [f for f in ("coordinator", "num_processes", "process_id")
                 if getattr(self, f) is not None]
        if self.auto:
            if given:
                raise ValueError("--distributed-auto lets JAX detect the cluster: do not also give "
                                 f"{', '.join('--' + g.replace('_', '-') for g in given)}")
            return
        if given and len(given) != 3:
            missing = sorted({"coordinator", "num_processes", "process_id"} - set(given))
            raise ValueError(
                "a multi-process run needs all of --coordinator, --num-processes and --process-id "
                f"(or {', '.join(ENV_VARS.values())}); missing: "
                f"{', '.join('--' + m.replace('_', '-') for m in missing)}")
        if self.coordinator is not None:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--coordinator must be HOST:PORT (port 1-65535), got "
                                 f"{self.coordinator!r}")
            for name in ("num_processes", "process_id"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ValueError(f"--{name.replace('_', '-')} must be an int, got {v!r}")
            if self.num_processes < 1:
                raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
            if not 0 <= self.process_id < self.num_processes:
                raise ValueError(f"--process-id must be in [0, --num-processes={self.num_processes}), "
                                 f"got {self.process_id}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) \
                or self.timeout_s < 1:
            raise ValueError(f"timeout_s must be an int >= 1, got {self.timeout_s!r}")

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator is not None


def distributed_config(coordinator: str | None = None, num_processes: int | None = None,
                       process_id: int | None = None, *, auto: bool = False,
                       timeout_s: int = 300, environ: dict[str, str] | None = None
                       ) -> DistributedConfig:
    """DistributedConfig from the given values, each missing one falling back to its JAX_*
    environment variable (ENV_VARS; ValueError for malformed values)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {"coordinator": coordinator, "num_processes": num_processes,
                              "process_id": process_id}
    for field, var in ENV_VARS.items():
        v = values[field]
        if v is None and env.get(var):
            v = env[var]
            if field != "coordinator":
                if not v.strip().lstrip("-").isdigit():
                    raise ValueError(f"environment variable {var} must be an int, got {v!r}")
                v = int(v)
        values[field] = v
    return DistributedConfig(**values, auto=auto, timeout_s=timeout_s)


def initialize_distributed(config: DistributedConfig | None = None) -> bool:
    """Join the multi-process run `config` describes (default: the JAX_* environment
    variables, distributed_config()) and check the coordinator agrees on the process count
    and this process's index. Call it before any other JAX computation. Returns True for a
    multi-process run, False (nothing done) for a single-process one. ValueError, before
    anything compiles, when the values are malformed or disagree with the coordinator."""
    config = distributed_config() if config is None else config
    if not config.enabled:
        return False
    if jax.distributed.is_initialized():
        _check_agreement(config)
        return True
    # CPU processes exchange collectives through gloo (GPU: NCCL, TPU: ICI need nothing).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.auto:
        jax.distributed.initialize(initialization_timeout=config.timeout_s)
    else:
        jax.distributed.initialize(coordinator_address=config.coordinator,
                                   num_processes=config.num_processes,
                                   process_id=config.process_id,
                                   initialization_timeout=config.timeout_s)
    _check_agreement(config)
    return True


def _check_agreement(config: DistributedConfig) -> None:
    if config.auto:
        return
    count, index = jax.process_count(), jax.process_index()
    if count != config.num_processes or index != config.process_id:
        jax.distributed.shutdown()
        raise ValueError(
            f"this process was launched with --num-processes {config.num_processes} "
            f"--process-id {config.process_id}, but the coordinator at {config.coordinator} "
            f"runs {count} processes and calls this one {index}; launch every process with the "
            "same --num-processes and a distinct --process-id in [0, K)")


def is_main_process() -> bool:
    """True on process 0 (the one that logs and writes result files)."""
    return jax.process_index() == 0


def process_shard(items: Sequence[T], *, process_index: int | None = None,
                  process_count: int | None = None) -> tuple[int, Sequence[T]]:
    """(offset, items[offset : offset + len/K]): process i's contiguous share of a global
    list. Keep the offset: numbering groups by their global index (offset + local index)
    makes every per-sample rng key the same as in a one-process run. ValueError if the
    items do not split evenly."""
    i = jax.process_index() if process_index is None else process_index
    k = jax.process_count() if process_count is None else process_count
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not 0 <= i < k:
        raise ValueError(f"process_index must be in [0, process_count) with process_count >= 1, "
                         f"got {i} of {k}")
    n = len(items)
    if n % k:
        raise ValueError(f"{n} items do not split evenly over {k} processes; make the global "
                         f"count (e.g. prompts per step) a multiple of {k}")
    share = n // k
    return i * share, items[i * share:(i + 1) * share]


def process_local(tree: Any) -> Any:
    """`tree` as this process's own computations can use it (e.g. params for a
    per-process sampler): unchanged when every leaf is fully addressable (one process),
    else every leaf's full value gathered to host numpy on every process. The gather is a
    collective: in a multi-process run every process must call it."""
    leaves = jax.tree.leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return tree
    return multihost_utils.process_allgather(tree, tiled=True)
