"""A finished run in one JSON-ready dict (summary.json in the run dir) and two lines of
text: the headline (final eval reward over the step-0 eval's: the random policy's for a
"tiny" model, the starting policy's for a pretrained one), each named reward's and eval
metric's first and last eval (sampled and greedy), the step profile and the curves.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rl.loops.config import RunConfig
from rl.loops.harness import RunResult
from rl.run.policy import initial_policy_label
from rl.runtime.logging import profile_summary

EVAL_METRICS = ("accuracy", "mean_length", "truncated_frac")  # logged besides the rewards


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


def summarize(result: RunResult, cfg: RunConfig, task: Any, *, wall_s: float, command: str,
              machine: str, load: dict | None = None) -> dict:
    """The run's summary (module docstring); `load`: load averages before / after."""
    evals = result.eval
    first, last = evals[0], evals[-1]
    ratio = last["reward"] / first["reward"] if first["reward"] > 0 else None
    initial = initial_policy_label(cfg)
    names = tuple(getattr(task, "reward_names", ()))
    out = {
        "headline": {
            "metric": f"final eval reward / {initial.replace(' ', '-')} eval reward",
            "value": None if ratio is None else round(ratio, 4),
            "target": cfg.headline_target,
            "initial_policy": initial,
            "machine": machine,
        },
        "command": command,
        "preset": cfg.name,
        "description": cfg.description,
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
        "load_average_1_5_15min": load,
        "config": {"train": repr(cfg.train), "loop": dataclasses.asdict(cfg.loop),
                   "task": cfg.task.kwargs, "model": cfg.model.name},
        "curve": {
            "train_step_reward": [[r["step"], round(r["reward_mean"], 4)] for r in result.train],
            "eval_reward": [[r["step"], round(r["reward"], 4)] for r in evals],
            "eval_greedy_reward": [[r["step"], round(r["greedy_reward"], 4)] for r in evals
                                   if r.get("greedy_reward") is not None],
            "eval_rewards": {n: [[r["step"], round(r[n], 4)] for r in evals
                                 if r.get(n) is not None] for n in names},
        },
    }
    if cfg.asynchronous is not None:
        out["config"]["async"] = dataclasses.asdict(cfg.asynchronous)
    if cfg.model.name == "tiny":  # the key results files and their readers know
        out["random_policy_eval_reward"] = first["reward"]
    if cfg.headline_target is not None and ratio is not None:
        out["headline"]["reached_target"] = ratio >= cfg.headline_target
    return out


def format_summary(summary: dict) -> str:
    """The final lines a run prints: the headline and each reward's first -> last eval."""
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
