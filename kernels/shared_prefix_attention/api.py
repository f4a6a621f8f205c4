"""The one public entry point: `shared_prefix_attention` (validates, then dispatches)."""
from __future__ import annotations

from kernels.dispatch import dispatch
from kernels.shared_prefix_attention.config import BlockSizes
from kernels.shared_prefix_attention.cudnn import CUDNN_FLASH, cudnn_supports
from kernels.shared_prefix_attention.flash_xla import XLA_FLASH
from kernels.shared_prefix_attention.inputs import check_dims, normalize_lengths, normalize_scale
from kernels.shared_prefix_attention.mosaic import shared_prefix_attention_mosaic
from kernels.shared_prefix_attention.pallas import shared_prefix_attention_pallas
from kernels.shared_prefix_attention.reference import shared_prefix_attention_reference
from kernels.shared_prefix_attention.split import SplitOptions, shared_prefix_attention_split
from kernels.shared_prefix_attention.tuned import (
    choose_block_sizes,
    choose_split_options,
    local_gpu_kind,
)
from kernels.shared_prefix_attention.xla import shared_prefix_attention_xla

SPLIT_IMPLS = ("split_xla", "split_cudnn")


def shared_prefix_attention(
    q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp,
    *,
    prompt_lengths=None,
    resp_lengths=None,
    sm_scale: float | None = None,
    impl: str | None = None,
    block_sizes: BlockSizes | None = None,
    split_options: SplitOptions | None = None,
    interpret: bool | None = None,
):
    """Attention for a group of N responses that share one prompt (DualKV packing).

    Prompt query i attends causally to valid prompt keys 0..i. Response n's query j
    attends to all valid prompt keys and to its own response keys 0..j; responses never
    see each other. Equal to running N copies of [prompt, resp_n] through causal
    attention, without repeating the prompt. Softmax in fp32; outputs in the input dtype.
    Query rows beyond the lengths come out as zeros and get zero gradient.

    Args:
      q_prompt: `[groups, P, heads, head_dim]`.
      k_prompt, v_prompt: `[groups, P, kv_heads, head_dim]`; heads % kv_heads == 0.
      q_resp: `[groups, N, R, heads, head_dim]`.
      k_resp, v_resp: `[groups, N, R, kv_heads, head_dim]`.
      prompt_lengths: `[groups]` int, valid prompt tokens (right padding); None = P.
      resp_lengths: `[groups, N]` int, valid response tokens; None = R. Concrete lengths
        outside [0, P] / [0, R] raise; traced ones are clipped into range.
      sm_scale: logit scale, default 1/sqrt(head_dim).
      impl: None | "reference" | "xla" | "pallas" | "pallas_triton" | "pallas_mosaic" |
        "split_xla" | "split_cudnn". None picks by the platform LOWERED for: on "cuda" the
        split design on cuDNN where cuDNN takes the dtype and head dim (bf16 / fp16,
        head_dim a multiple of 8 up to 128, 256 on Hopper), else the fused Triton
        kernel (fp32, other head dims, ROCm); Mosaic on TPU; XLA elsewhere (CPU).
        "split_xla" is the split design with XLA flash calls (every platform, the
        design's exact twin); "split_cudnn" forces cuDNN (lowers for cuda only).
      block_sizes: Pallas tiles (`BlockSizes`); None = the device's tuned table
        (`kernels/shared_prefix_attention/tuned/`), else defaults. Triton configs are
        shrunk until each launch fits the shared memory (`smem.py`). Only Pallas impls.
      split_options: knobs of the split design (`SplitOptions`); None = tuned, else
        defaults. Only split impls (and impl=None on cuDNN).
      interpret: Pallas interpret mode; None = compiled on the kernel's platform and
        interpreted elsewhere. Ignored by the other impls.

    Returns:
      (o_prompt `[groups, P, heads, head_dim]`, o_resp `[groups, N, R, heads, head_dim]`).
    """
    dims = check_dims(q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp)
    prompt_lengths, resp_lengths = normalize_lengths(prompt_lengths, resp_lengths, dims)
    scale = normalize_scale(sm_scale, dims.head_dim)
    args = (q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp,
            prompt_lengths, resp_lengths)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(
            f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
    if split_options is not None and not isinstance(split_options, SplitOptions):
        raise ValueError(
            f"split_options must be a SplitOptions or None, got {type(split_options).__name__}")
    dtype = q_prompt.dtype
    device = local_gpu_kind()
    triton_sizes = choose_block_sizes(dtype, dims.head_dim, block_sizes, device_kind=device)
    options = split_options or choose_split_options(dtype, dims.head_dim, device_kind=device)

    def triton(*a, interpret):
        return shared_prefix_attention_pallas(*a, scale, block_sizes=triton_sizes,
                                              interpret=interpret)

    def mosaic(*a, interpret):
        return shared_prefix_attention_mosaic(*a, scale, block_sizes=block_sizes,
                                              interpret=interpret)

    def split(backend):
        return lambda *a: shared_prefix_attention_split(*a, scale, backend=backend,
                                                        options=options)

    # on cuda, impl=None: the split design on cuDNN where cuDNN takes the inputs
    cuda = split(CUDNN_FLASH) if cudnn_supports(dtype, dims.head_dim) else None
    # the scale is a static float: it stays out of platform_dependent's operands
    return dispatch(args, impl, interpret,
                    reference=lambda *a: shared_prefix_attention_reference(*a, scale),
                    xla=lambda *a: shared_prefix_attention_xla(*a, scale),
                    triton=triton, mosaic=mosaic,
                    extra={"split_xla": split(XLA_FLASH), "split_cudnn": split(CUDNN_FLASH)},
                    cuda=cuda)
