"""The LATR-vs-GRPO study's smoke: both methods' cells configured as the doc says (the latr
cell grows trees and trains tree-packed), a 4-step sweep records per-problem evals and
cumulative counts, and the analysis applies the rule to hand-made records."""
import dataclasses

import numpy as np

from experiments.repro import latr_tiny as lt

TINY = dataclasses.replace(lt.SETUP, steps=4, eval_every=2, eval_prompts=8,
                           task_options=(("kind", "copy"), ("length", 4), ("alphabet", 4)))


def test_cells_are_configured_as_the_doc_says(tmp_path):
    grpo = lt.cell_config(TINY, "grpo", 1, tmp_path)
    latr = lt.cell_config(TINY, "latr", 1, tmp_path)
    assert grpo.latr is None and not grpo.train.tree
    assert latr.latr is not None and latr.train.tree and not latr.train.packed
    assert latr.loop.seed == grpo.loop.seed == 1 and latr.model.init_seed == 1
    assert latr.latr.mix_ratio == 1.0
    assert lt.cell_config(TINY, "latr_mix", 1, tmp_path).latr.mix_ratio == lt.MIX == 0.5
    latr.validate()


def test_sweep_records_both_methods(tmp_path):
    cells, work = tmp_path / "cells", tmp_path / "work"
    lt.sweep([0], 2, dataclasses.replace(TINY), cells, work)  # grpo and latr (not latr_mix)
    found = lt.load_cells(cells)
    rec = found["latr"][0]
    assert rec["eval_steps"] == [0, 2, 4]
    assert len(rec["eval_problems"]["4"]) == 8
    tokens = rec["tokens_at_eval"]
    assert tokens[0] == 0 and tokens[-1] > tokens[1] > 0
    out = lt.analyse(found)
    assert out["seeds"] == [0] and out["verdict"] in ("reproduced", "partly", "not")


def record(method, seed, curve):
    steps = [0, 100, 200, 300, 400]
    rng = np.random.default_rng(seed)
    return {"method": method, "seed": seed, "eval_steps": steps,
            "eval_problems": {str(s): list(np.clip(v + rng.normal(0, 0.01, 64), 0, 1))
                              for s, v in zip(steps, curve)},
            "tokens_at_eval": [s * 100.0 for s in steps],
            "seconds_at_eval": [s * 1.0 for s in steps], "train_keys": ["step", *lt.TRAIN_KEYS],
            "train": [[1, 0.5, 0.0, 100.0, 1.0, None, None, None, None]], "wall_s": 1.0,
            "machine": "m"}


def test_the_rule_reads_the_curves():
    fast = {"grpo": {s: record("grpo", s, [0.1, 0.3, 0.4, 0.5, 0.6]) for s in range(3)},
            "latr": {s: record("latr", s + 10, [0.1, 0.65, 0.7, 0.8, 0.8]) for s in range(3)}}
    out = lt.analyse(fast)
    assert out["latr_reaches_at"] == 100 and out["speedup"]["steps"] == 4.0
    assert out["verdict"] == "reproduced"
    slow = {"grpo": fast["grpo"],
            "latr": {s: record("latr", s + 10, [0.1, 0.2, 0.3, 0.5, 0.62]) for s in range(3)}}
    assert lt.analyse(slow)["verdict"] == "partly" and lt.analyse(slow)["latr_reaches_at"] == 400
    never = {"grpo": fast["grpo"],
             "latr": {s: record("latr", s + 10, [0.1, 0.2, 0.3, 0.4, 0.45]) for s in range(3)}}
    assert lt.analyse(never)["verdict"] == "not" and lt.analyse(never)["speedup"] is None


def test_the_page_gives_each_arm_its_verdict():
    fast = {"grpo": {s: record("grpo", s, [0.1, 0.3, 0.4, 0.5, 0.6]) for s in range(3)},
            "latr": {s: record("latr", s + 10, [0.1, 0.65, 0.7, 0.8, 0.8]) for s in range(3)},
            "latr_mix": {s: record("latr", s + 20, [0.1, 0.2, 0.3, 0.4, 0.45]) for s in range(3)}}
    arms = {a: lt.analyse(fast, a) for a in lt.ARMS}
    result = {"setup": dataclasses.asdict(lt.SETUP), "eval_steps": arms["latr"]["eval_steps"],
              "machine": "m", "arms": arms}
    page = lt.render_page(result)
    assert "**Verdict: reproduced.**" in page and "**Verdict: not.**" in page
    row = lt.summary_row(result, "latr-tiny.md", index=True)
    assert "LATR (defaults): reproduced" in row and "LATR, mix 0.5: not" in row
