"""The learner: `TrainState`, `TrainBatch` and one pure, jittable `train_step`.

One step: recompute token log-probs with `models.decoder.forward` (log-softmax of
logits / the sampler's temperature; the logit at position t predicts token t+1) ->
advantages from rewards (`rl.advantages.compute_advantages`) -> policy loss
(`rl.losses.compute_loss`: PPO-clip / GSPO / CISPO, aggregation, optional KL to a frozen
reference) with optional off-policy weights (`rl.offpolicy`) -> gradients accumulated
over micro-batches with `lax.scan` -> ONE optax update (global-norm clipping, then AdamW
or SGD on a warmup + constant / cosine schedule).

Micro-batching is exact: each micro-batch's loss is scaled by its share of the full
batch's normaliser (tokens for "token-mean", non-empty sequences for the seq-mean
modes), so the summed gradient equals the full-batch gradient up to float rounding.

Shared-prefix packing (DualKV, `TrainConfig.packed`): when every group of a batch shares
its prompt, `batch_from_trajectory(..., packed=True)` attaches `models.packed.PackedGroups`
and the step computes the same log-probs with `models.packed.packed_token_logprobs` (each
prompt runs once per group instead of once per response); the loss code is the same.

VCPO (`TrainConfig.vcpo`, rl.vcpo): sequence importance weights against the behaviour
policy, the minimum-variance off-policy baseline and an ESS-scaled final update; off by
default (the step is then exactly the one above).

`make_train_step` jits `train_step` with explicit in/out shardings derived from the
models' logical axis rules (params by `models.sharding`, batch rows (packed: groups) over
("data", "fsdp")), donating the state.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from models.config import ModelConfig
from models.decoder import forward, init_params, param_logical_axes
from models.packed import PackedGroups, groups_share_prompts, pack_groups, packed_token_logprobs
from models.sharding import DEFAULT_RULES, LogicalRules, logical_to_mesh_sharding, mesh_context
from rl.advantages import AdvantageConfig, compute_advantages
from rl.losses import LossConfig, compute_loss, token_entropy
from rl.offpolicy import (approx_proximal_logp, behaviour_weights, ratio_decomposition_metrics,
                          truncated_is_weights)
from rl.trajectory import Trajectory
from rl.vcpo import (VCPOConfig, ess_lr_scale, ess_ratio, per_trajectory_logprob_grads, scale_by_ess,
                     sequence_log_weights, truncated_sequence_weights, vcpo_advantages,
                     weight_tail_stats)

Params = Any
sg = jax.lax.stop_gradient


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
    With VCPO enabled and its lr_scale not "none", rl.vcpo.scale_by_ess is chained last
    (its update then needs the extra argument ess=ρ)."""
    sched = make_schedule(config)
    if config.name == "adamw":
        opt = optax.adamw(sched, b1=config.b1, b2=config.b2, eps=config.eps,
                          weight_decay=config.weight_decay)
    else:
        opt = optax.sgd(sched)
    clip = (optax.identity() if config.max_grad_norm is None
            else optax.clip_by_global_norm(config.max_grad_norm))
    if _scales_lr(vcpo):
        return optax.chain(clip, opt, scale_by_ess(vcpo.rho_base, vcpo.lr_scale))
    return optax.chain(clip, opt)


def _scales_lr(vcpo: VCPOConfig | None) -> bool:
    return vcpo is not None and vcpo.enabled and vcpo.lr_scale != "none"


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    """Optional correction for the train/inference mismatch between the learner's π_prox
    (the step's starting params) and the sampler's recorded μ. Default off.

    correction "truncated_is": rl.offpolicy.truncated_is_weights (mode "truncate"|"mask",
    cap default 2 token / 8 sequence); "behaviour": AReaL's behaviour weights
    (rl.offpolicy.behaviour_weights, mode "mask"|"clamp", cap default 5).
    The weights multiply the per-token loss (aggregated over the original mask)."""

    correction: str = "none"  # "none" | "truncated_is" | "behaviour"
    level: str = "token"  # "token" | "sequence"
    cap: float | None = None
    mode: str | None = None

    def __post_init__(self):
        if self.correction not in ("none", "truncated_is", "behaviour"):
            raise ValueError("OffPolicyConfig.correction must be 'none', 'truncated_is' or "
                             f"'behaviour', got {self.correction!r}")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"OffPolicyConfig.level must be 'token' or 'sequence', got {self.level!r}")
        modes = {"none": (None,), "truncated_is": (None, "truncate", "mask"),
                 "behaviour": (None, "mask", "clamp")}[self.correction]
        if self.mode not in modes:
            raise ValueError(f"OffPolicyConfig.mode for {self.correction!r} must be one of {modes}, "
                             f"got {self.mode!r}")
        if self.cap is not None and not self.cap > 0:
            raise ValueError(f"OffPolicyConfig.cap must be > 0 or None, got {self.cap}")


OLD_LOGP_SOURCES = ("current", "behaviour", "proximal", "versions")


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
        versions and the state's version (rl.offpolicy.approx_proximal_logp, no forward).
    reward_weights: {name: weight} for combining named rewards into the scalar reward
        that non-GDPO estimators see (default: every reward weight 1). GDPO gets the
        named rewards themselves (set its weights in AdvantageConfig.params).
    packed: compute log-probs on the packed shared-prefix layout whenever the batch
        carries one (`batch_from_trajectory(..., packed=True)` attaches it when every group
        shares its prompt); batches without it use the naive rows. Same results up to
        float rounding; needs the groups to split evenly into micro_batches.
    vcpo: VCPO (rl.vcpo.VCPOConfig; default disabled, and then the step is unchanged).
        Enabled, the step computes each row's log w = Σ_t (log π_θ - log μ) with the
        step's starting params before the micro-batches (plus exact per-row gradient norms
        for the "opob" baseline unless grad_norms="none"), replaces the advantages by
        VCPO's (R - b_g)/σ_g, multiplies each sequence's loss by its truncated weight
        min(exp(clamp(log w, ±20)), is_cap), and scales the optimizer's final update by
        the ESS of the whole batch. It cannot be combined with `offpolicy` (both weight the
        loss by π/μ) and needs advantage "grpo" (which it replaces).
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
    vcpo: VCPOConfig = VCPOConfig()

    def __post_init__(self):
        if not isinstance(self.packed, bool):
            raise ValueError(f"TrainConfig.packed must be True or False, got {self.packed!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"TrainConfig.temperature must be a finite number > 0, got {self.temperature}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) \
                or self.micro_batches < 1:
            raise ValueError(f"TrainConfig.micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if self.old_logp not in OLD_LOGP_SOURCES:
            raise ValueError(f"TrainConfig.old_logp must be one of {OLD_LOGP_SOURCES}, got {self.old_logp!r}")
        weights = self.reward_weights
        items = weights.items() if isinstance(weights, Mapping) else weights
        object.__setattr__(self, "reward_weights", tuple(sorted((str(k), float(v)) for k, v in items)))
        for name, cls in (("loss", LossConfig), ("advantage", AdvantageConfig),
                          ("optimizer", OptimizerConfig), ("offpolicy", OffPolicyConfig),
                          ("vcpo", VCPOConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"TrainConfig.{name} must be a {cls.__name__}, got "
                                 f"{type(getattr(self, name)).__name__}")
        if self.vcpo.enabled and self.offpolicy.correction != "none":
            raise ValueError("TrainConfig.vcpo (enabled) already weights each sequence by its "
                             "truncated π/μ; set offpolicy=OffPolicyConfig() (correction "
                             f"'none'), got correction {self.offpolicy.correction!r}")
        if self.vcpo.enabled and self.advantage.name != "grpo":
            raise ValueError("TrainConfig.vcpo (enabled) computes its own advantages "
                             "(R - b_g)/σ_g; leave TrainConfig.advantage at 'grpo', got "
                             f"{self.advantage.name!r}")


# ----------------------------------------------------------------------------- pytrees
@struct.dataclass
class TrainState:
    """params; opt_state (optax state of make_optimizer(config.optimizer, config.vcpo)); step int32 []
    (optimizer updates so far); version int32 [] (policy version of `params`; +1 per
    update); rng uint32 [2] (raw key data, for the loop's sampling seeds)."""

    params: Params
    opt_state: Any
    step: jax.Array
    version: jax.Array
    rng: jax.Array


def init_train_state(params: Params, config: TrainConfig, rng: Any = 0) -> TrainState:
    """A fresh state at step 0 / version 0. rng: int seed or PRNG key."""
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        key = jax.random.PRNGKey(int(rng))
    else:
        key = jnp.asarray(rng)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise ValueError(f"rng must be an int seed or a PRNG key, got dtype {key.dtype} shape {key.shape}")
    opt_state = make_optimizer(config.optimizer, config.vcpo).init(params)
    return TrainState(params=params, opt_state=opt_state, step=jnp.zeros((), jnp.int32),
                      version=jnp.zeros((), jnp.int32), rng=key)


@struct.dataclass
class TrainBatch:
    """One learner batch; every array field has the B rows first (they shard over
    ("data", "fsdp")). Row b = [prompt, response, padding] contiguous; per-token fields
    are aligned with `tokens` (index t describes token t, predicted by the logit at t-1).

    tokens [B, T] int32; positions [B, T] int32; loss_mask [B, T] bool (True at response
    tokens); behaviour_logprobs [B, T] float32 (log μ of each response token, 0 elsewhere);
    versions [B, T] int32 (policy version that sampled each token, 0 elsewhere);
    rewards [B, K] float32 (one column per name in `reward_names`); proximal_logprobs:
    None or [B, T] float32 aligned like behaviour_logprobs (log π_prox of each response
    token, computed outside the step; used by TrainConfig.old_logp="proximal", and, when
    given, as π_prox of the ratio-decomposition metrics whatever old_logp is);
    loss_weights: None or [B, T] float32 >= 0 aligned like loss_mask (a per-token factor on
    the policy loss, e.g. a buffer down-weighting stale tokens; multiplies any off-policy
    weights; the aggregation's normaliser still counts the mask). Static: group_size
    (contiguous groups of that many rows), reward_names. packed: None, or the same batch
    as PackedGroups with G = B / group_size groups first (G shards over ("data", "fsdp"))
    and rows[g, n] = g * group_size + n (what batch_from_trajectory builds)."""

    tokens: jax.Array
    positions: jax.Array
    loss_mask: jax.Array
    behaviour_logprobs: jax.Array
    versions: jax.Array
    rewards: jax.Array
    group_size: int = struct.field(pytree_node=False)
    reward_names: tuple[str, ...] = struct.field(pytree_node=False)
    packed: PackedGroups | None = None
    proximal_logprobs: jax.Array | None = None
    loss_weights: jax.Array | None = None


def _reward_columns(rewards: Any, batch: int) -> tuple[tuple[str, ...], np.ndarray]:
    """{name: [B]} or [B] -> (names, [B, K] float32), with clear errors."""
    if rewards is None:
        raise ValueError("rewards are missing: attach them to the Trajectory (with_rewards) "
                         "or pass rewards={name: [B]}")
    if not isinstance(rewards, Mapping):
        rewards = {"reward": rewards}
    if not rewards:
        raise ValueError("rewards is an empty mapping; give at least one named reward")
    names = tuple(str(k) for k in rewards)
    cols = []
    for name in names:
        col = np.asarray(rewards[name], dtype=np.float64)
        if col.ndim != 1 or col.shape[0] != batch:
            raise ValueError(f"rewards[{name!r}] must be a list of {batch} numbers (one per "
                             f"response), got shape {col.shape}")
        bad = ~np.isfinite(col)
        if bad.any():
            raise ValueError(f"rewards[{name!r}] has non-finite values (NaN or inf) at rows "
                             f"{np.flatnonzero(bad).tolist()[:8]}; the reward function must "
                             "return finite numbers")
        cols.append(col)
    return names, np.stack(cols, axis=1).astype(np.float32)


def batch_from_trajectory(
    traj: Trajectory,
    *,
    group_size: int,
    model_config: ModelConfig,
    rewards: Mapping[str, Any] | None = None,
    seq_len: int | None = None,
    packed: bool = False,
) -> TrainBatch:
    """Host-side: pack a Trajectory into a TrainBatch (numpy on host; jit moves it).

    Row b becomes tokens [prompt_ids[b, :P_b], response_ids[b, :R_b], 0...] of width
    seq_len (default P_max + R_max of the trajectory: a fixed width keeps one compiled
    step). rewards default to traj.rewards. Groups must be contiguous blocks of
    `group_size` rows with one group id each (what RolloutEngine.harvest returns).
    packed=True also attaches the packed shared-prefix layout (TrainBatch.packed, widths
    P_max and R_max of the trajectory: one compiled shape) when every group shares its
    prompt, some response is non-empty and P_max + R_max fits the model; otherwise
    TrainBatch.packed stays None and the step uses the naive rows.
    Raises ValueError for an empty batch, bad group layout, missing / NaN / inf /
    wrongly sized rewards, or a sequence longer than seq_len or the model's maximum.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    group_size = int(group_size)
    b = int(traj.response_ids.shape[0])
    if b == 0:
        raise ValueError("the batch is empty (0 responses): nothing to train on; sample at least "
                         "one group (e.g. dynamic sampling dropped every group)")
    if b % group_size:
        raise ValueError(f"batch of {b} responses is not a whole number of groups of size {group_size}")
    names, reward_cols = _reward_columns(traj.rewards if rewards is None else rewards, b)
    gids = np.asarray(traj.group_ids).reshape(-1, group_size)
    if not (gids == gids[:, :1]).all():
        raise ValueError(f"group_ids must be contiguous blocks of group_size={group_size} equal ids "
                         f"(one group per block), got {np.asarray(traj.group_ids).tolist()[:16]}")
    plen = np.asarray(traj.prompt_lengths)
    rmask = np.asarray(traj.response_mask)
    rlen = rmask.sum(axis=1)
    total = plen + rlen
    width = traj.prompt_ids.shape[1] + traj.response_ids.shape[1] if seq_len is None else int(seq_len)
    longest = int(total.max())
    if longest > width:
        raise ValueError(f"a sequence has {longest} tokens (prompt + response), longer than "
                         f"seq_len={width}; raise seq_len")
    if width > model_config.max_position_embeddings:
        raise ValueError(
            f"sequences of {width} tokens (prompt + response) exceed the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}; shorten "
            "max_prompt_len / max_new_tokens")
    prompt_ids, resp_ids = np.asarray(traj.prompt_ids), np.asarray(traj.response_ids)
    blp, ver = np.asarray(traj.behaviour_logprobs), np.asarray(traj.versions)
    tokens = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), bool)
    behaviour = np.zeros((b, width), np.float32)
    versions = np.zeros((b, width), np.int32)
    for i in range(b):
        p, r = int(plen[i]), int(rlen[i])
        tokens[i, :p] = prompt_ids[i, :p]
        tokens[i, p:p + r] = resp_ids[i, :r]
        mask[i, p:p + r] = True
        behaviour[i, p:p + r] = blp[i, :r]
        versions[i, p:p + r] = ver[i, :r]
    if tokens.max() >= model_config.vocab_size:
        raise ValueError(f"token ids must be < vocab_size={model_config.vocab_size}, got {tokens.max()}")
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width)).copy()
    groups = None
    p_w, r_w = traj.prompt_ids.shape[1], traj.response_ids.shape[1]
    gid = np.asarray(traj.group_ids)
    if packed and p_w + r_w <= model_config.max_position_embeddings \
            and groups_share_prompts(tokens, plen, rlen, gid):
        # contiguous groups (checked above) => rows[g, n] = g * group_size + n
        groups = pack_groups(tokens, plen, rlen, gid, prompt_width=p_w, response_width=r_w)
    return TrainBatch(tokens=tokens, positions=positions, loss_mask=mask,
                      behaviour_logprobs=behaviour, versions=versions, rewards=reward_cols,
                      group_size=group_size, reward_names=names, packed=groups)


# ----------------------------------------------------------------------------- the step
def token_logprobs(params: Params, model_config: ModelConfig, tokens: jax.Array,
                   positions: jax.Array, temperature: float, attn_impl: str | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """(logp [B, T-1], scaled logits [B, T-1, V]): logp[b, t] = log softmax(logits[b, t] / T)
    at tokens[b, t + 1], i.e. the log-prob of token t+1 (the logit at t predicts t+1)."""
    logits = forward(params, model_config, tokens, positions, attn_impl=attn_impl)
    z = logits[:, :-1].astype(jnp.float32) / temperature
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(z, target[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1), z


def _scalar_rewards(config: TrainConfig, batch: TrainBatch) -> jax.Array:
    weights = dict(config.reward_weights)
    unknown = set(weights) - set(batch.reward_names)
    if unknown:
        raise ValueError(f"TrainConfig.reward_weights names {sorted(unknown)} that the batch does "
                         f"not have; its rewards are {list(batch.reward_names)}")
    w = jnp.asarray([weights.get(n, 1.0) for n in batch.reward_names], jnp.float32)
    return batch.rewards @ w


def _advantages(config: TrainConfig, batch: TrainBatch):
    if config.advantage.name == "gdpo":
        rewards = {n: batch.rewards[:, k] for k, n in enumerate(batch.reward_names)}
    else:
        rewards = _scalar_rewards(config, batch)
    return compute_advantages(config.advantage, rewards, batch.group_size)


_LOSS_KEYS = ("loss", "pg_loss", "kl")  # aggregated like the loss (not per token)


def _offpolicy_weights(config: OffPolicyConfig, prox, behaviour, mask):
    kw = {"level": config.level}
    if config.cap is not None:
        kw["cap"] = config.cap
    if config.mode is not None:
        kw["mode"] = config.mode
    fn = truncated_is_weights if config.correction == "truncated_is" else behaviour_weights
    return fn(prox, behaviour, mask, **kw)


def _vcpo(config: TrainConfig, model_config: ModelConfig, params: Params, batch: TrainBatch,
          monitor: bool = False) -> dict:
    """VCPO's per-row quantities for the WHOLE batch (the jitted step sees the global array,
    so ρ counts every micro-batch and device): log w from the step's starting params (with
    exact per-row gradient norms when the OPOB baseline needs them), advantages, truncated
    sequence weights [B] and the vcpo_* metrics. monitor: only ρ and the log-weight
    statistics (one forward)."""
    vc = config.vcpo
    tokens, positions, loss_mask = batch.tokens, batch.positions, batch.loss_mask
    mask = loss_mask[:, 1:]
    norms = None
    if not monitor and vc.baseline == "opob" and vc.grad_norms == "exact":
        logp, norms = per_trajectory_logprob_grads(params, model_config, tokens, positions,
                                                   loss_mask, config.temperature, vc.chunk,
                                                   config.attn_impl)
    else:  # one forward, micro-batch by micro-batch (the activations of one at a time)
        m = config.micro_batches

        def fwd(xs):
            return token_logprobs(params, model_config, *xs, config.temperature, config.attn_impl)[0]

        split = lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:])  # noqa: E731
        logp = jax.lax.map(fwd, (split(tokens), split(positions))).reshape(mask.shape)
    log_w = sequence_log_weights(logp, batch.behaviour_logprobs[:, 1:], mask)
    valid = jnp.any(mask, axis=1)
    rho = ess_ratio(log_w, valid)
    if monitor:
        return {"metrics": {"vcpo_ess": rho, **weight_tail_stats(log_w, valid)}}
    rewards = _scalar_rewards(config, batch)
    adv, base = vcpo_advantages(rewards, log_w, norms, batch.group_size, baseline=vc.baseline,
                                variant=vc.variant, valid=valid, is_cap=vc.is_cap)
    seq_w = truncated_sequence_weights(log_w, vc.is_cap)
    group_mean = jnp.mean(rewards.reshape(base.shape[0], -1), axis=1)
    metrics = {
        "vcpo_ess": rho,
        "vcpo_lr_scale": ess_lr_scale(rho, vc.rho_base, vc.lr_scale),
        "vcpo_baseline_minus_mean": jnp.mean(jnp.abs(base - group_mean)),
        "vcpo_capped_frac": jnp.sum(valid & (log_w > math.log(vc.is_cap)))
        / jnp.maximum(jnp.sum(valid), 1),
        **weight_tail_stats(log_w, valid),
    }
    if norms is not None:
        metrics["vcpo_grad_sq_norm_mean"] = jnp.sum(jnp.where(valid, norms, 0.0)) \
            / jnp.maximum(jnp.sum(valid), 1)
    return {"advantages": adv, "seq_weights": seq_w, "metrics": metrics}


def _micro_loss(params, mb, ref_params, norm, version, *, config: TrainConfig,
                model_config: ModelConfig):
    """Loss of one micro-batch, scaled to its share of the full batch, and its metrics.
    mb = (tokens, positions, mask, behaviour, adv, versions, proximal, loss_weights, packed);
    proximal / loss_weights ([b, T-1] or None) are the batch's fields; packed (PackedGroups of this
    micro-batch's whole groups, rows local to it, or None) selects the packed forward;
    version: the state's policy version (for old_logp="versions")."""
    tokens, positions, mask, behaviour, adv, versions, proximal, loss_weights, packed = mb

    def logprobs(p):  # (logp [b, T-1], z [b, T-1, V]) in the naive row layout either way
        if packed is None:
            return token_logprobs(p, model_config, tokens, positions, config.temperature,
                                  config.attn_impl)
        return packed_token_logprobs(p, model_config, packed, width=tokens.shape[1],
                                     temperature=config.temperature, attn_impl=config.attn_impl)

    logp, z = logprobs(params)
    if config.old_logp == "current":
        old = sg(logp)
    elif config.old_logp == "behaviour":
        old = behaviour
    elif config.old_logp == "proximal":
        old = sg(proximal)
    else:  # "versions"
        old = approx_proximal_logp(logp, behaviour, versions, version, mask)
    ref = None
    if ref_params is not None:
        ref = sg(logprobs(ref_params)[0])
    entropy = token_entropy(z if config.loss.entropy_coef else sg(z), mask)
    weights, extra = None, {}
    if config.offpolicy.correction != "none":
        ow = _offpolicy_weights(config.offpolicy, old, behaviour, mask)
        weights, extra = ow.weights, ow.metrics
    if loss_weights is not None:
        weights = loss_weights if weights is None else weights * loss_weights
    loss, metrics = compute_loss(config.loss, logp, old, adv, mask, ref_logp=ref, entropy=entropy,
                                 token_weights=weights)
    decomp_prox = old if proximal is None else sg(proximal)
    metrics = {**metrics, **extra,
               **ratio_decomposition_metrics(logp, decomp_prox, behaviour, mask)}
    n_tok = jnp.sum(mask).astype(jnp.float32)
    n_seq = jnp.sum(jnp.any(mask, axis=1)).astype(jnp.float32)
    share = (n_tok if config.loss.aggregation == "token-mean" else n_seq) / norm
    return loss * share, (metrics, share, n_tok)


def train_step(state: TrainState, batch: TrainBatch, ref_params: Params | None = None, *,
               config: TrainConfig, model_config: ModelConfig) -> tuple[TrainState, dict]:
    """One optimizer update from one batch (pure; jit it with `make_train_step`).

    Args:
        state: TrainState; batch: TrainBatch with B rows (B divisible by
            config.micro_batches); ref_params: frozen reference params (same tree as
            state.params), required iff config.loss.kl_coef > 0. With config.packed and
            batch.packed set, log-probs (current and reference) come from the packed
            shared-prefix forward; its G groups must divide into config.micro_batches.
    Returns:
        (new state with step and version + 1, metrics {name: scalar}): loss, pg_loss,
        clip_frac*, ratio_mean/max, approx_kl, kl (with a reference), entropy,
        mismatch_* / staleness_* / total_* (log π/μ statistics), is_* or behav_* (with an
        off-policy correction), grad_norm (before clipping), lr, tokens, response_len,
        reward_mean, reward_<name>, adv_mean, adv_abs_mean; with VCPO also vcpo_ess (ρ),
        vcpo_lr_scale, vcpo_baseline_minus_mean (mean |b_g - group mean|), vcpo_capped_frac,
        vcpo_logw_max / _p99 / _mean / _std and (exact norms) vcpo_grad_sq_norm_mean
        (VCPOConfig.monitor without VCPO: vcpo_ess and vcpo_logw_* only).
    """
    if (config.loss.kl_coef > 0) != (ref_params is not None):
        raise ValueError("ref_params must be given exactly when config.loss.kl_coef > 0 "
                         f"(kl_coef={config.loss.kl_coef}, ref_params "
                         f"{'given' if ref_params is not None else 'missing'})")
    if config.old_logp == "proximal" and batch.proximal_logprobs is None:
        raise ValueError('TrainConfig.old_logp="proximal" needs TrainBatch.proximal_logprobs '
                         "([B, T], e.g. from rl.proximal); attach them with "
                         "batch.replace(proximal_logprobs=...) or choose another old_logp")
    for name in ("proximal_logprobs", "loss_weights"):
        field = getattr(batch, name)
        if field is not None and tuple(field.shape) != tuple(batch.tokens.shape):
            raise ValueError(f"TrainBatch.{name} has shape {tuple(field.shape)}, expected the "
                             f"tokens' shape {tuple(batch.tokens.shape)} (aligned like loss_mask)")
    b = batch.tokens.shape[0]
    m = config.micro_batches
    if b % m:
        raise ValueError(f"batch of {b} rows does not split into micro_batches={m}; "
                         "make the batch a multiple of micro_batches")
    vcpo_out = None
    if config.vcpo.enabled:
        vcpo_out = _vcpo(config, model_config, state.params, batch)
        adv = vcpo_out["advantages"]
        mask = batch.loss_mask[:, 1:]
    else:
        if config.vcpo.monitor:  # metrics only: the loss and the update stay the plain ones
            vcpo_out = _vcpo(config, model_config, state.params, batch, monitor=True)
        adv_out = _advantages(config, batch)
        adv = adv_out.advantages
        mask = batch.loss_mask[:, 1:] & (adv_out.sample_mask[:, None] > 0)
    n_tok_all = jnp.sum(mask).astype(jnp.float32)
    n_seq_all = jnp.sum(jnp.any(mask, axis=1)).astype(jnp.float32)
    norm = jnp.maximum(n_tok_all if config.loss.aggregation == "token-mean" else n_seq_all, 1.0)

    def split(x):  # [B, ...] -> [M, B/M, ...] (packed: [G, ...] -> [M, G/M, ...])
        return x.reshape((m, x.shape[0] // m) + x.shape[1:])

    packed = batch.packed if config.packed else None
    if packed is not None:
        g = packed.prompt_tokens.shape[0]
        if g % m:
            raise ValueError(f"the packed batch has {g} groups, which do not split into "
                             f"micro_batches={m} whole groups; make the number of groups a "
                             "multiple of micro_batches or set TrainConfig.packed=False")
        # micro-batches hold whole contiguous groups: make each one's rows local to it
        packed = packed.replace(rows=packed.rows % (b // m))
    mbs = tuple(split(x) for x in (batch.tokens, batch.positions, mask,
                                   batch.behaviour_logprobs[:, 1:], adv, batch.versions[:, 1:]))
    loss_weights = batch.loss_weights
    if config.vcpo.enabled:  # the truncated sequence weight, on every token of the row
        w = jnp.broadcast_to(vcpo_out["seq_weights"][:, None], batch.tokens.shape)
        loss_weights = w if loss_weights is None else w * loss_weights
    mbs += tuple(None if f is None else split(f[:, 1:])
                 for f in (batch.proximal_logprobs, loss_weights))
    mbs += (None if packed is None else jax.tree.map(split, packed),)
    grad_fn = jax.value_and_grad(partial(_micro_loss, config=config, model_config=model_config),
                                 has_aux=True)

    def body(acc, mb):
        (_, (metrics, share, n_tok)), g = grad_fn(state.params, mb, ref_params, norm, state.version)
        return jax.tree.map(jnp.add, acc, g), (metrics, share, n_tok)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (stacked, shares, n_toks) = jax.lax.scan(body, zeros, mbs)

    tok_w = n_toks / jnp.maximum(jnp.sum(n_toks), 1.0)
    metrics = {}
    for k, v in stacked.items():
        if k.endswith("_max"):
            metrics[k] = jnp.max(v)
        elif k in _LOSS_KEYS:
            metrics[k] = jnp.sum(v * shares)
        else:
            metrics[k] = jnp.sum(v * tok_w)

    tx = make_optimizer(config.optimizer, config.vcpo)
    if _scales_lr(config.vcpo):
        updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                       ess=vcpo_out["metrics"]["vcpo_ess"])
    else:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    rewards = _scalar_rewards(config, batch) if config.advantage.name != "gdpo" \
        else jnp.sum(batch.rewards, axis=1)
    metrics.update(
        grad_norm=optax.tree.norm(grads),
        lr=make_schedule(config.optimizer)(state.step),
        tokens=n_tok_all,
        response_len=jnp.sum(batch.loss_mask).astype(jnp.float32) / b,
        reward_mean=jnp.mean(rewards),
        adv_mean=jnp.mean(adv),
        adv_abs_mean=jnp.mean(jnp.abs(adv)),
    )
    for k, name in enumerate(batch.reward_names):
        metrics[f"reward_{name}"] = jnp.mean(batch.rewards[:, k])
    if vcpo_out is not None:
        metrics.update(vcpo_out["metrics"])
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                              version=state.version + 1)
    return new_state, metrics


# ----------------------------------------------------------------------------- jit + shardings
def abstract_train_state(model_config: ModelConfig, config: TrainConfig) -> TrainState:
    """Shapes and dtypes (jax.ShapeDtypeStruct leaves) of a TrainState; allocates nothing."""
    def build():
        return init_train_state(init_params(model_config, 0), config, 0)
    return jax.eval_shape(build)


def state_shardings(model_config: ModelConfig, config: TrainConfig, mesh: jax.sharding.Mesh,
                    rules: LogicalRules = DEFAULT_RULES) -> TrainState:
    """NamedSharding tree of a TrainState: params by the logical rules, optimizer moments
    like their params, counters, scalars and rng replicated."""
    params_sh = logical_to_mesh_sharding(param_logical_axes(model_config), mesh, rules)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = abstract_train_state(model_config, config)
    opt_sh = optax.tree_map_params(make_optimizer(config.optimizer, config.vcpo), lambda _, s: s,
                                   abstract.opt_state, params_sh,
                                   transform_non_params=lambda _: replicated)
    return TrainState(params=params_sh, opt_state=opt_sh, step=replicated, version=replicated,
                      rng=replicated)


def batch_sharding(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Rows of every batch field (packed fields: groups) over ("data", "fsdp"); the rest of
    each array whole."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))


@functools.lru_cache(maxsize=64)
def _jitted(config: TrainConfig, model_config: ModelConfig, mesh: jax.sharding.Mesh | None,
            rules: LogicalRules, with_ref: bool, compiler_options: tuple | None):
    """One jax.jit object per (configs, mesh, ...): every JittedTrainStep with the same key
    shares its compilations (e.g. a run resumed in the same process compiles nothing)."""
    body = partial(train_step, config=config, model_config=model_config)
    opts = None if compiler_options is None else dict(compiler_options)
    if mesh is None:
        return jax.jit(body, donate_argnums=0, compiler_options=opts)
    st = state_shardings(model_config, config, mesh, rules)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ins = (st, batch_sharding(mesh)) + ((st.params,) if with_ref else ())
    return jax.jit(body, in_shardings=ins, out_shardings=(st, rep), donate_argnums=0,
                   compiler_options=opts)


def _check_packed_rows(batch: TrainBatch) -> None:
    """The step relies on rows[g, n] = g * N + n (contiguous groups, as batch_from_trajectory
    builds them): check it on host-side arrays (traced ones are left alone)."""
    rows = batch.packed.rows
    if isinstance(rows, jax.core.Tracer) or (isinstance(rows, jax.Array)
                                              and not rows.is_fully_addressable):
        return  # traced, or spread over several processes: nothing to read on host
    rows = np.asarray(rows)
    b = batch.tokens.shape[0]
    if rows.size != b or not np.array_equal(rows.reshape(-1), np.arange(b)):
        raise ValueError("TrainBatch.packed.rows must be arange(B).reshape(G, N) (groups as "
                         "contiguous row blocks); build the batch with "
                         "batch_from_trajectory(..., packed=True)")


class JittedTrainStep:
    """`train_step` compiled for one (TrainConfig, ModelConfig[, mesh]); call it as
    `state, metrics = step(state, batch[, ref_params])`. The state is donated: do not
    use the state you passed in after the call. With a mesh, inputs are placed with
    explicit shardings (B must be divisible by data * fsdp * micro_batches) and the
    model's activation annotations become sharding constraints."""

    def __init__(self, config: TrainConfig, model_config: ModelConfig,
                 mesh: jax.sharding.Mesh | None = None, rules: LogicalRules = DEFAULT_RULES,
                 compiler_options: Mapping[str, Any] | None = None):
        self.config, self.model_config, self.mesh, self.rules = config, model_config, mesh, rules
        self._opts = None if compiler_options is None else tuple(sorted(compiler_options.items()))

    def place_state(self, state: TrainState) -> TrainState:
        """Put `state` on the mesh with its shardings (without a mesh: commit it to the
        default device, so fresh and restored states hit the same compiled step)."""
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        return jax.device_put(state, state_shardings(self.model_config, self.config, self.mesh,
                                                     self.rules))

    def __call__(self, state: TrainState, batch: TrainBatch, ref_params: Params | None = None
                 ) -> tuple[TrainState, dict]:
        b = batch.tokens.shape[0]
        if b == 0:
            raise ValueError("the batch is empty (0 rows); nothing to train on")
        if self.config.packed and batch.packed is not None:
            _check_packed_rows(batch)
        if self.mesh is not None:
            rows = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            if b % (rows * self.config.micro_batches):
                raise ValueError(f"batch of {b} rows must be divisible by data*fsdp*micro_batches = "
                                 f"{rows * self.config.micro_batches} on this mesh")
            g = None if batch.packed is None else batch.packed.prompt_tokens.shape[0]
            if self.config.packed and g is not None and g % (rows * self.config.micro_batches):
                raise ValueError(f"the packed batch has {g} groups; with TrainConfig.packed they "
                                 "must be divisible by data*fsdp*micro_batches = "
                                 f"{rows * self.config.micro_batches} on this mesh")
        return self._apply(lambda fn, *args: fn(*args), state, batch, ref_params)

    def lower(self, state: TrainState, batch: TrainBatch, ref_params: Params | None = None):
        """The step lowered for these arguments (`.compile().as_text()` gives the HLO, e.g.
        to count collectives); nothing runs and the state is not donated."""
        return self._apply(lambda fn, *args: fn.lower(*args), state, batch, ref_params)

    def _apply(self, call, state, batch, ref_params):
        fn = _jitted(self.config, self.model_config, self.mesh, self.rules,
                     ref_params is not None, self._opts)
        args = (state, batch) + ((ref_params,) if ref_params is not None else ())
        if self.mesh is None:
            return call(fn, *args)
        with mesh_context(self.mesh, self.rules):
            return call(fn, *args)


def make_train_step(config: TrainConfig, model_config: ModelConfig,
                    mesh: jax.sharding.Mesh | None = None, rules: LogicalRules = DEFAULT_RULES,
                    compiler_options: Mapping[str, Any] | None = None) -> JittedTrainStep:
    """The jitted step (see JittedTrainStep). Without a mesh: plain jit on the default
    device; with one: explicit in/out shardings from the logical rules. compiler_options
    are passed to XLA (e.g. {"xla_backend_optimization_level": 0} compiles about twice
    as fast on CPU and runs slower: useful for short CPU runs and tests)."""
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(model_config, ModelConfig):
        raise ValueError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    if mesh is not None:  # heads / kv_heads / mlp / vocab vs the mesh: a clear error, before compiling
        from rl.sharding import validate_mesh
        validate_mesh(mesh, model_config, rules=rules)
    return JittedTrainStep(config, model_config, mesh, rules, compiler_options)
