"""The learner step: one pure, jittable `train_step` (jit it with `rl.learner.make_train_step`).

The step, in the order `train_step` runs it:

 1. check the inputs (reference params iff a KL term, the optional per-token fields'
    shapes, rows that split into `micro_batches`);
 2. advantages [B] and the token mask [B, T-1]: from the rewards by `TrainConfig.advantage`
    (`rl.learner.rewards.reward_advantages`), or, with VCPO enabled (`TrainConfig.vcpo`),
    VCPO's (R - b_g)/σ_g plus a truncated importance weight per sequence, from log π/μ of
    the WHOLE batch under the step's starting params (`rl.learner.vcpo.vcpo_terms`);
    with TrainBatch.token_advantages (turn-level credit) the per-token term is added:
    advantages [B, T-1];
 3. the loss's normaliser over the whole batch (tokens for "token-mean", non-empty
    sequences for the seq-mean modes);
 4. split every per-row field into M = micro_batches `MicroBatch`es (packed or tree:
    whole groups);
 5. `lax.scan` over them of value_and_grad(`micro_loss`), summing gradients from zeros
    (one micro-batch: value_and_grad once, no accumulator).
    `micro_loss` recomputes the token log-probs (`row_logprobs`: naive rows, the packed
    shared-prefix forward, or a prefix tree per group), picks the PPO "old" policy π_prox (`proximal_logprobs`: one of
    the four `TrainConfig.old_logp` sources), weights tokens (`offpolicy_token_weights`,
    then the batch's loss_weights / VCPO's sequence weights), runs
    `rl.objectives.losses.compute_loss` (PPO-clip / GSPO / CISPO, aggregation, optional
    KL to a frozen reference) and scales the loss by its micro-batch's share of the
    normaliser — so the summed gradient IS the full-batch gradient (up to float rounding);
 6. combine the per-micro-batch metrics (`combine_micro_metrics`);
 7. ONE optax update (global-norm clipping, AdamW or SGD on the schedule; with VCPO's
    lr_scale, the update scaled by the batch's ESS ρ);
 8. batch-level metrics (`batch_metrics`), and the state's step and version + 1.

With every variant off (VCPO off, old_logp="current", no off-policy correction, no
loss_weights, not packed) this is plain GRPO.
"""
from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from models.config import ModelConfig
from models.logprobs import token_logprobs, token_logprobs_fused
from models.lora import compose
from models.packed import PackedGroups, packed_token_logprobs, packed_token_logprobs_fused
from models.tree import TreeGroups, tree_row_logprobs
from rl.learner.batch import TrainBatch, TrainState
from rl.learner.config import OffPolicyConfig, TrainConfig, make_optimizer, make_schedule, scales_lr
from rl.learner.rewards import reward_advantages, scalar_rewards
from rl.learner.vcpo import VCPOTerms, monitor_metrics, vcpo_terms
from rl.objectives.losses import compute_loss, token_entropy
from rl.objectives.vcpo import sequence_log_weights
from rl.learner.old_logp import get_old_logp
from rl.objectives.offpolicy import ratio_decomposition_metrics
from rl.objectives.registry import get_correction

Params = Any
sg = jax.lax.stop_gradient


class MicroBatch(NamedTuple):
    """One micro-batch of b = B / M rows (with a leading [M] axis when stacked for the scan).
    Per-token fields are shifted like the log-probs ([b, T-1]: column t is token t+1)."""

    tokens: jax.Array  # [b, T] int32
    positions: jax.Array  # [b, T] int32
    mask: jax.Array  # [b, T-1] bool: the tokens the loss counts
    behaviour: jax.Array  # [b, T-1] log μ, the sampler's recorded log-probs
    advantages: jax.Array  # [b], or [b, T-1] with TrainBatch.token_advantages
    versions: jax.Array  # [b, T-1] int32: policy version that sampled each token
    proximal: jax.Array | None  # [b, T-1] TrainBatch.proximal_logprobs, or None
    loss_weights: jax.Array | None  # [b, T-1] per-token loss factor (batch's × VCPO's), or None
    packed: PackedGroups | None  # this micro-batch's whole groups, rows local to it; or None
    tree: TreeGroups | None = None  # this micro-batch's whole groups as prefix trees; or None


_LOSS_KEYS = ("loss", "pg_loss", "kl")  # aggregated like the loss (not per token)


# ----------------------------------------------------------------------------- the step
def train_step(state: TrainState, batch: TrainBatch, ref_params: Params | None = None, *,
               config: TrainConfig, model_config: ModelConfig) -> tuple[TrainState, dict]:
    """One optimizer update from one batch (pure; jit it with `make_train_step`).

    Args:
        state: TrainState; batch: TrainBatch with B rows (B divisible by
            config.micro_batches); ref_params: frozen reference params (same tree as
            state.params), required iff config.loss.kl_coef > 0. With config.packed and
            batch.packed set, log-probs (current and reference) come from the packed
            shared-prefix forward; its G groups must divide into config.micro_batches.
            With config.lora: state.params are the adapters and ref_params is the frozen
            base, required (the KL reference too when kl_coef > 0: adapters off).
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
    check_step_inputs(config, batch, ref_params)
    model_config = learner_model_config(config, model_config)
    # LoRA: the frozen base rides beside the adapters (no gradient: not differentiated)
    base = ref_params if config.lora is not None else None
    ref_params = ref_params if config.loss.kl_coef > 0 else None

    # Advantages. VCPO needs log π/μ of the whole batch (ρ counts every row), so its terms
    # come before the micro-batches. Monitoring only logs ρ (loss and update unchanged),
    # from the rows' log w that the micro-batches' own forward passes return (no extra pass).
    vcpo = None
    if config.vcpo.enabled:
        vcpo = vcpo_terms(config, model_config, state.params, batch)
    if config.vcpo.enabled:
        adv, mask = vcpo.advantages, batch.loss_mask[:, 1:]
    else:
        adv, mask = reward_advantages(config, batch)
    if batch.token_advantages is not None:  # turn-level credit: a per-token term on top
        adv = adv[:, None] + batch.token_advantages[:, 1:]

    # The normaliser of the WHOLE batch: each micro-batch's loss is scaled by its share of
    # it, which makes micro-batching exact.
    count, n_tok_all = loss_count(config, mask)
    norm = jnp.maximum(count, 1.0)

    # Gradient accumulation: scan the micro-batches (the activations of one in memory at a
    # time), summing their gradients from zeros.
    mbs = split_micro_batches(config, batch, mask, adv, vcpo)
    grad_fn = jax.value_and_grad(partial(micro_loss, config=config, model_config=model_config),
                                 has_aux=True)

    def micro(mb):
        (_, aux), g = grad_fn(state.params, mb, ref_params, norm, state.version, base)
        return g, aux

    grads, (stacked, shares, n_toks, row_log_w) = accumulate_gradients(micro, state.params, mbs)
    metrics = combine_micro_metrics(stacked, shares, n_toks)
    if config.vcpo.monitor and not config.vcpo.enabled:  # micro-batches split rows in order
        metrics.update(monitor_metrics(row_log_w.reshape(-1), jnp.any(mask, axis=1)))

    # ONE update from the accumulated gradient (the optimizer is rebuilt from the frozen
    # config: deterministic, so it need not live in the state).
    tx = make_optimizer(config.optimizer, config.vcpo)
    if scales_lr(config.vcpo):  # VCPO shrinks the final update when the ESS is low
        updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                       ess=vcpo.metrics["vcpo_ess"])
    else:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)

    metrics.update(batch_metrics(config, batch, state.step, grads, n_tok_all, adv))
    if vcpo is not None:
        metrics.update(vcpo.metrics)
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1,
                              version=state.version + 1)
    return new_state, metrics


def accumulate_gradients(micro, params: Params, mbs: MicroBatch) -> tuple[Params, Any]:
    """(summed gradients, per-micro-batch aux stacked [M, ...]) of micro(mb) -> (grads, aux)
    over the M stacked micro-batches: a lax.scan from zero gradients (one micro-batch's
    activations in memory at a time); for M = 1 one call, with no accumulator (zeros + g
    would cost two more passes over the parameters)."""
    if jax.tree.leaves(mbs)[0].shape[0] == 1:
        grads, aux = micro(jax.tree.map(lambda x: x[0], mbs))
        return grads, jax.tree.map(lambda x: x[None], aux)

    def body(acc, mb):
        g, aux = micro(mb)
        return jax.tree.map(jnp.add, acc, g), aux

    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), mbs)


def micro_loss(params: Params, mb: MicroBatch, ref_params: Params | None, norm: jax.Array,
               version: jax.Array, base: Params | None = None, *, config: TrainConfig,
               model_config: ModelConfig):
    """Loss of one micro-batch scaled to its share of the full batch's normaliser `norm`,
    and (metrics, share, tokens). version: the state's policy version (old_logp="versions").
    base (with config.lora): the frozen base under the adapters `params`."""
    if base is not None:
        params = compose(base, params, config.lora)
    logp, entropy = row_logprobs(config, model_config, params, mb)
    old = proximal_logprobs(config, logp, mb, version)
    ref = None
    if ref_params is not None:  # the frozen reference of the KL term: no gradient
        ref = sg(row_logprobs(config, model_config, ref_params, mb, entropy=False)[0])
    # the entropy's gradient is only needed when it is a bonus in the loss
    entropy = jnp.where(mb.mask, entropy if config.loss.entropy_coef else sg(entropy), 0.0)
    weights, extra = offpolicy_token_weights(config.offpolicy, old, mb.behaviour, mb.mask)
    if mb.loss_weights is not None:  # a factor on top of any off-policy weights
        weights = mb.loss_weights if weights is None else weights * mb.loss_weights
    loss, metrics = compute_loss(config.loss, logp, old, mb.advantages, mb.mask, ref_logp=ref,
                                 entropy=entropy, token_weights=weights)
    # π/μ = (π/π_prox)(π_prox/μ): report both factors, with the batch's π_prox when given
    decomp_prox = old if mb.proximal is None else sg(mb.proximal)
    metrics = {**metrics, **extra,
               **ratio_decomposition_metrics(logp, decomp_prox, mb.behaviour, mb.mask)}
    count, n_tok = loss_count(config, mb.mask)
    share = count / norm
    # VCPOConfig.monitor: each row's log w = Σ_t (log π_θ - log μ) at the step's params
    row_log_w = sequence_log_weights(sg(logp), mb.behaviour, mb.mask) \
        if config.vcpo.monitor and not config.vcpo.enabled else jnp.zeros((0,))
    return loss * share, (metrics, share, n_tok, row_log_w)


# ----------------------------------------------------------------------------- the variants
def row_logprobs(config: TrainConfig, model_config: ModelConfig, params: Params,
                 mb: MicroBatch, entropy: bool = True) -> tuple[jax.Array, jax.Array]:
    """(logp [b, T-1], entropy [b, T-1]) of the micro-batch's rows under `params`, in the
    naive row layout either way: the packed shared-prefix forward when the micro-batch
    carries groups (each prompt runs once per group), the tree forward when it carries
    trees (each shared prefix once per group), else one forward over the rows.
    Entries off the loss mask are meaningless (the caller masks them).

    TrainConfig.logprob_chunk > 0 runs the vocabulary head chunk by chunk
    (models.logprobs.chunked_logprobs: no [b, T-1, V] logits in the forward; kept for the
    backward unless TrainConfig.head_remat); 0 is the slow
    twin that materialises every logit. entropy=False: zeros instead (the reference)."""
    chunk, temp, impl = config.logprob_chunk, config.temperature, config.attn_impl
    if mb.tree is not None:  # each group's rows as one prefix tree (models.tree)
        head_tokens = mb.tree.tokens.size
        logp, ent = tree_row_logprobs(
            params, model_config, mb.tree, temperature=temp, attn_impl=impl, chunk=chunk,
            entropy=entropy,
            keep_logits=config.keeps_head_logits(min(chunk or head_tokens, head_tokens),
                                                 model_config.vocab_size))
        return logp, ent
    if mb.packed is None:
        if chunk:
            b, t = mb.tokens.shape
            return token_logprobs_fused(
                params, model_config, mb.tokens, mb.positions, temp, impl, chunk=chunk,
                entropy=entropy,
                keep_logits=config.keeps_head_logits(b * (t - 1), model_config.vocab_size))
        logp, z = token_logprobs(params, model_config, mb.tokens, mb.positions, temp, impl)
    else:
        width = mb.tokens.shape[1]
        if chunk:
            return packed_token_logprobs_fused(params, model_config, mb.packed, width=width,
                                               temperature=temp, attn_impl=impl, chunk=chunk,
                                               entropy=entropy,
                                               keep_logits=config.keeps_head_logits(
                                                   mb.packed.response_tokens.size,
                                                   model_config.vocab_size))
        logp, z = packed_token_logprobs(params, model_config, mb.packed, width=width,
                                        temperature=temp, attn_impl=impl)
    return logp, (token_entropy(z) if entropy else jnp.zeros_like(logp))


def proximal_logprobs(config: TrainConfig, logp: jax.Array, mb: MicroBatch,
                      version: jax.Array) -> jax.Array:
    """log π_prox [b, T-1], the PPO "old" policy, from the source TrainConfig.old_logp names
    (rl.learner.old_logp: current, behaviour, proximal, versions, or one registered)."""
    return get_old_logp(config.old_logp)(logp, mb, version)


def offpolicy_token_weights(config: OffPolicyConfig, prox: jax.Array, behaviour: jax.Array,
                            mask: jax.Array) -> tuple[jax.Array | None, dict]:
    """(per-token weights [b, T-1] or None, their metrics) of the off-policy correction
    π_prox/μ that config.correction names (rl.objectives.registry.get_correction: the
    built-ins of rl.objectives.offpolicy, or one registered); (None, {}) with "none"."""
    if config.correction == "none":
        return None, {}
    bounds = {} if config.low is None else {"low": config.low}  # the two-sided ones'
    ow = get_correction(config.correction)(prox, behaviour, mask, level=config.level,
                                           cap=config.cap, mode=config.mode, **bounds)
    return ow.weights, ow.metrics


# ----------------------------------------------------------------------------- plumbing
def learner_model_config(config: TrainConfig, model_config: ModelConfig) -> ModelConfig:
    """The model config the step differentiates: with TrainConfig.remat set, the layers'
    rematerialisation policy replaced by it (the sampler's config is never touched)."""
    if config.remat is None or config.remat == model_config.remat:
        return model_config
    return model_config.replace(remat=config.remat)


def check_step_inputs(config: TrainConfig, batch: TrainBatch, ref_params: Params | None) -> None:
    """ValueError with a fix for inputs the step cannot use."""
    if config.lora is not None:
        if ref_params is None:
            raise ValueError("TrainConfig.lora trains adapters on a frozen base: pass the base "
                             "params as the step's third argument (ref_params)")
    elif (config.loss.kl_coef > 0) != (ref_params is not None):
        raise ValueError("ref_params must be given exactly when config.loss.kl_coef > 0 "
                         f"(kl_coef={config.loss.kl_coef}, ref_params "
                         f"{'given' if ref_params is not None else 'missing'})")
    if get_old_logp(config.old_logp).needs_proximal and batch.proximal_logprobs is None:
        raise ValueError(f"TrainConfig.old_logp={config.old_logp!r} needs "
                         "TrainBatch.proximal_logprobs ([B, T], e.g. from rl.learner.proximal); "
                         "attach them with batch.replace(proximal_logprobs=...) or choose "
                         "another old_logp")
    for name in ("proximal_logprobs", "loss_weights", "token_advantages"):
        field = getattr(batch, name)
        if field is not None and tuple(field.shape) != tuple(batch.tokens.shape):
            raise ValueError(f"TrainBatch.{name} has shape {tuple(field.shape)}, expected the "
                             f"tokens' shape {tuple(batch.tokens.shape)} (aligned like loss_mask)")
    b = batch.tokens.shape[0]
    m = config.micro_batches
    if b % m:
        raise ValueError(f"batch of {b} rows does not split into micro_batches={m}; "
                         "make the batch a multiple of micro_batches")


def loss_count(config: TrainConfig, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(what the aggregation divides by, tokens) of `mask`: tokens for "token-mean",
    non-empty sequences for the seq-mean modes (float32)."""
    n_tok = jnp.sum(mask).astype(jnp.float32)
    n_seq = jnp.sum(jnp.any(mask, axis=1)).astype(jnp.float32)
    return (n_tok if config.loss.aggregation == "token-mean" else n_seq), n_tok


def split_micro_batches(config: TrainConfig, batch: TrainBatch, mask: jax.Array, adv: jax.Array,
                        vcpo: VCPOTerms | None) -> MicroBatch:
    """The batch as M = micro_batches stacked MicroBatches ([B, ...] -> [M, B/M, ...];
    packed groups [G, ...] -> [M, G/M, ...]). With VCPO enabled, its truncated sequence
    weight multiplies every token of the row (before the batch's own loss_weights)."""
    b = batch.tokens.shape[0]
    m = config.micro_batches

    def split(x):
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
    rows = tuple(split(x) for x in (batch.tokens, batch.positions, mask,
                                    batch.behaviour_logprobs[:, 1:], adv, batch.versions[:, 1:]))
    loss_weights = batch.loss_weights
    if config.vcpo.enabled:
        w = jnp.broadcast_to(vcpo.seq_weights[:, None], batch.tokens.shape)
        loss_weights = w if loss_weights is None else w * loss_weights
    optional = tuple(None if f is None else split(f[:, 1:])
                     for f in (batch.proximal_logprobs, loss_weights))
    tree = batch.tree if config.tree else None
    if tree is not None and tree.tokens.shape[0] % m:
        raise ValueError(f"the tree batch has {tree.tokens.shape[0]} groups, which do not "
                         f"split into micro_batches={m} whole groups; make the number of "
                         "groups a multiple of micro_batches or set TrainConfig.tree=False")
    return MicroBatch(*rows, *optional, None if packed is None else jax.tree.map(split, packed),
                      None if tree is None else jax.tree.map(split, tree))


def combine_micro_metrics(stacked: dict, shares: jax.Array, n_toks: jax.Array) -> dict:
    """The M micro-batches' metrics as one batch's: maxima stay maxima, the loss terms add
    up by their shares (like the loss), everything else is a token-weighted mean."""
    tok_w = n_toks / jnp.maximum(jnp.sum(n_toks), 1.0)
    metrics = {}
    for k, v in stacked.items():
        if k.endswith("_max"):
            metrics[k] = jnp.max(v)
        elif k in _LOSS_KEYS:
            metrics[k] = jnp.sum(v * shares)
        else:
            metrics[k] = jnp.sum(v * tok_w)
    return metrics


def batch_metrics(config: TrainConfig, batch: TrainBatch, step: jax.Array, grads: Params,
                  n_tok_all: jax.Array, adv: jax.Array) -> dict:
    """grad_norm (before clipping), lr, tokens, response_len, rewards and advantages
    (adv [B], or [B, T-1] with TrainBatch.token_advantages)."""
    rewards = scalar_rewards(config, batch) if config.advantage.name != "gdpo" \
        else jnp.sum(batch.rewards, axis=1)
    metrics = dict(
        grad_norm=optax.tree.norm(grads),
        lr=make_schedule(config.optimizer)(step),
        tokens=n_tok_all,
        response_len=jnp.sum(batch.loss_mask).astype(jnp.float32) / batch.tokens.shape[0],
        reward_mean=jnp.mean(rewards),
    )
    if adv.ndim == 1:
        metrics.update(adv_mean=jnp.mean(adv), adv_abs_mean=jnp.mean(jnp.abs(adv)))
    else:  # per-token advantages [B, T-1]: means over the loss mask's tokens
        m = batch.loss_mask[:, 1:]
        n = jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
        metrics.update(adv_mean=jnp.sum(jnp.where(m, adv, 0.0)) / n,
                       adv_abs_mean=jnp.sum(jnp.where(m, jnp.abs(adv), 0.0)) / n)
    for k, name in enumerate(batch.reward_names):
        metrics[f"reward_{name}"] = jnp.mean(batch.rewards[:, k])
    return metrics
