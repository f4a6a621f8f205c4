"""Log-probabilities of given tokens under a model: the one place the learner, the exact
proximal policy (rl.learner.proximal) and VCPO's per-trajectory gradients get log π from.

The logit at position t predicts token t+1, so the log-probs of a [B, T] row are
[B, T-1]: logp[b, t] = log softmax(logits[b, t] / T)[tokens[b, t+1]] at temperature T
(the sampler's). The packed shared-prefix twin is `models.packed.packed_token_logprobs`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.decoder import forward

Params = Any


def token_logprobs(params: Params, model_config: ModelConfig, tokens: jax.Array,
                   positions: jax.Array, temperature: float, attn_impl: str | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """(logp [B, T-1], scaled logits [B, T-1, V]): logp[b, t] = log softmax(logits[b, t] / T)
    at tokens[b, t + 1], i.e. the log-prob of token t+1 (the logit at t predicts t+1)."""
    logits = forward(params, model_config, tokens, positions, attn_impl=attn_impl)
    z = logits[:, :-1].astype(jnp.float32) / temperature
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(z, target[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1), z
