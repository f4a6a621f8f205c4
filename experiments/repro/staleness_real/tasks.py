"""Picking the task: the base model's greedy accuracy on candidate reasoning-gym tasks.

    python -m experiments.repro.staleness_real tasks            # every candidate, 256 problems

Each candidate is evaluated with rl.run.evaluate (the function `python -m
experiments.evaluate` calls): SmolLM2-135M-Instruct, one greedy response per held-out
problem (the eval split of task seed 0), the strict verifier (full credit only). The
table goes to experiments/results/staleness_real_tasks.json; the chosen task's short
synchronous run is the `sync` sub-command's (module __init__).
"""
from __future__ import annotations

import time
from pathlib import Path

from experiments.common.benchmarking import RESULTS_DIR, load_average, machine
from rl.runtime.logging import atomic_write_json

TASKS_RESULT = RESULTS_DIR / "staleness_real_tasks.json"

# name -> (task spec, task options). Options of a mixture are "<dataset>.<option>".
CANDIDATES: dict[str, tuple[str, dict]] = {
    "chain_sum_2x2": ("reasoning_gym:chain_sum",
                      {"min_terms": 2, "max_terms": 2, "max_digits": 2,
                       "max_new_tokens": 48, "max_prompt_len": 128}),
    "chain_sum_3x2": ("reasoning_gym:chain_sum",
                      {"min_terms": 3, "max_terms": 3, "max_digits": 2,
                       "max_new_tokens": 64, "max_prompt_len": 128}),
    "arith_2x2": ("reasoning_gym:basic_arithmetic",
                  {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-", "*"],
                   "allow_parentheses": False, "allow_negation": False,
                   "max_new_tokens": 64, "max_prompt_len": 128}),
    "mix_sum_arith_legs": ("reasoning_gym:chain_sum=1,basic_arithmetic=1,leg_counting=1",
                           {"chain_sum.min_terms": 2, "chain_sum.max_terms": 3,
                            "chain_sum.max_digits": 2,
                            "basic_arithmetic.min_terms": 2, "basic_arithmetic.max_terms": 2,
                            "basic_arithmetic.max_digits": 2,
                            "basic_arithmetic.operators": ["+", "-", "*"],
                            "basic_arithmetic.allow_parentheses": False,
                            "basic_arithmetic.allow_negation": False,
                            "leg_counting.min_animals": 2, "leg_counting.max_animals": 3,
                            "leg_counting.max_instances": 5,
                            "max_new_tokens": 64, "max_prompt_len": 160}),
}


def measure_candidates(names: list[str], n: int = 256, out: Path = TASKS_RESULT,
                       model: str = "smollm2-135m") -> dict:
    """Greedy accuracy of `model` on each candidate's first n held-out problems; the
    table is rewritten after every candidate (so a stopped measurement keeps its rows)."""
    from rl.run import EvalOptions, evaluate

    result = {"model": model, "n": n, "verifier": "strict", "task_seed": 0,
              "command": "python -m experiments.repro.staleness_real tasks", "machine": machine(),
              "candidates": {}}
    for name in names:
        spec, options = CANDIDATES[name]
        t0 = time.perf_counter()
        report = evaluate(model, task=spec, task_options=options, n=n, seed=0,
                          options=EvalOptions(examples=2, progress=False))
        row = {"task": spec, "options": options, "accuracy": report["accuracy"],
               "accuracy_stderr": report["accuracy_stderr"], "rewards": report["rewards"],
               "mean_length": report["mean_length"], "truncated_frac": report["truncated_frac"],
               "wall_s": round(time.perf_counter() - t0, 1), "load_average": load_average()}
        if "per_dataset" in report:
            row["per_dataset"] = report["per_dataset"]
        result["candidates"][name] = row
        print(f"{name:<22} accuracy {row['accuracy']:.3f} ± {row['accuracy_stderr']:.3f}  "
              f"format {report['rewards'].get('format', float('nan')):.3f}  "
              f"len {row['mean_length']:.1f}  truncated {row['truncated_frac']:.2f}  "
              f"({row['wall_s']:.0f} s, load {row['load_average'][0]})", flush=True)
        atomic_write_json(out, result)
    return result
