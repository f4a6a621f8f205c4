"""experiments.common.paired: the paired bootstrap against the normal-theory interval of a
mean difference (the textbook 1.96 standard errors), seeds widening the interval when runs
differ, the gain-kept share on hand-made tables, and reading runs' per-problem files."""
import json

import numpy as np
import pytest

from experiments.common.paired import (gain_kept, paired_bootstrap, problem_results,
                                       seed_problem_matrix)


def test_the_paired_interval_is_the_normal_one_for_iid_differences():
    rng = np.random.default_rng(0)
    p = 900
    base = rng.random((1, p))
    d = rng.normal(0.1, 1.0, (1, p))
    est = paired_bootstrap(base + d, base, replicates=3000, seed=1)
    se = d.std(ddof=1) / np.sqrt(p)
    assert est.value == pytest.approx(d.mean())
    assert est.half_width == pytest.approx(1.96 * se, rel=0.12)
    assert est.low < d.mean() < est.high and est.excludes(0.0)


def test_resampling_seeds_widens_the_interval_when_runs_differ():
    rng = np.random.default_rng(2)
    problems = rng.random(300)
    same = np.stack([problems] * 4)
    noisy = same + rng.normal(0, 0.2, (4, 1))  # a per-seed offset: run-to-run noise
    narrow = paired_bootstrap(same + 0.05, same, seed=0)
    wide = paired_bootstrap(noisy + 0.05, same, seed=0)
    assert narrow.half_width < 1e-9 < wide.half_width  # a constant difference has no spread


def test_gain_kept_on_hand_tables():
    init = np.zeros((2, 50))
    sync = np.full((2, 50), 0.5)
    half = np.full((2, 50), 0.25)
    est = gain_kept(half, sync, init, replicates=200)
    assert est.value == pytest.approx(0.5) and est.low == est.high == pytest.approx(0.5)


def write_problems(run_dir, rows):
    run_dir.mkdir(parents=True)
    with open(run_dir / "eval_problems.jsonl", "w") as f:
        for step, pass_, idx, acc in rows:
            f.write(json.dumps({"step": step, "pass": pass_, "prompt_index": idx,
                                "accuracy": acc}) + "\n")


def test_reading_runs_and_refusing_unpaired_ones(tmp_path):
    write_problems(tmp_path / "a", [(0, "greedy", [0, 1, 2], [0, 0, 1]),
                                    (5, "greedy", [2, 0, 1], [1.0, 0.5, 0.25]),
                                    (5, "sampled", [0, 1, 2], [0, 0, 0])])
    write_problems(tmp_path / "b", [(5, "greedy", [0, 1, 2], [1, 1, 1])])
    write_problems(tmp_path / "c", [(5, "greedy", [0, 1, 3], [1, 1, 1])])
    assert problem_results(tmp_path / "a")[5]["greedy"] == {2: 1.0, 0: 0.5, 1: 0.25}
    table = seed_problem_matrix([tmp_path / "a", tmp_path / "b"])
    np.testing.assert_array_equal(table, [[0.5, 0.25, 1.0], [1, 1, 1]])  # index order
    np.testing.assert_array_equal(seed_problem_matrix([tmp_path / "a"], step=0), [[0, 0, 1]])
    with pytest.raises(ValueError, match="share their eval set"):
        seed_problem_matrix([tmp_path / "a", tmp_path / "c"])
    with pytest.raises(ValueError, match="no 'greedy' eval at step 3"):
        seed_problem_matrix([tmp_path / "a"], step=3)
    with pytest.raises(FileNotFoundError, match="eval_problems.jsonl"):
        problem_results(tmp_path / "missing")
