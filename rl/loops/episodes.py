"""Environments in the training loops: an `rl.envs.Environment` run the way a task is.

`EnvTask(env)` shows an environment to the loops as an `rl.tasks.Task` whose rollouts are
multi-turn episodes: the loops' few hooks (rl.loops.rollouts.sample_groups / score /
build_batch, the step metrics and the eval record) hand such a task to this module:

    sample_episodes    prompts -> episodes through rl.rollout.multiturn.MultiTurnEngine (a
                       group of `group_size` episodes per prompt, rng keys by global group
                       id like rl.loops.rollouts.sample_groups), rows in prompt order;
                       sample_episode_groups the same with the rows' records returned
                       (and groups that continue earlier episodes: TRACE)
    episode_rewards    the episodes' outcomes (Trajectory.rewards) as the task rewards
    turn_credit_of     the TurnCreditConfig batch_from_trajectory applies (None for a task)
    take_episode_metrics   the metrics of the episodes sampled since the last call:
                       episode_turns (model turns per episode), episode_end_<reason> (the
                       fraction that ended for each rl.envs.EndReason), episode_turn_reward
                       (mean per-turn reward), episode_obs_tokens / episode_model_tokens
                       (per episode), episode_tool_calls (per episode, when the turns'
                       info has "tool_calls")

Shapes: an episode's Trajectory row holds the prompt ([max_prompt_len]) and a response
of max_episode_tokens − 1 tokens (turns and observations, env_mask on observations), so
the learner's rows are max_prompt_len + max_episode_tokens − 1 wide (`EnvTask.
max_new_tokens` = max_episode_tokens − 1): one compiled step.

Environments by task spec (`make_env_task`): "env:" + an rl.envs.make_env spec, e.g.
"env:guess_number" (token-level, for the tiny model), "env:calculator" (needs a
tokenizer) or your own factory "env:my_module:make". Every source runs them: the
synchronous loop and the deterministic source through `sample_episodes`, the threaded
producer through `episode_engine` (static or continuous rollouts), APRIL rounds (either
mode) through rl.rollout.april_episodes over one long-lived `episode_engine`.
`episode_engine` applies the run's concurrent tool calls and
emulated tool latency (rl.rollout.multiturn, rl.envs.latency); the engine's slot and tool
metrics (`engine_metrics`: tool_wait_share, tool_calls_in_flight, slot_occupancy,
slot_held, tokens_per_s_tools_running) join the episode metrics.

Metrics are collected per EnvTask under a lock and drained by the caller: the sync loop
drains them after sampling a batch and the evaluator after each eval pass, so each record
holds its own episodes.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rl.envs import env_factory, factory_fields, make_env, parse_env_spec
from rl.envs.base import EndReason, Environment, check_environment
from rl.envs.latency import with_latency
from rl.objectives.turn_credit import TurnCreditConfig
from rl.rollout.episodes import EpisodeRecord
from rl.rollout.multiturn import MODES, EpisodeStart, MultiTurnConfig, MultiTurnEngine
from rl.rollout.sampler_state import KV_LAYOUTS
from rl.runtime.logging import NULL_PROFILE
from rl.runtime.preemption import abandon_point
from rl.tasks.base import Prompt
from rl.trajectory import Trajectory, concat_trajectories

ENV_PREFIX = "env:"  # a task spec "env:NAME[:k=v,...]" names an environment (rl.envs.make_env)


@dataclasses.dataclass(frozen=True)
class EpisodeOptions:
    """How the loops run an environment: turn_credit (rl.objectives.turn_credit; default
    outcome only = GRPO), kv_layout / mode of the multi-turn engine ("segmented" |
    "replicated"; "append" | "reprefill", its exact slow twin)."""

    turn_credit: TurnCreditConfig = TurnCreditConfig()
    kv_layout: str = "segmented"
    mode: str = "append"

    def __post_init__(self):
        if not isinstance(self.turn_credit, TurnCreditConfig):
            raise ValueError(f"EpisodeOptions.turn_credit must be a TurnCreditConfig, got "
                             f"{type(self.turn_credit).__name__}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"EpisodeOptions.kv_layout must be one of {KV_LAYOUTS}, got "
                             f"{self.kv_layout!r}")
        if self.mode not in MODES:
            raise ValueError(f"EpisodeOptions.mode must be one of {MODES}, got {self.mode!r}")


def is_env_spec(spec: Any) -> bool:
    """True for a task spec naming an environment ("env:NAME")."""
    return isinstance(spec, str) and spec.startswith(ENV_PREFIX)


def make_env_task(spec: str, *, tokenizer: Any = None, seed: int = 0,
                  options: EpisodeOptions = EpisodeOptions(), **env_options: Any) -> "EnvTask":
    """EnvTask of rl.envs.make_env(spec without "env:", **env_options), the tokenizer and
    seed passed when the environment's class has those fields."""
    name = spec[len(ENV_PREFIX):] if is_env_spec(spec) else spec
    fields = env_fields(parse_env_spec(name)[0])
    kw = dict(env_options)
    if fields is None or "seed" in fields:
        kw.setdefault("seed", int(seed))
    if (fields is None or "tokenizer" in fields) and tokenizer is not None:
        kw.setdefault("tokenizer", tokenizer)
    return EnvTask(make_env(name, **kw), options)


def env_fields(name: str) -> set[str] | None:
    """The keyword arguments environment `name` (registered, or 'module:factory') takes;
    None when its factory takes any (**kwargs)."""
    return factory_fields(env_factory(name))


class EnvTask:
    """An Environment as the loops' Task: prompts, reward names and the token budgets
    (max_new_tokens = max_episode_tokens − 1: a response holds every turn and
    observation), sampled by `sample_episodes` and scored by the episodes' outcomes."""

    episodic = True

    def __init__(self, env: Environment, options: EpisodeOptions = EpisodeOptions()):
        check_environment(env)
        if not isinstance(options, EpisodeOptions):
            raise ValueError(f"options must be an EpisodeOptions, got {type(options).__name__}")
        if int(env.max_episode_tokens) <= int(env.max_prompt_len):
            raise ValueError(f"environment {env.name!r}: max_episode_tokens="
                             f"{env.max_episode_tokens} leaves no room after max_prompt_len="
                             f"{env.max_prompt_len}")
        self.env, self.options = env, options
        self.name = f"{ENV_PREFIX}{env.name}"
        self.reward_names = tuple(env.reward_names)
        self.stop_ids = tuple(env.stop_ids)
        self.max_prompt_len = int(env.max_prompt_len)
        self.max_new_tokens = int(env.max_episode_tokens) - 1
        for attr in ("vocab_size", "tokenizer"):
            if hasattr(env, attr):
                setattr(self, attr, getattr(env, attr))
        self._lock = threading.Lock()
        self._records: list[tuple[EpisodeRecord, int, int]] = []  # (record, obs, model tokens)
        self._engine_stats: list[dict[str, float]] = []  # MultiTurnEngine.stats() per rollout

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        return self.env.train_prompts(start, count)

    def with_own_records(self) -> "EnvTask":
        """The same environment and options with record sinks of its own: what the copy
        samples is drained apart from what this task samples (the evaluator's episodes
        never mix with a producer thread's train episodes)."""
        view = copy.copy(self)
        view._lock = threading.Lock()
        view._records, view._engine_stats = [], []
        return view

    def eval_prompts(self, count: int) -> list[Prompt]:
        return self.env.eval_prompts(count)

    def reward(self, prompt: Prompt, response: Sequence[int]) -> dict[str, float]:
        raise ValueError(f"{self.name}: an episode is scored by its environment "
                         "(rl.loops.episodes.episode_rewards), not from response ids")

    def describe(self, prompt: Prompt, response: Sequence[int]) -> str:
        text = self.env.decode_turn(list(response))
        describe = getattr(self.env, "describe", None)
        return describe(prompt, [text]) if describe is not None else text

    def random_baseline(self) -> float | None:
        fn = getattr(self.env, "random_baseline", None)
        return None if fn is None else fn()

    def record(self, records: Sequence[EpisodeRecord], traj: Trajectory) -> None:
        """Keep the episodes (row b = records[b]) for take_episode_metrics."""
        env, resp = np.asarray(traj.env_mask), np.asarray(traj.response_mask)
        rows = [(rec, int(env[b].sum()), int((resp[b] & ~env[b]).sum()))
                for b, rec in enumerate(records)]
        with self._lock:
            self._records += rows

    def record_engine(self, stats: dict[str, float]) -> None:
        """Keep one rollout's engine stats (MultiTurnEngine.stats) for the metrics."""
        with self._lock:
            self._engine_stats.append(dict(stats))

    def add_records(self, rows: Sequence[tuple[EpisodeRecord, int, int]],
                    engine_stats: Sequence[dict[str, float]]) -> None:
        """Keep rows and engine stats another copy of this task took (take_records /
        take_engine_stats): a Ray rollout worker's episodes, metered by the learner."""
        with self._lock:
            self._records += list(rows)
            self._engine_stats += [dict(s) for s in engine_stats]

    def __getstate__(self) -> dict:
        """Pickled (to a Ray worker) without the lock and the records: a copy starts with
        sinks of its own, like with_own_records."""
        state = dict(self.__dict__)
        del state["_lock"]
        state["_records"], state["_engine_stats"] = [], []
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def take_records(self) -> list[tuple[EpisodeRecord, int, int]]:
        with self._lock:
            out, self._records = self._records, []
        return out

    def take_engine_stats(self) -> list[dict[str, float]]:
        with self._lock:
            out, self._engine_stats = self._engine_stats, []
        return out


def is_episodic(task: Any) -> bool:
    return bool(getattr(task, "episodic", False))


def sample_episodes(params: Any, version: int, spec: Any, prompts: Sequence[Prompt], *,
                    seed: int, first_group_id: int = 0, profile=NULL_PROFILE) -> Trajectory:
    """spec.group_size episodes per prompt of spec.task (an EnvTask) with the multi-turn
    engine, all groups together (rl.loops.rollouts.sample_groups' contract; `spec` is its
    RolloutSpec: the sampler's model config, segment length, sampling and time limits): rows
    grouped in prompt order (group g = prompts[g], group ids 0..G-1; rng keys by the global
    id first_group_id + g), with rewards = the outcomes; the records go to task.record.
    profile gets the engine's prefill_s / decode_s (decode + observation appends) and the
    rest as host_s."""
    traj, records = sample_episode_groups(params, version, spec, prompts, seed=seed,
                                          first_group_id=first_group_id, profile=profile)
    spec.task.record(records, traj)
    return traj


def sample_episode_groups(params: Any, version: int, spec: Any, prompts: Sequence[Prompt], *,
                          seed: int, first_group_id: int = 0, profile=NULL_PROFILE,
                          starts: Sequence[EpisodeStart | None] | None = None
                          ) -> tuple[Trajectory, list[EpisodeRecord]]:
    """`sample_episodes` without the task's record: (Trajectory, the record of each row).
    starts[g] (optional): group g continues an earlier episode (rl.rollout.multiturn.
    EpisodeStart; its prompt holds the prefix); with starts, the prompt buffer is widened
    to the environment's max_episode_tokens - 1 (a prefix of any length fits, and every
    such batch has one prompt width)."""
    if not prompts:
        raise ValueError("no prompts to sample: the prompt list is empty")
    task, group_size = spec.task, spec.group_size
    t0 = time.perf_counter()
    width = None if starts is None else int(task.env.max_episode_tokens) - 1
    engine = episode_engine(spec, len(prompts) * group_size, seed, first_group_id,
                            max_prompt_len=width)
    engine.submit(list(prompts), starts)
    parts, records = [], []
    try:
        while not engine.idle:
            abandon_point()  # a stop request ends an abandonable phase (rl.runtime.preemption)
            engine.step(params, int(version))
            got = engine.harvest()
            if got is not None:
                parts.append(got.trajectory)
                records += list(got.episodes)
    finally:
        engine.close()
    task.record_engine(engine.stats())
    abandon_point()
    traj = parts[0] if len(parts) == 1 else concat_trajectories(parts)
    order = np.argsort(np.asarray(traj.group_ids), kind="stable")
    traj = jax.tree.map(lambda x: np.asarray(x)[order], traj)
    traj = traj.replace(group_ids=np.asarray(traj.group_ids) - first_group_id)
    t = engine.timings
    profile.add("prefill_s", t["prefill_s"])
    profile.add("decode_s", t["decode_s"] + t["append_s"])
    profile.add("host_s", time.perf_counter() - t0 - t["prefill_s"] - t["decode_s"] - t["append_s"])
    return traj, [records[i] for i in order]


def episode_engine(spec: Any, num_slots: int, seed: int, first_group_id: int = 0,
                   max_prompt_len: int | None = None) -> MultiTurnEngine:
    """The multi-turn engine of one rollout of spec.task (an EnvTask) over `num_slots`
    slots: the spec's segment length, sampling, time limits and concurrent tool calls, the
    task's KV layout / mode, its environment behind the spec's emulated tool latency
    (seeded by `seed`); max_prompt_len widens the prompt buffer (continued episodes)."""
    task = spec.task
    cfg = MultiTurnConfig(num_slots=int(num_slots), group_size=spec.group_size,
                          segment_len=spec.segment_len, sampling=spec.sampling, seed=int(seed),
                          first_group_id=int(first_group_id), kv_layout=task.options.kv_layout,
                          mode=task.options.mode, time_limits=spec.time_limits,
                          max_concurrent_tool_calls=spec.max_concurrent_tool_calls,
                          park_after_s=spec.park_after_s, max_prompt_len=max_prompt_len)
    env = with_latency(task.env, spec.tool_latency, seed=int(seed))
    return MultiTurnEngine(spec.sampler_config, env, cfg)


def episode_rewards(task: EnvTask, traj: Trajectory) -> dict[str, np.ndarray]:
    """The episodes' outcome rewards {name: [B] float64} (exactly task.reward_names)."""
    if traj.rewards is None or sorted(traj.rewards) != sorted(task.reward_names):
        got = None if traj.rewards is None else sorted(traj.rewards)
        raise ValueError(f"{task.name}: the episodes carry rewards {got}, expected "
                         f"{sorted(task.reward_names)}")
    return {n: np.asarray(traj.rewards[n], np.float64) for n in task.reward_names}


def turn_credit_of(task: Any) -> TurnCreditConfig | None:
    """The turn credit an EnvTask's batches are built with; None for a task."""
    return task.options.turn_credit if is_episodic(task) else None


def own_records(task: Any) -> Any:
    """`task` with record sinks of its own (EnvTask.with_own_records); a task unchanged."""
    return task.with_own_records() if is_episodic(task) else task


def episode_config(task: Any) -> dict:
    """{"episodes": EpisodeOptions} for a run's config record (resume compares it); {} for a
    task."""
    return {"episodes": task.options} if is_episodic(task) else {}


def take_episode_metrics(task: Any) -> dict[str, float]:
    """The metrics (module docstring) of the episodes `task` sampled since the last call,
    and forget them; {} for a task or when there were none."""
    if not is_episodic(task):
        return {}
    rows, engines = task.take_records(), task.take_engine_stats()
    if not rows:
        return {}
    recs = [r for r, _, _ in rows]
    n = len(recs)
    turn_rewards = [x for r in recs for x in r.turn_rewards]
    out = {"episode_turns": float(np.mean([r.turns for r in recs])),
           "episode_turn_reward": float(np.mean(turn_rewards)) if turn_rewards else 0.0,
           "episode_obs_tokens": float(np.mean([o for _, o, _ in rows])),
           "episode_model_tokens": float(np.mean([m for _, _, m in rows]))}
    for reason in EndReason:
        out[f"episode_end_{reason.value}"] = sum(r.end_reason == reason for r in recs) / n
    calls = [sum(int(i.get("tool_calls", 0)) for i in r.infos if isinstance(i, dict))
             for r in recs]
    if any(isinstance(i, dict) and "tool_calls" in i for r in recs for i in r.infos):
        out["episode_tool_calls"] = float(np.mean(calls))
    return {**out, **engine_metrics(engines)}


def engine_metrics(stats: Sequence[dict[str, float]]) -> dict[str, float]:
    """Rollouts' MultiTurnEngine.stats() combined, weighted by their wall time: tool_wait_share,
    tool_calls_in_flight, slot_occupancy, slot_held, tokens_per_s_tools_running; {} if none."""
    wall = sum(s["wall_s"] for s in stats)
    if not stats or wall <= 0:
        return {}
    keys = ("tool_wait_share", "tool_calls_in_flight", "slot_occupancy", "slot_held",
            "tokens_per_s_tools_running")
    return {k: float(sum(s[k] * s["wall_s"] for s in stats) / wall) for k in keys}
