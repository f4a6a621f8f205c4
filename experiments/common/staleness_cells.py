"""One cell of a staleness study (method, staleness k, seed) as a resumable run of the
library, shared by the real-model studies (experiments/repro/staleness_real,
experiments/repro/staleness_confirm).

SweepSetup is what a study's cells share; cell_config the whole RunConfig of a cell (a
method of experiments.common.offpolicy_methods on a preset's learner, trained by
rl.loops.run_async in deterministic mode: step v trains on a batch sampled with the params
of version max(v - k, 0)). A cell trains with rl.run.train in `<work dir>/<method>_k<k>_s<seed>`
(run record, checkpoints every `save_every` steps); a cell whose run dir holds a checkpoint
resumes from it (deterministic async resumes bit for bit), so a stopped sweep (SIGTERM,
Ctrl-C, a reboot) continues where it stopped. A finished cell's record (curves, final
greedy accuracy, config, timings) goes to `<runs dir>/<name>.json` and its checkpoints are
deleted (the metrics and run record stay).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from experiments.common.offpolicy_methods import LABELS, method_train
from rl.loops import AsyncConfig
from rl.loops.config import LoggingConfig, RewardConfig, RunConfig, TaskSpec, TrainConfig
from rl.run import PRESETS
from rl.runtime.host import load_average, machine
from rl.runtime.logging import atomic_write_json

BASE_PRESET = "smollm2-rg"


@dataclasses.dataclass(frozen=True)
class SweepSetup:
    """What every cell of a sweep shares: the task (spec, options; its split is fixed by
    task_seed), the schedule, the batch and the sampler's compute dtype (rollout_dtype
    "bfloat16": a bf16 inference engine beside the fp32 learner, a real train/inference
    mismatch). Recorded in every run's JSON."""

    task: str | None  # None: the preset's own task (an environment such as the calculator)
    task_options: dict  # with task None: options over the preset task's own
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8
    eval_every: int = 10
    eval_prompts: int = 256
    eval_sampled_prompts: int = 16
    save_every: int = 5
    task_seed: int = 0
    preset: str = BASE_PRESET  # the learner, loop and model every method starts from
    rollout_dtype: str | None = None  # the sampler's compute dtype (None: the model's, fp32)
    learning_rate: float | None = None  # the optimizer's peak rate (None: the preset's)


def cell_config(setup: SweepSetup, method: str, k: int, seed: int, run_dir: str) -> RunConfig:
    """The whole RunConfig of one (method, staleness k, seed) cell."""
    preset = PRESETS[setup.preset]
    loop = dataclasses.replace(
        preset.loop, steps=setup.steps, prompts_per_step=setup.prompts_per_step,
        group_size=setup.group_size, eval_every=setup.eval_every,
        eval_prompts=setup.eval_prompts, eval_greedy=True,
        eval_sampled_prompts=setup.eval_sampled_prompts, save_every=setup.save_every,
        keep_checkpoints=1, seed=seed, time_limit_s=0.0)
    return dataclasses.replace(
        preset, name=f"staleness-real-{method}-k{k}", run_dir=run_dir,
        description=f"issue 35 sweep cell: {LABELS[method]}, max staleness {k}, seed {seed}"
                    + (f", {setup.rollout_dtype} rollouts" if setup.rollout_dtype else ""),
        task=TaskSpec(preset.task.spec, {**preset.task.kwargs, **setup.task_options},
                      seed=preset.task.seed) if setup.task is None else
        TaskSpec(setup.task, dict(setup.task_options), seed=setup.task_seed),
        # the strict verifier: full credit only, not reasoning-gym's partial credit
        reward=RewardConfig(verifier="strict" if (setup.task or "").startswith("reasoning_gym")
                            else None),
        train=method_train(method, train_with_rate(preset.train, setup.learning_rate)),
        loop=loop,
        rollout=dataclasses.replace(preset.rollout, dtype=setup.rollout_dtype),
        # k > 0: the param ring on disk (bit-identical; at k = 32 the in-memory ring would
        # be 34 x 0.54 GB of SmolLM2 weights beside a ~14 GB step)
        asynchronous=AsyncConfig(mode="deterministic", max_staleness=k,
                                 snapshot_store="disk" if k > 0 else "memory"),
        logging=LoggingConfig(wandb="disabled", progress=False))


def train_with_rate(train: TrainConfig, learning_rate: float | None) -> TrainConfig:
    """`train` with its optimizer's peak learning rate replaced (None: unchanged)."""
    if learning_rate is None:
        return train
    if not learning_rate > 0:
        raise ValueError(f"SweepSetup.learning_rate must be > 0 (or None), got {learning_rate}")
    return dataclasses.replace(train, optimizer=dataclasses.replace(
        train.optimizer, learning_rate=float(learning_rate)))


def run_name(method: str, k: int, seed: int) -> str:
    return f"{method}_k{k}_s{seed}"


# per-step train metrics kept in a run's record (None where the method does not log one)
TRAIN_KEYS = ("reward_mean", "reward_correct", "zero_spread_frac", "vcpo_ess", "vcpo_lr_scale",
              "vcpo_capped_frac", "clip_frac", "behav_kept_frac", "m2po_masked_frac",
              "version_lag_mean", "staleness_log_ratio_abs_mean", "mismatch_log_ratio_abs_mean",
              "total_log_ratio_abs_mean", "grad_norm", "entropy", "response_len", "rollout_s",
              "rollout_wait_s", "train_s", "step_s")
EVAL_KEYS = ("greedy_accuracy", "greedy_accuracy_stderr", "accuracy", "greedy_mean_length",
             "greedy_truncated_frac")


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a run dir's metrics.jsonl; a step logged twice
    (a resumed run redoes the steps after its last checkpoint) keeps its last record."""
    train, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        {"train": train, "eval": evals}.get(rec.get("kind"), {})[rec["step"]] = rec
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def _value(rec: dict, key: str):
    v = rec.get(key)
    return None if v is None else round(float(v), 6)


def cell_record(setup: SweepSetup, method: str, k: int, seed: int, run_dir: Path,
                wall_s: float, command: str) -> dict:
    """The JSON record of a finished cell, read back from its run dir."""
    train, evals = read_metrics(run_dir)
    if not evals or evals[-1]["step"] != setup.steps:
        raise RuntimeError(f"{run_dir}: no final eval at step {setup.steps}; the run did not finish")
    first, last = evals[0], evals[-1]
    return {
        "method": method, "k": k, "seed": seed, "steps": setup.steps,
        "task": setup.task, "task_options": setup.task_options, "task_seed": setup.task_seed,
        "final_accuracy": last["greedy_accuracy"],
        "final_accuracy_stderr": last.get("greedy_accuracy_stderr"),
        "initial_accuracy": first["greedy_accuracy"],
        "peak_accuracy": max(e["greedy_accuracy"] for e in evals),
        "eval_keys": ["step", *EVAL_KEYS],
        "eval": [[e["step"], *(_value(e, key) for key in EVAL_KEYS)] for e in evals],
        "train_keys": ["step", *TRAIN_KEYS],
        "train": [[r["step"], *(_value(r, key) for key in TRAIN_KEYS)] for r in train],
        "wall_s_last_call": round(wall_s, 1),
        # the train steps' time, resumed parts included, and the run clock at the last eval
        "steps_s": round(sum(r.get("step_s", 0.0) for r in train), 1),
        "run_clock_s": round(float(evals[-1].get("time_s", 0.0)), 1),
        "run_config": json.loads((run_dir / "run_config.json").read_text()),
        "machine": machine(), "load_average_after": load_average(), "command": command,
    }


def run_cell(setup: SweepSetup, method: str, k: int, seed: int, work_dir: Path,
             on_step: Callable[[dict], None] | None = None) -> tuple[Path, float]:
    """Train one cell to its last step (resuming its checkpoint if there is one); returns
    (run dir, wall seconds of this call). rl.runtime.preemption.Preempted propagates (the
    cell is checkpointed and resumes on the next call)."""
    from rl.loops.config import RunHooks
    from rl.run import train

    run_dir = work_dir / run_name(method, k, seed)
    ckpts = run_dir / "checkpoints"
    resume = ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)  # a start that never reached a checkpoint
    cfg = cell_config(setup, method, k, seed, str(run_dir))
    t0 = time.perf_counter()
    train(cfg, resume=resume, hooks=RunHooks(on_step=on_step))
    return run_dir, time.perf_counter() - t0


def record_path(runs_dir: Path, method: str, k: int, seed: int) -> Path:
    return runs_dir / f"{run_name(method, k, seed)}.json"


def finish_cell(setup: SweepSetup, cell: tuple[str, int, int], run_dir: Path, wall_s: float,
                runs_dir: Path, command: str) -> dict:
    """Write the cell's record, then drop its checkpoints and the param-ring snapshots
    saved beside them (metrics and run record stay)."""
    rec = cell_record(setup, *cell, run_dir, wall_s, command)
    atomic_write_json(record_path(runs_dir, *cell), rec)
    for folder in ("checkpoints", "snapshots"):
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    return rec
