"""The agentic async driver on synthetic run dirs: its run order alternates the arms, its
train commands configure the arm they name, read_run counts a resumed run's steps once,
compare's d / se / wall ratio / verdict agree with a direct numpy computation, and the
committed page is the one its JSON renders."""
import argparse
import json
import math

import numpy as np
import pytest

from experiments.common.flags import config_from_argv
from experiments.repro import agentic_async as aa
from tests.run_dirs import write_run


def test_run_order_alternates_and_limits_the_inline_arm():
    order = aa.run_order([0, 1, 2], inline_seeds=[0])
    assert order == [("async", 0), ("sync_inline", 0), ("sync_concurrent", 0),
                     ("sync_concurrent", 1), ("async", 1),
                     ("async", 2), ("sync_concurrent", 2)]
    assert len(aa.run_order([0, 1])) == 6


@pytest.mark.parametrize("arm", list(aa.ARMS))
def test_train_commands_configure_their_arm(arm, tmp_path):
    args = argparse.Namespace(steps=6, eval_prompts=128)
    cfg, resume = config_from_argv(aa.train_command(arm, 3, tmp_path / "r", args)[3:])
    assert resume is None and cfg.loop.seed == 3 and cfg.loop.steps == 6
    assert cfg.loop.tool_latency == aa.LATENCY and cfg.loop.eval_sampled_prompts == 0
    assert cfg.loop.max_concurrent_tool_calls == (0 if arm == "sync_inline" else 32)
    if arm == "async":
        assert cfg.asynchronous.max_staleness == 2 and cfg.asynchronous.mode == "threaded"
    else:
        assert cfg.asynchronous is None  # the synchronous loop


def test_read_run_counts_a_resumed_step_once(tmp_path):
    write_run(tmp_path / "r", [10.0, 20.0, 30.0], np.ones(4), resumed_step=2)
    run = aa.read_run(tmp_path / "r")
    assert run["steps"] == 3 and run["train_wall_s"] == 60.0
    assert run["train_s"] == pytest.approx(10.0) and run["final_accuracy"] == 1.0


def test_compare_matches_a_direct_computation(tmp_path):
    rng = np.random.default_rng(0)
    sync = (rng.random(400) < 0.7).astype(float)
    worse = np.where(rng.random(400) < 0.3, 0.0, sync)  # async loses ~0.21
    write_run(tmp_path / "sync_concurrent_s0", [50.0] * 4, sync)
    for name, acc in (("async_s0", sync), ("bad/async_s0", worse)):
        write_run(tmp_path / name, [20.0] * 4, acc)
    runs = {str(tmp_path / n): aa.read_run(tmp_path / n)
            for n in ("sync_concurrent_s0", "async_s0", "bad/async_s0")}
    same = aa.compare(tmp_path, "sync_concurrent", [0], runs)
    assert same["accuracy_diff"]["value"] == 0 and same["reaches_sync_accuracy"]
    assert same["wall_ratio"] == pytest.approx(80 / 200) and same["target_met"]

    (tmp_path / "bad" / "sync_concurrent_s0").symlink_to(tmp_path / "sync_concurrent_s0")
    runs[str(tmp_path / "bad" / "sync_concurrent_s0")] = runs[str(tmp_path / "sync_concurrent_s0")]
    bad = aa.compare(tmp_path / "bad", "sync_concurrent", [0], runs)
    d = worse - sync
    assert bad["accuracy_diff"]["value"] == pytest.approx(d.mean())
    # one seed: the bootstrap resamples problems, so se_d ≈ the plain standard error
    assert bad["accuracy_diff_se"] == pytest.approx(d.std() / math.sqrt(d.size), rel=0.1)
    assert not bad["reaches_sync_accuracy"] and not bad["target_met"]


def test_the_committed_page_is_its_json_rendered():
    res = json.loads(aa.OUT.read_text())
    assert aa.PAGE.read_text() == aa.render_page(res)
    for path, link, index in ((aa.README, "docs/results/agentic-async.md", False),
                              (aa.INDEX, "agentic-async.md", True)):
        assert aa.summary_row(res, link, index) in path.read_text().splitlines()
    c = res["comparisons"]["sync_concurrent"]
    assert res["headline"]["value"] == c["wall_ratio"]
    assert c["wall_ratio"] == pytest.approx(c["async_wall_s"] / c["sync_wall_s"], abs=2e-3)
