"""experiments/bench/agentic_overlap.py: a smoke run of the three loops on a tiny config,
and the committed page / README / index rows are exactly what the committed JSON renders."""
import json

from experiments.bench import agentic_overlap as bench


def test_smoke_runs_every_side(tmp_path):
    out = tmp_path / "overlap.json"
    result = bench.main(["--reps", "1", "--steps", "2", "--inline-steps", "2", "--prompts", "1",
                         "--group-size", "2", "--turns", "2", "--latency", "fixed:0.02",
                         "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["headline"]["metric"].startswith("async") and saved["headline"]["target"] == 3.0
    assert {r["side"] for r in saved["reps"]} == set(bench.SIDES)
    inline = saved["median_reps"]["sync_inline"]
    assert 0 < inline["tool_calls_in_flight"] <= 1 and inline["tool_wait_share"] == 0
    assert result["steps_per_hour"]["async"] > 0 and out.with_suffix(".png").is_file()


def test_committed_page_and_rows_come_from_the_json():
    result = json.loads(bench.RESULT.read_text())
    assert bench.PAGE.read_text() == bench.render_page(result)
    assert bench.summary_row(result, "docs/results/agentic-overlap.md") in \
        bench.README.read_text().splitlines()
    assert bench.summary_row(result, "agentic-overlap.md", index=True) in \
        bench.INDEX.read_text().splitlines()


def test_python_tool_page_comes_from_its_json():
    from experiments.repro import python_tool_base as base

    result = json.loads(base.RESULT.read_text())
    assert base.PAGE.read_text() == base.render_page(result)
    assert base.index_row(result) in base.INDEX.read_text().splitlines()
    row = result["rows"][0]
    assert len(row["tool"]["per_problem"]) == len(row["no_tool"]["per_problem"]) == row["n"]
