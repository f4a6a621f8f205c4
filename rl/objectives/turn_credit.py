"""Turn-level credit for multi-turn episodes: per-turn rewards -> a per-token advantage term.

An episode i of a group g (the N episodes started from one prompt) has model turns
k = 0 .. n_i − 1 with turn rewards r_{i,k} (`Trajectory.turn_rewards`, what the
environment's `StepResult.reward` said after each turn) and the episode's outcome reward
R_i (`Episode.outcome()`, what every estimator of rl.objectives.advantages reads).

Outcome only (`TurnCreditConfig(name="outcome")`, the default): every model token of the
episode gets the outcome advantage A^O_i of TrainConfig.advantage (GRPO: (R_i − mean_g) /
(std_g + ε)) — exactly today's GRPO; no per-token term is built.

Turn credit (`name="turn"`), MT-GRPO style (Zeng et al. 2025, "Reinforcing Multi-Turn
Reasoning in LLM Agents via Turn-Level Credit Assignment", arXiv 2505.11821), generalised
from their two turns to K turns with a return-to-go:

    return-to-go    G_{i,k} = Σ_{k'=k}^{n_i−1} γ^{k'−k} r_{i,k'}          (k < n_i)
    alive           S_{g,k} = {j ∈ g : n_j > k}  (the group's episodes that have turn k)
    turn advantage  Â_{i,k} = (G_{i,k} − mean_{j∈S_{g,k}} G_{j,k}) / (std_{j∈S_{g,k}} G_{j,k} + ε)
                    (std with Bessel's n − 1, as GRPO; scale=False: no division;
                    Â_{i,k} = 0 when |S_{g,k}| < 2 or k ≥ n_i)
    token advantage A_{i,t} = A^O_i + λ · Â_{i,k(t)}   for a model token t of turn k(t)

Observation tokens are never targets, so their term is 0. The statistics are taken per
turn index over the episodes still running at that turn: an episode that already ended
(e.g. found the answer) is not a 0 return pulling the others' baseline. With two turns and
a turn reward on the first only (r_{i,1} = 0) the first turn's tokens get A^O + λ Â^T and
the second's A^O — MT-GRPO's estimator with λ moved from the outcome onto the turn term
(so λ = 0 is plain GRPO). Group statistics subtract the group's maximum first (as
rl.objectives.advantages), so a turn where every alive episode has the same return gets
exactly 0.

The learner adds λ · Â as `TrainBatch.token_advantages` [B, T] (built on the host by
rl.learner.batch.batch_from_trajectory) to the row advantages [B] of its estimator.
Pure functions of arrays; they take the dtype of `turn_rewards` (float64 in, float64 out).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
TURN_CREDITS = ("outcome", "turn")


@dataclasses.dataclass(frozen=True)
class TurnCreditConfig:
    """name: "outcome" (default: the episode's outcome advantage on every model token, plain
    GRPO) or "turn" (+ coef · the group-normalised return-to-go of the turn rewards, per
    turn index); coef: λ >= 0; gamma: γ in [0, 1], the discount of later turns' rewards in
    the return-to-go; eps: added to the std; unbiased_std: Bessel's n − 1 (as GRPO);
    scale: divide by the std (False: centre only, as Dr. GRPO)."""

    name: str = "outcome"
    coef: float = 1.0
    gamma: float = 1.0
    eps: float = 1e-6
    unbiased_std: bool = True
    scale: bool = True

    def __post_init__(self):
        if self.name not in TURN_CREDITS:
            raise ValueError(f"TurnCreditConfig.name must be one of {TURN_CREDITS}, got {self.name!r}")
        for field, low, high in (("coef", 0.0, math.inf), ("gamma", 0.0, 1.0), ("eps", 0.0, math.inf)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not low <= v <= high:
                raise ValueError(f"TurnCreditConfig.{field} must be a finite number in "
                                 f"[{low}, {high}], got {v!r}")
        for field in ("unbiased_std", "scale"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"TurnCreditConfig.{field} must be True or False")

    @property
    def enabled(self) -> bool:
        """True when the learner needs the per-token term (name "turn")."""
        return self.name != "outcome"


def episode_turns(turn_ids: Any, model_mask: Any) -> Array:
    """[B] int32: model turns per episode, n_i = 1 + the largest turn id on a model token
    (0 for a row without model tokens). turn_ids, model_mask: [B, R]."""
    ids = jnp.asarray(turn_ids, jnp.int32)
    m = jnp.asarray(model_mask, bool)
    return jnp.max(jnp.where(m, ids + 1, 0), axis=1).astype(jnp.int32)


def turn_returns(turn_rewards: Any, num_turns: Any, gamma: float = 1.0) -> Array:
    """[B, K] return-to-go G_{i,k} = Σ_{k'=k}^{n_i−1} γ^{k'−k} r_{i,k'} (0 for k >= n_i).
    turn_rewards [B, K] (float; its dtype is kept), num_turns [B]."""
    r = jnp.asarray(turn_rewards)
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
    k = r.shape[1]
    alive = jnp.arange(k)[None, :] < jnp.asarray(num_turns)[:, None]
    r = jnp.where(alive, r, 0.0)
    # U[k', k] = γ^{k'−k} for k' >= k: G = r @ U sums each turn's future rewards
    e = jnp.arange(k)[:, None] - jnp.arange(k)[None, :]
    u = jnp.where(e >= 0, jnp.asarray(gamma, r.dtype) ** jnp.maximum(e, 0).astype(r.dtype), 0.0)
    return jnp.where(alive, r @ u, 0.0)


def turn_advantages(turn_rewards: Any, num_turns: Any, group_size: int,
                    config: TurnCreditConfig = TurnCreditConfig(name="turn")) -> Array:
    """[B, K] Â_{i,k}: the return-to-go normalised over the group's episodes alive at turn
    k (formulas in the module docstring); 0 for k >= n_i and where fewer than 2 episodes of
    the group are alive. Groups are contiguous blocks of `group_size` rows."""
    g = turn_returns(turn_rewards, num_turns, config.gamma)
    b, k = g.shape
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 \
            or b % group_size:
        raise ValueError(f"group_size must be an int >= 1 dividing the batch of {b} episodes, "
                         f"got {group_size!r}")
    alive = jnp.arange(k)[None, :] < jnp.asarray(num_turns)[:, None]
    gg = g.reshape(b // group_size, group_size, k)
    al = alive.reshape(gg.shape)
    count = jnp.sum(al, axis=1, keepdims=True).astype(g.dtype)
    top = jnp.max(jnp.where(al, gg, -jnp.inf), axis=1, keepdims=True)
    d = jnp.where(al, gg - jnp.where(jnp.isfinite(top), top, 0.0), 0.0)
    centred = jnp.where(al, d - jnp.sum(d, axis=1, keepdims=True) / jnp.maximum(count, 1.0), 0.0)
    if config.scale:
        dof = count - (1.0 if config.unbiased_std else 0.0)
        std = jnp.sqrt(jnp.sum(centred * centred, axis=1, keepdims=True) / jnp.maximum(dof, 1.0))
        centred = centred / (std + config.eps)
    adv = jnp.where(al & (count >= 2), centred, 0.0)
    return adv.reshape(b, k)


def token_turn_advantages(config: TurnCreditConfig, turn_rewards: Any, turn_ids: Any,
                          model_mask: Any, group_size: int) -> Array | None:
    """[B, R] per-token term λ · Â_{i,k(t)} on the model tokens (0 on observations and
    padding), or None with config.name "outcome" (the learner then uses the row advantages
    alone: plain GRPO). turn_rewards [B, K], turn_ids / model_mask [B, R] as in
    rl.trajectory.Trajectory; groups contiguous blocks of `group_size` rows."""
    if not config.enabled:
        return None
    r = jnp.asarray(turn_rewards)
    ids = jnp.asarray(turn_ids, jnp.int32)
    m = jnp.asarray(model_mask, bool)
    if r.ndim != 2 or ids.shape != m.shape or ids.shape[0] != r.shape[0]:
        raise ValueError(f"turn_rewards [B, K] and turn_ids / model_mask [B, R] must share B; "
                         f"got {r.shape}, {ids.shape}, {m.shape}")
    if r.shape[1] == 0 or not bool(jnp.any(m)):  # no model token: no term
        return jnp.zeros(m.shape, jnp.promote_types(r.dtype, jnp.float32))
    n = episode_turns(ids, m)
    if int(jnp.max(n)) > r.shape[1]:
        raise ValueError(f"a model token has turn id {int(jnp.max(n)) - 1} but turn_rewards has "
                         f"only {r.shape[1]} turns per episode")
    adv = turn_advantages(r, n, group_size, config)
    per_tok = jnp.take_along_axis(adv, jnp.clip(ids, 0, max(r.shape[1] - 1, 0)), axis=1)
    return jnp.where(m, config.coef * per_tok, 0.0)
