"""LATR's sampler benchmark: the smoke run (tiny model) grows every prompt's tree three
ways and they agree row for row (the script stops otherwise), the device steps take fewer
calls; the committed page, README row and index row are its JSON rendered."""
import json

from experiments.bench import latr_decode as bench


def test_tiny_run_three_ways_same_rows_fewer_calls(capsys):
    bench.main(["--tiny", "--prompts", "2"])
    out = capsys.readouterr().out
    assert "host_copy/device_shared" in out
    calls = {line.split()[0]: float(line.split()[2]) for line in out.splitlines()
             if line.split() and line.split()[0] in bench.WAYS}
    assert calls["device_shared"] < calls["host_shared"] == calls["host_copy"]


def test_the_committed_page_and_rows_are_its_json_rendered():
    result = json.loads(bench.RESULT.read_text())
    assert bench.PAGE.read_text() == bench.render_page(result)
    readme = (bench.ROOT / "README.md").read_text().splitlines()
    index = (bench.PAGE.parent / "index.md").read_text().splitlines()
    assert bench.summary_row(result, "docs/results/latr-decode.md") in readme
    assert bench.summary_row(result, "latr-decode.md", index=True) in index
