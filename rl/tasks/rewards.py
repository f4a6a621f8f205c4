"""Your own reward function, around any single-turn task.

A reward function is a Python callable `fn(prompt, response, entry) -> {name: float}`:
prompt is the prompt text the model was given (chat template included), response the
decoded response text (token ids for a tokenizer-free task), entry the prompt's answer
record (a file task's row entry, a reasoning-gym entry; rl.tasks.file_task says what it
holds). It is named by a spec string, so a run config stays JSON:

    "my_rewards:score"           module my_rewards (importable: on sys.path, e.g. the
                                 working directory), function score
    "path/to/rewards.py:score"   a file, loaded by path
    "length_bonus"               a name given to register_reward("length_bonus", fn)

From a notebook, `register_reward("name", fn)` (or `reward_spec(fn)`, which registers fn
under "module:qualname" and returns that spec; RunConfig(reward=fn) does this) makes a
callable defined there usable by name in the same process.

`RewardedTask(task, spec, timeout_s)` is `task` with the function's rewards: its
reward_names are the function's names, then the task's own ("correct", ...) that the
function does not return; those are `logged_rewards` (logged, weight 0 unless
TrainConfig.reward_weights names them), so accuracy still reads the task's verifier while
training follows the function. Each call runs with a time limit (timeout_s, in a daemon
thread: a call that overruns stops the run with an error; the thread is abandoned) and
its result is checked: a dict of the same names on every call, each value an int or float
(not a bool), finite. Anything else, and any exception the function raises, is a
RewardFunctionError naming the function and the prompt. When built, the function is
called on the first train prompt (an empty response and one that is the reference answer)
so that a function that cannot be imported, raises, hangs or returns NaN is refused
before anything compiles; that call also fixes the reward names.
"""
from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rl.tasks.base import Prompt
from rl.tasks.callables import is_callable_spec, load_callable

REWARD_FUNCTIONS: dict[str, Callable[..., Any]] = {}
DEFAULT_TIMEOUT_S = 10.0


class RewardFunctionError(ValueError):
    """A reward function cannot be loaded, fails, overruns or returns a bad value; the
    message names the function and the prompt."""


def register_reward(name: str, fn: Callable[..., Any]) -> str:
    """Make `fn` usable as reward function `name` in this process (a later call with the
    same name replaces it: re-running a notebook cell updates it). Returns the name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_reward: the name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise ValueError(f"register_reward({name!r}, ...): {fn!r} is not callable")
    REWARD_FUNCTIONS[name] = fn
    return name


def reward_spec(fn: Callable[..., Any]) -> str:
    """The spec string of a callable: it is registered under "module:qualname" (so it
    resolves in this process even when defined in a notebook) and that name returned."""
    if not callable(fn):
        raise ValueError(f"a reward function must be callable, got {fn!r}")
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if "<lambda>" in qualname:
        raise ValueError("a lambda has no name to record in the run config: define the reward "
                         "with def, or register_reward('name', fn) and pass the name")
    return register_reward(f"{getattr(fn, '__module__', None) or '__main__'}:{qualname}", fn)


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The callable a spec names (module docstring); RewardFunctionError otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardFunctionError(f"a reward function spec must be a non-empty string, got "
                                  f"{spec!r}")
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if not is_callable_spec(spec):
        raise RewardFunctionError(
            f"reward function {spec!r} is neither 'module:function', 'file.py:function' nor a "
            f"registered name (registered: {sorted(REWARD_FUNCTIONS) or 'none'})")
    return load_callable(spec, "reward function", RewardFunctionError)


def call_with_time_limit(fn: Callable[..., Any], args: tuple, timeout_s: float,
                         what: str) -> Any:
    """fn(*args) in a daemon thread, waited for at most timeout_s; its result, or a
    RewardFunctionError naming `what` when it raises or overruns (then the thread is left
    to finish or hang on its own)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - reported to the caller
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="tandem-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardFunctionError(f"{what} did not return within {timeout_s:g} s (it may "
                                  "hang); fix it or raise the limit (reward.timeout_s)")
    if "error" in box:
        err = box["error"]
        raise RewardFunctionError(f"{what} raised {type(err).__name__}: {err}") from err
    return box["value"]


def check_result(result: Any, names: Sequence[str] | None, what: str) -> dict[str, float]:
    """{name: float} of a reward function's result, or a RewardFunctionError naming `what`:
    not a dict, no names, other names than `names` (when given), a value that is not an
    int or float (bools are refused) or not finite."""
    if not isinstance(result, dict) or not result:
        raise RewardFunctionError(f"{what} returned {result!r}; it must return a non-empty "
                                  "dict {name: float}")
    if names is not None and set(result) != set(names):
        raise RewardFunctionError(f"{what} returned rewards {sorted(map(str, result))}, other "
                                  f"names than on its first call {sorted(names)}")
    out = {}
    for name, value in result.items():
        if not isinstance(name, str) or not name:
            raise RewardFunctionError(f"{what} returned a reward named {name!r}; names must be "
                                      "non-empty strings")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"{what} returned {name}={value!r} "
                                      f"({type(value).__name__}); rewards must be floats")
        f = float(value)
        if not math.isfinite(f):
            raise RewardFunctionError(f"{what} returned {name}={f} (not finite); rewards must "
                                      "be finite floats")
        out[name] = f
    return out


def _short(text: Any, limit: int = 80) -> str:
    s = " ".join(str(text).split())
    return repr(s if len(s) <= limit else s[:limit - 3] + "...")


class RewardedTask:
    """`task` with the rewards of reward function `spec` (module docstring). Everything
    but the rewards (prompts, budgets, stop ids, describe, the tokenizer) is the task's."""

    def __init__(self, task: Any, spec: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                and timeout_s > 0):
            raise ValueError(f"the reward function's timeout_s must be a number > 0, got "
                             f"{timeout_s!r}")
        if isinstance(task, RewardedTask):
            raise ValueError("the task already has a reward function")
        self.task, self.spec, self.timeout_s = task, spec, float(timeout_s)
        self.fn = load_reward_function(spec)
        self.function_names: tuple[str, ...] | None = None
        (probe,) = task.train_prompts(0, 1)
        reference = probe.answer.get("answer") if isinstance(probe.answer, dict) else None
        text = self.tokenizer is not None or isinstance(reference, str)
        responses = ["", f"\\boxed{{{reference}}}"] if text else [[]]
        for response in responses:
            got = self.function_rewards(probe, response)
            if self.function_names is None:
                self.function_names = tuple(got)
        own = tuple(task.reward_names)
        self.reward_names = self.function_names + tuple(n for n in own
                                                        if n not in self.function_names)
        self.logged_rewards = tuple(n for n in own if n not in self.function_names)

    def __getattr__(self, name: str) -> Any:  # only for what this class does not define
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)

    @property
    def name(self) -> str:
        return self.task.name

    def _prompt_text(self, prompt: Prompt) -> str | None:
        render = getattr(self.task, "prompt_text", None)
        if render is not None and isinstance(prompt.answer, dict):
            return render(prompt.answer)
        return prompt.text

    def function_rewards(self, prompt: Prompt, response: Sequence[int] | str
                         ) -> dict[str, float]:
        """The reward function's checked result for one response."""
        tok = self.tokenizer
        if not isinstance(response, str) and tok is not None:
            response = tok.decode(list(response))
        elif not isinstance(response, str):
            response = list(response)
        what = f"reward function {self.spec!r} on prompt {_short(prompt.text)}"
        result = call_with_time_limit(self.fn, (self._prompt_text(prompt), response,
                                                prompt.answer), self.timeout_s, what)
        return check_result(result, self.function_names, what)

    @property
    def tokenizer(self) -> Any:
        return getattr(self.task, "tokenizer", None)

    def reward(self, prompt: Prompt, response: Sequence[int] | str) -> dict[str, float]:
        out = self.function_rewards(prompt, response)
        if len(out) < len(self.reward_names):
            own = self.task.reward(prompt, response)
            out.update({n: own[n] for n in self.reward_names if n not in out})
        return out


def with_reward_function(task: Any, spec: str | None, timeout_s: float = DEFAULT_TIMEOUT_S
                         ) -> Any:
    """RewardedTask(task, spec, timeout_s), or `task` itself when spec is None."""
    if spec is None:
        return task
    return RewardedTask(task, spec, timeout_s)


__all__ = ["DEFAULT_TIMEOUT_S", "REWARD_FUNCTIONS", "RewardFunctionError", "RewardedTask",
           "call_with_time_limit", "check_result", "load_reward_function", "register_reward",
           "reward_spec", "with_reward_function"]
