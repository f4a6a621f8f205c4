"""How tool calls run beside decoding in rl.rollout.multiturn.MultiTurnEngine: the pool
(threads, or inline), a turn boundary's result, a parked episode, the slot-time clock
behind `MultiTurnEngine.stats()`, and the re-grown sample a returning episode is loaded
from.

Concurrent tool calls (`MultiTurnConfig.max_concurrent_tool_calls`): with 0 every turn
boundary runs at once on the calling thread, one after another (the exact slow twin);
with M >= 1 they run on a pool of M threads, so the calls of different episodes overlap
each other and the decoding of every slot whose episode is not waiting. A slot whose
episode waits stays reserved (`done` in the sampler, not decoded) until its call returns;
when no slot is left to decode, `step` waits for the first call to return. Tokens do not
depend on when a call returns: a sample's rng stream is keyed by its group, index and
position (rl.rollout.sampler_state), so under one params version both settings give the
same tokens, log-probs and records (tested). An environment written the plain way, with
a blocking `Episode.step`, gets this concurrency unchanged; its calls of *different*
episodes run at the same time, so `reset` / `step` / `decode_turn` /
`encode_observation` must be safe to call from several threads (the tokenizers library
is). `stats()`: tool wait share of wall time, calls in flight, slot occupancy, tokens per
second while tools run.
Parking (`park_after_s`, replicated layout): a slot whose episode's call has run that long
is freed for other work (new groups, returning episodes); when the call returns, the
episode goes back into a free slot with its history re-prefilled (`load_samples`: the
rng stream, log-probs and versions kept), so more episodes wait on tools than there are
slots. None = never park.

Statistics (`SlotClock.stats`, over a window: since the engine was made or the last
stats(reset=True)): wall_s; tool_calls (turn boundaries handed to the pool); tool_s
(seconds inside turn boundaries, the tools and the environment's code, summed over
calls); tool_wait_share (share of wall time blocked on tools with no slot left to
decode); tool_calls_in_flight (mean calls running over wall time: tool_s / wall_s,
Little's law); slot_occupancy (share of slot-time spent decoding: slot-seconds in decode
/ (slots x the steps' wall seconds)); slot_held (share of slot-time holding an unfinished
episode, waiting ones included; a parked one holds none); tokens_per_s_tools_running
(tokens decoded per wall second in steps that began with a call running; 0 if none did).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import numpy as np

from rl.rollout.episodes import EpisodeRecord
from rl.rollout.sampler import PartialSample


@dataclasses.dataclass(frozen=True)
class TurnResult:
    """A turn boundary's job done: the slot's sample as read at submission, the
    observation ids to append (None: the episode ended), the job's seconds."""

    smp: PartialSample
    obs: list[int] | None
    seconds: float


@dataclasses.dataclass
class ParkedEpisode:
    """An episode that left its slot while its tool call runs: everything the slot's
    bookkeeping held, the call's future and, once the call returned, its result."""

    record: EpisodeRecord
    episode: Any
    turn_start: int
    began: float
    future: concurrent.futures.Future
    result: TurnResult | None = None


class InlinePool:
    """The pool of max_concurrent_tool_calls = 0: each job runs at once on the calling
    thread (one after another) and returns a finished future."""

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - re-raised by result()
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        return None


COUNTERS = ("wall_s", "slot_s", "decoding_slot_s", "held_slot_s", "tool_wall_s",
            "tool_tokens", "tool_calls", "tool_s", "tool_wait_s")


class SlotClock:
    """The counters behind the engine's stats (module doc), over a window."""

    def __init__(self):
        self.open()

    def open(self) -> None:
        """Start a new window."""
        self.counts = dict.fromkeys(COUNTERS, 0.0)
        self.start = time.perf_counter()

    def add(self, name: str, value: float) -> None:
        self.counts[name] += value

    def step(self, seconds: float, slots: int, decoding_slot_s: float, held: int,
             in_flight: bool, tokens: int) -> None:
        """One engine step of `seconds` wall time over `slots` slots: slot-seconds spent
        decoding, slots holding an unfinished episode, whether a call was running when it
        began, tokens it decoded."""
        c = self.counts
        c["wall_s"] += seconds
        c["slot_s"] += seconds * slots
        c["decoding_slot_s"] += decoding_slot_s
        c["held_slot_s"] += seconds * held
        if in_flight:
            c["tool_wall_s"] += seconds
            c["tool_tokens"] += tokens

    def stats(self, reset: bool = False) -> dict[str, float]:
        """The window's statistics (module doc); reset starts a new window."""
        c, wall = self.counts, time.perf_counter() - self.start
        slot_s = c["slot_s"] or 1.0
        out = {"wall_s": wall, "tool_calls": c["tool_calls"], "tool_s": c["tool_s"],
               "tool_wait_share": c["tool_wait_s"] / wall if wall > 0 else 0.0,
               "tool_calls_in_flight": c["tool_s"] / wall if wall > 0 else 0.0,
               "slot_occupancy": c["decoding_slot_s"] / slot_s,
               "slot_held": c["held_slot_s"] / slot_s,
               "tokens_per_s_tools_running": (c["tool_tokens"] / c["tool_wall_s"]
                                              if c["tool_wall_s"] else 0.0)}
        if reset:
            self.open()
        return out


def grown_sample(smp: PartialSample, obs: list[int], version: int, budget: int) -> PartialSample:
    """`smp` with observation ids `obs` appended (log-prob 0, `version`), live again with
    response budget `budget`: what rl.rollout.sampler.load_samples rebuilds a slot from."""
    k = len(obs)
    return dataclasses.replace(
        smp, response_ids=np.concatenate([smp.response_ids, np.asarray(obs, np.int32)]),
        logprobs=np.concatenate([smp.logprobs, np.zeros((k,), np.float32)]),
        versions=np.concatenate([smp.versions, np.full((k,), version, np.int32)]),
        budget=budget, done=False, stopped=False)
