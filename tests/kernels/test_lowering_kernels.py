"""Every Pallas kernel lowers for "cuda" (Triton) and "tpu" (Mosaic) from this CPU host.

jax.export runs the whole Pallas -> Triton / Pallas -> Mosaic lowering for another
platform without its hardware, so unsupported ops, block shapes (the TPU tiling rule is
checked at lowering) and dtypes fail here. With impl=None the kernel must follow the
platform LOWERED FOR (kernels.dispatch), not jax.default_backend() (cpu here): the cuda
module holds exactly the Triton kernels, the tpu module exactly the Mosaic ones, and the
cpu module neither. Shapes: ragged lengths are runtime inputs; the static sizes include
non-power-of-two P, R, N, heads and GQA ratios, in bf16 (and one fp32).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels.dispatch import MOSAIC_CUSTOM_CALL, TRITON_CUSTOM_CALL, lowered_kernels
from kernels.segment_decode import segment_decode_attention
from kernels.shared_prefix_attention import shared_prefix_attention

ALLOW = [jax.export.DisabledSafetyCheck.custom_call(t)
         for t in (TRITON_CUSTOM_CALL, MOSAIC_CUSTOM_CALL)]
SPA_FWD = {"cuda": ["spa_fwd_prompt", "spa_fwd_resp"],
           "tpu": ["spa_mosaic_fwd_prompt", "spa_mosaic_fwd_resp"]}
SPA_BWD = {"cuda": ["spa_bwd_dq_prompt", "spa_bwd_dq_resp", "spa_bwd_dkdv_resp",
                    "spa_bwd_dkdv_prompt"],
           "tpu": ["spa_mosaic_bwd_dq_prompt", "spa_mosaic_bwd_dq_resp",
                   "spa_mosaic_bwd_dkdv_resp", "spa_mosaic_bwd_dkdv_prompt"]}
DECODE = {"cuda": ["segment_decode_prompt", "segment_decode_response"],
          "tpu": ["segment_decode_prompt_mosaic", "segment_decode_response_mosaic"]}


def lowered(fn, platform: str, *args) -> dict[str, list[str]]:
    text = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=ALLOW)(
        *args).mlir_module()
    found = lowered_kernels(text)
    return {"cuda": found["triton"], "tpu": found["mosaic"]}


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# (groups, N, P, R, heads, kv_heads, head_dim): SmolLM2-135M and Qwen2.5-0.5B head layouts
SPA_SHAPES = [(2, 3, 21, 13, 9, 3, 64), (1, 16, 100, 37, 14, 2, 64), (1, 4, 256, 128, 32, 8, 128)]


def spa_args(g, n, p, r, h, kvh, d, dtype=jnp.bfloat16):
    return (sds((g, p, h, d), dtype), sds((g, p, kvh, d), dtype), sds((g, p, kvh, d), dtype),
            sds((g, n, r, h, d), dtype), sds((g, n, r, kvh, d), dtype),
            sds((g, n, r, kvh, d), dtype), sds((g,), jnp.int32), sds((g, n), jnp.int32))


def spa_forward(impl=None):
    def fn(qp, kp, vp, qr, kr, vr, plen, rlen):
        return shared_prefix_attention(qp, kp, vp, qr, kr, vr, prompt_lengths=plen,
                                       resp_lengths=rlen, impl=impl)
    return fn


def spa_grad(qp, kp, vp, qr, kr, vr, plen, rlen):
    def loss(*qkv):
        o_p, o_r = spa_forward()(*qkv, plen, rlen)
        return jnp.sum(o_p.astype(jnp.float32) ** 2) + jnp.sum(o_r.astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=tuple(range(6)))(qp, kp, vp, qr, kr, vr)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", SPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shared_prefix_forward_and_backward_lower(platform, shape):
    other = {"cuda": "tpu", "tpu": "cuda"}[platform]
    fwd = lowered(spa_forward(), platform, *spa_args(*shape))
    assert fwd[platform] == SPA_FWD[platform] and fwd[other] == []
    bwd = lowered(spa_grad, platform, *spa_args(*shape))
    assert sorted(bwd[platform]) == sorted(SPA_FWD[platform] + SPA_BWD[platform])
    assert bwd[other] == []


def test_shared_prefix_lowers_in_float32_and_cpu_keeps_xla():
    args = spa_args(*SPA_SHAPES[0], dtype=jnp.float32)
    for platform in ("cuda", "tpu"):
        assert sorted(lowered(spa_grad, platform, *args)[platform]) == sorted(
            SPA_FWD[platform] + SPA_BWD[platform])
    assert lowered(spa_grad, "cpu", *args) == {"cuda": [], "tpu": []}
    # an explicit impl is honoured on every platform
    assert lowered(spa_forward("xla"), "tpu", *args) == {"cuda": [], "tpu": []}
    assert lowered(spa_forward("pallas"), "tpu", *args) == {"cuda": [], "tpu": SPA_FWD["tpu"]}
    assert lowered(spa_forward("pallas_triton"), "cuda", *args) == {"cuda": SPA_FWD["cuda"],
                                                                    "tpu": []}


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
    assert lowered(decode, "cpu", *decode_args(*DECODE_SHAPES[0])) == {"cuda": [], "tpu": []}
