"""The shared-engine benchmark's committed result: its headline and summary recomputed
from the raw rows (tokens and wall seconds of every timed pass, the two sides paired by
repeat), no timed pass compiling, and the page generated from the JSON."""
import json
from pathlib import Path

import numpy as np

from experiments.bench import shared_engine as se

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "experiments/results/bench_shared_engine.json"


def test_the_headline_is_the_median_paired_ratio_of_the_rows():
    result = json.loads(RESULT.read_text())
    rows = result["rows"]
    assert len(rows["rounds"]) == len(rows["shared"]) == result["setup"]["repeats"] >= 3
    ratios = [(s["useful_tokens"] / s["wall_s"]) / (r["useful_tokens"] / r["wall_s"])
              for s, r in zip(rows["shared"], rows["rounds"])]
    assert abs(result["headline"]["value"] - round(float(np.median(ratios)), 3)) < 1e-9
    assert np.allclose(result["summary"]["ratio"]["runs"], ratios)
    setup = result["setup"]
    groups = setup["requests"] * setup["prompts"]
    assert all(x["groups"] == groups and x["compile_s"] < 0.5
               for side in rows.values() for x in side)


def test_the_committed_page_is_generated_from_the_committed_json():
    assert (ROOT / se.PAGE).read_text() == se.render_page(json.loads(RESULT.read_text()))
