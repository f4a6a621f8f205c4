"""APRIL for multi-turn episodes: over-provisioned rounds over one long-lived
`rl.rollout.multiturn.MultiTurnEngine`, unfinished episodes carried to the next round.

APRIL (Active Partial Rollouts, rl.rollout.april) in its own terms: a round that must
return b groups starts at most ⌈γ·b⌉ (γ = over_provision >= 1), returns as soon as b are
complete, and keeps the unfinished ones for later instead of waiting on them (the long
tail) or discarding them. For episodes the carried unit is a whole group of episodes in
the middle of their turns, environment state included, which no array can hold; so the
engine itself is the FIFO:

    round r (params θ_r, version v_r), budget B = ⌈γ·b⌉
      carried  = groups from earlier rounds, still running in the engine or complete in
                 hand (they count against B)
      start    = new prompts, while slots are free and carried + started < B
      step the engine with θ_r until b complete groups are in hand (accept() may reject
      one: it is counted and replaced by one more start)
      return b of them, oldest first; complete groups beyond b wait in hand for round r+1
      (returned first then); unfinished episodes stay in their slots (or parked, or in
      a tool call) and go on under θ_{r+1} at the next round

Every model token keeps the version that sampled it and every observation token the
version of the turn it answers (the engine's stamping), so an episode carried over k
rounds holds tokens of versions v_r .. v_{r+k}: the buffer's admission counts its oldest
token and the off-policy corrections see each token's own version. Unlike single-turn
APRIL, a carried episode's KV is not rebuilt under the new params: its next turns read the
cache the old params wrote (the threaded producer's in-flight update, PipelineRL-style);
the behaviour log-probs are those of the tokens' own versions either way.

Counts (`counts`): submitted (new prompts started), harvested (groups returned), rejected,
lost (carried groups a restore could not bring back), restarted (those started again from
their prompts), resumed (groups carried into a round, running or complete, counted once
per round they were carried into), wasted_tokens (tokens of the lost groups), in_engine,
in_hand (complete, carried) and to_restart (lost groups not started again yet). Every
start ends in exactly one place; between rounds:
    submitted + restarted == harvested + rejected + lost + in_engine + in_hand
and every lost group is started again, before any new prompt: no prompt is skipped and
none is trained twice.

Checkpoints. `state_dict()` (between rounds) holds the counters and the global ids of the
carried groups, never the episodes (their environments are live objects). A run resumed
from it starts those groups again from their prompts (fresh episodes, new sampling
streams), first, then new prompts: their earlier tokens are counted in wasted_tokens (as
far as the saved state knew them) and never trained. Determinism: with
max_concurrent_tool_calls = 0 (calls inline) a round's cut depends only on the tokens, so
rounds repeat exactly; with concurrent calls which groups complete first depends on how
long the tools take.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from rl.rollout.april import AprilConfig
from rl.rollout.episodes import EpisodeRecord
from rl.rollout.multiturn import MultiTurnEngine
from rl.trajectory import Trajectory, concat_trajectories

Accept = Callable[[Trajectory], bool]
_COUNTERS = ("submitted", "harvested", "rejected", "lost", "restarted", "resumed",
             "wasted_tokens")


def split_episode_groups(traj: Trajectory, records: tuple[EpisodeRecord, ...], n: int
                         ) -> list[tuple[Trajectory, tuple[EpisodeRecord, ...]]]:
    """A harvested episode batch (groups as contiguous blocks of n rows) -> (one-group
    Trajectory, its records) per group."""
    host = jax.tree.map(np.asarray, traj)
    return [(jax.tree.map(lambda x, i=i: x[i * n:(i + 1) * n], host), records[i * n:(i + 1) * n])
            for i in range(traj.batch_size // n)]


class EpisodeAprilRollout:
    """APRIL rounds of episodes (module doc).

    ro = EpisodeAprilRollout(lambda seed: episode_engine(...), prompts, AprilConfig(),
                             group_size=8, seed=0)
    traj, records = ro.collect(params, version, num_groups)   # one round
    prompt_of: global group id -> its Prompt (the carried groups restarted after a restore).
    """

    strategy = "april_episodes"

    def __init__(self, make_engine: Callable[[int], MultiTurnEngine], prompts: Iterable[Any],
                 april: AprilConfig, *, group_size: int, seed: int,
                 prompt_of: Callable[[int], Any] | None = None):
        if not isinstance(april, AprilConfig):
            raise ValueError(f"april must be an AprilConfig, got {type(april).__name__}")
        self.april, self.group_size, self.seed = april, int(group_size), int(seed)
        self._make_engine, self._prompt_of = make_engine, prompt_of
        self._prompts: Iterator[Any] = iter(prompts)
        self.engine = make_engine(self.seed)
        self._ids: dict[int, int] = {}  # engine group id -> global group id
        self._restart: list[int] = []  # global ids to start again first (after a restore)
        self._hand: list[tuple[Trajectory, tuple[EpisodeRecord, ...]]] = []  # complete, carried
        self._next_id = 0
        self._restores = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self.round_version: int | None = None
        self.last_round: dict[str, float] = {}
        self.last_rejected: list[Trajectory] = []

    # ------------------------------------------------------------------ counts
    @property
    def in_engine(self) -> int:
        return self.engine.num_active_groups + self.engine.num_queued

    @property
    def counts(self) -> dict[str, int]:
        """The counters (module doc) with in_engine and in_hand."""
        return {**self._counts, "in_engine": self.in_engine, "in_hand": len(self._hand),
                "to_restart": len(self._restart)}

    def carried_ids(self) -> list[int]:
        """Global ids of the groups carried to the next round (in the engine or in hand),
        sorted."""
        return sorted(list(self._ids.values()) + [int(np.asarray(t.group_ids)[0])
                                                  for t, _ in self._hand])

    # ------------------------------------------------------------------ the round
    def _feed(self, limit: int) -> int:
        """Queue groups (restarts first, then new prompts) while a whole group fits in the
        free slots, at most `limit`. Returns how many."""
        room = self.engine.num_free_slots // self.group_size - self.engine.num_queued
        started = 0
        while room > 0 and started < limit:
            if self._restart:
                gid = self._restart.pop(0)
                prompt = self._prompt_of(gid)
                self._counts["restarted"] += 1
            else:
                try:
                    prompt = next(self._prompts)
                except StopIteration:
                    break
                gid, self._next_id = self._next_id, self._next_id + 1
                self._counts["submitted"] += 1
            (eid,) = self.engine.submit([prompt])
            self._ids[eid] = gid
            room, started = room - 1, started + 1
        return started

    def _take(self, part: Any) -> list[tuple[Trajectory, tuple[EpisodeRecord, ...]]]:
        """The harvested EpisodeBatch as one-group parts with global group ids."""
        out = []
        for traj, recs in split_episode_groups(part.trajectory, part.episodes, self.group_size):
            gid = self._ids.pop(int(np.asarray(traj.group_ids)[0]))
            out.append((traj.replace(group_ids=np.full_like(traj.group_ids, gid)), recs))
        return out

    def collect(self, params: Any, version: int, num_groups: int, accept: Accept | None = None
                ) -> tuple[Trajectory, tuple[EpisodeRecord, ...]]:
        """One round under `params` (stamped `version`): `num_groups` complete groups as one
        Trajectory (rows grouped, oldest group first) and their episode records. Fewer
        come back only when the prompt source runs dry (a ValueError if none)."""
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) \
                or num_groups < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        num_groups, version, t0 = int(num_groups), int(version), time.perf_counter()
        max_rej = 4 * num_groups if self.april.max_rejected is None else self.april.max_rejected
        budget = math.ceil(self.april.over_provision * num_groups - 1e-9)
        carried = self.in_engine + len(self._hand)  # they count against the budget
        self._counts["resumed"] += carried
        self.round_version, self.last_rejected = version, []
        kept, self._hand = self._hand, []
        started = steps = generated = 0
        while len(kept) < num_groups:
            started += self._feed(max(budget + len(self.last_rejected) - carried - started, 0))
            if self.in_engine == 0:
                break  # nothing running and nothing more may or can start
            generated += self.engine.step(params, version).decoded_tokens
            steps += 1
            part = self.engine.harvest()
            for group in ([] if part is None else self._take(part)):
                if accept is None or bool(accept(group[0])):
                    kept.append(group)
                    continue
                self.last_rejected.append(group[0])
                self._counts["rejected"] += 1
                if len(self.last_rejected) > max_rej:
                    self._hand = kept
                    raise ValueError(
                        f"accept rejected {len(self.last_rejected)} groups in one round (more "
                        f"than max_rejected={max_rej}); the accepted ones are kept for the next "
                        "round. Raise max_rejected or loosen the filter")
        kept.sort(key=lambda g: int(np.asarray(g[0].group_ids)[0]))
        out, self._hand = kept[:num_groups], kept[num_groups:]
        if not out:
            raise ValueError("the prompt source is exhausted: no complete group to return")
        self._counts["harvested"] += len(out)
        traj = concat_trajectories([t for t, _ in out])
        records = tuple(r for _, recs in out for r in recs)
        mask, ver = np.asarray(traj.response_mask), np.asarray(traj.versions)
        self.last_round = {
            "seconds": time.perf_counter() - t0, "steps": steps, "generated_tokens": generated,
            "trained_tokens": int(mask.sum()),
            "offpolicy_tokens": int((mask & (ver < version)).sum()),
            "started": started, "resumed": carried, "rejected": len(self.last_rejected),
            "carried": self.in_engine + len(self._hand)}
        return traj, records

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Counters, the next global id and the carried groups' ids (numpy; module doc)."""
        return {"strategy": np.asarray(self.strategy),
                "counts": {k: np.asarray(v, np.int64) for k, v in self._counts.items()},
                "next_group_id": np.asarray(self._next_id, np.int64),
                "restores": np.asarray(self._restores, np.int64),
                "carried": np.asarray(self.carried_ids(), np.int64),
                "to_restart": np.asarray(self._restart, np.int64),
                "carried_tokens": np.asarray(self._carried_tokens(), np.int64)}

    def _carried_tokens(self) -> int:
        in_hand = sum(int(np.asarray(t.response_mask).sum()) for t, _ in self._hand)
        return in_hand + self.engine.tokens_in_flight

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore the counters; the carried groups are started again from their prompts
        (first, with their global ids) under a fresh engine seeded from the restore count."""
        if self.in_engine or self._hand:
            raise ValueError("load_state_dict: groups are in the engine; load before any round")
        if self._prompt_of is None:
            raise ValueError("load_state_dict needs prompt_of (global group id -> prompt) to "
                             "restart the carried groups")
        try:
            strategy = str(np.asarray(d["strategy"]))
            counts = {k: int(np.asarray(d["counts"][k])) for k in _COUNTERS}
            carried = [int(x) for x in np.asarray(d["carried"]).reshape(-1)]
            pending = [int(x) for x in np.asarray(d["to_restart"]).reshape(-1)]
            next_id, restores = int(np.asarray(d["next_group_id"])), int(np.asarray(d["restores"]))
            wasted = int(np.asarray(d["carried_tokens"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"load_state_dict: not a {self.strategy} state dict ({e!r})") from None
        if strategy != self.strategy:
            raise ValueError(f"load_state_dict: state of a {strategy!r} rollout, this is "
                             f"{self.strategy!r}")
        self._restores = restores + 1
        self.engine.close()
        seed = int(np.random.SeedSequence([self.seed, self._restores]).generate_state(1)[0] >> 1)
        self.engine = self._make_engine(seed)
        counts["wasted_tokens"] += wasted
        counts["lost"] += len(carried)
        restart = sorted(pending + carried)  # oldest first
        self._counts, self._next_id, self._restart, self._ids = counts, next_id, restart, {}

    def close(self) -> None:
        self.engine.close()
