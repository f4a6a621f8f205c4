"""Pure-JAX segment decode attention: one partial softmax state per segment, merged.

Prompt segment: the group's N queries are folded into one [N * heads_per_kv, head_dim]
matrix per kv head and multiplied against the prompt keys once (Hydragen), so the prompt
KV is read once per group per step instead of N times. Response segment: a batched
per-sample product with ragged-length masks. The two states merge in float32.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from kernels.segment_decode.layout import fold_for_prompt, split_heads, unfold_from_prompt
from kernels.segment_decode.merge import merge_attention_states, new_token_state


def _partial_state(
    s: jax.Array, valid: jax.Array, v: jax.Array, out_spec: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalised partial state from fp32 scores s [..., keys] and validity mask (broadcastable).

    `out_spec` is the einsum "scores,values->out" used for p @ v.
    """
    m = jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - m_safe[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    # p is cast to v's dtype for the product (as a fused kernel would); accumulate in fp32.
    o = jnp.einsum(out_spec, p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    return o, m, l


def _empty_state(shape: tuple[int, ...], head_dim: int):
    return (jnp.zeros(shape + (head_dim,), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32))


def prompt_state_xla(q, k_prompt, v_prompt, prompt_lengths, sm_scale):
    """Partial state over the shared prompt segment.

    q [groups, N, heads, d], k/v_prompt [groups, P, kv_heads, d], prompt_lengths [groups]
    -> (o [groups, N, kv_heads, heads_per_kv, d], m, l [groups, N, kv_heads, heads_per_kv]).
    """
    g, n, h, d = q.shape
    p, kvh = k_prompt.shape[1], k_prompt.shape[2]
    if p == 0:
        return _empty_state((g, n, kvh, h // kvh), d)
    qf = fold_for_prompt(q, kvh)  # [g, kvh, n * hpk, d]
    s = jnp.einsum("gkmd,gpkd->gkmp", qf, k_prompt, preferred_element_type=jnp.float32)
    valid = (jnp.arange(p)[None, :] < prompt_lengths[:, None])[:, None, None, :]
    o, m, l = _partial_state(s * sm_scale, valid, v_prompt, "gkmp,gpkd->gkmd")
    return unfold_from_prompt(o, n), unfold_from_prompt(m, n), unfold_from_prompt(l, n)


def response_state_xla(q, k_resp, v_resp, resp_lengths, sm_scale):
    """Partial state over each sample's own response segment.

    q [groups, N, heads, d], k/v_resp [groups, N, R_max, kv_heads, d], resp_lengths [groups, N]
    -> (o [groups, N, kv_heads, heads_per_kv, d], m, l [groups, N, kv_heads, heads_per_kv]).
    """
    g, n, h, d = q.shape
    r_max, kvh = k_resp.shape[2], k_resp.shape[3]
    if r_max == 0:
        return _empty_state((g, n, kvh, h // kvh), d)
    q5 = split_heads(q, kvh)
    s = jnp.einsum("gnkhd,gnrkd->gnkhr", q5, k_resp, preferred_element_type=jnp.float32)
    valid = (jnp.arange(r_max)[None, None, :] < resp_lengths[:, :, None])[:, :, None, None, :]
    return _partial_state(s * sm_scale, valid, v_resp, "gnkhr,gnrkd->gnkhd")


@partial(jax.jit, static_argnames=("sm_scale",))
def segment_decode_attention_xla(
    q: jax.Array, k_prompt: jax.Array, v_prompt: jax.Array, k_resp: jax.Array,
    v_resp: jax.Array, prompt_lengths: jax.Array, resp_lengths: jax.Array,
    k_new: jax.Array | None = None, v_new: jax.Array | None = None, *, sm_scale: float,
) -> jax.Array:
    """XLA segment decode attention (inputs already validated by the public entry).

    Shapes as in `kernels.segment_decode.segment_decode_attention`; returns
    [groups, N, heads, head_dim] in q's dtype. k_new, v_new [groups, N, kv_heads, d]
    (optional): one more key per sample, outside the segments, merged as a third state.
    """
    g, n, h, d = q.shape
    o, m, l = merge_attention_states(
        *prompt_state_xla(q, k_prompt, v_prompt, prompt_lengths, sm_scale),
        *response_state_xla(q, k_resp, v_resp, resp_lengths, sm_scale),
    )
    if k_new is not None:
        o, _, _ = merge_attention_states(o, m, l, *new_token_state(q, k_new, v_new, sm_scale))
    return o.reshape(g, n, h, d).astype(q.dtype)
