"""The bounded decode (attend to the first kv_bound cache slots in place, the new token as
one more key, written once after all layers) against its exact slow twin, the masked
decode over every allocated slot, and against independent float64 references: the
kernels' k_new argument (every impl), dense decode_attention, decode_step on both cache
layouts (logits <= 1e-5), the sampler (same tokens, log-probs <= 1e-5, stop ids, budgets,
several bound chunks, 3 segments), the chunk planner, and the compiled loop (no copy of
a layer's response segment)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.segment_decode import segment_decode_attention
from models.attention import attention, decode_attention
from models.config import get_config
from models.decoder import decode_step, init_params, prefill
from models.kv_cache import init_cache
from rl.rollout import SamplingConfig, decode_segment, init_state, read_slots, sample_keys
from rl.rollout import prefill as sampler_prefill
from rl.rollout.sampler import kv_bucket, plan_bounded_decode
from rl.rollout.sampler_core import decode_segment_jit

CFG = get_config("tiny")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def _softmax_rows(s):
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_segment_decode_k_new_matches_float64_loop(impl):
    rng = np.random.default_rng(0)
    g, n, kvh, hpk, d, p, r = 2, 3, 2, 2, 16, 5, 7
    h = kvh * hpk
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, kp, vp, kr, vr = f(g, n, h, d), f(g, p, kvh, d), f(g, p, kvh, d), f(g, n, r, kvh, d), f(g, n, r, kvh, d)
    kn, vn = f(g, n, kvh, d), f(g, n, kvh, d)
    plen = np.array([0, 5])
    rlen = np.array([[0, 3, 7], [2, 0, 6]])
    out = segment_decode_attention(q, kp, vp, kr, vr, prompt_lengths=plen, resp_lengths=rlen,
                                   k_new=kn, v_new=vn, impl=impl, block_k=16)
    want = np.zeros((g, n, h, d))
    for a in range(g):
        for b in range(n):
            for hh in range(h):
                kv = hh // hpk
                keys = np.concatenate([kp[a, :plen[a], kv], kr[a, b, :rlen[a, b], kv], kn[a, b, kv][None]])
                vals = np.concatenate([vp[a, :plen[a], kv], vr[a, b, :rlen[a, b], kv], vn[a, b, kv][None]])
                w = _softmax_rows(keys.astype(np.float64) @ q[a, b, hh].astype(np.float64) / math.sqrt(d))
                want[a, b, hh] = w @ vals
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_dense_decode_attention_equals_write_then_attend(impl):
    rng = np.random.default_rng(1)
    b, length, kvh, hpk, d = 3, 9, 2, 3, 8
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v, kn, vn = f(b, 1, kvh * hpk, d), f(b, length, kvh, d), f(b, length, kvh, d), f(b, kvh, d), f(b, kvh, d)
    lengths = jnp.array([0, 4, 8])
    out = decode_attention(q, k, v, lengths, kn, vn, impl=impl)
    rows = jnp.arange(b)
    k_w, v_w = k.at[rows, lengths].set(kn), v.at[rows, lengths].set(vn)  # the slow twin
    mask = (jnp.arange(length)[None, :] <= lengths[:, None])[:, None, :]
    want = attention(q, k_w, v_w, mask=mask, impl="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6)


# ----------------------------------------------------------------------------- decode_step
def test_decode_step_bounded_equals_masked_dense(params):
    toks = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 6)).astype(np.int32)
    _, cache = prefill(params, CFG, toks, jnp.array([3, 6, 1, 4]), init_cache(CFG, 4, 32))
    a = b = cache
    nxt = jnp.array([1, 2, 3, 4])
    for _ in range(12):  # lengths 6 .. 18 cross the bound 16 -> 32
        la, a = decode_step(params, CFG, nxt, a)
        bound = kv_bucket(int(np.asarray(b.lengths).max()) + 1, b.max_len)
        lb, b = decode_step(params, CFG, nxt, b, kv_bound=bound)
        np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
        nxt = la.argmax(-1)
    np.testing.assert_allclose(np.asarray(b.k), np.asarray(a.k), atol=1e-6)
    with pytest.raises(ValueError, match="kv_bound"):
        decode_step(params, CFG, nxt, b, kv_bound=8)
    with pytest.raises(ValueError, match="kv_bound"):
        decode_step(params, CFG, nxt, b, kv_bound=0)


# ----------------------------------------------------------------------------- sampler
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 200, 201, 4], [60], [7, 7, 8, 9]]


@pytest.mark.parametrize("layout,n", [("segmented", 2), ("segmented", 1), ("replicated", 2)])
def test_sampler_bounded_equals_masked(params, layout, n):
    g = 8 // n
    st = init_state(CFG, num_slots=8, max_prompt_len=8, max_new_tokens=40,
                    sampling=SamplingConfig(temperature=0.9), stop_ids=(3, 77), group_size=n,
                    kv_layout=layout)
    budgets = 40 if n == 2 else 33
    st = sampler_prefill(params, st, (PROMPTS * 2)[:g], np.arange(8).reshape(g, n),
                         sample_keys(0, range(g), n), max_new_tokens=budgets)
    fast, slow = st, st
    for v, steps in enumerate((5, 20, 15)):  # several bound chunks per call
        fast = decode_segment(params, fast, steps, v)
        slow = decode_segment(params, slow, steps, v, bounded=False)
    a, b = read_slots(fast, range(8)), read_slots(slow, range(8))
    assert sum(s.num_generated for s in b) > 8 * 12
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        np.testing.assert_array_equal(x.versions, y.versions)
        assert (x.done, x.stopped, x.budget) == (y.done, y.stopped, y.budget)


def test_plan_bounded_decode_covers_every_step():
    assert [kv_bucket(n, 1000) for n in (1, 16, 17, 64, 65, 96, 97, 129, 200)] == \
        [16, 16, 32, 64, 96, 96, 128, 192, 256]
    assert kv_bucket(70, 80) == 80
    for longest, steps, limit in [(0, 64, 64), (5, 100, 40), (63, 8, 64), (30, 300, 512)]:
        chunks = plan_bounded_decode(longest, steps, limit)
        length = longest
        for n, bound in chunks:
            assert n >= 1 and bound <= limit and length + n <= bound  # last write at bound - 1
            length += n
        assert length == min(longest + steps, limit)


def test_bounded_loop_does_not_copy_a_layer_segment(params):
    """The bounded decode reads the cache in place: no op in the compiled loop copies a
    layer's whole response segment (the masked twin's write into a segment copy does)."""
    st = init_state(CFG, num_slots=8, max_prompt_len=8, max_new_tokens=96, group_size=2)
    seg = f"f32[4,2,96,{CFG.num_kv_heads},{CFG.head_dim}]"  # [groups, N, R, kv_heads, d]

    def segment_sized(**kw):
        txt = decode_segment_jit.lower(params, st, jnp.int32(4), jnp.int32(0), **kw).compile().as_text()
        return txt[:txt.index("\nENTRY")].count(seg)  # the loop, not the entry's copy-in

    assert segment_sized(kv_bound=None) > 0  # the slow twin materialises segment copies
    assert segment_sized(kv_bound=32) == 0
