"""experiments.repro.guess_number's baselines and experiments.repro.calculator_tool's summaries and
report, against hand computations on hand-written records and run files."""
import json
from fractions import Fraction

import pytest

from experiments.repro.calculator_tool import main as calc_main
from experiments.repro.calculator_tool import summarize
from experiments.repro.guess_number import baselines
from rl.envs.base import EndReason
from rl.rollout.episodes import EpisodeRecord
from rl.tasks.base import Prompt


def test_guess_number_baselines_of_the_preset():
    b = baselines("tiny-guess")  # K = 8, T = 4
    assert (b["k"], b["max_turns"]) == (8, 4)
    q = Fraction(7, 8)
    rand = Fraction(1, 8) * (1 + q * Fraction(3, 4) + q ** 2 * Fraction(1, 2) + q ** 3 * Fraction(1, 4))
    assert b["random_numbers"] == pytest.approx(float(rand), abs=1e-4)
    # binary search: 1 value at turn 1, 2 at turn 2, 4 at turn 3, 1 at turn 4
    assert b["optimal"] == pytest.approx((1 + 2 * 0.75 + 4 * 0.5 + 0.25) / 8, abs=1e-4)
    assert b["random_vocab"] < b["random_numbers"] < b["consistent_random"] < b["optimal"]


def _rec(i, expr, correct, calls):
    infos = [{"tool_calls": 1}] * calls + [{"tool_calls": 0}]
    return EpisodeRecord(group_id=i, sample=0, prompt=Prompt(ids=(1,), answer=0, text=expr),
                         turns=calls + 1, end_reason=EndReason.DONE, infos=infos,
                         outcome={"correct": correct}, turn_texts=["t"] * (calls + 1))


def test_summarize_counts_accuracy_and_tool_use():
    recs = [_rec(0, "12 * 34", 1.0, 1), _rec(1, "1 + 2 + 3", 0.0, 0),
            _rec(2, "5 * 6 + 7", 1.0, 2), _rec(3, "8 * 9", 0.0, 0)]
    s = summarize(recs)
    assert s["accuracy"] == 0.5 and s["used_tool"] == 0.5
    assert s["tool_calls_per_episode"] == 0.75 and s["accuracy_when_tool_used"] == 1.0
    assert s["accuracy_without_a_call"] == 0.0
    assert s["accuracy_by_kind"] == {"add": 0.0, "mul": 0.5, "muladd": 1.0}
    assert s["end_reasons"] == {"done": 4} and s["turns_per_episode"] == 1.75


def test_report_from_base_file_and_run(tmp_path):
    out = tmp_path / "res" / "calc.json"
    out.parent.mkdir()
    base = {"n": 64, "machine": "m", "no_tool": {"accuracy": 0.02}, "tool": {"accuracy": 0.6}}
    out.with_suffix(".base.json").write_text(json.dumps(base))
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"kind": "eval", "step": s, "greedy_accuracy": a, "greedy_episode_tool_calls": c,
             "accuracy": a - 0.1, "time_s": 60 * s} for s, a, c in [(0, 0.6, 0.7), (5, 0.7, 0.9)]]
    rows.insert(1, {"kind": "train", "step": 1, "reward_correct": 0.5})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 5, "wall_time_s": 300}))
    res = calc_main(["report", "--out", str(out), "--run-dir", str(run)])
    h = res["headline"]
    assert (h["value"], h["base"], h["base_no_tool"]) == (0.7, 0.6, 0.02)
    assert [c["greedy_tool_calls"] for c in res["grpo"]["eval_curve"]] == [0.7, 0.9]
    assert json.loads(out.read_text())["headline"] == h
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
