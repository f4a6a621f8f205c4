"""Log-probabilities of given tokens under a model: the one place the learner, the exact
proximal policy (rl.learner.proximal) and VCPO's per-trajectory gradients get log π from.

The logit at position t predicts token t+1, so the log-probs of a [B, T] row are
[B, T-1]: logp[b, t] = log softmax(logits[b, t] / T)[tokens[b, t+1]] at temperature T
(the sampler's). The packed shared-prefix twins are in `models.packed`.

Two paths with the same results (to float rounding; tests/models/test_logprobs.py):

  * `token_logprobs` (the slow twin): the full logits [B, T-1, V] in float32, then
    log-softmax and a gather. With V = 49,152 (SmolLM2) that is 200 KB per token, and the
    backward holds several such arrays: gigabytes for a few thousand tokens.
  * `token_logprobs_fused`: the model stops at the final-normed hidden states [B, T, E];
    `chunked_logprobs` applies the head to C tokens at a time, keeping only log p and
    the entropy per token, and (jax.checkpoint per chunk) recomputes each chunk's logits
    in the backward instead of storing them, so at most [C, V] logits exist at once.
    Per token: logp = z[y] - logsumexp(z), H = logsumexp(z) - Σ_v softmax(z)_v z_v, with
    z = h @ W / T. With a bf16 compute dtype the head's backward matmuls run in bf16 as its
    forward does (`head_logits`; fp32 accumulation, fp32 logits and softmax).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.config import ModelConfig
from models.decoder import Params, forward, hidden_states
from models.weight_grads import contract_tokens

DEFAULT_CHUNK = 1024  # tokens per head chunk: [1024, 49152] fp32 logits = 200 MB
LOGITS_NAME = "head_logits"  # the chunk logits' name for keep_logits's remat policy


def head_chunk_for_memory(vocab_size: int, memory_bytes: int | None, *, share: float = 1 / 16,
                          smallest: int = 256, largest: int = 16384) -> int:
    """Tokens per head chunk for a device with memory_bytes of memory: the largest power
    of two C whose chunk -- C x vocab_size fp32 logits and the two arrays of that size the
    backward adds (softmax, gradient) -- takes at most `share` of it, clamped to
    [smallest, largest]. Fewer, larger chunks mean fewer loop iterations (an accelerator
    pays per iteration); DEFAULT_CHUNK when memory_bytes is None (e.g. a CPU, whose memory
    the rest of the step needs). E.g. 80 GB: qwen2.5 (V = 151,936) 2048, SmolLM2
    (V = 49,152) 8192."""
    if memory_bytes is None:
        return DEFAULT_CHUNK
    if not memory_bytes > 0 or not 0 < share <= 1 or not 1 <= smallest <= largest:
        raise ValueError(f"head_chunk_for_memory: need memory_bytes > 0, 0 < share <= 1 and "
                         f"1 <= smallest <= largest, got {memory_bytes}, {share}, {smallest}, "
                         f"{largest}")
    fits = int(share * memory_bytes) // (3 * 4 * int(vocab_size))
    chunk = 1 << max(0, fits.bit_length() - 1) if fits >= 1 else 1
    return max(smallest, min(largest, chunk))


def head_matrix(params: Params, config: ModelConfig) -> jax.Array:
    """The vocabulary head [embed, vocab] in the compute dtype: logits = hidden @ head
    (the embedding's transpose when tied, else lm_head/kernel)."""
    dt = jnp.dtype(config.dtype)
    if config.tie_word_embeddings:
        return params["embed"]["embedding"].astype(dt).T
    return params["lm_head"]["kernel"].astype(dt)


def token_logprobs(params: Params, model_config: ModelConfig, tokens: jax.Array,
                   positions: jax.Array, temperature: float, attn_impl: str | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """(logp [B, T-1], scaled logits [B, T-1, V]): logp[b, t] = log softmax(logits[b, t] / T)
    at tokens[b, t + 1], i.e. the log-prob of token t+1 (the logit at t predicts t+1).
    The slow twin of `token_logprobs_fused` (materialises every logit)."""
    logits = forward(params, model_config, tokens, positions, attn_impl=attn_impl)
    z = logits[:, :-1].astype(jnp.float32) / temperature
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(z, target[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1), z


@jax.custom_vjp
def head_logits(h: jax.Array, head: jax.Array) -> jax.Array:
    """fp32 logits [C, V] = h [C, E] @ head [E, V]. The backward multiplies in h's dtype:
    for low-precision (bf16) h and head the fp32 cotangent of the logits is rounded to
    bf16 before both backward matmuls (fp32 accumulation, results in the operands'
    dtypes), where plain autodiff would run them in fp32 (the vocabulary head is the
    largest matmul of a small model's step; only the logits and their softmax need fp32).
    For fp32 it is plain autodiff's math. The head's gradient hᵀ g comes from
    models.weight_grads.contract_tokens (a canonical dot on CPU)."""
    return jnp.einsum("ce,ev->cv", h, head, preferred_element_type=jnp.float32)


def _head_logits_fwd(h, head):
    return head_logits(h, head), (h, head)


def _head_logits_bwd(res, g):
    h, head = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("cv,ev->ce", g, head, preferred_element_type=jnp.float32)
    dhead = contract_tokens(h, g, 1, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), dhead.astype(head.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def _chunk_stats(h: jax.Array, head: jax.Array, targets: jax.Array, temperature: jax.Array,
                 entropy: bool) -> tuple[jax.Array, jax.Array]:
    """(logp [C], entropy [C] or zeros) of one chunk: h [C, E], head [E, V], targets [C]."""
    # bf16 compute: the backward in bf16 too; named so that keep_logits can save it
    z = checkpoint_name(head_logits(h, head), LOGITS_NAME) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, targets[:, None], axis=-1)[:, 0]
    if not entropy:
        return picked - lse, jnp.zeros_like(lse)
    p = jnp.exp(z - lse[:, None])
    return picked - lse, lse - jnp.sum(p * z, axis=-1)


def chunked_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array,
                     temperature: float | jax.Array, *, chunk: int = DEFAULT_CHUNK,
                     entropy: bool = True, keep_logits: bool = False
                     ) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies of softmax(hidden @ head / temperature), C tokens at a time.

    Args:
      hidden: [..., E] final-normed hidden states; head: [E, V]; targets: [...] int token
        ids (the ones whose log-prob is wanted); chunk: C, the most tokens per head
        application (the n tokens run as ceil(n / C) equal chunks).
      entropy: compute the entropy too (else zeros; saves a pass over each chunk's logits).
      keep_logits: keep every chunk's fp32 logits for the backward (tokens x V x 4 bytes in
        all) instead of recomputing them there (one more head matmul, the largest of a
        small model). Same values either way.
    Returns:
      (logp [...], entropy [...]) float32. Differentiable in hidden and head; without
      keep_logits each chunk's [C, V] logits are recomputed in the backward, never stored.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1 (tokens per head chunk), got {chunk!r}")
    lead, e = hidden.shape[:-1], hidden.shape[-1]
    if tuple(targets.shape) != tuple(lead):
        raise ValueError(f"targets have shape {tuple(targets.shape)}, expected hidden's leading "
                         f"shape {tuple(lead)}")
    h = hidden.reshape(-1, e)
    t = targets.reshape(-1).astype(jnp.int32)
    n = h.shape[0]
    # k = ceil(n / chunk) chunks of equal size c <= chunk: the last one pads at most k - 1
    # rows (chunks of exactly `chunk` tokens would pad up to chunk - 1 rows of head matmul)
    k = max(1, -(-n // max(1, min(chunk, n))))
    c = max(1, -(-n // k))
    pad = k * c - n
    h = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, c, e)
    t = jnp.pad(t, (0, pad)).reshape(-1, c)
    temperature = jnp.asarray(temperature, jnp.float32)
    policy = jax.checkpoint_policies.save_only_these_names(LOGITS_NAME) if keep_logits else None
    one = jax.checkpoint(partial(_chunk_stats, entropy=entropy), policy=policy)
    logp, ent = jax.lax.map(lambda xs: one(xs[0], head, xs[1], temperature), (h, t))
    return logp.reshape(-1)[:n].reshape(lead), ent.reshape(-1)[:n].reshape(lead)


def token_logprobs_fused(params: Params, model_config: ModelConfig, tokens: jax.Array,
                         positions: jax.Array, temperature: float,
                         attn_impl: str | None = None, *, chunk: int = DEFAULT_CHUNK,
                         entropy: bool = True, keep_logits: bool = False
                         ) -> tuple[jax.Array, jax.Array]:
    """(logp [B, T-1], entropy [B, T-1]) of the same rows as `token_logprobs`, through the
    chunked head: never more than [chunk, V] logits at once in the forward (see the module
    docstring; keep_logits: chunked_logprobs's). entropy=False skips the entropy (zeros)."""
    hidden = hidden_states(params, model_config, tokens, positions, attn_impl=attn_impl)
    return chunked_logprobs(hidden[:, :-1], head_matrix(params, model_config), tokens[:, 1:],
                            temperature, chunk=chunk, entropy=entropy,
                            keep_logits=keep_logits)
