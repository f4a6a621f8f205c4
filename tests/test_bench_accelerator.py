"""experiments.bench_accelerator on this CPU: it refuses without an accelerator, and its
--smoke run (tiny shapes, both Pallas kernel families in interpret mode, the tiny model)
passes its own correctness checks against the references and writes a complete JSON."""
from __future__ import annotations

import json

import pytest

from experiments import bench_accelerator


def test_refuses_on_cpu_without_smoke():
    with pytest.raises(SystemExit, match="no accelerator here"):
        bench_accelerator.main(["--parts", "decode"])


@pytest.mark.slow  # ~40 s on 2 cores: every part compiles (kernels interpreted, tiny model)
def test_smoke_runs_every_part(tmp_path):
    out = tmp_path / "acc.json"
    result = bench_accelerator.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["headline"]["target"] == 1.65 and saved["smoke"] is True
    rows = saved["correctness"]
    assert {(r["kernel"], r["impl"], r["dtype"]) for r in rows} == {
        (k, i, d) for k in ("shared_prefix fwd+vjp", "segment_decode")
        for i in ("pallas_triton", "pallas_mosaic") for d in ("float32", "bfloat16")}
    assert all(r["ok"] for r in rows), rows
    assert all(r["max_rel_err"] < 1e-4 for r in rows if r["dtype"] == "float32")
    dualkv, decode = saved["dualkv"][0], saved["decode"][0]
    assert dualkv["ms"]["dualkv"] > 0 and "copies_xla" in dualkv["ms"]
    assert decode["max_abs_diff"] < 0.05   # segment decode == replicated cache (bf16)
    assert saved["sampler"][0]["tokens"] == 2 * 2 * 5   # groups x samples x new tokens
    assert saved["train"][0]["tokens_per_s"] > 0 and saved["train"][0]["mfu"] is None
    assert result["headline"] == saved["headline"]
