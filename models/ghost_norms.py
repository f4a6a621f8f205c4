"""Per-row squared gradient norms from ONE batched forward and backward ("ghost norms").

For a weight W used as y_s = x_s W at the positions s of row i, the row's gradient is the
sum of outer products ∇W_i = Σ_s x_s ⊗ g_s (g_s = ∂L_i/∂y_s), so

    ‖∇W_i‖²_F = Σ_{s,s'} (x_s · x_s') (g_s · g_s')

without forming ∇W_i (Goodfellow 2015, "Efficient per-example gradient computations"; Li
et al. 2022, "ghost clipping"; Bu et al. 2023, "book-keeping": take whichever of the Gram
form, S² (I + O) multiplies, and the per-row ∇W_i, S I O, is cheaper). A norm scale γ
(y = n ∘ γ) has ∇γ_i = Σ_s n_s ∘ g_s, a bias ∇b_i = Σ_s g_s. A TIED embedding table E
(input lookup x_t = E[tok_t] and output logits z_s = h_s Eᵀ) gets both parts and their
cross term:

    ‖∇E_i‖² = Σ_{t,t'} [tok_t = tok_t'] (e_t · e_t')         (lookup; e_t = ∂L_i/∂x_t)
            + Σ_{s,s'} (h_s · h_s') (dz_s · dz_s')             (head; dz_s = ∂L_i/∂z_s)
            + 2 Σ_t e_t · u_t,   u_t = Σ_s dz_s[tok_t] h_s      (⟨lookup, head⟩)

Every parameterised op of models.decoder (Linear, the SwiGLU MLP, RMSNorm, the embedding,
the head) is swapped, by a flax method interceptor, for a custom-vjp twin whose backward
also returns its rows' squared norm as the cotangent of a zero "probe" [B]; the probe's
gradient is then Σ over ops = ‖∇_θ Σ_t log π(y_t)‖² per row. The lookup's u_t reaches the
lookup's backward as the cotangent of a zero "carrier" that the lookup hands the head.
A param the interceptors do not consume raises (trace time) instead of being left out.

Cost: the forward plus the backward's input gradients of the batch (no weight gradient is
formed; XLA drops the unused ones) plus the Grams; the slow twin,
rl.learner.vcpo.per_trajectory_logprob_grads, runs vmap(grad) row by row.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from models import decoder
from models.config import ModelConfig
from models.swiglu import _backward as swiglu_backward
from models.swiglu import _forward as swiglu_forward
from models.swiglu import hidden_grads

Array = jax.Array


# ----------------------------------------------------------------------------- norm arithmetic
def outer_sum_sq_norms(x: Array, g: Array) -> Array:
    """[B] ‖Σ_s x[b, s] ⊗ g[b, s]‖²_F for x [B, S, I], g [B, S, O], in at least float32:
    the Gram form or the materialised per-row matrix, whichever multiplies less."""
    dt = jnp.promote_types(jnp.promote_types(x.dtype, g.dtype), jnp.float32)
    x, g = x.astype(dt), g.astype(dt)
    s, i, o = x.shape[1], x.shape[2], g.shape[2]
    if s * (i + o) <= i * o:
        xx = jnp.einsum("bsi,bti->bst", x, x)
        gg = jnp.einsum("bso,bto->bst", g, g)
        return jnp.sum(xx * gg, axis=(1, 2))
    w = jnp.einsum("bsi,bso->bio", x, g)
    return jnp.sum(w * w, axis=(1, 2))


def _rows(x: Array) -> Array:
    """[B, S, ...] -> [B, S, prod(...)]."""
    return x.reshape(x.shape[:2] + (-1,))


def _probe_ct(norm: Array, probe: Array) -> Array:
    return norm.astype(probe.dtype)


# ----------------------------------------------------------------------------- ghost ops
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def ghost_einsum(spec: str, x: Array, kernel: Array, probe: Array) -> Array:
    """jnp.einsum(spec, x, kernel) for a projection that contracts all of x's trailing
    axes (x [B, S, in...], kernel [in..., out...], y [B, S, out...]); the probe's
    cotangent is the rows' ‖∇kernel‖²."""
    return jnp.einsum(spec, x, kernel)


def _ghost_einsum_fwd(spec, x, kernel, probe):
    return jnp.einsum(spec, x, kernel), (x, kernel, probe)


def _ghost_einsum_bwd(spec, res, g):
    x, kernel, probe = res
    dx, dk = jax.vjp(lambda a, k: jnp.einsum(spec, a, k), x, kernel)[1](g)
    return dx, dk, _probe_ct(outer_sum_sq_norms(_rows(x), _rows(g)), probe)


ghost_einsum.defvjp(_ghost_einsum_fwd, _ghost_einsum_bwd)


@jax.custom_vjp
def ghost_add_bias(y: Array, bias: Array, probe: Array) -> Array:
    """y [B, S, out...] + bias [out...]; the probe's cotangent is ‖Σ_s g_s‖² per row."""
    return y + bias


def _ghost_add_bias_fwd(y, bias, probe):
    return y + bias, probe


def _ghost_add_bias_bwd(probe, g):
    per_row = jnp.sum(_rows(g).astype(jnp.promote_types(g.dtype, jnp.float32)), axis=1)
    db = jnp.sum(g, axis=(0, 1))
    return g, db, _probe_ct(jnp.sum(per_row * per_row, axis=1), probe)


ghost_add_bias.defvjp(_ghost_add_bias_fwd, _ghost_add_bias_bwd)


@jax.custom_vjp
def ghost_scale(n: Array, scale: Array, probe: Array) -> Array:
    """n [B, S, ..., D] * scale [D] (RMSNorm's gain); probe cotangent ‖Σ n ∘ g‖² per row."""
    return n * scale


def _ghost_scale_fwd(n, scale, probe):
    return n * scale, (n, scale, probe)


def _ghost_scale_bwd(res, g):
    n, scale, probe = res
    dt = jnp.promote_types(g.dtype, jnp.float32)
    prod = (n.astype(dt) * g.astype(dt)).reshape(n.shape[0], -1, n.shape[-1])
    per_row = jnp.sum(prod, axis=1)  # [B, D]
    dscale = jnp.sum(per_row, axis=0).astype(scale.dtype)
    return g * scale, dscale, _probe_ct(jnp.sum(per_row * per_row, axis=1), probe)


ghost_scale.defvjp(_ghost_scale_fwd, _ghost_scale_bwd)


@jax.custom_vjp
def ghost_swiglu(x: Array, w_gate: Array, w_up: Array, w_down: Array, probe: Array) -> Array:
    """models.swiglu.swiglu (x [B, S, E]); probe cotangent: the three kernels' row norms."""
    return swiglu_forward(x, w_gate, w_up, w_down)[0]


def _ghost_swiglu_fwd(x, w_gate, w_up, w_down, probe):
    y, res = swiglu_forward(x, w_gate, w_up, w_down)
    return y, (res, probe)


def _ghost_swiglu_bwd(saved, dy):
    res, probe = saved
    x = res[0]
    dx, d_gate, d_up, d_down = swiglu_backward(res, dy)
    h, dg, du = hidden_grads(res, dy)  # XLA shares them with the backward's own
    norm = outer_sum_sq_norms(x, dg) + outer_sum_sq_norms(x, du) + outer_sum_sq_norms(h, dy)
    return dx, d_gate, d_up, d_down, _probe_ct(norm, probe)


ghost_swiglu.defvjp(_ghost_swiglu_fwd, _ghost_swiglu_bwd)


@jax.custom_vjp
def ghost_lookup(table: Array, tokens: Array, probe: Array) -> tuple[Array, Array]:
    """(`table[tokens]` [B, S, E], carrier zeros [B, S, E]): the carrier goes to the tied
    head, whose backward sends back u_t (module docstring) for the cross term."""
    return table[tokens], jnp.zeros(tokens.shape + table.shape[1:], _norm_dtype(table))


def _norm_dtype(a: Array):
    return jnp.promote_types(a.dtype, jnp.float32)


def _ghost_lookup_fwd(table, tokens, probe):
    return ghost_lookup(table, tokens, probe), (table, tokens, probe)


def _ghost_lookup_bwd(res, cts):
    table, tokens, probe = res
    e, u = cts
    dt = _norm_dtype(e)
    ef = e.astype(dt)
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, S, S]
    lookup = jnp.sum(jnp.where(same, jnp.einsum("bse,bte->bst", ef, ef), 0.0), axis=(1, 2))
    cross = 2.0 * jnp.sum(ef * u.astype(dt), axis=(1, 2))
    dtable = jnp.zeros(table.shape, e.dtype).at[tokens].add(e).astype(table.dtype)
    return dtable, None, _probe_ct(lookup + cross, probe)


ghost_lookup.defvjp(_ghost_lookup_fwd, _ghost_lookup_bwd)


@jax.custom_vjp
def ghost_tied_head(h: Array, table: Array, carrier: Array, tokens: Array,
                    probe: Array) -> Array:
    """fp32 logits h [B, S', E] @ table [V, E]ᵀ of a tied embedding; the carrier's
    cotangent is u_t = Σ_s dz_s[tok_t] h_s for the lookup's tokens [B, S]."""
    return jnp.einsum("bse,ve->bsv", h, table, preferred_element_type=jnp.float32)


def _ghost_tied_head_fwd(h, table, carrier, tokens, probe):
    return ghost_tied_head(h, table, carrier, tokens, probe), (h, table, carrier, tokens, probe)


def _ghost_tied_head_bwd(res, dz):
    h, table, carrier, tokens, probe = res
    dh = jnp.einsum("bsv,ve->bse", dz, table.astype(dz.dtype)).astype(h.dtype)
    dtable = jnp.einsum("bsv,bse->ve", dz, h.astype(dz.dtype)).astype(table.dtype)
    dt = jnp.promote_types(dz.dtype, _norm_dtype(h))
    hf, dzf = h.astype(dt), dz.astype(dt)
    head = outer_sum_sq_norms(hf, dzf)
    at_tokens = jnp.take_along_axis(  # dz_s[tok_t]: [B, S', S]
        dzf, jnp.broadcast_to(tokens[:, None, :], dz.shape[:2] + tokens.shape[1:]), axis=2)
    u = jnp.einsum("bst,bse->bte", at_tokens, hf).astype(carrier.dtype)
    return dh, dtable, u, None, _probe_ct(head, probe)


ghost_tied_head.defvjp(_ghost_tied_head_fwd, _ghost_tied_head_bwd)


# ----------------------------------------------------------------------------- the model
class _Trace:
    """What the interceptors share during one trace: the probe, the lookup's carrier and
    the param paths consumed (checked against the params tree)."""

    def __init__(self, probe: Array):
        self.probe = probe
        self.carrier: Array | None = None
        self.used: set[tuple[str, ...]] = set()

    def use(self, module: nn.Module, *names: str) -> None:
        self.used.add(tuple(module.path) + names)


def _plain(module: nn.Module) -> None:
    if module.has_variable("params", "qkernel") or module.has_variable("params", "lora_a"):
        raise ValueError(f"ghost gradient norms cover plain params only; {'/'.join(module.path)} "
                         f"is quantized or carries a LoRA adapter (use the vmap(grad) twin)")


def _interceptor(trace: _Trace):
    def intercept(next_fun, args, kwargs, context):
        m, name = context.module, context.method_name
        if name != "__call__":
            return next_fun(*args, **kwargs)
        if isinstance(m, decoder.Linear):
            _plain(m)
            x = args[0].astype(m.dtype)
            kernel = m.get_variable("params", "kernel").astype(m.dtype)
            y = ghost_einsum(m.spec, x, kernel, trace.probe)
            trace.use(m, "kernel")
            if m.use_bias:
                y = ghost_add_bias(y, m.get_variable("params", "bias").astype(m.dtype), trace.probe)
                trace.use(m, "bias")
            return y
        if isinstance(m, decoder.MLP):
            dt = jnp.dtype(m.config.dtype)
            params = m.variables["params"]
            ws = []
            for sub in ("gate_proj", "up_proj", "down_proj"):
                if set(params[sub]) != {"kernel"}:
                    raise ValueError(f"ghost gradient norms cover plain params only; "
                                     f"{'/'.join(m.path + (sub,))} holds {sorted(params[sub])}")
                ws.append(params[sub]["kernel"].astype(dt))
                trace.use(m, sub, "kernel")
            return ghost_swiglu(args[0].astype(dt), *ws, trace.probe)
        if isinstance(m, decoder.RMSNorm):
            n = decoder.rms_normalize(args[0], m.eps, m.dtype)
            trace.use(m, "scale")
            return ghost_scale(n, m.get_variable("params", "scale").astype(m.dtype), trace.probe)
        if isinstance(m, nn.Embed):
            table = m.get_variable("params", "embedding").astype(m.dtype)
            x, trace.carrier = ghost_lookup(table, jnp.asarray(args[0], jnp.int32), trace.probe)
            trace.use(m, "embedding")
            return x
        if isinstance(m, (decoder.Attention, decoder.Block, decoder.Decoder, decoder._Head)):
            # containers (their parts are intercepted) and the untied head's declaration
            # (its kernel is used, through a ghost op, by ghost_token_logprobs)
            return next_fun(*args, **kwargs)
        raise ValueError(f"ghost gradient norms do not know module {type(m).__name__} at "
                         f"{'/'.join(m.path)} (use the vmap(grad) twin)")
    return intercept


def _param_paths(params: Any) -> set[tuple[str, ...]]:
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return {tuple(k.key for k in path) for path, _ in paths}


def ghost_token_logprobs(params: Any, config: ModelConfig, tokens: Array, positions: Array,
                         probe: Array, temperature: float, attn_impl: str | None = None,
                         logits_at: Array | None = None) -> Array:
    """logp [B, T-1] as models.logprobs.token_logprobs (the log-prob of token t+1 at
    temperature), computed through the ghost ops: d(Σ_b c_b · f_b(logp))/d probe [B] is
    each row's ‖∇_θ f_b‖² for a per-row function f_b of its own log-probs.
    logits_at [B, K] int in [0, T-1) (optional): the head only at those logit positions
    -> logp [B, K] (the vocabulary head is the costliest per-token op of a small model)."""
    trace = _Trace(probe)
    model = decoder.Decoder(config, "forward", attn_impl, return_hidden=True)
    with nn.intercept_methods(_interceptor(trace)):
        hidden, _ = model.apply({"params": params}, tokens, positions,
                                decoder.segment_mask(jnp.ones_like(tokens)))
    h, targets = hidden[:, :-1], tokens[:, 1:]
    if logits_at is not None:
        h = jnp.take_along_axis(h, logits_at[:, :, None], axis=1)
        targets = jnp.take_along_axis(targets, logits_at, axis=1)
    if config.tie_word_embeddings:
        table = params["embed"]["embedding"].astype(config.dtype)
        z = ghost_tied_head(h, table, trace.carrier, tokens, probe)
    else:
        head = params["lm_head"]["kernel"].astype(config.dtype)
        z = ghost_einsum("bse,ev->bsv", h, head, probe).astype(jnp.float32)
        trace.used.add(("lm_head", "kernel"))
    missing = _param_paths(params) - trace.used
    if missing:
        raise ValueError("ghost gradient norms would leave out params "
                         f"{sorted('/'.join(p) for p in missing)} (use the vmap(grad) twin)")
    z = z.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def loss_window(mask: Array, width: int) -> tuple[Array, Array, Array, Array]:
    """The `width` logit positions from each row's first loss token: (logits_at [B, K]
    int, in_window [B, K] bool: inside the row, mask_at [B, K] bool: the loss mask there,
    covered [B] bool: every loss position of the row is in the window). mask [B, T-1] is
    the loss mask of the logit positions (mask[:, 1:] of a token-aligned mask)."""
    t1 = mask.shape[1]
    k = min(width, t1)
    start = jnp.argmax(mask, axis=1)  # 0 for a row without loss tokens
    idx = start[:, None] + jnp.arange(k)
    in_window = idx < t1
    logits_at = jnp.minimum(idx, t1 - 1).astype(jnp.int32)
    mask_at = jnp.take_along_axis(mask, logits_at, axis=1) & in_window
    covered = jnp.sum(mask_at, axis=1) == jnp.sum(mask, axis=1)
    return logits_at, in_window, mask_at, covered


def ghost_logprob_grads(params: Any, config: ModelConfig, tokens: Array, positions: Array,
                        mask: Array, temperature: float = 1.0, chunk: int = 8,
                        attn_impl: str | None = None,
                        window: int | None = None) -> tuple[Array, Array]:
    """(logp [B, T-1], ‖∇_θ Σ_t mask[b, t+1] log π(token t+1)‖² [B]): the same values as
    the vmap(grad) twin rl.learner.vcpo.per_trajectory_logprob_grads, `chunk` rows per
    batched pass (lax.map over chunks; rows padded to a multiple of chunk).

    tokens, positions [B, T] int; mask [B, T] bool aligned with tokens (column 0 ignored).
    window (static, optional): run the vocabulary head only at the `window` logit
    positions from each row's first loss token (e.g. the response width R of a packed
    batch, whose loss tokens all lie in its response segment); logp is then 0 outside
    the window, and a row with a loss token beyond it gets a NaN norm rather than a
    wrong one.
    """
    b, t = tokens.shape
    chunk = min(chunk, b)
    pad = (-b) % chunk
    pdt = jnp.promote_types(jnp.dtype(config.param_dtype), jnp.float32)

    def one_chunk(xs):
        tok, pos, msk = xs
        msk = msk[:, 1:]
        if window is None:
            at, keep, covered = None, msk, None
        else:
            at, inside, keep, covered = loss_window(msk, window)

        def total(probe):
            lp = ghost_token_logprobs(params, config, tok, pos, probe, temperature, attn_impl, at)
            return jnp.sum(jnp.where(keep, lp, 0.0)), lp

        (_, lp), sq = jax.value_and_grad(total, has_aux=True)(jnp.zeros((tok.shape[0],), pdt))
        if window is not None:  # back to [rows, T-1]: the window's log-probs, 0 elsewhere
            rows = jnp.arange(tok.shape[0])[:, None]
            lp = jnp.zeros(msk.shape, lp.dtype).at[rows, at].add(jnp.where(inside, lp, 0.0))
            sq = jnp.where(covered, sq, jnp.nan)
        return lp, sq

    def prep(x):
        x = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)]) if pad else x
        return x.reshape((-1, chunk) + x.shape[1:])

    lp, sq = jax.lax.map(one_chunk, (prep(tokens), prep(positions), prep(mask)))
    return lp.reshape(-1, t - 1)[:b], sq.reshape(-1)[:b].astype(jnp.float32)
