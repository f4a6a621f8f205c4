"""Where the PPO "old" policy π_prox of a step comes from (TrainConfig.old_logp), as named,
registered sources the way losses and corrections are (rl.objectives.registry.Registry).

    current    log π_θ at the step's own starting params, detached: the exact π_old when
               each batch gets one update (ratio 1 in value, the gradient through π_θ;
               AReaL's recomputed proximal policy)
    behaviour  log μ, the sampler's recorded log-probs (rollout replay's clipped π_θ/μ)
    proximal   TrainBatch.proximal_logprobs, computed outside the step (the snapshot ring's
               exact per-version log-probs, or EWMA params': rl.learner.proximal)
    versions   AReaL's log-linear interpolation between μ and π_θ by each token's version
               and the state's (rl.objectives.offpolicy.approx_proximal_logp; no forward)

A source is ``fn(logp, mb, version) -> log π_prox [b, T-1]`` of the micro-batch's detached
log π_θ ``logp`` [b, T-1], its `rl.learner.step.MicroBatch` (behaviour log-probs, versions,
mask, proximal log-probs) and the state's policy version; register your own with

    @register_old_logp("mine", needs_proximal=False)
    def mine(logp, mb, version): ...

needs_proximal=True: the source reads TrainBatch.proximal_logprobs (the step refuses a
batch without them).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from rl.objectives.offpolicy import approx_proximal_logp
from rl.objectives.registry import Registry

OLD_LOGP = Registry("old log-prob source", "rl.learner.old_logp")
sg = jax.lax.stop_gradient


def register_old_logp(name: str, *, needs_proximal: bool = False,
                      overwrite: bool = False) -> Callable[[Callable], Callable]:
    """Register an old log-prob source (module doc) as TrainConfig.old_logp = ``name``."""
    def decorator(fn: Callable) -> Callable:
        fn.needs_proximal = bool(needs_proximal)
        return OLD_LOGP.register(name, overwrite=overwrite)(fn)

    return decorator


def get_old_logp(name: str) -> Callable[..., Any]:
    """The old log-prob source registered as ``name`` (ValueError if unknown)."""
    return OLD_LOGP.get(name)


def available_old_logp() -> tuple[str, ...]:
    return OLD_LOGP.names()


@register_old_logp("current")
def current_old_logp(logp: jax.Array, mb: Any, version: jax.Array) -> jax.Array:
    """The step's own params: ratio 1, gradient through π_θ."""
    return sg(logp)


@register_old_logp("behaviour")
def behaviour_old_logp(logp: jax.Array, mb: Any, version: jax.Array) -> jax.Array:
    """The sampler's recorded μ."""
    return mb.behaviour


@register_old_logp("proximal", needs_proximal=True)
def proximal_old_logp(logp: jax.Array, mb: Any, version: jax.Array) -> jax.Array:
    """Computed outside the step (snapshot ring, EWMA)."""
    return sg(mb.proximal)


@register_old_logp("versions")
def versions_old_logp(logp: jax.Array, mb: Any, version: jax.Array) -> jax.Array:
    """AReaL's interpolation between μ and π_θ by token versions (no forward)."""
    return approx_proximal_logp(logp, mb.behaviour, mb.versions, version, mb.mask)
