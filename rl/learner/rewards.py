"""The batch's rewards as the learner step sees them.

    scalar_rewards      the named reward columns combined into one reward per row
                        (TrainConfig.reward_weights; every weight 1 by default)
    reward_advantages   TrainConfig.advantage's advantages [B] and the loss mask [B, T-1]
                        without the rows the estimator drops

Shared by the plain step (`rl.learner.step`) and VCPO's terms (`rl.learner.vcpo`), which
replaces the advantages but still reads the scalar reward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl.learner.batch import TrainBatch
from rl.learner.config import TrainConfig
from rl.objectives.advantages import compute_advantages


def scalar_rewards(config: TrainConfig, batch: TrainBatch) -> jax.Array:
    """[B] float32: batch.rewards [B, K] @ the weights of config.reward_weights (missing
    names weigh 1). ValueError when a weight names a reward the batch does not have."""
    weights = dict(config.reward_weights)
    unknown = set(weights) - set(batch.reward_names)
    if unknown:
        raise ValueError(f"TrainConfig.reward_weights names {sorted(unknown)} that the batch does "
                         f"not have; its rewards are {list(batch.reward_names)}")
    w = jnp.asarray([weights.get(n, 1.0) for n in batch.reward_names], jnp.float32)
    return batch.rewards @ w


def reward_advantages(config: TrainConfig, batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
    """(advantages [B], mask [B, T-1]) from config.advantage: the mask is the loss mask
    (shifted like the log-probs: column t is token t+1) with the rows the estimator drops
    (sample_mask 0, e.g. groups without signal) switched off."""
    if config.advantage.name == "gdpo":  # GDPO normalises each named reward on its own
        rewards = {n: batch.rewards[:, k] for k, n in enumerate(batch.reward_names)}
    else:
        rewards = scalar_rewards(config, batch)
    out = compute_advantages(config.advantage, rewards, batch.group_size)
    mask = batch.loss_mask[:, 1:] & (out.sample_mask[:, None] > 0)
    return out.advantages, mask
