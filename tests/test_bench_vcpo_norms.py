"""experiments.bench.vcpo_norms on the tiny model: both sides run, their norms agree, and
the results JSON carries its headline."""
import json

from experiments.bench import vcpo_norms


def test_bench_vcpo_norms_tiny(tmp_path):
    out = tmp_path / "bench_vcpo_norms.json"
    vcpo_norms.main(["--model", "tiny", "--rows", "6", "--prompt", "8", "--response", "6",
                     "--ghost-chunk", "4", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["headline"]["value"] > 0 and result["headline"]["target"] == 1.5
    assert [row["side"] for row in result["table"]] == ["ghost", "ghost_full_head", "vmap"]
    assert all(len(row["times_s"]) == 1 for row in result["table"])
    assert result["max_relative_norm_difference"] < 1e-5
    assert result["max_logp_difference"] < 1e-5
