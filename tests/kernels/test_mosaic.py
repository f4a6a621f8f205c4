"""Mosaic-TPU kernels in Pallas' TPU interpret mode (`pltpu.InterpretParams()`) on CPU.

impl="pallas_mosaic" with interpret=None runs the Mosaic kernels interpreted here (the
platform is not TPU), so these tests also exercise the dispatch. References: the naive
shared-prefix reference (forward and vjp; itself checked against a float64 loop in
test_shared_prefix_attention.py) and the float64 segment-decode loop. Shapes are drawn
within the TPU tiling rules the wrappers enforce (tiles of >= 16 rows, whole head_dim);
interpret mode is slow, so the examples are few.
"""
from __future__ import annotations

import jax.numpy as jnp
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_segment_decode import Case as DecodeCase
from test_segment_decode import assert_matches_loop, make_inputs
from test_shared_prefix_attention import Case, _compare

from kernels.segment_decode import segment_decode_attention

FEW = settings(max_examples=3, deadline=None)


@st.composite
def spa_cases(draw):
    g, n = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    p, r = draw(st.integers(1, 40)), draw(st.integers(1, 20))
    return Case(
        groups=g, n=n, p=p, r=r, kv_heads=draw(st.integers(1, 2)),
        rep=draw(st.sampled_from([1, 2, 3])), head_dim=draw(st.sampled_from([8, 32, 64])),
        prompt_lengths=tuple(draw(st.integers(1, p)) for _ in range(g)),
        resp_lengths=tuple(tuple(draw(st.sampled_from([0, 1, r, draw(st.integers(0, r))]))
                                 for _ in range(n)) for _ in range(g)),
        block=tuple(draw(st.sampled_from([16, 32])) for _ in range(4)),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        sm_scale=draw(st.sampled_from([None, 0.37])), seed=draw(st.integers(0, 2**31 - 1)))


# ragged: a 1-token prompt, empty and full responses, several key tiles per sequence
_SPA_BF16 = Case(groups=2, n=3, p=37, r=21, kv_heads=2, rep=3, head_dim=64,
                 prompt_lengths=(37, 1), resp_lengths=((21, 0, 5), (1, 17, 21)),
                 block=(16, 16, 16, 16), dtype="bfloat16", seed=3)
_SPA_F32 = Case(groups=1, n=2, p=19, r=33, kv_heads=1, rep=2, head_dim=32,
                prompt_lengths=(11,), resp_lengths=((33, 16),), block=(32, 16, 16, 32),
                dtype="float32", sm_scale=0.37, seed=4)


@FEW
@example(case=_SPA_BF16)
@example(case=_SPA_F32)
@given(case=spa_cases())
def test_mosaic_shared_prefix_matches_reference(case):
    """Forward outputs and all six input gradients, padding rows exactly zero."""
    _compare(case, impls=("pallas_mosaic",))


@st.composite
def decode_cases(draw):
    return DecodeCase(
        groups=draw(st.integers(1, 2)), n=draw(st.integers(1, 3)),
        kv_heads=draw(st.integers(1, 2)), heads_per_kv=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from([16, 64])), p=draw(st.integers(0, 70)),
        r_max=draw(st.integers(0, 40)), block_k=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        seed=draw(st.integers(0, 2**31 - 1)), zero_frac=draw(st.sampled_from([0.0, 0.4, 1.0])))


@FEW
@example(c=DecodeCase(2, 3, 3, 3, 64, 70, 37, 16, "bfloat16", 5, 0.4))
@example(c=DecodeCase(1, 2, 1, 2, 16, 0, 5, 16, "float32", 6, 0.0))   # no prompt at all
@given(c=decode_cases())
def test_mosaic_segment_decode_matches_float64_loop(c):
    assert_matches_loop(c, ("pallas_mosaic",))


def test_mosaic_off_tpu_default_is_interpret_mode():
    """Off TPU, interpret=None runs the Mosaic kernels interpreted: bit-equal to
    interpret=True (an XLA fallback would differ in rounding)."""
    c = DecodeCase(1, 2, 2, 2, 16, 20, 9, 16, "float32", 7, 0.0)
    arrays, p_len, r_len = make_inputs(c)
    a, b = (segment_decode_attention(*arrays, prompt_lengths=p_len, resp_lengths=r_len,
                                     impl="pallas_mosaic", block_k=16, interpret=i)
            for i in (True, None))
    assert jnp.array_equal(a, b)
