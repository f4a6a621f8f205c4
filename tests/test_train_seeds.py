"""experiments.train_seeds: two 2-step seeds of the main job write a results JSON whose
per-seed numbers are each run dir's summary.json and whose mean / spread are numpy's
(and scipy's t interval) over those numbers; the PNG is written; clashing flags are refused.

Same geometry as tests/test_train_job.py (2 groups of 4, 8 eval prompts), so the compiled
sampler and train step are shared within one pytest process."""
import json

import numpy as np
import pytest
from scipy import stats

from experiments.train_seeds import main
from rl.run import PRESETS

SMALL = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--eval-prompts", "8",
         "--eval-every", "0", "--wandb", "disabled"]


def test_two_seeds_aggregate_their_summaries(tmp_path):
    out = tmp_path / "res" / "seeds.json"
    res = main(["--seeds", "0", "3", "--runs-root", str(tmp_path / "runs"),
                "--results-json", str(out), "--bar", "0.2", "--", *SMALL])
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(res))
    assert out.with_suffix(".png").stat().st_size > 0

    seeds = on_disk["seeds"]
    assert [s["seed"] for s in seeds] == [0, 3] == on_disk["headline"]["seeds"]
    for s in seeds:
        summary = json.loads((tmp_path / "runs" / f"seed_{s['seed']}" / "summary.json").read_text())
        assert summary["steps"] == s["steps"] == 2
        assert s["final_eval_reward"] == summary["final_eval_reward"]
        assert s["final_greedy_eval_reward"] == summary["final_greedy_eval_reward"]
        assert s["random_policy_eval_reward"] == summary["random_policy_eval_reward"]
        assert s["ratio"] == summary["headline"]["value"]
        assert s["wall_time_s"] == summary["wall_time_s"]
        assert s["curve"]["eval_reward"] == summary["curve"]["eval_reward"]
    # the two seeds are different runs (different init, prompts and eval split)
    assert seeds[0]["curve"] != seeds[1]["curve"]

    ratio = np.array([s["ratio"] for s in seeds], dtype=np.float64)
    final = np.array([s["final_eval_reward"] for s in seeds], dtype=np.float64)
    h = on_disk["headline"]
    assert h["value"] == pytest.approx(ratio.mean(), abs=1e-4)
    assert h["spread"]["std"] == pytest.approx(ratio.std(ddof=1), abs=1e-4)
    assert h["spread"]["min"] == pytest.approx(ratio.min(), abs=1e-4)
    assert h["spread"]["max"] == pytest.approx(ratio.max(), abs=1e-4)
    half = stats.t.ppf(0.975, df=1) * ratio.std(ddof=1) / np.sqrt(2)
    assert h["spread"]["ci95"] == pytest.approx([ratio.mean() - half, ratio.mean() + half],
                                                abs=2e-4)
    assert h["final_eval_reward"]["mean"] == pytest.approx(final.mean(), abs=1e-4)
    assert h["final_eval_reward"]["std"] == pytest.approx(final.std(ddof=1), abs=1e-4)
    assert h["target"] == PRESETS["tiny-synthetic"].headline_target
    assert h["reached_target"] == bool(ratio.min() >= h["target"])
    f = on_disk["final_eval_reward"]
    assert f["bar"] == 0.2
    assert f["seeds_at_or_above_bar"] == [s["seed"] for s in seeds if s["final_eval_reward"] >= 0.2]
    assert h["bar"]["all_seeds_cleared"] == bool((final >= 0.2).all())


def test_driver_owned_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--seeds", "0", "--", "--seed", "4"])
    assert "--seed is set by experiments.train_seeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--seeds", "1", "1"])
    assert "--seeds has repeats" in capsys.readouterr().err
