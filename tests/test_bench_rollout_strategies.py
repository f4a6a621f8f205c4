"""The rollout-strategies benchmark's summary over repeated runs (median and range of each
figure, counted by hand) and its page, generated from the committed JSON."""
import json
from pathlib import Path

import numpy as np

from experiments.bench import rollout_strategies as rs

ROOT = Path(__file__).resolve().parents[1]


def _run(static_tps: float, april_tps: float, tokens: int) -> dict:
    row = lambda tps: {"useful_tokens_per_s": tps, "vs_static": tps / static_tps,  # noqa: E731
                       "useful_tokens": tokens, "generated_tokens": tokens,
                       "wasted_tokens": 0, "offpolicy_tokens": 0}
    return {"strategies": {"static": row(static_tps), "april x1.5": row(april_tps)}}


def test_summary_over_runs_by_hand():
    runs = [_run(100.0, 140.0, 50), _run(80.0, 100.0, 50), _run(120.0, 150.0, 50)]
    asyn = [{"sync_step_s": s, "async_step_s": a, "measured_speedup": s / a, "swap_s": 1e-4,
             "cost_model": {"projected_speedup": p}}
            for s, a, p in ((0.02, 0.03, 1.6), (0.03, 0.03, 1.7), (0.025, 0.02, 1.5))]
    out = rs.summarize(runs, asyn)
    april = out["strategies"]["april x1.5"]["vs_static"]
    assert april["runs"] == [1.4, 1.25, 1.25] and april["median"] == 1.25
    assert (april["min"], april["max"]) == (1.25, 1.4)
    assert out["strategies"]["static"]["useful_tokens_per_s"]["median"] == 100.0
    assert out["strategies"]["april x1.5"]["same_tokens_every_run"]
    assert out["async"]["projected_speedup"]["median"] == 1.6
    assert np.isclose(out["async"]["measured_speedup"]["max"], 1.25)
    runs[1]["strategies"]["static"]["wasted_tokens"] = 3
    assert not rs.summarize(runs, [])["strategies"]["static"]["same_tokens_every_run"]
    assert "async" not in rs.summarize(runs, [])


def test_the_committed_page_is_generated_from_the_committed_json():
    result = json.loads((ROOT / "experiments/results/bench_rollout_strategies.json").read_text())
    assert (ROOT / rs.PAGE).read_text() == rs.render_page(result)
    head = result["headline"]
    best = result["summary"]["strategies"][head["best"]]["vs_static"]
    assert head["value"] == round(best["median"], 3) and len(best["runs"]) >= 3
