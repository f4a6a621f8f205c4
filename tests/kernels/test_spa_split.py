"""The split (cascade) design of shared-prefix attention: its XLA backend against the
reference (float64 and fp32, forward and vjp; ragged lengths, GQA, N = 1, empty prompt),
the log-sum-exp merge and its backward against float64 computations, and the cuDNN
adapter's contract as far as a CPU host can see it (shapes; lowering is in
test_lowering_kernels.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernels.shared_prefix_attention import SplitOptions, shared_prefix_attention
from kernels.shared_prefix_attention.cudnn import cudnn_available, cudnn_supports
from kernels.shared_prefix_attention.flash_xla import flash_backward_xla, flash_forward_xla
from kernels.shared_prefix_attention.merge import merge_by_lse

_FAST_COMPILE = {"xla_backend_optimization_level": 0,
                 "xla_llvm_disable_expensive_passes": True}
_NAMES = ("o_prompt", "o_resp", "dq_prompt", "dk_prompt", "dv_prompt",
          "dq_resp", "dk_resp", "dv_resp")


@dataclasses.dataclass(frozen=True)
class Case:
    groups: int
    n: int
    p: int
    r: int
    kv_heads: int
    rep: int
    head_dim: int
    prompt_lengths: tuple[int, ...]
    resp_lengths: tuple[tuple[int, ...], ...]
    joint: bool = False
    sm_scale: float | None = None
    seed: int = 0


def _arrays(case: Case, dtype):
    rng = np.random.default_rng(case.seed)
    g, n, p, r, d, kvh = case.groups, case.n, case.p, case.r, case.head_dim, case.kv_heads
    h = kvh * case.rep
    shapes = [(g, p, h, d), (g, p, kvh, d), (g, p, kvh, d),
              (g, n, r, h, d), (g, n, r, kvh, d), (g, n, r, kvh, d)]
    qkv = tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)
    cts = (jnp.asarray(rng.standard_normal(shapes[0]), dtype),
           jnp.asarray(rng.standard_normal(shapes[3]), dtype))
    return (qkv, jnp.asarray(case.prompt_lengths, jnp.int32),
            jnp.asarray(case.resp_lengths, jnp.int32), cts)


def _split_vs_reference(case: Case, dtype):
    """(split_xla, reference) outputs and vjps, both from one compiled program."""
    def run(qkv, plen, rlen, cts):
        res = []
        for impl in ("split_xla", "reference"):
            fn = lambda *a, impl=impl: shared_prefix_attention(
                *a, prompt_lengths=plen, resp_lengths=rlen, sm_scale=case.sm_scale,
                impl=impl, split_options=SplitOptions(joint_prompt=case.joint))
            out, vjp = jax.vjp(fn, *qkv)
            res.append(tuple(out) + tuple(vjp(cts)))
        return res

    args = _arrays(case, dtype)
    got, want = jax.jit(run).lower(*args).compile(_FAST_COMPILE)(*args)
    return [np.asarray(x) for x in got], [np.asarray(x) for x in want]


_FLOAT64_CASES = [
    # ragged prompts and responses (empty and length-1 ones), GQA 3:1
    Case(2, 3, 9, 6, 1, 3, 5, (9, 4), ((6, 0, 1), (2, 6, 5)), seed=1),
    Case(2, 3, 9, 6, 2, 2, 4, (9, 4), ((6, 0, 1), (2, 6, 5)), joint=True, sm_scale=0.4, seed=2),
    # N = 1, and a group whose prompt is empty (responses see only themselves)
    Case(2, 1, 7, 5, 2, 1, 8, (0, 7), ((5,), (3,)), seed=3),
    Case(2, 1, 7, 5, 2, 1, 8, (0, 7), ((5,), (3,)), joint=True, seed=4),
]


@pytest.mark.parametrize("case", _FLOAT64_CASES, ids=lambda c: f"joint{c.joint}-seed{c.seed}")
def test_split_xla_equals_reference_in_float64(case):
    with jax.enable_x64():
        got, want = _split_vs_reference(case, jnp.float64)
    for name, g, w in zip(_NAMES, got, want):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, atol=1e-12, rtol=1e-10, err_msg=name)


@st.composite
def fp32_cases(draw):
    g, n = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    p, r = draw(st.integers(1, 12)), draw(st.integers(1, 8))
    return Case(
        groups=g, n=n, p=p, r=r, kv_heads=draw(st.integers(1, 2)),
        rep=draw(st.sampled_from([1, 2, 3])), head_dim=draw(st.sampled_from([4, 8])),
        prompt_lengths=tuple(draw(st.integers(0, p)) for _ in range(g)),
        resp_lengths=tuple(tuple(draw(st.integers(0, r)) for _ in range(n)) for _ in range(g)),
        joint=draw(st.booleans()), sm_scale=draw(st.sampled_from([None, 0.3])),
        seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=max(1, settings.default.max_examples // 2))
@example(case=Case(1, 1, 1, 1, 1, 1, 4, (1,), ((1,),)))
@given(case=fp32_cases())
def test_split_xla_equals_reference_in_float32(case):
    got, want = _split_vs_reference(case, jnp.float32)
    for name, g, w in zip(_NAMES, got, want):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"{name} {case}")


# ----------------------------------------------------------------------------- the merge

def _attention64(q, k, v, mask, scale):
    """float64 numpy attention over the keys `mask` `[T, S]` allows: (o, lse)."""
    s = np.einsum("thd,shd->hts", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.where(mask[None], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    l = e.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", e / np.where(l > 0, l, 1.0), v)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l > 0, l, 1.0))[..., 0]
                   + np.where(np.isfinite(m), m, 0.0)[..., 0], -np.inf)
    return o, lse.T   # [T, H, D], [T, H]


def test_merge_by_lse_equals_attention_over_the_union():
    rng = np.random.default_rng(0)
    t, s, h, d = 6, 9, 2, 5
    q, k, v = (rng.standard_normal(x) for x in ((t, h, d), (s, h, d), (s, h, d)))
    part_a = rng.random((t, s)) < 0.5
    part_a[0] = False          # row 0: only part b has keys
    part_b = ~part_a
    part_b[1] = False          # row 1: only part a has keys
    part_b[2], part_a[2] = False, False   # row 2: no key at all
    o_a, lse_a = _attention64(q, k, v, part_a, 0.7)
    o_b, lse_b = _attention64(q, k, v, part_b, 0.7)
    o_u, lse_u = _attention64(q, k, v, part_a | part_b, 0.7)
    with jax.enable_x64():
        o, lse = merge_by_lse(*(jnp.asarray(x) for x in (o_a, lse_a, o_b, lse_b)))
        o, lse = np.asarray(o), np.asarray(lse)
    assert o.dtype == np.float64 and np.all(np.isfinite(o))
    np.testing.assert_allclose(o, o_u, atol=1e-13)
    np.testing.assert_allclose(lse[[0, 1, 3, 4, 5]], lse_u[[0, 1, 3, 4, 5]], atol=1e-13)
    assert np.all(lse[2] == -np.inf) and not np.any(o[2])


def test_merge_by_lse_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="merge_by_lse"):
        merge_by_lse(jnp.zeros((2, 3)), jnp.zeros((2,)), jnp.zeros((2, 4)), jnp.zeros((2,)))


@pytest.mark.parametrize("rep", [1, 2])
def test_merged_backward_equals_float64_autodiff(rep):
    """Two flash calls over disjoint key sets (a causal own part and a padded cross part),
    merged by lse; each call's backward fed the merged o, lse and dO; dq summed: equals
    jax.vjp of dense float64 attention over the union."""
    rng = np.random.default_rng(rep)
    b, t, kvh, d, s_x = 2, 5, 2, 4, 7
    h = kvh * rep
    scale = 0.6
    with jax.enable_x64():
        f64 = lambda *shape: jnp.asarray(rng.standard_normal(shape))  # noqa: E731
        q, k_x, v_x, k_o, v_o = f64(b, t, h, d), f64(b, s_x, kvh, d), f64(b, s_x, kvh, d), \
            f64(b, t, kvh, d), f64(b, t, kvh, d)
        do = f64(b, t, h, d)
        kv_len = jnp.asarray([4, 0], jnp.int32)   # batch 1: the cross part is empty

        def dense(q, k_x, v_x, k_o, v_o):
            k = jnp.repeat(jnp.concatenate([k_x, k_o], 1), rep, axis=2)
            v = jnp.repeat(jnp.concatenate([v_x, v_o], 1), rep, axis=2)
            cols = jnp.arange(s_x + t)
            own = cols[None, :] - s_x
            mask = jnp.where(cols[None, None, :] < s_x,
                             cols[None, None, :] < kv_len[:, None, None],
                             own[None] <= jnp.arange(t)[None, :, None])   # [B, T, S]
            sc = jnp.einsum("bthd,bshd->bhts", q, k) * scale
            sc = jnp.where(mask[:, None], sc, -jnp.inf)
            return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(sc, axis=-1), v)

        want_o, vjp = jax.vjp(dense, q, k_x, v_x, k_o, v_o)
        want = vjp(do)
        o_x, lse_x = flash_forward_xla(q, k_x, v_x, kv_len, causal=False, scale=scale)
        o_o, lse_o = flash_forward_xla(q, k_o, v_o, None, causal=True, scale=scale)
        o, lse = merge_by_lse(o_x, lse_x.transpose(0, 2, 1), o_o, lse_o.transpose(0, 2, 1))
        lse = lse.transpose(0, 2, 1)
        dq_x, dk_x, dv_x = flash_backward_xla(q, k_x, v_x, kv_len, o, lse, do, causal=False,
                                              scale=scale)
        dq_o, dk_o, dv_o = flash_backward_xla(q, k_o, v_o, None, o, lse, do, causal=True,
                                              scale=scale)
        got = (dq_x + dq_o, dk_x, dv_x, dk_o, dv_o)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=1e-13)
        for name, g, w in zip(("dq", "dk_x", "dv_x", "dk_o", "dv_o"), got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-12, err_msg=name)


# ----------------------------------------------------------------------------- cuDNN adapter

def test_cudnn_adapter_contract_shapes():
    """The bound cuDNN primitives' abstract outputs follow the flash_xla contract."""
    from kernels.shared_prefix_attention.cudnn import cudnn_backward, cudnn_forward
    assert cudnn_available()
    b, t, s, h, kvh, d = 2, 48, 32, 8, 2, 64
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    for kv_len in (None, lengths):
        o, lse = jax.eval_shape(lambda q, k, v, n=kv_len: cudnn_forward(
            q, k, v, None if n is None else jnp.zeros(n.shape, n.dtype), causal=True,
            scale=0.1), q, kv, kv)
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == (
            (b, t, h, d), jnp.bfloat16, (b, h, t), jnp.float32)
        grads = jax.eval_shape(lambda q, k, v, o, lse: cudnn_backward(
            q, k, v, None, o, lse, q, causal=False, scale=0.1), q, kv, kv, o, lse)
        assert [(x.shape, x.dtype) for x in grads] == [
            ((b, t, h, d), jnp.bfloat16), ((b, s, kvh, d), jnp.bfloat16),
            ((b, s, kvh, d), jnp.bfloat16)]


def test_cudnn_supports_bf16_fp16_and_head_dims_it_takes():
    assert cudnn_supports(jnp.bfloat16, 64) and cudnn_supports(jnp.float16, 128)
    assert cudnn_supports(jnp.bfloat16, 72)
    assert not cudnn_supports(jnp.float32, 64)       # fp32: the Triton kernel
    assert not cudnn_supports(jnp.bfloat16, 60)      # not a multiple of 8
    assert not cudnn_supports(jnp.bfloat16, 512)
    # head dims in (128, 256] need a Hopper GPU in this process; a CPU host cannot know
    assert not cudnn_supports(jnp.bfloat16, 256)
