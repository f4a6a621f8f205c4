"""Tuned launch configs per device kind, read from `tuned/<device>.json`, and the choice of
the config a call runs with (tuned if a table has it, defaults otherwise; both made to fit
the chip's shared memory).

A table is written by `python -m experiments.bench.accelerator --parts tune` on the GPU
it describes (never by hand for a chip nobody measured). Format:

    {"device_kind": "NVIDIA H100 80GB HBM3", "jax_version": "0.11.2", "date": "...",
     "entries": [{"dtype": "bfloat16", "head_dim": 128,
                  "triton": {"fwd_prompt": {"block_q": 128, "block_k": 64,
                                            "num_warps": 4, "num_stages": 3}, ...},
                  "split": {"joint_prompt": false}}, ...]}

Every key of an entry but dtype and head_dim is optional; launches a table leaves out keep
their defaults. The file name is `device_file_name(device_kind)`.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels.shared_prefix_attention.config import LAUNCHES, BlockSizes, LaunchConfig
from kernels.shared_prefix_attention.smem import HOPPER_SMEM_BYTES, fit_block_sizes, padded_head_dim
from kernels.shared_prefix_attention.split import SplitOptions

TUNED_DIR = Path(__file__).parent / "tuned"


def device_file_name(device_kind: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3.json"."""
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") + ".json"


def local_gpu_kind() -> str | None:
    """The device kind of this process's first GPU, None without one."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover - no backend at all
        return None
    return dev.device_kind if dev.platform == "gpu" else None


@functools.lru_cache(maxsize=16)
def _read_table(path: str) -> tuple:
    """Entries of a table file as ((dtype, head_dim), BlockSizes | None, SplitOptions | None)
    tuples; () when the file does not exist. A malformed file raises ValueError."""
    file = Path(path)
    if not file.exists():
        return ()
    try:
        table = json.loads(file.read_text())
        out = []
        for entry in table["entries"]:
            key = (jnp.dtype(entry["dtype"]).name, int(entry["head_dim"]))
            block_sizes = None
            if entry.get("triton"):
                unknown = set(entry["triton"]) - set(LAUNCHES)
                if unknown:
                    raise ValueError(f"unknown launches {sorted(unknown)}")
                block_sizes = BlockSizes().with_launches(
                    {name: LaunchConfig(**cfg) for name, cfg in entry["triton"].items()})
            split = SplitOptions(**entry["split"]) if entry.get("split") else None
            out.append((key, block_sizes, split))
        return tuple(out)
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed tuned table {file}: {type(e).__name__}: {e}") from e


def tuned_entry(device_kind: str | None, dtype, head_dim: int,
                directory: Path | str = TUNED_DIR):
    """(BlockSizes | None, SplitOptions | None) tuned for this device, dtype and head dim;
    (None, None) without a table or an entry."""
    if not device_kind:
        return None, None
    path = Path(directory) / device_file_name(device_kind)
    key = (jnp.dtype(dtype).name, int(head_dim))
    for entry_key, block_sizes, split in _read_table(str(path)):
        if entry_key == key:
            return block_sizes, split
    return None, None


def default_block_sizes(dtype, head_dim: int) -> BlockSizes:
    """Untuned defaults: forward 128x128, backward 64x64, 2 stages; for fp32 at padded head
    dims >= 256 the forward query tile halves (its fp32 accumulator and query tile
    would otherwise fill the register file)."""
    if jnp.dtype(dtype).itemsize >= 4 and padded_head_dim(head_dim) >= 256:
        return BlockSizes(block_q=64)
    return BlockSizes()


def choose_block_sizes(dtype, head_dim: int, block_sizes: BlockSizes | None = None, *,
                       device_kind: str | None = None, directory: Path | str = TUNED_DIR,
                       limit: int = HOPPER_SMEM_BYTES) -> BlockSizes:
    """The Triton config a call runs with: the caller's `block_sizes`, else the tuned table's
    entry for `device_kind`, else `default_block_sizes`; then shrunk until every launch
    fits `limit` bytes of shared memory (`smem.fit_block_sizes`)."""
    if block_sizes is None:
        block_sizes = tuned_entry(device_kind, dtype, head_dim, directory)[0]
    if block_sizes is None:
        block_sizes = default_block_sizes(dtype, head_dim)
    return fit_block_sizes(block_sizes, head_dim, dtype, limit)


def choose_split_options(dtype, head_dim: int, *, device_kind: str | None = None,
                         directory: Path | str = TUNED_DIR) -> SplitOptions:
    """The split design's knobs: the tuned table's entry, else `SplitOptions()`."""
    split = tuned_entry(device_kind, dtype, head_dim, directory)[1]
    return split or SplitOptions()
