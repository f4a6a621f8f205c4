"""Proximal log-probs for the decoupled PPO objective ("Missing Old Logits", PPO-EWMA).

The PPO ratio π_θ / π_prox and the behaviour weight π_prox / μ need log π_prox at every
response token. Two routes, both computed outside the train step and handed to it as
`TrainBatch.proximal_logprobs` with `TrainConfig(old_logp="proximal")`:

* exact: log π_v(token) with v = the token's own behaviour version, from a snapshot of
  the params of version v (`exact_proximal_logprobs`). Then π_prox / μ is the pure
  train–inference discrepancy (same version) and π_θ / π_prox the pure staleness.
* EWMA: one set of params θ_prox ← β θ_prox + (1 − β) θ updated after every step
  (`ewma_update`), whose log-probs (`policy_logprobs`) serve as π_prox for every token.

Arrays are aligned like `TrainBatch.behaviour_logprobs`: index t describes token t, so
column 0 (never a response token: a row starts with its prompt) is always 0.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.logprobs import token_logprobs_fused
from rl.learner.batch import TrainBatch

Params = Any


@partial(jax.jit, static_argnames=("model_config", "temperature", "attn_impl"))
def _aligned_logprobs(params, tokens, positions, mask, *, model_config, temperature, attn_impl):
    """[B, T] float32: log softmax(logits / T) at token t in column t, 0 off `mask`.
    Only the picked log-probs leave the jit (never the [B, T, V] logits)."""
    logp, _ = token_logprobs_fused(params, model_config, tokens, positions, temperature, attn_impl,
                                   entropy=False)
    out = jnp.pad(logp, ((0, 0), (1, 0)))
    return jnp.where(mask, out, 0.0)


def check_temperature(temperature: float) -> float:
    """The sampler temperature as a float; ValueError unless finite and > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0 (the sampler's), got {temperature!r}")
    return float(temperature)


def check_train_batch(batch: Any) -> None:
    """ValueError unless `batch` is a rl.learner.TrainBatch."""
    if not isinstance(batch, TrainBatch):
        raise ValueError(f"batch must be a rl.learner.TrainBatch, got {type(batch).__name__}")


def policy_logprobs(params: Params, model_config: ModelConfig, batch: TrainBatch,
                    temperature: float, attn_impl: str | None = None) -> jax.Array:
    """log π_params of every response token of `batch`: [B, T] float32 aligned like
    behaviour_logprobs, 0 off the loss mask. One forward (jitted once per batch shape),
    e.g. with EWMA params for the PPO-EWMA proximal policy."""
    check_train_batch(batch)
    return _aligned_logprobs(params, batch.tokens, batch.positions, batch.loss_mask,
                             model_config=model_config, temperature=check_temperature(temperature),
                             attn_impl=attn_impl)


def exact_proximal_logprobs(snapshots: Mapping[int, Params], model_config: ModelConfig,
                            batch: TrainBatch, temperature: float,
                            attn_impl: str | None = None) -> jax.Array:
    """log π_v(token t) at each response token's own behaviour version v = batch.versions[b, t].

    Args:
        snapshots: {version: params} (e.g. rl.learner.snapshots.ParamSnapshots) holding every
            version that occurs on the loss mask.
        model_config: the params' ModelConfig; temperature: the sampler's temperature
            (log-probs are of softmax(logits / T), as the learner's).
        batch: TrainBatch (tokens, positions, loss_mask, versions [B, T]).
    Returns:
        [B, T] float32 aligned like behaviour_logprobs, 0 off the loss mask. One forward
        over the whole batch per distinct version present (the compiled forward is shared
        by all versions: same shapes); each token takes the row of its own version.
    Raises:
        ValueError naming the versions that have no snapshot (and the ones held).
    """
    check_train_batch(batch)
    temperature = check_temperature(temperature)
    if not isinstance(snapshots, Mapping):
        raise ValueError(f"snapshots must be a Mapping version -> params, got {type(snapshots).__name__}")
    mask = np.asarray(batch.loss_mask, bool)
    versions = np.asarray(batch.versions)
    if versions.shape != mask.shape:
        raise ValueError(f"batch.versions has shape {versions.shape}, expected the loss mask's {mask.shape}")
    needed = sorted(int(v) for v in np.unique(versions[mask]))
    missing = [v for v in needed if v not in snapshots]
    if missing:
        raise ValueError(
            f"exact_proximal_logprobs: no parameter snapshot for version(s) {missing} (the batch "
            f"has tokens of versions {needed}; snapshots hold {sorted(int(k) for k in snapshots)}); "
            "keep more versions in the snapshot ring or drop data older than it")
    out = jnp.zeros(mask.shape, jnp.float32)
    for v in needed:
        logp = _aligned_logprobs(snapshots[v], batch.tokens, batch.positions, mask,
                                 model_config=model_config, temperature=temperature,
                                 attn_impl=attn_impl)
        out = jnp.where(mask & (versions == v), logp, out)
    return out


@jax.jit
def _ewma(prox_params, params, beta):
    def mix(a, b):
        return (beta * a.astype(jnp.float32) + (1.0 - beta) * b.astype(jnp.float32)).astype(a.dtype)
    return jax.tree.map(mix, prox_params, params)


def ewma_update(prox_params: Params, params: Params, beta: float) -> Params:
    """PPO-EWMA proximal params: θ_prox ← β θ_prox + (1 − β) θ, leaf by leaf (computed in
    float32, stored in θ_prox's dtype). beta in [0, 1): 0 = the current params; close to 1
    = a slowly moving average. Jitted once per tree (beta is traced)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating)) \
            or not 0.0 <= float(beta) < 1.0:
        raise ValueError(f"ewma_update: beta must be a number in [0, 1), got {beta!r}")
    s_prox, s_par = jax.tree.structure(prox_params), jax.tree.structure(params)
    if s_prox != s_par:
        raise ValueError(f"ewma_update: prox_params and params have different trees: {s_prox} vs {s_par}")
    for a, b in zip(jax.tree.leaves(prox_params), jax.tree.leaves(params)):
        if jnp.shape(a) != jnp.shape(b):
            raise ValueError(f"ewma_update: leaf shapes differ: {jnp.shape(a)} vs {jnp.shape(b)}")
    return _ewma(prox_params, params, jnp.float32(beta))
