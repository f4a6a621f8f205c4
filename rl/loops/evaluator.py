"""The evaluation pass: `eval_report` samples responses to eval prompts (greedy by
default, plus k samples for pass@k) and builds the report whose statistics
rl.loops.evaluation computes; `evaluate` is its main pass as flat metrics; `make_evaluator`
is the loops' periodic eval (train-temperature and greedy passes, logged). What
`python -m experiments.evaluate`, rl.run.evaluate and both training loops call.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from models.config import ModelConfig
from rl.learner.config import TrainConfig
from rl.loops import episodes
from rl.loops.config import LoopConfig
from rl.loops.context import run_clock
from rl.loops.evaluation import (
    accuracy_name,
    flat_metrics,
    jsonable,
    mean_stderr,
    pass_at_k,
    response_stats,
    solved,
)
from rl.loops.rollouts import loop_time_limits, sample_groups
from rl.loops.scoring import score
from rl.rollout.multiturn import TimeLimits
from rl.rollout.sampler_state import SamplingConfig
from rl.runtime.host_memory import release_cycles
from rl.runtime.logging import MetricsLogger
from rl.tasks.base import Prompt, Task


def _sample_rows(params, version, model_config, task, prompts, *, group_size, sampling,
                 segment_len, seed, max_new_tokens, max_slots, bar, time_limits):
    """(response id lists, truncated [B], rewards {name: [B]}) of group_size samples per
    prompt, rows in prompt order, sampled in chunks of at most max_slots rows (None: all at
    once); rng keys follow the global group id, so the chunking changes no sample."""
    per = len(prompts) if max_slots is None else max(1, max_slots // group_size)
    ids, trunc, parts = [], [], []
    for start in range(0, len(prompts), per):
        chunk = prompts[start:start + per]
        traj = sample_groups(params, version, model_config, task, chunk, group_size=group_size,
                             sampling=sampling, segment_len=segment_len, seed=seed,
                             first_group_id=start, max_new_tokens=max_new_tokens,
                             time_limits=time_limits)
        parts.append(score(task, chunk, traj))
        resp, mask = np.asarray(traj.response_ids), np.asarray(traj.response_mask)
        ids += [resp[i, :int(mask[i].sum())].tolist() for i in range(traj.batch_size)]
        trunc.append(np.asarray(traj.truncated, bool))
        bar.update(len(chunk) * group_size)
    return ids, np.concatenate(trunc), {n: np.concatenate([p[n] for p in parts])
                                        for n in task.reward_names}


def eval_report(params: Any, version: int, model_config: ModelConfig, task: Task,
                prompts: Sequence[Prompt], *, sampling: SamplingConfig | None = None,
                segment_len: int = 32, seed: int = 0, k: int = 0, temperature: float = 1.0,
                reward_weights: dict[str, float] | None = None, max_new_tokens: int | None = None,
                examples: int = 0, decode: Callable[[list[int]], str] | None = None,
                max_slots: int | None = None, progress: bool = False,
                time_limits: TimeLimits | None = None) -> dict:
    """The evaluation report of `params` on `prompts` (rl.loops.evaluation has the formulas).

    One response per prompt with `sampling` (default greedy): "accuracy" (+ "accuracy_stderr";
    "accuracy_reward" names the reward it reads), the weighted total "reward", each named
    reward's mean under "rewards", "mean_length" (tokens), "truncated_frac" (cut at the
    budget, no stop token), "n" and "per_prompt_accuracy". k > 0 adds "pass_at_k": k samples
    per prompt at `temperature` with pass_at_k (+ stderr), best_of_k (mean best accuracy),
    the same block statistics over all k * n samples and per_prompt_accuracy [n][k].
    "examples": the first `examples` prompts' main-pass completions (prompt text, response
    via decode (default: the task's tokenizer, else the ids), answer, rewards, length,
    truncated, the task's describe line). max_new_tokens overrides the task's budget; max_slots caps the rows sampled
    at once; progress shows a tqdm bar; time_limits: an environment's (sample_groups)."""
    if not prompts:
        raise ValueError("eval_report: no prompts to evaluate")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"eval_report: k must be an int >= 0 (0 = no pass@k), got {k!r}")
    sampling = sampling or SamplingConfig(greedy=True)
    w, acc_name = dict(reward_weights or {}), accuracy_name(task.reward_names)
    bar = tqdm(total=len(prompts) * (1 + k), desc="eval", disable=not progress, unit="resp",
               dynamic_ncols=True)

    def one_pass(group_size, how):
        ids, trunc, rewards = _sample_rows(
            params, version, model_config, task, prompts, group_size=group_size, sampling=how,
            segment_len=segment_len, seed=seed, max_new_tokens=max_new_tokens,
            max_slots=max_slots, bar=bar, time_limits=time_limits)
        total = sum(w.get(n, 1.0) * v for n, v in rewards.items())
        acc = total if acc_name == "reward" else rewards[acc_name]
        return response_stats(rewards, total, [len(x) for x in ids], trunc, acc_name), \
            ids, trunc, rewards, np.asarray(acc, np.float64)

    try:
        block, ids, trunc, rewards, acc = one_pass(1, sampling)
        report = {"accuracy_reward": acc_name, "greedy": sampling.greedy,
                  "temperature": None if sampling.greedy else sampling.temperature, **block,
                  "per_prompt_accuracy": acc.tolist(), "pass_at_k": None}
        if k:
            kblock, *_, kacc = one_pass(k, SamplingConfig(temperature=temperature))
            per = kacc.reshape(len(prompts), k)
            report["pass_at_k"] = {
                "k": k, "temperature": temperature, "pass_at_k": pass_at_k(per),
                "pass_at_k_stderr": mean_stderr(solved(per).any(axis=1))[1],
                "best_of_k": float(per.max(axis=1).mean()), **kblock,
                "per_prompt_accuracy": per.tolist()}
    finally:
        bar.close()
    if decode is None:
        tok = getattr(task, "tokenizer", None)
        decode = tok.decode if tok is not None else (lambda x: " ".join(map(str, x)))
    report["examples"] = [
        {"prompt": prompts[i].text, "response": decode(list(ids[i])), "answer":
         jsonable(prompts[i].answer), "rewards": {n: float(v[i]) for n, v in rewards.items()},
         "length": len(ids[i]), "truncated": bool(trunc[i]),
         "describe": task.describe(prompts[i], list(ids[i]))}
        for i in range(min(int(examples), len(prompts)))]
    return report


def evaluate(params: Any, version: int, model_config: ModelConfig, task: Task,
             prompts: Sequence[Prompt], *, sampling: SamplingConfig, segment_len: int,
             seed: int, reward_weights: dict[str, float] | None = None,
             time_limits: TimeLimits | None = None, max_slots: int | None = None
             ) -> dict[str, float]:
    """One response per eval prompt (eval_report's main pass) as flat metrics: {"reward":
    weighted total mean, <name>: mean, accuracy, accuracy_stderr, mean_length,
    truncated_frac}. max_slots: rows sampled at once (None: all; the same samples)."""
    return flat_metrics(eval_report(params, version, model_config, task, prompts,
                                    sampling=sampling, segment_len=segment_len, seed=seed,
                                    reward_weights=reward_weights, time_limits=time_limits,
                                    max_slots=max_slots))


def make_evaluator(model_config: ModelConfig, task: Task, config: TrainConfig, loop: LoopConfig,
                   logger: MetricsLogger, on_eval: Callable[[dict], Any] | None = None
                   ) -> Callable[[int, Any, int], dict]:
    """do_eval(step, params, version) -> the logged eval record: eval_report's main pass
    (flat_metrics: reward, each named reward, accuracy, accuracy_stderr, mean_length,
    truncated_frac) sampled at the train temperature, plus the same with prefix "greedy_"
    with loop.eval_greedy (seed from loop.seed and step), and time_s (do_eval.clock()).
    loop.eval_max_rows > 0 samples the prompts in chunks of that many rows (a smaller KV
    cache; the same samples: the rng keys follow the prompt's index)."""
    eval_prompts = task.eval_prompts(loop.eval_prompts)
    weights = dict(config.reward_weights)
    clock = run_clock(logger)

    def do_eval(step: int, params: Any, version: int) -> dict:
        if loop.eval_clear_programs:  # the train step's programs: not resident beside the eval's
            jax.clear_caches()
        rec = {}
        modes = [("", SamplingConfig(temperature=config.temperature))]
        if loop.eval_greedy:
            modes.append(("greedy_", SamplingConfig(greedy=True)))
        for prefix, sampling in modes:
            prompts = eval_prompts
            if not prefix and loop.eval_sampled_prompts:
                prompts = eval_prompts[:loop.eval_sampled_prompts]
            res = evaluate(params, version, model_config, task, prompts, sampling=sampling,
                           segment_len=loop.segment_len, seed=(loop.seed * 7919 + step) % (2 ** 31),
                           reward_weights=weights, time_limits=loop_time_limits(loop),
                           max_slots=loop.eval_max_rows or None)
            res.update(episodes.take_episode_metrics(task))  # an environment: its episodes
            rec.update({f"{prefix}{k}": v for k, v in res.items()})
        if loop.eval_clear_programs:  # and the eval's programs not beside the next steps'
            jax.clear_caches()
        release_cycles()  # an eval compiles its own sampler programs (rl.runtime.host_memory)
        rec["time_s"] = clock()
        record = logger.log(step, rec, kind="eval")
        if on_eval is not None:
            on_eval(record)
        return record

    do_eval.clock = clock
    return do_eval
