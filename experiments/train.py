"""The main job: train a policy with GRPO, synchronously or asynchronously.

    python -m experiments.train                          # preset "tiny-synthetic" on CPU
    python -m experiments.train --preset smollm2-rg      # SmolLM2-135M on reasoning-gym chain_sum
    python -m experiments.train --run-dir runs/a --steps 400 --resume
    python -m experiments.train --max-staleness 2 --rollout continuous   # async (rl.loops.asynchronous)
    python -m experiments.train --max-staleness 4 --async-mode deterministic --proximal exact

Any async flag (--max-staleness, --async-mode, --rollout, ...) runs rl.loops.run_async
(η defaults to 1 then); without one the synchronous rl.loops.run runs as before.

Each iteration: task prompts -> sampler (rl.rollout) -> task rewards -> advantages ->
one train_step. Prints a tqdm bar (reward, tokens/s) and eval lines; writes into the
run dir: model.json (model, ModelConfig, task: what experiments.export reads),
metrics.jsonl, checkpoints/ (orbax; --resume continues from the latest),
wandb/ (offline unless --wandb online), summary.json and reward_curve.png. At the end it
prints the step profile (mean seconds and share of the step per phase, steps/hour without
the first, compiling step, peak resident memory; rl.runtime.logging.profile_summary), also
under "step_profile" in summary.json.
`--results-json PATH` also writes the headline summary there (and the PNG beside it).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from experiments import train_env
from experiments.benchmarking import load_average, machine
from models.config import get_config
from models.decoder import init_params
from rl.learner import NonFiniteError, OptimizerConfig, TrainConfig
from rl.loops import AsyncConfig, LoopConfig, RunResult, run, run_async
from rl.loops.adapters import add_lora_flags, lora_train_config
from rl.loops.asynchronous import MODES, PROXIMAL, ROLLOUTS
from rl.loops.replay import ReplayConfig, replay_train_config
from rl.loops.scheduling import add_scheduler_flags, scheduler_from_args
from rl.loops.validation import CHANGEABLE_ON_RESUME, ConfigError, validate_run
from rl.objectives import AdvantageConfig, LossConfig, VCPOConfig
from rl.objectives.advantages import ADVANTAGE_PRESETS
from rl.objectives.losses import LOSS_PRESETS
from rl.rollout.pruning import add_prune_args, prune_config_from_args
from rl.runtime.checkpoint import CheckpointError
from rl.runtime.distributed import add_distributed_flags, initialize_distributed, is_main_process
from rl.runtime.logging import WANDB_MODES, atomic_write_json, format_profile, profile_summary
from rl.runtime.mesh import MESH_PRESETS, make_mesh_preset, validate_mesh
from rl.runtime.runlock import RunLockError, check_run_dir_free


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named experiment. model: "tiny" (random init of that ModelConfig preset, vocab
    sized to the task) or a name/path for models.assets.load_model; task / task_options:
    rl.tasks.make_task arguments; headline_target: the ratio final eval reward / initial
    (random-policy) eval reward a run is expected to reach."""

    name: str
    description: str
    model: str
    task: str
    task_options: tuple[tuple[str, Any], ...]
    train: TrainConfig
    loop: LoopConfig
    init_seed: int = 0
    headline_target: float | None = None
    task_seed: int | None = None  # the task's split seed; None: the run's --seed


PRESETS: dict[str, Preset] = {
    "tiny-synthetic": Preset(
        name="tiny-synthetic",
        description="tiny decoder (2 layers, d=64) from scratch on 'reverse 4 symbols', CPU minutes",
        model="tiny",
        task="synthetic",
        task_options=(("kind", "reverse"), ("length", 4), ("alphabet", 4)),
        train=TrainConfig(
            # entropy bonus 0.1: without it the policy's entropy collapses (2.0 -> 0.3 nats
            # by step 150) while only 1-2 of the 4 positions are right, the others copying
            # the wrong input symbol with near certainty; then 70-90% of groups have equal
            # rewards (no GRPO signal) and 10 runs (5 seeds x 2 floating-point variants)
            # ended at 0.64-0.79. With it runs reach 3 of 4 positions (~0.8) by step ~300.
            # Cosine decay to 0.1x: at a constant lr the plateau drifts (one run fell from
            # 0.80 to 0.70 in its last 100 steps, where ~85% of groups carry no signal).
            loss=LossConfig(name="ppo_clip", aggregation="token-mean", entropy_coef=0.1),
            advantage=AdvantageConfig("grpo"),
            optimizer=OptimizerConfig(name="adamw", learning_rate=1e-3, warmup_steps=10, b2=0.99,
                                      max_grad_norm=1.0, schedule="cosine", decay_steps=790,
                                      min_lr_ratio=0.1),
            temperature=1.0,
        ),
        loop=LoopConfig(steps=800, prompts_per_step=8, group_size=8, segment_len=4,
                        eval_every=50, eval_prompts=64, eval_greedy=True, save_every=200),
        headline_target=3.0,
    ),
    "smollm2-rg": Preset(
        name="smollm2-rg",
        description="SmolLM2-135M-Instruct on reasoning-gym chain_sum (two 1-2 digit terms) "
                    "on a 2-core CPU, 30 min; greedy accuracy on 256 held-out problems",
        model="smollm2-135m",
        task="reasoning_gym:chain_sum",
        task_options=(("max_digits", 2), ("max_new_tokens", 48), ("max_prompt_len", 128),
                      ("max_terms", 2), ("min_terms", 2)),
        train=TrainConfig(
            loss=LossConfig(name="ppo_clip", params={"clip_low": 0.2, "clip_high": 0.28},
                            aggregation="token-mean"),
            advantage=AdvantageConfig("grpo"),
            optimizer=OptimizerConfig(name="adamw", learning_rate=2e-5, warmup_steps=3,
                                      weight_decay=0.0, max_grad_norm=1.0),
            temperature=0.8,
            packed=True,
            # format is logged, not rewarded: GRPO normalizes each group's rewards, so in the
            # many all-wrong groups any format weight > 0 becomes a full-size push, and a run
            # with weight 0.5 learned to box a bare guess (format 0.03 -> 1.00, greedy
            # accuracy 0.17 -> 0.05 in 8 steps) instead of computing the sum
            reward_weights={"correct": 1.0, "format": 0.0},
        ),
        loop=LoopConfig(steps=200, prompts_per_step=8, group_size=8, segment_len=16,
                        eval_every=8, eval_prompts=256, eval_greedy=True, eval_sampled_prompts=64,
                        save_every=8, time_limit_s=30 * 60.0),
        task_seed=0,  # every seed is measured on the same 256 held-out problems
    ),
}
PRESETS.update(train_env.env_presets(Preset))  # environments: tiny-guess
DEFAULT_PRESET = "tiny-synthetic"


# ----------------------------------------------------------------------------- CLI
def _loss_config(name: str) -> LossConfig:
    if name in LOSS_PRESETS:
        return LossConfig.preset(name)
    return LossConfig(name=name)  # a registered per-token loss with its defaults


def _advantage_config(name: str) -> AdvantageConfig:
    if name in ADVANTAGE_PRESETS:
        return AdvantageConfig.preset(name)
    return AdvantageConfig(name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.train",
                                description="Synchronous GRPO training (Tandem's main job).")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--task", help="task spec replacing the preset's (rl.tasks.make_task), e.g. "
                   "'reasoning_gym:basic_arithmetic' or 'reasoning_gym:chain_sum=1,leg_counting=1'")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option (repeatable), e.g. max_terms=2 or chain_sum.max_digits=1; "
                        "values are Python literals or strings")
    p.add_argument("--steps", type=int, help="total optimizer steps (a resumed run continues to it)")
    p.add_argument("--seed", type=int, default=0, help="init and rollout seed (default 0)")
    p.add_argument("--run-dir", help="output directory (default runs/<preset>)")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    p.add_argument("--resume-from-last-good", action="store_true",
                   help="with --resume: if the latest checkpoint fails verification (or is "
                        "incomplete), skip it for the previous good one")
    p.add_argument("--allow-config-change", nargs="+", default=[], metavar="FIELD",
                   choices=sorted(CHANGEABLE_ON_RESUME),
                   help="--resume: let these fields differ from the checkpoint's recorded config "
                        "(steps and the time limit always may; what is learned never may)")
    p.add_argument("--unchecked", action="store_true",
                   help="train without the checked step (rl.learner.checked: a non-finite "
                        "reward, loss or gradient stops the run naming the step and group)")
    p.add_argument("--wandb", default="offline", choices=WANDB_MODES,
                   help="wandb mode: offline (default, files in the run dir), online, disabled")
    p.add_argument("--lr", type=float, help="learning rate")
    p.add_argument("--group-size", type=int, help="samples per prompt")
    p.add_argument("--prompts-per-step", type=int, help="groups per batch")
    p.add_argument("--segment-len", type=int, help="decode tokens per sampler call")
    p.add_argument("--loss", help=f"loss preset {sorted(LOSS_PRESETS)} or a registered loss name")
    p.add_argument("--advantage", help=f"advantage preset {sorted(ADVANTAGE_PRESETS)} or estimator")
    p.add_argument("--temperature", type=float, help="sampling temperature (learner uses the same)")
    p.add_argument("--micro-batches", type=int, help="gradient-accumulation micro-batches")
    p.add_argument("--packed", action="store_true",
                   help="learner runs each group's shared prompt once (DualKV P+NR packing)")
    p.add_argument("--eval-every", type=int, help="steps between evals (0: start and end only)")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (0: end only)")
    p.add_argument("--eval-prompts", type=int, help="eval split prompts per eval")
    p.add_argument("--time-limit", type=float, metavar="MINUTES",
                   help="wall-time budget: the step that crosses it is the last (then eval, save)")
    p.add_argument("--dynamic-sampling", action="store_true", help="DAPO dynamic sampling")
    add_scheduler_flags(p)  # --prompt-scheduler, --replay-fraction, ... (rl.loops.scheduling)
    p.add_argument("--results-json", help="also write the headline summary JSON here (+ PNG beside)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--mesh", help=f"learner mesh over all devices: a preset {MESH_PRESETS} or "
                   "'data=N,fsdp=N,tensor=N' (default: one device; 'dp' with several processes)")
    add_distributed_flags(p)
    add_prune_args(p)
    train_env.add_env_flags(p)  # --env NAME, --env-option, --turn-credit
    add_lora_flags(p)
    v = p.add_argument_group("VCPO (variance-controlled off-policy RL)")
    v.add_argument("--vcpo", nargs="?", const="sqrt", choices=("sqrt", "linear", "none"),
                   help="VCPO: ESS-scaled update (sqrt|linear|none; default sqrt), minimum-variance "
                        "off-policy baseline and truncated sequence weights (replaces --advantage)")
    v.add_argument("--vcpo-baseline", choices=("opob", "group_mean", "none"), default="opob",
                   help="VCPO's baseline (default opob: the minimum-variance off-policy baseline)")
    v.add_argument("--vcpo-grad-norms", choices=("exact", "none"), default="exact",
                   help="exact per-trajectory gradient norms (vmap(grad)) or the cheap mode")
    v.add_argument("--log-ess", action="store_true",
                   help="log the batch's ESS ratio and log-weight tails (VCPOConfig(monitor=True))")
    a = p.add_argument_group("asynchronous training (any of these selects rl.loops.run_async)")
    a.add_argument("--max-staleness", type=int,
                   help="η: data at most η policy versions old (0 = synchronous; default 1)")
    a.add_argument("--async-mode", choices=MODES,
                   help="threaded (producer thread + learner) or deterministic (batch v sampled "
                        "with the params of v - η; reproducible); default threaded")
    a.add_argument("--rollout", choices=ROLLOUTS, help="static (default), continuous (threaded "
                   "only) or april (over-provisioned partial rollouts)")
    a.add_argument("--over-provision", type=float, help="APRIL groups started per group trained "
                   "(default 1.5)")
    a.add_argument("--mask-offpolicy-prefix", action="store_true",
                   help="APRIL: drop resumed groups' older-version prefix from the loss")
    a.add_argument("--stale-policy", choices=("drop", "downweight"),
                   help="data older than η versions: drop the group (default) or down-weight its "
                        "stale tokens")
    a.add_argument("--stale-weight", type=float, help="loss factor of stale tokens (downweight)")
    a.add_argument("--proximal", choices=PROXIMAL,
                   help="π_prox: current (default), exact (snapshot of each token's version), "
                        "versions (log-linear approximation) or ewma (EWMA of weights)")
    a.add_argument("--ewma-beta", type=float, help="EWMA proximal params' decay (default 0.9)")
    a.add_argument("--rollout-devices", type=int, help="threaded: devices for the sampler (default "
                   "half of them when there are several, else shared)")
    return p


_ASYNC_FLAGS = {"max_staleness": "max_staleness", "async_mode": "mode", "rollout": "rollout",
                "over_provision": "over_provision", "stale_policy": "stale_policy",
                "stale_weight": "stale_weight", "proximal": "proximal", "ewma_beta": "ewma_beta",
                "rollout_devices": "rollout_devices"}


def async_config(args: argparse.Namespace) -> AsyncConfig | None:
    """The AsyncConfig the command line asks for, or None (no async flag: synchronous)."""
    kw = {field: getattr(args, arg) for arg, field in _ASYNC_FLAGS.items()
          if getattr(args, arg) is not None}
    if args.mask_offpolicy_prefix:
        kw["mask_offpolicy_prefix"] = True
    return AsyncConfig(**kw) if kw else None


def parse_task_options(pairs: list[str]) -> dict[str, Any]:
    """["max_terms=2", "operators=('+','-')", "name=x"] -> {"max_terms": 2, ...}: a value
    is a Python literal when it parses as one, else the string."""
    out = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--task-option wants KEY=VALUE, got {pair!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


# sampling budget options a preset's task keeps when --task swaps the task itself
_BUDGET_OPTIONS = ("max_prompt_len", "max_new_tokens")


def task_override(preset: Preset, task: str | None, options: list[str]) -> Preset:
    """The preset with --task (which drops the preset's task options except the sampling
    budget) and --task-option applied."""
    if task is None and not options:
        return preset
    kept = dict(preset.task_options)
    if task is not None and task != preset.task:
        kept = {k: v for k, v in kept.items() if k in _BUDGET_OPTIONS}
    kept.update(parse_task_options(options))
    return dataclasses.replace(preset, task=task or preset.task,
                               task_options=tuple(sorted(kept.items())))


def configure(args: argparse.Namespace) -> tuple[Preset, TrainConfig, LoopConfig]:
    """The preset with the command line's overrides applied (validated by the configs)."""
    preset = task_override(PRESETS[args.preset], *train_env.env_overrides(args))
    train, loop = preset.train, preset.loop
    if args.lr is not None:
        train = dataclasses.replace(train, optimizer=dataclasses.replace(train.optimizer,
                                                                        learning_rate=args.lr))
    if args.loss is not None:
        train = dataclasses.replace(train, loss=_loss_config(args.loss))
    if args.advantage is not None:
        train = dataclasses.replace(train, advantage=_advantage_config(args.advantage))
    if args.temperature is not None:
        train = dataclasses.replace(train, temperature=args.temperature)
    if args.micro_batches is not None:
        train = dataclasses.replace(train, micro_batches=args.micro_batches)
    if args.packed:
        train = dataclasses.replace(train, packed=True)
    if args.vcpo is not None:
        train = dataclasses.replace(train, vcpo=VCPOConfig(
            enabled=True, lr_scale=args.vcpo, baseline=args.vcpo_baseline,
            grad_norms=args.vcpo_grad_norms))
    elif args.log_ess:
        train = dataclasses.replace(train, vcpo=VCPOConfig(monitor=True))
    loop_kw = {"seed": args.seed}
    for arg, field in (("steps", "steps"), ("group_size", "group_size"),
                       ("prompts_per_step", "prompts_per_step"), ("eval_every", "eval_every"),
                       ("save_every", "save_every"), ("eval_prompts", "eval_prompts"),
                       ("segment_len", "segment_len")):
        if getattr(args, arg) is not None:
            loop_kw[field] = getattr(args, arg)
    if args.time_limit is not None:
        loop_kw["time_limit_s"] = 60.0 * args.time_limit
    if args.dynamic_sampling:
        loop_kw["dynamic_sampling"] = True
    if args.unchecked:
        loop_kw["checked"] = False
    loop = dataclasses.replace(loop, **loop_kw)
    train = lora_train_config(args, train)
    validate_run(train, loop)  # before any model is loaded or compiled
    return preset, train, loop


def load_policy(preset: Preset, seed: int):
    """(model_config, params, task) for a preset."""
    options = dict(preset.task_options)
    if preset.model == "tiny":
        task = train_env.make_any_task(preset.task, seed=_task_seed(preset, seed), **options)
        if not hasattr(task, "vocab_size"):
            raise ValueError(f"the tiny random model has no tokenizer, so it trains only on "
                             f"token-level tasks ('synthetic'); task {preset.task!r} needs a "
                             "pretrained model: pick a preset such as smollm2-rg")
        config = get_config("tiny", vocab_size=task.vocab_size)
        check_context(config, task)
        return config, init_params(config, preset.init_seed + seed), task
    from models.assets import load_model

    config, params, tokenizer = load_model(preset.model)
    task = train_env.make_any_task(preset.task, tokenizer=tokenizer,
                                   seed=_task_seed(preset, seed), **options)
    check_context(config, task)
    return config, params, task


def _task_seed(preset: Preset, seed: int) -> int:
    return seed if preset.task_seed is None else preset.task_seed


def check_context(config, task) -> None:
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


EVAL_METRICS = ("accuracy", "mean_length", "truncated_frac")  # logged besides the rewards


def initial_policy_label(preset: Preset) -> str:
    """What the step-0 eval measured: the random policy (a "tiny" model, random init) or
    the starting policy (a pretrained model)."""
    return "random policy" if preset.model == "tiny" else "starting policy"


def before_after(first: dict, last: dict, names: Any) -> dict:
    """{metric: {"initial", "final" [, "initial_greedy", "final_greedy"]}} of the first and
    last eval records, for each of `names` the records hold."""
    out = {}
    for name in names:
        if first.get(name) is None and last.get(name) is None:
            continue
        entry = {"initial": first.get(name), "final": last.get(name)}
        if first.get(f"greedy_{name}") is not None or last.get(f"greedy_{name}") is not None:
            entry.update(initial_greedy=first.get(f"greedy_{name}"),
                         final_greedy=last.get(f"greedy_{name}"))
        out[name] = entry
    return out


def summarize(result: RunResult, preset: Preset, train: TrainConfig, loop: LoopConfig,
              task: Any, wall_s: float, load_before: list[float], command: str) -> dict:
    """Headline (final eval / initial eval reward), each named reward's and eval metric's
    first and last eval (sampled and greedy: "rewards", "eval_metrics"), and the curves,
    JSON-ready. The initial eval is the random policy's for a "tiny" model (also under the
    old key random_policy_eval_reward) and the starting policy's for a pretrained one."""
    evals = result.eval
    first, last = evals[0], evals[-1]
    ratio = last["reward"] / first["reward"] if first["reward"] > 0 else None
    initial = initial_policy_label(preset)
    names = tuple(getattr(task, "reward_names", ()))
    out = {
        "headline": {
            "metric": f"final eval reward / {initial.replace(' ', '-')} eval reward",
            "value": None if ratio is None else round(ratio, 4),
            "target": preset.headline_target,
            "initial_policy": initial,
            "machine": machine(),
        },
        "command": command,
        "preset": preset.name,
        "description": preset.description,
        "initial_policy": initial,
        "initial_eval_reward": first["reward"],
        "final_eval_reward": last["reward"],
        "initial_greedy_eval_reward": first.get("greedy_reward"),
        "final_greedy_eval_reward": last.get("greedy_reward"),
        "rewards": before_after(first, last, ("reward", *names)),
        "eval_metrics": before_after(first, last, EVAL_METRICS),
        "uniform_policy_expected_reward": task.random_baseline()
        if hasattr(task, "random_baseline") else None,
        "steps": int(result.state.step),
        "wall_time_s": round(wall_s, 1),
        "step_profile": profile_summary(result.train),
        "load_average_1_5_15min": {"before": load_before, "after": load_average()},
        "config": {"train": repr(train), "loop": dataclasses.asdict(loop),
                   "task": dict(preset.task_options), "model": preset.model},
        "curve": {
            "train_step_reward": [[r["step"], round(r["reward_mean"], 4)] for r in result.train],
            "eval_reward": [[r["step"], round(r["reward"], 4)] for r in evals],
            "eval_greedy_reward": [[r["step"], round(r["greedy_reward"], 4)] for r in evals
                                   if r.get("greedy_reward") is not None],
            "eval_rewards": {n: [[r["step"], round(r[n], 4)] for r in evals
                                 if r.get(n) is not None] for n in names},
        },
    }
    if preset.model == "tiny":  # the key results files and their readers know
        out["random_policy_eval_reward"] = first["reward"]
    if preset.headline_target is not None and ratio is not None:
        out["headline"]["reached_target"] = ratio >= preset.headline_target
    return out


def format_summary(summary: dict) -> str:
    """The final lines main prints: the headline and each reward's first -> last eval."""
    h = summary["headline"]
    ratio = "n/a" if h["value"] is None else f"{h['value']:.2f}x"
    lines = [(f"done: {summary['steps']} steps in {summary['wall_time_s']} s; eval reward "
              f"({summary['initial_policy']} -> final) {summary['initial_eval_reward']:.3f} -> "
              f"{summary['final_eval_reward']:.3f} ({ratio})")]
    for name, e in {**summary["rewards"], **summary["eval_metrics"]}.items():
        if e["initial"] is None or e["final"] is None:
            continue
        line = f"  {name:<16} {e['initial']:.3f} -> {e['final']:.3f} sampled"
        if e.get("initial_greedy") is not None and e.get("final_greedy") is not None:
            line += f", {e['initial_greedy']:.3f} -> {e['final_greedy']:.3f} greedy"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        multi = initialize_distributed(args)  # before any other JAX call
        preset, train, loop = configure(args)
        acfg = async_config(args)
        train_env.check_env_args(preset.task, acfg, args)
    except ValueError as err:
        build_parser().error(str(err))
    run_dir = Path(args.run_dir or Path("runs") / preset.name)
    if run_dir.exists() and (run_dir / "checkpoints").exists() and any(
            (run_dir / "checkpoints").iterdir()) and not args.resume:
        build_parser().error(f"run dir {str(run_dir)!r} already holds checkpoints; pass --resume to "
                             "continue it or choose another --run-dir")
    if args.resume_from_last_good and not args.resume:
        build_parser().error("--resume-from-last-good goes with --resume")
    try:  # fail before loading the model; the loop holds the lock while it trains
        if is_main_process():
            check_run_dir_free(run_dir)
    except RunLockError as err:
        sys.exit(f"error: {err}")
    command = "python -m experiments.train " + " ".join(sys.argv[1:] if argv is None else argv)
    load_before = load_average()
    t0 = time.perf_counter()
    try:
        config, params, task = load_policy(preset, args.seed)
    except ValueError as err:
        build_parser().error(str(err))
    if is_main_process():  # what experiments.export / evaluate rebuild the policy from
        from experiments.export import model_record
        from experiments.export_lora import lora_record

        atomic_write_json(run_dir / "model.json", model_record(
            preset, config, args.seed, task_seed=_task_seed(preset, args.seed),
            **lora_record(train.lora, preset.model, preset.init_seed + args.seed)))
    try:
        scheduler = scheduler_from_args(args)
        train = replay_train_config(train, ReplayConfig(scheduler.replay_fraction))
        prune = prune_config_from_args(args)
    except ValueError as err:
        build_parser().error(str(err))
    if acfg is not None and prune is not None:
        build_parser().error("--prune is for the synchronous loop; drop it or the async flags")
    if prune is not None and not scheduler.is_default:
        build_parser().error("--prune samples the stream uniformly; drop it or "
                             "--prompt-scheduler / --replay-fraction")
    if acfg is not None and not scheduler.is_default:
        build_parser().error("--prompt-scheduler and --replay-fraction are for the synchronous "
                             "loop; drop them or the async flags")
    if acfg is not None and loop.time_limit_s:
        build_parser().error("--time-limit is for the synchronous loop; drop it or the async flags")
    if multi and acfg is not None:
        build_parser().error("asynchronous training (rl.loops.run_async) runs in one process; "
                             "drop the async flags or the multi-process flags")
    mesh = None
    if args.mesh or multi:
        try:
            mesh = make_mesh_preset(args.mesh or "dp")
            validate_mesh(mesh, config,
                          batch=scheduler.batch_rows(loop.prompts_per_step, loop.group_size))
        except ValueError as err:
            build_parser().error(str(err))
    run_config = {"preset": preset.name, "train": repr(train), "loop": dataclasses.asdict(loop)}
    if acfg is not None:
        run_config["async"] = dataclasses.asdict(acfg)
    try:
        if acfg is None:
            result = run(config, params, task, train, loop, run_dir, resume=args.resume,
                         wandb_mode=args.wandb, run_config=run_config, mesh=mesh,
                         progress=not args.no_progress and is_main_process(),
                         allow_config_changes=args.allow_config_change,
                         resume_from_last_good=args.resume_from_last_good,
                         scheduler=scheduler, prune=prune)
        else:
            result = run_async(config, params, task, train, loop, acfg, run_dir,
                               resume=args.resume, wandb_mode=args.wandb, run_config=run_config,
                               mesh=mesh, progress=not args.no_progress,
                               allow_config_changes=args.allow_config_change,
                               resume_from_last_good=args.resume_from_last_good)
    except (CheckpointError, ConfigError, NonFiniteError, RunLockError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        if acfg is None:
            raise
        print(f"interrupted: a checkpoint was written in {run_dir}/checkpoints; continue with "
              "--resume", file=sys.stderr)
        sys.exit(130)
    wall = time.perf_counter() - t0
    if not is_main_process():  # process 0 writes the results files
        return {}
    from experiments.plots import plot_reward_curve

    summary = summarize(result, preset, train, loop, task, wall, load_before, command.strip())
    if acfg is not None:
        summary["config"]["async"] = dataclasses.asdict(acfg)
    baseline = result.eval[0]["reward"]
    title = f"{preset.name}: GRPO reward" + (
        "" if acfg is None else f" (async {acfg.mode}, η={acfg.max_staleness})")
    atomic_write_json(run_dir / "summary.json", summary)
    plot = {"baseline": baseline, "title": title, "pretrained": preset.model != "tiny",
            "reward_names": getattr(task, "reward_names", None), "minutes": True}
    plot_reward_curve(result.train, result.eval, run_dir / "reward_curve.png", **plot)
    if args.results_json:
        path = Path(args.results_json)
        atomic_write_json(path, summary)
        plot_reward_curve(result.train, result.eval, path.with_suffix(".png"), **plot)
    print(format_summary(summary))
    if summary["step_profile"] is not None:
        print(format_profile(summary["step_profile"]))
    print(f"run dir {run_dir}")
    return summary


if __name__ == "__main__":
    main()
