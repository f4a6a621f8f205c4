"""The asynchronous loop: η = 0 reproduces the synchronous loop bit for bit (both modes);
deterministic staleness k samples step v with the params of exactly v − k; the exact
proximal log-probs recomputed from the snapshot ring equal the sampler's recorded ones
(no train–inference mismatch); a failing rollout thread, and a KeyboardInterrupt, end
the run with a final checkpoint and no thread left; deterministic resume is exact;
threaded resume counts the in-flight groups as dropped; the disk param ring
(snapshot_store="disk") gives the memory ring's run bit for bit with at most 2 versions in
memory, its checkpoints hard-link its files, and it resumes exactly.

Same geometry as tests/rl/test_sync_loop.py (tiny-synthetic preset, 2 groups of 4, 8
eval prompts), so the compiled sampler and train step are shared with it."""
import dataclasses
import json
import os
import threading
from typing import ClassVar

import jax
import numpy as np
import pytest
from test_sync_loop import LOOP, PRESET, cfg, policy, sampler_of  # noqa: F401  (same geometry)

from rl.learner import ParamSnapshots, init_train_state
from rl.loops import AsyncConfig, asynchronous, build_batch, run, run_async, sample_batch_groups
from rl.run import RunHooks
from rl.tasks import SyntheticTask

FAST = {"xla_backend_optimization_level": 0}  # a config of its own: compile it quickly


def rollout_threads():
    return [t for t in threading.enumerate() if t.name == "tandem-rollout" and t.is_alive()]


def leaves(result):
    return [np.asarray(x) for x in jax.tree.leaves(result.state.params)]


def ckpt_steps(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


class FailingTask(SyntheticTask):
    """The preset's task whose reward raises from call `fail_at` on (a frozen dataclass:
    the counter lives in a list)."""

    def __init__(self, fail_at):
        base = SyntheticTask(**PRESET.task.kwargs)
        super().__init__(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        object.__setattr__(self, "_calls", [0, fail_at])

    def reward(self, prompt, response):
        self._calls[0] += 1
        if self._calls[0] >= self._calls[1]:
            raise OSError("verifier service unreachable")
        return SyntheticTask.reward(self, prompt, response)


def test_eta_zero_equals_the_sync_loop(policy, tmp_path):
    config, params, task = policy
    sync = run(config, params, task, cfg(tmp_path / "sync"))
    for mode, rollout in (("deterministic", "static"), ("threaded", "static"),
                          ("threaded", "continuous")):  # continuous: equal-length responses
        acfg = AsyncConfig(max_staleness=0, mode=mode, rollout=rollout)
        res = run_async(config, params, task, cfg(tmp_path / (mode + rollout), asynchronous=acfg))
        for a, b in zip(leaves(sync), leaves(res)):
            np.testing.assert_array_equal(a, b)
        assert [r["reward_mean"] for r in res.train] == [r["reward_mean"] for r in sync.train]
        assert [r["version_lag_max"] for r in res.train] == [0, 0, 0]
        assert res.data_position == sync.data_position == 6
        assert not rollout_threads()
    assert int(res.state.step) == 3 and ckpt_steps(tmp_path / "threadedcontinuous") == [3]


def test_deterministic_staleness_and_exact_proximal(policy, tmp_path):
    config, params, task = policy
    k = 2
    loop = dataclasses.replace(LOOP, steps=5)
    acfg = AsyncConfig(max_staleness=k, mode="deterministic", proximal="exact")
    res = run_async(config, params, task, cfg(tmp_path / "r", loop, asynchronous=acfg),
                    hooks=RunHooks(compiler_options=FAST))
    for v, r in enumerate(res.train):  # record of step v + 1 trained at version v
        want = max(v - k, 0)
        assert r["behaviour_version_min"] == r["behaviour_version_max"] == want
        assert r["version_lag_max"] == v - want
        assert r["buffer_dropped_stale_groups"] == 0
        # π_prox is recomputed with the very params that sampled: no mismatch left.
        assert r["mismatch_log_ratio_abs_mean"] < 1e-4
    # Once the data is 2 versions old, the learner has moved away from the sampler.
    assert res.train[-1]["staleness_log_ratio_abs_mean"] > 1e-3


def test_ewma_proximal_with_beta_zero_is_the_current_policy(policy, tmp_path):
    config, params, task = policy
    # β = 0: θ_prox is the params after the last update = the step's starting params, so
    # the staleness factor π_θ/π_prox is 1 and the whole ratio is the mismatch π_prox/μ.
    acfg = AsyncConfig(max_staleness=1, mode="deterministic", proximal="ewma", ewma_beta=0.0)
    res = run_async(config, params, task, cfg(tmp_path / "r", asynchronous=acfg),
                    hooks=RunHooks(compiler_options=FAST))
    for r in res.train:
        assert r["staleness_log_ratio_abs_mean"] < 1e-5
        assert r["mismatch_log_ratio_abs_mean"] == pytest.approx(r["total_log_ratio_abs_mean"],
                                                                abs=1e-5)
    assert res.train[-1]["mismatch_log_ratio_abs_mean"] > 1e-3  # data one version old


def test_deterministic_resume_is_exact(policy, tmp_path):
    config, params, task = policy
    acfg = AsyncConfig(max_staleness=1, mode="deterministic")
    loop4 = dataclasses.replace(LOOP, steps=4)
    straight = run_async(config, params, task, cfg(tmp_path / "a", loop4, asynchronous=acfg))
    run_async(config, params, task,
              cfg(tmp_path / "b", dataclasses.replace(LOOP, steps=2), asynchronous=acfg))
    assert sorted(os.listdir(tmp_path / "b" / "snapshots" / "2")) == ["v1.npz", "v2.npz"]
    resumed = run_async(config, params, task, cfg(tmp_path / "b", loop4, asynchronous=acfg),
                        resume=True)
    for a, b in zip(leaves(straight), leaves(resumed)):
        np.testing.assert_array_equal(a, b)


def test_rollout_thread_error_surfaces_with_a_final_checkpoint(policy, tmp_path):
    config, params, _ = policy
    task = FailingTask(fail_at=8 + 2 * 8 + 3)  # eval (8 rows), two batches, then fail
    loop = dataclasses.replace(LOOP, steps=50)
    with pytest.raises(RuntimeError, match="rollout thread failed: OSError: verifier") as info:
        run_async(config, params, task,
                  cfg(tmp_path / "r", loop, asynchronous=AsyncConfig(max_staleness=1)))
    cause = info.value.__cause__
    assert isinstance(cause, OSError)
    frames = []
    tb = cause.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "reward" in frames and "run" in frames  # the producer thread's own traceback
    assert not rollout_threads()
    steps = ckpt_steps(tmp_path / "r")
    assert steps and 1 <= steps[-1] <= 2
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, steps[-1] + 1))


def test_keyboard_interrupt_checkpoints_and_threaded_resume(policy, tmp_path):
    config, params, task = policy
    loop = dataclasses.replace(LOOP, steps=6)
    acfg = AsyncConfig(max_staleness=1, rollout="continuous")

    def stop_at_two(record):
        if record["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_async(config, params, task, cfg(tmp_path / "r", loop, asynchronous=acfg),
                  hooks=RunHooks(on_step=stop_at_two))
    assert ckpt_steps(tmp_path / "r") == [2] and not rollout_threads()
    res = run_async(config, params, task,
                    cfg(tmp_path / "r", dataclasses.replace(loop, steps=3), asynchronous=acfg),
                    resume=True)
    assert [r["step"] for r in res.train] == [1, 2, 3] and int(res.state.step) == 3
    # Groups queued or being sampled at the checkpoint are not restored: counted as dropped.
    first = res.train[2]
    assert first["dropped_on_resume_groups"] >= 1
    assert first["data_position"] >= 2 * 2 + 2
    assert not rollout_threads()


def test_downweighted_tokens_become_loss_weights(policy):
    config, params, task = policy
    state = jax.device_put(init_train_state(params, PRESET.train, 3), jax.devices()[0])
    sampler = sampler_of(config, task)
    groups, _, _, _ = sample_batch_groups(state, 0, sampler)
    weights = []
    for i, g in enumerate(groups):
        w = np.ones(np.asarray(g.traj.response_mask).shape, np.float32)
        w[:, 1] = 0.5 + i  # a distinct factor at response token 1 of each group
        weights.append(w)
    batch = build_batch(groups, sampler.spec, PRESET.train, token_weights=weights)
    lw = np.asarray(batch.loss_weights)
    for row in range(lw.shape[0]):
        p = int(np.argmax(np.asarray(batch.loss_mask)[row]))  # first response token
        want = np.ones(lw.shape[1], np.float32)
        want[p + 1] = 0.5 + row // LOOP.group_size
        np.testing.assert_array_equal(lw[row], want)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_staleness": -1}, "max_staleness"),
    ({"mode": "eager"}, "mode"),
    ({"mode": "deterministic", "rollout": "continuous"}, "needs mode='threaded'"),
    ({"proximal": "exact", "stale_policy": "downweight"}, "needs stale_policy='drop'"),
    ({"max_staleness": 3, "snapshot_capacity": 3}, "snapshot_capacity"),
    ({"ewma_beta": 1.0}, "ewma_beta"),
    ({"snapshot_store": "ssd"}, "snapshot_store must be one of"),
    ({"snapshot_store": "disk"}, "snapshot_store='disk' needs mode='deterministic'"),
])
def test_async_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncConfig(**kwargs)


def test_cli_async_flags(tmp_path):
    from experiments.common.flags import build_train_parser, config_from_args
    from experiments.common.train_cli import main

    def async_config(argv):
        return config_from_args(build_train_parser().parse_args(argv)).asynchronous

    assert async_config([]) is None  # no flag: the sync loop
    acfg = async_config(
        ["--max-staleness", "3", "--async-mode", "deterministic", "--rollout", "april",
         "--over-provision", "2", "--proximal", "versions", "--stale-policy", "downweight"])
    assert acfg == AsyncConfig(max_staleness=3, mode="deterministic", rollout="april",
                               over_provision=2.0, proximal="versions", stale_policy="downweight")
    assert async_config(["--rollout", "continuous"]).max_staleness == 1
    assert async_config(["--async-mode", "deterministic", "--set", "async.snapshot_store=disk"]
                        ) == AsyncConfig(mode="deterministic", snapshot_store="disk")
    summary = main(["--steps", "2", "--run-dir", str(tmp_path / "r"), "--wandb", "disabled",
                    "--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", "8",
                    "--eval-every", "0", "--no-progress", "--max-staleness", "1"])
    assert summary["steps"] == 2 and summary["config"]["async"]["max_staleness"] == 1
    with pytest.raises(SystemExit):
        main(["--async-mode", "deterministic", "--rollout", "continuous", "--no-progress"])


def test_rollout_devices_must_leave_a_training_device(policy, tmp_path):
    config, params, task = policy
    n = len(jax.devices())
    with pytest.raises(ValueError, match="leaves no training device"):
        run_async(config, params, task,
                  cfg(tmp_path / "r", asynchronous=AsyncConfig(rollout_devices=n)))
    assert not rollout_threads()


class WatchedRing(ParamSnapshots):
    """The loop's ring, recording the most versions it held (in all, in memory) and, on
    disk, checking after every put and read that its folder holds exactly its versions."""

    most: ClassVar[dict] = {"held": 0, "resident": 0}

    def put(self, *args, **kwargs):
        out = super().put(*args, **kwargs)
        self.watch()
        return out

    def __getitem__(self, version):
        out = super().__getitem__(version)
        self.watch()
        return out

    def watch(self):
        for key, n in (("held", len(self)), ("resident", len(self.resident()))):
            WatchedRing.most[key] = max(WatchedRing.most[key], n)
        if self.directory is not None:
            assert sorted(os.listdir(self.directory)) == sorted(f"v{v}.npz" for v in self)


def comparable(records):
    return [{k: v for k, v in r.items() if not k.endswith("_s")
             and k not in ("tokens_per_s", "peak_rss_mb", "peak_rss_per_step")} for r in records]


def test_disk_ring_equals_the_memory_ring_and_resumes_exactly(policy, tmp_path, monkeypatch):
    config, params, task = policy
    loop = dataclasses.replace(LOOP, steps=6, save_every=2, keep_checkpoints=2)
    mem = AsyncConfig(max_staleness=3, mode="deterministic", proximal="exact")
    disk = dataclasses.replace(mem, snapshot_store="disk")
    hooks = RunHooks(compiler_options=FAST)
    want = run_async(config, params, task, cfg(tmp_path / "mem", loop, asynchronous=mem),
                     hooks=hooks)
    monkeypatch.setattr(asynchronous, "ParamSnapshots", WatchedRing)
    got = run_async(config, params, task, cfg(tmp_path / "disk", loop, asynchronous=disk),
                    hooks=hooks)
    for a, b in zip(leaves(want), leaves(got)):
        np.testing.assert_array_equal(a, b)
    assert comparable(got.train) == comparable(want.train)
    assert [r["behaviour_version_max"] for r in got.train] == [0, 0, 0, 0, 1, 2]
    # the ring held its 5 = k + 2 versions, never more than 2 of them in memory
    assert WatchedRing.most == {"held": 5, "resident": 2}
    snaps = tmp_path / "disk" / "snapshots"
    assert os.listdir(snaps / "ring") == []  # the run's end deletes the ring's files
    assert sorted(os.listdir(snaps)) == ["4", "6", "ring"]  # step 2's pruned with its checkpoint
    for step, versions in ((4, [1, 2, 3, 4]), (6, [3, 4, 5, 6])):
        assert sorted(os.listdir(snaps / str(step))) == [f"v{v}.npz" for v in versions]
        assert sorted(os.listdir(tmp_path / "mem" / "snapshots" / str(step))) == \
            [f"v{v}.npz" for v in versions]
    # a version saved by two checkpoints is one file (hard links to the ring's file)
    assert os.stat(snaps / "4" / "v3.npz").st_ino == os.stat(snaps / "6" / "v3.npz").st_ino
    # stopped after step 3, resumed to step 6: the same run, bit for bit
    WatchedRing.most.update(held=0, resident=0)
    run_async(config, params, task, cfg(tmp_path / "r", dataclasses.replace(loop, steps=3),
                                        asynchronous=disk), hooks=hooks)
    resumed = run_async(config, params, task, cfg(tmp_path / "r", loop, asynchronous=disk),
                        hooks=hooks, resume=True)
    for a, b in zip(leaves(want), leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    after = [r for r in comparable(resumed.train) if r["step"] > 3]
    assert [r["step"] for r in after] == [4, 5, 6]
    for r in after:
        r.pop("dropped_on_resume_groups", None)
        assert {k: v for k, v in r.items() if not k.startswith("buffer_")} == \
            {k: v for k, v in comparable(want.train)[r["step"] - 1].items()
             if not k.startswith("buffer_")}
    assert WatchedRing.most["resident"] <= 2


def test_batch_version_metrics_count_rows_drawn_under_two_versions():
    """batch_version_metrics on a hand-made batch (loss tokens only; padding stamped -1 and
    other versions outside the loss mask do not count): rows 0 and 2 mix versions 3 and
    4, row 1 is all version 4, row 3 has no loss token (not a row of the share)."""
    import types

    mask = np.array([[0, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 1], [0, 0, 0, 0]], bool)
    vers = np.array([[-1, 3, 4, 9], [7, 4, 4, 4], [4, 4, 4, 3], [-1, -1, -1, -1]], np.int32)
    got = asynchronous.batch_version_metrics(types.SimpleNamespace(loss_mask=mask,
                                                                   versions=vers), 5)
    assert got["mixed_version_rows"] == 2 / 3
    assert got["behaviour_version_min"] == 3 and got["behaviour_version_max"] == 4
    assert got["version_lag_max"] == 2 and got["version_lag_mean"] == np.mean([2, 1] + [1] * 3
                                                                              + [1, 2])
