"""The math of the objectives: advantage estimators, policy losses, off-policy corrections
(offpolicy; IcePop and the rejection masks: rejection), VCPO's ESS / baseline / update scaling, turn-level credit for multi-turn episodes
(turn_credit), and the registries that name them.

Pure functions of arrays ([batch, seq] log-probs, masks, rewards): they jit, vmap and take
no model. May import: jax, optax, chex, numpy — nothing else from `rl`, nor `models`.

    from rl.objectives import LossConfig, compute_loss, AdvantageConfig, compute_advantages
"""
from rl.objectives.advantages import AdvantageConfig, AdvantageResult, compute_advantages  # noqa: I001
from rl.objectives.losses import LossConfig, aggregate, compute_loss, masked_mean, token_entropy
from rl.objectives.offpolicy import (
                                    OffPolicyWeights,
                                    approx_proximal_logp,
                                    behaviour_weights,
                                    decoupled_ppo_loss,
                                    dynamic_sampling_mask,
                                    kept_group_indices,
                                    m2po_mask,
                                    m2po_weights,
                                    overlong_penalty,
                                    ratio_decomposition_metrics,
                                    sequence_log_ratio,
                                    truncated_is_weights,
)
from rl.objectives.rejection import icepop_weights, rejection_weights
from rl.objectives.registry import (
                                    available_advantages,
                                    available_corrections,
                                    available_losses,
                                    get_advantage,
                                    get_correction,
                                    get_loss,
                                    register_advantage,
                                    register_correction,
                                    register_loss,
)
from rl.objectives.turn_credit import (
                                    TurnCreditConfig,
                                    token_turn_advantages,
                                    turn_advantages,
                                    turn_returns,
)
from rl.objectives.vcpo import (
                                    VCPOConfig,
                                    centred_advantages,
                                    ess_lr_scale,
                                    ess_ratio,
                                    min_variance_baseline,
                                    scale_by_ess,
                                    sequence_log_weights,
                                    truncated_sequence_weights,
                                    vcpo_advantages,
                                    weight_tail_stats,
)

__all__ = [
    "available_advantages", "available_corrections", "available_losses", "get_advantage",
    "get_correction", "get_loss", "register_advantage", "register_correction", "register_loss", "AdvantageConfig", "AdvantageResult", "compute_advantages", "LossConfig",
    "aggregate", "compute_loss", "masked_mean", "token_entropy", "OffPolicyWeights",
    "approx_proximal_logp", "behaviour_weights", "decoupled_ppo_loss", "dynamic_sampling_mask",
    "kept_group_indices", "m2po_mask", "m2po_weights", "overlong_penalty", "ratio_decomposition_metrics",
    "sequence_log_ratio", "truncated_is_weights", "VCPOConfig", "centred_advantages",
    "ess_lr_scale", "ess_ratio", "min_variance_baseline", "scale_by_ess", "sequence_log_weights",
    "truncated_sequence_weights", "vcpo_advantages", "weight_tail_stats", "TurnCreditConfig",
    "token_turn_advantages", "turn_advantages", "turn_returns", "icepop_weights",
    "rejection_weights",
]
