"""The Python-tool GRPO driver on synthetic run dirs: its train command trains the python
environment with the seed and evals it names, its gain is the paired mean difference a
direct numpy computation gives, the verdict follows the interval, and the committed page
(when there is one) is its JSON rendered."""
import argparse
import json

import numpy as np
import pytest

from experiments.common.flags import config_from_argv
from experiments.repro import python_tool_grpo as pg
from tests.run_dirs import write_run


def test_train_command_trains_the_python_env(tmp_path):
    args = argparse.Namespace(steps=8, eval_prompts=128, dataset="basic_arithmetic")
    cfg, resume = config_from_argv(pg.train_command(2, tmp_path / "r", args)[3:])
    assert resume is None and cfg.loop.seed == 2 and cfg.loop.steps == 8
    assert cfg.task.spec == "env:python" and cfg.loop.eval_every == 8
    options = dict(cfg.task.options)
    assert options["dataset"] == "basic_arithmetic"
    assert options["max_prompt_len"] == 256 and options["max_episode_tokens"] == 640
    assert cfg.loop.eval_prompts == 128
    assert cfg.model.name == "smollm2-135m" and cfg.loop.eval_greedy
    cfg.validate()


@pytest.mark.parametrize("lift", [0.0, 0.25])
def test_gain_and_verdict_match_a_direct_computation(tmp_path, lift):
    rng = np.random.default_rng(1)
    dirs = []
    for seed in range(3):
        before = (rng.random(200) < 0.1).astype(float)
        after = np.maximum(before, rng.random(200) < lift)
        d = tmp_path / f"s{seed}"
        write_run(d, [30.0] * 4, after, initial=before,
                  eval_extra={0: {"greedy_episode_tool_calls": 0.5},
                              4: {"greedy_episode_tool_calls": 1.25}})
        dirs.append((d, before, after))
    s = pg.summarize([d for d, _, _ in dirs])
    want = np.mean([a - b for _, b, a in dirs])
    assert s["gain"]["value"] == pytest.approx(want)
    assert s["seeds"] == 3 and s["problems"] == 200
    assert s["improves"] == (lift > 0)
    run = pg.read_run(dirs[0][0])
    assert run["initial_tool_calls"] == 0.5 and run["final_tool_calls"] == 1.25
    assert run["final_step"] == 4 and run["train_wall_s"] == 120.0
    np.testing.assert_array_equal(run["problems"]["initial"], dirs[0][1])
    np.testing.assert_array_equal(run["problems"]["final"], dirs[0][2])


def test_the_committed_page_is_its_json_rendered():
    assert pg.OUT.is_file(), "the committed result (python -m experiments.repro.python_tool_grpo)"
    res = json.loads(pg.OUT.read_text())
    assert pg.PAGE.read_text() == pg.render_page(res)
    assert pg.index_row(res) in pg.INDEX.read_text().splitlines()
    assert res["headline"]["value"] == res["summary"]["gain"]["value"]
    # the per-problem results it saved give its gain and accuracies
    runs = list(res["runs"].values())
    gain = np.mean([np.subtract(r["problems"]["final"], r["problems"]["initial"]) for r in runs])
    assert gain == pytest.approx(res["summary"]["gain"]["value"])
    for r in runs:
        assert np.mean(r["problems"]["final"]) == pytest.approx(r["final_accuracy"])
        assert np.mean(r["problems"]["initial"]) == pytest.approx(r["initial_accuracy"])
