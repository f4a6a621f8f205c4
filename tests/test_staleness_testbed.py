"""The testbed sweep's smoke: two methods at k = 0 and 2, one seed, 4 steps; each cell's
config is what it says (the method's learner, a deterministic k-stale source), its record
holds the per-problem counts its run's eval_problems.jsonl gave, a finished cell is skipped
on the next call, and the report computes its verdict rows from the records alone."""
import dataclasses
import json

import numpy as np

from experiments.repro import staleness_testbed as tb

TINY = dataclasses.replace(tb.SETUP, steps=4, eval_every=2, eval_prompts=8,
                           task_options=(("kind", "copy"), ("length", 4), ("alphabet", 4),
                                         ("repeats", 2)))


def test_cells_are_configured_as_their_method_says(tmp_path):
    cfg = tb.cell_config(TINY, "exact", 4, 1, tmp_path)
    assert cfg.asynchronous.max_staleness == 4 and cfg.asynchronous.mode == "deterministic"
    assert cfg.asynchronous.proximal == "exact" and cfg.train.offpolicy.correction == "behaviour"
    assert cfg.loop.seed == 1 and cfg.model.init_seed == 1 and cfg.loop.steps == 4
    naive = tb.cell_config(TINY, "naive", 0, 0, tmp_path)
    assert naive.train.old_logp == "behaviour" and naive.asynchronous.max_staleness == 0
    assert tb.cell_config(TINY, "icepop", 16, 0, tmp_path).train.offpolicy.correction == "icepop"
    cfg.validate()


def test_sweep_records_cells_and_the_report_reads_them(tmp_path):
    cells, work = tmp_path / "cells", tmp_path / "work"
    tb.sweep(["naive", "icepop"], [0, 2], [0], None, TINY, cells, work)
    names = sorted(p.stem for p in cells.glob("*.json"))
    assert names == ["icepop_k0_s0", "icepop_k2_s0", "naive_k0_s0", "naive_k2_s0"]
    rec = json.loads((cells / "naive_k2_s0.json").read_text())
    lines = [json.loads(x) for x in (work / "naive_k2_s0" / "eval_problems.jsonl")
             .read_text().splitlines()]
    last = [r for r in lines if r["pass"] == "greedy"][-1]
    assert rec["final_step"] == 4 and rec["positions"] == 8
    np.testing.assert_allclose(np.asarray(rec["final_correct"]) / 8, last["accuracy"])
    mtime = (cells / "naive_k2_s0.json").stat().st_mtime
    tb.sweep(["naive"], [2], [0], None, TINY, cells, work)  # done: skipped
    assert (cells / "naive_k2_s0.json").stat().st_mtime == mtime
    out = tb.report(cells, tmp_path / "r.json")
    assert {(r["method"], r["k"]) for r in out["rows"]} == {
        ("naive", 0), ("naive", 2), ("icepop", 0), ("icepop", 2)}
    assert set(out["verdicts"]) >= {"icepop"} and (tmp_path / "r.png").is_file()


def test_the_committed_page_and_rows_are_generated_from_the_committed_json():
    """Every number of the testbed's page, README row and results-index row comes from
    experiments/results/staleness_testbed.json (and the regime search's JSON)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = json.loads((root / tb.RESULT).read_text())
    regime = json.loads((root / tb.REGIME).read_text())
    mismatch = (json.loads((root / tb.MISMATCH_RESULT).read_text())
                if (root / tb.MISMATCH_RESULT).is_file() else None)
    assert (root / tb.PAGE).read_text() == tb.render_page(result, regime, mismatch)
    readme = (root / "README.md").read_text().splitlines()
    index = (root / "docs/results/index.md").read_text().splitlines()
    assert tb.summary_row(result, "docs/results/staleness-testbed.md") in readme
    assert tb.summary_row(result, "staleness-testbed.md", index=True) in index
    # the verdicts follow from the rows by the page's rule
    rows = {(r["method"], r["k"]): r for r in result["rows"]}
    hurts = [k for k in result["ks"] if k > 0 and rows[("naive", k)]["kept"]["high"] < tb.KEPT]
    assert result["staleness_hurts_at"] == hurts
