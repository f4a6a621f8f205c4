"""Segment decode attention. Every impl (reference, xla, pallas in interpret mode) is
checked against an independent float64 loop over hypothesis-drawn shapes (and xla against
the reference directly); merge/reduce_attention_states against a full float64 softmax;
input validation; and that the Pallas kernels lower to Triton for CUDA."""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels.segment_decode import (
    merge_attention_states,
    reduce_attention_states,
    segment_decode_attention,
)
from kernels.segment_decode.pallas import segment_decode_attention_pallas

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# Jitted once: run eagerly, every small op would compile on its own.
merge_jit = jax.jit(merge_attention_states)
reduce_jit = jax.jit(reduce_attention_states, static_argnames="axis")


@dataclasses.dataclass(frozen=True)
class Case:
    groups: int
    n: int
    kv_heads: int
    heads_per_kv: int
    head_dim: int
    p: int          # stored prompt length
    r_max: int      # stored response length
    block_k: int
    dtype: str
    seed: int
    zero_frac: float  # probability that a length is forced to 0


def make_inputs(c: Case):
    rng = np.random.default_rng(c.seed)
    heads = c.kv_heads * c.heads_per_kv
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype=c.dtype)
    q = normal(c.groups, c.n, heads, c.head_dim)
    k_p = normal(c.groups, c.p, c.kv_heads, c.head_dim)
    v_p = normal(c.groups, c.p, c.kv_heads, c.head_dim)
    k_r = normal(c.groups, c.n, c.r_max, c.kv_heads, c.head_dim)
    v_r = normal(c.groups, c.n, c.r_max, c.kv_heads, c.head_dim)
    p_len = rng.integers(0, c.p + 1, size=(c.groups,))
    r_len = rng.integers(0, c.r_max + 1, size=(c.groups, c.n))
    p_len[rng.random(p_len.shape) < c.zero_frac] = 0
    r_len[rng.random(r_len.shape) < c.zero_frac] = 0
    return (q, k_p, v_p, k_r, v_r), jnp.asarray(p_len, jnp.int32), jnp.asarray(r_len, jnp.int32)


@st.composite
def cases(draw, max_len: int = 40):
    return Case(
        groups=draw(st.integers(1, 2)), n=draw(st.integers(1, 3)),
        kv_heads=draw(st.integers(1, 2)), heads_per_kv=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from([16, 32])),
        p=draw(st.integers(0, max_len)), r_max=draw(st.integers(0, max_len)),
        block_k=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        zero_frac=draw(st.sampled_from([0.0, 0.4, 1.0])),
    )


def assert_matches_loop(c: Case, impls: tuple[str, ...], **kw):
    """Each impl's output vs the float64 loop on the same (dtype-rounded) inputs."""
    arrays, p_len, r_len = make_inputs(c)
    expect = loop_reference(*arrays, np.asarray(p_len), np.asarray(r_len),
                            1.0 / math.sqrt(c.head_dim))
    tol = TOL[c.dtype]
    outs = {}
    for impl in impls:
        out = segment_decode_attention(*arrays, prompt_lengths=p_len, resp_lengths=r_len,
                                       impl=impl, block_k=c.block_k, **kw)
        assert out.shape == arrays[0].shape and out.dtype == arrays[0].dtype
        outs[impl] = out = np.asarray(out.astype(jnp.float32))
        assert np.all(np.isfinite(out)), impl
        np.testing.assert_allclose(out, expect, atol=tol, rtol=tol, err_msg=impl)
    for impl in set(outs) - {"reference"}:
        if "reference" in outs:
            np.testing.assert_allclose(outs[impl], outs["reference"], atol=tol, rtol=tol)


# ---------------------------------------------------------------- reference vs float64 loop

def loop_reference(q, k_p, v_p, k_r, v_r, p_len, r_len, sm_scale):
    """Independent float64 loop: per (group, sample, head) gather the keys, softmax."""
    q, k_p, v_p, k_r, v_r = (np.asarray(x, np.float64) for x in (q, k_p, v_p, k_r, v_r))
    groups, n, heads, d = q.shape
    per_kv = heads // k_p.shape[2]
    out = np.zeros_like(q)
    for g in range(groups):
        for i in range(n):
            for h in range(heads):
                kh = h // per_kv
                keys = [k_p[g, j, kh] for j in range(p_len[g])] + \
                       [k_r[g, i, j, kh] for j in range(r_len[g, i])]
                vals = [v_p[g, j, kh] for j in range(p_len[g])] + \
                       [v_r[g, i, j, kh] for j in range(r_len[g, i])]
                if not keys:
                    continue
                s = np.array([q[g, i, h] @ key for key in keys]) * sm_scale
                w = np.exp(s - s.max())
                out[g, i, h] = sum(wj * vj for wj, vj in zip(w / w.sum(), vals))
    return out


def test_reference_matches_float64_loop():
    c = Case(groups=2, n=3, kv_heads=2, heads_per_kv=2, head_dim=8, p=7, r_max=5,
             block_k=16, dtype="float32", seed=1, zero_frac=0.0)
    arrays, _, _ = make_inputs(c)
    p_len = jnp.array([7, 0], jnp.int32)  # group 1 has an empty prompt
    r_len = jnp.array([[0, 3, 5], [2, 0, 5]], jnp.int32)  # sample (1, 1) has no key at all
    out = segment_decode_attention(*arrays, prompt_lengths=p_len, resp_lengths=r_len,
                                   sm_scale=0.3, impl="reference")
    expect = loop_reference(*arrays, np.asarray(p_len), np.asarray(r_len), 0.3)
    np.testing.assert_allclose(np.asarray(out), expect, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[1, 1] == 0)


# ------------------------------------------------------------------- merge_attention_states

def np_state(s, v, keep):
    """float64 partial state of scores s [B, K], values v [B, K, d] over keys `keep` [B, K]."""
    o = np.zeros(v.shape[0::2])
    m = np.full(s.shape[0], -np.inf)
    l = np.zeros(s.shape[0])
    for b in range(s.shape[0]):
        idx = np.flatnonzero(keep[b])
        if idx.size:
            m[b] = s[b, idx].max()
            w = np.exp(s[b, idx] - m[b])
            l[b] = w.sum()
            o[b] = (w[:, None] * v[b, idx]).sum(0) / l[b]
    return o, m, l


@pytest.mark.parametrize("mode", ["random", "a_empty", "b_empty", "both_empty"])
def test_merge_attention_states_equals_full_softmax(mode):
    rng = np.random.default_rng(["random", "a_empty", "b_empty", "both_empty"].index(mode))
    b, k, d = 6, 11, 5
    s = rng.standard_normal((b, k)) * 3.0
    v = rng.standard_normal((b, k, d))
    in_a = rng.random((b, k)) < 0.5
    in_a[0] = True  # one row entirely in a, one entirely in b
    in_a[1] = False
    if mode == "a_empty":
        in_a[:] = False
    if mode == "b_empty":
        in_a[:] = True
    present = np.zeros((b, k), bool) if mode == "both_empty" else np.ones((b, k), bool)
    a, bb = np_state(s, v, in_a & present), np_state(s, v, ~in_a & present)
    o, m, l = merge_jit(*(jnp.asarray(x, jnp.float32) for x in a + bb))
    o, m, l = np.asarray(o), np.asarray(m), np.asarray(l)
    assert not np.any(np.isnan(o)) and not np.any(np.isnan(l))
    if mode == "both_empty":
        assert np.all(o == 0) and np.all(m == -np.inf) and np.all(l == 0)
        return
    p = np.exp(s - s.max(1, keepdims=True))
    full = (p / p.sum(1, keepdims=True))[:, :, None] * v
    np.testing.assert_allclose(o, full.sum(1), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(m, s.max(1), rtol=1e-6)
    np.testing.assert_allclose(l, p.sum(1), rtol=1e-5)


def test_reduce_attention_states_over_random_partition():
    rng = np.random.default_rng(7)
    b, k, d, parts = 5, 13, 4, 4
    s = rng.standard_normal((b, k)) * 2.0
    v = rng.standard_normal((b, k, d))
    owner = rng.integers(0, parts - 1, size=(b, k))  # part parts-1 stays empty
    owner[0] = 2  # a row with a single non-empty part
    states = [np_state(s, v, owner == j) for j in range(parts)]
    o, m, l = (jnp.asarray(np.stack([st_[i] for st_ in states], axis=1), jnp.float32)
               for i in range(3))
    o, m, l = reduce_jit(o, m, l, axis=1)
    p = np.exp(s - s.max(1, keepdims=True))
    expect = ((p / p.sum(1, keepdims=True))[:, :, None] * v).sum(1)
    np.testing.assert_allclose(np.asarray(o), expect, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(l), p.sum(1), rtol=1e-5)
    # All parts empty -> zeros, no NaN.
    o0, m0, l0 = reduce_jit(
        jnp.full((2, 3, d), jnp.nan), jnp.full((2, 3), -jnp.inf), jnp.zeros((2, 3)), axis=1)
    assert np.all(np.asarray(o0) == 0) and np.all(np.asarray(l0) == 0)


def test_merge_rejects_mismatched_states():
    o, m = jnp.ones((2, 3, 4)), jnp.ones((2, 3))
    with pytest.raises(ValueError, match="m_b and l_b"):
        merge_attention_states(o, m, m, o, m[:, :2], m)
    with pytest.raises(ValueError, match="same shape"):
        merge_attention_states(o, m, m, o[:, :, :2], m, m)


# ------------------------------------------------------- kernels vs reference / float64 loop

# Compilation dominates the cost (about 1 s per xla shape, 3 s per interpreted pallas
# shape on 2 cores), hence the example counts.
@settings(max_examples=7)
@given(cases())
@example(Case(1, 2, 1, 2, 16, 0, 0, 16, "float32", 3, 0.0))  # nothing stored at all
def test_xla_and_reference_match_float64_loop(c):
    assert_matches_loop(c, ("xla", "reference"))


@settings(max_examples=4)
@given(cases(max_len=36))
@example(Case(2, 2, 2, 3, 32, 40, 23, 32, "bfloat16", 13, 0.4))  # GQA, bf16, ragged
@example(Case(1, 3, 1, 2, 16, 0, 18, 16, "float32", 14, 0.4))  # no prompt storage
def test_pallas_matches_float64_loop(c):
    assert_matches_loop(c, ("pallas",), interpret=True)


def _pallas_vs_loop(arrays, p_len, r_len, **kw):
    out = segment_decode_attention_pallas(*arrays, p_len, r_len, sm_scale=0.25,
                                          interpret=True, **kw)
    expect = loop_reference(*arrays, np.asarray(p_len), np.asarray(r_len), 0.25)
    np.testing.assert_allclose(np.asarray(out), expect, atol=1e-5, rtol=1e-5)
    return np.asarray(out)


def test_pallas_ragged_splits_and_empty_segments():
    # P = 70: five prompt tiles of 16 (one per split here); R_max = 20 is not a multiple of
    # block_k: two response tiles, the second zero-padded and ragged.
    c = Case(2, 3, 2, 2, 16, 70, 20, 16, "float32", 21, 0.0)
    arrays, _, _ = make_inputs(c)
    p_len = jnp.array([0, 70], jnp.int32)  # group 0: empty prompt
    r_len = jnp.array([[0, 17, 20], [0, 3, 16]], jnp.int32)  # (0, 0): no key at all
    out = _pallas_vs_loop(arrays, p_len, r_len, block_k=16, blocks_per_split=1)
    assert np.all(out[0, 0] == 0) and np.all(out[1, 0] != 0)


def test_pallas_without_response_storage():
    c = Case(2, 2, 1, 2, 16, 19, 0, 16, "float32", 15, 0.0)
    arrays, _, r_len = make_inputs(c)
    out = _pallas_vs_loop(arrays, jnp.array([9, 0], jnp.int32), r_len, block_k=16)
    assert np.all(out[1] == 0)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_no_valid_keys_gives_zeros(impl):
    c = Case(2, 2, 1, 2, 16, 12, 9, 16, "float32", 31, 1.0)
    arrays, p_len, r_len = make_inputs(c)
    out = segment_decode_attention(*arrays, prompt_lengths=p_len, resp_lengths=r_len, impl=impl)
    assert np.all(np.asarray(out) == 0)


def test_xla_entry_under_jit_with_traced_lengths():
    c = Case(2, 3, 2, 2, 16, 20, 17, 16, "float32", 41, 0.3)
    arrays, p_len, r_len = make_inputs(c)
    f = jax.jit(lambda *a: segment_decode_attention(*a[:5], prompt_lengths=a[5],
                                                    resp_lengths=a[6], impl="xla"))
    out = f(*arrays, p_len, r_len)
    expect = loop_reference(*arrays, np.asarray(p_len), np.asarray(r_len), 0.25)
    np.testing.assert_allclose(np.asarray(out), expect, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------ input validation

def _good():
    c = Case(1, 2, 2, 2, 16, 5, 4, 16, "float32", 51, 0.0)
    arrays, p_len, r_len = make_inputs(c)
    return list(arrays), {"prompt_lengths": p_len, "resp_lengths": r_len}


def _bad(change):
    arrays, kw = _good()
    change(arrays, kw)
    return arrays, kw


BAD = {
    "q_rank": (lambda a, kw: a.__setitem__(0, a[0][0]), "q must have 4"),
    "kv_mismatch": (lambda a, kw: a.__setitem__(2, a[2][:, :3]), "k_prompt and v_prompt"),
    "resp_n": (lambda a, kw: (a.__setitem__(3, a[3][:, :1]), a.__setitem__(4, a[4][:, :1])),
               "k_resp must be"),
    "head_dim": (lambda a, kw: (a.__setitem__(1, a[1][..., :8]), a.__setitem__(2, a[2][..., :8])),
                 "k_prompt must be"),
    "dtype": (lambda a, kw: a.__setitem__(4, a[4].astype(jnp.bfloat16)), "share one dtype"),
    "gqa": (lambda a, kw: a.__setitem__(0, a[0][:, :, :3]), "multiple of kv_heads"),
    "plen_shape": (lambda a, kw: kw.__setitem__("prompt_lengths", jnp.zeros((2,), jnp.int32)),
                   "prompt_lengths must have shape"),
    "rlen_shape": (lambda a, kw: kw.__setitem__("resp_lengths", jnp.zeros((2,), jnp.int32)),
                   "resp_lengths must have shape"),
    "rlen_dtype": (lambda a, kw: kw.__setitem__("resp_lengths", jnp.zeros((1, 2))),
                   "integer"),
    "rlen_range": (lambda a, kw: kw.__setitem__("resp_lengths", jnp.array([[1, 5]])),
                   r"resp_lengths must lie in \[0, 4\]"),
    "block_k": (lambda a, kw: kw.__setitem__("block_k", 24), "block_k must be"),
    "impl": (lambda a, kw: kw.__setitem__("impl", "cuda"), "impl must be one of"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_raise(name):
    change, msg = BAD[name]
    arrays, kw = _bad(change)
    kw.setdefault("impl", "xla")
    with pytest.raises(ValueError, match=msg):
        segment_decode_attention(*arrays, **kw)


def test_pallas_pads_non_power_of_two_head_dim():
    """Triton tiles need head_dim a power of two >= 16: head_dim 24 is zero-padded to 32,
    which changes nothing (compared with the float64 loop)."""
    c = Case(1, 2, 1, 1, 24, 5, 4, 16, "float32", 52, 0.0)
    arrays, p_len, r_len = make_inputs(c)
    out = segment_decode_attention(*arrays, prompt_lengths=p_len, resp_lengths=r_len,
                                   impl="pallas", interpret=True)
    expect = loop_reference(*[np.asarray(a) for a in arrays], np.asarray(p_len),
                            np.asarray(r_len), 1.0 / math.sqrt(24))
    np.testing.assert_allclose(np.asarray(out), expect, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- GPU (Triton) lowering

def test_pallas_kernels_lower_to_triton_for_cuda():
    """Cross-lowers (no GPU needed) to check the kernels satisfy Triton's constraints."""
    g, n, kvh, hpk, d, p, r = 2, 3, 2, 3, 64, 300, 70
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    f = jax.jit(partial(segment_decode_attention_pallas, sm_scale=0.125, block_k=64,
                        interpret=False, blocks_per_split=2))
    exported = jax.export.export(
        f, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(f32(g, n, kvh * hpk, d), f32(g, p, kvh, d), f32(g, p, kvh, d),
      f32(g, n, r, kvh, d), f32(g, n, r, kvh, d), i32(g), i32(g, n))
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2  # prompt + response
