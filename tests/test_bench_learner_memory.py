"""experiments.bench.learner_memory on the tiny model: each remat variant in its own process
(compiled scratch, step time, step peak resident memory), full remat needing less scratch
than none; the variant syntax; the alternating timer's result shape."""
from __future__ import annotations

import json

import pytest

from experiments.bench import learner_memory as bench
from models.logprobs import DEFAULT_CHUNK


def test_variant_syntax():
    assert bench.parse_variant("none") == ("none", 1, DEFAULT_CHUNK)
    assert bench.parse_variant("full/mb2/c256") == ("full", 2, 256)
    for bad in ("all", "full/x2", "dots/c"):
        with pytest.raises(ValueError, match="variant"):
            bench.parse_variant(bad)


def test_tiny_variants_in_their_own_processes(tmp_path):
    out = tmp_path / "lm.json"
    bench.main(["--models", "tiny", "--variants", "none,full/c256", "--repeats", "1",
                "--round-robin", "none,full", "--out", str(out)])
    res = json.loads(out.read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"none", "full/c256"}
    assert rows["full/c256"]["scratch_mb"] < 0.75 * rows["none"]["scratch_mb"]
    assert rows["full/c256"]["logprob_chunk"] == 256 and rows["none"]["remat"] == "none"
    for r in rows.values():
        assert r["step_s"] > 0 and r["process_peak_rss_mb"] >= r["step_peak_rss_mb"] > 100
        assert len(r["load_average_before"]) == 3
    # remat changes no number the step reports
    assert rows["full/c256"]["grad_norm"] == pytest.approx(rows["none"]["grad_norm"], rel=1e-5)
    (rr,) = res["round_robin"]
    assert set(rr["step_s_median"]) == {"none", "full"} and rr["repeats"] == 1
    assert res["headline"]["target"] == 4.0 and res["headline"]["value"] == 0.0  # no smollm2
