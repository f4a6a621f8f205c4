"""models.weight_grads: the token contraction (weight gradients) against a float64 numpy
sum, the projection's value and gradients against plain autodiff of jnp.einsum (float64),
the CPU lowering's canonical dots, and the plain contraction on GPU / TPU."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.weight_grads import contract_tokens, contract_tokens_many, parse_projection, project


def _np_contract(a, b, n_lead):
    a2 = np.asarray(a, np.float64).reshape(int(np.prod(a.shape[:n_lead])), -1)
    b2 = np.asarray(b, np.float64).reshape(a2.shape[0], -1)
    return (a2.T @ b2).reshape(a.shape[n_lead:] + b.shape[n_lead:])


@pytest.mark.parametrize("shapes", [
    ((3, 5, 4), (3, 5, 7), 2),      # a smaller: a is transposed
    ((3, 5, 9), (3, 5, 2), 2),      # b smaller: b is transposed, the result back
    ((6, 4, 3), (6, 2, 5), 1),      # several trailing axes on both sides
], ids=["a-small", "b-small", "trailing-axes"])
def test_contract_tokens_equals_the_float64_sum(shapes):
    sa, sb, n_lead = shapes
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=sa).astype(np.float32), rng.normal(size=sb).astype(np.float32)
    got = jax.jit(lambda a, b: contract_tokens(a, b, n_lead))(a, b)
    assert got.shape == sa[n_lead:] + sb[n_lead:] and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _np_contract(a, b, n_lead), rtol=1e-5, atol=1e-5)
    many = contract_tokens_many(a, (b, 2 * b), n_lead)
    np.testing.assert_allclose(many[1], 2 * _np_contract(a, b, n_lead), rtol=1e-5, atol=1e-5)


def test_contract_tokens_bf16_inputs_fp32_results():
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(16, 3)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(16, 40)), jnp.bfloat16)
    got = contract_tokens(a, b, 1, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    want = _np_contract(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # exact bf16 products, fp32 sums
    with pytest.raises(ValueError, match="leading axes"):
        contract_tokens(a, b[:8], 1)


@pytest.mark.parametrize("spec,xs,ks", [
    ("bse,ehd->bshd", (2, 3, 5), (5, 4, 6)),   # q/k/v projections
    ("bshd,hde->bse", (2, 3, 4, 6), (4, 6, 5)),  # the output projection
    ("ce,ev->cv", (7, 5), (5, 11)),              # one lead axis
])
def test_project_value_and_grads_equal_einsum_autodiff_float64(spec, xs, ks):
    with jax.enable_x64():
        rng = np.random.default_rng(2)
        x, k = jnp.asarray(rng.normal(size=xs)), jnp.asarray(rng.normal(size=ks))
        y0, vjp0 = jax.vjp(lambda x, k: jnp.einsum(spec, x, k), x, k)
        y1, vjp1 = jax.vjp(lambda x, k: project(spec, x, k), x, k)
        np.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-12)
        dy = jnp.asarray(rng.normal(size=y0.shape))
        for got, want in zip(vjp1(dy), vjp0(dy)):
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


def test_parse_projection_rejects_specs_it_cannot_split():
    assert parse_projection("bse,ehd->bshd") == (2, 1)
    assert parse_projection("bshd,hde->bse") == (2, 2)
    for bad in ["bse,hed->bshd", "bse,ehd->bsh", "be,ef", "bse,ehd->sbhd"]:
        with pytest.raises(ValueError, match="projection spec"):
            parse_projection(bad)


def test_cpu_learner_step_has_only_canonical_dots():
    """What the module is for. In XLA's optimized CPU program of the learner's step on a
    2-layer model of SmolLM2's sizes (16 rows x 128 tokens, the benchmark's batch) no dot
    contracts its left operand's first axis (the form YNNPACK refuses and Eigen ran at
    ~75 % of the rate, behind extra transposed copies). Before this module the MLP and k /
    v weight gradients had that form; the plain contraction inside these backwards still
    leaves the head's. Compile only (~7 s), nothing runs."""
    from models.config import get_config
    from rl.learner import (
        OptimizerConfig,
        TrainBatch,
        TrainConfig,
        abstract_train_state,
        make_train_step,
    )
    from rl.objectives.losses import LossConfig

    model = get_config("smollm2-135m", num_layers=2)
    config = TrainConfig(loss=LossConfig(name="ppo_clip", aggregation="token-mean"),
                         optimizer=OptimizerConfig(name="adamw", learning_rate=1e-6))
    b, t = 16, 128
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
    batch = TrainBatch(tokens=spec((b, t), jnp.int32), positions=spec((b, t), jnp.int32),
                       loss_mask=spec((b, t), jnp.bool_),
                       behaviour_logprobs=spec((b, t), jnp.float32),
                       versions=spec((b, t), jnp.int32), rewards=spec((b, 1), jnp.float32),
                       group_size=8, reward_names=("reward",))
    step = make_train_step(config, model)
    text = step.lower(abstract_train_state(model, config), batch).compile().as_text()
    dots = re.findall(r" dot\(.*?lhs_contracting_dims=\{(\d+)\}", text)
    assert len(dots) >= 2 * 7 + 1, len(dots)  # the layers' weight gradients at least
    assert "0" not in dots, [line.split("op_name=")[-1][:120] for line in text.splitlines()
                             if " dot(" in line and "lhs_contracting_dims={0}" in line]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_accelerators_get_the_plain_contraction(platform):
    """GPU / TPU lowerings carry no optimization barrier (only the CPU branch has one)."""
    x, k = jnp.ones((2, 8, 6), jnp.float32), jnp.ones((6, 10), jnp.float32)
    grad = jax.jit(jax.grad(lambda x, k: jnp.sum(project("bse,ef->bsf", x, k) ** 2),
                            argnums=(0, 1)))
    text = jax.export.export(grad, platforms=[platform])(x, k).mlir_module()
    assert "optimization_barrier" not in text
    cpu = jax.export.export(grad, platforms=["cpu"])(x, k).mlir_module()
    assert "optimization_barrier" in cpu
