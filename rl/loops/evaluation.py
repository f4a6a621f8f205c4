"""Statistics of scored responses: the numbers of an evaluation report and the train
batch's reward-spread metric. Pure numpy on already sampled and scored data; the sampling
side is `rl.loops.evaluator.eval_report` (what `python -m experiments.evaluate` and the
training loops' periodic eval both call).

Accuracy is the mean of the task's "correct" reward when it has one, else of the
(weighted) total reward. Its standard error is sqrt(p (1 - p) / n) when every value is 0
or 1, else the sample standard deviation / sqrt(n). A response counts as *solved* when
its accuracy value is 1 (up to 1e-9); pass@k is the fraction of prompts with at least one
solved response among k samples (the unbiased estimator 1 - C(n-c, k) / C(n, k) at n = k).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ACCURACY_REWARD = "correct"  # the named reward accuracy is read from, when a task has it
SOLVED_TOL = 1e-9


def accuracy_name(reward_names: Sequence[str]) -> str:
    """The reward accuracy is computed from: "correct" if the task has it, else "reward"
    (the weighted total)."""
    return ACCURACY_REWARD if ACCURACY_REWARD in tuple(reward_names) else "reward"


def mean_stderr(values: Any) -> tuple[float, float | None]:
    """(mean, standard error of the mean) of a 1-d sample: sqrt(p(1-p)/n) for 0/1 values,
    sample std (ddof=1) / sqrt(n) otherwise; the error is None for one non-0/1 value."""
    x = np.asarray(values, np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("mean_stderr of an empty sample")
    n, m = x.size, float(x.mean())
    if np.all((x == 0.0) | (x == 1.0)):
        return m, math.sqrt(max(m * (1.0 - m), 0.0) / n)
    if n < 2:
        return m, None
    return m, float(x.std(ddof=1) / math.sqrt(n))


def solved(values: Any) -> np.ndarray:
    """Bool array: which accuracy values count as a solved response (value >= 1)."""
    return np.asarray(values, np.float64) >= 1.0 - SOLVED_TOL


def pass_at_k(accuracy: Any) -> float:
    """accuracy [P, k] (k samples per prompt) -> fraction of prompts with a solved sample."""
    a = np.asarray(accuracy, np.float64)
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"pass_at_k takes a non-empty [prompts, k] array, got shape {a.shape}")
    return float(solved(a).any(axis=1).mean())


def response_stats(rewards: Mapping[str, Any], total: Any, lengths: Any, truncated: Any,
                   acc_name: str) -> dict:
    """One block of a report over B responses: accuracy (+ stderr), the weighted total
    "reward", each named reward's mean under "rewards", mean response length in tokens,
    the fraction cut at the token budget, and n."""
    total = np.asarray(total, np.float64)
    acc_values = total if acc_name == "reward" else np.asarray(rewards[acc_name], np.float64)
    acc, err = mean_stderr(acc_values)
    return {"accuracy": acc, "accuracy_stderr": err, "reward": float(total.mean()),
            "rewards": {n: float(np.mean(v)) for n, v in rewards.items()},
            "mean_length": float(np.mean(lengths)),
            "truncated_frac": float(np.mean(np.asarray(truncated, bool))),
            "n": int(total.size)}


def flat_metrics(block: Mapping[str, Any]) -> dict:
    """A report block as the flat keys of an eval record: "reward", one key per named
    reward, "accuracy", "accuracy_stderr", "mean_length", "truncated_frac"."""
    out = {"reward": block["reward"], **block["rewards"]}
    for key in ("accuracy", "accuracy_stderr", "mean_length", "truncated_frac"):
        out[key] = block[key]
    return out


def zero_spread_fraction(total: Any, group_size: int) -> float:
    """total [G * N] rewards (groups = contiguous blocks of N) -> the fraction of groups
    whose rewards are all equal (no GRPO learning signal)."""
    r = np.asarray(total, np.float64).reshape(-1)
    if group_size < 1 or r.size == 0 or r.size % group_size:
        raise ValueError(f"zero_spread_fraction: {r.size} rewards do not split into groups of "
                         f"{group_size}")
    g = r.reshape(-1, group_size)
    return float(np.mean(g.max(axis=1) - g.min(axis=1) == 0.0))


def batch_reward_metrics(reward_names: Sequence[str], rewards: Any, group_size: int,
                         reward_weights: Mapping[str, float] | None = None) -> dict:
    """Train metrics of a batch's rewards [B, K] (columns = reward_names):
    zero_spread_frac of the weighted total (missing weights are 1)."""
    w = dict(reward_weights or {})
    cols = np.asarray(rewards, np.float64).reshape(-1, len(reward_names))
    total = cols @ np.asarray([w.get(n, 1.0) for n in reward_names], np.float64)
    return {"zero_spread_frac": zero_spread_fraction(total, group_size)}


def jsonable(x: Any) -> Any:
    """An answer or other task value as JSON (tuples -> lists, numpy -> Python, else str)."""
    if isinstance(x, (str, bool, int, float)) or x is None:
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    return str(x)
