"""Choosing a kernel implementation by the platform a program is LOWERED for.

`impl` is one of:
  None             the platform default: Pallas-Triton on GPU (cuda, rocm), Pallas-Mosaic on
                   TPU, XLA elsewhere (CPU);
  "reference"      the readable naive twin;
  "xla"            the fast pure-JAX path (every platform);
  "pallas"         the platform's Pallas kernel: Triton on GPU, Mosaic on TPU, and the Triton
                   kernel in interpret mode elsewhere (CPU, for tests);
  "pallas_triton"  the Triton-style kernel (compiled on GPU, interpreted elsewhere);
  "pallas_mosaic"  the Mosaic-TPU kernel (compiled on TPU, interpreted elsewhere with
                   `pltpu.InterpretParams()`).
A kernel may add impls of its own (`extra`, e.g. shared-prefix attention's split design)
and its own NVIDIA default (`cuda`: what impl=None runs when lowered for "cuda"; ROCm
keeps the Triton kernel).

The choice is made with `jax.lax.platform_dependent`, so it follows the platform that
`jax.jit(...).lower` / `jax.export.export(..., platforms=[...])` lowers for, not
`jax.default_backend()` of the host that traces: a CPU host exporting for "cuda" gets the
Triton kernels, for "tpu" the Mosaic ones. Every branch is traced; only the lowered
platform's branch is compiled. `interpret=None` means "compiled on the kernel's own
platform, interpreted elsewhere"; True forces interpret mode, False forces compilation.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

import jax

IMPLS = ("reference", "xla", "pallas", "pallas_triton", "pallas_mosaic")
GPU_PLATFORMS = ("cuda", "rocm")

# Custom-call targets of compiled Pallas kernels in lowered modules (for jax.export's
# disabled_checks and for tests that inspect which kernel a program contains).
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CUSTOM_CALL = "tpu_custom_call"


def resolve_impl(impl: str | None, extra: tuple[str, ...] = ()) -> str | None:
    """Validate `impl` against IMPLS + `extra`; None stays None (= decided per lowering
    platform by `dispatch`)."""
    if impl is not None and impl not in IMPLS + tuple(extra):
        raise ValueError(f"impl must be one of {IMPLS + tuple(extra)} or None, got {impl!r}")
    return impl


def by_platform(*args, gpu: Callable, tpu: Callable, default: Callable,
                cuda: Callable | None = None):
    """`gpu(*args)` when lowered for cuda/rocm (`cuda(*args)` instead for cuda when given),
    `tpu(*args)` for tpu, else `default(*args)`."""
    return jax.lax.platform_dependent(*args, cuda=cuda or gpu, rocm=gpu, tpu=tpu,
                                      default=default)


def dispatch(args: tuple, impl: str | None, interpret: bool | None, *,
             reference: Callable, xla: Callable, triton: Callable, mosaic: Callable,
             extra: dict[str, Callable] | None = None, cuda: Callable | None = None):
    """Run one implementation of a kernel on `args`.

    `reference(*args)`, `xla(*args)`; `triton(*args, interpret=bool)` and
    `mosaic(*args, interpret=bool)` are the two Pallas kernels; `extra[name](*args)` are
    kernel-specific impls selected by name; `cuda(*args)`, when given, is what impl=None
    runs when lowered for "cuda". See the module docstring for `impl` and `interpret`.
    """
    extra = extra or {}
    impl = resolve_impl(impl, tuple(extra))
    if interpret is not None and not isinstance(interpret, bool):
        raise ValueError(f"interpret must be None, True or False, got {interpret!r}")
    if impl in extra:
        return extra[impl](*args)
    if impl == "reference":
        return reference(*args)
    if impl == "xla":
        return xla(*args)
    mosaic_only = impl == "pallas_mosaic"
    if interpret:   # interpret mode runs anywhere: no platform choice
        return (mosaic if mosaic_only else triton)(*args, interpret=True)
    gpu_kernel, tpu_kernel = partial(triton, interpret=False), partial(mosaic, interpret=False)
    elsewhere_kernel = mosaic if mosaic_only else triton
    elsewhere = partial(elsewhere_kernel, interpret=interpret is None)
    cuda_kernel = None
    if impl is None:
        elsewhere, cuda_kernel = xla, cuda
    elif impl == "pallas_triton":
        tpu_kernel = elsewhere
    elif mosaic_only:
        gpu_kernel = elsewhere
    return by_platform(*args, gpu=gpu_kernel, tpu=tpu_kernel, default=elsewhere,
                       cuda=cuda_kernel)


def lowered_kernels(module_text: str) -> dict[str, list[str]]:
    """Names of the compiled Pallas kernels in a lowered module's text, in order:
    {"triton": [...], "mosaic": [...]} (Triton calls carry `name = "..."` in their backend
    config, Mosaic calls `kernel_name = "..."`). For tests and benchmarks that check which
    kernels a program lowered for a platform holds."""
    found = {"triton": [], "mosaic": []}
    for line in module_text.splitlines():
        if TRITON_CUSTOM_CALL in line:
            found["triton"] += re.findall(r'\bname = "([^"]+)"', line)[:1]
        if MOSAIC_CUSTOM_CALL in line:
            found["mosaic"] += re.findall(r'kernel_name = "([^"]+)"', line)[:1]
    return found


def lowered_triton_launches(module_text: str) -> list[dict]:
    """The Triton launches of a lowered module, in order, as {"name", "num_warps",
    "num_stages"} (read from each call's backend config)."""
    found = []
    for line in module_text.splitlines():
        if TRITON_CUSTOM_CALL not in line:
            continue
        name = re.findall(r'\bname = "([^"]+)"', line)[:1]
        warps = re.findall(r"\bnum_warps = (\d+)", line)[:1]
        stages = re.findall(r"\bnum_stages = (\d+)", line)[:1]
        found.append({"name": name[0] if name else None,
                      "num_warps": int(warps[0]) if warps else None,
                      "num_stages": int(stages[0]) if stages else None})
    return found

