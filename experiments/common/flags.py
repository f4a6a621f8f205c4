"""The command line of `python -m experiments.train`: a view of rl.run's RunConfig.

    cfg, resume = config_from_argv(["--preset", "smollm2-rg", "--lr", "1e-5",
                                    "--set", "loop.eval_every=4"])

The run starts from a preset (`--preset`, default tiny-synthetic) or a saved config
(`--config FILE.json` or a run dir's run_config.json); every short flag is an alias of a
dotted RunConfig path (SIMPLE_FLAGS, SWITCHES, ASYNC_FLAGS, ... below) or of a few paths at
once (--vcpo, --lora-rank, --loss NAME, --env NAME); `--set PATH=VALUE` (repeatable)
sets any leaf and is applied last. No flag changes another field on its own: the
command line is a view of the config, and Python gets the same run from the same paths.
The config is validated once (RunConfig.validate, by rl.run.prepare) before a model
loads; errors are ValueError with a message saying what to change.

Also here, for the scripts that take the same flags: the multi-process flags
(`add_distributed_flags`, `distributed_from_args`).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from models.config import DTYPES, REMAT_POLICIES
from models.lora import LoraConfig
from rl.envs import ENVS
from rl.loops.config import BACKENDS, MODES, PROXIMAL, ROLLOUTS, Resume, RunConfig
from rl.loops.validation import CHANGEABLE_ON_RESUME
from rl.objectives import AdvantageConfig, LossConfig, VCPOConfig
from rl.objectives.advantages import ADVANTAGE_PRESETS
from rl.objectives.losses import LOSS_PRESETS
from rl.objectives.turn_credit import TURN_CREDITS
from rl.objectives.vcpo import GRAD_NORMS
from rl.rollout.latr import LatrConfig
from rl.rollout.pruning import PruneConfig
from rl.rollout.trace import TraceConfig
from rl.run import DEFAULT_PRESET, PRESETS
from rl.run.policy import BUDGET_OPTIONS
from rl.runtime.config_tree import parse_assignment, parse_value
from rl.runtime.distributed import ENV_VARS, distributed_config
from rl.runtime.host_memory import MALLOC_POLICIES
from rl.runtime.logging import WANDB_MODES
from rl.runtime.mesh import MESH_PRESETS
from rl.runtime.preemption import EXIT_PREEMPTED
from rl.schedulers import SCHEDULERS
from rl.schedulers.dars import SCHEDULES

# flag dest -> the RunConfig path it sets (value as given)
SIMPLE_FLAGS = {
    "steps": "loop.steps", "group_size": "loop.group_size",
    "prompts_per_step": "loop.prompts_per_step", "segment_len": "rollout.segment_len",
    "eval_every": "loop.eval_every", "save_every": "loop.save_every",
    "eval_prompts": "loop.eval_prompts", "seed": "loop.seed",
    "lr": "train.optimizer.learning_rate", "temperature": "train.temperature",
    "micro_batches": "train.micro_batches", "mesh": "mesh", "run_dir": "run_dir",
    "wandb": "logging.wandb", "remat": "train.remat",
    "model": "model.name", "reward": "reward.function", "verifier": "reward.verifier",
    "reward_timeout": "reward.timeout_s",
    "save_every_minutes": "loop.save_every_minutes",
    "env_step_timeout": "loop.env_step_timeout_s", "episode_timeout": "loop.episode_timeout_s",
    "host_malloc": "loop.host_malloc", "rollout_dtype": "rollout.dtype",
    "max_concurrent_tool_calls": "loop.max_concurrent_tool_calls",
    "tool_latency": "loop.tool_latency", "park_after": "loop.park_after_s",
}
# --low-memory: the learner and host options that bring the smollm2-rg step under 4 GB
# resident on CPU (docs/results/learner-memory.md), at a learner time cost (and a recompile
# after each eval: loop.eval_clear_programs); it also caps the evals' rows at one train
# batch (loop.eval_max_rows = prompts_per_step x group_size)
LOW_MEMORY = {"train.remat": "full", "train.logprob_chunk": 256, "train.head_remat": True,
              "loop.host_malloc": "lean", "loop.eval_clear_programs": True}
# store_true flag dest -> (path, value it sets)
SWITCHES = {
    "packed": ("train.packed", True), "dynamic_sampling": ("loop.dynamic_sampling", True),
    "unchecked": ("loop.checked", False), "no_progress": ("logging.progress", False),
}
# async flag dest -> AsyncConfig field (any of them selects rl.loops.run_async)
ASYNC_FLAGS = {
    "max_staleness": "max_staleness", "async_mode": "mode", "rollout": "rollout",
    "over_provision": "over_provision", "stale_policy": "stale_policy",
    "stale_weight": "stale_weight", "proximal": "proximal", "ewma_beta": "ewma_beta",
    "rollout_devices": "rollout_devices", "async_backend": "backend",
    "rollout_workers": "rollout_workers", "ray_address": "ray_address",
    "worker_cpus": "worker_cpus", "worker_gpus": "worker_gpus", "sync_dtype": "sync_dtype",
    "worker_requests": "worker_requests",
}
SCHEDULER_FLAGS = {"prompt_scheduler": "name", "scheduler_pool": "pool_size",
                   "dars_budget": "dars_budget", "dars_schedule": "dars_schedule",
                   "replay_fraction": "replay_fraction", "replay_capacity": "replay_capacity"}
PRUNE_FLAGS = {"prune_at": "prune_at", "prune_target": "target_ratio",
               "prune_max_frac": "max_prune_frac", "prune_warmup": "warmup",
               "prune_threshold": "threshold", "prune_lr": "lr"}
TRACE_FLAGS = {"trace_root_share": "root_share", "trace_min_depth": "min_depth",
               "trace_warmup": "warmup", "trace_threshold": "threshold", "trace_lr": "lr"}
LATR_FLAGS = {"latr_abs": "prob_abs", "latr_rel": "prob_rel", "latr_candidates":
              "max_branch_per_token", "latr_lookahead": "lookahead", "latr_edit": "edit_threshold",
              "latr_mix": "mix_ratio"}
LORA_SHORT = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
              "up": "up_proj", "down": "down_proj"}


# ----------------------------------------------------------------------------- the parser
def build_train_parser(prog: str = "python -m experiments.train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="GRPO training, synchronous or asynchronous (Tandem's main job).",
        epilog="Short flags are aliases of RunConfig paths: " + ", ".join(
            f"--{k.replace('_', '-')}={v}" for k, v in SIMPLE_FLAGS.items()) + "; any other "
        "leaf: --set PATH=VALUE (see --print-config for the paths).")
    add_config_flags(p)
    add_run_flags(p)
    add_learner_flags(p)
    add_loop_flags(p)
    add_scheduler_flags(p)
    add_distributed_flags(p)
    add_prune_flags(p)
    add_latr_flags(p)
    add_env_flags(p)
    add_trace_flags(p)
    add_lora_flags(p)
    add_vcpo_flags(p)
    add_async_flags(p)
    add_fault_flags(p)
    return p


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """Where the config comes from, and the policy, task and reward it trains."""
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help=f"the run to start from (default {DEFAULT_PRESET})")
    p.add_argument("--config", metavar="FILE|RUN_DIR",
                   help="start from a saved RunConfig (JSON), e.g. a run dir's run_config.json")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="set any RunConfig leaf by dotted path (repeatable, applied last), e.g. "
                        "train.optimizer.learning_rate=1e-5 or async.max_staleness=2")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved RunConfig as JSON and exit")
    p.add_argument("--model", metavar="NAME|FILE.gguf|HF_DIR",
                   help="the policy to train (model.name): a registered name (smollm2-135m), a "
                        ".gguf file or a Hugging Face directory (Llama, Qwen2, Qwen3, SmolLM2 "
                        "families); checked before anything compiles")
    p.add_argument("--task", help="task spec replacing the preset's (rl.tasks.make_task), e.g. "
                   "'reasoning_gym:basic_arithmetic', 'reasoning_gym:chain_sum=1,leg_counting=1' "
                   "or a prompt file 'file:PATH.jsonl' (JSONL, JSON, CSV, Parquet)")
    p.add_argument("--reward", metavar="MODULE:FUNCTION",
                   help="your reward function fn(prompt, response, entry) -> {name: float} "
                        "(reward.function): 'module:function', 'file.py:function' or a "
                        "registered name; its rewards are trained on, the task's are logged")
    p.add_argument("--verifier", choices=("strict", "dataset", "exact", "numeric", "math", "regex"),
                   help="what the task's 'correct' reward is (reward.verifier; default: strict "
                        "for reasoning-gym, math for a file task)")
    p.add_argument("--reward-timeout", type=float, metavar="S",
                   help="time limit of one reward-function call (reward.timeout_s, default 10)")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option (repeatable), e.g. max_terms=2 or chain_sum.max_digits=1; "
                        "values are Python literals or strings")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The run's length, seed, directory, resume and logging."""
    p.add_argument("--steps", type=int, help="total optimizer steps (a resumed run continues to it)")
    p.add_argument("--seed", type=int, help="init and rollout seed (default 0)")
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
    p.add_argument("--wandb", choices=WANDB_MODES,
                   help="wandb mode: offline (the presets', files in the run dir), online, disabled")


def add_learner_flags(p: argparse.ArgumentParser) -> None:
    """The learner's short flags (aliases of RunConfig paths) and its memory options."""
    p.add_argument("--lr", type=float, help="learning rate")
    p.add_argument("--group-size", type=int, help="samples per prompt")
    p.add_argument("--prompts-per-step", type=int, help="groups per batch")
    p.add_argument("--segment-len", type=int, help="decode tokens per sampler call")
    p.add_argument("--loss", help=f"loss preset {sorted(LOSS_PRESETS)} or a registered loss name")
    p.add_argument("--advantage", help=f"advantage preset {sorted(ADVANTAGE_PRESETS)} or estimator")
    p.add_argument("--temperature", type=float, help="sampling temperature (learner uses the same)")
    p.add_argument("--micro-batches", type=int, help="gradient-accumulation micro-batches")
    p.add_argument("--remat", choices=REMAT_POLICIES,
                   help="rematerialise the learner's layers: none, dots (keep matmul outputs) "
                        "or full (keep layer inputs); default: the model config's setting")
    p.add_argument("--host-malloc", choices=MALLOC_POLICIES,
                   help="the host allocator: default, or lean (freed blocks of >= 64 KiB leave "
                        "the resident set at once: a lower CPU peak, more system time)")
    p.add_argument("--rollout-dtype", choices=DTYPES,
                   help="the train rollouts' compute dtype (default: the model's); bfloat16 "
                        "with a float32 model samples like a bf16 inference engine beside an "
                        "fp32 learner (a real train/inference mismatch, logged as mismatch_*)")
    p.add_argument("--low-memory", action="store_true",
                   help="= " + " ".join(f"--set {k}={str(v).lower()}"
                                        for k, v in LOW_MEMORY.items())
                        + " --set loop.eval_max_rows=<rows of a train batch>: the lowest "
                        "resident peak on CPU (slower learner, a recompile after each eval); "
                        "--remat, --host-malloc and --set override it")
    p.add_argument("--packed", action="store_true",
                   help="learner runs each group's shared prompt once (DualKV P+NR packing)")


def add_loop_flags(p: argparse.ArgumentParser) -> None:
    """Evals, saves, time limit, dynamic sampling, outputs and the mesh."""
    p.add_argument("--eval-every", type=int, help="steps between evals (0: start and end only)")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (0: end only)")
    p.add_argument("--eval-prompts", type=int, help="eval split prompts per eval")
    p.add_argument("--time-limit", type=float, metavar="MINUTES",
                   help="wall-time budget: the step that crosses it is the last (then eval, save)")
    p.add_argument("--dynamic-sampling", action="store_true", help="DAPO dynamic sampling")
    p.add_argument("--results-json", help="also write the headline summary JSON here (+ PNG beside)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--mesh", help=f"learner mesh over all devices: a preset {MESH_PRESETS} or "
                   "'data=N,fsdp=N,tensor=N' (default: one device; 'dp' with several processes)")


def add_fault_flags(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("faults: preemption, time-based saves, time limits "
                             "(rl.runtime.preemption)")
    f.add_argument("--save-every-minutes", type=float, metavar="M",
                   help="also checkpoint after the first step that ends M minutes after the "
                        "last save (0 = off), so a killed run loses little")
    f.add_argument("--preempted-exit-code", type=int, default=EXIT_PREEMPTED, metavar="N",
                   help="exit status after a SIGTERM / Ctrl-C stop with its checkpoint saved "
                        f"(default {EXIT_PREEMPTED}; e.g. 143 for a supervisor that restarts "
                        "only failed jobs)")
    f.add_argument("--env-step-timeout", type=float, metavar="S",
                   help="environments: seconds a call into the environment may take (reset, "
                        "step, ...); past it the episode ends with EndReason.TIMEOUT")
    f.add_argument("--episode-timeout", type=float, metavar="S",
                   help="environments: wall seconds an episode may take; past it it ends with "
                        "EndReason.TIMEOUT")


def add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data efficiency (rl.schedulers, rollout replay; sync loop)")
    g.add_argument("--prompt-scheduler", choices=SCHEDULERS,
                   help="which train prompts each step samples (rl.schedulers): uniform (the "
                        "stream, default), dots (moderate adaptive difficulty), dps (predicted "
                        "partially solved), dars (extra groups for hard prompts)")
    g.add_argument("--scheduler-pool", type=int,
                   help="dots / dps: they choose among the first N train prompts (default 256)")
    g.add_argument("--dars-budget", type=int, metavar="T",
                   help="dars: rollouts per step in both stages (default 2 x stage 1)")
    g.add_argument("--dars-schedule", choices=SCHEDULES,
                   help="dars: equal treatment (et, default) or hardness weighted (hw)")
    g.add_argument("--replay-fraction", type=float, metavar="F",
                   help="rollout replay: this share of each batch's groups comes from a FIFO "
                        "of recent informative groups (rl.loops.replay; default 0 = off); "
                        "replayed groups are off-policy: set a correction too, e.g. the "
                        "paper's --set train.old_logp=behaviour")
    g.add_argument("--replay-capacity", type=int, metavar="C",
                   help="rollout replay: groups the FIFO holds (default 4 x prompts per step)")


def add_distributed_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--coordinator, --num-processes, --process-id, --distributed-auto,
    --distributed-timeout (defaults: the JAX_* environment variables)."""
    g = p.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help=f"address of process 0's coordinator (env {ENV_VARS['coordinator']})")
    g.add_argument("--num-processes", type=int, metavar="K",
                   help=f"number of processes (env {ENV_VARS['num_processes']})")
    g.add_argument("--process-id", type=int, metavar="I",
                   help=f"this process's index in [0, K) (env {ENV_VARS['process_id']})")
    g.add_argument("--distributed-auto", action="store_true",
                   help="jax.distributed.initialize() with auto-detection (TPU pod slices, SLURM)")
    g.add_argument("--distributed-timeout", type=int, default=300, metavar="S",
                   help="seconds to wait for all processes to join (default 300)")
    return p


def distributed_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None):
    """rl.runtime.distributed.DistributedConfig from add_distributed_flags' flags, falling
    back to the JAX_* environment variables."""
    return distributed_config(args.coordinator, args.num_processes, args.process_id,
                              auto=args.distributed_auto, timeout_s=args.distributed_timeout,
                              environ=environ)


def add_prune_flags(p: argparse.ArgumentParser) -> None:
    d = PruneConfig()
    g = p.add_argument_group("online rollout pruning (ARRoL; rl.rollout.pruning)")
    g.add_argument("--prune", action="store_true",
                   help="prune partial rollouts with an online quality head so each group's "
                        "survivors are correctness-balanced")
    g.add_argument("--prune-at", type=int, help="tokens made before a group is scored (a "
                   f"segment boundary; keep --segment-len <= it; default {d.prune_at})")
    g.add_argument("--prune-target", type=float,
                   help=f"target predicted positive ratio ρ of the survivors (default {d.target_ratio})")
    g.add_argument("--prune-max-frac", type=float,
                   help=f"at most this fraction of a group pruned (default {d.max_prune_frac})")
    g.add_argument("--prune-warmup", type=int,
                   help=f"examples the head learns from before it prunes (default {d.warmup})")
    g.add_argument("--prune-threshold", type=float,
                   help=f"a reward above it counts as a success (default {d.threshold})")
    g.add_argument("--prune-lr", type=float, help=f"the head's step size (default {d.lr})")


def add_latr_flags(p: argparse.ArgumentParser) -> None:
    d = LatrConfig()
    g = p.add_argument_group("tree rollouts (LATR; rl.rollout.latr)")
    g.add_argument("--latr", action="store_true",
                   help="grow each group as a LATR tree: branch at uncertain tokens, prune "
                        "branches that stay like their parent (latr section)")
    g.add_argument("--latr-abs", type=float,
                   help=f"τ_abs: a candidate branches if its probability exceeds it (default {d.prob_abs})")
    g.add_argument("--latr-rel", type=float,
                   help=f"τ_rel: ... and p(c_1) - p(c_k) exceeds it (default {d.prob_rel})")
    g.add_argument("--latr-candidates", type=int,
                   help=f"top-m tokens considered per step (default {d.max_branch_per_token})")
    g.add_argument("--latr-lookahead", type=int, nargs="+",
                   help=f"steps after a fork at which a branch is compared with its parent "
                        f"(default {' '.join(map(str, d.lookahead))})")
    g.add_argument("--latr-edit", type=float,
                   help=f"δ: prune when edit distance / L is below it (default {d.edit_threshold})")
    g.add_argument("--latr-mix", type=float,
                   help=f"share of each group grown as the tree (default {d.mix_ratio})")
    g.add_argument("--tree-batches", action="store_true",
                   help="the learner packs each group's rows as one prefix tree (train.tree: "
                        "the prompt and every prefix the rows share once; replaces --packed)")


def add_trace_flags(p: argparse.ArgumentParser) -> None:
    d = TraceConfig()
    g = p.add_argument_group("turn-level tree rollouts (TRACE; rl.rollout.trace)")
    g.add_argument("--trace", action="store_true",
                   help="an environment's batch in two stages: root groups, then the prompt "
                        "roots or turn prefixes a shared predictor scores most likely to give "
                        "mixed outcomes (trace section)")
    g.add_argument("--trace-root-share", type=float,
                   help=f"share of each batch's groups from prompt roots first (default "
                        f"{d.root_share})")
    g.add_argument("--trace-min-depth", type=int,
                   help=f"the shallowest turn prefix continued (default {d.min_depth})")
    g.add_argument("--trace-warmup", type=int,
                   help=f"examples the predictor learns from before it allocates (default "
                        f"{d.warmup})")
    g.add_argument("--trace-threshold", type=float,
                   help=f"an outcome above it counts as a success (default {d.threshold})")
    g.add_argument("--trace-lr", type=float, help=f"the predictor's step size (default {d.lr})")


def add_env_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("environments (multi-turn episodes, rl.loops.episodes)")
    e.add_argument("--env", metavar="NAME|MODULE:FACTORY",
                   help="train on an environment instead of a task (= --task env:SPEC): a "
                        f"registered one ({', '.join(sorted(ENVS))}) or your own, "
                        "'module:factory' / 'file.py:factory' (a callable returning an "
                        "rl.envs.Environment; checked before anything compiles)")
    e.add_argument("--max-concurrent-tool-calls", type=int, metavar="M",
                   help="environment calls of different episodes run at once on M threads "
                        "while the other slots decode (loop.max_concurrent_tool_calls; default "
                        "32; 0 = one after another)")
    e.add_argument("--park-after", type=float, metavar="S",
                   help="free the slot of an episode whose tool call has run S seconds for "
                        "other episodes; it comes back re-prefilled (loop.park_after_s; needs "
                        "--env-option kv_layout=replicated; default -1: never)")
    e.add_argument("--tool-latency", metavar="SPEC",
                   help="add an emulated latency to every environment step (loop.tool_latency): "
                        "'fixed:0.5' or 'lognormal:P50,P99' seconds, e.g. 'lognormal:0.5,3'")
    e.add_argument("--env-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment option (repeatable), e.g. k=16 or max_turns=5")
    e.add_argument("--turn-credit", choices=TURN_CREDITS,
                   help="per-token advantages: outcome (default: GRPO on the episode's outcome) "
                        "or turn (+ λ · group-normalised return-to-go of the turn rewards)")
    e.add_argument("--turn-credit-coef", type=float, help="turn credit's λ (default 1)")
    e.add_argument("--turn-credit-gamma", type=float, help="turn credit's discount γ (default 1)")


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA / QLoRA (train adapters only; models.lora)")
    g.add_argument("--lora-rank", type=int, help="train rank-R LoRA adapters on a frozen base "
                   "(the base is also the KL reference); default: full fine-tuning")
    g.add_argument("--lora-alpha", type=float, help="LoRA alpha (update scaled by alpha / "
                   "rank; default 2 * rank)")
    g.add_argument("--lora-targets", help="comma-separated projections or fnmatch patterns: "
                   "q,k,v,o,gate,up,down (default all), e.g. 'q,v' or '*_proj'")
    g.add_argument("--qlora", choices=("int8", "int4"),
                   help="store the frozen base quantized (int8 per channel / int4 blocks of 64)")


def add_vcpo_flags(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("VCPO (variance-controlled off-policy RL)")
    v.add_argument("--vcpo", nargs="?", const="sqrt", choices=("sqrt", "linear", "none"),
                   help="VCPO: ESS-scaled update (sqrt|linear|none; default sqrt), minimum-variance "
                        "off-policy baseline and truncated sequence weights (replaces --advantage)")
    v.add_argument("--vcpo-baseline", choices=("opob", "group_mean", "none"), default="opob",
                   help="VCPO's baseline (default opob: the minimum-variance off-policy baseline)")
    v.add_argument("--vcpo-grad-norms", choices=GRAD_NORMS, default="ghost",
                   help="per-trajectory gradient norms: ghost (one batched backward), exact "
                        "(the vmap(grad) twin, same values, slower) or none (the cheap mode)")
    v.add_argument("--log-ess", action="store_true",
                   help="log the batch's ESS ratio and log-weight tails (VCPOConfig(monitor=True))")


def add_async_flags(p: argparse.ArgumentParser) -> None:
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
    a.add_argument("--async-backend", choices=BACKENDS,
                   help="local (default) or ray: rollout workers in their own processes "
                        "(the deterministic schedule, or streaming with --async-mode "
                        "threaded, there also --rollout continuous: in-flight weight "
                        "updates; pip install -e '.[ray]')")
    a.add_argument("--rollout-workers", type=int, help="ray: worker processes (default 1)")
    a.add_argument("--ray-address", help="ray: the cluster to join (default: start a local one, "
                   "or join the one RAY_ADDRESS names; 'auto': the cluster `ray start` made "
                   "here; 'local': always a new local one)")
    a.add_argument("--worker-cpus", type=float, help="ray: CPUs each worker asks for (default 1)")
    a.add_argument("--worker-gpus", type=float, help="ray: GPUs each worker asks for (default 0)")
    a.add_argument("--worker-requests", type=int,
                   help="ray: requests one worker samples at once (default 1; more when "
                        "sampling waits on tools)")
    a.add_argument("--sync-dtype", choices=("bfloat16",),
                   help="ray: send float32 weights to the workers in bf16 (half the bytes)")


# ----------------------------------------------------------------------------- flags -> config
def parse_task_options(pairs: Sequence[str]) -> dict[str, Any]:
    """["max_terms=2", "operators=('+','-')", "name=x"] -> {"max_terms": 2, ...}: a value
    is a Python literal when it parses as one, else the string."""
    out = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--task-option wants KEY=VALUE, got {pair!r}")
        out[key.strip()] = parse_value(raw)
    return out


def task_overrides(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    """--task / --env (which drop the config's task options except the sampling budget, and
    its reward.verifier / tolerance), --task-option / --env-option and the turn-credit
    flags."""
    task, options = args.task, list(args.task_option)
    if args.env is not None:
        if task is not None:
            raise ValueError("--env and --task both name what to train on; give one")
        task = "env:" + args.env
        options += list(args.env_option)
    elif args.env_option:
        raise ValueError("--env-option goes with --env (or use --task-option with an env: task)")
    extra = parse_task_options(options)
    for key in ("turn_credit", "turn_credit_coef", "turn_credit_gamma"):
        if getattr(args, key) is not None:
            extra[key] = getattr(args, key)
    if task is None and not extra:
        return cfg
    kept, reward = cfg.task.kwargs, cfg.reward
    if task is not None and task != cfg.task.spec:  # the verifier was the old task's choice
        kept = {k: v for k, v in kept.items() if k in BUDGET_OPTIONS}
        reward = dataclasses.replace(reward, verifier=None, tolerance=None)
    return dataclasses.replace(cfg, reward=reward, task=dataclasses.replace(
        cfg.task, spec=task or cfg.task.spec, options={**kept, **extra}))


def lora_from_args(args: argparse.Namespace) -> LoraConfig | None:
    """The LoraConfig of --lora-rank / --lora-alpha / --lora-targets / --qlora (None
    without --lora-rank; ValueError for the others without it)."""
    if args.lora_rank is None:
        given = [f for f in ("lora_alpha", "lora_targets", "qlora") if getattr(args, f)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --lora-rank R")
        return None
    kw: dict[str, Any] = {"rank": args.lora_rank,
                          "alpha": float(args.lora_alpha or 2 * args.lora_rank),
                          "qlora": args.qlora}
    if args.lora_targets:
        kw["targets"] = tuple(LORA_SHORT.get(t.strip(), t.strip())
                              for t in args.lora_targets.split(",") if t.strip())
    return LoraConfig(**kw)


def _given(args: argparse.Namespace, table: dict[str, str]) -> dict[str, Any]:
    return {field: getattr(args, dest) for dest, field in table.items()
            if getattr(args, dest) is not None}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig the parsed flags describe (module docstring). Not validated here:
    rl.run.prepare validates it once, before anything loads (--print-config validates it
    before printing)."""
    if args.config and args.preset:
        raise ValueError("--config and --preset both name the run to start from; give one")
    cfg = RunConfig.load(args.config) if args.config else PRESETS[args.preset or DEFAULT_PRESET]
    cfg = task_overrides(cfg, args)
    paths: dict[str, Any] = dict(LOW_MEMORY) if args.low_memory else {}  # flags override it
    paths.update({path: getattr(args, dest) for dest, path in SIMPLE_FLAGS.items()
                  if getattr(args, dest) is not None})
    paths.update({path: value for dest, (path, value) in SWITCHES.items() if getattr(args, dest)})
    if args.time_limit is not None:
        paths["loop.time_limit_s"] = 60.0 * args.time_limit
    cfg = cfg.overrides(paths)
    train = cfg.train
    if args.loss is not None:
        train = dataclasses.replace(train, loss=LossConfig.preset(args.loss)
                                    if args.loss in LOSS_PRESETS else LossConfig(name=args.loss))
    if args.advantage is not None:
        train = dataclasses.replace(train, advantage=AdvantageConfig.preset(args.advantage)
                                    if args.advantage in ADVANTAGE_PRESETS
                                    else AdvantageConfig(args.advantage))
    # set in one pass with --set (below): a check across train's fields (VCPO wants the
    # grpo advantage) then sees the --set values too, e.g. --vcpo --set train.advantage.name=grpo
    vcpo = None
    if args.vcpo is not None:
        vcpo = VCPOConfig(enabled=True, lr_scale=args.vcpo, baseline=args.vcpo_baseline,
                          grad_norms=args.vcpo_grad_norms)
    elif args.log_ess:
        vcpo = VCPOConfig(monitor=True)
    # field by field, so that --set may change one of them too
    late: dict[str, Any] = ({} if vcpo is None else
                            {f"train.vcpo.{f.name}": getattr(vcpo, f.name)
                             for f in dataclasses.fields(vcpo)})
    lora = lora_from_args(args)
    if lora is not None:
        train = dataclasses.replace(train, lora=lora)
    cfg = dataclasses.replace(cfg, train=train)
    sched = _given(args, SCHEDULER_FLAGS)
    if sched:
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, **sched))
    prune = _given(args, PRUNE_FLAGS)
    if args.prune:
        cfg = dataclasses.replace(cfg, prune=dataclasses.replace(cfg.prune or PruneConfig(),
                                                                 **prune))
    elif prune:
        flag = next(k for k in PRUNE_FLAGS if getattr(args, k) is not None)
        raise ValueError(f"--{flag.replace('_', '-')} goes with --prune")
    latr = _given(args, LATR_FLAGS)
    if args.latr:
        cfg = dataclasses.replace(cfg, latr=dataclasses.replace(cfg.latr or LatrConfig(), **latr))
    elif latr:
        flag = next(k for k in LATR_FLAGS if getattr(args, k) is not None)
        raise ValueError(f"--{flag.replace('_', '-')} goes with --latr")
    trace = _given(args, TRACE_FLAGS)
    if args.trace:
        cfg = dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace or TraceConfig(),
                                                                 **trace))
    elif trace:
        flag = next(k for k in TRACE_FLAGS if getattr(args, k) is not None)
        raise ValueError(f"--{flag.replace('_', '-')} goes with --trace")
    if args.tree_batches:
        if args.packed:
            raise ValueError("--tree-batches and --packed are two learner layouts; pick one")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, tree=True,
                                                                 packed=False))
    acfg = _given(args, ASYNC_FLAGS)
    if args.mask_offpolicy_prefix:
        acfg["mask_offpolicy_prefix"] = True
    if acfg:
        cfg = cfg.overrides({f"asynchronous.{k}": v for k, v in acfg.items()})
    dist = distributed_from_args(args)
    if dist.enabled:
        cfg = dataclasses.replace(cfg, distributed=dist)
    if args.set or late:
        cfg = cfg.overrides({**late, **dict(parse_assignment(a) for a in args.set)})
    if args.low_memory and not any(a.split("=", 1)[0].strip() == "loop.eval_max_rows"
                                   for a in args.set):
        # evals in chunks of one train batch, of the batch the config ends with
        cfg = cfg.override("loop.eval_max_rows", cfg.loop.prompts_per_step * cfg.loop.group_size)
    return cfg


def resume_from_args(args: argparse.Namespace) -> Resume | None:
    """Resume(...) for --resume (with --resume-from-last-good / --allow-config-change), else
    None; ValueError for those two without --resume."""
    if not args.resume:
        if args.resume_from_last_good:
            raise ValueError("--resume-from-last-good goes with --resume")
        if args.allow_config_change:
            raise ValueError("--allow-config-change goes with --resume")
        return None
    return Resume(from_last_good=args.resume_from_last_good,
                  allow_changes=tuple(args.allow_config_change))


def config_from_argv(argv: Sequence[str] | None = None) -> tuple[RunConfig, Resume | None]:
    """(RunConfig, Resume or None) of an experiments.train command line."""
    args = build_train_parser().parse_args(argv)
    return config_from_args(args), resume_from_args(args)
