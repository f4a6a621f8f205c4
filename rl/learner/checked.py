"""Checked mode: the train step with runtime checks (jax.experimental.checkify), so a
non-finite reward, loss or gradient stops a run with the step and the group named instead
of training on NaN.

Under `jit` the rewards, log-probs and loss are tracers: a Python-side finiteness check
cannot see them, and one NaN reward silently makes its group's advantages, the loss and
then every parameter NaN. `checked_train_step` adds `checkify.check`s around
`rl.learner.step.train_step` (the same update; only the checks are added):

  * every reward of every row is finite; else "step s: group g (rows a..b) has a
    non-finite reward (first: row r, column k)" — the task's reward function is at fault;
  * the behaviour log-probs of the response tokens are finite (a damaged sampler / cache);
  * the loss and the gradient norm of the update are finite.

`make_train_step(..., checked=True)` (what the loops use; `LoopConfig.checked`, on by
default) jits `checkify.checkify(checked_train_step)`; the error is raised on the host
after the step as `NonFiniteError`. The checks cost a few reductions over the batch.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from models.config import ModelConfig
from rl.learner.batch import NonFiniteError, TrainBatch, TrainState
from rl.learner.config import TrainConfig
from rl.learner.step import train_step

__all__ = ["checked_train_step", "checkified", "throw"]  # NonFiniteError: rl.learner.batch


def _first_true(x: jax.Array) -> jax.Array:
    """Index of the first True in a 1-d bool array (0 if none)."""
    return jnp.argmax(x)


def checked_train_step(state: TrainState, batch: TrainBatch, ref_params: Any = None, *,
                       config: TrainConfig, model_config: ModelConfig
                       ) -> tuple[TrainState, dict]:
    """`train_step` with checkify checks (see the module doc); call it through
    `checkify.checkify(...)` (make_train_step(checked=True) does). Shapes as train_step:
    batch.rewards [B, K], behaviour_logprobs / loss_mask [B, T]."""
    update = state.step + 1  # the step number metrics.jsonl gives this update
    n = batch.group_size
    rewards = jnp.asarray(batch.rewards)
    bad_rows = ~jnp.all(jnp.isfinite(rewards), axis=1)
    row = _first_true(bad_rows)
    col = _first_true(~jnp.isfinite(rewards[row]))
    group = row // n
    checkify.check(
        ~jnp.any(bad_rows),
        "step {update}: group {group} (rows {start}..{stop}) has a non-finite reward (first: "
        "row {row}, reward column {col}); the task's reward function returned NaN or inf for "
        "this group's responses",
        update=update, group=group, start=group * n, stop=group * n + n - 1, row=row, col=col)
    mask = jnp.asarray(batch.loss_mask)
    bad_logp = mask & ~jnp.isfinite(jnp.asarray(batch.behaviour_logprobs))
    bad_logp_rows = jnp.any(bad_logp, axis=1)
    lrow = _first_true(bad_logp_rows)
    checkify.check(
        ~jnp.any(bad_logp_rows),
        "step {update}: group {group} (row {row}) has non-finite behaviour log-probs on its "
        "response tokens; the sampler's log-probs are damaged (check the params it sampled with)",
        update=update, group=lrow // n, row=lrow)
    new_state, metrics = train_step(state, batch, ref_params, config=config,
                                    model_config=model_config)
    checkify.check(jnp.isfinite(metrics["loss"]),
                   "step {update}: the loss is non-finite ({loss}) although every reward and "
                   "behaviour log-prob is finite: the model's log-probs overflowed (lower the "
                   "learning rate, check the params for NaN)", update=update,
                   loss=metrics["loss"])
    checkify.check(jnp.isfinite(metrics["grad_norm"]),
                   "step {update}: the gradient norm is non-finite ({norm}); the update would "
                   "put NaN into the params", update=update, norm=metrics["grad_norm"])
    return new_state, metrics


def checkified(fn):
    """`fn` (a checked step) under checkify with the user checks only: returns
    (error, (state, metrics))."""
    return checkify.checkify(fn, errors=checkify.user_checks)


def throw(err: checkify.Error) -> None:
    """Raise NonFiniteError with the failed check's message, if any."""
    msg = err.get()
    if msg is not None:
        msg = msg.split("\n")[0].replace("(`check` failed)", "").strip()
        raise NonFiniteError(f"{msg} (checked mode: rl.learner.checked)")
