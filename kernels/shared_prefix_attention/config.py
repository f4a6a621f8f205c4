"""Tile sizes and GPU launch knobs for the Pallas shared-prefix attention kernels.

The Triton kernel makes six launches (`LAUNCHES`); each has its own `LaunchConfig`:
query-tile rows, key-tile rows, warps and pipeline stages. `BlockSizes` is the user's
handle: four tile sizes shared by the forward / backward launches, plus optional
per-launch `overrides` (what a tuned table sets, see `tuned.py`).
"""
from __future__ import annotations

import dataclasses

# the six Pallas-Triton launches, in execution order (names as in pallas.py)
LAUNCHES = ("fwd_prompt", "fwd_resp", "dq_prompt", "dq_resp", "dkdv_resp", "dkdv_prompt")
FORWARD_LAUNCHES = LAUNCHES[:2]


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def default_num_warps(block_q: int, block_k: int) -> int:
    """8 warps for tiles of at least 128x128, else 4 (a 64-row tile has too little work
    for 8 warps)."""
    return 8 if block_q * block_k >= 128 * 128 else 4


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Tiles and Triton knobs of one launch.

    Attributes:
      block_q: query rows per tile (the program's tile in fwd / dq launches, the inner
        loop's step in dk/dv launches).
      block_k: key rows per tile (the inner loop's step in fwd / dq launches, the program's
        tile in dk/dv launches).
      num_warps: Triton warps per program; None = `default_num_warps`.
      num_stages: Triton software-pipelining stages of the inner loop (>= 1).
    """

    block_q: int
    block_k: int
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_power_of_two(value):
                raise ValueError(
                    f"LaunchConfig.{name} must be a positive power of two, got {value!r}")
        if self.num_warps is not None and (
                not isinstance(self.num_warps, int) or not _is_power_of_two(self.num_warps)):
            raise ValueError(
                f"LaunchConfig.num_warps must be None or a power of two, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(
                f"LaunchConfig.num_stages must be a positive int, got {self.num_stages!r}")

    @property
    def warps(self) -> int:
        """The warps this launch runs with."""
        return self.num_warps or default_num_warps(self.block_q, self.block_k)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the Pallas kernels (ignored by the reference, XLA and split paths).

    All sizes must be powers of two (the Triton lowering needs power-of-two tiles);
    on GPU use at least 16 (the smallest Triton matmul tile). Each size is clamped to
    the next power of two of the sequence it tiles, so small inputs need no tuning.

    Attributes:
      block_q: query rows per program in the forward kernels.
      block_k: key rows per inner-loop step in the forward kernels.
      block_q_bwd: query rows per step in the backward kernels (dq tile / dk,dv loop).
      block_k_bwd: key rows per step in the backward kernels (dk,dv tile / dq loop).
      num_warps: Triton warps per program; None = `default_num_warps` of each launch's
        tiles (4 below 128x128, else 8).
      num_stages: Triton software-pipelining stages.
      overrides: `((launch name, LaunchConfig), ...)` replacing the derived config of the
        named launches (names in `LAUNCHES`).
    """

    block_q: int = 128
    block_k: int = 128
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2
    overrides: tuple[tuple[str, LaunchConfig], ...] = ()

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_power_of_two(value):
                raise ValueError(
                    f"BlockSizes.{name} must be a positive power of two, got {value!r}"
                )
        if self.num_warps is not None and (
            not isinstance(self.num_warps, int) or not _is_power_of_two(self.num_warps)
        ):
            raise ValueError(
                f"BlockSizes.num_warps must be None or a power of two, got {self.num_warps!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(
                f"BlockSizes.num_stages must be a positive int, got {self.num_stages!r}"
            )
        for item in self.overrides:
            if (not isinstance(item, tuple) or len(item) != 2 or item[0] not in LAUNCHES
                    or not isinstance(item[1], LaunchConfig)):
                raise ValueError("BlockSizes.overrides must be (launch name in "
                                 f"{LAUNCHES}, LaunchConfig) pairs, got {item!r}")

    def launch(self, name: str) -> LaunchConfig:
        """The config of launch `name` (an override, else derived from the four sizes)."""
        if name not in LAUNCHES:
            raise ValueError(f"unknown launch {name!r}; launches are {LAUNCHES}")
        for launch_name, cfg in self.overrides:
            if launch_name == name:
                return cfg
        if name in FORWARD_LAUNCHES:
            return LaunchConfig(self.block_q, self.block_k, self.num_warps, self.num_stages)
        return LaunchConfig(self.block_q_bwd, self.block_k_bwd, self.num_warps,
                            self.num_stages)

    def with_launches(self, configs: dict[str, LaunchConfig]) -> BlockSizes:
        """A copy whose overrides set every launch in `configs` (others unchanged)."""
        merged = {name: self.launch(name) for name, _ in self.overrides}
        merged.update(configs)
        return dataclasses.replace(
            self, overrides=tuple((name, merged[name]) for name in LAUNCHES if name in merged))
