"""KV cache: prefill of ragged right-padded prompts + step-by-step decode must reproduce
the full (uncached) forward's logits; bf16 compute stays close; bad input is rejected."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import decode_step, forward, init_params, prefill
from models.kv_cache import init_cache

# Exercise every optional feature at once: GQA, q/k/v biases, q/k norms, untied head.
CONFIG = get_config("tiny", arch="qwen3", qk_norm=True, attention_bias=True,
                    tie_word_embeddings=False, vocab_size=128)
LENGTHS = np.array([5, 2, 7])  # ragged prompt lengths
T, STEPS, MAX_LEN = 7, 4, 12


def random_params(config, seed):
    """init_params, then every leaf (biases and norm scales included) perturbed so that a
    dropped bias or a skipped norm changes the logits."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(np.asarray(p) + 0.1 * rng.standard_normal(p.shape), p.dtype),
        init_params(config, seed),
    )


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, CONFIG.vocab_size, size=(3, T))
    new = rng.integers(0, CONFIG.vocab_size, size=(3, STEPS))  # teacher-forced continuations
    return prompts, new


def full_reference(params, config, prompts, new):
    """Uncached forward over each row's prompt + continuation (right padded).
    Returns logits [3, T + STEPS, vocab] with row b's token j at index j."""
    width = T + STEPS
    tokens = np.zeros((3, width), np.int64)
    valid = np.zeros((3, width), np.int64)
    for b, n in enumerate(LENGTHS):
        seq = np.concatenate([prompts[b, :n], new[b]])
        tokens[b, : len(seq)] = seq
        valid[b, : len(seq)] = 1
    return np.asarray(forward(params, config, tokens, segment_ids=valid))


def cached_run(params, config, prompts, new):
    """Prefill + STEPS decode steps; returns (prefill logits, [STEPS] decode logits, cache)."""
    cache = init_cache(config, batch=3, max_len=MAX_LEN)
    pre, cache = prefill(params, config, prompts, LENGTHS, cache)
    steps = []
    for s in range(STEPS):
        logits, cache = decode_step(params, config, new[:, s], cache)
        steps.append(np.asarray(logits))
    return np.asarray(pre), steps, cache


def compare(ref, pre, steps, atol):
    errs = []
    for b, n in enumerate(LENGTHS):
        errs.append(np.abs(pre[b, :n] - ref[b, :n]).max())
        for s in range(STEPS):
            errs.append(np.abs(steps[s][b] - ref[b, n + s]).max())
    assert max(errs) <= atol, f"max abs error {max(errs)}"


def test_prefill_and_decode_match_full_forward_fp32(case):
    prompts, new = case
    params = random_params(CONFIG, 0)
    ref = full_reference(params, CONFIG, prompts, new)
    pre, steps, cache = cached_run(params, CONFIG, prompts, new)
    compare(ref, pre, steps, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), LENGTHS + STEPS)
    assert np.isfinite(pre).all(), "padded prompt positions must still give finite logits"


def test_bf16_compute_is_close_to_fp32(case):
    prompts, new = case
    params = random_params(CONFIG, 0)
    ref = full_reference(params, CONFIG, prompts, new)
    bf16 = CONFIG.replace(dtype="bfloat16", param_dtype="bfloat16")
    params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    pre, steps, cache = cached_run(params16, bf16, prompts, new)
    assert cache.k.dtype == jnp.bfloat16 and pre.dtype == np.float32
    scale = np.abs(ref).max()
    compare(ref, pre, steps, atol=0.05 * scale)


def test_prompt_longer_than_cache_is_rejected(case):
    prompts, _ = case
    params = init_params(CONFIG, 0)
    with pytest.raises(ValueError, match=r"prompt longer than the cache: .*T=7.*max_len=6"):
        prefill(params, CONFIG, prompts, LENGTHS, init_cache(CONFIG, batch=3, max_len=6))


def test_bad_lengths_and_tokens_are_rejected(case):
    prompts, _ = case
    params = init_params(CONFIG, 0)
    cache = init_cache(CONFIG, batch=3, max_len=MAX_LEN)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, T=7\]"):
        prefill(params, CONFIG, prompts, np.array([8, 1, 1]), cache)
    bad = prompts.copy()
    bad[1, 0] = CONFIG.vocab_size
    with pytest.raises(ValueError, match=r"out-of-vocab ids \[128\]"):
        prefill(params, CONFIG, bad, LENGTHS, cache)
    with pytest.raises(ValueError, match=r"out-of-vocab ids \[-1\]"):
        decode_step(params, CONFIG, np.array([0, -1, 3]), cache)


def test_full_cache_is_rejected():
    params = init_params(CONFIG, 0)
    cache = init_cache(CONFIG, batch=3, max_len=MAX_LEN)
    cache = cache.replace(lengths=jnp.array([3, MAX_LEN, 1], jnp.int32))
    with pytest.raises(ValueError, match=r"cache is full: lengths \[3, 12, 1\] reached max_len=12"):
        decode_step(params, CONFIG, np.array([5, 6, 7]), cache)
