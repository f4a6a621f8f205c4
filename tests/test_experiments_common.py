"""experiments.common: where each script's results go, the moving mean of the plots, and the
seeds scaffolding (train the missing runs, collect, mean with spread, plot), against hand
computations and naive loops."""
import json
import math
import statistics

import numpy as np
import pytest

from experiments.common.benchmarking import RESULTS_DIR, results_path
from experiments.common.plots import plt, smooth
from experiments.common.seeds import (
    check_train_args,
    gain_over_seeds,
    over_seeds,
    plot_over_seeds,
    read_metrics,
    spread,
    train_missing,
)


def test_results_path_by_room():
    assert RESULTS_DIR.parent.name == "experiments" and RESULTS_DIR.name == "results"
    assert results_path("/x/experiments/bench/sampler.py") == RESULTS_DIR / "bench_sampler.json"
    assert results_path("experiments/repro/smollm2_rg.py") == RESULTS_DIR / "smollm2_rg.json"
    for bad in ("experiments/train.py", "experiments/common/plots.py", "experiments/bench/x.txt"):
        with pytest.raises(ValueError, match="not a script"):
            results_path(bad)


@pytest.mark.parametrize("window", [1, 3, 10])
def test_smooth_is_the_trailing_window_mean(window):
    values = list(np.random.default_rng(window).normal(size=17))
    naive = [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(smooth(values, window), naive, rtol=1e-12)


def test_smooth_leaves_nans_out():
    values = [1.0, float("nan"), 3.0, float("nan"), float("nan"), float("nan"), 8.0]
    got = smooth(values, 3)
    expected = [1.0, 1.0, 2.0, 3.0, 3.0, None, 8.0]  # means of the non-NaN in each window
    for g, e in zip(got, expected):
        assert math.isnan(g) if e is None else g == pytest.approx(e, rel=1e-12)


def test_spread_against_hand_numbers():
    s = spread([1.0, 2.0, 3.0, 4.0], digits=None)
    std = math.sqrt(5 / 3)  # squares of (-1.5, -0.5, 0.5, 1.5) sum to 5, over n - 1 = 3
    half = 3.182 * std / 2  # t(0.975, 3 dof) * std / sqrt(4)
    assert (s["mean"], s["min"], s["max"]) == (2.5, 1.0, 4.0)
    assert s["std"] == pytest.approx(std, rel=1e-12)
    assert s["ci95"] == pytest.approx([2.5 - half, 2.5 + half], rel=1e-12)
    assert spread([1.0, 2.0, 3.0, 4.0])["std"] == round(std, 4)
    one = spread([0.7])
    assert (one["mean"], one["std"], one["min"], one["max"]) == (0.7, 0.0, 0.7, 0.7)
    assert all(math.isnan(x) for x in one["ci95"])
    many = spread(list(range(20)), digits=None)  # beyond 10 dof: the normal's 1.96
    assert many["ci95"][1] - many["mean"] == pytest.approx(1.96 * many["std"] / math.sqrt(20))


def test_gain_over_seeds():
    runs = {"0": {"gain": 0.25, "steps": 10}, "1": {"gain": 0.10, "steps": 13}}
    g = gain_over_seeds(runs)
    assert g["mean"] == pytest.approx(0.175) and g["std"] == pytest.approx(math.sqrt(2) * 0.075)
    assert (g["min"], g["max"], g["seeds"], g["steps_mean"]) == (0.10, 0.25, 2, 11.5)
    assert gain_over_seeds({"0": runs["0"]})["std"] is None


def _finish(run_dir, rows=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"steps": len(rows)}))


def test_train_missing_trains_only_unfinished_runs_in_order(tmp_path):
    _finish(tmp_path / "s1")
    (tmp_path / "s3").mkdir()  # started, not finished: trained again
    trained = []
    out = train_missing([0, 1, 2, 3], lambda s: tmp_path / f"s{s}",
                        lambda s: (trained.append(s), _finish(tmp_path / f"s{s}")))
    assert out == trained == [0, 2, 3]
    assert train_missing([0, 1, 2, 3], lambda s: tmp_path / f"s{s}", trained.append) == []
    # one record file per run: finished = the file exists
    (tmp_path / "b.json").write_text("{}")
    got = train_missing(["a", "b"], lambda c: tmp_path / f"{c}.json", trained.append,
                        finished=lambda p: p.exists())
    assert got == ["a"] and trained[-1] == "a"


def test_over_seeds_trains_then_reads_every_seed(tmp_path):
    _finish(tmp_path / "s0", [{"kind": "eval", "step": 0}])
    calls = []

    def train(seed):
        calls.append(seed)
        _finish(tmp_path / f"s{seed}", [{"kind": "train", "step": 1}] * 3)

    def read(run_dir):
        train_rows, eval_rows = read_metrics(run_dir)
        return {"train": len(train_rows), "eval": len(eval_rows)}

    runs = over_seeds([0, 1], lambda s: tmp_path / f"s{s}", read, train=train)
    assert calls == [1]
    assert runs == {"0": {"train": 0, "eval": 1}, "1": {"train": 3, "eval": 0}}
    assert over_seeds([1], lambda s: tmp_path / f"s{s}", read) == {"1": {"train": 3, "eval": 0}}


def test_read_metrics_splits_kinds_in_file_order_and_skips_a_torn_line(tmp_path):
    rows = [{"kind": "eval", "step": 0}, {"kind": "train", "step": 1},
            {"kind": "train", "step": 2}, {"kind": "eval", "step": 2}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra')
    train, evals = read_metrics(tmp_path)
    assert train == rows[1:3] and evals == [rows[0], rows[3]]


def test_check_train_args_refuses_the_driver_flags():
    check_train_args(["--steps", "5", "--lr=1e-5"], "driver")
    with pytest.raises(ValueError, match=r"--run-dir, --seed is set by my.driver per seed"):
        check_train_args(["--seed", "3", "--run-dir=x"], "my.driver")


def test_plot_over_seeds_draws_each_seed_and_the_mean_over_shared_points():
    fig, ax = plt.subplots()
    curves = [[[0, 0.1], [10, 0.5], [20, 0.9]], [[0, 0.3], [10, 0.7]]]
    x, mean = plot_over_seeds(ax, curves, color="tab:blue", label="mean")
    np.testing.assert_allclose(x, [0, 10])
    np.testing.assert_allclose(mean, [0.2, 0.6])
    assert len(ax.lines) == 3 and ax.lines[-1].get_label() == "mean"
    np.testing.assert_allclose(ax.lines[-1].get_ydata(), [0.2, 0.6])
    plt.close(fig)
