"""Environments in the training loops: an `rl.envs.Environment` run the way a task is.

`EnvTask(env)` shows an environment to the loops as an `rl.tasks.Task` whose rollouts are
multi-turn episodes: the loops' few hooks (rl.loops.rollouts.sample_groups / score /
build_batch, the step metrics and the eval record) hand such a task to this module:

    sample_episodes    prompts -> episodes through rl.rollout.multiturn.MultiTurnEngine (a
                       group of `group_size` episodes per prompt, rng keys by global group
                       id like rl.loops.rollouts.sample_groups), rows in prompt order
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
"env:guess_number" (token-level, for the tiny model) or "env:calculator" (needs a
tokenizer). The synchronous loop and the asynchronous loop's deterministic mode run
environments with static rollouts; the threaded producer and APRIL drive the single-turn
engine, so run_async refuses an EnvTask there (`check_episode_loop`).

Metrics are collected per EnvTask under a lock and drained by the caller: the sync loop
drains them after sampling a batch and the evaluator after each eval pass, so each record
holds its own episodes.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rl.envs import ENVS, make_env
from rl.envs.base import EndReason, Environment
from rl.objectives.turn_credit import TurnCreditConfig
from rl.rollout.episodes import EpisodeRecord
from rl.rollout.multiturn import MODES, MultiTurnConfig, MultiTurnEngine
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
    base = name.partition(":")[0]
    if base not in ENVS:
        raise ValueError(f"unknown environment {base!r}; available: {sorted(ENVS)}")
    fields = env_fields(base)
    kw = dict(env_options)
    if "seed" in fields:
        kw.setdefault("seed", int(seed))
    if "tokenizer" in fields and tokenizer is not None:
        kw.setdefault("tokenizer", tokenizer)
    return EnvTask(make_env(name, **kw), options)


def env_fields(name: str) -> set[str]:
    """The constructor fields of registered environment `name` (empty if not a dataclass)."""
    cls = ENVS[name]
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


class EnvTask:
    """An Environment as the loops' Task: prompts, reward names and the token budgets
    (max_new_tokens = max_episode_tokens − 1: a response holds every turn and
    observation), sampled by `sample_episodes` and scored by the episodes' outcomes."""

    episodic = True

    def __init__(self, env: Environment, options: EpisodeOptions = EpisodeOptions()):
        for attr in ("name", "reward_names", "stop_ids", "max_turns", "max_turn_tokens",
                     "max_prompt_len", "max_episode_tokens", "train_prompts", "eval_prompts",
                     "reset", "decode_turn", "encode_observation"):
            if not hasattr(env, attr):
                raise ValueError(f"{type(env).__name__} is not an rl.envs.Environment: it has "
                                 f"no {attr!r}")
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

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        return self.env.train_prompts(start, count)

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

    def take_records(self) -> list[tuple[EpisodeRecord, int, int]]:
        with self._lock:
            out, self._records = self._records, []
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
    if not prompts:
        raise ValueError("no prompts to sample: the prompt list is empty")
    task, group_size = spec.task, spec.group_size
    t0 = time.perf_counter()
    cfg = MultiTurnConfig(num_slots=len(prompts) * group_size, group_size=group_size,
                          segment_len=spec.segment_len, sampling=spec.sampling, seed=int(seed),
                          first_group_id=int(first_group_id), kv_layout=task.options.kv_layout,
                          mode=task.options.mode, time_limits=spec.time_limits)
    engine = MultiTurnEngine(spec.sampler_config, task.env, cfg)
    engine.submit(list(prompts))
    parts, records = [], []
    while not engine.idle:
        abandon_point()  # a stop request ends an abandonable phase here (rl.runtime.preemption)
        engine.step(params, int(version))
        got = engine.harvest()
        if got is not None:
            parts.append(got.trajectory)
            records += list(got.episodes)
    abandon_point()
    traj = parts[0] if len(parts) == 1 else concat_trajectories(parts)
    order = np.argsort(np.asarray(traj.group_ids), kind="stable")
    traj = jax.tree.map(lambda x: np.asarray(x)[order], traj)
    traj = traj.replace(group_ids=np.asarray(traj.group_ids) - first_group_id)
    task.record([records[i] for i in order], traj)
    t = engine.timings
    profile.add("prefill_s", t["prefill_s"])
    profile.add("decode_s", t["decode_s"] + t["append_s"])
    profile.add("host_s", time.perf_counter() - t0 - t["prefill_s"] - t["decode_s"] - t["append_s"])
    return traj


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


def episode_config(task: Any) -> dict:
    """{"episodes": EpisodeOptions} for a run's config record (resume compares it); {} for a
    task."""
    return {"episodes": task.options} if is_episodic(task) else {}


def take_episode_metrics(task: Any) -> dict[str, float]:
    """The metrics (module docstring) of the episodes `task` sampled since the last call,
    and forget them; {} for a task or when there were none."""
    if not is_episodic(task):
        return {}
    rows = task.take_records()
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
    return out


def check_episode_loop(task: Any, mode: str, rollout: str) -> None:
    """ValueError unless the asynchronous loop's `mode` / `rollout` can run `task`'s
    episodes (an environment needs mode "deterministic" with rollout "static")."""
    if is_episodic(task) and (mode, rollout) != ("deterministic", "static"):
        raise ValueError(f"{task.name}: environments run in the synchronous loop and in the "
                         "asynchronous loop's deterministic mode with static rollouts, not "
                         f"mode={mode!r} rollout={rollout!r}; pass --async-mode deterministic "
                         "(and no --rollout)")
