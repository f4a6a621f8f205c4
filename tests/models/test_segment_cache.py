"""The decoder on a SegmentedKVCache (models/kv_cache.py, models/decoder.py): filling it
with `prefill_segments` and stepping it with `decode_step` gives the full forward's
logits on every [prompt, own response] sequence (the naive, independent twin), with
ragged prompts (incl. an empty prompt segment), ragged responses (incl. empty ones),
GQA, and a finished sample's out-of-range write dropped; plus the cache's shapes/errors."""
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import decode_jit, decode_step, forward, init_params, prefill_segments
from models.kv_cache import cache_bytes, init_segmented_cache

CFG = get_config("tiny")  # 4 query heads over 2 kv heads (GQA)
G, N, P, R = 3, 2, 6, 8
PROMPTS = [[5, 17, 33, 40], [9], [7, 8, 9, 10, 11, 12]]  # segment = prompt[:-1]: 3, 0, 5
RESPONSES = [[[1, 2, 3], []], [[100, 3, 4, 5, 6], [7]], [[20], [21, 22]]]


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def filled_cache(params):
    """Prompt segment = prompt[:-1]; response segment i = [prompt[-1]] + response[:-1]."""
    pt = np.zeros((G, P), np.int32)
    rt = np.zeros((G, N, R), np.int32)
    rl = np.zeros((G, N), np.int32)
    for g, prompt in enumerate(PROMPTS):
        pt[g, :len(prompt)] = prompt
        for i, resp in enumerate(RESPONSES[g]):
            ctx = ([prompt[-1]] + resp)[:len(resp)]
            rt[g, i, :len(ctx)], rl[g, i] = ctx, len(ctx)
    plen = np.array([len(p) - 1 for p in PROMPTS], np.int32)
    kp, vp, kr, vr = prefill_segments(params, CFG, pt, plen, rt, rl)
    cache = init_segmented_cache(CFG, G, N, P, R)
    return cache.replace(k_prompt=kp, v_prompt=vp, k_resp=kr, v_resp=vr,
                         prompt_lengths=jnp.asarray(plen), resp_lengths=jnp.asarray(rl))


def test_decode_on_segments_matches_full_forward(params):
    cache = filled_cache(params)
    # Feed each sample's pending token (last response token, or the last prompt token).
    seqs = [PROMPTS[g] + RESPONSES[g][i] for g in range(G) for i in range(N)]
    pending = [s[-1] for s in seqs]
    logits, cache = decode_step(params, CFG, jnp.asarray(pending, jnp.int32), cache)
    logits2, cache2 = decode_step(params, CFG, jnp.arange(G * N, dtype=jnp.int32) + 30, cache)
    toks = np.zeros((G * N, P + R + 1), np.int32)
    for b, s in enumerate(seqs):
        toks[b, :len(s) + 1] = s + [30 + b]
    ref = np.asarray(forward(params, CFG, toks), np.float64)
    for b, s in enumerate(seqs):
        np.testing.assert_allclose(np.asarray(logits[b]), ref[b, len(s) - 1], atol=2e-5)
        np.testing.assert_allclose(np.asarray(logits2[b]), ref[b, len(s)], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(cache2.resp_lengths),
                                  [[len(r) + 2 for r in rs] for rs in RESPONSES])


def test_full_response_segment_write_is_dropped(params):
    # A finished sample's throw-away step (inside the sampler's jit, unchecked) writes at
    # index R: dropped, not clamped onto the valid entry R - 1.
    cache = filled_cache(params).replace(resp_lengths=jnp.full((G, N), R, jnp.int32))
    toks = jnp.zeros((G * N,), jnp.int32)
    # decode_jit is decode_step's jitted core (no host checks): one compile for the file.
    _, after = decode_jit(params, toks, cache, config=CFG, attn_impl=None)
    np.testing.assert_array_equal(np.asarray(after.k_resp), np.asarray(cache.k_resp))
    np.testing.assert_array_equal(np.asarray(after.v_resp), np.asarray(cache.v_resp))
    with pytest.raises(ValueError, match=r"cache is full: resp_lengths .* reached resp_len=8"):
        decode_step(params, CFG, toks, cache)


def test_segmented_cache_shapes_and_errors():
    cache = init_segmented_cache(CFG, 3, 4, 16, 8, dtype="bfloat16")
    kvh, d, layers = CFG.num_kv_heads, CFG.head_dim, CFG.num_layers
    assert cache.k_prompt.shape == (layers, 3, 16, kvh, d) and cache.k_prompt.dtype == jnp.bfloat16
    assert cache.v_resp.shape == (layers, 3, 4, 8, kvh, d) and cache.batch == 12
    per = layers * kvh * d * 2 * 2  # k and v, bfloat16
    assert cache_bytes(cache) == {"prompt": 3 * 16 * per, "response": 12 * 8 * per,
                                  "total": (3 * 16 + 12 * 8) * per}
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        init_segmented_cache(CFG, 3, 0, 16, 8)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        init_segmented_cache(CFG, 1, 1, 500, 100)
