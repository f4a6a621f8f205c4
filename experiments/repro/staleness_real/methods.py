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

import dataclasses

from experiments.common.offpolicy_methods import COLORS, LABELS, method_train  # noqa: F401
from rl.loops import AsyncConfig
from rl.loops.config import LoggingConfig, RewardConfig, RunConfig, TaskSpec
from rl.run import PRESETS

METHODS = ("naive", "decoupled", "m2po", "vcpo")  # of experiments.common.offpolicy_methods
BASE_PRESET = "smollm2-rg"


@dataclasses.dataclass(frozen=True)
class SweepSetup:
    """What every cell of a sweep shares: the task (spec, options; its split is fixed by
    task_seed), the schedule, the batch and the sampler's compute dtype (rollout_dtype
    "bfloat16": a bf16 inference engine beside the fp32 learner, a real train/inference
    mismatch). Recorded in every run's JSON."""

    task: str | None  # None: the preset's own task (an environment such as the calculator)
    task_options: dict  # with task None: options over the preset task's own
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8
    eval_every: int = 10
    eval_prompts: int = 256
    eval_sampled_prompts: int = 16
    save_every: int = 5
    task_seed: int = 0
    preset: str = BASE_PRESET  # the learner, loop and model every method starts from
    rollout_dtype: str | None = None  # the sampler's compute dtype (None: the model's, fp32)


def cell_config(setup: SweepSetup, method: str, k: int, seed: int, run_dir: str) -> RunConfig:
    """The whole RunConfig of one (method, staleness k, seed) cell."""
    preset = PRESETS[setup.preset]
    loop = dataclasses.replace(
        preset.loop, steps=setup.steps, prompts_per_step=setup.prompts_per_step,
        group_size=setup.group_size, eval_every=setup.eval_every,
        eval_prompts=setup.eval_prompts, eval_greedy=True,
        eval_sampled_prompts=setup.eval_sampled_prompts, save_every=setup.save_every,
        keep_checkpoints=1, seed=seed, time_limit_s=0.0)
    return dataclasses.replace(
        preset, name=f"staleness-real-{method}-k{k}", run_dir=run_dir,
        description=f"issue 35 sweep cell: {LABELS[method]}, max staleness {k}, seed {seed}"
                    + (f", {setup.rollout_dtype} rollouts" if setup.rollout_dtype else ""),
        task=TaskSpec(preset.task.spec, {**preset.task.kwargs, **setup.task_options},
                      seed=preset.task.seed) if setup.task is None else
        TaskSpec(setup.task, dict(setup.task_options), seed=setup.task_seed),
        # the strict verifier: full credit only, not reasoning-gym's partial credit
        reward=RewardConfig(verifier="strict" if (setup.task or "").startswith("reasoning_gym")
                            else None),
        train=method_train(method, preset.train), loop=loop,
        rollout=dataclasses.replace(preset.rollout, dtype=setup.rollout_dtype),
        # k > 0: the param ring on disk (bit-identical; at k = 32 the in-memory ring would
        # be 34 x 0.54 GB of SmolLM2 weights beside a ~14 GB step)
        asynchronous=AsyncConfig(mode="deterministic", max_staleness=k,
                                 snapshot_store="disk" if k > 0 else "memory"),
        logging=LoggingConfig(wandb="disabled", progress=False))


def run_name(method: str, k: int, seed: int) -> str:
    return f"{method}_k{k}_s{seed}"


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
