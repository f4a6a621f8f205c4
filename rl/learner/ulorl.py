"""UloRL pieces: segment rollouts, the POIS / SAIS ratio choice, and DMMPT masking.

Segment rollouts need no code of their own: `rl.rollout.RolloutEngine` advances every
live sample by at most `RolloutConfig.segment_len` (S) tokens per `step`, finished
samples leave at the segment boundary, the rest continue next step, possibly under newer
params, and every token records the version that drew it. A sample's rng stream depends
only on its key and token index, so cutting a response into segments of S tokens gives
exactly the tokens of one long call. Swapping params between steps does NOT recompute
the KV cache of the tokens already made: tokens after the swap are drawn from the new
params attending to the old params' keys/values (in-flight update). Their recorded μ is
that distribution — what acted —, so the exact π_prox of the new version
(rl.learner.proximal) differs from μ there and the train–inference factor π_prox/μ shows it.

Ratio modes (`ratio_mode_changes`), for segments made under several versions:
  "pois" (pseudo on-policy IS): every token is treated as if sampled by the latest
      policy: PPO's old policy = the learner's params at the start of the step
      (TrainConfig.old_logp="current", ratio 1 in value) and no off-policy weight
      (OffPolicyConfig() = none), so the importance weight is 1.
  "sais" (segment-aware IS): each token's own version: old_logp="proximal" with the
      exact log π at the token's version (rl.learner.proximal.exact_proximal_logprobs) when given,
      else old_logp="behaviour" (the recorded μ of that version).

DMMPT (dynamic masking of well-mastered positive tokens): drop token t of sample i from
the loss when p(token) >= 0.99 and R_i = 1 and the sample's mean token entropy < 0.2.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.logprobs import token_logprobs_fused
from rl.learner.batch import TrainBatch
from rl.learner.config import OffPolicyConfig, TrainConfig
from rl.learner.proximal import check_temperature, check_train_batch

RATIO_MODES = ("pois", "sais")


def ratio_mode_changes(mode: str, proximal_logprobs: Any = None) -> tuple[dict, dict]:
    """(TrainConfig field changes, TrainBatch field changes) for a UloRL ratio mode.

    "pois" -> ({"old_logp": "current", "offpolicy": OffPolicyConfig()}, {}) (importance
    weight 1; proximal_logprobs must be None). "sais" -> ({"old_logp": "proximal"},
    {"proximal_logprobs": proximal_logprobs}) with exact per-version log-probs [B, T],
    or ({"old_logp": "behaviour"}, {}) without them. Apply with dataclasses.replace /
    batch.replace, or `apply_ratio_mode`."""
    if mode not in RATIO_MODES:
        raise ValueError(f"ratio mode must be one of {RATIO_MODES}, got {mode!r}")
    if mode == "pois":
        if proximal_logprobs is not None:
            raise ValueError('ratio mode "pois" treats every token as the latest policy\'s: it '
                             "takes no proximal_logprobs (use \"sais\" for per-version log-probs)")
        return {"old_logp": "current", "offpolicy": OffPolicyConfig()}, {}
    if proximal_logprobs is None:
        return {"old_logp": "behaviour"}, {}
    return {"old_logp": "proximal"}, {"proximal_logprobs": proximal_logprobs}


def apply_ratio_mode(config: TrainConfig, batch: TrainBatch, mode: str,
                     proximal_logprobs: Any = None) -> tuple[TrainConfig, TrainBatch]:
    """`config` and `batch` with `ratio_mode_changes(mode, proximal_logprobs)` applied.
    proximal_logprobs must have the batch's tokens shape [B, T]."""
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    check_train_batch(batch)
    if proximal_logprobs is not None and tuple(jnp.shape(proximal_logprobs)) != tuple(batch.tokens.shape):
        raise ValueError(f"proximal_logprobs has shape {tuple(jnp.shape(proximal_logprobs))}, "
                         f"expected the batch's tokens shape {tuple(batch.tokens.shape)}")
    cfg_changes, batch_changes = ratio_mode_changes(mode, proximal_logprobs)
    return dataclasses.replace(config, **cfg_changes), batch.replace(**batch_changes)


@partial(jax.jit, static_argnames=("model_config", "temperature", "attn_impl"))
def _token_stats(params, tokens, positions, mask, *, model_config, temperature, attn_impl):
    logp, ent = token_logprobs_fused(params, model_config, tokens, positions, temperature,
                                     attn_impl)
    m = mask[:, 1:]
    ent = jnp.where(m, ent, 0.0)
    pad = lambda x: jnp.pad(jnp.where(m, x, 0.0), ((0, 0), (1, 0)))  # noqa: E731
    return pad(jnp.exp(logp)), pad(ent)


def token_stats(params: Any, model_config: ModelConfig, batch: TrainBatch, temperature: float,
                attn_impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """(p(token) [B, T], entropy [B, T]) of softmax(logits / temperature) under `params`,
    aligned like the loss mask (column t = token t), 0 off it: DMMPT's inputs."""
    check_train_batch(batch)
    return _token_stats(params, batch.tokens, batch.positions, batch.loss_mask,
                        model_config=model_config, temperature=check_temperature(temperature),
                        attn_impl=attn_impl)


def dmmpt_mask(token_probs: jax.Array, rewards: jax.Array, entropies: jax.Array, mask: jax.Array,
               p_threshold: float = 0.99, entropy_threshold: float = 0.2,
               positive_reward: float = 1.0) -> jax.Array:
    """The loss mask without well-mastered positive tokens (UloRL's DMMPT).

    Args:
        token_probs: [B, T] p(token) under the current policy; rewards: [B];
        entropies: [B, T] per-token entropies (averaged over `mask` per sample) or [B]
            mean entropies; mask: [B, T] bool loss mask.
        p_threshold / entropy_threshold: token t of sample i is masked when
            p >= p_threshold, R_i == positive_reward and mean entropy_i < entropy_threshold.
    Returns:
        [B, T] bool: mask with those tokens set False.
    """
    probs, mask = jnp.asarray(token_probs), jnp.asarray(mask).astype(bool)
    rewards, ent = jnp.asarray(rewards), jnp.asarray(entropies)
    if probs.ndim != 2 or mask.shape != probs.shape:
        raise ValueError(f"token_probs and mask must both be [B, T], got {probs.shape} and {mask.shape}")
    b = probs.shape[0]
    if rewards.shape != (b,):
        raise ValueError(f"rewards must be [B={b}], got shape {rewards.shape}")
    if ent.shape == probs.shape:
        n = jnp.sum(mask, axis=1)
        ent = jnp.sum(jnp.where(mask, ent, 0.0), axis=1) / jnp.maximum(n, 1)
    elif ent.shape != (b,):
        raise ValueError(f"entropies must be [B, T] = {probs.shape} or [B] = ({b},), got {ent.shape}")
    if not 0.0 < p_threshold <= 1.0:
        raise ValueError(f"p_threshold must be in (0, 1], got {p_threshold}")
    if not entropy_threshold >= 0.0:
        raise ValueError(f"entropy_threshold must be >= 0, got {entropy_threshold}")
    mastered = (rewards == positive_reward) & (ent < entropy_threshold)
    return mask & ~((probs >= p_threshold) & mastered[:, None])
