"""The packed shared-prefix layout (DualKV), shared by `models.decoder` (the segmented
sampler's `prefill_segments`) and `models.packed` (the packed learner forward); it imports
neither.

A group is laid out [prompt (P, right-padded), resp_1, ..., resp_N (each R, right-padded)]:
P + N*R tokens. Positions run 0..P-1 over the prompt and restart at prompt_length for every
response.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class PackedGroups:
    """A batch of G groups of N responses sharing their prompt (a pytree; host or device).

    prompt_tokens [G, P] int32 (right-padded); prompt_lengths [G] int32 in [1, P];
    response_tokens [G, N, R] int32 (right-padded); response_lengths [G, N] int32 in [0, R];
    rows [G, N] int32: the row of the naive batch that response (g, n) came from.
    """

    prompt_tokens: jax.Array
    prompt_lengths: jax.Array
    response_tokens: jax.Array
    response_lengths: jax.Array
    rows: jax.Array


def packed_tokens_and_positions(prompt_tokens, prompt_lengths, response_tokens):
    """tokens and positions [G, P + N*R] of the packed layout.

    prompt_tokens [G, P]; prompt_lengths [G]; response_tokens [G, N, R]. Prompt positions
    are 0..P-1; response n's token t sits at position prompt_lengths[g] + t.
    """
    g, p = prompt_tokens.shape
    _, n, r = response_tokens.shape
    tokens = jnp.concatenate([prompt_tokens, response_tokens.reshape(g, n * r)], axis=1)
    resp_pos = prompt_lengths[:, None, None] + jnp.arange(r, dtype=jnp.int32)
    resp_pos = jnp.broadcast_to(resp_pos, (g, n, r)).reshape(g, n * r)
    prompt_pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (g, p))
    return tokens, jnp.concatenate([prompt_pos, resp_pos.astype(jnp.int32)], axis=1)
