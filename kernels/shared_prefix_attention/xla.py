"""Shared-prefix attention in plain XLA: the prompt is attended once, not N times.

Prompt queries: causal attention over the prompt. Response queries: one softmax over the
block-masked scores [prompt keys | own response keys]; responses never meet each other,
so the cost is P^2 + N*R*(P+R) instead of N*(P+R)^2. Grouped-query attention is done by
folding the query heads as [kv_heads, rep] so K/V are never repeated.
Differentiable by plain autodiff; softmax in fp32, matmuls accumulate in fp32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.shared_prefix_attention.inputs import MASK_VALUE

_F32 = jnp.float32


def shared_prefix_attention_xla(
    q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp,
    prompt_lengths, resp_lengths, sm_scale: float,
):
    """Same contract as `shared_prefix_attention_reference` (validated inputs).

    Args: q_prompt `[G, P, H, D]`, k_prompt/v_prompt `[G, P, KH, D]`, q_resp
      `[G, N, R, H, D]`, k_resp/v_resp `[G, N, R, KH, D]`, prompt_lengths `[G]` int32,
      resp_lengths `[G, N]` int32, sm_scale float.
    Returns: (o_prompt `[G, P, H, D]`, o_resp `[G, N, R, H, D]`) in the input dtype.
    """
    dtype = q_prompt.dtype
    g, p, h, d = q_prompt.shape
    n, r = q_resp.shape[1], q_resp.shape[2]
    kvh = k_prompt.shape[2]
    rep = h // kvh

    p_pos = jnp.arange(p)
    r_pos = jnp.arange(r)
    p_valid = p_pos[None, :] < prompt_lengths[:, None]              # [G, P]
    r_valid = r_pos[None, None, :] < resp_lengths[:, :, None]       # [G, N, R]

    # --- prompt queries: causal over the valid prompt
    qp = q_prompt.reshape(g, p, kvh, rep, d)
    s = jnp.einsum("gqkrd,gskd->gkrqs", qp, k_prompt, preferred_element_type=_F32)
    mask = (p_pos[:, None] >= p_pos[None, :])[None] & p_valid[:, None, :]   # [G, P, P]
    s = jnp.where(mask[:, None, None], s * sm_scale, MASK_VALUE)
    w = jax.nn.softmax(s, axis=-1)
    o_prompt = jnp.einsum("gkrqs,gskd->gqkrd", w.astype(dtype), v_prompt,
                          preferred_element_type=_F32)
    o_prompt = jnp.where(p_valid[:, :, None, None, None], o_prompt, 0.0)
    o_prompt = o_prompt.reshape(g, p, h, d).astype(dtype)

    # --- response queries: [all valid prompt keys | own causal response keys]
    qr = q_resp.reshape(g, n, r, kvh, rep, d)
    s_pr = jnp.einsum("gnjkrd,gskd->gnkrjs", qr, k_prompt, preferred_element_type=_F32)
    s_rr = jnp.einsum("gnjkrd,gntkd->gnkrjt", qr, k_resp, preferred_element_type=_F32)
    mask_pr = p_valid[:, None, None, None, None, :]                          # keys only
    mask_rr = ((r_pos[:, None] >= r_pos[None, :])[None, None]
               & r_valid[:, :, None, :])[:, :, None, None]                  # [G,N,1,1,R,R]
    s = jnp.concatenate([jnp.where(mask_pr, s_pr * sm_scale, MASK_VALUE),
                         jnp.where(mask_rr, s_rr * sm_scale, MASK_VALUE)], axis=-1)
    w = jax.nn.softmax(s, axis=-1).astype(dtype)
    o_resp = (jnp.einsum("gnkrjs,gskd->gnjkrd", w[..., :p], v_prompt,
                         preferred_element_type=_F32)
              + jnp.einsum("gnkrjt,gntkd->gnjkrd", w[..., p:], v_resp,
                           preferred_element_type=_F32))
    o_resp = jnp.where(r_valid[..., None, None, None], o_resp, 0.0)
    o_resp = o_resp.reshape(g, n, r, h, d).astype(dtype)
    return o_prompt, o_resp
