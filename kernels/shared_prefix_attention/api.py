"""The one public entry point: `shared_prefix_attention` (validates, then dispatches)."""
from __future__ import annotations

from kernels.dispatch import dispatch
from kernels.shared_prefix_attention.config import BlockSizes
from kernels.shared_prefix_attention.inputs import (
    check_dims, normalize_lengths, normalize_scale)
from kernels.shared_prefix_attention.mosaic import shared_prefix_attention_mosaic
from kernels.shared_prefix_attention.pallas import shared_prefix_attention_pallas
from kernels.shared_prefix_attention.reference import shared_prefix_attention_reference
from kernels.shared_prefix_attention.xla import shared_prefix_attention_xla


def shared_prefix_attention(
    q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp,
    *,
    prompt_lengths=None,
    resp_lengths=None,
    sm_scale: float | None = None,
    impl: str | None = None,
    block_sizes: BlockSizes | None = None,
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
      impl: "reference" | "xla" | "pallas" | "pallas_triton" | "pallas_mosaic" | None
        (kernels.dispatch: None = Triton when lowered for GPU, Mosaic for TPU, XLA else).
      block_sizes: Pallas tile sizes (`BlockSizes`); ignored by the other impls.
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

    def triton(*a, interpret):
        return shared_prefix_attention_pallas(*a, scale, block_sizes=block_sizes,
                                              interpret=interpret)

    def mosaic(*a, interpret):
        return shared_prefix_attention_mosaic(*a, scale, block_sizes=block_sizes,
                                              interpret=interpret)

    # the scale is a static float: it stays out of platform_dependent's operands
    return dispatch(args, impl, interpret,
                    reference=lambda *a: shared_prefix_attention_reference(*a, scale),
                    xla=lambda *a: shared_prefix_attention_xla(*a, scale),
                    triton=triton, mosaic=mosaic)
