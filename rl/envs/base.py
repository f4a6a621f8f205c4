"""The environment protocol: how a multi-turn episode talks to the rollout engine.

An episode starts from a task prompt (`Environment.reset(prompt) -> Episode`). The model
writes a *turn*: it decodes until one of `Environment.stop_ids` (end of its message, or the
end of a tool call) or `max_turn_tokens` new tokens. A turn's ids are every token the
model sampled in it, ending with its stop id when one ended it (the stop id is a model token: trained on, like
a single-turn response's eos). The engine decodes the turn's ids to text
(`Environment.decode_turn`; whether special tokens are kept is the environment's choice)
and calls `Episode.step(text) -> StepResult`: the observation text for the next turn,
this turn's reward, and whether the episode is done. The observation becomes token ids
with `Environment.encode_observation(text)` — already wrapped in the model's chat roles
and ending where the model's next turn begins (after a turn that stopped on <|im_end|>:
`\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n`; an environment
that sees a turn cut at max_turn_tokens closes it first, starting with `<|im_end|>`) —
and those ids are appended to the episode's KV cache; the model's next turn follows them.

An episode ends when the environment says done, after `max_turns` model turns, or when
prompt + turns + observations would pass `max_episode_tokens`. The episode's rewards
(what the advantage estimator sees, one float per name in `reward_names`) come from
`Episode.outcome()`; the per-turn `StepResult.reward`s are kept for turn-level credit.

Tools are environments too: a tool call is a turn that ends on the tool-call end id; the
tool's result (or a clear error message) is the next observation. Environments never
`eval`/`exec` model output.

If an environment misbehaves — `step` raises, returns something that is not a StepResult
with a string observation, or its observation would pass the token budget — the rollout
side ends that episode with an `EndReason` and a logged message; no other episode in the
batch is affected.

Time limits. An environment may set `step_timeout_s` (an optional attribute, seconds; the
loop's `env_step_timeout_s` overrides it): a call into its code (reset, decode_turn,
step, encode_observation, outcome) that has not returned by then ends that episode with
EndReason.TIMEOUT (the call was run in a daemon thread and is left behind: a Python call
cannot be stopped from outside; the episode's rewards are 0). The rollout engine also has
a per-episode wall limit (rl.rollout.multiturn.TimeLimits). Work that may really hang (a
tool calling out to other code) belongs in a worker process that can be killed:
`rl.envs.tools.ToolWorker` runs a function there with a hard timeout and raises
`ToolTimeout` when it is exceeded; a ToolTimeout out of an environment call also ends the
episode with EndReason.TIMEOUT (or the environment catches it and shows the model an
error observation instead).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rl.tasks.base import Prompt


class EndReason(str, enum.Enum):
    """Why an episode ended (logged per episode; counted in the loop's metrics)."""

    DONE = "done"                      # the environment said done
    MAX_TURNS = "max_turns"            # the model used its max_turns turns
    TOKEN_BUDGET = "token_budget"      # the next turn or observation would not fit
    ENV_ERROR = "env_error"            # step() raised
    BAD_RESULT = "bad_result"          # step() returned something that is not a valid StepResult
    TIMEOUT = "timeout"                # a call or the whole episode passed its time limit


class ToolTimeout(TimeoutError):
    """A tool (or any environment work) did not finish within its time limit (raised by
    rl.envs.tools.ToolWorker; ends the episode with EndReason.TIMEOUT unless caught)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an environment returns after one model turn. observation: text shown to the
    model before its next turn (ignored when done); reward: this turn's reward (finite);
    done: the episode is over; info: anything worth logging (not used for training)."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Episode(Protocol):
    """One episode's host-side state (made by Environment.reset)."""

    def step(self, turn_text: str) -> StepResult:
        """The model's turn (the text Environment.decode_turn made of its ids) -> the next
        observation."""
        ...

    def outcome(self) -> dict[str, float]:
        """The episode's rewards, one finite float per name in Environment.reward_names;
        called once when the episode ends, for whatever reason."""
        ...


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment: prompts with deterministic train/eval splits (as
    rl.tasks.Task), episodes, and the token-level settings the rollout engine needs.

    stop_ids: ids that end a model turn; max_turns: model turns per episode;
    max_turn_tokens: new tokens per model turn; max_prompt_len: prompt tokens;
    max_episode_tokens: prompt + every turn + every observation. Optional: step_timeout_s,
    the time limit of each call into the environment (module doc; absent or 0 = none)."""

    name: str
    reward_names: tuple[str, ...]
    stop_ids: tuple[int, ...]
    max_turns: int
    max_turn_tokens: int
    max_prompt_len: int
    max_episode_tokens: int

    def train_prompts(self, start: int, count: int) -> list[Prompt]: ...

    def eval_prompts(self, count: int) -> list[Prompt]: ...

    def reset(self, prompt: Prompt) -> Episode: ...

    def decode_turn(self, ids: Sequence[int]) -> str: ...

    def encode_observation(self, text: str) -> list[int]: ...


def check_step_result(result: Any) -> str | None:
    """None if `result` is a usable StepResult, else why not (the message the rollout side
    logs when it ends the episode with EndReason.BAD_RESULT)."""
    if not isinstance(result, StepResult):
        return f"step() returned {type(result).__name__}, not a StepResult"
    if not result.done and not isinstance(result.observation, str):
        return f"observation must be a str, got {type(result.observation).__name__}"
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return f"reward must be a finite number, got {reward!r}"
    if not isinstance(result.done, bool):
        return f"done must be a bool, got {result.done!r}"
    return None


ENV_ATTRIBUTES = ("name", "reward_names", "stop_ids", "max_turns", "max_turn_tokens",
                  "max_prompt_len", "max_episode_tokens")
ENV_METHODS = ("train_prompts", "eval_prompts", "reset", "decode_turn", "encode_observation")


def check_environment(env: Any, what: str | None = None) -> None:
    """ValueError naming every attribute or method of the Environment protocol `env`
    lacks (or has of the wrong kind), before anything is built around it."""
    label = what or type(env).__name__
    missing = [a for a in ENV_ATTRIBUTES if not hasattr(env, a)]
    missing += [f"{m}()" for m in ENV_METHODS if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"environment {label!r} built a {type(env).__name__}, which is not an "
                         f"rl.envs.Environment: it has no {', '.join(missing)} (the protocol: "
                         "rl/envs/base.py)")
    for a in ("max_turns", "max_turn_tokens", "max_prompt_len", "max_episode_tokens"):
        v = getattr(env, a)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"environment {label!r}: {a} must be an int >= 1, got {v!r}")
    if isinstance(env.reward_names, str) or not env.reward_names \
            or not all(isinstance(n, str) for n in env.reward_names):
        raise ValueError(f"environment {label!r}: reward_names must be a non-empty tuple of "
                         f"strings, got {env.reward_names!r}")
    stops = env.stop_ids
    if isinstance(stops, (str, int)) or not all(isinstance(t, numbers.Integral)
                                                and not isinstance(t, bool) for t in stops):
        raise ValueError(f"environment {label!r}: stop_ids must be a tuple of int token ids, "
                         f"got {stops!r}")
