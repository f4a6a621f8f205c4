"""The asynchronous sources' rollout side: `RolloutProducer` (the threaded producer's
work: admit prompts under the buffer's rule, sample with the latest published params
segment by segment, score, put finished groups) and `AprilSource` (APRIL rounds over a
task's train stream), plus the small helpers that cut a harvested trajectory into scored
groups and APRIL's off-policy prefix mask. Every engine here is built from the run's
rollout spec (rl.loops.rollouts.RolloutSpec).
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable

import jax
import numpy as np

from rl.learner.batch import TrainBatch
from rl.learner.config import TrainConfig
from rl.loops.buffer import ScoredGroup, TrajectoryBuffer
from rl.loops.rollouts import RolloutSpec, rollout_seed, take_rows
from rl.loops.scoring import score, total_reward
from rl.objectives.offpolicy import kept_group_indices
from rl.rollout.april import AprilConfig, AprilRollout, offpolicy_prefix_mask
from rl.rollout.april_episodes import EpisodeAprilRollout
from rl.loops import episodes
from rl.rollout.engine import RolloutEngine
from rl.rollout.episodes import EpisodeBatch
from rl.rollout.multiturn import MultiTurnEngine


# ----------------------------------------------------------------------------- producer
def split_groups(traj, rewards: dict[str, np.ndarray], group_size: int) -> list[tuple[int, ScoredGroup]]:
    """(engine group id, ScoredGroup) per group of a harvested Trajectory (rows grouped)."""
    gids = np.asarray(traj.group_ids)
    out = []
    for start in range(0, gids.size, group_size):
        rows = list(range(start, start + group_size))
        out.append((int(gids[start]), ScoredGroup(traj=take_rows(traj, rows),
                                                  rewards={k: v[rows] for k, v in rewards.items()})))
    return out


def round_engine(spec: RolloutSpec, slots: int, seed: int) -> RolloutEngine | MultiTurnEngine:
    """A fresh engine of `slots` slots seeded `seed` (an environment's: the multi-turn one)."""
    if episodes.is_episodic(spec.task):
        return episodes.episode_engine(spec, slots, seed)
    return RolloutEngine(spec.sampler_config, spec.engine(slots, seed))


def submit_prompts(engine: RolloutEngine | MultiTurnEngine, task: Any, prompts: list
                   ) -> dict[int, Any]:
    """Queue prompts in the engine (ids, or Prompt objects for episodes); {group id: prompt}
    for scoring."""
    form = prompts if episodes.is_episodic(task) else [p.ids for p in prompts]
    return dict(zip(engine.submit(form), prompts))


def segment_groups(engine: RolloutEngine | MultiTurnEngine, task: Any, pending: dict,
                   params: Any, version: int, group_size: int
                   ) -> tuple[list[tuple[int, ScoredGroup]], int]:
    """One segment with (params, version): the groups it finished, scored (their prompts
    popped from `pending`), and the tokens it harvested; an environment's episode records
    and engine stats go to the task's metrics."""
    engine.step(params, version)
    part = engine.harvest()
    if part is None:
        return [], 0
    if isinstance(part, EpisodeBatch):
        task.record(part.episodes, part.trajectory)
        task.record_engine(engine.stats(reset=True))
        part = part.trajectory
    rewards = score(task, pending, part)
    for g in np.unique(np.asarray(part.group_ids)):
        pending.pop(int(g), None)
    return split_groups(part, rewards, group_size), part.num_tokens()


def retire_engine(engine: RolloutEngine | MultiTurnEngine | None, task: Any) -> None:
    """Close an episode engine's tool pool, its last stats to the task's metrics."""
    if isinstance(engine, MultiTurnEngine):
        engine.close()
        task.record_engine(engine.stats(reset=True))


def sample_round(spec: RolloutSpec, slots: int, seed: int, prompts: list,
                 latest: Callable[[], tuple[Any, int]],
                 stopping: Callable[[], bool] = lambda: False) -> tuple[list[ScoredGroup], int]:
    """One round of len(prompts) groups on a fresh engine (`slots` slots, `seed`), segment
    by segment with the (params, version) latest() gives at each segment boundary: the
    in-flight weight updates of the threaded producer and of Ray workers (a token carries
    the version it was drawn under). Returns (the finished groups in prompt order, tokens
    sampled); stops early, with the groups finished so far, once stopping() is true."""
    engine = round_engine(spec, slots, seed)
    done: list[tuple[int, ScoredGroup]] = []
    tokens = 0
    try:
        pending = submit_prompts(engine, spec.task, prompts)
        while not engine.idle and not stopping():
            params, version = latest()
            got, n = segment_groups(engine, spec.task, pending, params, version,
                                    spec.group_size)
            done += got
            tokens += n
    finally:
        retire_engine(engine, spec.task)
    return [g for _, g in sorted(done, key=lambda x: x[0])], tokens


class AprilSource:
    """APRIL rounds over the task's train stream from `base`: rl.rollout.april.AprilRollout,
    or for an environment's episodes rl.rollout.april_episodes.EpisodeAprilRollout; the
    group with global id g is the prompt at stream position base + g. spec: the run's
    train rollouts; config: the TrainConfig (reward weights); loop: the LoopConfig (groups
    per step, dynamic sampling)."""

    def __init__(self, spec: RolloutSpec, config: TrainConfig, loop: Any, april: AprilConfig, *,
                 base: int, seed: int, saved: dict | None = None):
        self.task, self.config, self.loop, self.base = spec.task, config, loop, int(base)
        slots = math.ceil(april.over_provision * loop.prompts_per_step - 1e-9) * spec.group_size
        submitted = 0 if saved is None else int(saved["counts"]["submitted"])
        stream = self._prompts(self.base + submitted)
        self.episodic = episodes.is_episodic(self.task)
        if self.episodic:
            self.rollout = EpisodeAprilRollout(
                lambda s: episodes.episode_engine(spec, slots, s), stream, april,
                group_size=spec.group_size, seed=seed,
                prompt_of=lambda g: self.task.train_prompts(self.base + g, 1)[0])
        else:
            self.rollout = AprilRollout(spec.sampler_config, spec.engine(slots, seed),
                                        (p.ids for p in stream), april)
        if saved is not None:
            self.rollout.load_state_dict(saved)
        self.counts = dict(self.rollout.counts)  # as of the last finished round

    def _prompts(self, start: int):
        chunk = max(self.loop.prompts_per_step, 8)
        while True:
            yield from self.task.train_prompts(start, chunk)
            start += chunk

    def _prompt_map(self, traj) -> dict[int, Any]:
        return {int(g): self.task.train_prompts(self.base + int(g), 1)[0]
                for g in np.unique(np.asarray(traj.group_ids))}

    def _accept(self, group) -> bool:
        rewards = score(self.task, self._prompt_map(group), group)
        return kept_group_indices(total_reward(rewards, self.config),
                                  self.loop.group_size).size > 0

    def round(self, params: Any, version: int, n: int) -> list[ScoredGroup]:
        """n finished groups sampled under (params, version), scored, in group order
        (episodes: their records and engine stats go to the task's metrics)."""
        accept = self._accept if self.loop.dynamic_sampling else None
        traj = self.rollout.collect(params, int(version), n, accept=accept)
        # read by the learner thread while the next round runs: a round's groups held
        # between the engine and the hand would be counted nowhere mid-round
        self.counts = dict(self.rollout.counts)
        if self.episodic:
            traj, records = traj
            self.task.record(records, traj)
            self.task.record_engine(self.rollout.engine.stats(reset=True))
        rewards = score(self.task, self._prompt_map(traj), traj)
        return [g for _, g in split_groups(traj, rewards, self.loop.group_size)]

    def close(self) -> None:
        """Stop an episode engine's tool pool (calls still running finish unread)."""
        if self.episodic:
            self.rollout.close()

    @property
    def position(self) -> int:
        return self.base + self.rollout.counts["submitted"]

    @property
    def generated_tokens(self) -> int:
        return int(self.rollout.last_round.get("generated_tokens", 0))

    def state(self) -> dict:
        """Between rounds: {"base", "april": AprilRollout.state_dict()} (numpy)."""
        return {"base": np.asarray(self.base, np.int64), "april": self.rollout.state_dict()}

    def metrics(self) -> dict[str, float]:
        """The rollout's counters as of the last finished round (they balance there)."""
        return {f"april_{k}": float(v) for k, v in self.counts.items()}


def offpolicy_prefix_batch(batch: TrainBatch, group_size: int) -> TrainBatch:
    """APRIL's optional mask: per group, drop from the loss the tokens drawn under a
    version older than the group's newest token (the part sampled before its last resume)."""
    mask, vers = np.asarray(batch.loss_mask), np.asarray(batch.versions)
    out = mask.copy()
    for start in range(0, mask.shape[0], group_size):
        rows = slice(start, start + group_size)
        if mask[rows].any():
            out[rows] = offpolicy_prefix_mask(vers[rows], mask[rows], int(vers[rows][mask[rows]].max()))
    return batch.replace(loss_mask=out)


class RolloutProducer:
    """The rollout thread's work: admit prompts under the buffer's rule, sample with the
    latest published params segment by segment, score, put finished groups. spec: the run's
    train rollouts; config / loop: the TrainConfig and LoopConfig (AprilSource's); rollout:
    "static" | "continuous" | "april"; latest() -> (sampler params, version) last published;
    start: (data position, rng key [2] uint32) to continue from; device: where the sampler
    runs (None: the default device)."""

    def __init__(self, spec: RolloutSpec, config: TrainConfig, loop: Any, *, rollout: str,
                 buffer: TrajectoryBuffer, latest: Callable[[], tuple[Any, int]],
                 start: tuple[int, np.ndarray], device: jax.Device | None,
                 april: AprilSource | None = None):
        data_position, rng = start
        self.spec, self.task, self.config, self.loop = spec, spec.task, config, loop
        self.april = april
        # APRIL: (state between rounds, data position) of the last round, for checkpoints
        self.april_snapshot = None if april is None else (april.state(), april.position)
        self.rollout, self.buffer, self.latest, self.device = rollout, buffer, latest, device
        self._lock = threading.Lock()
        self._pos, self._rng = int(data_position), np.asarray(rng, np.uint32)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.sampled_tokens = 0
        self.filtered_in_a_row = 0
        self._engine: RolloutEngine | MultiTurnEngine | None = None
        self._prompts: dict[int, Any] = {}

    # -------------------------------------------------------------- shared state
    def position(self) -> tuple[int, np.ndarray]:
        """(data position of the next prompt, rng key) — consistent with each other
        (APRIL: the position at the end of the last round)."""
        with self._lock:
            pos = self._pos if self.april is None else self.april_snapshot[1]
            return pos, self._rng.copy()

    def _april_round(self) -> None:
        n = self._admit(self.loop.prompts_per_step, block=True)
        if n == 0:
            return
        params, version = self.latest()
        groups = self.april.round(params, version, n)
        self.sampled_tokens += self.april.generated_tokens
        with self._lock:
            self.april_snapshot = (self.april.state(), self.april.position)
        for g in groups:
            self.buffer.put(g)

    def _take_prompts(self, n: int) -> tuple[int, list]:
        """Seed + the next n train prompts; advances position and rng together."""
        with self._lock:
            seed, key = rollout_seed(self._rng)
            prompts = self.task.train_prompts(self._pos, n)
            self._pos += n
            self._rng = np.asarray(key, np.uint32)
        return seed, prompts

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set() or self.buffer.closed

    # -------------------------------------------------------------- pieces
    def _engine_for(self, seed: int) -> RolloutEngine | MultiTurnEngine:
        """A fresh engine for b groups; the last one's tool pool is closed and its stats
        kept for the metrics."""
        self._retire_engine()
        return round_engine(self.spec, self.loop.prompts_per_step * self.spec.group_size, seed)

    def _retire_engine(self) -> None:
        retire_engine(self._engine, self.task)
        self._engine = None

    def _submit(self, prompts: list) -> None:
        self._prompts.update(submit_prompts(self._engine, self.task, prompts))

    def _admit(self, most: int, block: bool) -> int:
        """Reserve up to `most` groups (blocking until at least one fits if `block`)."""
        while most > 0:
            n = min(most, self.buffer.capacity())
            if n > 0 and self.buffer.reserve(n):
                return n
            if not block or self.stopping:
                return 0
            self.buffer.wait_for_capacity(1, timeout=0.1)
        return 0

    def _segment(self) -> list[tuple[int, ScoredGroup]]:
        """One segment with the latest params; the finished groups, scored."""
        params, version = self.latest()
        groups, tokens = segment_groups(self._engine, self.task, self._prompts, params,
                                        version, self.loop.group_size)
        self.sampled_tokens += tokens
        return groups

    def _offer(self, group: ScoredGroup) -> None:
        """Put a group, or (dynamic sampling, all rewards equal) release it as filtered."""
        if self.loop.dynamic_sampling:
            total = total_reward(dict(group.rewards), self.config)
            if kept_group_indices(total, self.loop.group_size).size == 0:
                self.buffer.release(1, "filtered")
                self.filtered_in_a_row += 1
                limit = (self.loop.max_resample_rounds + 1) * self.loop.prompts_per_step
                if self.filtered_in_a_row >= limit:
                    raise ValueError(
                        f"empty batch after dynamic sampling: {self.filtered_in_a_row} groups in a "
                        "row had equal rewards within their group (no learning signal); raise "
                        "max_resample_rounds, the group size or the temperature, or turn dynamic "
                        "sampling off")
                return
        self.filtered_in_a_row = 0
        self.buffer.put(group)

    def _static_round(self) -> None:
        n = self._admit(self.loop.prompts_per_step, block=True)
        if n == 0:
            return
        seed, prompts = self._take_prompts(n)
        self._retire_engine()
        groups, tokens = sample_round(self.spec, self.loop.prompts_per_step * self.spec.group_size,
                                      seed, prompts, self.latest, lambda: self.stopping)
        self.sampled_tokens += tokens
        for group in groups:  # prompt order, as the sync loop
            self._offer(group)

    def _continuous_step(self) -> None:
        n_slots = self.loop.prompts_per_step
        if self._engine is None or self._engine.idle:
            n = self._admit(n_slots, block=True)
            if n == 0:
                return
            seed, prompts = self._take_prompts(n)
            self._engine, self._prompts = self._engine_for(seed), {}
            self._submit(prompts)
        else:  # refill free slots while the admission rule allows
            free = self._engine.num_free_slots // self.loop.group_size - self._engine.num_queued
            n = self._admit(free, block=False) if free > 0 else 0
            if n:
                with self._lock:
                    prompts = self.task.train_prompts(self._pos, n)
                    self._pos += n
                self._submit(prompts)
        for _, group in self._segment():
            self._offer(group)

    # -------------------------------------------------------------- thread body
    def run(self) -> None:
        try:
            place = (jax.default_device(self.device) if self.device is not None
                     else contextlib.nullcontext())
            with place:
                while not self.stopping:
                    if self.rollout == "static":
                        self._static_round()
                    elif self.rollout == "april":
                        self._april_round()
                    else:
                        self._continuous_step()
        except BaseException as err:  # handed to the learner, which re-raises it
            self.error = err
            self.buffer.close()
        finally:
            self._retire_engine()
            running = self.buffer.stats()["running_groups"]
            if running:
                self.buffer.release(running, "cancelled")


