"""The off-policy methods the staleness studies compare, as changes to a base learner
(and, for the exact proximal policy, to the asynchronous source): one definition that the
real-model study (experiments/repro/staleness_real) and the toy testbed
(experiments/repro/staleness_testbed) both train with.

With μ the sampler's (behaviour) policy, π_θ the learner, π_prox the PPO "old" policy, in
a deterministic k-stale run (step v trains on a batch sampled with version max(v − k, 0)):

  naive         PPO-clip on π_θ / μ: the behaviour log-probs as the old policy
                (old_logp="behaviour"), nothing else; the baseline AReaL's and M2PO's papers
                show degrading with staleness
  decoupled     AReaL's decoupled PPO: PPO-clip on π_θ / π_prox with π_prox the learner's
                own params before the update (old_logp="current"), times the behaviour
                weight sg[π_prox / μ], tokens with a weight above 5 rejected
  m2po          M2PO: tokens with the largest (log π_prox − log μ)² masked until the mean of
                the rest is <= 0.04, kept tokens weighted by π_prox / μ, no clip
  vcpo          VCPO: sequence weight min(π/μ, 8), the minimum-variance off-policy
                baseline, the update scaled by √ESS
  truncated_is  PPO-clip on π_θ / π_prox (current) times min(π_prox / μ, 2) per token
                (Yao et al.'s truncated importance sampling)
  icepop        PPO-clip on π_θ / π_prox (current) times IcePop's M(π_prox / μ; 0.5, 5)
  exact         Missing Old Logits' repair: π_prox computed exactly at each token's own
                behaviour version from the param ring (AsyncConfig.proximal="exact"), so the
                PPO ratio π_θ / π_prox is the staleness alone and π_prox / μ the pure
                train/inference discrepancy, with AReaL's behaviour weights as in decoupled

Every method logs the batch's ESS ratio ρ (VCPOConfig(monitor=True)) and the learner logs
both factors of π_θ/μ (mismatch_* = π_prox/μ, staleness_* = π_θ/π_prox).
"""
from __future__ import annotations

import dataclasses

from rl.learner import OffPolicyConfig, TrainConfig
from rl.objectives import VCPOConfig

VCPO_CHUNK = 8  # rows per batched pass of VCPO's exact (ghost) gradient norms
METHODS = ("naive", "decoupled", "m2po", "vcpo", "truncated_is", "icepop", "exact")
LABELS = {"naive": "naive PPO (old = behaviour μ)", "decoupled": "decoupled PPO (AReaL)",
          "m2po": "M2PO", "vcpo": "VCPO", "truncated_is": "truncated IS",
          "icepop": "IcePop", "exact": "exact π_prox (Missing Old Logits)"}
COLORS = {"naive": "tab:gray", "decoupled": "tab:green", "m2po": "tab:blue", "vcpo": "tab:red",
          "truncated_is": "tab:orange", "icepop": "tab:purple", "exact": "tab:brown"}
BEHAVIOUR_WEIGHTS = OffPolicyConfig(correction="behaviour", level="token", cap=5.0, mode="mask")


def method_train(method: str, base: TrainConfig) -> TrainConfig:
    """The base learner with `method`'s correction (module doc); every method logs ρ."""
    monitor = VCPOConfig(monitor=True)
    current = {"old_logp": "current", "vcpo": monitor}
    if method == "naive":
        return dataclasses.replace(base, old_logp="behaviour", vcpo=monitor)
    if method == "decoupled":
        return dataclasses.replace(base, **current, offpolicy=BEHAVIOUR_WEIGHTS)
    if method == "m2po":
        return dataclasses.replace(base, **current,
                                   offpolicy=OffPolicyConfig(correction="m2po", cap=0.04))
    if method == "vcpo":
        # the ghost norms (one batched pass, models.ghost_norms); the vmap(grad) twin agrees
        # to float rounding, and the choice is free on resume
        return dataclasses.replace(base, old_logp="current", vcpo=VCPOConfig(
            enabled=True, grad_norms="ghost", chunk=VCPO_CHUNK))
    if method == "truncated_is":
        return dataclasses.replace(base, **current, offpolicy=OffPolicyConfig(
            correction="truncated_is", level="token", cap=2.0))
    if method == "icepop":
        return dataclasses.replace(base, **current, offpolicy=OffPolicyConfig(
            correction="icepop", cap=5.0, low=0.5))
    if method == "exact":  # old_logp becomes "proximal" through AsyncConfig.proximal="exact"
        return dataclasses.replace(base, **current, offpolicy=BEHAVIOUR_WEIGHTS)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def method_proximal(method: str) -> str:
    """The AsyncConfig.proximal a method runs with ("exact" for exact, else "current")."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    return "exact" if method == "exact" else "current"
