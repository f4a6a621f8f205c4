"""RolloutOptions.dtype: the train rollouts sample at another compute dtype than the
learner (a bf16 inference engine beside an fp32 learner), so the behaviour log-probs carry
a real train/inference mismatch; evals stay at the model's dtype.

Reference: teacher-forced log-probs from one full forward pass (models.decoder.forward, no
KV cache), log-softmax in float64, at the model's dtype and at bfloat16."""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from models.decoder import forward
from rl.loops import (AsyncConfig, RolloutOptions, RolloutSpec, rollout_model_config, run, run_async,
                      sample_groups)
from rl.rollout import SamplingConfig
from rl.run import PRESETS, LoggingConfig, load_policy

PRESET = PRESETS["tiny-synthetic"]
T = PRESET.train.temperature


@pytest.fixture(scope="module")
def policy():
    return load_policy(PRESET, 0)


def teacher_forced(params, config, traj) -> tuple[np.ndarray, np.ndarray]:
    """([B, R_max] float64 log softmax(logits / T) of each response token, [B, R_max] mask)."""
    plen, rlen = np.asarray(traj.prompt_lengths), np.asarray(traj.response_lengths)
    toks = np.zeros((traj.batch_size, int((plen + rlen).max())), np.int32)
    for i in range(traj.batch_size):
        toks[i, :plen[i]] = np.asarray(traj.prompt_ids[i, :plen[i]])
        toks[i, plen[i]:plen[i] + rlen[i]] = np.asarray(traj.response_ids[i, :rlen[i]])
    logits = np.asarray(forward(params, config, toks)).astype(np.float64)
    out = np.zeros(np.asarray(traj.behaviour_logprobs).shape)
    for i in range(traj.batch_size):
        for t in range(rlen[i]):
            z = logits[i, plen[i] - 1 + t] / T
            out[i, t] = z[toks[i, plen[i] + t]] - z.max() - math.log(np.exp(z - z.max()).sum())
    return out, np.asarray(traj.response_mask, bool)


def test_rollout_model_config_swaps_only_the_compute_dtype(policy):
    config = policy[0]
    assert rollout_model_config(config, None) is config
    assert rollout_model_config(config, config.dtype) is config
    bf = rollout_model_config(config, "bfloat16")
    assert (bf.dtype, bf.param_dtype) == ("bfloat16", config.param_dtype)
    assert dataclasses.replace(bf, dtype=config.dtype) == config


def test_bf16_rollouts_record_the_bf16_engines_logprobs(policy):
    config, params, task = policy
    prompts = task.train_prompts(0, 2)
    gaps = {}
    for dtype in (None, "bfloat16"):
        spec = RolloutSpec(task, config, group_size=4, segment_len=PRESET.rollout.segment_len,
                           sampling=SamplingConfig(temperature=T), compute_dtype=dtype)
        traj = sample_groups(params, 0, spec, prompts, seed=3)
        mu = np.asarray(traj.behaviour_logprobs, np.float64)
        ref32, mask = teacher_forced(params, config, traj)
        ref16, _ = teacher_forced(params, dataclasses.replace(config, dtype="bfloat16"), traj)
        gaps[dtype] = (np.abs(mu - ref32)[mask].mean(), np.abs(mu - ref16)[mask].max())
    # the fp32 engine is the learner's policy; the bf16 engine is not (a real mismatch,
    # thousands of times the fp32 engine's), and it is the bf16 model (within bf16 rounding)
    assert gaps[None][0] < 1e-6
    assert gaps["bfloat16"][0] > 1e-4 > 100 * gaps[None][0]
    assert gaps["bfloat16"][1] < 1e-2


def test_loop_logs_the_mismatch_and_evals_at_the_models_dtype(policy, tmp_path):
    config, params, task = policy
    loop = dataclasses.replace(PRESET.loop, steps=2, prompts_per_step=2, group_size=4,
                               eval_prompts=8, eval_every=0, save_every=0, eval_greedy=True)
    results = {}
    for dtype in (None, "bfloat16"):
        run_dir = tmp_path / str(dtype)
        cfg = dataclasses.replace(PRESET, loop=loop,
                                  rollout=dataclasses.replace(PRESET.rollout, dtype=dtype),
                                  run_dir=str(run_dir),
                                  logging=LoggingConfig(wandb="disabled", progress=False))
        run(config, params, task, cfg)
        results[dtype] = [json.loads(line)
                          for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {d: [r for r in recs if r["kind"] == "train"] for d, recs in results.items()}
    evals = {d: [r for r in recs if r["kind"] == "eval"] for d, recs in results.items()}
    # step 1 starts from the same params: |log π_prox/μ| is the engine's dtype gap alone
    assert train[None][0]["mismatch_log_ratio_abs_mean"] < 1e-6
    assert train["bfloat16"][0]["mismatch_log_ratio_abs_mean"] > 1e-4
    # the step-0 eval samples the same policy at the model's dtype either way
    keys = [k for k in evals[None][0] if "accuracy" in k or "length" in k]
    assert keys and all(evals[None][0][k] == evals["bfloat16"][0][k] for k in keys)


def test_async_eta_zero_equals_sync_with_bf16_rollouts(policy, tmp_path):
    """Both async modes sample with the rollout dtype (the deterministic loop through the
    sync sampler, the threaded one through its producer): at η = 0 they equal the sync loop
    bit for bit, and their behaviour log-probs are the bf16 engine's (|log π_prox/μ| at
    η = 0 is the dtype gap alone; ~0 with fp32 rollouts)."""
    config, params, task = policy
    loop = dataclasses.replace(PRESET.loop, steps=2, prompts_per_step=2, group_size=4,
                               eval_prompts=4, eval_every=0, save_every=0)

    def cfg(name, dtype="bfloat16", **sections):
        return dataclasses.replace(PRESET, loop=loop,
                                   rollout=dataclasses.replace(PRESET.rollout, dtype=dtype),
                                   run_dir=str(tmp_path / name),
                                   logging=LoggingConfig(wandb="disabled", progress=False),
                                   **sections)

    def leaves(res):
        return [np.asarray(x) for x in jax.tree.leaves(res.state.params)]

    sync = run(config, params, task, cfg("sync"))
    fp32 = run(config, params, task, cfg("fp32", None))
    assert fp32.train[0]["mismatch_log_ratio_abs_mean"] < 1e-6
    for mode in ("deterministic", "threaded"):
        res = run_async(config, params, task,
                        cfg(mode, asynchronous=AsyncConfig(max_staleness=0, mode=mode)))
        for a, b in zip(leaves(sync), leaves(res)):
            np.testing.assert_array_equal(a, b)
        assert res.train[0]["mismatch_log_ratio_abs_mean"] > 1e-4


def test_rollout_dtype_is_validated():
    assert RolloutOptions(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="RolloutOptions.dtype"):
        RolloutOptions(dtype="float16")
    # the path it had before it was the rollout section's still works
    old = PRESET.override("loop.rollout_dtype", "bfloat16")
    assert old.rollout.dtype == "bfloat16" and old == PRESET.override("rollout.dtype", "bfloat16")
