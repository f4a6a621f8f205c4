"""The multi-turn engine's configuration (rl.rollout.multiturn): `MultiTurnConfig` (slots,
group size, segment length, sampling, KV layout, how observations enter the cache, time
limits, concurrent tool calls, parking), `TimeLimits` and what one `step` reports,
`MultiTurnStepInfo`. Validated on construction, with messages that say what to change.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from rl.rollout.sampler_state import KV_LAYOUTS, SamplingConfig

MODES = ("append", "reprefill")


@dataclasses.dataclass(frozen=True)
class TimeLimits:
    """step_s: seconds each call into the environment may take; episode_s: wall seconds
    of one episode (0 = no limit; module doc)."""

    step_s: float = 0.0
    episode_s: float = 0.0

    def __post_init__(self):
        for name in ("step_s", "episode_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"TimeLimits.{name} must be a finite number of seconds >= 0 "
                                 f"(0 = no limit), got {v!r}")


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """num_slots episodes decode in parallel (rounded down to a multiple of group_size);
    group_size N episodes per prompt; segment_len S tokens per step; kv_layout
    "segmented" | "replicated"; mode "append" | "reprefill" (see the module doc);
    time_limits: the step / episode time limits (TimeLimits). The token limits (stop ids,
    turns, turn / prompt / episode tokens) come from the environment; max_prompt_len
    (None: the environment's) widens the prompt buffer for groups submitted with an
    EpisodeStart, whose prompt holds an earlier episode's prefix."""

    num_slots: int
    group_size: int
    segment_len: int
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    attn_impl: str | None = None
    kv_layout: str = "segmented"
    mode: str = "append"
    first_group_id: int = 0
    time_limits: TimeLimits = TimeLimits()
    max_concurrent_tool_calls: int = 0
    park_after_s: float | None = None
    max_prompt_len: int | None = None

    def __post_init__(self):
        for name in ("num_slots", "group_size", "segment_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MultiTurnConfig.{name} must be an int >= 1, got {v!r}")
        if self.num_slots < self.group_size:
            raise ValueError(f"MultiTurnConfig.num_slots={self.num_slots} cannot hold one group "
                             f"of group_size={self.group_size}; use num_slots >= group_size")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"MultiTurnConfig.kv_layout must be one of {KV_LAYOUTS}, got "
                             f"{self.kv_layout!r}")
        if self.mode not in MODES:
            raise ValueError(f"MultiTurnConfig.mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.first_group_id, bool) or not isinstance(self.first_group_id, int) \
                or self.first_group_id < 0:
            raise ValueError(f"MultiTurnConfig.first_group_id must be an int >= 0, got "
                             f"{self.first_group_id!r}")
        m = self.max_concurrent_tool_calls
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"MultiTurnConfig.max_concurrent_tool_calls must be an int >= 0 "
                             f"(0 = one after another on this thread), got {m!r}")
        pk = self.park_after_s
        if pk is not None:
            if isinstance(pk, bool) or not isinstance(pk, (int, float)) or not 0 <= pk < math.inf:
                raise ValueError(f"MultiTurnConfig.park_after_s must be None (never park) or a "
                                 f"finite number of seconds >= 0, got {pk!r}")
            if self.kv_layout != "replicated" or self.max_concurrent_tool_calls < 1:
                raise ValueError("MultiTurnConfig.park_after_s (parking a slot whose episode "
                                 "waits on a tool) needs kv_layout='replicated' (a segmented "
                                 "slot shares its group's prompt block) and "
                                 "max_concurrent_tool_calls >= 1")
        if not isinstance(self.time_limits, TimeLimits):
            raise ValueError(f"MultiTurnConfig.time_limits must be a TimeLimits, got "
                             f"{type(self.time_limits).__name__}")
        mp = self.max_prompt_len
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 1):
            raise ValueError(f"MultiTurnConfig.max_prompt_len must be None (the environment's) "
                             f"or an int >= 1, got {mp!r}")


@dataclasses.dataclass(frozen=True)
class EpisodeStart:
    """Where a submitted group's episodes begin when not at a fresh reset: the prompt it is
    submitted with already holds `turns` model turns and their observations (a prefix of
    an earlier episode: rl.rollout.trace), and `reset()` returns a new Episode in the state
    after them (called once per sample, guarded like Environment.reset). Its episodes
    count those turns against max_turns; their rows' responses hold what follows."""

    turns: int
    reset: Callable[[], Any]

    def __post_init__(self):
        if isinstance(self.turns, bool) or not isinstance(self.turns, int) or self.turns < 0:
            raise ValueError(f"EpisodeStart.turns must be an int >= 0, got {self.turns!r}")
        if not callable(self.reset):
            raise ValueError("EpisodeStart.reset must be callable (no arguments -> Episode)")


@dataclasses.dataclass(frozen=True)
class MultiTurnStepInfo:
    """What one `step` did: tokens decoded / appended / (re)prefilled, groups started,
    turns that ended, episodes that ended, slots still live."""

    decoded_tokens: int
    appended_tokens: int
    prefill_tokens: int
    started_groups: int
    turns_ended: int
    episodes_ended: int
    live_slots: int
