"""The prompt scheduler in the synchronous loop (rl.loops.scheduling): uniform samples the
train stream in order and gives the same run as the default; dps chooses from its pool,
saves its state in the checkpoint, and 2 steps + resume + 1 step == 3 steps, bit for bit.

Tiny-synthetic preset, 2 groups of 4, 8 eval prompts (the geometry of test_sync_loop)."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from rl.loops import LoopConfig, SchedulerOptions, run
from rl.loops.scheduling import make_prompt_source
from rl.run import PRESETS, LoggingConfig, load_policy
from rl.tasks import SyntheticTask

PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=3, prompts_per_step=2, group_size=4, eval_prompts=8,
                           eval_every=0, save_every=0, eval_greedy=False)


def cfg(run_dir, loop=LOOP, **sections):
    """The preset with this loop (and other sections, e.g. scheduler=), writing into
    run_dir, no wandb, no progress bar."""
    return dataclasses.replace(PRESET, loop=loop, run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False), **sections)


class RecordingTask(SyntheticTask):
    """The preset's task; remembers the train prompts it was asked to reward, in order."""

    def __init__(self):
        base = SyntheticTask(**PRESET.task.kwargs)
        super().__init__(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        object.__setattr__(self, "_train", set())
        object.__setattr__(self, "rewarded", [])

    def train_prompts(self, start, count):
        out = SyntheticTask.train_prompts(self, start, count)
        self._train.update(id(p) for p in out)
        return out

    def reward(self, prompt, response):
        if id(prompt) in self._train:
            self.rewarded.append(prompt.index)
        return SyntheticTask.reward(self, prompt, response)


@pytest.fixture(scope="module")
def policy():
    config, params, _ = load_policy(PRESET, 0)
    return config, jax.device_put(params, jax.devices()[0])


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    def measured(k):  # wall times and memory: not part of what a run computes
        return k.endswith(("_s", "_mb")) or k == "tokens_per_s"

    return [{k: v for k, v in json.loads(x).items() if not measured(k)} for x in lines]


def same_params(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_uniform_samples_the_stream_in_order_and_matches_the_default_run(policy, tmp_path):
    config, params = policy
    task = RecordingTask()
    default = run(config, params, task, cfg(tmp_path / "a"))
    n = LOOP.group_size
    # the stream positions 0..5 in order, each rewarded once per rollout
    assert task.rewarded == [i for i in range(3 * 2) for _ in range(n)]
    explicit = run(config, params, RecordingTask(),
                   cfg(tmp_path / "b", scheduler=SchedulerOptions("uniform")))
    ra, rb = records(tmp_path / "a"), records(tmp_path / "b")
    assert [sorted(k for k in x if x[k] != y.get(k)) for x, y in zip(ra, rb)] == [[]] * len(ra)
    assert same_params(default.state.params, explicit.state.params)


def test_dps_chooses_from_its_pool_and_resumes_bit_exactly(policy, tmp_path):
    config, params = policy
    opts = SchedulerOptions("dps", pool_size=6)
    task = RecordingTask()
    full = run(config, params, task, cfg(tmp_path / "full", scheduler=opts))
    assert set(task.rewarded) <= set(range(6)) and len(task.rewarded) == 3 * 2 * LOOP.group_size
    short = dataclasses.replace(LOOP, steps=2)
    run(config, params, RecordingTask(), cfg(tmp_path / "split", short, scheduler=opts))
    resumed = run(config, params, RecordingTask(), cfg(tmp_path / "split", scheduler=opts),
                  resume=True)
    train = [r for r in records(tmp_path / "full") if r["kind"] == "train"]
    train_split = [r for r in records(tmp_path / "split") if r["kind"] == "train"]
    assert train == train_split
    assert same_params(full.state.params, resumed.state.params)


def test_resume_without_the_scheduler_in_the_record_is_refused(policy, tmp_path):
    config, params = policy
    short = dataclasses.replace(LOOP, steps=1)
    run(config, params, RecordingTask(), cfg(tmp_path / "r", short))
    with pytest.raises(ValueError, match="scheduler"):
        run(config, params, RecordingTask(), cfg(tmp_path / "r", dataclasses.replace(LOOP, steps=2),
                                                 scheduler=SchedulerOptions("dps", pool_size=6)),
            resume=True)


def test_dots_source_embeds_the_pool_and_measures_its_reference_set(policy):
    _, params = policy
    task = RecordingTask()
    source = make_prompt_source(SchedulerOptions("dots", pool_size=8, reference_size=3),
                                task, LOOP, params)
    table = np.asarray(params["embed"]["embedding"], np.float64)
    pool = task.train_prompts(0, 8)
    np.testing.assert_allclose(source.scheduler.embeddings[5],
                               [sum(table[t, j] for t in pool[5].ids) / len(pool[5].ids)
                                for j in range(table.shape[1])], rtol=1e-12)
    drawn = []

    def draw(state, prompts):  # the reference rollouts: 1 token each, all correct
        drawn.append([p.index for p in prompts])
        return [], [np.ones(LOOP.group_size) for _ in prompts], len(prompts), state

    state, tokens, stats = source.measure(0, "s", draw)
    assert state == "s" and tokens == stats["reference_groups"] == 3 and len(set(drawn[0])) == 3
    np.testing.assert_array_equal(source.scheduler.ref_difficulty, [0.0] * 3)
    prompts, pos = source.next(0, 10)
    assert len(prompts) == 2 and pos == 12
    source.record(prompts, [np.ones(4), np.zeros(4)])
    # μ = 2: the round's second step measures nothing
    assert source.measure(1, "s", draw) == ("s", 0, {"reference_groups": 0})
    second, _ = source.next(1, 12)
    assert len({p.index for p in prompts + second}) == 4
    assert source.scheduler.config.reference_size == 3
    auto = make_prompt_source(SchedulerOptions("dots", pool_size=8), task, LOOP, params)
    assert auto.scheduler.config.reference_size == 1  # μ·B/4 = 2·2/4
    with pytest.raises(ValueError, match="selection_interval"):
        make_prompt_source(SchedulerOptions("dots", pool_size=3), task, LOOP, params)


def test_dots_runs_and_resumes_bit_exactly(policy, tmp_path):
    config, params = policy
    opts = SchedulerOptions("dots", pool_size=6, reference_size=2)
    full = run(config, params, RecordingTask(), cfg(tmp_path / "full", scheduler=opts))
    assert [r["reference_groups"] for r in full.train] == [2, 0, 2]
    one_step = dataclasses.replace(LOOP, steps=1)  # stops mid-round
    run(config, params, RecordingTask(), cfg(tmp_path / "split", one_step, scheduler=opts))
    resumed = run(config, params, RecordingTask(), cfg(tmp_path / "split", scheduler=opts),
                  resume=True)
    assert same_params(full.state.params, resumed.state.params)
    assert [r["reference_groups"] for r in resumed.train][-2:] == [0, 2]


@pytest.mark.parametrize("kw,match", [({"name": "dars", "replay_fraction": 0.5}, "replay"),
                                      ({"name": "x"}, "unknown prompt scheduler"),
                                      ({"name": "dps", "pool_size": 0}, "pool_size")])
def test_scheduler_options_refuse_what_the_loop_cannot_run(kw, match):
    with pytest.raises(ValueError, match=match):
        SchedulerOptions(**kw)


def test_non_uniform_scheduler_refuses_dynamic_sampling(policy, tmp_path):
    config, params = policy
    loop = dataclasses.replace(LOOP, dynamic_sampling=True)
    assert isinstance(loop, LoopConfig)
    with pytest.raises(ValueError, match="dynamic"):
        run(config, params, RecordingTask(),
            cfg(tmp_path / "d", loop, scheduler=SchedulerOptions("dps", pool_size=6)))
