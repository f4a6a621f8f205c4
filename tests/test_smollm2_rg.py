"""experiments.repro.smollm2_rg's collection: per-seed before / after / gain and the mean gain
over seeds, recomputed by hand from hand-written run dirs; the plot; unfinished runs."""
import json
import math

import pytest

from experiments.repro.smollm2_rg import main


def _write_run(d, accs, stderrs, minutes):
    d.mkdir(parents=True)
    rows = []
    for step, (a, se, m) in enumerate(zip(accs, stderrs, minutes)):
        if step:
            rows.append({"kind": "train", "step": step, "reward_correct": a, "reward_format": 0.5,
                         "zero_spread_frac": 0.25, "time_s": 60 * m - 1})
        rows.append({"kind": "eval", "step": step, "greedy_accuracy": a,
                     "greedy_accuracy_stderr": se, "greedy_correct": a, "greedy_format": 0.1 * step,
                     "accuracy": a / 2, "time_s": 60 * m})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "summary.json").write_text(json.dumps({"command": "x", "steps": len(accs) - 1,
                                                "wall_time_s": 60 * minutes[-1]}))


def test_collect_gains_over_seeds(tmp_path):
    _write_run(tmp_path / "smollm2-rg-s0", [0.2, 0.3, 0.45], [0.02, 0.03, 0.03], [2, 20, 40])
    _write_run(tmp_path / "smollm2-rg-s1", [0.2, 0.25, 0.3], [0.02, 0.02, 0.04], [2, 21, 41])
    out = tmp_path / "res" / "r.json"
    res = main(["--seeds", "0", "1", "--run-root", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["runs"]["0"]["gain"] == pytest.approx(0.25)
    assert res["runs"]["1"]["gain"] == pytest.approx(0.10)
    assert res["runs"]["0"]["gain_stderr"] == pytest.approx(math.hypot(0.02, 0.03))
    assert res["headline"]["value"] == pytest.approx(0.175)
    assert res["headline"]["target"] == 0.15 and res["headline"]["reached_target"]
    assert res["gain_over_seeds"]["std"] == pytest.approx(math.sqrt(2 * 0.075 ** 2))
    assert [r["minutes"] for r in res["runs"]["1"]["eval_curve"]] == [2, 21, 41]
    assert res["runs"]["1"]["greedy_rewards"]["format"] == {"before": 0.0, "after": 0.2}
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_unfinished_run_is_a_clear_error(tmp_path):
    (tmp_path / "smollm2-rg-s0").mkdir()
    with pytest.raises(SystemExit, match="no summary.json"):
        main(["--seeds", "0", "--run-root", str(tmp_path), "--out", str(tmp_path / "r.json")])
