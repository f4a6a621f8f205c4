"""`python -m experiments.train --env NAME`: environments (multi-turn episodes) in the main job.

    python -m experiments.train --preset tiny-guess                  # guess the number, tiny model
    python -m experiments.train --preset tiny-guess --turn-credit turn --turn-credit-coef 0.5
    python -m experiments.train --env guess_number --env-option k=16 --env-option max_turns=5
    python -m experiments.train --preset tiny-guess --max-staleness 1 --async-mode deterministic

An environment is a task spec "env:NAME" (rl.envs.make_env: guess_number, calculator); `--env NAME` is `--task env:NAME` and `--env-option K=V` a task option
passed to the environment's constructor. The episode options ride along as task options
too (recorded in model.json and the checkpoint's config): turn_credit, turn_credit_coef,
turn_credit_gamma (rl.objectives.turn_credit), kv_layout, episode_mode (the multi-turn
engine's "append" / "reprefill"). Rollouts go through rl.rollout.multiturn; eval runs
held-out environment prompts (greedy with the preset's eval_greedy) and reads the
environment's outcome as accuracy; train and eval records add episode_* metrics (turns
per episode, end reasons, per-turn reward, tool calls). The synchronous loop runs any
environment; the asynchronous loop runs them in deterministic mode with static rollouts.

This module holds what experiments.train needs for it: the flags (`add_env_flags`), the
task spec / options they mean (`env_overrides`), the task builder (`make_any_task`), the
checks (`check_env_args`) and the environment presets (`env_presets`).
"""
from __future__ import annotations

import argparse
from typing import Any

from rl.envs import ENVS
from rl.learner import OptimizerConfig, TrainConfig
from rl.loops import LoopConfig
from rl.loops.episodes import ENV_PREFIX, EpisodeOptions, env_fields, is_env_spec, make_env_task
from rl.objectives import AdvantageConfig, LossConfig
from rl.objectives.turn_credit import TURN_CREDITS, TurnCreditConfig
from rl.tasks import make_task

# task options that configure the episodes, not the environment
_EPISODE_OPTIONS = {"turn_credit": "name", "turn_credit_coef": "coef",
                    "turn_credit_gamma": "gamma", "kv_layout": None, "episode_mode": None}
# a task preset's sampling budget, kept by task_override when --env swaps the task: an
# environment without such a field sets its own budgets
_BUDGET_OPTIONS = ("max_prompt_len", "max_new_tokens")


def add_env_flags(p: argparse.ArgumentParser) -> None:
    """The environment flags of experiments.train's parser."""
    e = p.add_argument_group("environments (multi-turn episodes, rl.loops.episodes)")
    e.add_argument("--env", choices=sorted(ENVS),
                   help="train on an environment instead of a task (= --task env:NAME)")
    e.add_argument("--env-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment option (repeatable), e.g. k=16 or max_turns=5")
    e.add_argument("--turn-credit", choices=TURN_CREDITS,
                   help="per-token advantages: outcome (default: GRPO on the episode's outcome) "
                        "or turn (+ λ · group-normalised return-to-go of the turn rewards)")
    e.add_argument("--turn-credit-coef", type=float, help="turn credit's λ (default 1)")
    e.add_argument("--turn-credit-gamma", type=float, help="turn credit's discount γ (default 1)")


def env_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """(task spec, task options) for experiments.train.task_override from --task /
    --task-option and the environment flags. ValueError for --env with --task, or episode
    flags without an environment in sight."""
    task, options = args.task, list(args.task_option)
    if args.env is not None:
        if task is not None:
            raise ValueError("--env and --task both name what to train on; give one")
        task = ENV_PREFIX + args.env
        options += list(args.env_option)
    elif args.env_option:
        raise ValueError("--env-option goes with --env (or use --task-option with an env: task)")
    for flag, key in (("turn_credit", "turn_credit"), ("turn_credit_coef", "turn_credit_coef"),
                      ("turn_credit_gamma", "turn_credit_gamma")):
        value = getattr(args, flag)
        if value is not None:
            options.append(f"{key}={value!r}")
    return task, options


def split_env_options(env_name: str, options: dict[str, Any]) -> tuple[dict, EpisodeOptions]:
    """(the environment's constructor options, EpisodeOptions) from a task's options."""
    env_opts = dict(options)
    credit = {}
    kw = {}
    for key, field in _EPISODE_OPTIONS.items():
        if key not in env_opts:
            continue
        value = env_opts.pop(key)
        if key == "kv_layout":
            kw["kv_layout"] = value
        elif key == "episode_mode":
            kw["mode"] = value
        else:
            credit[field] = float(value) if field != "name" else value
    cls_fields = env_fields(env_name)
    for key in _BUDGET_OPTIONS:
        if key in env_opts and key not in cls_fields:
            env_opts.pop(key)
    return env_opts, EpisodeOptions(turn_credit=TurnCreditConfig(**credit), **kw)


def make_any_task(spec: str, *, tokenizer: Any = None, seed: int = 0, **options: Any) -> Any:
    """rl.tasks.make_task for a task spec; an EnvTask (rl.loops.episodes) for "env:NAME"."""
    if not is_env_spec(spec):
        kw = {} if tokenizer is None else {"tokenizer": tokenizer}
        return make_task(spec, seed=seed, **kw, **options)
    name = spec[len(ENV_PREFIX):].partition(":")[0]
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; available: {sorted(ENVS)}")
    env_opts, episode_opts = split_env_options(name, options)
    return make_env_task(spec, tokenizer=tokenizer, seed=seed, options=episode_opts, **env_opts)


def check_env_args(task_spec: str, acfg: Any, args: argparse.Namespace) -> None:
    """ValueError (before any model loads) for an environment with settings its loops
    cannot run: async other than deterministic static (rl.loops.episodes.check_episode_loop),
    online pruning (single-turn only)."""
    if not is_env_spec(task_spec):
        return
    if acfg is not None and (acfg.mode, acfg.rollout) != ("deterministic", "static"):
        raise ValueError(f"{task_spec}: environments run in the synchronous loop or with "
                         "--async-mode deterministic (static rollouts), not "
                         f"--async-mode {acfg.mode} --rollout {acfg.rollout}")
    if getattr(args, "prune", False):
        raise ValueError(f"{task_spec}: --prune (online rollout pruning) is for single-turn "
                         "tasks; drop it for an environment")


def env_presets(preset_cls: type) -> dict[str, Any]:
    """experiments.train's presets for environments (built with its Preset class)."""
    return {
        "tiny-guess": preset_cls(
            name="tiny-guess",
            description="tiny decoder (2 layers, d=64) from scratch on guess-the-number (K=8, "
                        "4 turns, higher/lower feedback), CPU minutes",
            model="tiny",
            task=ENV_PREFIX + "guess_number",
            task_options=(("k", 8), ("max_turns", 4)),
            train=TrainConfig(
                loss=LossConfig(name="ppo_clip", aggregation="token-mean", entropy_coef=0.01),
                # Dr. GRPO (no std division) and 32 prompts a step: in a group (one hidden
                # number) the episode that happened to guess it first wins, a push towards
                # that number that only many groups average out into "search from the
                # middle". With GRPO's std scaling and 8 prompts a step the score
                # plateaued at 0.3-0.45 in 800 steps; with these, 3 of 3 seeds reached the
                # binary-search optimum 0.594 (greedy) by step 300-500 (host-loop sweep).
                advantage=AdvantageConfig("dr_grpo"),
                optimizer=OptimizerConfig(name="adamw", learning_rate=1e-3, warmup_steps=10,
                                          b2=0.99, max_grad_norm=1.0),
                temperature=1.0,
            ),
            # one-token turns: segment_len 1 steps the environment after every token
            loop=LoopConfig(steps=500, prompts_per_step=32, group_size=8, segment_len=1,
                            eval_every=25, eval_prompts=64, eval_greedy=True, save_every=100),
            headline_target=2.0,
        ),
        "smollm2-calc": preset_cls(
            name="smollm2-calc",
            description="SmolLM2-135M-Instruct with the <calc> calculator tool on 3-4 digit "
                        "arithmetic (rl.envs.calculator), 2-core CPU, 20 min; greedy accuracy "
                        "and tool calls on 64 held-out problems",
            model="smollm2-135m",
            task=ENV_PREFIX + "calculator",
            task_options=(("max_turns", 3), ("max_turn_tokens", 48), ("max_prompt_len", 192),
                          ("max_episode_tokens", 352)),
            train=TrainConfig(
                loss=LossConfig(name="ppo_clip", params={"clip_low": 0.2, "clip_high": 0.28},
                                aggregation="token-mean"),
                advantage=AdvantageConfig("grpo"),
                optimizer=OptimizerConfig(name="adamw", learning_rate=2e-5, warmup_steps=3,
                                          weight_decay=0.0, max_grad_norm=1.0),
                temperature=0.8,
                packed=True,
                micro_batches=4,
            ),
            # micro_batches 4 (one group each): the whole 32-row step OOMed (26.7 GB) at 543-token rows
            loop=LoopConfig(steps=200, prompts_per_step=4, group_size=8, segment_len=16,
                            eval_every=5, eval_prompts=64, eval_greedy=True, save_every=5,
                            eval_sampled_prompts=16,
                            time_limit_s=20 * 60.0),
            task_seed=0,
        ),
    }
