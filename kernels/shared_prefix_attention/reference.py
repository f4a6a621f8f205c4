"""Naive shared-prefix attention: N copies of [prompt, resp_n], dense causal mask.

Computed in float32, or in float64 for float64 inputs (so float64 tests compare exactly).

Obviously correct and slow (it recomputes the prompt N times); the other
implementations are tested against it. Differentiable by plain autodiff.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.shared_prefix_attention.inputs import MASK_VALUE


def shared_prefix_attention_reference(
    q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp,
    prompt_lengths, resp_lengths, sm_scale: float,
):
    """Shared-prefix attention by materialising the naive batch.

    Args: q_prompt `[G, P, H, D]`, k_prompt/v_prompt `[G, P, KH, D]`, q_resp
      `[G, N, R, H, D]`, k_resp/v_resp `[G, N, R, KH, D]`, prompt_lengths `[G]` int32,
      resp_lengths `[G, N]` int32 (already validated), sm_scale float.
    Returns: (o_prompt `[G, P, H, D]`, o_resp `[G, N, R, H, D]`) in the input dtype;
      rows beyond the lengths are zero.
    """
    dtype = q_prompt.dtype
    acc = jnp.promote_types(dtype, jnp.float32)
    g, n, r, h, _ = q_resp.shape
    p = q_prompt.shape[1]
    rep = h // k_prompt.shape[2]

    def naive_batch(prompt, resp):
        # [G, P, h, D] + [G, N, R, h, D] -> [G, N, P+R, h, D] in `acc`, one copy per response
        copies = jnp.broadcast_to(prompt[:, None], (g, n) + prompt.shape[1:])
        return jnp.concatenate([copies, resp], axis=2).astype(acc)

    q = naive_batch(q_prompt, q_resp)
    # GQA: repeat every kv head for the `rep` query heads that share it
    k = jnp.repeat(naive_batch(k_prompt, k_resp), rep, axis=3)
    v = jnp.repeat(naive_batch(v_prompt, v_resp), rep, axis=3)

    pos = jnp.arange(p + r)
    in_prompt = pos < p
    # [G, N, P+R]: a token is valid if inside its segment's length
    valid = jnp.where(in_prompt[None, None, :],
                      pos[None, None, :] < prompt_lengths[:, None, None],
                      (pos - p)[None, None, :] < resp_lengths[:, :, None])
    causal = pos[:, None] >= pos[None, :]                       # [P+R (q), P+R (k)]
    mask = causal[None, None] & valid[:, :, None, :]            # [G, N, P+R, P+R]

    s = jnp.einsum("gnqhd,gnkhd->gnhqk", q, k,
                   precision=jax.lax.Precision.HIGHEST) * sm_scale
    s = jnp.where(mask[:, :, None], s, MASK_VALUE)
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("gnhqk,gnkhd->gnqhd", w, v, precision=jax.lax.Precision.HIGHEST)
    o = jnp.where(valid[..., None, None], o, 0.0).astype(dtype)
    # every copy holds the same prompt output; copy 0 is the answer
    return o[:, 0, :p], o[:, :, p:]
