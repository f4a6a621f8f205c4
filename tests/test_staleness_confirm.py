"""The real-model confirmation's plumbing on the tiny model: cells configured as the study
says (the SmolLM2 setup: chain_sum, strict verifier, 512 problems, the k-stale source), a
smoke sweep's records hold the per-problem greedy results its runs' eval_problems.jsonl
gave, a finished cell is skipped, and the committed page is generated from the committed JSON."""
import json
from pathlib import Path

import numpy as np
import pytest

from experiments.common.staleness_cells import cell_config
from experiments.repro import staleness_confirm as sc


def test_the_study_cells_are_the_smollm2_setup(tmp_path):
    cfg = cell_config(sc.SETUP, "naive", sc.K, 2, str(tmp_path))
    assert cfg.model.name == "smollm2-135m" and cfg.task.spec == "reasoning_gym:chain_sum"
    assert cfg.reward.verifier == "strict" and cfg.loop.eval_prompts == 512
    assert cfg.asynchronous.max_staleness == 8 and cfg.asynchronous.mode == "deterministic"
    assert cfg.train.old_logp == "behaviour" and cfg.loop.seed == 2
    assert cell_config(sc.SETUP, "decoupled", 8, 0, str(tmp_path)).train.old_logp == "current"
    order = sc.grid()
    assert order[:6] == [("naive", 0, 0), ("naive", 8, 0), ("naive", 0, 1), ("naive", 8, 1),
                         ("naive", 0, 2), ("naive", 8, 2)]
    assert len(order) == 6 + 3 * len(sc.CORRECTIONS)


def test_smoke_sweep_records_the_problems_and_reports(tmp_path):
    cells, work = tmp_path / "cells", tmp_path / "work"
    grid = [("naive", 0, 0), ("naive", 2, 0), ("decoupled", 2, 0)]
    sc.sweep(grid, None, sc.smoke_setup(), cells, work)
    # the tiny model learns nothing in 2 steps: no hurt at k = 2, so the correction waits
    assert not sc.staleness_hurts(cells, 2) and not (cells / "decoupled_k2_s0.json").exists()
    sc.sweep(grid, None, sc.smoke_setup(), cells, work, force=True)
    rec = json.loads((cells / "naive_k2_s0.json").read_text())
    lines = [json.loads(x) for x in (work / "naive_k2_s0" / "eval_problems.jsonl")
             .read_text().splitlines()]
    greedy = [r for r in lines if r["pass"] == "greedy"]
    assert rec["final_step"] == 2 and rec["initial_step"] == 0
    order = np.argsort(greedy[-1]["prompt_index"])
    np.testing.assert_allclose(rec["final_correct"], np.asarray(greedy[-1]["accuracy"])[order])
    np.testing.assert_allclose(rec["initial_correct"], np.asarray(greedy[0]["accuracy"])[order])
    mtime = (cells / "naive_k2_s0.json").stat().st_mtime
    sc.sweep(grid[1:2], None, sc.smoke_setup(), cells, work)  # done: skipped
    assert (cells / "naive_k2_s0.json").stat().st_mtime == mtime
    out = sc.report(cells, tmp_path / "r.json", page=False)
    assert {(r["method"], r["k"]) for r in out["rows"]} == {
        ("naive", 0), ("naive", 2), ("decoupled", 2)}
    assert "decoupled" in out["verdicts"] and (tmp_path / "r.png").is_file()


def test_the_committed_page_and_rows_are_generated_from_the_committed_json():
    root = Path(__file__).resolve().parents[1]
    result = json.loads((root / sc.RESULT).read_text())
    assert (root / sc.PAGE).read_text() == sc.render_page(result)
    if result.get("rows"):
        readme = (root / "README.md").read_text().splitlines()
        index = (root / "docs/results/index.md").read_text().splitlines()
        assert sc.summary_row(result, "docs/results/staleness-confirm.md") in readme
        assert sc.summary_row(result, "staleness-confirm.md", index=True) in index
        # the records behind the JSON are committed, and give its synchronous gain
        base = [json.loads(p.read_text()) for p in (root / sc.CELLS_DIR).glob("naive_k0_s*.json")]
        gain = np.mean([np.mean(r["final_correct"]) - np.mean(r["initial_correct"]) for r in base])
        assert abs(gain - result["sync_gain"]) < 1e-4


def _record(path, method, k, seed, initial, final, entropy, lr):
    keys = ["step", *sc.LATE_KEYS]
    train = [[i + 1, e, 20.0 - i, 0.1 * i] for i, e in enumerate(entropy)]
    path.write_text(json.dumps({
        "method": method, "k": k, "seed": seed, "steps": 24, "initial_correct": initial,
        "final_correct": final, "train_keys": keys, "train": train,
        "run_config": {"train": {"optimizer": {"learning_rate": lr}}}}))


def test_regime_rows_of_the_pilots_by_hand(tmp_path):
    """Each pilot folder's row: the gain, the kept share and the paired difference as
    counted by hand, late means over the last LATE_STEPS steps, k = 0 alone shown as such,
    and cells of one folder at two rates refused."""
    rng = np.random.default_rng(0)
    init, sync, stale = (rng.integers(0, 2, 64).tolist() for _ in range(3))
    ent = [1.0, 0.9, 0.5, 0.4, 0.3, 0.2]
    a, b = tmp_path / "lr4e-5", tmp_path / "lr6e-5"
    a.mkdir(), b.mkdir()
    _record(a / "naive_k0_s100.json", "naive", 0, 100, init, sync, ent, 4e-5)
    _record(a / "naive_k8_s100.json", "naive", sc.K, 100, init, stale, ent[::-1], 4e-5)
    _record(b / "naive_k0_s100.json", "naive", 0, 100, init, sync, ent, 6e-5)
    rows = sc.pilots(tmp_path)
    assert [r["learning_rate"] for r in rows] == [4e-5, 6e-5]
    r = rows[0]
    gain = np.mean(sync) - np.mean(init)
    assert r["sync_gain"] == np.float64(gain)
    assert abs(r["kept"]["value"] - (np.mean(stale) - np.mean(init)) / gain) < 1e-12
    d = np.mean(stale) - np.mean(sync)
    assert abs(r["stale_minus_sync"]["value"] - d) < 1e-12
    assert r["stale_minus_sync"]["low"] <= d <= r["stale_minus_sync"]["high"]
    late = np.mean(ent[-sc.LATE_STEPS:])
    assert abs(r["late"]["sync"]["entropy"] - late) < 1e-12
    assert abs(r["late"]["stale"]["entropy"] - np.mean(ent[::-1][-sc.LATE_STEPS:])) < 1e-12
    assert r["initial_entropy"] == 1.0
    assert r["late"]["sync"]["response_len"] == 16.5  # lengths 18, 17, 16, 15
    assert rows[1]["stale_final"] is None and "stale" not in rows[1]["late"]
    page = "\n".join(sc.render_regimes(rows))
    assert "| 6e-05, 24, – (lr6e-5) | 1 | " in page and "| – | – | – |" in page
    assert rows[1]["k"] is None
    assert r["k"] == sc.K and r["steps"] == 24
    c = tmp_path / "k16"  # a pilot of another k: its stale cell is its largest k
    c.mkdir()
    _record(c / "naive_k0_s100.json", "naive", 0, 100, init, sync, ent, 2e-5)
    _record(c / "naive_k16_s100.json", "naive", 16, 100, init, stale, ent, 2e-5)
    assert sc.pilots(tmp_path)[0]["k"] == 16
    assert sc.pilots(tmp_path)[0]["stale_minus_sync"]["value"] == r["stale_minus_sync"]["value"]
    _record(b / "naive_k8_s100.json", "naive", sc.K, 100, init, stale, ent, 4e-5)
    with pytest.raises(ValueError, match="different rates"):
        sc.pilots(tmp_path)
