"""The chunked vocabulary head (models.logprobs.chunked_logprobs / token_logprobs_fused and
models.packed.packed_token_logprobs_fused) against float64 numpy references and the slow
twins that materialise every logit: values, entropies and gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig, get_config
from models.decoder import forward, init_params
from models.logprobs import chunked_logprobs, head_matrix, token_logprobs, token_logprobs_fused
from models.packed import pack_groups, packed_token_logprobs, packed_token_logprobs_fused

TINY = get_config("tiny")
UNTIED = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=64,
                     num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=64, qk_norm=True, attention_bias=True,
                     tie_word_embeddings=False, rope_theta=500.0)


def _np_stats(hidden, head, targets, temperature):
    """float64 reference: (logp, entropy) of softmax(hidden @ head / T)."""
    z = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    logp = np.take_along_axis(logq, np.asarray(targets)[..., None], -1)[..., 0]
    return logp, -(np.exp(logq) * logq).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_logprobs_matches_float64(chunk):
    """Any chunk size (dividing the tokens or not, larger than them) gives the float64
    log-probs and entropies; entropy=False gives zeros and the same log-probs."""
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 11, 16)).astype(np.float32)
    head = rng.normal(size=(16, 50)).astype(np.float32)
    targets = rng.integers(0, 50, (3, 11))
    want_lp, want_ent = _np_stats(hidden, head, targets, 0.7)
    lp, ent = chunked_logprobs(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(targets),
                               0.7, chunk=chunk)
    np.testing.assert_allclose(lp, want_lp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5, rtol=1e-5)
    lp2, ent2 = chunked_logprobs(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(targets),
                                 0.7, chunk=chunk, entropy=False)
    np.testing.assert_allclose(lp2, want_lp, atol=2e-5, rtol=1e-5)
    assert not np.any(np.asarray(ent2))


def test_chunked_logprobs_gradients_match_full_logits():
    """Gradients of a loss using both log-probs and entropies, in hidden and head, equal
    those through the full [N, V] logits (jax autodiff of the naive formula)."""
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(2, 9, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 40)) / 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (2, 9)))
    w1 = jnp.asarray(rng.normal(size=(2, 9)), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(2, 9)), jnp.float32)

    def naive(h, w):
        z = jnp.einsum("bte,ev->btv", h, w) / 1.3
        logq = jax.nn.log_softmax(z, -1)
        lp = jnp.take_along_axis(logq, targets[..., None], -1)[..., 0]
        return jnp.sum(w1 * lp) + jnp.sum(w2 * -(jnp.exp(logq) * logq).sum(-1))

    want = jax.grad(naive, argnums=(0, 1))(hidden, head)
    for keep in [False, True]:  # recomputed or kept logits: the same gradients
        fused = lambda h, w, keep=keep: _weighted(chunked_logprobs(
            h, w, targets, 1.3, chunk=4, keep_logits=keep), w1, w2)
        got = jax.grad(fused, argnums=(0, 1))(hidden, head)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def _weighted(stats, w1, w2):
    lp, ent = stats
    return jnp.sum(w1 * lp) + jnp.sum(w2 * ent)


def test_keep_logits_holds_every_chunks_logits_for_the_backward():
    """keep_logits: the backward closes over the [chunks, C, V] logits (and recomputes no
    head matmul); without it no residual has V columns per token."""
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.normal(size=(2, 9, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 40)) / 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (2, 9)))

    def residual_shapes(keep):
        f = lambda h, w: jnp.sum(chunked_logprobs(h, w, targets, 1.0, chunk=4,
                                                  keep_logits=keep)[0])
        _, vjp = jax.vjp(f, hidden, head)
        return {tuple(x.shape) for x in jax.tree.leaves(vjp)}

    assert (5, 4, 40) in residual_shapes(True)  # 18 tokens -> 5 chunks of 4, all logits
    assert not any(s[-1:] == (40,) and len(s) == 3 for s in residual_shapes(False))


def test_chunked_logprobs_rejects_bad_inputs():
    h, w = jnp.zeros((2, 3, 4)), jnp.zeros((4, 5))
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        chunked_logprobs(h, w, jnp.zeros((2, 3), int), 1.0, chunk=0)
    with pytest.raises(ValueError, match="targets have shape"):
        chunked_logprobs(h, w, jnp.zeros((2, 4), int), 1.0)


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
def test_token_logprobs_fused_equals_slow_twin(config):
    """Through a real decoder (tied and untied heads): the fused path's log-probs,
    entropies and parameter gradients equal the full-logits twin's (<= 1e-5)."""
    params = init_params(config, 3)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (3, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), tokens.shape)
    w = jnp.asarray(rng.normal(size=(3, 11)), jnp.float32)

    def slow(p):
        lp, z = token_logprobs(p, config, tokens, positions, 0.8)
        logq = jax.nn.log_softmax(z, -1)
        ent = -(jnp.exp(logq) * logq).sum(-1)
        return jnp.sum(w * lp) + 0.1 * jnp.sum(ent), (lp, ent)

    def fast(p):
        lp, ent = token_logprobs_fused(p, config, tokens, positions, 0.8, chunk=5)
        return jnp.sum(w * lp) + 0.1 * jnp.sum(ent), (lp, ent)

    (_, (lp0, ent0)), g0 = jax.value_and_grad(slow, has_aux=True)(params)
    (_, (lp1, ent1)), g1 = jax.value_and_grad(fast, has_aux=True)(params)
    np.testing.assert_allclose(lp1, lp0, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent1, ent0, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max() + 1e-6), rtol=1e-4)
    # and the head really is the decoder's: logits = hidden @ head_matrix
    logits = forward(params, config, tokens, positions)
    z = np.asarray(logits, np.float64)[:, :-1] / 0.8
    z -= z.max(-1, keepdims=True)
    want = np.take_along_axis(z - np.log(np.exp(z).sum(-1, keepdims=True)),
                              np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(lp1, want, atol=2e-5)
    assert head_matrix(params, config).shape == (config.hidden_size, config.vocab_size)


def test_packed_token_logprobs_fused_equals_slow_twin():
    """The packed fused path: log-probs equal the packed slow twin's at every column that
    predicts a response token, entropies equal the entropy of its scaled logits there, and
    both are 0 elsewhere; gradients match."""
    config = TINY
    params = init_params(config, 4)
    rng = np.random.default_rng(3)
    g, n, p, r = 2, 3, 5, 4
    plen = np.array([3, 5])
    rlen = np.array([[4, 2, 0], [1, 4, 3]])
    rows = []
    for gi in range(g):
        prompt = rng.integers(1, config.vocab_size, plen[gi])
        for ni in range(n):
            resp = rng.integers(1, config.vocab_size, rlen[gi, ni])
            row = np.zeros(p + r, np.int32)
            row[:plen[gi] + rlen[gi, ni]] = np.concatenate([prompt, resp])
            rows.append(row)
    tokens = np.stack(rows)
    packed = pack_groups(tokens, np.repeat(plen, n), rlen.reshape(-1), np.repeat(np.arange(g), n),
                         prompt_width=p, response_width=r)
    width = tokens.shape[1]
    w = jnp.asarray(rng.normal(size=(g * n, width - 1)), jnp.float32)

    def slow(prm):
        lp, z = packed_token_logprobs(prm, config, packed, width=width, temperature=1.3)
        logq = jax.nn.log_softmax(z, -1)
        return jnp.sum(w * lp), (lp, -(jnp.exp(logq) * logq).sum(-1))

    def fast(prm):
        lp, ent = packed_token_logprobs_fused(prm, config, packed, width=width,
                                              temperature=1.3, chunk=4)
        return jnp.sum(w * lp), (lp, ent)

    (_, (lp0, ent0)), g0 = jax.value_and_grad(slow, has_aux=True)(params)
    (_, (lp1, ent1)), g1 = jax.value_and_grad(fast, has_aux=True)(params)
    predicting = np.zeros((g * n, width - 1), bool)
    for b in range(g * n):
        pl, rl = plen[b // n], rlen.reshape(-1)[b]
        predicting[b, pl - 1:pl - 1 + rl] = True
    np.testing.assert_allclose(lp1, lp0, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.where(predicting, ent1, 0), np.where(predicting, ent0, 0),
                               atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(ent1)[~predicting]) and np.all(np.asarray(ent1)[predicting] > 0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(b).max() + 1e-6), rtol=1e-4)


def test_bf16_head_backward_multiplies_in_bf16_against_float64():
    """head_logits (the bf16 head): fp32 logits; its backward rounds the fp32
    cotangent to bf16 and multiplies in bf16 with fp32 accumulation -- checked against the
    float64 products of exactly those bf16 values; and chunked_logprobs on bf16 inputs
    takes that path (its gradient wrt the head equals the float64 one to bf16 rounding)."""
    from models.logprobs import head_logits

    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((6, 16)), jnp.bfloat16)
    head = jnp.asarray(0.2 * rng.standard_normal((16, 40)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((6, 40)), jnp.float32)
    z, vjp = jax.vjp(head_logits, h, head)
    f64 = lambda x: np.asarray(x, np.float64)
    assert z.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(z), f64(h) @ f64(head), rtol=1e-5, atol=1e-5)
    dh, dhead = vjp(g)
    assert dh.dtype == jnp.bfloat16 and dhead.dtype == jnp.bfloat16
    gb = f64(g.astype(jnp.bfloat16))           # the cotangent rounded to bf16 first
    np.testing.assert_allclose(f64(dh), gb @ f64(head).T, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(f64(dhead), f64(h).T @ gb, rtol=1e-2, atol=1e-2)

    targets = jnp.asarray(rng.integers(0, 40, 6))

    def loss(head):
        return chunked_logprobs(h, head, targets, 1.0, chunk=4)[0].sum()
    grad = jax.grad(loss)(head)
    z64 = f64(h) @ f64(head)
    p = np.exp(z64 - z64.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = f64(h).T @ (np.eye(40)[np.asarray(targets)] - p)  # d sum(logp) / d head
    np.testing.assert_allclose(f64(grad), want, rtol=3e-2, atol=3e-2)
    text = str(jax.make_jaxpr(jax.grad(loss))(head))
    assert "custom_vjp_call" in text


@pytest.mark.parametrize("n,chunk", [(1100, 1024), (2032, 1024), (5, 2), (7, 100)])
def test_chunks_are_equal_and_pad_less_than_one_row_per_chunk(n, chunk):
    """The n tokens run as k = ceil(n / chunk) equal chunks: the head's matmuls cover at most
    n + k - 1 rows (chunks of exactly `chunk` would cover up to n + chunk - 1), with the
    values of the full logits."""
    from experiments.common.jaxpr_flops import matmul_flops

    e, v = 8, 32
    rng = np.random.default_rng(n)
    h = jnp.asarray(rng.standard_normal((n, e)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, v)), jnp.float32)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    logp, _ = chunked_logprobs(h, w, t, 1.0, chunk=chunk)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    ref = z[np.arange(n), np.asarray(t)] - np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(np.asarray(logp), ref, atol=1e-4)
    rows = matmul_flops(lambda h: chunked_logprobs(h, w, t, 1.0, chunk=chunk)[0], h) // (2 * e * v)
    k = -(-n // min(chunk, n))
    assert n <= rows <= n + k - 1
