"""Tree-of-segments decode attention: samples of a group that share a response prefix read
it from the segment that wrote it, instead of from a copy.

A rollout tree (rl.rollout.tree_sampler) forks a live sample p into a child c at response
index f: c's first f response tokens are p's. In the segmented cache each sample writes
its keys into its own response segment at their absolute response index, so c never
writes entries < f of its own segment and reads them from p's segment instead. In
general sample i of a group reads, from each sample j's response segment, the entries

    resp_lo[g, i, j] <= r < resp_hi[g, i, j]

(an empty span where lo >= hi). For a tree these spans are disjoint and, laid end to end
along i's root-to-leaf path, cover [0, len_i): the root's segment up to the first fork on
the path, the next segment from there up to the next fork, ..., i's own segment from its
fork to its length. The diagonal span (lo[g, i, i], hi[g, i, i]) is i's own segment. With
lo = 0, hi = diag(resp_lengths) this is `segment_decode_attention` exactly.

  tree_decode_attention_reference   gathers each sample's keys along its path into one
                                    replicated [P + N * R] key set and runs a masked softmax
  tree_decode_attention_xla         the prompt state as in segment decode (the group's N
                                    queries folded, Hydragen), then one masked state over
                                    every segment of the group ([N, R] keys per query), merged

  tree_decode_attention_pallas      the prompt kernel of `pallas.py` (folded queries) and a
                                    response kernel over grid (groups, N, kv_heads, N
                                    segments, tiles): program (g, i, ·, j, t) reads tile t of
                                    segment j only if it overlaps i's span there, so a query
                                    loads its path's keys and nothing else; states reduced
                                    over (segment, tile) and merged in float32

The XLA path reads N response segments per query, N times the work of the segment decode's
own-segment read: it trades decode FLOPs for not copying (and not storing twice) a shared
prefix. The Pallas kernel is written for Triton (GPU); on CPU it runs in interpret mode,
which is how it is tested, and it lowers for "cuda" (tests/kernels/test_tree_decode.py).
It has not been measured on a GPU, so impl=None takes the XLA path on every platform;
"pallas" / "pallas_triton" select the kernel. No Mosaic (TPU) twin yet.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.dispatch import by_platform
from kernels.segment_decode.api import _check_inputs, _check_lengths, _check_scale_and_new
from kernels.segment_decode.layout import split_heads
from kernels.segment_decode.merge import (
    merge_attention_states,
    new_token_state,
    reduce_attention_states,
)
from kernels.segment_decode.pallas import MIN_ROWS, prompt_state_pallas, tile_state
from kernels.segment_decode.pallas import _compiler_params as triton_compiler_params
from kernels.segment_decode.pallas import _next_pow2 as next_pow2
from kernels.segment_decode.pallas import _pad_axis as pad_axis
from kernels.segment_decode.reference import masked_decode_attention
from kernels.segment_decode.xla import _partial_state, prompt_state_xla

TREE_IMPLS = ("reference", "xla", "pallas", "pallas_triton")


def tree_span_mask(resp_lo: jax.Array, resp_hi: jax.Array, r_max: int) -> jax.Array:
    """[groups, N, N, R] bool: may sample i read entry r of sample j's segment."""
    r = jnp.arange(r_max)[None, None, None, :]
    return (r >= resp_lo[..., None]) & (r < resp_hi[..., None])


@partial(jax.jit, static_argnames=("sm_scale",))
def tree_decode_attention_reference(q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths,
                                    resp_lo, resp_hi, k_new=None, v_new=None, *,
                                    sm_scale: float) -> jax.Array:
    """Every sample gets its own copy of the prompt and of all N response segments of its
    group, masked to its spans, plus k_new as one more key; a plain masked softmax."""
    g, n, r_max = k_resp.shape[:3]
    p = k_prompt.shape[1]
    def tile(x):  # [g, ...] -> [g, n, ...]: one copy per sample
        return jnp.broadcast_to(x[:, None], (g, n) + x.shape[1:])

    def flat(x):  # [g, n, R, ...] -> [g, n, n * R, ...]: every sample gets all n segments
        return tile(x).reshape(g, n, n * r_max, *x.shape[3:])

    k = jnp.concatenate([tile(k_prompt), flat(k_resp)], axis=2)
    v = jnp.concatenate([tile(v_prompt), flat(v_resp)], axis=2)
    prompt_valid = jnp.broadcast_to(
        jnp.arange(p)[None, None, :] < prompt_lengths[:, None, None], (g, n, p))
    resp_valid = tree_span_mask(resp_lo, resp_hi, r_max).reshape(g, n, n * r_max)
    valid = jnp.concatenate([prompt_valid, resp_valid], axis=2)
    if k_new is not None:
        k = jnp.concatenate([k, k_new[:, :, None].astype(k.dtype)], axis=2)
        v = jnp.concatenate([v, v_new[:, :, None].astype(v.dtype)], axis=2)
        valid = jnp.concatenate([valid, jnp.ones((g, n, 1), bool)], axis=2)
    return masked_decode_attention(q, k, v, valid, sm_scale)


def tree_response_state_xla(q, k_resp, v_resp, resp_lo, resp_hi, sm_scale):
    """Partial state over the spans of the group's response segments.

    q [groups, N, heads, d], k/v_resp [groups, N, R, kv_heads, d], resp_lo/hi [groups, N, N]
    -> (o [groups, N, kv_heads, heads_per_kv, d], m, l [groups, N, kv_heads, heads_per_kv]).
    """
    g, n, r_max, kvh, d = k_resp.shape
    q5 = split_heads(q, kvh)  # [g, i, k, h, d]
    s = jnp.einsum("gikhd,gjrkd->gikhjr", q5, k_resp, preferred_element_type=jnp.float32)
    valid = tree_span_mask(resp_lo, resp_hi, r_max)[:, :, None, None]  # [g, i, 1, 1, j, r]
    s = s.reshape(*s.shape[:4], n * r_max)
    valid = valid.reshape(g, n, 1, 1, n * r_max)
    v = v_resp.reshape(g, n * r_max, kvh, d)
    return _partial_state(s * sm_scale, valid, v, "gikhx,gxkd->gikhd")


@partial(jax.jit, static_argnames=("sm_scale",))
def tree_decode_attention_xla(q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths,
                              resp_lo, resp_hi, k_new=None, v_new=None, *,
                              sm_scale: float) -> jax.Array:
    """Prompt state (folded queries) merged with the span-masked state over the group's
    response segments, then with k_new's (module doc)."""
    g, n, h, d = q.shape
    o, m, l = merge_attention_states(
        *prompt_state_xla(q, k_prompt, v_prompt, prompt_lengths, sm_scale),
        *tree_response_state_xla(q, k_resp, v_resp, resp_lo, resp_hi, sm_scale))
    if k_new is not None:
        o, _, _ = merge_attention_states(o, m, l, *new_token_state(q, k_new, v_new, sm_scale))
    return o.reshape(g, n, h, d).astype(q.dtype)


def _tree_response_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                          sm_scale: float, block_k: int):
    """q_ref [rows, d] (sample i, one kv head); k_ref, v_ref [block_k, d] (tile t of sample
    j's segment); lo_ref, hi_ref [1]: i's span in j. Writes the tile's partial state."""
    lo, hi = lo_ref[0], hi_ref[0]
    start = pl.program_id(4) * block_k
    rows, d = q_ref.shape

    def compute():  # the tile overlaps the span
        r = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        return tile_state(q_ref, k_ref, v_ref, (r >= lo) & (r < hi), sm_scale)

    def empty():
        return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
                jnp.zeros((rows,), jnp.float32))

    o, m, l = lax.cond((start < hi) & (start + block_k > lo) & (lo < hi), compute, empty)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _span_spec():
    return pl.BlockSpec((None, None, None, 1), lambda gi, i, hi, j, t: (gi, i, j, 0))


def _state_spec(*tail):
    return pl.BlockSpec((None, None, None, None, None) + tail,
                        lambda gi, i, hi, j, t: (gi, i, hi, j, t) + (0,) * len(tail))


def tree_response_state_pallas(q, k_resp, v_resp, resp_lo, resp_hi, *, sm_scale, block_k,
                               interpret):
    """The Pallas twin of `tree_response_state_xla` (same shapes)."""
    g, n, h, d = q.shape
    r_max, kvh = k_resp.shape[2], k_resp.shape[3]
    hpk = h // kvh
    rows = max(MIN_ROWS, next_pow2(hpk))
    q5 = pad_axis(split_heads(q, kvh), 3, rows)  # [g, n, kvh, rows, d]
    r_pad = pl.cdiv(r_max, block_k) * block_k
    k_resp, v_resp = pad_axis(k_resp, 2, r_pad), pad_axis(v_resp, 2, r_pad)
    tiles = r_pad // block_k
    kv_spec = pl.BlockSpec((None, None, block_k, None, d),
                           lambda gi, i, hi, j, t: (gi, j, t, hi, 0))
    o, m, l = pl.pallas_call(
        partial(_tree_response_kernel, sm_scale=sm_scale, block_k=block_k),
        grid=(g, n, kvh, n, tiles),
        in_specs=[_span_spec(), _span_spec(),
                  pl.BlockSpec((None, None, None, rows, d),
                               lambda gi, i, hi, j, t: (gi, i, hi, 0, 0)),
                  kv_spec, kv_spec],
        out_specs=[_state_spec(rows, d), _state_spec(rows), _state_spec(rows)],
        out_shape=[jax.ShapeDtypeStruct((g, n, kvh, n, tiles, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((g, n, kvh, n, tiles, rows), jnp.float32),
                   jax.ShapeDtypeStruct((g, n, kvh, n, tiles, rows), jnp.float32)],
        compiler_params=triton_compiler_params(),
        interpret=interpret,
        name="tree_decode_response",
    )(resp_lo.astype(jnp.int32)[..., None], resp_hi.astype(jnp.int32)[..., None], q5,
      k_resp, v_resp)
    o, m, l = (x.reshape(g, n, kvh, n * tiles, *x.shape[5:]) for x in (o, m, l))
    o, m, l = reduce_attention_states(o, m, l, axis=3)  # [g, n, kvh, rows(, d)]
    return o[:, :, :, :hpk], m[:, :, :, :hpk], l[:, :, :, :hpk]


@partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret"))
def tree_decode_attention_pallas(q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths,
                                 resp_lo, resp_hi, k_new=None, v_new=None, *, sm_scale: float,
                                 block_k: int = 128, interpret: bool = False) -> jax.Array:
    """Pallas (Triton) tree decode attention (inputs validated by the public entry); a
    head_dim that is not a power of two >= 16 is zero-padded to one."""
    g, n, h, d = q.shape
    dp = max(MIN_ROWS, next_pow2(d))
    if dp != d:  # Triton tiles: zero columns change nothing
        q, k_prompt, v_prompt, k_resp, v_resp, k_new, v_new = (
            None if x is None else pad_axis(x, x.ndim - 1, dp)
            for x in (q, k_prompt, v_prompt, k_resp, v_resp, k_new, v_new))
        return tree_decode_attention_pallas(
            q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lo, resp_hi, k_new,
            v_new, sm_scale=sm_scale, block_k=block_k, interpret=interpret)[..., :d]
    if k_prompt.shape[1] == 0:
        prompt = prompt_state_xla(q, k_prompt, v_prompt, prompt_lengths, sm_scale)  # empty
    else:
        prompt = prompt_state_pallas(q, k_prompt, v_prompt, prompt_lengths, sm_scale=sm_scale,
                                     block_k=block_k, blocks_per_split=4, block_q=64,
                                     interpret=interpret)
    resp = tree_response_state_pallas(q, k_resp, v_resp, resp_lo, resp_hi, sm_scale=sm_scale,
                                      block_k=block_k, interpret=interpret)
    o, m, l = merge_attention_states(*prompt, *resp)
    if k_new is not None:
        o, _, _ = merge_attention_states(o, m, l, *new_token_state(q, k_new, v_new, sm_scale))
    return o.reshape(g, n, h, d).astype(q.dtype)


def tree_decode_attention(q: jax.Array, k_prompt: jax.Array, v_prompt: jax.Array,
                          k_resp: jax.Array, v_resp: jax.Array, *, prompt_lengths: jax.Array,
                          resp_lo: jax.Array, resp_hi: jax.Array,
                          k_new: jax.Array | None = None, v_new: jax.Array | None = None,
                          sm_scale: float | None = None, impl: str | None = None,
                          block_k: int = 128, interpret: bool | None = None) -> jax.Array:
    """Decode attention of a group's samples over the shared prompt and a tree of response
    segments (module doc).

    Args:
      q: [groups, N, heads, head_dim]; k/v_prompt [groups, P, kv_heads, head_dim];
      k/v_resp: [groups, N, R, kv_heads, head_dim].
      prompt_lengths: [groups] int in [0, P].
      resp_lo, resp_hi: [groups, N, N] int in [0, R]: sample i reads entries
        resp_lo[g, i, j] <= r < resp_hi[g, i, j] of sample j's segment (clipped under jit).
      k_new, v_new: [groups, N, kv_heads, head_dim] (optional, together): the query's own
        key / value, one more valid key outside the segments.
      sm_scale: None = 1 / sqrt(head_dim). impl: "reference" | "xla" | "pallas" |
        "pallas_triton" | None (= "xla"; module doc). block_k: the kernel's key tile (a
        power of two >= 16). interpret: the kernel in interpret mode; None = compiled when
        lowered for GPU, interpreted elsewhere.
    Returns:
      [groups, N, heads, head_dim] in q's dtype; zeros for a query with no valid key.
    """
    if impl is None:
        impl = "xla"
    if impl not in TREE_IMPLS:
        raise ValueError(f"tree_decode_attention: impl must be one of {TREE_IMPLS} or None "
                         f"(no Mosaic kernel reads a tree of segments yet), got {impl!r}")
    if isinstance(block_k, bool) or not isinstance(block_k, int) or block_k < 16 \
            or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k!r}")
    _check_inputs(q, k_prompt, v_prompt, k_resp, v_resp)
    g, n = q.shape[:2]
    r_max = k_resp.shape[2]
    prompt_lengths = _check_lengths(prompt_lengths, "prompt_lengths", (g,), k_prompt.shape[1])
    resp_lo = _check_lengths(resp_lo, "resp_lo", (g, n, n), r_max)
    resp_hi = _check_lengths(resp_hi, "resp_hi", (g, n, n), r_max)
    sm_scale, k_new, v_new = _check_scale_and_new(q, k_prompt, sm_scale, k_new, v_new)
    args = (q, k_prompt, v_prompt, k_resp, v_resp, prompt_lengths, resp_lo, resp_hi, k_new,
            v_new)
    if impl in ("pallas", "pallas_triton"):
        kernel = partial(tree_decode_attention_pallas, sm_scale=sm_scale, block_k=block_k)
        if interpret is not None:
            return kernel(*args, interpret=interpret)
        interpreted = partial(kernel, interpret=True)  # off a GPU (a TPU included)
        return by_platform(*args, gpu=partial(kernel, interpret=False), tpu=interpreted,
                           default=interpreted)
    fn = tree_decode_attention_reference if impl == "reference" else tree_decode_attention_xla
    return fn(*args, sm_scale=sm_scale)
