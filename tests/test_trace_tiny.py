"""The TRACE-vs-GRPO study's smoke: both cells configured as the doc says, a 2-step sweep
records per-episode evals and TRACE's counts, and the rule reads hand-made records."""
import dataclasses

import numpy as np
import pytest

from experiments.repro import trace_tiny as tt

TINY = tt.Study(steps=2, eval_every=2, eval_prompts=8)


def test_cells_are_configured_as_the_doc_says(tmp_path):
    grpo = tt.cell_config(TINY, "grpo", 1, tmp_path)
    trace = tt.cell_config(TINY, "trace", 1, tmp_path)
    assert grpo.trace is None and trace.trace is not None
    assert trace.trace.root_share == 0.5 and trace.trace.warmup == 64
    assert trace.loop.seed == grpo.loop.seed == 1 and trace.model.init_seed == 1
    assert trace.loop.prompts_per_step == grpo.loop.prompts_per_step == 32
    assert not trace.loop.eval_greedy and trace.loop.eval_prompts == 8
    trace.validate()
    with pytest.raises(ValueError, match="method"):
        tt.cell_config(TINY, "latr", 1, tmp_path)
    found = tt.cell_config(TINY, "trace", 1, tmp_path, "found")  # the second testbed
    assert dict(found.task.options) == {"k": 8, "max_turns": 3, "reward": "found"}
    assert dict(grpo.task.options) == {"k": 8, "max_turns": 4}
    assert found.trace == trace.trace and found.loop == trace.loop
    found.validate()
    assert tt.cell_name("trace", 1, "found") == "found_trace_s1"
    with pytest.raises(ValueError, match="testbed"):
        tt.cell_config(TINY, "trace", 1, tmp_path, "binary")


def test_sweep_records_both_methods(tmp_path):
    cells, work = tmp_path / "cells", tmp_path / "work"
    tt.sweep([0], None, TINY, cells, work)
    found = tt.load_cells(cells)
    rec = found["trace"][0]
    assert rec["eval_steps"] == [0, 2] and len(rec["eval_problems"]["2"]) == 8
    keys = rec["train_keys"]
    row = rec["train"][-1]
    assert row[keys.index("trace_mixed_share_stage2")] is not None
    assert found["grpo"][0]["train"][-1][keys.index("trace_mixed_share_stage2")] is None
    out = tt.analyse(found)
    assert out["seeds"] == [0] and out["verdict"] in ("reproduced", "partly", "not")


def record(method, seed, curve, rng_seed):
    steps = [0, 25, 50]
    rng = np.random.default_rng(rng_seed)
    base = rng.uniform(0.3, 0.7, 256)  # an episode's difficulty, shared by both methods
    row = [1, 0.5, 0.2, 900.0, 0.4, None, None, None, None, None]
    if method == "trace":
        row[5:] = [0.6, 0.9, 8.0, 12.0, 1.0]
    return {"method": method, "seed": seed, "eval_steps": steps,
            "eval_problems": {str(s): list(np.clip(base + v + rng.normal(0, 0.01, 256), 0, 1))
                              for s, v in zip(steps, curve)},
            "train_keys": ["step", *tt.TRAIN_KEYS], "train": [row, [2, *row[1:]]],
            "wall_s": 1.0, "machine": "m"}


def cells(trace_curve):
    return {"grpo": {s: record("grpo", s, [0.0, 0.05, 0.1], s) for s in range(3)},
            "trace": {s: record("trace", s, trace_curve, s) for s in range(3)}}


def test_the_rule_reads_the_curves():
    assert tt.analyse(cells([0.0, 0.1, 0.15]))["verdict"] == "reproduced"  # +0.05 at the end
    faster = tt.analyse(cells([0.0, 0.1, 0.11]))  # +0.01 at the end, +0.03 over the run
    assert faster["verdict"] == "partly" and faster["d_final"]["value"] < tt.CLAIM
    assert faster["d_auc"]["low"] > 0
    same = tt.analyse(cells([0.0, 0.05, 0.1]))
    assert same["verdict"] == "not" and not same["worse"]
    worse = tt.analyse(cells([0.0, 0.0, 0.02]))
    assert worse["verdict"] == "not" and worse["worse"]
    assert faster["mixed_share"]["grpo"] == pytest.approx(0.8)
    assert faster["mixed_share"]["trace_stage2"] == pytest.approx(0.9)


def test_the_page_states_the_rule_and_the_verdict():
    found = tt.analyse(cells([0.0, 0.1, 0.15]))
    result = {**found, "study": dataclasses.asdict(tt.STUDY), "preset": tt.PRESET}
    page = tt.render_page(result)
    assert "**Verdict: reproduced.**" in page and "fixed before any cell ran" in page
    row = tt.summary_row(result, "trace-tiny.md", index=True)
    assert row.endswith("| reproduced |") and "3 seeds" in row
    assert "## A binary outcome" not in page  # before the found testbed's cells
    result["found"] = {**tt.analyse(cells([0.0, 0.05, 0.1])), "options": tt.FOUND_OPTIONS,
                       "optimum": 0.875, "random_vocab": 0.176}
    page = tt.render_page(result)
    assert "## A binary outcome: found within 3 turns" in page
    assert "**Verdict (found): not.**" in page and "**Verdict: reproduced.**" in page
    row = tt.summary_row(result, "trace-tiny.md", index=True)
    assert row.endswith("| reproduced (graded), not (found) |")
    assert "found within 3 turns (binary): GRPO" in row
