"""Boundary checks of the model entry points (decoder, packed, logprobs, chunked prefill):
token ids in the vocabulary, positions inside the context, exact shapes. Concrete inputs
are checked by value; traced ones (under jit) only by dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate_tokens(tokens, config: ModelConfig) -> None:
    """Raise ValueError unless `tokens` is an integer array with ids in [0, vocab_size).
    Traced values are not checked (they have no value yet)."""
    if not _is_concrete(tokens):
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer array, got dtype {tokens.dtype}")
        return
    arr = np.asarray(tokens)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be an integer array, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= config.vocab_size):
        bad = arr[(arr < 0) | (arr >= config.vocab_size)]
        raise ValueError(
            f"token ids must be in [0, vocab_size={config.vocab_size}); got out-of-vocab ids "
            f"{sorted(set(bad.tolist()))[:8]}"
        )


def _check_positions(positions, config: ModelConfig, what: str = "positions") -> None:
    if not _is_concrete(positions):
        return
    arr = np.asarray(positions)
    if arr.size and (arr.min() < 0 or arr.max() >= config.max_position_embeddings):
        raise ValueError(
            f"{what} must be in [0, max_position_embeddings={config.max_position_embeddings}); "
            f"got range [{arr.min()}, {arr.max()}]"
        )


def _check_shape(name: str, x, shape: tuple) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
