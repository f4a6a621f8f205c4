"""The learner side: one pure, jitted optimizer step and what it needs.

    config     OptimizerConfig, OffPolicyConfig, TrainConfig; make_optimizer, make_schedule
    batch      TrainState, TrainBatch, init_train_state, batch_from_trajectory, global_batch
    step       train_step: the GRPO step read top to bottom, each variant a named function
    old_logp   the registered sources of the PPO "old" policy π_prox (TrainConfig.old_logp)
    rewards    named rewards -> the scalar reward and the advantages the step trains on
    vcpo       VCPO's in-step terms (vcpo_terms) and exact per-trajectory gradient norms
    jitted     make_train_step: the step jitted with explicit shardings (any mesh)
    checked    checked mode: the step with checkify checks (non-finite reward, log-prob,
               loss, gradient -> NonFiniteError naming the update and group)
    proximal   exact proximal log-probs at each token's own version, PPO-EWMA params
    snapshots  ParamSnapshots, the ring of past params the exact proximal policy reads
    ulorl      UloRL's ratio modes (POIS / SAIS) and DMMPT masking

May import: `models`, `kernels`, `rl.objectives`, `rl.trajectory`, `rl.runtime` — not
`rl.rollout` nor `rl.loops`. Token log-probs under a model come from `models.logprobs`.

    from rl.learner import TrainConfig, init_train_state, batch_from_trajectory, make_train_step
"""
from rl.learner.config import (OLD_LOGP_SOURCES, OffPolicyConfig, OptimizerConfig,  # noqa: I001
                               TrainConfig, make_optimizer, make_schedule)
from rl.learner.batch import (TrainBatch, TrainState, batch_from_trajectory, global_batch,
                              init_train_state)
from rl.learner.step import train_step
from rl.learner.checked import NonFiniteError, checked_train_step
from rl.learner.jitted import (JittedTrainStep, abstract_train_state, make_train_step,
                               state_shardings)
from rl.learner.proximal import ewma_update, exact_proximal_logprobs, policy_logprobs
from rl.learner.snapshots import ParamSnapshots
from rl.learner.ulorl import apply_ratio_mode, dmmpt_mask, ratio_mode_changes, token_stats
from rl.learner.vcpo import per_trajectory_grad_sq_norms, per_trajectory_logprob_grads

__all__ = [
    "OLD_LOGP_SOURCES", "OffPolicyConfig", "OptimizerConfig", "TrainConfig", "make_optimizer",
    "make_schedule", "TrainBatch", "TrainState", "batch_from_trajectory", "global_batch",
    "init_train_state", "train_step", "NonFiniteError", "checked_train_step", "JittedTrainStep", "abstract_train_state",
    "make_train_step", "state_shardings", "ewma_update", "exact_proximal_logprobs",
    "policy_logprobs", "ParamSnapshots", "apply_ratio_mode", "dmmpt_mask", "ratio_mode_changes",
    "token_stats", "per_trajectory_grad_sq_norms", "per_trajectory_logprob_grads",
]
