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
  sandbox       `run_python(code, SandboxLimits(...))`: model-written code in a fresh
                process and temp dir with limits (bubblewrap where installed, else
                rlimits + an audit hook); always an observation back
  python_tool   `PythonToolEnv`: reasoning-gym word problems with a sandboxed `python`
                tool, any number of turns, answers checked by math-verify
  latency       `with_latency(env, "lognormal:0.5,3")`: a seeded, emulated tool latency
                on every step (benchmarks without a network)

Environments are plain Python objects that step on the host between decode segments.

    from rl.envs import make_env
    env = make_env("guess_number", k=8, max_turns=4)
    env = make_env("guess_number:k=16,max_turns=5")
    env = make_env("calculator", tokenizer=tok)
    env = make_env("my_envs:make_maze:size=5")   # your own factory, checked on build
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from rl.envs.arithmetic import calculate
from rl.envs.base import (
    EndReason,
    Environment,
    Episode,
    StepResult,
    ToolTimeout,
    check_environment,
    check_step_result,
)
from rl.envs.calculator import CalculatorEnv
from rl.envs.guess_number import GuessNumberEnv
from rl.envs.latency import LatencyModel, parse_latency, with_latency
from rl.envs.python_tool import PythonToolEnv
from rl.envs.sandbox import SandboxLimits, SandboxResult, run_python
from rl.tasks.callables import is_callable_spec, load_callable

ENVS: dict[str, Callable[..., Any]] = {"guess_number": GuessNumberEnv, "calculator": CalculatorEnv,
                                       "python": PythonToolEnv}


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
    """"name", "name:key=value,key=value", "module:factory" or "module:factory:key=value,..."
    ("file.py:factory" too) -> (name, options); values are ints, floats, true/false,
    strings, or '+'-joined tuples (kinds=mul+add)."""
    parts = spec.replace(" ", "").split(":")
    if parts[0] not in ENVS and len(parts) >= 2 and parts[1] and "=" not in parts[1]:
        name, rest = f"{parts[0]}:{parts[1]}", ":".join(parts[2:])
    else:
        name, rest = parts[0], ":".join(parts[1:])
    options: dict[str, Any] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"environment option {part!r} in {spec!r} is not key=value")
        if key in options:
            raise ValueError(f"environment option {key!r} appears twice in {spec!r}")
        options[key] = _option(value)
    return name, options


def env_factory(name: str) -> Callable[..., Any]:
    """What builds environment `name`: a registered class, or the callable a
    'module:factory' / 'file.py:factory' spec names (rl.tasks.callables)."""
    if name in ENVS:
        return ENVS[name]
    if is_callable_spec(name):
        return load_callable(name, "environment factory")
    raise ValueError(f"unknown environment {name!r}; available: {sorted(ENVS)}, or your own "
                     "as 'module:factory' / 'path/to/file.py:factory'")


def factory_fields(factory: Callable[..., Any]) -> set[str] | None:
    """The keyword arguments a factory takes: a dataclass's fields, a callable's named
    parameters; None when it takes **kwargs (any name)."""
    if dataclasses.is_dataclass(factory):
        return {f.name for f in dataclasses.fields(factory)}
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def make_env(spec: str, **kwargs) -> Environment:
    """Build an environment from a spec: a registered name ("guess_number", "calculator"),
    "name:key=value,..." (e.g. "guess_number:k=16,max_turns=5") or your own factory,
    "module:factory[:key=value,...]"; kwargs are more options (the tokenizer, ...) and may
    not repeat a spec option. What it builds is checked against the protocol
    (check_environment)."""
    name, options = parse_env_spec(spec)
    factory = env_factory(name)
    both = set(options) & set(kwargs)
    if both:
        raise ValueError(f"options {sorted(both)} given both in the spec {spec!r} and as keywords")
    try:
        env = factory(**options, **kwargs)
    except TypeError as err:
        raise ValueError(f"environment {name!r} rejected its options: {err}") from None
    check_environment(env, name)
    return env


__all__ = ["ENVS", "CalculatorEnv", "EndReason", "Environment", "Episode", "GuessNumberEnv",
           "LatencyModel", "PythonToolEnv", "SandboxLimits", "SandboxResult", "run_python", "StepResult", "ToolTimeout", "calculate", "check_environment",
           "check_step_result", "env_factory", "factory_fields", "make_env", "parse_env_spec",
           "parse_latency", "with_latency"]
