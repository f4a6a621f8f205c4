"""Outcome-reward advantage estimators for group-sampled RL (GRPO family).

Every estimator is a pure function of ``rewards [batch]`` and a group layout, and
returns advantages ``[batch]`` (one per response; broadcast over the response's
tokens with `token_advantages`). Groups are given either as
``group_size: int`` (contiguous groups of equal size; the main API) or as
``group_ids [batch]`` (any integer labels; costs O(batch^2) memory).

Conventions shared by all estimators:

  * group statistics are computed on values shifted by the group max, so a group
    whose rewards are all equal gets advantage exactly 0 (no rounding residue);
  * a group of size 1 gets advantage 0 (its mean is itself; Bessel's ``n - 1`` is
    guarded so no 0/0 appears). veRL instead gives such a sample ``A = R``;
  * NaN/inf rewards raise ValueError naming ``rewards`` when the input is concrete;
    under jit/vmap values cannot be inspected, so call
    ``rl.objectives.registry.check_finite("rewards", r)`` before jit if the source is untrusted.

All functions jit (``group_size`` must be static: ``functools.partial`` or
``static_argnames``) and vmap over extra leading axes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rl.objectives.registry import (
    check_finite,
    check_float,
    check_number,
    check_params,
    check_rank,
    check_same_shape,
    freeze_params,
    get_advantage,
    register_advantage,
)

Array = jax.Array


class AdvantageResult(NamedTuple):
    """Advantages and which samples the loss may use.

    advantages: [batch] float32.
    sample_mask: [batch] float32, 1 = train on this response, 0 = drop it (multiply
        the token mask by ``sample_mask[:, None]``). MC-GRPO zeroes its pivots here.
    """

    advantages: Array
    sample_mask: Array


# ---------------------------------------------------------------------------
# Group layout and group statistics


class Groups:
    """Group membership for a batch: contiguous groups of ``size`` or labels ``ids``.

    Every statistic is returned per sample ([batch]), i.e. already broadcast
    back to the members of each group.
    """

    def __init__(self, batch: int, size: int | None = None, ids: Array | None = None,
                 dtype: Any = jnp.float32):
        self.batch = batch
        self.size = size
        # Counts and the factors built from them (RLOO's n/(n-1), MC-GRPO's n/#nonzero)
        # take the rewards' dtype, so float64 rewards get float64 factors.
        self.dtype = dtype
        # [batch, batch] membership: same[i, j] = samples i and j share a group.
        self.same = None if ids is None else ids[:, None] == ids[None, :]

    def _by_group(self, x: Array) -> Array:
        return x.reshape(self.batch // self.size, self.size)

    def _spread(self, per_group: Array) -> Array:
        return jnp.repeat(per_group, self.size, total_repeat_length=self.batch)

    def count(self) -> Array:
        if self.same is None:
            return jnp.full((self.batch,), float(self.size), self.dtype)
        return jnp.sum(self.same, axis=1).astype(self.dtype)

    def sum(self, x: Array) -> Array:
        if self.same is None:
            return self._spread(jnp.sum(self._by_group(x), axis=1))
        return jnp.sum(jnp.where(self.same, x[None, :], 0), axis=1)

    def max(self, x: Array) -> Array:
        if self.same is None:
            return self._spread(jnp.max(self._by_group(x), axis=1))
        return jnp.max(jnp.where(self.same, x[None, :], -jnp.inf), axis=1)

    def min(self, x: Array) -> Array:
        return -self.max(-x)

    def centered(self, x: Array) -> Array:
        """x - group mean, computed on max-shifted values (all-equal group -> exactly 0)."""
        d = x - self.max(x)
        return d - self.sum(d) / self.count()

    def std(self, x: Array, unbiased: bool) -> Array:
        """Group std; Bessel-corrected if ``unbiased`` (size-1 groups give 0, not NaN)."""
        c = self.centered(x)
        dof = self.count() - (1.0 if unbiased else 0.0)
        return jnp.sqrt(self.sum(c * c) / jnp.maximum(dof, 1.0))

    def rank(self, x: Array) -> Array:
        """Stable rank of each sample inside its group (ties broken by batch index)."""
        if self.same is None:
            g = self._by_group(x)
            idx = jnp.arange(self.size)
            # before[k, i, j]: sample j sorts before sample i in group k.
            before = (g[:, None, :] < g[:, :, None]) | (
                (g[:, None, :] == g[:, :, None]) & (idx[None, :] < idx[:, None])[None]
            )
            return jnp.sum(before, axis=2).reshape(self.batch)
        idx = jnp.arange(self.batch)
        before = (x[None, :] < x[:, None]) | ((x[None, :] == x[:, None]) & (idx[None, :] < idx[:, None]))
        return jnp.sum(before & self.same, axis=1)

    def lower_median(self, x: Array) -> Array:
        """The group's order statistic at rank (n-1)//2: the median for odd n,
        the lower of the two middle values for even n (always a real sample)."""
        if self.same is None:
            return self._spread(jnp.sort(self._by_group(x), axis=1)[:, (self.size - 1) // 2])
        ordered = jnp.sort(jnp.where(self.same, x[None, :], jnp.inf), axis=1)
        k = (jnp.sum(self.same, axis=1) - 1) // 2
        return jnp.take_along_axis(ordered, k[:, None], axis=1)[:, 0]


def _batch_centered(x: Array) -> Array:
    d = x - jnp.max(x)
    return d - jnp.mean(d)


def _batch_std(x: Array, unbiased: bool) -> Array:
    c = _batch_centered(x)
    dof = max(x.shape[0] - (1 if unbiased else 0), 1)
    return jnp.sqrt(jnp.sum(c * c) / dof)


# ---------------------------------------------------------------------------
# Boundary validation


def _as_rewards(rewards: Any, name: str = "rewards") -> Array:
    r = jnp.asarray(rewards)
    check_rank(name, r, 1, "a [batch] vector (one reward per response)")
    if jnp.issubdtype(r.dtype, jnp.complexfloating):
        raise ValueError(f"{name} must be real, got dtype {r.dtype}")
    check_finite(name, r)
    # Binary / integer rewards are fine; statistics run in at least float32.
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32) if jnp.issubdtype(r.dtype, jnp.floating)
                 else jnp.float32)
    check_float(name, r)
    return r


def _groups(batch: int, group_size: Any, group_ids: Any, dtype: Any = jnp.float32) -> Groups:
    if group_ids is None and group_size is None:
        raise ValueError("pass group_size (contiguous groups) or group_ids [batch]")
    if group_ids is not None and group_size is not None:
        raise ValueError(
            f"pass only one of group_size ({group_size}) and group_ids, not both"
        )
    if group_ids is not None:
        ids = jnp.asarray(group_ids)
        check_rank("group_ids", ids, 1, "a [batch] vector of integer group labels")
        if ids.shape[0] != batch:
            raise ValueError(
                f"group_ids has shape {ids.shape} but rewards has batch {batch}; one id per response"
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"group_ids must be integers, got dtype {ids.dtype}")
        return Groups(batch, ids=ids, dtype=dtype)
    if isinstance(group_size, jax.core.Tracer) or isinstance(group_size, bool) or not isinstance(
        group_size, int
    ):
        raise ValueError(
            f"group_size must be a static Python int (mark it static under jit), got {group_size!r}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if batch % group_size != 0:
        raise ValueError(
            f"group_size {group_size} does not divide the batch of {batch} rewards; "
            f"the batch must hold whole groups"
        )
    return Groups(batch, size=group_size, dtype=dtype)


def grouped_rewards(rewards: Any, group_size: int | None,
                    group_ids: Any = None) -> tuple[Array, Groups]:
    """Validated rewards [batch] (finite, real, at least float32) and their group layout
    (exactly one of group_size / group_ids [batch]); ValueError naming what is wrong."""
    r = _as_rewards(rewards)
    return r, _groups(r.shape[0], group_size, group_ids, r.dtype)


_SCALES = ("group", "batch", "none")


def _check_eps(eps: float, name: str = "eps") -> None:
    check_number(name, eps, low=0.0)


# ---------------------------------------------------------------------------
# Estimators


@register_advantage("grpo")
def grpo_advantages(
    rewards: Array,
    group_size: int | None = None,
    *,
    group_ids: Array | None = None,
    eps: float = 1e-6,
    unbiased_std: bool = True,
    scale_rewards: str = "group",
) -> Array:
    """GRPO: A_i = (R_i - mean_g) / (std + eps)  (Shao et al. 2024, DeepSeekMath).

    Args:
        rewards: [batch] scalar reward per response (bool/int are cast to float32).
        group_size: responses per prompt; groups are contiguous blocks of the batch.
        group_ids: [batch] int labels instead of ``group_size``.
        eps: added to the std. Default 1e-6 (veRL); TRL uses 1e-4.
        unbiased_std: Bessel-corrected std (veRL and TRL both do: torch.std's default).
        scale_rewards: "group" divides by the group's std (GRPO), "batch" by the std
            of all rewards in the batch (TRL's option),
            "none" does not divide (= Dr. GRPO).

    Returns:
        [batch] advantages; 0 for groups of size 1 and all-equal groups.
    """
    r, groups = grouped_rewards(rewards, group_size, group_ids)
    _check_eps(eps)
    if scale_rewards not in _SCALES:
        raise ValueError(f"scale_rewards must be one of {_SCALES}, got {scale_rewards!r}")
    centered = groups.centered(r)
    if scale_rewards == "none":
        return centered
    std = groups.std(r, unbiased_std) if scale_rewards == "group" else _batch_std(r, unbiased_std)
    return centered / (std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantages(
    rewards: Array, group_size: int | None = None, *, group_ids: Array | None = None
) -> Array:
    """Dr. GRPO: A_i = R_i - mean_g, no std division (Liu et al. 2025,
    "Understanding R1-Zero-Like Training"). Shapes as `grpo_advantages`."""
    r, groups = grouped_rewards(rewards, group_size, group_ids)
    return groups.centered(r)


@register_advantage("rloo")
def rloo_advantages(
    rewards: Array, group_size: int | None = None, *, group_ids: Array | None = None
) -> Array:
    """RLOO: A_i = R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean_g)
    (Ahmadian et al. 2024, "Back to Basics"). A group of size 1 has no other
    sample to compare with and gets 0. Shapes as `grpo_advantages`."""
    r, groups = grouped_rewards(rewards, group_size, group_ids)
    n = groups.count()
    return groups.centered(r) * jnp.where(n > 1, n / jnp.maximum(n - 1, 1), 0.0)


@register_advantage("mc_grpo")
def mc_grpo_advantages(
    rewards: Array,
    group_size: int | None = None,
    *,
    group_ids: Array | None = None,
    scale: str = "std",
    eps: float = 1e-6,
    unbiased_std: bool = True,
    mad_eps: float = 1e-3,
    rescale_nonzero: bool = True,
) -> AdvantageResult:
    """MC-GRPO: median-centred group advantages with one pivot dropped per group.

    Sample G+1 (odd) responses per prompt. med = group median; A = (R - med) / scale;
    non-zero advantages are multiplied by n / #nonzero (n = group size); the one
    median sample per group (the pivot) gets ``sample_mask`` 0.

    ``scale="mad"`` is the source's rule: MAD = median(|R - med|) + ``mad_eps``.
    The default ``scale="std"`` divides by (group std + ``eps``) instead, because
    with binary rewards more than half of an odd group always equals the median,
    so MAD = 0 and |A| = 1/mad_eps = 1000 for every non-median sample.

    For an even group the "median" is the lower middle value, so the pivot is still
    one real sample (the paper only uses odd groups).

    Args:
        rewards: [batch]; group_size / group_ids as in `grpo_advantages`.
        scale: "std" (default) or "mad".
        eps, unbiased_std: std denominator (used when scale="std").
        mad_eps: added to the MAD (used when scale="mad").
        rescale_nonzero: apply the n / #nonzero factor.

    Returns:
        AdvantageResult(advantages [batch], sample_mask [batch], 0 at pivots).
    """
    r, groups = grouped_rewards(rewards, group_size, group_ids)
    if scale not in ("std", "mad"):
        raise ValueError(f"scale must be 'std' or 'mad', got {scale!r}")
    _check_eps(eps)
    _check_eps(mad_eps, "mad_eps")
    med = groups.lower_median(r)
    n = groups.count()
    pivot = groups.rank(r) == (n.astype(jnp.int32) - 1) // 2
    diff = r - med  # exact 0 for samples tied with the median
    if scale == "mad":
        denom = groups.lower_median(jnp.abs(diff)) + mad_eps
    else:
        denom = groups.std(r, unbiased_std) + eps
    adv = diff / denom
    if rescale_nonzero:
        nonzero = groups.sum((diff != 0).astype(r.dtype))
        adv = adv * jnp.where(nonzero > 0, n / jnp.maximum(nonzero, 1.0), 1.0)
    return AdvantageResult(adv, 1.0 - pivot.astype(jnp.float32))


@register_advantage("gdpo")
def gdpo_advantages(
    rewards: Mapping[str, Array] | Array,
    group_size: int | None = None,
    *,
    group_ids: Array | None = None,
    weights: Mapping[str, float] | Sequence[float] | None = None,
    eps: float = 1e-4,
    unbiased_std: bool = True,
) -> Array:
    """GDPO: multi-reward advantages with per-reward group normalisation, then batch
    whitening (GDPO, "Group reward-Decoupled normalization Policy Optimization").

    Per reward k: Â_k = (r_k - mean_g) / (std_g + eps); pre = sum_k w_k Â_k;
    A = (pre - mean_batch) / (std_batch + eps). With one reward this is GRPO
    (eps 1e-4) followed by batch whitening.

    Args:
        rewards: {name: [batch]} named rewards, or a [batch, K] array.
        group_size / group_ids: as in `grpo_advantages`.
        weights: {name: w} with exactly the rewards' names (for a mapping) or K floats
            (for an array); default all 1.
        eps: 1e-4 in both normalisations (source default).
        unbiased_std: Bessel-corrected std in both normalisations.

    Returns:
        [batch] advantages.
    """
    _check_eps(eps)
    if isinstance(rewards, Mapping):
        if not rewards:
            raise ValueError("rewards is an empty mapping; give at least one named reward")
        names = list(rewards)
        cols = [_as_rewards(rewards[k], f"rewards[{k!r}]") for k in names]
        check_same_shape(**{f"rewards[{k!r}]": c for k, c in zip(names, cols)})
        if weights is None:
            w = [1.0] * len(names)
        else:
            wmap = dict(weights)
            if set(wmap) != set(names):
                raise ValueError(
                    f"weights names {sorted(wmap)} must equal the rewards' names {sorted(names)}"
                )
            w = [float(wmap[k]) for k in names]
    else:
        arr = jnp.asarray(rewards)
        check_rank("rewards", arr, 2, "a [batch, K] array or a {name: [batch]} mapping")
        cols = [_as_rewards(arr[:, k], f"rewards[:, {k}]") for k in range(arr.shape[1])]
        if weights is None:
            w = [1.0] * len(cols)
        else:
            w = [float(v) for v in weights]
            if len(w) != len(cols):
                raise ValueError(
                    f"weights has {len(w)} entries but rewards has {len(cols)} columns"
                )
    groups = _groups(cols[0].shape[0], group_size, group_ids, cols[0].dtype)
    pre = jnp.zeros_like(cols[0])
    for wk, rk in zip(w, cols):
        pre = pre + wk * groups.centered(rk) / (groups.std(rk, unbiased_std) + eps)
    return _batch_centered(pre) / (_batch_std(pre, unbiased_std) + eps)


# ---------------------------------------------------------------------------
# Broadcasting, config, dispatch


def token_advantages(advantages: Array, mask: Array) -> Array:
    """Broadcast per-response advantages [batch] over tokens: [batch, seq], 0 where
    ``mask`` [batch, seq] is 0."""
    a = jnp.asarray(advantages)
    m = jnp.asarray(mask)
    check_rank("advantages", a, 1, "a [batch] vector")
    check_rank("mask", m, 2, "a [batch, seq] array")
    if m.shape[0] != a.shape[0]:
        raise ValueError(
            f"advantages has batch {a.shape[0]} but mask has shape {m.shape}; batch must match"
        )
    return jnp.where(m.astype(bool), a[:, None], 0.0)


_RESERVED = ("rewards", "group_size", "group_ids")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Which advantage estimator to run, and its hyper-parameters.

    ``params`` holds keyword arguments for the estimator (a dict is accepted and
    frozen to sorted pairs, so the config is hashable and jit-static); names it
    does not set take the estimator's documented defaults. Unknown estimator or
    hyper-parameter names raise ValueError at construction.
    """

    name: str = "grpo"
    params: Any = ()

    def __post_init__(self):
        object.__setattr__(self, "params", freeze_params(self.params))
        check_params("advantage estimator", self.name, get_advantage(self.name),
                     self.params, _RESERVED)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.params)

    @classmethod
    def preset(cls, algorithm: str) -> "AdvantageConfig":
        """Advantage settings of a published recipe; see `ADVANTAGE_PRESETS`."""
        if algorithm not in ADVANTAGE_PRESETS:
            raise ValueError(
                f"unknown preset {algorithm!r}; known: {', '.join(sorted(ADVANTAGE_PRESETS))}"
            )
        name, params = ADVANTAGE_PRESETS[algorithm]
        return cls(name, params)


# algorithm -> (estimator, hyper-parameters). Sources:
#   grpo     veRL's GRPO estimator: group std with Bessel, eps 1e-6.
#   grpo_trl TRL's GRPOTrainer: eps 1e-4, scale_rewards="group".
#   dr_grpo  Liu et al. 2025: no std division.
#   dapo     DAPO (Yu et al. 2025) keeps GRPO's group normalisation (veRL recipe).
#   gspo     GSPO (Zheng et al. 2025) uses GRPO's group-normalised advantages.
#   cispo    MiniMax-M1 (2025) uses group-normalised advantages.
#   rloo, mc_grpo, gdpo: the estimators' own defaults.
ADVANTAGE_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo": ("grpo", {"eps": 1e-6, "unbiased_std": True, "scale_rewards": "group"}),
    "grpo_trl": ("grpo", {"eps": 1e-4, "unbiased_std": True, "scale_rewards": "group"}),
    "dr_grpo": ("dr_grpo", {}),
    "dapo": ("grpo", {"eps": 1e-6, "unbiased_std": True, "scale_rewards": "group"}),
    "gspo": ("grpo", {"eps": 1e-6, "unbiased_std": True, "scale_rewards": "group"}),
    "cispo": ("grpo", {"eps": 1e-6, "unbiased_std": True, "scale_rewards": "group"}),
    "rloo": ("rloo", {}),
    "mc_grpo": ("mc_grpo", {}),
    "gdpo": ("gdpo", {}),
}


def compute_advantages(
    config: AdvantageConfig,
    rewards: Array | Mapping[str, Array],
    group_size: int | None = None,
    *,
    group_ids: Array | None = None,
) -> AdvantageResult:
    """Run the estimator ``config`` names.

    Returns:
        AdvantageResult(advantages [batch], sample_mask [batch]); estimators that
        return a bare array get an all-ones sample_mask.
    """
    fn = get_advantage(config.name)
    out = fn(rewards, group_size, group_ids=group_ids, **config.kwargs)
    if isinstance(out, AdvantageResult):
        return out
    adv = jnp.asarray(out)
    check_rank(f"output of advantage estimator {config.name!r}", adv, 1, "a [batch] vector")
    return AdvantageResult(adv, jnp.ones_like(adv))
