"""Every Pallas kernel lowers for "cuda" (Triton) and "tpu" (Mosaic) from this CPU host, and
shared-prefix attention's split design lowers for "cuda" onto cuDNN.

jax.export runs the whole Pallas -> Triton / Pallas -> Mosaic lowering for another
platform without its hardware, so unsupported ops, block shapes (the TPU tiling rule is
checked at lowering) and dtypes fail here. With impl=None the kernel must follow the
platform LOWERED FOR (kernels.dispatch), not jax.default_backend() (cpu here): the cuda
module holds exactly the Triton kernels (or, for shared-prefix attention in bf16 at head dims
cuDNN takes, exactly the cuDNN calls of the split design), the tpu module exactly the
Mosaic ones, and the cpu module neither. Shapes: ragged lengths are runtime inputs; the
static sizes include non-power-of-two P, R, N, heads and GQA ratios, in bf16 (and fp32).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from kernels.dispatch import (
    MOSAIC_CUSTOM_CALL,
    TRITON_CUSTOM_CALL,
    lowered_kernels,
    lowered_triton_launches,
)
from kernels.segment_decode import segment_decode_attention
from kernels.shared_prefix_attention import SplitOptions, shared_prefix_attention
from kernels.shared_prefix_attention.cudnn import CUDNN_CUSTOM_CALLS

ALLOW = [jax.export.DisabledSafetyCheck.custom_call(t)
         for t in (TRITON_CUSTOM_CALL, MOSAIC_CUSTOM_CALL) + CUDNN_CUSTOM_CALLS]
CUDNN_FWD, CUDNN_BWD = CUDNN_CUSTOM_CALLS
SPA_FWD = {"cuda": ["spa_fwd_prompt", "spa_fwd_resp"],
           "tpu": ["spa_mosaic_fwd_prompt", "spa_mosaic_fwd_resp"]}
SPA_BWD = {"cuda": ["spa_bwd_dq_prompt", "spa_bwd_dq_resp", "spa_bwd_dkdv_resp",
                    "spa_bwd_dkdv_prompt"],
           "tpu": ["spa_mosaic_bwd_dq_prompt", "spa_mosaic_bwd_dq_resp",
                   "spa_mosaic_bwd_dkdv_resp", "spa_mosaic_bwd_dkdv_prompt"]}
DECODE = {"cuda": ["segment_decode_prompt", "segment_decode_response"],
          "tpu": ["segment_decode_prompt_mosaic", "segment_decode_response_mosaic"]}


def lowered_text(fn, platform: str, *args) -> str:
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=ALLOW)(
        *args).mlir_module()


def cudnn_calls(text: str) -> list[str]:
    return re.findall(r"custom_call @(__cudnn\$\w+)", text)


def lowered(fn, platform: str, *args) -> dict[str, list[str]]:
    text = lowered_text(fn, platform, *args)
    found = lowered_kernels(text)
    return {"cuda": found["triton"], "tpu": found["mosaic"], "cudnn": cudnn_calls(text)}


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# (groups, N, P, R, heads, kv_heads, head_dim): SmolLM2-135M and Qwen2.5-0.5B head layouts
SPA_SHAPES = [(2, 3, 21, 13, 9, 3, 64), (1, 16, 100, 37, 14, 2, 64), (1, 4, 256, 128, 32, 8, 128)]


def spa_args(g, n, p, r, h, kvh, d, dtype=jnp.bfloat16):
    return (sds((g, p, h, d), dtype), sds((g, p, kvh, d), dtype), sds((g, p, kvh, d), dtype),
            sds((g, n, r, h, d), dtype), sds((g, n, r, kvh, d), dtype),
            sds((g, n, r, kvh, d), dtype), sds((g,), jnp.int32), sds((g, n), jnp.int32))


def spa_forward(impl=None, **kwargs):
    def fn(qp, kp, vp, qr, kr, vr, plen, rlen):
        return shared_prefix_attention(qp, kp, vp, qr, kr, vr, prompt_lengths=plen,
                                       resp_lengths=rlen, impl=impl, **kwargs)
    return fn


def spa_grad_of(impl=None, **kwargs):
    def grad(qp, kp, vp, qr, kr, vr, plen, rlen):
        def loss(*qkv):
            o_p, o_r = spa_forward(impl, **kwargs)(*qkv, plen, rlen)
            return (jnp.sum(o_p.astype(jnp.float32) ** 2)
                    + jnp.sum(o_r.astype(jnp.float32) ** 2))
        return jax.grad(loss, argnums=tuple(range(6)))(qp, kp, vp, qr, kr, vr)
    return grad


spa_grad = spa_grad_of()
NONE = {"cuda": [], "tpu": [], "cudnn": []}


@pytest.mark.parametrize("shape", SPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shared_prefix_default_on_cuda_is_the_split_design_on_cudnn(shape):
    """bf16 at head dims 64 / 128: three cuDNN forward calls (prompt causal, responses ->
    prompt, responses -> own), three backward calls, and no Triton kernel."""
    fwd = lowered(spa_forward(), "cuda", *spa_args(*shape))
    assert fwd == {**NONE, "cudnn": [CUDNN_FWD] * 3}
    bwd = lowered(spa_grad, "cuda", *spa_args(*shape))
    assert bwd == {**NONE, "cudnn": [CUDNN_FWD] * 3 + [CUDNN_BWD] * 3}


def test_shared_prefix_split_joint_prompt_lowers_to_two_cudnn_calls():
    args = spa_args(*SPA_SHAPES[1])
    joint = dict(split_options=SplitOptions(joint_prompt=True))
    for impl in (None, "split_cudnn"):
        text = lowered_text(spa_grad_of(impl, **joint), "cuda", *args)
        assert cudnn_calls(text) == [CUDNN_FWD] * 2 + [CUDNN_BWD] * 2
        assert "PADDING_CAUSAL" in text and lowered_kernels(text)["triton"] == []


@pytest.mark.parametrize("shape", SPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shared_prefix_triton_forward_and_backward_lower(shape):
    fwd = lowered(spa_forward("pallas_triton"), "cuda", *spa_args(*shape))
    assert fwd == {**NONE, "cuda": SPA_FWD["cuda"]}
    bwd = lowered(spa_grad_of("pallas_triton"), "cuda", *spa_args(*shape))
    assert sorted(bwd["cuda"]) == sorted(SPA_FWD["cuda"] + SPA_BWD["cuda"])
    assert bwd["tpu"] == [] and bwd["cudnn"] == []


@pytest.mark.parametrize("shape", SPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shared_prefix_mosaic_forward_and_backward_lower(shape):
    fwd = lowered(spa_forward(), "tpu", *spa_args(*shape))
    assert fwd == {**NONE, "tpu": SPA_FWD["tpu"]}
    bwd = lowered(spa_grad, "tpu", *spa_args(*shape))
    assert sorted(bwd["tpu"]) == sorted(SPA_FWD["tpu"] + SPA_BWD["tpu"])
    assert bwd["cuda"] == [] and bwd["cudnn"] == []


@pytest.mark.parametrize("dtype, head_dim", [(jnp.float32, 64), (jnp.float32, 128),
                                             (jnp.bfloat16, 60)])
def test_shared_prefix_default_on_cuda_takes_triton_where_cudnn_cannot(dtype, head_dim):
    """fp32, and head dims cuDNN rejects: the fused Triton kernel, 4 warps on tiles below
    128x128 (the backward's 64x64), 8 on the forward's 128x128."""
    args = spa_args(1, 4, 256, 128, 8, 2, head_dim, dtype=dtype)
    text = lowered_text(spa_grad, "cuda", *args)
    assert cudnn_calls(text) == []
    launches = lowered_triton_launches(text)
    assert sorted(x["name"] for x in launches) == sorted(SPA_FWD["cuda"] + SPA_BWD["cuda"])
    warps = {x["name"]: x["num_warps"] for x in launches}
    assert all(warps[name] == 4 for name in SPA_BWD["cuda"]), warps
    if dtype == jnp.bfloat16:
        assert all(warps[name] == 8 for name in SPA_FWD["cuda"]), warps


def test_shared_prefix_lowers_in_float32_and_cpu_keeps_xla():
    args = spa_args(*SPA_SHAPES[0], dtype=jnp.float32)
    for platform in ("cuda", "tpu"):
        assert sorted(lowered(spa_grad, platform, *args)[platform]) == sorted(
            SPA_FWD[platform] + SPA_BWD[platform])
    assert lowered(spa_grad, "cpu", *args) == NONE
    assert lowered(spa_grad, "cpu", *spa_args(*SPA_SHAPES[0])) == NONE   # bf16 too
    # an explicit impl is honoured on every platform
    assert lowered(spa_forward("xla"), "tpu", *args) == NONE
    assert lowered(spa_forward("split_xla"), "cuda", *args) == NONE
    assert lowered(spa_forward("pallas"), "tpu", *args) == {**NONE, "tpu": SPA_FWD["tpu"]}
    assert lowered(spa_forward("pallas_triton"), "cuda", *args) == {**NONE,
                                                                    "cuda": SPA_FWD["cuda"]}


# (groups, N, heads, kv_heads, head_dim, P, R_max)
DECODE_SHAPES = [(2, 3, 9, 3, 64, 300, 70), (1, 16, 14, 2, 64, 1000, 33),
                 (1, 8, 32, 8, 128, 1024, 256), (2, 5, 4, 2, 24, 37, 19)]


def decode_args(g, n, h, kvh, d, p, r, dtype=jnp.bfloat16):
    return (sds((g, n, h, d), dtype), sds((g, p, kvh, d), dtype), sds((g, p, kvh, d), dtype),
            sds((g, n, r, kvh, d), dtype), sds((g, n, r, kvh, d), dtype),
            sds((g,), jnp.int32), sds((g, n), jnp.int32), sds((g, n, kvh, d), dtype),
            sds((g, n, kvh, d), dtype))


def decode(q, kp, vp, kr, vr, plen, rlen, k_new, v_new):
    return segment_decode_attention(q, kp, vp, kr, vr, prompt_lengths=plen, resp_lengths=rlen,
                                    k_new=k_new, v_new=v_new)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_segment_decode_lowers(platform, shape):
    other = {"cuda": "tpu", "tpu": "cuda"}[platform]
    names = lowered(decode, platform, *decode_args(*shape))
    assert names[platform] == DECODE[platform] and names[other] == []


def test_segment_decode_cpu_keeps_xla():
    assert lowered(decode, "cpu", *decode_args(*DECODE_SHAPES[0])) == NONE
