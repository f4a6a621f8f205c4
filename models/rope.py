"""Rotary position embeddings (RoPE): the inverse frequencies of a model config, with
its rope scaling (linear, Llama 3.1), and the rotation of queries and keys."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32), with the config's rope scaling."""
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = config.rope_scaling
    if s is not None and s.kind == "linear":
        inv = inv / s.factor
    elif s is not None and s.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly (Llama 3.1 recipe).
        wavelen = 2 * math.pi / inv
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [batch, seq, heads, head_dim] by positions [batch, seq] (rotate-half
    layout: dims i and i + head_dim/2 form a pair, as in HF checkpoints)."""
    angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
