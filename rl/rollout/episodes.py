"""Host-side bookkeeping of multi-turn episodes for `rl.rollout.multiturn`: the guarded
calls into an environment, the per-episode record, and the Trajectory of finished groups.

Every call into environment code (reset, decode_turn, step, encode_observation, outcome)
goes through a guard here: an exception or a malformed result ends *that* episode with
an `EndReason` (ENV_ERROR for an exception, BAD_RESULT for a malformed value, TIMEOUT for
a call past its time limit or a `rl.envs.base.ToolTimeout`), a message logged through the
`logging` module (logger "rl.rollout.episodes") and kept in the episode's record; nothing
else in the batch is touched. With a time limit (`timeout_s` > 0) the call runs in a
daemon thread the guard waits for at most that long; one that does not return is left
running there and never touched again (its episode gets rewards 0).

Rewards. A finished episode's rewards are `Episode.outcome()` ({name: float} with exactly
the environment's reward_names). If outcome raises, returns other names or a non-finite
value, the episode gets reward 0.0 for every name (so one broken episode can neither stop
training nor push a NaN into it), its end reason becomes ENV_ERROR / BAD_RESULT and the
record's message says what happened and why the episode had ended before.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from rl.envs.base import (
    EndReason,
    Environment,
    Episode,
    Prompt,  # rl.tasks.base.Prompt, as the protocol uses it
    ToolTimeout,
    check_step_result,
)
from rl.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EpisodeRecord:
    """One episode, as it happened (host objects; row b of a harvested batch is
    records[b]). group_id / sample: its group and index in the group; prompt: the task
    prompt; turns: model turns taken; end_reason: an EndReason (None while running);
    message: why it ended, for anything but DONE / MAX_TURNS (None otherwise);
    turn_texts / observations / turn_rewards / infos: per model turn, the decoded turn,
    the observation that followed it ("" after the last turn), StepResult.reward and
    .info; outcome: {name: reward} (zeros after a failed outcome, see the module doc);
    spans: (kind, start, end) response-index ranges, kind "model" or "env"."""

    group_id: int
    sample: int
    prompt: Prompt
    turns: int = 0
    end_reason: EndReason | None = None
    message: str | None = None
    turn_texts: list[str] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    infos: list[Any] = dataclasses.field(default_factory=list)
    outcome: dict[str, float] = dataclasses.field(default_factory=dict)
    spans: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.end_reason is not None

    @property
    def text(self) -> str:
        """The transcript after the prompt: turns and observations interleaved."""
        parts = []
        for i, t in enumerate(self.turn_texts):
            parts.append(t)
            if i < len(self.observations) and self.observations[i]:
                parts.append(self.observations[i])
        return "".join(parts)


class EnvCallError(Exception):
    """Internal: an environment call failed; reason + message end the episode. hung: the
    call is still running (past its time limit), so its episode must not be called again."""

    def __init__(self, reason: EndReason, message: str, hung: bool = False):
        super().__init__(message)
        self.reason, self.message, self.hung = reason, message, hung


def guarded(what: str, fn: Callable[..., Any], *args, timeout_s: float = 0.0) -> Any:
    """fn(*args), turning any exception into EnvCallError(ENV_ERROR, '<what> raised ...'),
    a ToolTimeout into EnvCallError(TIMEOUT) and, with timeout_s > 0, a call that has not
    returned after timeout_s seconds into EnvCallError(TIMEOUT) (module doc)."""
    if timeout_s > 0:
        return _within(what, fn, args, timeout_s)
    try:
        return fn(*args)
    except ToolTimeout as e:
        raise EnvCallError(EndReason.TIMEOUT, f"{what}: {e}") from e
    except Exception as e:  # noqa: BLE001 - the environment is untrusted code
        raise EnvCallError(EndReason.ENV_ERROR, f"{what} raised {type(e).__name__}: {e}") from e


def _within(what: str, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """guarded's timed call: fn(*args) in a daemon thread, waited for timeout_s seconds."""
    box: dict[str, Any] = {}

    def call():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=call, name=f"tandem-env-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EnvCallError(EndReason.TIMEOUT, f"{what} did not return within its time limit "
                           f"of {timeout_s:g} s (left running in a daemon thread)", hung=True)
    if "error" in box:
        e = box["error"]
        if isinstance(e, ToolTimeout):
            raise EnvCallError(EndReason.TIMEOUT, f"{what}: {e}") from e
        if not isinstance(e, Exception):
            raise e
        raise EnvCallError(EndReason.ENV_ERROR, f"{what} raised {type(e).__name__}: {e}") from e
    return box["value"]


def check_ids(what: str, ids: Any, vocab_size: int) -> list[int]:
    """A list of ints in [0, vocab_size) or EnvCallError(BAD_RESULT)."""
    try:
        arr = np.asarray(ids)
    except Exception:  # noqa: BLE001
        arr = np.asarray([object()])
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise EnvCallError(EndReason.BAD_RESULT,
                           f"{what} must return a flat list of int token ids, got {ids!r:.80}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise EnvCallError(EndReason.BAD_RESULT,
                           f"{what} returned ids outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in arr]


def step_episode(env: Environment, episode: Episode, rec: EpisodeRecord,
                 turn_ids: Sequence[int], timeout_s: float = 0.0) -> tuple[str, bool]:
    """Decode the turn, step the episode, record the turn (each call within timeout_s
    seconds when > 0). Returns (observation text, done). Raises EnvCallError (the turn is
    still counted)."""
    rec.turns += 1
    text = guarded("decode_turn", env.decode_turn, list(turn_ids), timeout_s=timeout_s)
    if not isinstance(text, str):
        raise EnvCallError(EndReason.BAD_RESULT,
                           f"decode_turn returned {type(text).__name__}, not a str")
    rec.turn_texts.append(text)
    result = guarded("step", episode.step, text, timeout_s=timeout_s)
    why = check_step_result(result)
    if why is not None:
        raise EnvCallError(EndReason.BAD_RESULT, why)
    rec.turn_rewards.append(float(result.reward))
    rec.infos.append(result.info)
    return ("" if result.done else result.observation), result.done


def end_episode(rec: EpisodeRecord, reason: EndReason, message: str | None,
                episode: Episode | None, reward_names: Sequence[str],
                timeout_s: float = 0.0) -> None:
    """Close the record: end reason, message (logged), outcome (guarded, within timeout_s
    seconds when > 0; see module doc). episode=None (it failed to start, or a call into it
    is still running): rewards 0."""
    rec.end_reason, rec.message = reason, message
    if message is not None:
        log.warning("episode (group %d, sample %d) ended: %s: %s", rec.group_id, rec.sample,
                    reason.value, message)
    zeros = {str(n): 0.0 for n in reward_names}
    if episode is None:
        rec.outcome = zeros
        return
    try:
        out = guarded("outcome", episode.outcome, timeout_s=timeout_s)
        if not isinstance(out, dict) or sorted(map(str, out)) != sorted(zeros):
            raise EnvCallError(EndReason.BAD_RESULT, f"outcome() must return a dict with "
                               f"names {sorted(zeros)}, got {out!r:.80}")
        bad = {k: v for k, v in out.items() if isinstance(v, bool)
               or not isinstance(v, (int, float, np.floating, np.integer))
               or not math.isfinite(float(v))}
        if bad:
            raise EnvCallError(EndReason.BAD_RESULT, f"outcome() values must be finite numbers, "
                               f"got {bad!r:.80}")
        rec.outcome = {str(k): float(v) for k, v in out.items()}
    except EnvCallError as e:
        before = f" (the episode had ended: {reason.value}{': ' + message if message else ''})"
        rec.end_reason, rec.message, rec.outcome = e.reason, e.message + before, zeros
        log.warning("episode (group %d, sample %d): %s; its rewards are 0", rec.group_id,
                    rec.sample, rec.message)


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """What `MultiTurnEngine.harvest` returns: trajectory (rows = episodes, grouped, in
    group id order; see `episodes_to_trajectory`) and episodes[b], the record of row b."""

    trajectory: Trajectory
    episodes: tuple[EpisodeRecord, ...]


def episodes_to_trajectory(records: Sequence[EpisodeRecord], samples: Sequence[Any],
                           max_prompt_len: int, max_response_len: int, max_turns: int,
                           reward_names: Sequence[str]) -> Trajectory:
    """Rows b = (records[b], samples[b]) (samples: rl.rollout.sampler.PartialSample read
    from the slots). env_mask is True on the records' "env" spans; turn_ids gives each
    response token its model turn (observations: the turn they answer); turn_rewards
    [B, max_turns]; rewards = the outcomes; finished = ended DONE, truncated = ended on
    the token budget (TOKEN_BUDGET)."""
    b, r = len(records), max_response_len
    out = {
        "prompt_ids": np.zeros((b, max_prompt_len), np.int32),
        "prompt_lengths": np.zeros((b,), np.int32),
        "response_ids": np.zeros((b, r), np.int32), "response_mask": np.zeros((b, r), bool),
        "behaviour_logprobs": np.zeros((b, r), np.float32), "versions": np.zeros((b, r), np.int32),
        "group_ids": np.array([rec.group_id for rec in records], np.int32),
        "finished": np.array([rec.end_reason == EndReason.DONE for rec in records], bool),
        "truncated": np.array([rec.end_reason == EndReason.TOKEN_BUDGET for rec in records], bool),
        "env_mask": np.zeros((b, r), bool), "turn_ids": np.zeros((b, r), np.int32),
        "turn_rewards": np.zeros((b, max_turns), np.float32),
        "rewards": {str(n): np.array([rec.outcome[str(n)] for rec in records], np.float32)
                    for n in reward_names},
    }
    for i, (rec, s) in enumerate(zip(records, samples)):
        k, p = s.num_generated, s.prompt_ids.size
        out["prompt_ids"][i, :p], out["prompt_lengths"][i] = s.prompt_ids, p
        out["response_ids"][i, :k], out["response_mask"][i, :k] = s.response_ids, True
        out["behaviour_logprobs"][i, :k], out["versions"][i, :k] = s.logprobs, s.versions
        turn = 0
        for kind, lo, hi in rec.spans:
            if kind == "env":
                out["env_mask"][i, lo:hi] = True
                out["turn_ids"][i, lo:hi] = turn - 1
            else:
                out["turn_ids"][i, lo:hi] = turn
                turn += 1
        n = min(len(rec.turn_rewards), max_turns)
        out["turn_rewards"][i, :n] = rec.turn_rewards[:n]
    return Trajectory.create(**out)
