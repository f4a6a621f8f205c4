"""DARS in the synchronous loop (rl.loops.scheduling): stage 2 comes in whole groups of N
for the hard prompts, the allocation sums to the budget (hand-computed largest-remainder
apportionment in float64), every batch has T/N groups, and a run resumes bit for bit."""
import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from rl.loops import SchedulerOptions, run
from rl.loops.buffer import ScoredGroup
from rl.loops.scheduling import make_prompt_source
from rl.run import PRESETS, LoggingConfig, load_policy
from rl.tasks import SyntheticTask
from rl.trajectory import Trajectory

PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=3, prompts_per_step=2, group_size=4, eval_prompts=8,
                           eval_every=0, save_every=0, eval_greedy=False)


def cfg(run_dir, loop=LOOP, **sections):
    """The preset with this loop (and other sections, e.g. scheduler=), writing into
    run_dir, no wandb, no progress bar."""
    return dataclasses.replace(PRESET, loop=loop, run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False), **sections)


def hand_allocation(acc, n, blocks):
    """ET weights N − n with N = min(4n, round(n / (4 a (1 − a)))) (the official table for
    n = 8: 32, 18, 11, 9 rollouts at a = 0, 1/8, 2/8, 3/8), 3n at a = 0, 0 for a >= 1/2;
    then `blocks` apportioned by largest remainder (ties to the lower index); no hard
    prompt: equal shares."""
    w = []
    for a in acc:
        if a >= 0.5:
            w.append(0.0)
        elif a == 0:
            w.append(3.0 * n)
        else:
            w.append(min(4 * n, math.floor(n / (4 * a * (1 - a)) + 0.5)) - n)
    if sum(w) == 0:
        w = [1.0] * len(w)
    quota = [blocks * x / sum(w) for x in w]
    out = [math.floor(q) for q in quota]
    order = sorted(range(len(w)), key=lambda i: (-(quota[i] - out[i]), i))
    for i in order[:blocks - sum(out)]:
        out[i] += 1
    return out


class FixedRewards:
    """A fake draw: prompt index -> the group's rewards (stage 1), recording the prompts."""

    def __init__(self, rewards_by_index, n):
        self.rewards, self.n, self.calls = rewards_by_index, n, []

    def __call__(self, state, prompts):
        self.calls.append([p.index for p in prompts])
        n = self.n
        traj = Trajectory(
            prompt_ids=np.ones((n, 2), np.int32), prompt_lengths=np.full(n, 2, np.int32),
            response_ids=np.ones((n, 1), np.int32), response_mask=np.ones((n, 1), bool),
            behaviour_logprobs=np.zeros((n, 1), np.float32), versions=np.zeros((n, 1), np.int32),
            group_ids=np.zeros(n, np.int32), finished=np.zeros(n, bool),
            truncated=np.ones(n, bool))
        groups, signal = [], []
        for p in prompts:
            r = np.asarray(self.rewards[p.index], np.float64)
            groups.append(ScoredGroup(traj=traj, rewards={"correct": r}))
            signal.append(r)
        return groups, signal, n * len(prompts), state


@pytest.mark.parametrize("acc", [[0.0, 0.25, 0.5, 1.0], [0.25, 0.25, 0.125, 0.375],
                                 [1.0, 0.75, 0.5, 1.0]])
def test_dars_extra_groups_go_to_hard_prompts_and_sum_to_the_budget(acc):
    n, b, budget = 8, 4, 8 * 4 * 3  # T = 3 · B · N: E = 2 · B · N = 8 extra groups
    loop = dataclasses.replace(LOOP, prompts_per_step=b, group_size=n)
    task = SyntheticTask(**PRESET.task.kwargs)
    source = make_prompt_source(SchedulerOptions("dars", dars_budget=budget), task, loop, None)
    stream = task.train_prompts(5, b)
    draw = FixedRewards({p.index: np.repeat([1.0, 0.0], [round(a * n), n - round(a * n)])
                         for p, a in zip(stream, acc)}, n)
    groups, _, pos, stats = source.sample_batch(0, None, 5, draw)
    assert pos == 5 + b and len(groups) == budget // n == source.groups_per_step(n)
    assert draw.calls[0] == [p.index for p in stream]  # stage 1: the stream, in order
    extra = [draw.calls[1].count(p.index) for p in stream] if len(draw.calls) > 1 else [0] * b
    assert extra == hand_allocation(acc, n, (budget - b * n) // n)
    assert (b + sum(extra)) * n == budget and stats["dars_extra_groups"] == sum(extra)
    assert stats["sampled_tokens"] == budget  # one token per rollout in the fake draw


def test_dars_budget_must_be_whole_groups():
    task = SyntheticTask(**PRESET.task.kwargs)
    with pytest.raises(ValueError, match="multiple of unit"):
        make_prompt_source(SchedulerOptions("dars", dars_budget=2 * 4 + 3), task, LOOP, None)
    with pytest.raises(ValueError, match="micro_batches=3"):  # 16 rollouts = 4 groups
        make_prompt_source(SchedulerOptions("dars"), task, LOOP, None,
                           config=dataclasses.replace(PRESET.train, micro_batches=3))
    with pytest.raises(ValueError, match="replay"):
        SchedulerOptions("dars", replay_fraction=0.5)


def test_batch_rows_is_what_the_learner_sees():
    """The row count the CLI validates a mesh against (SchedulerOptions.batch_rows) equals
    the rows of the batches a DARS / uniform source actually produces."""
    task = SyntheticTask(**PRESET.task.kwargs)
    for options, rows in ((SchedulerOptions(), 2 * 4), (SchedulerOptions("dars"), 2 * 2 * 4),
                          (SchedulerOptions("dars", dars_budget=24), 24),
                          (SchedulerOptions("dps", pool_size=8), 2 * 4)):
        assert options.batch_rows(LOOP.prompts_per_step, LOOP.group_size) == rows
    source = make_prompt_source(SchedulerOptions("dars", dars_budget=24), task, LOOP, None)
    assert source.scheduler.config.budget == 24


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()

    def measured(k):
        return k.endswith(("_s", "_mb")) or k == "tokens_per_s"

    return [{k: v for k, v in json.loads(x).items() if not measured(k)} for x in lines]


def test_dars_runs_with_a_fixed_batch_shape_and_resumes_bit_exactly(tmp_path):
    config, params, task = load_policy(PRESET, 0)
    params = jax.device_put(params, jax.devices()[0])
    opts = SchedulerOptions("dars")  # T = 2 · B · N: 4 groups per batch
    full = run(config, params, task, cfg(tmp_path / "full", scheduler=opts))
    assert [r["kept_groups"] for r in full.train] == [4, 4, 4]
    assert [r["dars_extra_groups"] for r in full.train] == [2, 2, 2]
    run(config, params, task, cfg(tmp_path / "split", dataclasses.replace(LOOP, steps=2),
                                  scheduler=opts))
    resumed = run(config, params, task, cfg(tmp_path / "split", scheduler=opts), resume=True)
    train = [r for r in records(tmp_path / "full") if r["kind"] == "train"]
    assert train == [r for r in records(tmp_path / "split") if r["kind"] == "train"]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)))
