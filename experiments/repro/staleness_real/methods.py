"""The sweep's methods and the one run config every cell starts from (the methods'
definitions are shared with the toy testbed: experiments.common.offpolicy_methods).

Each method is a change to the `smollm2-rg` preset's learner (PPO-clip 0.2 / 0.28,
token-mean, GRPO advantages, AdamW 2e-5 with 3 warm-up steps, temperature 0.8, packed),
trained by rl.loops.run_async in deterministic mode: step v trains on a batch sampled
with the params of version max(v - k, 0), so past step k every token is exactly k
versions stale (k = max_staleness). With μ the sampler's (behaviour) policy, π_θ the
learner, π_prox the PPO "old" policy:

  naive      PPO-clip on π_θ / μ: the behaviour log-probs as the old policy
             (TrainConfig.old_logp="behaviour"), no other correction; the baseline AReaL's
             and M2PO's papers show degrading with staleness.
  decoupled  AReaL's decoupled PPO: PPO-clip on π_θ / π_prox with π_prox recomputed
             exactly by the learner (its params before the update: old_logp="current",
             not the "versions" interpolation), times the behaviour weight sg[π_prox / μ],
             tokens with a weight above 5 rejected (OffPolicyConfig "behaviour", token, mask).
  m2po       M2PO: tokens with the largest (log π_prox - log μ)² masked until the mean of
             the rest is <= 0.04, kept tokens weighted by π_prox / μ, no clip
             (OffPolicyConfig "m2po"; with π_prox = the step's params the PPO clip is inactive).
  vcpo       VCPO: sequence weight min(π/μ, 8), the minimum-variance off-policy baseline
             (exact per-row gradient norms, ghost: one batched pass), the update scaled by
             √ESS (VCPOConfig(enabled)).

Every method logs the batch's ESS ratio ρ (VCPOConfig(monitor=True): from the rows' log w
that the learner's own forward returns, no extra pass),
and the learner logs both factors of π_θ/μ (mismatch_* = π_prox/μ, staleness_* = π_θ/π_prox).
"""
from __future__ import annotations

from experiments.common.offpolicy_methods import COLORS, LABELS  # noqa: F401
from experiments.common.staleness_cells import SweepSetup, cell_config, run_name  # noqa: F401

METHODS = ("naive", "decoupled", "m2po", "vcpo")  # of experiments.common.offpolicy_methods


def grid_order(methods: list[str], ks: list[int], seeds: list[int],
               extra_seed_ks: list[int]) -> list[tuple[str, int, int]]:
    """Cells in the order they are worth running on a budget: the first method at k = 0
    (the synchronous-equivalent baseline: at k = 0 the methods differ only in VCPO's
    baseline and float rounding), then the first seed of every k > 0 in the order given,
    then the other methods at k = 0, then the extra seeds at `extra_seed_ks` (the issue:
    every method gets 2 seeds at the largest k), then the rest."""
    first, rest = seeds[0], seeds[1:]
    stale = [k for k in ks if k > 0]
    order = [(methods[0], 0, first)] if 0 in ks else []
    order += [(m, k, first) for k in stale for m in methods]
    order += [(m, 0, first) for m in methods] if 0 in ks else []
    order += [(m, k, s) for s in rest for k in stale if k in extra_seed_ks for m in methods]
    order += [(m, k, s) for s in rest for k in [*stale, 0] if k in ks for m in methods]
    seen, out = set(), []
    for cell in order:
        if cell not in seen:
            seen.add(cell)
            out.append(cell)
    return out
