"""Tile sizes and GPU launch knobs for the Pallas shared-prefix attention kernels."""
from __future__ import annotations

import dataclasses


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the Pallas kernels (ignored by the reference and XLA paths).

    All sizes must be powers of two (the Triton lowering needs power-of-two tiles);
    on GPU use at least 16 (the smallest Triton matmul tile). Each size is clamped to
    the next power of two of the sequence it tiles, so small inputs need no tuning.

    Attributes:
      block_q: query rows per program in the forward kernels.
      block_k: key rows per inner-loop step in the forward kernels.
      block_q_bwd: query rows per step in the backward kernels (dq tile / dk,dv loop).
      block_k_bwd: key rows per step in the backward kernels (dk,dv tile / dq loop).
      num_warps: Triton warps per program; None picks 4 for small tiles, else 8.
      num_stages: Triton software-pipelining stages.
    """

    block_q: int = 128
    block_k: int = 128
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2

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
