"""Named registries for advantage estimators, policy losses and off-policy corrections,
plus the boundary checks every objective module shares.

A config names an estimator (``AdvantageConfig(name="grpo")``) or a loss
(``LossConfig(name="gspo")``); the name resolves here. Users add their own::

    from rl.objectives.registry import register_loss

    @register_loss("my_loss")
    def my_loss(logp, old_logp, advantages, mask, *, temperature=1.0):
        ...  # -> (per_token_loss [batch, seq], token_stats {name: [batch, seq]})

An off-policy correction (``OffPolicyConfig(correction="my_fix")``, per-token weights of
π_prox/μ that multiply the loss) is one function and one decorator::

    from rl.objectives.registry import register_correction

    @register_correction("my_fix", modes=(None, "mask"), levels=("token",))
    def my_fix(prox_logp, behaviour_logp, mask, *, level="token", cap=None, mode=None):
        ...  # -> rl.objectives.offpolicy.OffPolicyWeights(weights, keep, metrics)

This module imports nothing else from ``rl``: the built-in entries register themselves
when ``rl.objectives.advantages`` / ``rl.objectives.losses`` / ``rl.objectives.offpolicy``
are imported, and ``get_*`` imports them on first use so a name always resolves.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np


class Registry:
    """A name -> function table with clear errors.

    Args:
        kind: what is registered, used in error messages ("advantage estimator").
        builtin_module: the module (or modules) whose import registers the built-in entries.
    """

    def __init__(self, kind: str, builtin_module: str | tuple[str, ...]):
        self.kind = kind
        self._builtin_modules = ((builtin_module,) if isinstance(builtin_module, str)
                                 else tuple(builtin_module))
        self._table: dict[str, Callable[..., Any]] = {}

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` under ``name``; returns ``fn`` unchanged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: Callable) -> Callable:
            old = self._table.get(name)
            # Re-importing a module re-registers the same function: that is not a clash.
            same = old is not None and (
                getattr(old, "__module__", None), getattr(old, "__qualname__", None)
            ) == (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
            if old is not None and not same and not overwrite:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {old.__module__}."
                    f"{old.__qualname__}); pick another name or pass overwrite=True"
                )
            self._table[name] = fn
            return fn

        return decorator

    def _load_builtins(self) -> None:
        for name in self._builtin_modules:
            importlib.import_module(name)

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered under ``name``; ValueError listing known names."""
        self._load_builtins()
        if name not in self._table:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            )
        return self._table[name]

    def names(self) -> tuple[str, ...]:
        """Sorted registered names (built-ins included)."""
        self._load_builtins()
        return tuple(sorted(self._table))


ADVANTAGES = Registry("advantage estimator", "rl.objectives.advantages")
LOSSES = Registry("policy loss", "rl.objectives.losses")


def register_advantage(name: str, *, overwrite: bool = False) -> Callable[[Callable], Callable]:
    """Register an advantage estimator.

    Signature it must have: ``fn(rewards, group_size=None, *, group_ids=None, **hyper)``
    returning advantages ``[batch]`` or an ``rl.objectives.advantages.AdvantageResult``.
    """
    return ADVANTAGES.register(name, overwrite=overwrite)


def get_advantage(name: str) -> Callable[..., Any]:
    """The advantage estimator registered as ``name`` (ValueError if unknown)."""
    return ADVANTAGES.get(name)


def available_advantages() -> tuple[str, ...]:
    return ADVANTAGES.names()


def register_loss(name: str, *, overwrite: bool = False) -> Callable[[Callable], Callable]:
    """Register a per-token policy loss.

    Signature it must have: ``fn(logp, old_logp, advantages, mask, **hyper)`` with
    ``[batch, seq]`` log-probs and mask and ``[batch]`` or ``[batch, seq]`` advantages,
    returning ``(per_token_loss [batch, seq], token_stats {name: [batch, seq]})``.
    """
    return LOSSES.register(name, overwrite=overwrite)


def get_loss(name: str) -> Callable[..., Any]:
    """The policy loss registered as ``name`` (ValueError if unknown)."""
    return LOSSES.get(name)


def available_losses() -> tuple[str, ...]:
    return LOSSES.names()


CORRECTIONS = Registry("off-policy correction", ("rl.objectives.offpolicy",
                                                 "rl.objectives.rejection"))


def register_correction(name: str, *, modes: tuple = (None,),
                        levels: tuple[str, ...] = ("token", "sequence"), two_sided: bool = False,
                        overwrite: bool = False) -> Callable[[Callable], Callable]:
    """Register an off-policy correction (OffPolicyConfig.correction = ``name``).

    Signature it must have: ``fn(prox_logp, behaviour_logp, mask, *, level, cap, mode)``
    (and ``low`` when ``two_sided``) with ``[batch, seq]`` log π_prox, log μ and mask,
    ``cap`` (the upper bound) and ``low`` (the lower one) None meaning its own defaults,
    returning ``rl.objectives.offpolicy.OffPolicyWeights`` (weights [batch, seq], detached,
    0 where masked or rejected; keep; scalar metrics). ``modes`` / ``levels``: the values
    of OffPolicyConfig.mode / level it accepts; ``two_sided``: whether it takes
    OffPolicyConfig.low (all checked when the config is built)."""
    if name == "none":
        raise ValueError("'none' means no correction; register under another name")

    def decorator(fn: Callable) -> Callable:
        fn.correction_modes = tuple(modes)
        fn.correction_levels = tuple(levels)
        fn.correction_two_sided = bool(two_sided)
        return CORRECTIONS.register(name, overwrite=overwrite)(fn)

    return decorator


def get_correction(name: str) -> Callable[..., Any]:
    """The off-policy correction registered as ``name`` (ValueError if unknown)."""
    return CORRECTIONS.get(name)


def available_corrections() -> tuple[str, ...]:
    """The registered off-policy corrections (besides "none")."""
    return CORRECTIONS.names()


def freeze_params(params: Mapping[str, Any] | tuple) -> tuple[tuple[str, Any], ...]:
    """Hyper-parameters as a sorted tuple of pairs (hashable, so configs can be jit-static).

    Nested mappings (e.g. GDPO's reward weights) become tuples of pairs too.
    """
    items = params.items() if isinstance(params, Mapping) else params
    out = []
    for key, value in items:
        if isinstance(value, Mapping):
            value = tuple(sorted(value.items()))
        out.append((key, value))
    return tuple(sorted(out))


def check_params(kind: str, name: str, fn: Callable, params: tuple[tuple[str, Any], ...],
                 reserved: tuple[str, ...]) -> None:
    """ValueError if ``params`` names a keyword ``fn`` does not take (or a reserved one)."""
    sig = inspect.signature(fn)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    accepted = [n for n, p in sig.parameters.items()
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n not in reserved]
    for key, value in params:
        if key in reserved:
            raise ValueError(f"params: {key!r} is an input of the {kind}, not a hyper-parameter")
        if key not in accepted and not takes_any:
            raise ValueError(
                f"params: {kind} {name!r} takes no hyper-parameter {key!r}; "
                f"it takes: {', '.join(accepted) or '(none)'}"
            )
        # A hyper-parameter whose default is a number must be given a number (None only
        # where its annotation allows it): `clip_high=None` or `max_len="512"` is caught at
        # config construction, not as a TypeError inside a jitted step.
        p = sig.parameters.get(key)
        if (p is not None and isinstance(p.default, (int, float))
                and not isinstance(p.default, bool)):
            check_number(f"{kind} {name!r} hyper-parameter {key}", value,
                         allow_none="None" in str(p.annotation))


# ---------------------------------------------------------------------------
# Boundary checks shared by rl.objectives' advantages, losses and offpolicy.
# Shape checks are static, so they also run under jit and vmap; value checks
# (finiteness) need concrete data and are skipped for tracers.


def check_number(name: str, value: Any, *, low: float | None = None, low_open: bool = False,
                 high: float | None = None, high_open: bool = False, integer: bool = False,
                 allow_none: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is a real Python / numpy number (an int
    if ``integer``; None only if ``allow_none``) inside [low, high] (open ends with
    ``low_open`` / ``high_open``). Hyper-parameters are static, so this also runs under jit;
    a traced value is accepted as is."""
    if value is None and allow_none:
        return
    if isinstance(value, jax.core.Tracer):
        return
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kinds):
        what = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {what}{' or None' if allow_none else ''}, "
                         f"got {value!r} ({type(value).__name__})")
    v = float(value)
    if v != v:
        raise ValueError(f"{name} must be a number, got NaN")
    below = low is not None and (v <= low if low_open else v < low)
    above = high is not None and (v >= high if high_open else v > high)
    if below or above:
        if low is not None and high is not None:
            span = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            span = f"{'>' if low_open else '>='} {low}"
        else:
            span = f"{'<' if high_open else '<='} {high}"
        raise ValueError(f"{name} must be {span}, got {value!r}")


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds data (not a jit/vmap/grad tracer), so values can be checked."""
    return not isinstance(x, jax.core.Tracer)


def check_rank(name: str, x: Any, rank: int | set[int], what: str) -> None:
    """ValueError naming ``name`` if ``x`` does not have ``rank`` (chex does the test)."""
    try:
        chex.assert_rank(x, rank)
    except AssertionError:
        raise ValueError(
            f"{name} must be {what}, got shape {tuple(jnp.shape(x))}"
        ) from None


def check_float(name: str, x: Any) -> None:
    """ValueError naming ``name`` if ``x`` is not a floating-point array."""
    try:
        chex.assert_type(x, float)
    except AssertionError:
        raise ValueError(
            f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}"
        ) from None


def check_same_shape(**arrays: Any) -> None:
    """ValueError naming every argument if the given arrays' shapes differ."""
    shapes = {k: tuple(jnp.shape(v)) for k, v in arrays.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k} {s}" for k, s in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; these must have the same shape")


def check_finite(name: str, x: Any, where: Any = None) -> None:
    """ValueError naming ``name`` if concrete ``x`` has NaN/inf (at ``where`` if given).

    Skipped under jit/vmap (values unknown there): call it on concrete inputs
    before entering jitted code if the data source is untrusted.
    """
    if not (is_concrete(x) and (where is None or is_concrete(where))):
        return
    bad = ~np.isfinite(np.asarray(x, dtype=np.float64))
    if where is not None:
        bad &= np.asarray(where).astype(bool)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) (NaN or inf), first at index "
            f"{idx}; clean them before computing the objective"
        )
