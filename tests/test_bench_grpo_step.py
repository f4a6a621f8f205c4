"""experiments.bench.grpo_step: a 2-step tiny-synthetic run (no baseline) writes the JSON
with its headline, table, per-step rewards and a step profile whose phases sum to each
step's time and match the step's wall time from metrics.jsonl; the pieces that compare
two sides (step walls from time_s, steps/hour, reward differences) on known records."""
import json

import pytest

from experiments.bench import grpo_step as bench
from rl.runtime.logging import read_jsonl

PHASES = ("prefill_s", "decode_s", "reward_s", "learner_s", "host_s", "transfer_s", "other_s")


def test_tiny_run_writes_the_table_and_a_consistent_profile(tmp_path):
    out = tmp_path / "bench.json"
    work = tmp_path / "work"
    bench.main(["--preset", "tiny-synthetic", "--steps", "2", "--baseline", "none",
                "--eval-prompts", "4", "--work-dir", str(work), "--out", str(out)])
    res = json.loads(out.read_text())
    head = res["headline"]
    assert head["metric"] == "steps/hour (no baseline)" and head["value"] > 0
    assert isinstance(head["machine"], str) and res["old"] is None and res["comparison"] == {}
    assert set(res["load_average_1_5_15min"]) == {"before", "after"}
    new = res["sides"]["new"]
    assert new["runs"] == 1 and new["steps_timed"] == 1
    assert new["steps_per_hour"] == pytest.approx(3600 / new["step_wall_s_mean"])
    assert head["value"] == pytest.approx(new["steps_per_hour"], rel=1e-3)
    assert len(new["reward_mean_per_step"]) == 2
    assert all(0.0 <= r <= 1.0 for r in new["reward_mean_per_step"])
    assert sum(new["phases_share"].values()) == pytest.approx(1.0)
    (run,) = res["runs"]["new"]
    # each step resets the kernel's high-water mark (/proc/self/clear_refs), so the process
    # peak os.wait4 reports covers the last step onward: at least that step's peak
    assert new["peak_rss_mb_per_step_max"] > 10.0
    assert new["process_peak_rss_mb"] >= run["profile"][-1]["peak_rss_mb"]
    assert res["runs"]["old"] == [] and run["profile_summary"]["steps_measured"] == 1
    records = read_jsonl(work / "00-new" / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert run["reward_mean"] == [r["reward_mean"] for r in train]
    for prof, wall in zip(run["profile"], run["step_wall_s"]):
        assert sum(prof[k] for k in PHASES) == pytest.approx(prof["step_s"], rel=1e-6)
        assert abs(prof["other_s"]) <= 0.05 * prof["step_s"] + 0.02
        # the profiled step and its wall time from metrics.jsonl's time_s agree
        assert wall == pytest.approx(prof["step_s"], rel=0.1, abs=0.05)


def test_step_walls_and_the_comparison():
    records = [{"kind": "eval", "step": 0, "time_s": 5.0},
               {"kind": "train", "step": 1, "time_s": 25.0},
               {"kind": "train", "step": 2, "time_s": 29.0},
               {"kind": "eval", "step": 2, "time_s": 40.0},
               {"kind": "train", "step": 3, "time_s": 46.0}]
    assert bench.step_walls(records) == [20.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="no time_s"):
        bench.step_walls([{"kind": "eval", "step": 0}])

    def run(walls, rewards):
        return {"step_wall_s": walls, "reward_mean": rewards, "rollout_s": [1.0] * len(walls),
                "train_s": [2.0] * len(walls), "process_peak_rss_mb": 1000.0}

    old = bench.side_table([run([30.0, 8.0, 8.0], [0.1, 0.2, 0.3]),
                            run([31.0, 8.0, 8.0], [0.1, 0.2, 0.3])])
    new = bench.side_table([run([20.0, 4.0, 4.0], [0.1, 0.2, 0.4])])
    assert old["steps_per_hour"] == 450.0 and new["steps_per_hour"] == 900.0
    assert old["first_step_wall_s_mean"] == 30.5 and old["steps_timed"] == 4
    c = bench.compare(new, old)
    assert c["steps_per_hour_ratio"] == 2.0
    assert c["reward_mean_abs_diff"] == pytest.approx(0.1 / 3)
    assert c["reward_max_abs_diff"] == pytest.approx(0.1) and c["first_step_reward_equal"]
    with pytest.raises(ValueError, match="single step"):
        bench.side_table([run([30.0], [0.1])])


def test_bad_arguments_fail_early(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "1", "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="is not a commit"), \
            bench.baseline_tree("no-such-commit-xyz"):
        pass
