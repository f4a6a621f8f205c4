"""Evaluate a model on a task's eval split: accuracy with its standard error, every named
reward, pass@k, response lengths and truncation, a few example completions.

    report = evaluate("runs/smollm2-rg")                    # a run dir: its latest checkpoint,
                                                            # on the split the run held out
    report = evaluate(cfg)                                  # a RunConfig: its run dir if it has
                                                            # checkpoints, else its initial policy
    report = evaluate("smollm2-135m", task="reasoning_gym:chain_sum", n=256, k=4,
                      options=EvalOptions(temperature=0.8))
    print(format_report(report))

A source is a RunConfig, a training run dir (model.json + checkpoints/: rl.run.load_run,
latest checkpoint or `step`; the task, its options and the split seed default to the
run's), a registered model name, a .gguf file, a Hugging Face directory, or "tiny" (a
random init, for tokenizer-free tasks). The numbers come from rl.loops.evaluation.eval_report,
the function the training loops' periodic eval calls: one greedy response per prompt ->
accuracy (mean of the task's "correct" reward, else of the total reward) ± standard
error; with k > 0 also k samples per prompt at `temperature` -> pass@k and best-of-k.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from rl.loops import ReportOptions, RolloutSpec, eval_report
from rl.loops.config import RUN_CONFIG_FILE, RewardConfig, RunConfig
from rl.rollout import SamplingConfig
from rl.run.policy import load_policy, make_task, task_seed
from rl.run.record import is_run_dir, load_run

SEGMENT_LEN = 32  # decode tokens per sampler call


def load_for_eval(source: RunConfig | str | os.PathLike, *, task: str | None = None,
                  task_options: dict | None = None, seed: int | None = None,
                  step: int | None = None, reward: RewardConfig | None = None) -> dict:
    """{"model_config", "params", "task", "task_spec", "task_options", "seed", "step",
    "kind", "tokenizer", "model"} for an evaluation of `source` (module docstring);
    ValueError with a clear message otherwise. reward: the verifier / reward function
    (default: a run's own, from its run_config.json, when its task is evaluated; else the
    task's default)."""
    options = dict(task_options or {})
    if isinstance(source, RunConfig):
        if is_run_dir(source.output_dir):
            return load_for_eval(source.output_dir, task=task, task_options=task_options,
                                 seed=seed, step=step, reward=reward)
        if step is not None:
            raise ValueError(f"step={step}: the config's run dir {str(source.output_dir)!r} "
                             "has no checkpoints")
        cfg = source if task is None else source.override("task.spec", task)
        cfg = cfg.overrides({f"task.options.{k}": v for k, v in options.items()})
        if reward is not None:
            cfg = dataclasses.replace(cfg, reward=reward)
        config, params, built = load_policy(cfg, seed)
        return {"model_config": config, "params": params, "task": built,
                "task_spec": cfg.task.spec, "task_options": cfg.task.kwargs,
                "seed": task_seed(cfg, seed), "step": None, "kind": "config",
                "tokenizer": getattr(built, "tokenizer", None) is not None,
                "model": cfg.model.name}
    source = os.fspath(source)
    meta, tokenizer = {}, None
    if is_run_dir(source):
        policy = load_run(source, step)
        config, params, tokenizer = policy.model_config, policy.params, policy.tokenizer
        meta, step = policy.meta, policy.step
        kind = "run"
    elif step is not None:
        raise ValueError(f"step is for a training run dir; {source!r} is not one "
                         "(no model.json + checkpoints/)")
    elif source == "tiny":
        kind = "tiny"
    else:
        from models.assets import load_model

        config, params, tokenizer = load_model(source)
        kind = "model"
    spec = task or meta.get("task")
    if not spec:
        raise ValueError("a task is required (a rl.tasks.make_task spec, e.g. "
                         "'reasoning_gym:chain_sum')")
    if spec == meta.get("task"):
        options = {**(meta.get("task_options") or {}), **options}
        saved = Path(source) / RUN_CONFIG_FILE
        if reward is None and kind == "run" and saved.is_file():
            reward = RunConfig.load(saved).reward
    # a run's task split seed (model.json "task_seed", else its seed), so a run is
    # evaluated on the problems it held out
    seed = seed if seed is not None else int(meta.get("task_seed", meta.get("seed", 0)))
    built = make_task(spec, tokenizer=tokenizer, seed=seed, reward=reward, **options)  # env too
    if kind == "tiny":
        from models.config import get_config
        from models.decoder import init_params

        if not hasattr(built, "vocab_size"):
            raise ValueError(f"model 'tiny' needs a tokenizer-free task with its own "
                             f"vocabulary (e.g. synthetic); {spec!r} has none")
        config = get_config("tiny", vocab_size=built.vocab_size)
        params = init_params(config, seed)
    vocab = getattr(built, "vocab_size", None)
    if tokenizer is None and vocab is not None and vocab > config.vocab_size:
        raise ValueError(f"task {spec!r} has {vocab} token ids but the model only "
                         f"{config.vocab_size} embeddings")
    return {"model_config": config, "params": params, "task": built, "task_spec": spec,
            "task_options": options, "seed": seed, "step": step, "kind": kind,
            "tokenizer": tokenizer is not None, "model": source}


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How `evaluate` samples and reports beyond its prompts: temperature (of the pass@k
    samples), max_new_tokens (None: the task's budget), examples (completions in the
    report), max_slots (responses decoded at once), progress (a tqdm bar), reward
    (load_for_eval's: the verifier / reward function)."""

    temperature: float = 1.0
    max_new_tokens: int | None = None
    examples: int = 4
    max_slots: int = 256
    progress: bool = True
    reward: RewardConfig | None = None

    def __post_init__(self):
        for name, value, low in (("examples", self.examples, 0), ("max_slots", self.max_slots, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def evaluate(source: RunConfig | str | os.PathLike, *, task: str | None = None,
             task_options: dict | None = None, n: int = 256, k: int = 0,
             seed: int | None = None, step: int | None = None,
             options: EvalOptions = EvalOptions()) -> dict:
    """The evaluation report of `source` (module docstring) on `n` eval prompts:
    rl.loops.evaluation.eval_report's keys plus "model", "model_kind", "tokenizer", "step",
    "task", "task_options", "seed", "max_new_tokens", "wall_s". k > 0 adds pass@k over k
    samples per prompt at options.temperature; options.reward: load_for_eval's; the
    weighted total ("reward") gives a task's logged-only rewards weight 0."""
    for name, value, low in (("n", n, 1), ("k", k, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if k and not options.temperature > 0:
        raise ValueError(f"temperature must be > 0 for pass@k sampling, got {options.temperature}")
    t0 = time.perf_counter()
    got = load_for_eval(source, task=task, task_options=task_options, seed=seed, step=step,
                        reward=options.reward)
    built = got["task"]
    prompts = built.eval_prompts(n)
    budget = options.max_new_tokens or built.max_new_tokens
    spec = RolloutSpec(task=built, model_config=got["model_config"], group_size=1,
                       segment_len=min(SEGMENT_LEN, budget), sampling=SamplingConfig(greedy=True),
                       max_new_tokens=budget)
    report = eval_report(got["params"], 0, spec, prompts, seed=got["seed"], options=ReportOptions(
        k=k, temperature=options.temperature, examples=options.examples,
        max_slots=options.max_slots, progress=options.progress,
        reward_weights=dict.fromkeys(getattr(built, "logged_rewards", ()), 0.0)))
    return {"model": str(got["model"]), "model_kind": got["kind"], "tokenizer": got["tokenizer"],
            "step": got["step"], "task": got["task_spec"], "task_options": got["task_options"],
            "seed": got["seed"], "max_new_tokens": budget, **report,
            "wall_s": round(time.perf_counter() - t0, 2)}


def default_report_path(report: dict) -> Path | None:
    """RUN_DIR/evals/step<N>-<task>.json for a run dir's report, else None."""
    import re

    if report["model_kind"] != "run":
        return None
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", report["task"])
    return Path(report["model"]) / "evals" / f"step{report['step']}-{slug}.json"


def _pm(value: float, err: float | None) -> str:
    return f"{value:.4f}" + ("" if err is None else f" ± {err:.4f}")


def format_report(r: dict[str, Any]) -> str:
    """The report as a text table plus its example completions."""
    mode = "greedy" if r["greedy"] else f"T={r['temperature']}"
    rows = [(f"accuracy ({r['accuracy_reward']}, {mode})", _pm(r["accuracy"], r["accuracy_stderr"])),
            ("reward (weighted total)", f"{r['reward']:.4f}")]
    rows += [(f"reward {name}", f"{v:.4f}") for name, v in r["rewards"].items()]
    rows += [("mean length (tokens)", f"{r['mean_length']:.1f}"),
             ("truncated (at budget, no stop)", f"{100 * r['truncated_frac']:.1f}%")]
    pk = r.get("pass_at_k")
    if pk:
        t = f"T={pk['temperature']}"
        rows += [(f"pass@{pk['k']} ({t})", _pm(pk["pass_at_k"], pk["pass_at_k_stderr"])),
                 (f"best-of-{pk['k']} accuracy ({t})", f"{pk['best_of_k']:.4f}"),
                 (f"sampled accuracy ({t}, {pk['n']} samples)",
                  _pm(pk["accuracy"], pk["accuracy_stderr"])),
                 (f"sampled mean length / truncated ({t})",
                  f"{pk['mean_length']:.1f} / {100 * pk['truncated_frac']:.1f}%")]
    step = "" if r.get("step") is None else f" (step {r['step']})"
    lines = [(f"model {r['model']}{step}  task {r['task']}  n={r['n']}  seed={r['seed']}  "
              f"max_new_tokens={r['max_new_tokens']}")]
    width = max(len(a) for a, _ in rows)
    lines += [f"  {a:<{width}}  {b}" for a, b in rows]
    for i, ex in enumerate(r["examples"]):
        rewards = ", ".join(f"{k}={v:g}" for k, v in ex["rewards"].items())
        lines.append(f"--- example {i}: {rewards}, {ex['length']} tokens"
                     + (" (truncated)" if ex["truncated"] else ""))
        if r.get("tokenizer", True):
            lines += [f"prompt:   {ex['prompt']}", f"response: {ex['response']!r}",
                      f"answer:   {ex['answer']}"]
        else:  # token ids mean nothing to a reader: the task's own rendering
            lines.append(ex["describe"])
    return "\n".join(lines)
