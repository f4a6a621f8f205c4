"""The learner's frozen configs and the optimizer they build.

  OptimizerConfig -> make_schedule, make_optimizer (optax.chain(clip, adamw | sgd[, VCPO's
                     scale_by_ess]))
  OffPolicyConfig    which off-policy correction weights the loss (rl.objectives.offpolicy)
  TrainConfig        everything `rl.learner.step.train_step` needs besides state and batch
                     (hashable: a jit static)
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from models.config import REMAT_POLICIES
from models.logprobs import DEFAULT_CHUNK
from models.lora import LoraConfig
from rl.objectives.advantages import AdvantageConfig
from rl.learner.old_logp import available_old_logp
from rl.objectives.losses import LossConfig
from rl.objectives.registry import available_corrections, get_correction
from rl.objectives.vcpo import VCPOConfig, scale_by_ess


# ----------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer = chain(clip_by_global_norm(max_grad_norm), adamw | sgd) on a schedule.

    schedule "constant": lr ramps linearly over `warmup_steps` (step s gets
    lr * (s + 1) / (warmup_steps + 1)), then stays at lr. "cosine": same warmup, then
    cosine decay from lr to lr * min_lr_ratio over `decay_steps` steps, flat after. The
    schedule is a function of the step only (never of the run length), so a resumed run
    follows the same curve. max_grad_norm=None disables clipping.
    """

    name: str = "adamw"  # "adamw" | "sgd"
    learning_rate: float = 1e-6
    schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"OptimizerConfig.name must be 'adamw' or 'sgd', got {self.name!r}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(
                f"OptimizerConfig.schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(
                f"OptimizerConfig.learning_rate must be a finite number > 0, got {self.learning_rate}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.schedule == "cosine" and (
                not isinstance(self.decay_steps, int) or self.decay_steps < 1):
            raise ValueError(
                "OptimizerConfig.decay_steps must be an int >= 1 for the cosine schedule, got "
                f"{self.decay_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise ValueError(f"OptimizerConfig.b1/b2 must be in [0, 1), got {self.b1}, {self.b2}")
        if not self.eps > 0 or not self.weight_decay >= 0:
            raise ValueError(
                f"OptimizerConfig: need eps > 0 and weight_decay >= 0, got {self.eps}, {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"OptimizerConfig.max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm}")


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """Learning rate as a function of the step (see OptimizerConfig)."""
    lr, warm = config.learning_rate, config.warmup_steps

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        ramp = jnp.minimum(1.0, (s + 1.0) / (warm + 1.0))
        if config.schedule == "constant":
            return lr * ramp
        t = jnp.clip((s - warm) / config.decay_steps, 0.0, 1.0)
        cos = config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        return lr * ramp * cos

    return schedule


def make_optimizer(config: OptimizerConfig, vcpo: VCPOConfig | None = None
                   ) -> optax.GradientTransformation:
    """optax.chain(clip_by_global_norm, adamw | sgd) from a frozen config (deterministic:
    building it twice gives the same update rule, so it need not live in the state).
    With VCPO enabled and its lr_scale not "none", rl.objectives.vcpo.scale_by_ess is chained last
    (its update then needs the extra argument ess=ρ)."""
    sched = make_schedule(config)
    if config.name == "adamw":
        opt = optax.adamw(sched, b1=config.b1, b2=config.b2, eps=config.eps,
                          weight_decay=config.weight_decay)
    else:
        opt = optax.sgd(sched)
    clip = (optax.identity() if config.max_grad_norm is None
            else optax.clip_by_global_norm(config.max_grad_norm))
    if scales_lr(vcpo):
        return optax.chain(clip, opt, scale_by_ess(vcpo.rho_base, vcpo.lr_scale))
    return optax.chain(clip, opt)


def scales_lr(vcpo: VCPOConfig | None) -> bool:
    return vcpo is not None and vcpo.enabled and vcpo.lr_scale != "none"


KEEP_HEAD_LOGITS_BYTES = 2**30  # TrainConfig.head_remat=None keeps the head's logits up to this


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    """Optional correction for the train/inference mismatch between the learner's π_prox
    (the step's starting params) and the sampler's recorded μ. Default off.

    correction: "none", or a correction registered with
    rl.objectives.registry.register_correction (the built-ins below; a new one is a function
    and a decorator, no change here). "truncated_is": rl.objectives.offpolicy.truncated_is_weights (mode "truncate"|"mask",
    cap default 2 token / 8 sequence); "behaviour": AReaL's behaviour weights
    (rl.objectives.offpolicy.behaviour_weights, mode "mask"|"clamp", cap default 5);
    "m2po": M2PO's second-moment mask (rl.objectives.offpolicy.m2po_weights: the tokens
    with the largest (log π_prox - log μ)² are masked until the mean of the rest is <= cap,
    default 0.04, the paper's τ_M2; kept tokens weighted by π_prox/μ, uncapped; level
    "token" only). The mask is taken over one loss call's tokens: the whole batch with
    micro_batches=1 (the paper's form), else each micro-batch's own. "icepop": IcePop's
    two-sided token mask (rl.objectives.rejection.icepop_weights: ρ kept in [low, cap],
    default [0.5, 5]); "rejection": masked importance sampling's rejection
    (rl.objectives.rejection.rejection_weights: weight 1 inside [low, cap], level "token",
    "sequence" or "geometric"; cap default 2 / 8 / 1.01, low default 1 / cap). low: the lower
    bound of the two-sided corrections (None: their default).
    The weights multiply the per-token loss (aggregated over the original mask)."""

    correction: str = "none"  # "none" | "truncated_is" | "behaviour" | "m2po" | "icepop" | ...
    level: str = "token"  # "token" | "sequence" (| "geometric": rejection)
    cap: float | None = None
    mode: str | None = None
    low: float | None = None

    def __post_init__(self):
        known = ("none", *available_corrections())
        if self.correction not in known:
            raise ValueError(f"OffPolicyConfig.correction must be one of {known} (or a name "
                             "registered with rl.objectives.register_correction), got "
                             f"{self.correction!r}")
        fn = None if self.correction == "none" else get_correction(self.correction)
        if fn is None and self.level not in ("token", "sequence"):
            raise ValueError(f"OffPolicyConfig.level must be 'token' or 'sequence', got {self.level!r}")
        modes = (None,) if fn is None else fn.correction_modes
        if self.mode not in modes:
            raise ValueError(f"OffPolicyConfig.mode for {self.correction!r} must be one of {modes}, "
                             f"got {self.mode!r}")
        for name in ("cap", "low"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not v > 0):
                raise ValueError(f"OffPolicyConfig.{name} must be > 0 or None, got {v!r}")
        if self.low is not None and not getattr(fn, "correction_two_sided", False):
            raise ValueError(f"OffPolicyConfig.low is a lower bound of the two-sided "
                             f"corrections (icepop, rejection); {self.correction!r} takes none")
        if self.low is not None and self.cap is not None and self.low > self.cap:
            raise ValueError(f"OffPolicyConfig.low {self.low} exceeds cap {self.cap}")
        if fn is not None and self.level not in fn.correction_levels:
            raise ValueError(f"OffPolicyConfig(correction={self.correction!r}) works at level "
                             f"{' or '.join(map(repr, fn.correction_levels))}: set "
                             f"level={fn.correction_levels[0]!r}, got {self.level!r}")


OLD_LOGP_SOURCES = ("current", "behaviour", "proximal", "versions")  # the built-in ones


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `train_step` needs besides state and batch (hashable: a jit static).

    temperature: the sampler's temperature (log-probs are of softmax(logits / T)).
    micro_batches: gradient-accumulation micro-batches (must divide the batch).
    old_logp: the PPO "old" (proximal) policy π_prox, which also enters the off-policy
        weights π_prox/μ and the ratio decomposition. "current" = the step's starting
        params (the exact π_old when each batch gets one update: the ratio is 1 in value,
        the gradient flows through π_θ; AReaL's recomputed proximal policy);
        "behaviour" = the sampler's recorded log μ; "proximal" = the batch's
        `proximal_logprobs` (computed outside the step, e.g. exactly at each token's
        behaviour version from a parameter-snapshot ring, or with EWMA weights; required);
        "versions" = AReaL's log-linear interpolation between μ and π_θ from the per-token
        versions and the state's version (rl.objectives.offpolicy.approx_proximal_logp, no forward).
    reward_weights: {name: weight} for combining named rewards into the scalar reward
        that non-GDPO estimators see (default: every reward weight 1). GDPO gets the
        named rewards themselves (set its weights in AdvantageConfig.params).
    packed: compute log-probs on the packed shared-prefix layout whenever the batch
        carries one (`batch_from_trajectory(..., packed=True)` attaches it when every group
        shares its prompt); batches without it use the naive rows. Same results up to
        float rounding; needs the groups to split evenly into micro_batches.
    tree: compute log-probs on the tree layout whenever the batch carries one
        (`batch_from_trajectory(..., tree=True)`; models.tree.TreeGroups): each group's
        rows packed as one prefix tree, so the prompt and every prefix rows share past it
        (a LATR tree's tokens before its forks) run through the decoder once, and the
        vocabulary head once per tree token. Same results up to float rounding; exclusive
        with `packed` (two layouts of the same log-probs); needs the groups to split evenly
        into micro_batches. Its attention is a dense [L, L] tree mask (XLA).
    logprob_chunk: tokens per chunk of the vocabulary head in the learner's log-probs
        (models.logprobs.chunked_logprobs: the [tokens, vocab] logits exist one chunk at a
        time in the forward); 0 = the slow twin, full logits at once.
    head_remat: recompute each head chunk's logits in the backward (True: at most one
        chunk's [chunk, vocab] fp32 logits exist at a time, for one more vocabulary-head
        matmul) or keep them from the forward (False: tokens x vocab x 4 bytes per
        micro-batch held until the backward). None (the default): keep them when that is
        at most KEEP_HEAD_LOGITS_BYTES (1 GiB; SmolLM2's smollm2-rg step: 0.6 GB, kept,
        ~5 % faster), else recompute (e.g. 16k tokens of Qwen's 152k vocabulary: 10 GB).
        Same values either way; --low-memory sets True.
    vcpo: VCPO (rl.objectives.vcpo.VCPOConfig; default disabled, and then the step is unchanged).
        Enabled, the step computes each row's log w = Σ_t (log π_θ - log μ) with the
        step's starting params before the micro-batches (plus exact per-row gradient norms
        for the "opob" baseline unless grad_norms="none"), replaces the advantages by
        VCPO's (R - b_g)/σ_g, multiplies each sequence's loss by its truncated weight
        min(exp(clamp(log w, ±20)), is_cap), and scales the optimizer's final update by
        the ESS of the whole batch. It cannot be combined with `offpolicy` (both weight the
        loss by π/μ) and needs advantage "grpo" (which it replaces).
    remat: rematerialisation of the decoder layers in the learner's backward: None (the
        default: the ModelConfig's own `remat`, off in every preset), "none" (store every
        layer's activations), "dots" (store the outputs of the matmuls without batch
        dimensions, recompute norms, RoPE, attention and activations), "full" (store each
        layer's input only, recompute the layer). Same gradients up to float rounding;
        less memory for more time (docs/results/learner-memory.md measures both).
    lora: models.lora.LoraConfig to train LoRA adapters only (default None: full params).
        Then TrainState.params are the adapters (models.lora.init_lora; the optimizer
        state is theirs alone) and the step's third argument is the frozen base, required:
        log-probs come from models.lora.compose(base, adapters) and, with a KL term, the
        reference is the same base with the adapters off (no second copy).
    """

    loss: LossConfig = LossConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    offpolicy: OffPolicyConfig = OffPolicyConfig()
    temperature: float = 1.0
    micro_batches: int = 1
    old_logp: str = "current"
    reward_weights: Any = ()
    attn_impl: str | None = None
    packed: bool = False
    tree: bool = False
    vcpo: VCPOConfig = VCPOConfig()
    logprob_chunk: int = DEFAULT_CHUNK
    head_remat: bool | None = None
    lora: LoraConfig | None = None
    remat: str | None = None

    def keeps_head_logits(self, head_tokens: int, vocab_size: int) -> bool:
        """Whether the chunked head keeps its logits for the backward (head_remat), for a
        micro-batch whose head runs on head_tokens tokens."""
        if self.head_remat is not None:
            return not self.head_remat
        return head_tokens * vocab_size * 4 <= KEEP_HEAD_LOGITS_BYTES

    def __post_init__(self):
        if self.remat is not None and self.remat not in REMAT_POLICIES:
            raise ValueError(f"TrainConfig.remat must be None (the model config's setting) or "
                             f"one of {REMAT_POLICIES}, got {self.remat!r}")
        if isinstance(self.logprob_chunk, bool) or not isinstance(self.logprob_chunk, int) \
                or self.logprob_chunk < 0:
            raise ValueError("TrainConfig.logprob_chunk must be an int >= 0 (tokens per head "
                             f"chunk; 0 = full logits), got {self.logprob_chunk!r}")
        if self.head_remat is not None and not isinstance(self.head_remat, bool):
            raise ValueError("TrainConfig.head_remat must be None (auto), True or False, got "
                             f"{self.head_remat!r}")
        if not isinstance(self.packed, bool):
            raise ValueError(f"TrainConfig.packed must be True or False, got {self.packed!r}")
        if not isinstance(self.tree, bool):
            raise ValueError(f"TrainConfig.tree must be True or False, got {self.tree!r}")
        if self.tree and self.packed:
            raise ValueError("TrainConfig.tree and TrainConfig.packed are two layouts of the "
                             "same log-probs (a prefix tree per group, or the prompt once per "
                             "group): set one of them")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"TrainConfig.temperature must be a finite number > 0, got {self.temperature}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or self.micro_batches < 1:
            raise ValueError(f"TrainConfig.micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if self.old_logp not in available_old_logp():
            raise ValueError(f"TrainConfig.old_logp must be one of {available_old_logp()} (or a "
                             "source registered with rl.learner.old_logp.register_old_logp), "
                             f"got {self.old_logp!r}")
        weights = self.reward_weights
        items = weights.items() if isinstance(weights, Mapping) else weights
        object.__setattr__(self, "reward_weights", tuple(sorted((str(k), float(v)) for k, v in items)))
        for name, cls in (("loss", LossConfig), ("advantage", AdvantageConfig),
                          ("optimizer", OptimizerConfig), ("offpolicy", OffPolicyConfig),
                          ("vcpo", VCPOConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"TrainConfig.{name} must be a {cls.__name__}, got "
                                 f"{type(getattr(self, name)).__name__}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"TrainConfig.lora must be a models.lora.LoraConfig or None, got "
                             f"{type(self.lora).__name__}")
        if self.lora is not None and (self.vcpo.enabled or self.vcpo.monitor):
            raise ValueError("TrainConfig.lora with VCPO is not supported (VCPO's per-row "
                             "gradients are taken over full params); set vcpo=VCPOConfig()")
        if self.vcpo.enabled and self.offpolicy.correction != "none":
            raise ValueError("TrainConfig.vcpo (enabled) already weights each sequence by its "
                             "truncated π/μ; set offpolicy=OffPolicyConfig() (correction "
                             f"'none'), got correction {self.offpolicy.correction!r}")
        if self.vcpo.enabled and self.advantage.name != "grpo":
            raise ValueError("TrainConfig.vcpo (enabled) computes its own advantages "
                             "(R - b_g)/σ_g; leave TrainConfig.advantage at 'grpo', got "
                             f"{self.advantage.name!r}")

