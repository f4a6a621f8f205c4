"""The sweep: one resumable run per (method, staleness k, seed) cell.

A cell trains with rl.run.train (the library run layer: run record, checkpoints every
`save_every` steps) in `<work dir>/<method>_k<k>_s<seed>`. A cell whose run dir holds a
checkpoint resumes from it (deterministic async resumes bit for bit), so a stopped sweep
(SIGTERM, Ctrl-C, a reboot) continues where it stopped: re-run the same command. A
finished cell's record (curves, final greedy accuracy, config, timings) goes to
`<runs dir>/<name>.json` and its checkpoints are deleted (the metrics and run record stay);
a cell with a record is skipped.
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from experiments.repro.staleness_real.methods import SweepSetup, cell_config, run_name
from rl.runtime.host import load_average, machine
from rl.runtime.logging import atomic_write_json

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
