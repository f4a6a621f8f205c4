"""How the host process's C allocator hands memory back: a run's resident peak on CPU.

    from rl.runtime.host_memory import apply_malloc_policy
    apply_malloc_policy("lean")        # True: glibc's malloc now returns freed blocks at once

On CPU, XLA's buffers (parameters, optimizer moments, gradients, activations) come from the
process's malloc. glibc's malloc serves a block of at least its *mmap threshold* with its
own mmap, which free() hands back to the kernel; smaller blocks come from heaps ("arenas",
up to 8 per core, one per thread that needed one) whose freed space stays resident until
the heap's top is free. The threshold starts at 128 KiB and rises, each time such a block
is freed, to that block's size (up to 32 MiB): after the first learner step, most of a
step's temporaries are carved from the heaps, and the process's resident peak becomes the
sum of every arena's high-water mark rather than what is live.

Policies (LoopConfig.host_malloc):
  default   leave the allocator as the process started (its environment's MALLOC_*
            variables, if any, still apply)
  lean      mallopt: M_MMAP_THRESHOLD = 64 KiB (fixed: the dynamic rise is off),
            M_TRIM_THRESHOLD = 128 KiB, M_ARENA_MAX = 2. Every block of >= 64 KiB is its own
            mapping and leaves the resident set when freed. The cost: a fresh mapping is
            zero-filled page by page on first touch (more minor page faults and system time).

Measured on the smollm2-rg step with remat and a 256-token head chunk, side by side
(docs/results/learner-memory.md): 4.37-4.44 GB per step with "default", 3.90-3.94 GB with
"lean", the same rewards (the allocator never changes a computed value), no visible wall
cost, 1.13x the process's CPU seconds (system time).

Also here: `release_cycles()`, gc.collect() at the points where jax has just traced and
compiled outside the timed steps (after the run's model load, at the end of each eval;
a collection inside a step would land in the next step's wall time). Tracing leaves reference
cycles (tracers, jaxpr equations) that keep arrays alive -- the params-sized intermediates
of the traced function among them -- until Python's cyclic collector runs, which for
long-lived objects can be many steps later. Measured: after SmolLM2's init_params the
cycles held 194 arrays (708 MB) and the process 2.96 GB resident, 0.81 GB after one
gc.collect(); after a compiling 64-row sampler call, ~1 GB.

A leaf module: the standard library only.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

MALLOC_POLICIES = ("default", "lean")

# glibc's <malloc.h> parameter numbers (stable ABI since glibc 2.x)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

LEAN = {M_MMAP_THRESHOLD: 64 << 10, M_TRIM_THRESHOLD: 128 << 10, M_ARENA_MAX: 2}


@functools.lru_cache(maxsize=1)
def glibc_mallopt():
    """glibc's mallopt(param, value) -> int, or None where the C library has none (macOS,
    musl): the policies are glibc's."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def check_malloc_policy(policy: str) -> None:
    """ValueError (what to change) for a policy that is unknown or that this platform's C
    library cannot apply; call before anything expensive."""
    if policy not in MALLOC_POLICIES:
        raise ValueError(f"host_malloc must be one of {MALLOC_POLICIES}, got {policy!r}")
    if policy != "default" and glibc_mallopt() is None:
        raise ValueError(f"host_malloc={policy!r} needs glibc's mallopt, which this platform's C "
                         "library lacks; set loop.host_malloc='default'")


def apply_malloc_policy(policy: str) -> bool:
    """Set the process's allocator to `policy` (module docstring). True when it changed
    something, False for "default"; ValueError as check_malloc_policy, RuntimeError if
    glibc refuses a parameter. The setting lasts for the process (it is not undone)."""
    check_malloc_policy(policy)
    if policy == "default":
        return False
    mallopt = glibc_mallopt()
    for param, value in LEAN.items():
        if mallopt(param, value) != 1:  # mallopt returns 1 on success
            raise RuntimeError(f"glibc refused mallopt({param}, {value}); run with "
                               "loop.host_malloc='default'")
    return True


def release_cycles() -> int:
    """Collect the reference cycles tracing and compiling leave behind (module docstring),
    so the arrays they hold are freed now rather than at Python's next full collection.
    Returns the number of unreachable objects found. Costs a full collection (~0.1 s)."""
    return gc.collect()
