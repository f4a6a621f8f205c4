"""Shared memory of each Pallas-Triton launch, and shrinking configs until they fit.

Model (what Triton's software pipeliner allocates): the tiles a launch loads inside its
inner loop are multi-buffered, one buffer per pipeline stage, so

    requested = num_stages * (bytes of the tiles loaded per loop step)

  fwd_prompt, fwd_resp, dq_prompt, dq_resp   K and V tiles `[block_k, Dp]` in the input dtype;
  dkdv_resp, dkdv_prompt                     Q and dO tiles `[block_q, Dp]` in the input
                                             dtype, lse and delta rows `[block_q]` float32,
with Dp = head_dim rounded up to a power of two (the kernel pads it). This reproduces the
measured failure on an H200: fp32, head_dim 128, forward tiles 128x128, 2 stages ->
2 * 2 * 128 * 128 * 4 = 262,144 bytes requested, 232,448 available.
A config FITS when requested + scratch <= the limit, the scratch (one `[block_q, block_k]`
tile in the input dtype) leaving room for the layout conversions Triton stages through
shared memory, which the model above does not count.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels.shared_prefix_attention.config import LAUNCHES, BlockSizes, LaunchConfig

HOPPER_SMEM_BYTES = 232_448     # per-block limit of sm_90 (227 KiB)
_FP32 = 4
_MIN_TILE = 16                  # the smallest Triton matmul tile


def padded_head_dim(head_dim: int) -> int:
    return 1 << max(0, (head_dim - 1).bit_length())


def _loop_tiles(launch: str) -> str:
    """Which tile the inner loop of `launch` steps over: "k" or "q"."""
    if launch not in LAUNCHES:
        raise ValueError(f"unknown launch {launch!r}; launches are {LAUNCHES}")
    return "q" if launch.startswith("dkdv") else "k"


def launch_shared_memory(launch: str, cfg: LaunchConfig, head_dim: int, dtype) -> int:
    """Bytes of shared memory the pipeliner requests for `launch` under `cfg`."""
    item = jnp.dtype(dtype).itemsize
    dp = padded_head_dim(head_dim)
    if _loop_tiles(launch) == "k":
        per_stage = 2 * cfg.block_k * dp * item
    else:
        per_stage = 2 * cfg.block_q * dp * item + 2 * cfg.block_q * _FP32
    return cfg.num_stages * per_stage


def launch_fits(launch: str, cfg: LaunchConfig, head_dim: int, dtype,
                limit: int = HOPPER_SMEM_BYTES) -> bool:
    scratch = cfg.block_q * cfg.block_k * jnp.dtype(dtype).itemsize
    return launch_shared_memory(launch, cfg, head_dim, dtype) + scratch <= limit


def fit_launch(launch: str, cfg: LaunchConfig, head_dim: int, dtype,
               limit: int = HOPPER_SMEM_BYTES) -> LaunchConfig:
    """`cfg` if it fits, else the first that fits of: the loop's tile halved (down to 16),
    then fewer stages (down to 1), then the program's tile halved (down to 16).

    Raises ValueError when even 16x16 tiles with one stage do not fit (head dims far
    beyond 256).
    """
    loop = _loop_tiles(launch)
    while not launch_fits(launch, cfg, head_dim, dtype, limit):
        loop_size = cfg.block_k if loop == "k" else cfg.block_q
        other = cfg.block_q if loop == "k" else cfg.block_k
        if loop_size > _MIN_TILE:
            change = {"block_k" if loop == "k" else "block_q": loop_size // 2}
        elif cfg.num_stages > 1:
            change = {"num_stages": cfg.num_stages - 1}
        elif other > _MIN_TILE:
            change = {"block_q" if loop == "k" else "block_k": other // 2}
        else:
            raise ValueError(
                f"no config of launch {launch} fits {limit} bytes of shared memory at "
                f"head_dim {head_dim}, dtype {jnp.dtype(dtype).name}")
        cfg = dataclasses.replace(cfg, **change)
    return cfg


def fit_block_sizes(block_sizes: BlockSizes, head_dim: int, dtype,
                    limit: int = HOPPER_SMEM_BYTES) -> BlockSizes:
    """`block_sizes` with every launch that does not fit replaced by its shrunk config
    (`fit_launch`); unchanged when all fit."""
    changed = {}
    for name in LAUNCHES:
        cfg = block_sizes.launch(name)
        fitted = fit_launch(name, cfg, head_dim, dtype, limit)
        if fitted != cfg:
            changed[name] = fitted
    return block_sizes.with_launches(changed) if changed else block_sizes
