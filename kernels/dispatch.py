"""Shared helpers for choosing a kernel implementation.

`impl` is one of "reference", "xla", "pallas" or None (= the platform default: Pallas
on GPU, XLA on CPU and TPU). The Pallas kernels are written for the GPU (Triton)
lowering; they run on CPU only in interpret mode, which is for testing, not speed, and
have not been ported to Mosaic TPU, so TPU defaults to the XLA path.
"""
from __future__ import annotations

import jax

IMPLS = ("reference", "xla", "pallas")


def default_impl() -> str:
    """The implementation used when a caller passes `impl=None`."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve_impl(impl: str | None) -> str:
    """Validate `impl` and replace None by the platform default."""
    if impl is None:
        return default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    return impl


def pallas_interpret_default() -> bool:
    """Pallas kernels must run in interpret mode on CPU."""
    return jax.default_backend() == "cpu"
