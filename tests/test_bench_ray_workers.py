"""The Ray benchmark's sides are the commands it says (the learner pinned to core 0, the
worker to core 1, the deterministic schedule on Ray; sync on every core), and its committed
page, when there is one, is its JSON rendered."""
import argparse
import json

from experiments.bench import ray_workers as bench
from experiments.common.flags import config_from_argv


def test_the_sides_run_what_the_doc_says(tmp_path):
    args = argparse.Namespace(steps=12, eta=1)
    sync = bench.side_command("sync", "rollout_heavy", tmp_path, args)
    ray = bench.side_command("ray", "rollout_heavy", tmp_path, args)
    assert ray[:3] == ["taskset", "-c", "0"] and "taskset" not in sync
    cfg_sync, _ = config_from_argv(sync[3:])
    cfg_ray, _ = config_from_argv(ray[6:])
    assert cfg_sync.asynchronous is None
    a = cfg_ray.asynchronous
    assert a.backend == "ray" and a.mode == "deterministic" and a.max_staleness == 1
    assert a.worker_affinity == (1,) and a.rollout_workers == 1
    for c in (cfg_sync, cfg_ray):
        assert dict(c.task.options)["length"] == 128 and c.loop.steps == 12
        assert (c.loop.prompts_per_step, c.loop.group_size) == (1, 4)
        c.validate()


def test_the_committed_page_is_its_json_rendered():
    assert bench.RESULT.is_file(), "the committed result (python -m experiments.bench.ray_workers)"
    result = json.loads(bench.RESULT.read_text())
    assert bench.PAGE.read_text() == bench.render_page(result)
    assert bench.summary_row(result, "ray-workers.md", index=True) in \
        bench.INDEX.read_text().splitlines()


def test_the_ceiling_is_the_sync_step_over_the_longer_ray_phase():
    sync = {"step_s": 0.09}
    assert bench.ceiling(sync, {"learner_step_s": 0.075, "worker_sample_s": 0.04}) == \
        0.09 / 0.075
    assert bench.ceiling(sync, {"learner_step_s": 0.03, "worker_sample_s": 0.06}) == 1.5


def test_paired_ratios_pair_each_reps_two_runs():
    runs = [{"rep": 1, "side": "ray", "steps_per_hour": 30.0},
            {"rep": 0, "side": "sync", "steps_per_hour": 10.0},
            {"rep": 0, "side": "ray", "steps_per_hour": 12.0},
            {"rep": 1, "side": "sync", "steps_per_hour": 20.0}]
    assert bench.paired_ratios(runs) == [1.2, 1.5]
