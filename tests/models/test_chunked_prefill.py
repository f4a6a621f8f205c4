"""Chunked prefill (models/chunked_prefill.py) against its exact slow twin, the one-shot
prefill, and against independent references: chunk_attention vs a float64 loop; the host
loop and the lax.scan driver vs models.decoder.prefill (last-token logits and the K/V cache
<= 1e-5, fp32) and vs the no-cache forward, for ragged batches, T not a multiple of C, C = 1,
C >= T, a GQA config; the segmented response stage vs prefill_segments; the sampler with
chunking on vs off (same tokens, log-probs <= 1e-5, both layouts, with the progress host
loop and a resume); one compiled chunk step for every T; bounded temporary memory."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import chunk_attention
from models.chunked_prefill import (
    _prompt_chunk_jit,
    check_chunk_size,
    chunked_prefill,
    prefill_chunks,
    prompt_chunk,
    segments_from_prompt_kv,
)
from models.config import get_config
from models.decoder import prefill_jit, forward, init_params, prefill, prefill_segments
from models.kv_cache import init_cache
from rl.rollout import (
    SamplingConfig,
    decode_segment,
    init_state,
    load_samples,
    read_slots,
    sample_keys,
)
from rl.rollout import prefill as sampler_prefill

CFG = get_config("tiny")  # 4 query heads over 2 kv heads: grouped-query attention
TOL = 1e-5


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def _tokens(b, t, seed=0):
    return np.random.default_rng(seed).integers(3, CFG.vocab_size, (b, t)).astype(np.int32)


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("n, c, w, block", [(1, 5, 12, 4), (3, 4, 9, 4), (2, 1, 6, 1)])
def test_chunk_attention_matches_float64_loop(n, c, w, block):
    rng = np.random.default_rng(n * 100 + c)
    g, kvh, hpk, d = 2, 2, 2, 8
    h = kvh * hpk

    def f(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k, v = f(g * n, c, h, d), f(g * n, c, kvh, d), f(g * n, c, kvh, d)
    kc, vc = f(g, w, kvh, d), f(g, w, kvh, d)
    cache_len = np.array([w - 1, 0])  # a full-ish row and an empty one
    own = np.array([c, max(c - 2, 0)] * n)[: g * n]
    own[-1] = 0  # a row with no valid query: zeros
    blocks = -(-w // block)  # the last block overhangs W when block does not divide it
    out = np.asarray(chunk_attention(q, k, v, kc, vc, cache_lengths=jnp.asarray(cache_len),
                                     num_blocks=jnp.int32(blocks), block=block,
                                     own_lengths=jnp.asarray(own)))
    want = np.zeros((g * n, c, h, d))
    for row in range(g * n):
        gg = row // n
        for i in range(own[row]):
            for hh in range(h):
                kv = hh // hpk
                keys = np.concatenate([kc[gg, :cache_len[gg], kv], k[row, :i + 1, kv]])
                vals = np.concatenate([vc[gg, :cache_len[gg], kv], v[row, :i + 1, kv]])
                s = keys.astype(np.float64) @ q[row, i, hh].astype(np.float64) / math.sqrt(d)
                p = np.exp(s - s.max())
                want[row, i, hh] = (p / p.sum()) @ vals.astype(np.float64)
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_chunk_attention_rejects_a_block_wider_than_the_cache():
    z = jnp.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match="fewer than one block"):
        chunk_attention(z, z[:, :, :1], z[:, :, :1], z[:, :3, :1], z[:, :3, :1],
                        cache_lengths=jnp.ones(1, jnp.int32), num_blocks=jnp.int32(1), block=4,
                        own_lengths=jnp.ones(1, jnp.int32))


# ----------------------------------------------------------------------------- model
def _one_shot(params, tokens, lengths, max_len):
    logits, cache = prefill(params, CFG, tokens, lengths, init_cache(CFG, len(lengths), max_len))
    return np.asarray(logits)[np.arange(len(lengths)), lengths - 1], cache


def _assert_same_cache(k, v, ref, lengths):
    for b, n in enumerate(lengths):  # entries past a row's length are meaningless
        np.testing.assert_allclose(np.asarray(k)[:, b, :n], np.asarray(ref.k)[:, b, :n], atol=TOL)
        np.testing.assert_allclose(np.asarray(v)[:, b, :n], np.asarray(ref.v)[:, b, :n], atol=TOL)


@pytest.mark.parametrize("chunk", [1, 5, 16, 36, 37, 64])
def test_host_loop_matches_one_shot_prefill(params, chunk):
    t = 37  # not a multiple of 5 or 16; chunk >= T is the one-shot path
    tokens = _tokens(3, t)
    lengths = np.array([t, 20, 1], np.int32)  # ragged, down to a single token
    ref_last, ref = _one_shot(params, tokens, lengths, 40)
    seen = []
    last, cache = chunked_prefill(params, CFG, tokens, lengths, init_cache(CFG, 3, 40),
                                  chunk_size=chunk, on_chunk=lambda *a: seen.append(a))
    np.testing.assert_allclose(np.asarray(last), ref_last, atol=TOL)
    _assert_same_cache(cache.k, cache.v, ref, lengths)
    assert np.asarray(cache.lengths).tolist() == lengths.tolist()
    n = -(-t // chunk)
    assert [s[:2] for s in seen] == [(i + 1, n) for i in range(n)]
    assert sum(s[2] for s in seen) == t
    # and the no-cache forward (an independent path) agrees on the next-token logits
    full = np.asarray(forward(params, CFG, tokens[:1]))[0, -1]
    np.testing.assert_allclose(np.asarray(last)[0], full, atol=TOL)


@pytest.mark.parametrize("chunk", [1, 8, 13])
def test_scan_matches_one_shot_prefill(params, chunk):
    t = 29
    tokens = _tokens(2, t, seed=1)
    lengths = np.array([7, t], np.int32)
    ref_last, ref = _one_shot(params, tokens, lengths, t)
    last, k, v = jax.jit(lambda p, x, n: prefill_chunks(p, CFG, x, n, chunk=chunk))(
        params, tokens, lengths)
    assert k.shape == ref.k.shape
    np.testing.assert_allclose(np.asarray(last), ref_last, atol=TOL)
    _assert_same_cache(k, v, ref, lengths)


def test_segmented_responses_match_prefill_segments(params):
    g, n, p, r, chunk = 2, 3, 21, 5, 4
    prompt = _tokens(g, p, seed=2)
    plen = jnp.asarray([p, 6], jnp.int32)
    resp = jnp.asarray(_tokens(g * n, r, seed=3).reshape(g, n, r))
    rlen = jnp.asarray([[5, 0, 2], [1, 5, 3]], jnp.int32)
    kp, vp, kr, vr = prefill_segments(params, CFG, prompt, plen, resp, rlen)
    _, kpc, vpc = prefill_chunks(params, CFG, jnp.asarray(prompt), plen, chunk=chunk)
    krc, vrc = segments_from_prompt_kv(params, CFG, kpc, vpc, plen, resp, rlen, chunk=chunk)
    for a in range(g):
        np.testing.assert_allclose(np.asarray(kpc)[:, a, :plen[a]], np.asarray(kp)[:, a, :plen[a]],
                                   atol=TOL)
        np.testing.assert_allclose(np.asarray(vpc)[:, a, :plen[a]], np.asarray(vp)[:, a, :plen[a]],
                                   atol=TOL)
        for b in range(n):
            m = int(rlen[a, b])
            np.testing.assert_allclose(np.asarray(krc)[:, a, b, :m], np.asarray(kr)[:, a, b, :m],
                                       atol=TOL)
            np.testing.assert_allclose(np.asarray(vrc)[:, a, b, :m], np.asarray(vr)[:, a, b, :m],
                                       atol=TOL)


def test_one_compiled_chunk_step_for_every_prompt_length(params):
    sizes = []
    for t in (19, 24, 33):  # different T, same chunk: the ragged last chunk is padded
        tokens = _tokens(2, t, seed=t)
        chunked_prefill(params, CFG, tokens, np.array([t, 3], np.int32), init_cache(CFG, 2, 40),
                        chunk_size=8)
        sizes.append(_prompt_chunk_jit._cache_size())
    assert sizes[1] == sizes[0] and sizes[2] == sizes[0]


def test_chunk_step_temporaries_do_not_grow_with_the_square_of_the_prompt(params):
    """XLA's temporary buffers: the one-shot prefill holds [heads, T, T] scores (grows 4x
    when T doubles); a chunk step's stay O(C^2) per block plus O(T) for the cache."""
    cfg = get_config("tiny", max_position_embeddings=1024)

    def temp_bytes(fn, *args, **static):
        return fn.lower(*args, **static).compile().memory_analysis().temp_size_in_bytes

    def one_shot(t):
        tok = jnp.zeros((1, t), jnp.int32)
        return temp_bytes(prefill_jit, params, tok, jnp.array([t]), init_cache(cfg, 1, t),
                          config=cfg, attn_impl=None)

    def chunk_step(t, c=32):
        k = jnp.zeros((cfg.num_layers, 1, t, cfg.num_kv_heads, cfg.head_dim))
        fn = jax.jit(prompt_chunk, static_argnames=("config", "attn_impl"))
        return temp_bytes(fn, params, (k, k, jnp.zeros((1, cfg.vocab_size))),
                          jnp.zeros((1, c), jnp.int32), jnp.int32(0), jnp.array([t]),
                          config=cfg, attn_impl=None)

    assert one_shot(1024) > 3 * one_shot(512)
    assert chunk_step(1024) < 2.5 * chunk_step(512)
    assert chunk_step(1024) * 8 < one_shot(1024)


def test_chunk_size_checks(params):
    assert check_chunk_size(None) is None and check_chunk_size(512) == 512
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk size must be an int >= 1"):
            check_chunk_size(bad)
    with pytest.raises(ValueError, match="prompt longer than the cache"):
        chunked_prefill(params, CFG, _tokens(1, 20), np.array([20]), init_cache(CFG, 1, 16),
                        chunk_size=4)
    with pytest.raises(ValueError, match=r"lengths must be \[batch=1\] ints in \[1, T=20\]"):
        chunked_prefill(params, CFG, _tokens(1, 20), np.array([0]), init_cache(CFG, 1, 24),
                        chunk_size=4)
    with pytest.raises(ValueError, match="prefill chunk size"):
        init_state(CFG, num_slots=1, max_prompt_len=4, max_new_tokens=2, prefill_chunk=0)


# ----------------------------------------------------------------------------- sampler
def _sample(params, layout, chunk, progress=None):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (45, 9, 30)]
    st = init_state(CFG, num_slots=6, max_prompt_len=48, max_new_tokens=12, group_size=2,
                    sampling=SamplingConfig(temperature=1.0), kv_layout=layout,
                    prefill_chunk=chunk)
    st = sampler_prefill(params, st, prompts, np.arange(6).reshape(3, 2),
                         sample_keys(0, [0, 1, 2], 2), progress=progress)
    st = decode_segment(params, st, 5, 0)
    # Read out and resume: the fill then prefills prompt + partial response.
    st = load_samples(params, st, read_slots(st, range(6)), list(range(6)))
    st = decode_segment(params, st, 12, 0)
    out = read_slots(st, range(6))
    return [s.response_ids.tolist() for s in out], np.concatenate([s.logprobs for s in out])


@pytest.mark.parametrize("layout", ["replicated", "segmented"])
def test_sampler_same_tokens_with_chunking_on_and_off(params, layout):
    ref_tokens, ref_logp = _sample(params, layout, None)
    for chunk in (1, 16):
        for progress in (None, []):
            cb = None if progress is None else (lambda *a, _p=progress: _p.append(a))
            tokens, logp = _sample(params, layout, chunk, cb)
            assert tokens == ref_tokens
            np.testing.assert_allclose(logp, ref_logp, atol=TOL)
            if progress is not None:  # the host loop ran and reported every chunk
                assert progress and progress[-1][0] == progress[-1][1]
