"""Shared-prefix attention for training (DualKV): reference, XLA, split (cascade) and
Pallas kernels (`pallas.py` for Triton / GPU, `mosaic.py` for Mosaic / TPU).

`shared_prefix_attention(q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp, ...)`
attends each group's prompt once and its N responses against [prompt, own response];
see `api.shared_prefix_attention` for the contract and which implementation runs where.
"""
from kernels.shared_prefix_attention.api import shared_prefix_attention
from kernels.shared_prefix_attention.config import BlockSizes, LaunchConfig
from kernels.shared_prefix_attention.mosaic import shared_prefix_attention_mosaic
from kernels.shared_prefix_attention.pallas import shared_prefix_attention_pallas
from kernels.shared_prefix_attention.reference import shared_prefix_attention_reference
from kernels.shared_prefix_attention.split import SplitOptions, shared_prefix_attention_split
from kernels.shared_prefix_attention.xla import shared_prefix_attention_xla

__all__ = [
    "BlockSizes",
    "LaunchConfig",
    "SplitOptions",
    "shared_prefix_attention",
    "shared_prefix_attention_mosaic",
    "shared_prefix_attention_pallas",
    "shared_prefix_attention_reference",
    "shared_prefix_attention_split",
    "shared_prefix_attention_xla",
]
