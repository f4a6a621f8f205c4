"""Tool latency you can set: wrap any environment so every `Episode.step` first waits a
seeded, random time, to emulate a search API, a sandbox or a compiler without a network.

A latency model is a spec string (so a run config stays JSON):

    ""                       no added latency
    "fixed:S"                every step waits S seconds
    "lognormal:P50,P99"      log T ~ Normal(mu, sigma) with median P50 and 99th percentile
                             P99 seconds: mu = ln P50, sigma = (ln P99 - ln P50) / z_0.99,
                             z_0.99 = 2.3263 (the standard normal's 99th percentile);
                             mean = P50 * exp(sigma^2 / 2)

    env = with_latency(make_env("guess_number"), "lognormal:0.5,3", seed=0)

Seeding: the delays of an episode are drawn from numpy's PCG64 seeded by (seed, a CRC32 of
the prompt's token ids, how many episodes of that prompt this wrapper has reset before,
turn number), so one run's delays are the same whatever order its tool calls finish in,
and the samples of a group get different delays. The wait is a `time.sleep` inside
`step`, i.e. exactly where a blocking tool call would block: the rollout engine's
concurrent tool calls (rl.rollout.multiturn, `max_concurrent_tool_calls`) overlap it the
way they overlap a real tool.
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.envs.base import StepResult

KINDS = ("none", "fixed", "lognormal")
Z99 = 2.3263478740408408  # the standard normal's 0.99 quantile


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """kind "none" | "fixed" | "lognormal"; p50 seconds (fixed: the delay); p99 seconds
    (lognormal only, > p50)."""

    kind: str = "none"
    p50: float = 0.0
    p99: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"LatencyModel.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("p50", "p99"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"LatencyModel.{name} must be a finite number of seconds >= 0, "
                                 f"got {v!r}")
        if self.kind == "lognormal" and not 0 < self.p50 < self.p99:
            raise ValueError(f"lognormal latency needs 0 < p50 < p99, got p50={self.p50}, "
                             f"p99={self.p99}")

    @property
    def sigma(self) -> float:
        return (math.log(self.p99) - math.log(self.p50)) / Z99 if self.kind == "lognormal" else 0.0

    @property
    def mean(self) -> float:
        """The expected delay in seconds."""
        if self.kind == "lognormal":
            return self.p50 * math.exp(self.sigma ** 2 / 2)
        return self.p50 if self.kind == "fixed" else 0.0

    def draw(self, rng: np.random.Generator) -> float:
        """One delay in seconds."""
        if self.kind == "lognormal":
            return float(math.exp(math.log(self.p50) + self.sigma * rng.standard_normal()))
        return float(self.p50) if self.kind == "fixed" else 0.0

    @property
    def spec(self) -> str:
        if self.kind == "lognormal":
            return f"lognormal:{self.p50:g},{self.p99:g}"
        return f"fixed:{self.p50:g}" if self.kind == "fixed" else ""


def parse_latency(spec: str | LatencyModel | None) -> LatencyModel:
    """A LatencyModel from its spec string (module doc); ValueError naming the forms."""
    if isinstance(spec, LatencyModel):
        return spec
    if spec is None or not str(spec).strip() or str(spec).strip() == "none":
        return LatencyModel()
    kind, _, rest = str(spec).replace(" ", "").partition(":")
    try:
        values = [float(x) for x in rest.split(",")] if rest else []
    except ValueError:
        values = None
    if kind == "fixed" and values and len(values) == 1:
        return LatencyModel("fixed", values[0])
    if kind == "lognormal" and values and len(values) == 2:
        return LatencyModel("lognormal", values[0], values[1])
    raise ValueError(f"tool latency {spec!r} is not '' (none), 'fixed:SECONDS' or "
                     "'lognormal:P50,P99' (seconds), e.g. 'lognormal:0.5,3'")


class LatencyEpisode:
    """An episode whose every step waits a drawn delay first (module doc)."""

    def __init__(self, inner: Any, model: LatencyModel, rng: np.random.Generator):
        self.inner, self.model, self.rng = inner, model, rng
        self.waited_s = 0.0

    def step(self, turn_text: str) -> StepResult:
        delay = self.model.draw(self.rng)
        self.waited_s += delay
        time.sleep(delay)
        return self.inner.step(turn_text)

    def outcome(self) -> dict[str, float]:
        return self.inner.outcome()


class LatencyEnv:
    """`env` with a latency model on every Episode.step (module doc); everything else is
    env's own (attributes are read through)."""

    def __init__(self, env: Any, model: LatencyModel, seed: int = 0):
        self.env, self.latency, self.seed = env, model, int(seed)
        self._resets: dict[int, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name in ("env", "latency", "seed", "_resets", "_lock"):
            raise AttributeError(name)
        return getattr(self.env, name)

    def reset(self, prompt: Any) -> LatencyEpisode:
        key = zlib.crc32(np.asarray(prompt.ids, np.int64).tobytes())
        with self._lock:
            k = self._resets.get(key, 0)
            self._resets[key] = k + 1
        rng = np.random.default_rng([self.seed, key, k])
        return LatencyEpisode(self.env.reset(prompt), self.latency, rng)

    def decode_turn(self, ids: Sequence[int]) -> str:
        return self.env.decode_turn(ids)

    def encode_observation(self, text: str) -> list[int]:
        return self.env.encode_observation(text)


def with_latency(env: Any, latency: str | LatencyModel | None, seed: int = 0) -> Any:
    """env with the latency model's delays on every step (module doc); env itself when
    the model adds none."""
    model = parse_latency(latency)
    return env if model.kind == "none" else LatencyEnv(env, model, seed)
