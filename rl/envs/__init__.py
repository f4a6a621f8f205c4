"""Multi-turn environments and tools (a leaf: may import `rl.tasks` for `Prompt` and the
split helpers, nothing else from `rl`).

  base          the protocol every environment follows (`Environment`, `Episode`,
                `StepResult`, `EndReason`) and the check the rollout side applies to
                what an environment returns
  guess_number  guess a hidden number with higher/lower feedback; tokenizer-free, the
                `tiny` model learns it from scratch (exact random / optimal baselines)
  arithmetic    a safe `ast` arithmetic evaluator (`calculate`): the calculator tool,
                exact, bounded, never eval/exec
  calculator    `CalculatorEnv`: arithmetic problems for a chat model with a
                <calc>EXPR</calc> tool (`arithmetic.calculate`)
  tools         `ToolWorker`: a tool function run in a worker process with a hard
                timeout (`ToolTimeout`), for tools that may hang

Environments are plain Python objects that step on the host between decode segments.

    from rl.envs import make_env
    env = make_env("guess_number", k=8, max_turns=4)
    env = make_env("guess_number:k=16,max_turns=5")
    env = make_env("calculator", tokenizer=tok)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl.envs.arithmetic import calculate
from rl.envs.base import (
    EndReason,
    Environment,
    Episode,
    StepResult,
    ToolTimeout,
    check_step_result,
)
from rl.envs.calculator import CalculatorEnv
from rl.envs.guess_number import GuessNumberEnv

ENVS: dict[str, Callable[..., Any]] = {"guess_number": GuessNumberEnv, "calculator": CalculatorEnv}


def _option(text: str) -> Any:
    """A spec option value: int, float, true/false, or a string ("mul+add" -> a tuple)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue  # not this kind: try the next
    return tuple(text.split("+")) if "+" in text else text


def parse_env_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """"name" or "name:key=value,key=value" -> (name, options); values are ints, floats,
    true/false, strings, or '+'-joined tuples (kinds=mul+add)."""
    name, _, rest = spec.replace(" ", "").partition(":")
    options: dict[str, Any] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"environment option {part!r} in {spec!r} is not key=value")
        if key in options:
            raise ValueError(f"environment option {key!r} appears twice in {spec!r}")
        options[key] = _option(value)
    return name, options


def make_env(spec: str, **kwargs) -> Environment:
    """Build an environment from a spec: a registered name ("guess_number", "calculator")
    or "name:key=value,..." (e.g. "guess_number:k=16,max_turns=5"); kwargs are more
    options (the tokenizer, ...) and may not repeat a spec option."""
    name, options = parse_env_spec(spec)
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; available: {sorted(ENVS)}")
    both = set(options) & set(kwargs)
    if both:
        raise ValueError(f"options {sorted(both)} given both in the spec {spec!r} and as keywords")
    try:
        return ENVS[name](**options, **kwargs)
    except TypeError as err:
        raise ValueError(f"environment {name!r} rejected its options: {err}") from None


__all__ = ["ENVS", "CalculatorEnv", "EndReason", "Environment", "Episode", "GuessNumberEnv",
           "StepResult", "ToolTimeout", "calculate", "check_step_result", "make_env",
           "parse_env_spec"]
