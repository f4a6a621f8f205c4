"""The learner: `TrainState`, `TrainBatch` and one pure, jittable `train_step`.

One step: recompute token log-probs with `models.decoder.forward` (log-softmax of
logits / the sampler's temperature; the logit at position t predicts token t+1) ->
advantages from rewards (`rl.objectives.advantages.compute_advantages`) -> policy loss
(`rl.objectives.losses.compute_loss`: PPO-clip / GSPO / CISPO, aggregation, optional KL to a frozen
reference) with optional off-policy weights (`rl.objectives.offpolicy`) -> gradients accumulated
over micro-batches with `lax.scan` -> ONE optax update (global-norm clipping, then AdamW
or SGD on a warmup + constant / cosine schedule).

Micro-batching is exact: each micro-batch's loss is scaled by its share of the full
batch's normaliser (tokens for "token-mean", non-empty sequences for the seq-mean
modes), so the summed gradient equals the full-batch gradient up to float rounding.

Shared-prefix packing (DualKV, `TrainConfig.packed`): when every group of a batch shares
its prompt, `batch_from_trajectory(..., packed=True)` attaches `models.packed.PackedGroups`
and the step computes the same log-probs with `models.packed.packed_token_logprobs` (each
prompt runs once per group instead of once per response); the loss code is the same.

VCPO (`TrainConfig.vcpo`, rl.objectives.vcpo): sequence importance weights against the behaviour
policy, the minimum-variance off-policy baseline and an ESS-scaled final update; off by
default (the step is then exactly the one above).

`make_train_step` jits `train_step` with explicit in/out shardings derived from the
models' logical axis rules (params by `models.sharding`, batch rows (packed: groups) over
("data", "fsdp")), donating the state.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from models.config import ModelConfig
from models.logprobs import token_logprobs
from models.packed import packed_token_logprobs
from rl.learner.batch import TrainBatch, TrainState
from rl.learner.config import OffPolicyConfig, TrainConfig, make_optimizer, make_schedule, scales_lr
from rl.learner.vcpo import per_trajectory_logprob_grads
from rl.objectives.advantages import compute_advantages
from rl.objectives.losses import compute_loss, token_entropy
from rl.objectives.offpolicy import (
    approx_proximal_logp,
    behaviour_weights,
    ratio_decomposition_metrics,
    truncated_is_weights,
)
from rl.objectives.vcpo import (
    ess_lr_scale,
    ess_ratio,
    sequence_log_weights,
    truncated_sequence_weights,
    vcpo_advantages,
    weight_tail_stats,
)

Params = Any
sg = jax.lax.stop_gradient
# ----------------------------------------------------------------------------- the step
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
                         "([B, T], e.g. from rl.learner.proximal); attach them with "
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
    if scales_lr(config.vcpo):
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


