"""The policy and task a RunConfig names, built before anything trains.

    model_config, params, task = load_policy(cfg)      # cfg.model, cfg.task, cfg.reward
    task = make_task(cfg.task, tokenizer=tok, seed=0)  # a task or an environment ("env:NAME")
    cfg = with_logged_reward_weights(cfg, task)        # logged-only rewards weigh 0

`load_policy` gives a "tiny" model a random init (seed cfg.model.init_seed + the run
seed) with its vocabulary sized to a token-level task. Any other model (a registered
name, a .gguf file, a Hugging Face directory) is checked in this order, each check a
ValueError saying what to change, and only then are its weights read:
  1. its headers (models.assets.inspect_model): a supported architecture (else the list),
     weights present, a tokenizer;
  2. a chat template, when the task renders prompts with one (its `chat` option, on by
     default for reasoning-gym and file tasks);
  3. the task, built with the tokenizer and cfg.reward (the verifier option and the
     reward function, which is called once on a train prompt: rl.tasks.rewards); a file
     task reads and checks its rows;
  4. `check_context`: the prompt plus response budget within the model's context, and the
     first train / eval prompts within max_prompt_len.
Nothing compiles before these pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig, get_config
from models.decoder import init_params
from rl.envs import env_factory, parse_env_spec
from rl.loops.config import RewardConfig, RunConfig, TaskSpec
from rl.loops.episodes import ENV_PREFIX, EpisodeOptions, env_fields, make_env_task
from rl.objectives.turn_credit import TurnCreditConfig
from rl.tasks import make_task as make_plain_task
from rl.tasks.rewards import with_reward_function

# task options that configure the episodes of an environment, not the environment
EPISODE_OPTIONS = ("turn_credit", "turn_credit_coef", "turn_credit_gamma", "kv_layout",
                   "episode_mode")
# a task preset's sampling budget: kept when the command line swaps the task, dropped for
# an environment whose class has no such field (it sets its own budgets)
BUDGET_OPTIONS = ("max_prompt_len", "max_new_tokens")


def split_env_options(env_name: str, options: dict[str, Any]) -> tuple[dict, EpisodeOptions]:
    """(the environment's constructor options, EpisodeOptions) from a task's options."""
    env_opts = dict(options)
    credit = {}
    kw = {}
    for key in EPISODE_OPTIONS:
        if key not in env_opts:
            continue
        value = env_opts.pop(key)
        if key == "kv_layout":
            kw["kv_layout"] = value
        elif key == "episode_mode":
            kw["mode"] = value
        elif key == "turn_credit":
            credit["name"] = value
        else:  # turn_credit_coef / turn_credit_gamma
            credit[key.removeprefix("turn_credit_")] = float(value)
    cls_fields = env_fields(env_name)
    for key in BUDGET_OPTIONS:
        if key in env_opts and cls_fields is not None and key not in cls_fields:
            env_opts.pop(key)
    return env_opts, EpisodeOptions(turn_credit=TurnCreditConfig(**credit), **kw)


def make_task(task: TaskSpec | str, *, tokenizer: Any = None, seed: int = 0,
              reward: RewardConfig | None = None, **options: Any) -> Any:
    """The rl.tasks task of a TaskSpec (or spec string + options), with `reward`'s
    verifier / tolerance as task options and its function around it (rl.tasks.rewards);
    an EnvTask (rl.loops.episodes) for "env:NAME"."""
    if isinstance(task, TaskSpec):
        spec, options = task.spec, {**task.kwargs, **options}
    else:
        spec = task
    reward = reward or RewardConfig()
    if not spec.startswith(ENV_PREFIX):
        kw = {} if tokenizer is None else {"tokenizer": tokenizer}
        extra = reward.task_options
        try:
            built = make_plain_task(spec, seed=seed, **kw, **{**options, **extra})
        except TypeError as err:
            if extra and "unexpected keyword" in str(err):
                raise ValueError(f"task {spec!r} takes no {sorted(extra)} option: its reward is "
                                 "fixed; drop reward.verifier / reward.tolerance (--verifier) or "
                                 "use reward.function") from err
            raise
        return with_reward_function(built, reward.function, reward.timeout_s)
    if reward.function is not None or reward.task_options:
        raise ValueError(f"{spec}: an environment scores its own episodes; reward.function / "
                         "reward.verifier are for single-turn tasks")
    name = parse_env_spec(spec[len(ENV_PREFIX):])[0]
    env_factory(name)  # ValueError now for an unknown name or a factory that cannot load
    env_opts, episode_opts = split_env_options(name, options)
    return make_env_task(spec, tokenizer=tokenizer, seed=seed, options=episode_opts, **env_opts)


def task_seed(cfg: RunConfig, seed: int | None = None) -> int:
    """The task's split seed: cfg.task.seed, else the run's seed."""
    run_seed = cfg.loop.seed if seed is None else seed
    return run_seed if cfg.task.seed is None else cfg.task.seed


def needs_chat_template(task: TaskSpec) -> bool:
    """Whether the task renders prompts with the tokenizer's chat template (single-turn text
    tasks unless their option chat is false)."""
    return (not task.is_env and not task.spec.startswith("synthetic")
            and task.kwargs.get("chat", True) is not False)


def load_policy(cfg: RunConfig, seed: int | None = None) -> tuple[ModelConfig, Any, Any]:
    """(model_config, params, task) for a run config (seed: the run seed, default
    cfg.loop.seed), after the checks of the module docstring: ValueError, before any weight
    is read or anything compiles, for a model that cannot load, a tokenizer-free model on
    a text task, a missing chat template, a bad prompt file or reward function, or a task
    that does not fit the model's context."""
    seed = cfg.loop.seed if seed is None else seed
    if cfg.model.name == "tiny":
        task = make_task(cfg.task, seed=task_seed(cfg, seed), reward=cfg.reward)
        if not hasattr(task, "vocab_size"):
            raise ValueError(f"the tiny random model has no tokenizer, so it trains only on "
                             f"token-level tasks ('synthetic'); task {cfg.task.spec!r} needs a "
                             "pretrained model: pick a preset such as smollm2-rg")
        config = get_config("tiny", vocab_size=task.vocab_size)
        check_context(config, task)
        return config, init_params(config, cfg.model.init_seed + seed), task
    from models.assets import inspect_model, load_model, load_tokenizer

    if cfg.task.spec.split(":")[0] == "synthetic":
        raise ValueError(f"task {cfg.task.spec!r} is token-level, for the tiny random model; "
                         f"to train {cfg.model.name!r} give a text task: --task file:PATH "
                         "(your prompts) or reasoning_gym:NAME")
    info = inspect_model(cfg.model.name)
    tokenizer = load_tokenizer(info.path)
    if needs_chat_template(cfg.task) and tokenizer.chat_template is None:
        raise ValueError(f"model {cfg.model.name!r} has no chat template, and task "
                         f"{cfg.task.spec!r} renders its prompts with one: pass the task option "
                         "chat=false (--task-option chat=false: the question and instruction "
                         "as plain text), use an instruct model, or add chat_template to its "
                         "tokenizer_config.json")
    task = make_task(cfg.task, tokenizer=tokenizer, seed=task_seed(cfg, seed), reward=cfg.reward)
    check_context(info.config, task)
    config, params, _ = load_model(info.path)
    return config, params, task


def with_logged_reward_weights(cfg: RunConfig, task: Any) -> RunConfig:
    """cfg with weight 0 for each of the task's logged_rewards that train.reward_weights
    does not name (they are logged, not trained on); with GDPO, which normalises each named
    reward on its own and reads its weights from advantage.params, also those weights
    (logged ones 0, the others their reward_weights, default 1) unless they are set. cfg
    itself when the task has no logged rewards."""
    weights = dict(cfg.train.reward_weights)
    logged = tuple(getattr(task, "logged_rewards", ()))
    extra = {n: 0.0 for n in logged if n not in weights}
    if not logged:
        return cfg
    train = dataclasses.replace(cfg.train, reward_weights={**weights, **extra})
    adv = cfg.train.advantage
    if adv.name == "gdpo" and "weights" not in adv.kwargs:
        all_weights = {**weights, **extra}
        train = dataclasses.replace(train, advantage=dataclasses.replace(adv, params={
            **adv.kwargs, "weights": {n: all_weights.get(n, 1.0) for n in task.reward_names}}))
    return dataclasses.replace(cfg, train=train)


def check_context(config: ModelConfig, task: Any) -> None:
    """ValueError unless a prompt plus its response budget fits the model's context and
    the task's first prompts fit its max_prompt_len (building them raises if not)."""
    need = task.max_prompt_len + task.max_new_tokens
    if need > config.max_position_embeddings:
        raise ValueError(f"task {task.name!r} asks for prompts of up to {task.max_prompt_len} "
                         f"plus {task.max_new_tokens} new tokens = {need}, more than the model's "
                         f"context ({config.max_position_embeddings}): lower max_prompt_len / "
                         "max_new_tokens (--task-option)")
    task.train_prompts(0, 8)
    task.eval_prompts(8)


def initial_policy_label(cfg: RunConfig) -> str:
    """What the step-0 eval measured: the random policy (a "tiny" model) or the starting
    policy (a pretrained model)."""
    return "random policy" if cfg.model.name == "tiny" else "starting policy"
