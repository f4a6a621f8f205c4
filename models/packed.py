"""Packed shared-prefix forward (DualKV): the N responses of one prompt run as ONE sequence.

A group is laid out [prompt (P, right-padded, prompt_lengths), resp_1, ..., resp_N (each
R, right-padded, response_lengths)]: P + N*R tokens instead of the N*(P+R) of the naive
batch of N rows [prompt, resp_n] (ratio rho = N(P+R)/(P+NR)). Positions run 0..P-1 over
the prompt and restart at prompt_length for every response. Embeddings, norms, MLPs and
projections see the prompt tokens once; attention goes through
`kernels.shared_prefix_attention` (models/decoder.py, Attention mode "packed"), so every
response attends to [valid prompt, own response] exactly as in its naive row.

Entry points:
  packed_forward            logits of the prompt and of every response token.
  packed_response_logprobs  logp [G, N, R] of each response token given prompt + prefix.
  pack_groups               host side: naive rows + group ids -> PackedGroups (checks that
                            every response of a group shares its prompt).
  groups_share_prompts      host side: whether pack_groups applies (no exception).
  packed_token_logprobs     the same log-probs scattered back into the naive [B, T-1] row
                            layout that rl.learner uses (logit at t predicts token t+1),
                            with the scaled logits [B, T-1, V] (the slow twin);
  packed_token_logprobs_fused  log-probs and entropies in that layout through the chunked
                            head (models.logprobs.chunked_logprobs): no [B, T-1, V] array.
"""
from __future__ import annotations

import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kernels.dispatch import resolve_impl
from models import lora
from models.config import ModelConfig
from models.decoder import Decoder, Params, init_params
from models.inputs import _is_concrete, validate_tokens
from models.logprobs import DEFAULT_CHUNK, chunked_logprobs, head_matrix
from models.packed_layout import PackedGroups, packed_tokens_and_positions


# ----------------------------------------------------------------------------- validation
@functools.lru_cache(maxsize=32)
def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    tree = jax.eval_shape(partial(init_params, config), jax.random.PRNGKey(0))
    return {jax.tree_util.keystr(path): leaf.shape
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_params(params: Params, config: ModelConfig) -> None:
    """Raise ValueError naming the first leaf whose presence or shape disagrees with config
    (e.g. params of a model with other head counts). Works on traced params too."""
    want = _expected_shapes(config)
    got = {jax.tree_util.keystr(path): tuple(np.shape(leaf) if not hasattr(leaf, "shape")
                                             else leaf.shape)  # LoRA / QLoRA leaves as plain
           for path, leaf in jax.tree_util.tree_flatten_with_path(lora.base_shapes(params))[0]}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"params do not match the config: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    for name, shape in want.items():
        if got[name] != shape:
            c = config
            raise ValueError(
                f"params do not match the config: {name} has shape {got[name]} but the config "
                f"(hidden_size={c.hidden_size}, num_heads={c.num_heads}, num_kv_heads="
                f"{c.num_kv_heads}, head_dim={c.head_dim}) expects {shape}")


def _check_lengths(name: str, x, shape: tuple, low: int, high: int, hint: str):
    if tuple(jnp.shape(x)) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(jnp.shape(x))}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name} must be integers, got {jnp.result_type(x)}")
    if _is_concrete(x):
        arr = np.asarray(x)
        if arr.size and (arr.min() < low or arr.max() > high):
            raise ValueError(f"{name} must lie in [{low}, {high}] ({hint}), got min "
                             f"{arr.min()} and max {arr.max()}")
    return jnp.asarray(x, jnp.int32)


def _validate(params, config, prompt_tokens, prompt_lengths, response_tokens, response_lengths,
              attn_impl):
    """Boundary checks of the packed entry points; returns int32 arrays."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
    resolve_impl(attn_impl)
    if jnp.ndim(prompt_tokens) != 2:
        raise ValueError(f"prompt_tokens must be [groups, P], got shape {jnp.shape(prompt_tokens)}")
    if jnp.ndim(response_tokens) != 3:
        raise ValueError("response_tokens must be [groups, N, R], got shape "
                         f"{jnp.shape(response_tokens)}")
    g, p = jnp.shape(prompt_tokens)
    _, n, r = jnp.shape(response_tokens)
    if g == 0 or p == 0:
        raise ValueError(f"prompt_tokens needs groups >= 1 and P >= 1, got shape {(g, p)}")
    if jnp.shape(response_tokens)[0] != g:
        raise ValueError(f"response_tokens has {jnp.shape(response_tokens)[0]} groups but "
                         f"prompt_tokens has {g}")
    if n == 0:
        raise ValueError("response_tokens has N = 0 responses per group; pass N >= 1")
    if r == 0:
        raise ValueError("response_tokens has R = 0 tokens per response; pass R >= 1 and mark "
                         "short responses with response_lengths")
    if p + r > config.max_position_embeddings:
        raise ValueError(f"P + R = {p} + {r} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}; shorten the prompt or responses")
    validate_tokens(prompt_tokens, config)
    validate_tokens(response_tokens, config)
    prompt_lengths = _check_lengths("prompt_lengths", prompt_lengths, (g,), 1, p,
                                    "every prompt needs >= 1 token: its last logit predicts "
                                    "the first response token")
    response_lengths = _check_lengths("response_lengths", response_lengths, (g, n), 0, r,
                                      "valid tokens of each right-padded response")
    check_params(params, config)
    return (jnp.asarray(prompt_tokens, jnp.int32), prompt_lengths,
            jnp.asarray(response_tokens, jnp.int32), response_lengths)


# ----------------------------------------------------------------------------- forward
def _run(params, config, attn_impl, prompt_tokens, prompt_lengths, response_tokens,
         response_lengths, logits_at=None, return_hidden=False):
    n, r = response_tokens.shape[1:]
    tokens, positions = packed_tokens_and_positions(prompt_tokens, prompt_lengths,
                                                    response_tokens)
    logits, _ = Decoder(config, "packed", attn_impl, (n, r), return_hidden=return_hidden).apply(
        {"params": params}, tokens, positions, (prompt_lengths, response_lengths),
        logits_at=logits_at)
    return logits


@partial(jax.jit, static_argnames=("config", "attn_impl"))
def _forward_jit(params, prompt_tokens, prompt_lengths, response_tokens, response_lengths, *,
                 config, attn_impl):
    g, p = prompt_tokens.shape
    _, n, r = response_tokens.shape
    logits = _run(params, config, attn_impl, prompt_tokens, prompt_lengths, response_tokens,
                  response_lengths)
    return logits[:, :p], logits[:, p:].reshape(g, n, r, -1)


def packed_forward(
    params: Params,
    config: ModelConfig,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    response_tokens: jax.Array,
    response_lengths: jax.Array,
    *,
    attn_impl: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Logits of a packed batch of groups (float32).

    Args:
      prompt_tokens: [G, P] int, right-padded; prompt_lengths: [G] int in [1, P].
      response_tokens: [G, N, R] int, right-padded; response_lengths: [G, N] int in [0, R].
      attn_impl: "reference" | "xla" | "pallas" | None (kernels.dispatch default: Pallas
        on GPU, XLA elsewhere).
    Returns:
      (prompt_logits [G, P, V], response_logits [G, N, R, V]): equal to the logits of the
      naive row [prompt[:prompt_length], response_n] at the same tokens. The logit at
      prompt position prompt_length - 1 predicts token 0 of every response. Logits at
      padded positions are finite but meaningless.
    """
    args = _validate(params, config, prompt_tokens, prompt_lengths, response_tokens,
                     response_lengths, attn_impl)
    return _forward_jit(params, *args, config=config, attn_impl=attn_impl)


def _target_logits(params, config, attn_impl, prompt_tokens, prompt_lengths, response_tokens,
                   response_lengths, return_hidden=False):
    """Logits [G, N, R, V] float32 whose [g, n, t] row predicts response token t (with
    return_hidden: the final-normed hidden states [G, N, R, E] there instead).

    The vocabulary head runs only at the 1 + N*(R-1) predicting positions: the last valid
    prompt token (shared by all N responses) and response tokens 0..R-2."""
    g, p = prompt_tokens.shape
    _, n, r = response_tokens.shape
    resp_idx = p + (jnp.arange(n)[:, None] * r + jnp.arange(r - 1)[None, :]).reshape(-1)
    logits_at = jnp.concatenate(
        [(prompt_lengths - 1)[:, None], jnp.broadcast_to(resp_idx, (g, n * (r - 1)))], axis=1)
    logits = _run(params, config, attn_impl, prompt_tokens, prompt_lengths, response_tokens,
                  response_lengths, logits_at.astype(jnp.int32), return_hidden)
    first = jnp.broadcast_to(logits[:, None, :1], (g, n, 1, logits.shape[-1]))
    return jnp.concatenate([first, logits[:, 1:].reshape(g, n, r - 1, -1)], axis=2)


def _logprobs_and_logits(params, prompt_tokens, prompt_lengths, response_tokens,
                         response_lengths, temperature, *, config, attn_impl):
    z = _target_logits(params, config, attn_impl, prompt_tokens, prompt_lengths,
                       response_tokens, response_lengths) / temperature
    picked = jnp.take_along_axis(z, response_tokens[..., None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(z, axis=-1)
    valid = jnp.arange(response_tokens.shape[2]) < response_lengths[..., None]
    return jnp.where(valid, logp, 0.0), z


@partial(jax.jit, static_argnames=("config", "attn_impl"))
def _logprobs_jit(params, prompt_tokens, prompt_lengths, response_tokens, response_lengths,
                  temperature, *, config, attn_impl):
    return _logprobs_and_logits(params, prompt_tokens, prompt_lengths, response_tokens,
                                response_lengths, temperature, config=config,
                                attn_impl=attn_impl)[0]


def _check_temperature(temperature):
    if _is_concrete(temperature) and not (math.isfinite(float(temperature))
                                          and float(temperature) > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return jnp.asarray(temperature, jnp.float32)


def packed_response_logprobs(
    params: Params,
    config: ModelConfig,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    response_tokens: jax.Array,
    response_lengths: jax.Array,
    *,
    temperature: float = 1.0,
    attn_impl: str | None = None,
) -> jax.Array:
    """logp [G, N, R] float32: logp[g, n, t] = log softmax(logits / temperature) of response
    token t given the prompt and response[:t]; 0 for t >= response_lengths[g, n].

    Same arguments as `packed_forward`. Differentiable (jax.grad through params); prompt-side
    gradients sum over the N responses, as in the naive batch."""
    args = _validate(params, config, prompt_tokens, prompt_lengths, response_tokens,
                     response_lengths, attn_impl)
    return _logprobs_jit(params, *args, _check_temperature(temperature), config=config,
                         attn_impl=attn_impl)


# ----------------------------------------------------------------------------- naive rows
def to_rows(values: jax.Array, packed: PackedGroups, width: int) -> jax.Array:
    """Scatter per-response-token values [G, N, R, ...] into the naive row layout
    [B = G*N, width - 1, ...]: value (g, n, t), t < response_lengths[g, n], lands in row
    rows[g, n], column prompt_lengths[g] - 1 + t (the column whose logit predicts that
    token, as in models.logprobs.token_logprobs). Every other entry is 0."""
    g, n, r = values.shape[:3]
    cols = packed.prompt_lengths[:, None, None] - 1 + jnp.arange(r)
    # padded tokens go to an out-of-range column, which mode="drop" discards
    cols = jnp.where(jnp.arange(r) < packed.response_lengths[..., None], cols, width)
    rows = jnp.broadcast_to(packed.rows[:, :, None], (g, n, r))
    out = jnp.zeros((g * n, width - 1) + values.shape[3:], values.dtype)
    return out.at[rows, cols].set(values, mode="drop")


@partial(jax.jit, static_argnames=("config", "attn_impl", "width"))
def _token_logprobs_jit(params, packed, temperature, *, config, attn_impl, width):
    logp, z = _logprobs_and_logits(params, packed.prompt_tokens, packed.prompt_lengths,
                                   packed.response_tokens, packed.response_lengths, temperature,
                                   config=config, attn_impl=attn_impl)
    return to_rows(logp, packed, width), to_rows(z, packed, width)


@partial(jax.jit, static_argnames=("config", "attn_impl", "width", "chunk", "entropy",
                                   "keep_logits"))
def _token_logprobs_fused_jit(params, packed, temperature, *, config, attn_impl, width, chunk,
                              entropy, keep_logits):
    hidden = _target_logits(params, config, attn_impl, packed.prompt_tokens,
                            packed.prompt_lengths, packed.response_tokens,
                            packed.response_lengths, return_hidden=True)
    logp, ent = chunked_logprobs(hidden, head_matrix(params, config), packed.response_tokens,
                                 temperature, chunk=chunk, entropy=entropy,
                                 keep_logits=keep_logits)
    valid = jnp.arange(packed.response_tokens.shape[2]) < packed.response_lengths[..., None]
    logp, ent = jnp.where(valid, logp, 0.0), jnp.where(valid, ent, 0.0)
    return to_rows(logp, packed, width), to_rows(ent, packed, width)


def _check_rows_call(params, config, packed: PackedGroups, width, attn_impl) -> int:
    """Boundary checks of the naive-row-layout entry points; returns the width as an int."""
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 2:
        raise ValueError(f"width must be the naive row width T >= 2 (an int), got {width!r}")
    _validate(params, config, packed.prompt_tokens, packed.prompt_lengths,
              packed.response_tokens, packed.response_lengths, attn_impl)
    return int(width)


def packed_token_logprobs_fused(
    params: Params,
    config: ModelConfig,
    packed: PackedGroups,
    *,
    width: int,
    temperature: float = 1.0,
    attn_impl: str | None = None,
    chunk: int = DEFAULT_CHUNK,
    entropy: bool = True,
    keep_logits: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(logp [B, T-1], entropy [B, T-1]) in the naive row layout, like
    `packed_token_logprobs`, but through the chunked head (models.logprobs.chunked_logprobs):
    the forward's logits exist only per chunk of `chunk` response tokens, never as
    [B, T-1, V] (keep_logits: chunked_logprobs's, kept for the backward).
    Entries at columns that predict no response token are 0; entropy=False gives zeros."""
    width = _check_rows_call(params, config, packed, width, attn_impl)
    return _token_logprobs_fused_jit(params, packed, _check_temperature(temperature),
                                     config=config, attn_impl=attn_impl, width=width,
                                     chunk=chunk, entropy=entropy, keep_logits=keep_logits)


def packed_token_logprobs(
    params: Params,
    config: ModelConfig,
    packed: PackedGroups,
    *,
    width: int,
    temperature: float = 1.0,
    attn_impl: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The packed path with models.logprobs.token_logprobs' output layout.

    Args:
      packed: from `pack_groups` on the naive batch tokens [B, width].
      width: T, the naive row width (static).
    Returns:
      (logp [B, T-1], z [B, T-1, V]): at every column that predicts a response token
      (column prompt_length - 1 + t) they equal the naive batch's log-probs and scaled
      logits (logits / temperature); every other entry is 0.
    """
    width = _check_rows_call(params, config, packed, width, attn_impl)
    return _token_logprobs_jit(params, packed, _check_temperature(temperature), config=config,
                               attn_impl=attn_impl, width=width)


def _rows_by_group(group_ids: np.ndarray) -> np.ndarray | dict:
    """rows [G, N] (groups by first appearance, rows ascending), or {group id: size} when
    the groups do not all have the same size."""
    _, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    group_of_row = rank[inverse.reshape(-1)]
    sizes = np.bincount(group_of_row)
    if (sizes != sizes[0]).any():
        return dict(zip(group_ids[first[order]].tolist(), sizes.tolist()))
    return np.stack([np.flatnonzero(group_of_row == k)
                     for k in range(sizes.size)]).astype(np.int32)


def _prompt_mismatch(tokens, prompt_lengths, rows) -> tuple[int, int] | None:
    """The first (lead row, other row) of a group whose prompts differ, else None."""
    for group in rows:
        lead, pl = group[0], prompt_lengths[group[0]]
        for row in group[1:]:
            if prompt_lengths[row] != pl or not np.array_equal(tokens[row, :pl],
                                                               tokens[lead, :pl]):
                return int(lead), int(row)
    return None


def _check_rows(tokens, prompt_lengths, response_lengths, group_ids):
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an integer [B, T] array, got {tokens.dtype} "
                         f"{tokens.shape}")
    b, t = tokens.shape
    if b == 0:
        raise ValueError("the batch is empty (N = 0 responses); nothing to pack")
    plen, rlen, gids = (np.asarray(x) for x in (prompt_lengths, response_lengths, group_ids))
    for name, x in (("prompt_lengths", plen), ("response_lengths", rlen), ("group_ids", gids)):
        if x.shape != (b,):
            raise ValueError(f"{name} must have shape [B] = ({b},), got {x.shape}")
    for name, x in (("prompt_lengths", plen), ("response_lengths", rlen)):
        if not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"{name} must be integers, got {x.dtype}")
    if plen.min() < 1:
        raise ValueError(f"prompt_lengths must be >= 1 (row {int(np.argmin(plen))} has "
                         f"{plen.min()}): the last prompt logit predicts the first response token")
    if rlen.min() < 0 or (plen + rlen).max() > t:
        raise ValueError(f"need 0 <= response_lengths and prompt + response <= T={t}; got "
                         f"response_lengths in [{rlen.min()}, {rlen.max()}] and longest row "
                         f"{(plen + rlen).max()}")
    return tokens, plen, rlen, gids


def groups_share_prompts(tokens, prompt_lengths, response_lengths, group_ids) -> bool:
    """Host side: True iff `pack_groups` can pack this naive batch, i.e. all groups have the
    same size and every response of a group has the same prompt. Same arguments as
    `pack_groups`; malformed arguments still raise ValueError."""
    tokens, plen, rlen, gids = _check_rows(tokens, prompt_lengths, response_lengths, group_ids)
    rows = _rows_by_group(gids)
    return (isinstance(rows, np.ndarray) and rlen.max() > 0
            and _prompt_mismatch(tokens, plen, rows) is None)


def pack_groups(
    tokens,
    prompt_lengths,
    response_lengths,
    group_ids,
    *,
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> PackedGroups:
    """Host side: build the packed arrays from a naive batch (numpy in, numpy out).

    Args:
      tokens: [B, T] int, row b = [prompt (prompt_lengths[b]), response
        (response_lengths[b]), padding].
      prompt_lengths, response_lengths: [B] int; prompt >= 1 token, prompt + response <= T.
      group_ids: [B]; rows with one id form a group. Every group must have the same number N
        of rows and the same prompt (tokens and length). Groups are ordered by first
        appearance, responses by row.
      prompt_width, response_width: P and R of the output (default: the longest prompt and
        response); pass fixed widths to keep one compiled shape across batches.
    Returns:
      PackedGroups with padding token 0 and rows[g, n] = the naive row of response (g, n).
    Raises:
      ValueError for an empty batch, groups of unequal size, a group whose prompts differ,
      all responses empty (R = 0), or lengths that do not fit.
    """
    tokens, plen, rlen, gids = _check_rows(tokens, prompt_lengths, response_lengths, group_ids)
    rows = _rows_by_group(gids)
    if isinstance(rows, dict):
        raise ValueError("every group must have the same number of responses to pack as "
                         f"[G, N, R]; got group sizes {rows}")
    bad = _prompt_mismatch(tokens, plen, rows)
    if bad is not None:
        lead, row = bad
        raise ValueError(
            f"group {gids[lead].tolist()!r}: rows {lead} and {row} have different prompts "
            f"(lengths {plen[lead]} and {plen[row]}); every response of a group must share "
            "its prompt to be packed (use the naive batch otherwise)")
    g, n = rows.shape
    p_need, r_need = int(plen.max()), int(rlen.max())
    if r_need == 0:
        raise ValueError("every response is empty (R = 0): there is no token to train on")
    p = p_need if prompt_width is None else int(prompt_width)
    r = r_need if response_width is None else int(response_width)
    if p < p_need or r < r_need:
        raise ValueError(f"prompt_width={p} / response_width={r} are smaller than the longest "
                         f"prompt ({p_need}) / response ({r_need})")
    prompt_tokens = np.zeros((g, p), np.int32)
    response_tokens = np.zeros((g, n, r), np.int32)
    for k in range(g):
        pl = int(plen[rows[k, 0]])
        prompt_tokens[k, :pl] = tokens[rows[k, 0], :pl]
        for j, row in enumerate(rows[k]):
            response_tokens[k, j, :rlen[row]] = tokens[row, pl:pl + rlen[row]]
    return PackedGroups(
        prompt_tokens=prompt_tokens,
        prompt_lengths=plen[rows[:, 0]].astype(np.int32),
        response_tokens=response_tokens,
        response_lengths=rlen[rows].astype(np.int32),
        rows=rows,
    )
