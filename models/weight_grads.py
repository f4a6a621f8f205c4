"""Weight gradients of the projections, contracted over the token axes in a form XLA's CPU
backend runs on its fast matmul library.

A projection y = x W (x [tokens, C], W [C, O]) has the weight gradient dW = xᵀ dy, a
contraction over the token axis, the leading (major) axis of both operands. XLA's CPU
backend sends a dot to YNNPACK only when the left operand contracts over its last axis
(row-major [M, K]); it folds a plain `x.T` into the dot's dimension numbers, so autodiff's
dW becomes a non-canonical dot that falls back to Eigen, behind a transposed copy of the
larger operand. `contract_tokens` writes the transposed operand out explicitly behind an
optimization barrier (XLA cannot fold it back), so the dot is canonical: on the SmolLM2
learner step (16 x 128 tokens, 2-core CPU) the MLP's three weight gradients alone took the
step from 15.7 to 14.1 s (experiments/bench/learner.py). The smaller operand is the one
transposed; when that is `b`, the [B, A] product is transposed back (weights are small).

Only the CPU lowering changes (`jax.lax.platform_dependent`): on GPU and TPU the matmul
libraries take transposed operands natively, and the barrier would only stop fusion, so
those platforms get the plain contraction. Both branches compute Σ_n a[n, :] ⊗ b[n, :]
exactly (float rounding aside).

`project(spec, x, kernel)` is `jnp.einsum(spec, x, kernel)` for a spec of the form
"<lead><in>,<in><out>-><lead><out>" (e.g. "bse,ehd->bshd") whose backward takes its weight
gradient from `contract_tokens`; models.decoder.Linear and models.swiglu use it.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def _flat(x: jax.Array, n_lead: int) -> jax.Array:
    return x.reshape((math.prod(x.shape[:n_lead]), math.prod(x.shape[n_lead:])))


def _contract_plain(a: jax.Array, bs: tuple[jax.Array, ...], n_lead: int, out) -> tuple:
    axes = tuple(range(n_lead))
    return tuple(jnp.tensordot(a, b, axes=(axes, axes), preferred_element_type=out)
                 for b in bs)


def _contract_cpu(a: jax.Array, bs: tuple[jax.Array, ...], n_lead: int, out) -> tuple:
    a2 = _flat(a, n_lead)
    n, ka = a2.shape
    a_t = None
    outs = []
    for b in bs:
        b2 = _flat(b, n_lead)
        kb = b2.shape[1]
        if n * ka <= n * kb + ka * kb:  # transpose a (once for all bs): [A, N] @ [N, B]
            if a_t is None:
                a_t = jax.lax.optimization_barrier(a2.T)
            c = jnp.matmul(a_t, b2, preferred_element_type=out)
        else:  # transpose b, then the small [B, A] result (barred: XLA would fold that
            # transpose into the dot, making it contract a's axis 0 again)
            c = jax.lax.optimization_barrier(jnp.matmul(
                jax.lax.optimization_barrier(b2.T), a2, preferred_element_type=out)).T
        outs.append(c.reshape(a.shape[n_lead:] + b.shape[n_lead:]))
    return tuple(outs)


def contract_tokens_many(a: jax.Array, bs: tuple[jax.Array, ...], n_lead: int,
                         preferred_element_type=None) -> tuple:
    """contract_tokens(a, b, n_lead) for each b of bs, `a` transposed at most once."""
    bs = tuple(bs)
    for b in bs:
        if a.shape[:n_lead] != b.shape[:n_lead] or a.dtype != b.dtype:
            raise ValueError(f"contract_tokens: leading axes or dtypes differ: {a.shape} "
                             f"{a.dtype} vs {b.shape} {b.dtype} (n_lead={n_lead})")
    if n_lead == 0:
        return _contract_plain(a, bs, 0, preferred_element_type)
    return tuple(jax.lax.platform_dependent(
        a, bs, cpu=partial(_contract_cpu, n_lead=n_lead, out=preferred_element_type),
        default=partial(_contract_plain, n_lead=n_lead, out=preferred_element_type)))


def contract_tokens(a: jax.Array, b: jax.Array, n_lead: int,
                    preferred_element_type=None) -> jax.Array:
    """Σ over the n_lead leading (token) axes of a ⊗ b: a [*lead, *A], b [*lead, *B]
    -> [*A, *B] (a weight gradient xᵀ dy); one dtype, results in preferred_element_type
    (default: that dtype). On CPU written so the dot is canonical (module docstring);
    elsewhere the plain contraction."""
    return contract_tokens_many(a, (b,), n_lead, preferred_element_type)[0]


def _split_spec(spec: str) -> tuple[str, str, str]:
    """(x, kernel, y) subscripts of an einsum spec "x,kernel->y", or ValueError."""
    try:
        inputs, y = spec.replace(" ", "").split("->")
        x, k = inputs.split(",")
    except ValueError:
        raise ValueError(f"projection spec {spec!r}: expected 'x,kernel->y'") from None
    return x, k, y


def parse_projection(spec: str) -> tuple[int, int]:
    """(n_lead, n_in) of a spec "<lead><in>,<in><out>-><lead><out>", or ValueError."""
    x, k, y = _split_spec(spec)
    n_in = next((i for i in range(1, len(x) + 1) if k.startswith(x[-i:]) and
                 y == x[:-i] + k[i:]), None)
    if n_in is None or len(set(x + k)) != len(x) + len(k) - n_in:
        raise ValueError(f"projection spec {spec!r}: expected '<lead><in>,<in><out>->"
                         "<lead><out>' (e.g. 'bse,ehd->bshd')")
    return len(x) - n_in, n_in


# the name a remat policy saves projection outputs by (a custom_vjp's output is not a dot
# to jax.checkpoint_policies.dots_with_no_batch_dims_saveable): models.decoder.SAVE_DOTS
PROJECTION_NAME = "projection"


def project(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, kernel) for spec "<lead><in>,<in><out>-><lead><out>"; x and
    kernel one dtype. The backward: dx = dy Wᵀ, dW = contract_tokens(x, dy). The output
    is named PROJECTION_NAME for remat policies."""
    parse_projection(spec)
    return checkpoint_name(_project(spec, x, kernel), PROJECTION_NAME)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project(spec: str, x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, kernel)


def _project_fwd(spec, x, kernel):
    return _project(spec, x, kernel), (x, kernel)


def _project_bwd(spec, res, dy):
    x, kernel = res
    n_lead, _ = parse_projection(spec)
    xs, ks, ys = _split_spec(spec)
    dx = jnp.einsum(f"{ys},{ks}->{xs}", dy, kernel)
    dw = contract_tokens(x, dy.astype(x.dtype), n_lead)
    return dx.astype(x.dtype), dw.astype(kernel.dtype)


_project.defvjp(_project_fwd, _project_bwd)
