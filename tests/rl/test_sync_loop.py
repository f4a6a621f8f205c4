"""Synchronous loop tests: a short run's records, tokens and checkpoint; rewards and
batches checked against the sampled responses; DAPO dynamic sampling; bad input (NaN /
inf rewards, wrong reward names, all-equal groups, too-long sequences) raises a clear
error and leaves no half-written file.

Uses the tiny-synthetic preset's model and train configs with 2 groups of 4 samples and
8 eval prompts, the same geometry as tests/test_train_job.py, so the compiled sampler and
train step are shared between the two files."""
import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from rl.learner import NonFiniteError, init_train_state
from rl.loops import (LoopConfig, StreamSampler, collect_batch, rollout_spec, run, sample_groups,
                      score)
from rl.rollout import SamplingConfig
from rl.run import PRESETS, LoggingConfig, load_policy
from rl.tasks import SyntheticTask

PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=3, prompts_per_step=2, group_size=4, eval_prompts=8,
                           eval_every=0, save_every=0, eval_greedy=False)


def cfg(run_dir, loop=LOOP, **sections):
    """The preset with this loop (and other sections, e.g. asynchronous=), writing into
    run_dir, no wandb, no progress bar."""
    return dataclasses.replace(PRESET, loop=loop, run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False), **sections)


@pytest.fixture(scope="module")
def policy():
    config, params, task = load_policy(PRESET, 0)
    # Committed to the device like run()'s state, so every test reuses one compiled sampler.
    return config, jax.device_put(params, jax.devices()[0]), task


class _Task(SyntheticTask):
    """The preset's task with a replaceable reward (frozen dataclass subclass)."""

    def __init__(self, fn, names=("correct",)):
        base = SyntheticTask(**PRESET.task.kwargs)
        super().__init__(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_names", names)

    @property
    def reward_names(self):
        return self._names

    def reward(self, prompt, response):
        return self._fn(prompt, response, SyntheticTask.reward(self, prompt, response))


def sampler_of(config, task, loop=LOOP, train=PRESET.train):
    """The StreamSampler the synchronous source samples a step's groups with (uniform)."""
    run_cfg = dataclasses.replace(PRESET, loop=loop, train=train)
    return StreamSampler(rollout_spec(config, task, run_cfg), train, loop)


def committed_state(params, seed):
    """A fresh state placed like run() places it, so the compiled sampler is reused."""
    return jax.device_put(init_train_state(params, PRESET.train, seed), jax.devices()[0])


def no_temp_files(run_dir):
    return not [p for p in run_dir.rglob("*.tmp")]


def test_short_run_records_and_checkpoint(policy, tmp_path):
    config, params, task = policy
    res = run(config, params, task, cfg(tmp_path / "run"))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("eval", 0), ("train", 1), ("train", 2),
                                                       ("train", 3), ("eval", 3)]
    assert [r for r in lines if r["kind"] == "train"] == res.train
    assert [r["step"] for r in res.train] == [1, 2, 3]
    assert [r["step"] for r in res.eval] == [0, 3]
    for r in res.train:
        # Fixed-length responses: every sample has exactly `length` tokens.
        assert r["tokens"] == r["sampled_tokens"] == 2 * 4 * task.length
        assert 0.0 <= r["reward_mean"] <= 1.0 and math.isfinite(r["loss"])
        assert r["ratio_mean"] == pytest.approx(1.0)
        # The learner's log-probs equal the sampler's: the mismatch ratio is ~1.
        assert abs(r["mismatch_log_ratio_mean"]) < 1e-4
    assert res.data_position == 3 * 2 and int(res.state.step) == 3
    assert (tmp_path / "run" / "checkpoints" / "3").is_dir() and no_temp_files(tmp_path / "run")


def test_rewards_and_batch_match_the_samples(policy):
    config, params, task = policy
    state = committed_state(params, 5)
    batch, state2, pos, stats = collect_batch(state, 10, sampler_of(config, task))
    assert pos == 12 and stats["sampled_tokens"] == 2 * 4 * 4
    assert not np.array_equal(np.asarray(state2.rng), np.asarray(state.rng))
    prompts = task.train_prompts(10, 2)
    for row in range(8):
        p = prompts[row // 4]
        toks = batch.tokens[row]
        assert tuple(toks[:6]) == p.ids
        resp = toks[6:10]
        want = sum(int(a == 4 + b) for a, b in zip(resp, p.answer)) / 4  # independent scoring
        assert batch.rewards[row, 0] == pytest.approx(want)
        assert batch.loss_mask[row].tolist() == [False] * 6 + [True] * 4


def test_dynamic_sampling_drops_all_equal_groups(policy):
    config, params, task = policy
    # Prompts starting with symbol 0 or 1 always score 1 (no signal): they must be dropped.
    flat = _Task(lambda p, r, base: {"correct": 1.0} if p.ids[1] in (4, 5) else base)
    loop = dataclasses.replace(LOOP, dynamic_sampling=True, max_resample_rounds=6)
    state = committed_state(params, 0)
    batch, _, pos, stats = collect_batch(state, 0, sampler_of(config, flat, loop))
    kept_rows = np.asarray(batch.loss_mask).any(axis=1)
    for row in np.flatnonzero(kept_rows):
        assert batch.tokens[row, 1] not in (4, 5)
    assert pos >= 2 and stats["resample_rounds"] == pos // 2 - 1
    if stats["kept_groups"] >= 2:
        assert kept_rows.all()


def test_empty_batch_after_dynamic_sampling_raises(policy, tmp_path):
    config, params, _ = policy
    constant = _Task(lambda p, r, base: {"correct": 0.5})
    loop = dataclasses.replace(LOOP, dynamic_sampling=True, max_resample_rounds=1)
    with pytest.raises(ValueError, match="empty batch after dynamic sampling"):
        run(config, params, constant, cfg(tmp_path / "r", loop))
    assert no_temp_files(tmp_path / "r")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_raise(policy, tmp_path, value):
    config, params, _ = policy
    calls = []

    def reward(p, r, base):  # 8 eval rows, 8 rows of step 1, then a bad value in step 2
        calls.append(1)
        return {"correct": value if len(calls) == 20 else base["correct"]}

    # the step, the row and its group are named (group_size 4: row 3 is in group 0)
    with pytest.raises(NonFiniteError, match=r"^step 2: reward 'correct' of row 3 \(group 0\) "
                                             r"is .*NaN/inf"):
        run(config, params, _Task(reward), cfg(tmp_path / "r"))
    # What was written before the error is whole: valid JSON lines, no temp files.
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("eval", 0), ("train", 1)]
    assert no_temp_files(tmp_path / "r")


def test_wrong_reward_names_raise(policy):
    config, params, task = policy
    prompts = task.train_prompts(0, 2)
    spec = rollout_spec(config, task, PRESET).replace(sampling=SamplingConfig())
    traj = sample_groups(params, 0, spec, prompts, seed=0)
    renamed = _Task(lambda p, r, base: {"accuracy": base["correct"]})
    with pytest.raises(ValueError, match="expected exactly"):
        score(renamed, prompts, traj)
    text = _Task(lambda p, r, base: {"correct": "high"})
    with pytest.raises(ValueError, match="not a number"):
        score(text, prompts, traj)


def test_sequence_longer_than_the_model_raises(policy, tmp_path):
    config, params, task = policy
    short = config.replace(max_position_embeddings=8)  # prompt 6 + response 4 > 8
    with pytest.raises(ValueError, match="max_position_embeddings"):
        run(short, params, task, cfg(tmp_path / "r"))


def test_loop_config_validation():
    with pytest.raises(ValueError, match="group_size"):
        LoopConfig(group_size=0)
    with pytest.raises(ValueError, match="steps"):
        LoopConfig(steps=-1)


def test_evals_save_per_problem_results_that_resume_cleanly(policy, tmp_path):
    """Every eval pass writes each problem's accuracy to eval_problems.jsonl; their mean is
    the eval record's accuracy; a resumed run drops what came after its checkpoint."""
    config, params, task = policy
    loop = dataclasses.replace(LOOP, steps=2, eval_every=1, eval_greedy=True)
    run(config, params, task, cfg(tmp_path / "r", dataclasses.replace(loop, steps=1)))
    res = run(config, params, task, cfg(tmp_path / "r", loop), resume=True)
    lines = [json.loads(x) for x in (tmp_path / "r" / "eval_problems.jsonl").read_text()
             .splitlines()]
    assert [(r["step"], r["pass"]) for r in lines] == [
        (s, p) for s in (0, 1, 2) for p in ("sampled", "greedy")]
    evals = {r["step"]: r for r in res.eval}
    for r in lines:
        assert r["prompt_index"] == list(range(LOOP.eval_prompts))
        key = "accuracy" if r["pass"] == "sampled" else "greedy_accuracy"
        assert np.mean(r["accuracy"]) == pytest.approx(evals[r["step"]][key])
