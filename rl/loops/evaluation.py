"""The evaluation pass and its statistics: what `python -m experiments.evaluate`,
rl.run.evaluate (the public `evaluate` of a run dir or a model) and the training loops'
periodic eval all compute.

    eval_report     samples responses to eval prompts (greedy by default, plus k samples
                    for pass@k) and builds the report below
    eval_metrics    eval_report's main pass as the flat metrics of an eval record
    make_evaluator  the loops' periodic eval (train-temperature and greedy passes, logged)

Accuracy is the mean of the task's "correct" reward when it has one, else of the
(weighted) total reward. Its standard error is sqrt(p (1 - p) / n) when every value is 0
or 1, else the sample standard deviation / sqrt(n). A response counts as *solved* when
its accuracy value is 1 (up to 1e-9); pass@k is the fraction of prompts with at least one
solved response among k samples (the unbiased estimator 1 - C(n-c, k) / C(n, k) at n = k).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from rl.loops import episodes
from rl.loops.rollouts import RolloutSpec, sample_groups
from rl.loops.scoring import accuracy_name, score
from rl.rollout.sampler_state import SamplingConfig
from rl.runtime.host_memory import release_cycles
from rl.runtime.logging import MetricsLogger
from rl.tasks.base import Prompt

SOLVED_TOL = 1e-9


# ----------------------------------------------------------------------------- statistics
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


# ----------------------------------------------------------------------------- the pass
@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """What an eval_report computes beyond its main pass: k > 0 adds pass@k (k samples per
    prompt at `temperature`); reward_weights combine the named rewards into "reward"
    (missing: 1); examples: how many prompts' completions to include; max_slots: rows
    sampled at once (None: all; the same samples); progress: a tqdm bar."""

    k: int = 0
    temperature: float = 1.0
    reward_weights: Mapping[str, float] | None = None
    examples: int = 0
    max_slots: int | None = None
    progress: bool = False

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"eval_report: k must be an int >= 0 (0 = no pass@k), got {self.k!r}")


def sample_rows(params: Any, version: int, spec: RolloutSpec, prompts: Sequence[Prompt], *,
                seed: int, max_slots: int | None, bar: Any) -> tuple[list, np.ndarray, dict]:
    """(response id lists, truncated [B], rewards {name: [B]}) of spec.group_size samples per
    prompt, rows in prompt order, sampled in chunks of at most max_slots rows (None: all at
    once); rng keys follow the global group id, so the chunking changes no sample."""
    per = len(prompts) if max_slots is None else max(1, max_slots // spec.group_size)
    ids, trunc, parts = [], [], []
    for start in range(0, len(prompts), per):
        chunk = prompts[start:start + per]
        traj = sample_groups(params, version, spec, chunk, seed=seed, first_group_id=start)
        parts.append(score(spec.task, chunk, traj))
        resp, mask = np.asarray(traj.response_ids), np.asarray(traj.response_mask)
        ids += [resp[i, :int(mask[i].sum())].tolist() for i in range(traj.batch_size)]
        trunc.append(np.asarray(traj.truncated, bool))
        bar.update(len(chunk) * spec.group_size)
    return ids, np.concatenate(trunc), {n: np.concatenate([p[n] for p in parts])
                                        for n in spec.task.reward_names}


def eval_report(params: Any, version: int, spec: RolloutSpec, prompts: Sequence[Prompt], *,
                seed: int = 0, options: ReportOptions = ReportOptions(),
                decode: Callable[[list[int]], str] | None = None) -> dict:
    """The evaluation report of `params` on `prompts` (the module doc has the formulas).

    One response per prompt sampled as `spec` says (its sampling, segment length, response
    budget, time limits; its group size is ignored): "accuracy" (+ "accuracy_stderr";
    "accuracy_reward" names the reward it reads), the weighted total "reward", each named
    reward's mean under "rewards", "mean_length" (tokens), "truncated_frac" (cut at the
    budget, no stop token), "n" and "per_prompt_accuracy". options.k > 0 adds "pass_at_k": k
    samples per prompt at options.temperature with pass_at_k (+ stderr), best_of_k (mean
    best accuracy), the same block statistics over all k * n samples and
    per_prompt_accuracy [n][k]. "examples": the first options.examples prompts' main-pass
    completions (prompt text, response via decode (default: the task's tokenizer, else the
    ids), answer, rewards, length, truncated, the task's describe line)."""
    if not prompts:
        raise ValueError("eval_report: no prompts to evaluate")
    task, k = spec.task, options.k
    w, acc_name = dict(options.reward_weights or {}), accuracy_name(task.reward_names)
    bar = tqdm(total=len(prompts) * (1 + k), desc="eval", disable=not options.progress,
               unit="resp", dynamic_ncols=True)

    def one_pass(how: RolloutSpec):
        ids, trunc, rewards = sample_rows(params, version, how, prompts, seed=seed,
                                          max_slots=options.max_slots, bar=bar)
        total = sum(w.get(n, 1.0) * v for n, v in rewards.items())
        acc = total if acc_name == "reward" else rewards[acc_name]
        return response_stats(rewards, total, [len(x) for x in ids], trunc, acc_name), \
            ids, trunc, rewards, np.asarray(acc, np.float64)

    try:
        block, ids, trunc, rewards, acc = one_pass(spec.replace(group_size=1))
        report = {"accuracy_reward": acc_name, "greedy": spec.sampling.greedy,
                  "temperature": None if spec.sampling.greedy else spec.sampling.temperature,
                  **block, "per_prompt_accuracy": acc.tolist(), "pass_at_k": None}
        if k:
            kblock, *_, kacc = one_pass(spec.replace(
                group_size=k, sampling=SamplingConfig(temperature=options.temperature)))
            per = kacc.reshape(len(prompts), k)
            report["pass_at_k"] = {
                "k": k, "temperature": options.temperature, "pass_at_k": pass_at_k(per),
                "pass_at_k_stderr": mean_stderr(solved(per).any(axis=1))[1],
                "best_of_k": float(per.max(axis=1).mean()), **kblock,
                "per_prompt_accuracy": per.tolist()}
    finally:
        bar.close()
    report["examples"] = report_examples(task, prompts, ids, trunc, rewards, options.examples,
                                         decode)
    return report


def report_examples(task: Any, prompts: Sequence[Prompt], ids: list, trunc: np.ndarray,
                    rewards: dict, count: int, decode: Callable | None) -> list[dict]:
    """The first `count` prompts' completions of a report's main pass (eval_report)."""
    if decode is None:
        tok = getattr(task, "tokenizer", None)
        decode = tok.decode if tok is not None else (lambda x: " ".join(map(str, x)))
    return [{"prompt": prompts[i].text, "response": decode(list(ids[i])),
             "answer": jsonable(prompts[i].answer),
             "rewards": {n: float(v[i]) for n, v in rewards.items()},
             "length": len(ids[i]), "truncated": bool(trunc[i]),
             "describe": task.describe(prompts[i], list(ids[i]))}
            for i in range(min(int(count), len(prompts)))]


def eval_metrics(params: Any, version: int, spec: RolloutSpec, prompts: Sequence[Prompt], *,
                 seed: int, reward_weights: Mapping[str, float] | None = None,
                 max_slots: int | None = None) -> dict[str, float]:
    """One response per eval prompt (eval_report's main pass) as flat metrics: {"reward":
    weighted total mean, <name>: mean, accuracy, accuracy_stderr, mean_length,
    truncated_frac}. max_slots: rows sampled at once (None: all; the same samples)."""
    options = ReportOptions(reward_weights=reward_weights, max_slots=max_slots)
    return flat_metrics(eval_report(params, version, spec, prompts, seed=seed, options=options))


def make_evaluator(spec: RolloutSpec, loop: Any, logger: MetricsLogger, *,
                   reward_weights: Mapping[str, float], clock: Callable[[], float],
                   on_eval: Callable[[dict], Any] | None = None) -> Callable[[int, Any, int], dict]:
    """do_eval(step, params, version) -> the logged eval record: eval_report's main pass
    (flat_metrics: reward, each named reward, accuracy, accuracy_stderr, mean_length,
    truncated_frac) sampled at the train temperature, plus the same with prefix "greedy_"
    with loop.eval_greedy (seed from loop.seed and step), and time_s (clock()). Each pass's
    per-problem accuracy goes to the logger's per-problem file (eval_problems.jsonl:
    {"step", "pass": "sampled" | "greedy", "prompt_index", "accuracy"}), for paired
    comparisons between runs on the same problems. `spec`: the
    run's train rollouts (rollout_spec); evals sample at the learner's dtype (they measure
    its policy). loop.eval_max_rows > 0 samples the prompts in chunks of that many rows (a
    smaller KV cache; the same samples: the rng keys follow the prompt's index)."""
    eval_prompts = spec.task.eval_prompts(loop.eval_prompts)  # evals sample, never as trees
    weights = dict(reward_weights)
    # its own episode records: a producer thread that keeps sampling during the eval
    # records into the train task, whose episodes this eval must neither drain nor report
    spec = spec.replace(compute_dtype=None, task=episodes.own_records(spec.task), latr=None)

    def do_eval(step: int, params: Any, version: int) -> dict:
        if loop.eval_clear_programs:  # the train step's programs: not resident beside the eval's
            jax.clear_caches()
        rec = {}
        modes = [("", spec.sampling)]
        if loop.eval_greedy:
            modes.append(("greedy_", SamplingConfig(greedy=True)))
        for prefix, sampling in modes:
            prompts = eval_prompts
            if not prefix and loop.eval_sampled_prompts:
                prompts = eval_prompts[:loop.eval_sampled_prompts]
            options = ReportOptions(reward_weights=weights, max_slots=loop.eval_max_rows or None)
            report = eval_report(params, version, spec.replace(sampling=sampling), prompts,
                                 seed=(loop.seed * 7919 + step) % (2 ** 31), options=options)
            res = flat_metrics(report)
            res.update(episodes.take_episode_metrics(spec.task))  # an environment: its episodes
            logger.log_problems(step, {"pass": prefix.rstrip("_") or "sampled",
                                       "prompt_index": [int(p.index) for p in prompts],
                                       "accuracy": report["per_prompt_accuracy"]})
            rec.update({f"{prefix}{k}": v for k, v in res.items()})
        if loop.eval_clear_programs:  # and the eval's programs not beside the next steps'
            jax.clear_caches()
        release_cycles()  # an eval compiles its own sampler programs (rl.runtime.host_memory)
        rec["time_s"] = clock()
        record = logger.log(step, rec, kind="eval")
        if on_eval is not None:
            on_eval(record)
        return record

    return do_eval
