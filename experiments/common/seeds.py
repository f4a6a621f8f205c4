"""Runs over seeds, the scaffolding the reproductions share: seeds -> train the missing runs
-> collect -> mean with spread -> plot.

    runs = over_seeds(seeds, run_dir_of, read_before_after,
                   train=lambda seed: train_main(train_argv(seed)))  # trains unfinished seeds
    gains = gain_over_seeds(runs)                                    # mean, std, min, max
    plot_over_seeds(ax, curves, color="tab:blue", label="mean of 3 seeds")

A run is finished when its run dir holds summary.json (the train job writes it last), so a
driver that was interrupted trains only what is missing when started again. Runs go one
after another: each has the machine to itself. The pieces take the training function as
an argument (the train job's `main`, or a subprocess): this module imports the library only.
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rl.runtime.logging import read_jsonl

Key = TypeVar("Key", bound=Hashable)  # a seed, or a (method, seed) cell

# two-sided 95% Student-t quantiles by degrees of freedom (1..10); beyond 10 the normal's
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
# flags a driver sets per run itself (not to be passed through to every run)
DRIVER_FLAGS = ("--seed", "--run-dir", "--preset", "--resume", "--results-json")


# ----------------------------------------------------------------------------- train
def is_finished(run_dir: Path) -> bool:
    """True when the run dir holds summary.json (written when a run ends)."""
    return (Path(run_dir) / "summary.json").is_file()


def train_missing(keys: Iterable[Key], run_dir_of: Callable[[Key], Path],
                  train: Callable[[Key], Any], *,
                  finished: Callable[[Path], bool] = is_finished) -> list[Key]:
    """train(key) for each key whose run is not finished(run_dir_of(key)), in order, one
    after another; the keys trained. (A driver that keeps one record file per run passes
    that file as the run's path and finished=Path.exists.)"""
    trained = []
    for key in keys:
        if not finished(run_dir_of(key)):
            train(key)
            trained.append(key)
    return trained


def train_in_process(run_dir: Path, cmd: Sequence[str]) -> bool:
    """Run the train command `cmd` (an argv list, `cmd[0]` the interpreter) as a child
    process for `run_dir`, one after another: skipped when the run is finished, with
    --resume appended when it started before (its metrics.jsonl exists); progress on
    stdout. True when it ran."""
    import subprocess
    import time

    run_dir = Path(run_dir)
    if is_finished(run_dir):
        print(f"{run_dir.name}: finished, skipped", flush=True)
        return False
    cmd = list(cmd) + (["--resume"] if (run_dir / "metrics.jsonl").is_file() else [])
    print(f"{run_dir.name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"{run_dir.name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    return True


def check_train_args(train_args: Sequence[str], driver: str) -> None:
    """ValueError for pass-through flags (`-- FLAGS` given to every run) that the driver
    sets per run itself."""
    clash = sorted({a.split("=")[0] for a in train_args} & set(DRIVER_FLAGS))
    if clash:
        raise ValueError(f"{', '.join(clash)} is set by {driver} per seed; drop it from the "
                         "pass-through flags (use --seeds / --runs-root / --preset / "
                         "--results-json of the driver)")


# ----------------------------------------------------------------------------- collect
def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The train and the eval records of run_dir/metrics.jsonl, in file order."""
    records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return ([r for r in records if r.get("kind") == "train"],
            [r for r in records if r.get("kind") == "eval"])


def over_seeds(keys: Iterable[Key], run_dir_of: Callable[[Key], Path],
            read: Callable[[Path], dict], *,
            train: Callable[[Key], Any] | None = None) -> dict[str, dict]:
    """{str(key): read(run dir)} over the keys; with `train`, the unfinished runs are
    trained first (train_missing). `read` raises ValueError for a run it cannot use."""
    keys = list(keys)
    if train is not None:
        train_missing(keys, run_dir_of, train)
    return {str(k): read(run_dir_of(k)) for k in keys}


def read_before_after(run_dir: Path) -> dict:
    """One run's greedy accuracy before / after training (its first and last eval) with
    standard errors, the gain and its standard error (sqrt(se_before² + se_after²),
    conservative: the problems are the same), each named greedy reward before / after,
    the eval and train curves (step, run-clock minutes), steps, wall time and load.
    ValueError if the run has not finished or lacks a greedy eval at both ends."""
    run_dir = Path(run_dir)
    if not is_finished(run_dir):
        raise ValueError(f"{run_dir} has no summary.json: the run has not finished (train it "
                         "with --train, or resume it with experiments.train --resume)")
    summary = json.loads((run_dir / "summary.json").read_text())
    train, evals = read_metrics(run_dir)
    if len(evals) < 2 or evals[0].get("greedy_accuracy") is None:
        raise ValueError(f"{run_dir}: needs a greedy eval at the start and at the end")
    first, last = evals[0], evals[-1]
    before, after = first["greedy_accuracy"], last["greedy_accuracy"]
    se_b, se_a = first["greedy_accuracy_stderr"], last["greedy_accuracy_stderr"]
    names = [k[len("greedy_"):] for k in first
             if k.startswith("greedy_") and k[len("greedy_"):] in ("correct", "format")]
    return {
        "run_dir": str(run_dir),
        "command": summary.get("command"),
        "before": {"accuracy": before, "stderr": se_b},
        "after": {"accuracy": after, "stderr": se_a},
        "gain": after - before,
        "gain_stderr": math.sqrt(se_b ** 2 + se_a ** 2),
        "greedy_rewards": {n: {"before": first[f"greedy_{n}"], "after": last[f"greedy_{n}"]}
                           for n in names},
        "greedy_mean_length": {"before": first.get("greedy_mean_length"),
                               "after": last.get("greedy_mean_length")},
        "greedy_truncated_frac": {"before": first.get("greedy_truncated_frac"),
                                  "after": last.get("greedy_truncated_frac")},
        "steps": summary.get("steps"),
        # the run clock (metrics' time_s: first eval to final eval, continued across a
        # --resume) and the last process's wall time (model load included)
        "run_clock_minutes": round(last.get("time_s", 0.0) / 60, 2),
        "wall_time_s": summary.get("wall_time_s"),
        "resumed": "--resume" in (summary.get("command") or ""),
        "load_average_1_5_15min": summary.get("load_average_1_5_15min"),
        "zero_spread_frac_mean": statistics.fmean(r["zero_spread_frac"] for r in train)
        if train and "zero_spread_frac" in train[0] else None,
        "eval_curve": [{"step": r["step"], "minutes": round(r.get("time_s", 0.0) / 60, 2),
                        "greedy_accuracy": r["greedy_accuracy"],
                        "greedy_format": r.get("greedy_format"),
                        "sampled_accuracy": r.get("accuracy")} for r in evals],
        "train_curve": [{"step": r["step"], "minutes": round(r.get("time_s", 0.0) / 60, 2),
                         "correct": r.get("reward_correct"), "format": r.get("reward_format"),
                         "zero_spread_frac": r.get("zero_spread_frac")} for r in train],
    }


# ----------------------------------------------------------------------------- mean with spread
def spread(values: Sequence[float], digits: int | None = 4) -> dict[str, Any]:
    """mean, sample std (0 for one value), min, max and the 95% Student-t interval of the
    mean (NaN ends for one value), each rounded to `digits` (None: as computed)."""
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    std = float(x.std(ddof=1)) if n > 1 else 0.0
    t = _T95[n - 2] if 1 < n <= len(_T95) + 1 else 1.96
    half = t * std / math.sqrt(n) if n > 1 else float("nan")
    mean = float(x.mean())

    def r(v: float) -> float:
        return v if digits is None else round(v, digits)

    return {"mean": r(mean), "std": r(std), "min": r(float(x.min())), "max": r(float(x.max())),
            "ci95": [r(mean - half), r(mean + half)]}


def gain_over_seeds(runs: Mapping[str, dict]) -> dict[str, Any]:
    """{mean, std (None for one seed), min, max, seeds, steps_mean} of the runs' "gain"
    (read_before_after)."""
    g = spread([r["gain"] for r in runs.values()], digits=None)
    return {"mean": g["mean"], "std": g["std"] if len(runs) > 1 else None,
            "min": g["min"], "max": g["max"], "seeds": len(runs),
            "steps_mean": spread([r["steps"] for r in runs.values()], digits=None)["mean"]}


# ----------------------------------------------------------------------------- plot
def plot_over_seeds(ax, curves: Sequence[Any], *, color: str, label: str, ls: str = "-",
                    alpha: float = 0.4) -> tuple[np.ndarray, np.ndarray]:
    """Each seed's curve ([n_i, 2]: x, y) thin, and their mean over the points all share
    (the shortest curve's length) thick, labelled `label`; returns the mean's (x, y)."""
    curves = [np.asarray(c, dtype=np.float64) for c in curves]
    for c in curves:
        ax.plot(c[:, 0], c[:, 1], color=color, ls=ls, lw=0.7, alpha=alpha)
    n = min(len(c) for c in curves)
    x, mean = curves[0][:n, 0], np.mean([c[:n, 1] for c in curves], axis=0)
    ax.plot(x, mean, color=color, ls=ls, lw=2.2, label=label)
    return x, mean
