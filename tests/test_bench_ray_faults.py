"""The Ray fault, tool-latency and weight-sync benchmarks: their runs are the configs their
docstrings say, the fault check compares what it says (a repeated step's last record, a
missing step counted), the worker's receive casts bf16 back exactly, and each committed
page is its JSON rendered."""
import argparse
import json

import numpy as np
import pytest

from experiments.bench import ray_agentic, ray_faults, ray_sync
from experiments.common.flags import config_from_argv


def test_fault_runs_are_the_deterministic_schedule_on_one_ray_worker(tmp_path):
    args = argparse.Namespace(steps=40)
    for resume in (False, True):
        cmd = ray_faults.train_command(tmp_path, args, resume=resume)
        cfg, _ = config_from_argv(cmd[3:])
        a = cfg.asynchronous
        assert a.backend == "ray" and a.mode == "deterministic" and a.max_staleness == 1
        assert a.rollout_workers == 1 and cfg.loop.steps == 40 and cfg.loop.save_every == 2
        assert dict(cfg.task.options)["length"] == 32
        assert ("--resume" in cmd) == resume
        cfg.validate()


def test_fault_compare_counts_differing_and_missing_steps():
    ref = [{"step": s, "loss": 0.1 * s, "reward_mean": 0.5, "grad_norm": 1.0, "tokens": 64,
            "behaviour_version_min": s - 1, "behaviour_version_max": s - 1} for s in (1, 2, 3)]
    # a resumed run repeats step 2: its last record counts, and it equals the reference
    redone = [ref[0], dict(ref[1], loss=9.0), ref[1], dict(ref[2], ray_worker_restarts=2.0)]
    got = ray_faults.compare(ref, redone)
    assert got == {"steps": 3, "differing_steps": [], "ray_worker_restarts": 2.0,
                   "ray_request_resends": None}
    assert ray_faults.compare(ref, ref[:2])["differing_steps"] == [3]
    assert ray_faults.compare(ref, [ref[0], dict(ref[1], tokens=63), ref[2]])[
        "differing_steps"] == [2]


def test_the_agentic_sides_are_what_the_doc_says(tmp_path):
    args = argparse.Namespace(steps=12, latency="lognormal:0.5,3")
    sync = ray_agentic.side_config("sync", args, str(tmp_path))
    assert sync.asynchronous is None and sync.loop.max_concurrent_tool_calls == 64
    for side, (workers, requests, eta) in (("ray", (2, 1, 2)), ("ray_x2", (2, 2, 4))):
        cfg = ray_agentic.side_config(side, args, str(tmp_path))
        a = cfg.asynchronous
        assert (a.rollout_workers, a.worker_requests, a.max_staleness) == (workers, requests, eta)
        assert a.backend == "ray" and a.mode == "deterministic"
        cfg.validate()
    for cfg in (sync, cfg):
        assert cfg.loop.tool_latency == "lognormal:0.5,3"
        assert cfg.loop.prompts_per_step * cfg.loop.group_size == 64
    with pytest.raises(SystemExit, match="multiples of 4"):
        ray_agentic.main(["--steps", "10", "--skip", "4"])


def test_the_workers_receive_casts_bf16_back_to_the_fp32_rounding():
    import jax.numpy as jnp

    x = np.linspace(-3, 3, 97, dtype=np.float32)
    sent = {"w": x.astype(jnp.bfloat16), "ids": np.arange(4, dtype=np.int32)}
    nbytes, _ = ray_sync.Receiver().receive((sent, ["float32", "int32"]))
    assert nbytes == 97 * 4 + 4 * 4  # back in float32: the bytes of the original
    # bf16 keeps 8 bits of mantissa: within 2^-8 relative of the float32 value
    np.testing.assert_allclose(np.asarray(sent["w"], np.float32), x, rtol=2 ** -8)


@pytest.mark.parametrize("bench", [ray_faults, ray_agentic, ray_sync],
                         ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_committed_page_is_its_json_rendered(bench):
    assert bench.RESULT.is_file(), f"the committed result (python -m {bench.__name__})"
    result = json.loads(bench.RESULT.read_text())
    assert bench.PAGE.read_text() == bench.render_page(result)
    link = bench.PAGE.name
    assert bench.summary_row(result, link, index=True) in bench.INDEX.read_text().splitlines()


def test_the_async_guide_quotes_the_committed_ray_figures():
    """The guide's Ray tool-latency ratios and faults sentence are the committed JSONs'."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs/guides/async.md").read_text()
    guide = " ".join(guide.split())  # the guide wraps its lines
    ratios = json.loads(ray_agentic.RESULT.read_text())["ratios"]
    assert f"{ratios['ray']:.2f}× the synchronous loop with one request a worker" in guide
    assert f"{ratios['ray_x2']:.2f}× with `--worker-requests 2`" in guide
    faults = json.loads(ray_faults.RESULT.read_text())
    assert "every step equals the undisturbed run's" in guide
    assert all(p["differing_steps"] == [] and p["passed"] for p in faults["parts"].values())
