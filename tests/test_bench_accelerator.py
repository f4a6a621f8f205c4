"""experiments.bench.accelerator on this CPU: the budgeted process runner (a hanging, a
crashing and a raising task each become a row, rows written before a failure survive, a
spent budget skips), the plan (cuDNN on copies first, baselines too big for the device
skipped), the tuned table written from sweep rows and read back by the dispatcher, the
import path without the optional packages, and the whole --smoke run (tiny shapes, Pallas
in interpret mode) with its parts' rows and headline; the speed check (issue 33): its plan,
the torch peers' ratios, the bytes a decode step reads against a hand count, the torch side
importing without torch, and the whole --speed --smoke run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from experiments.bench import accelerator
from experiments.bench.accelerator import decode_parts, runner, speed, tune

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("wandb", "gguf", "reasoning_gym", "math_verify")
FAKE = "tests.test_bench_accelerator"


# ----------------------------------------------------------------------------- fake tasks
def fake_rows_then_hang(emit, *, rows):
    for i in range(rows):
        emit({"status": "ok", "i": i})
    time.sleep(600)


def fake_rows_then_crash(emit):
    emit({"status": "ok", "i": 0})
    os._exit(3)


def fake_raises(emit):
    emit({"status": "ok", "i": 0})
    raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded")


def _env():
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_runner_turns_hang_crash_and_exception_into_rows(tmp_path):
    log = runner.RowLog(tmp_path / "rows.jsonl")
    tasks = [
        {"part": "p", "item": "hang", "fn": f"{FAKE}:fake_rows_then_hang", "args": {"rows": 2},
         "cap_s": 6},
        {"part": "p", "item": "crash", "fn": f"{FAKE}:fake_rows_then_crash", "cap_s": 60},
        {"part": "p", "item": "raise", "fn": f"{FAKE}:fake_raises", "cap_s": 60},
    ]
    t0 = time.perf_counter()
    runner.run_tasks(tasks, budget_s=120, log=log, env=_env())
    assert time.perf_counter() - t0 < 100          # the hanging task was killed at its cap
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert rows == log.rows
    by_item = {}
    for row in rows:
        by_item.setdefault(row["item"], []).append(row)
    hang = by_item["hang"]
    assert [r["status"] for r in hang] == ["ok", "ok", "timeout"]
    assert "killed at its time limit of 6 s after 2 row(s)" in hang[-1]["error"]
    crash = by_item["crash"]
    assert [r["status"] for r in crash] == ["ok", "error"]
    assert "process ended with exit 3 after 1 row(s)" in crash[-1]["error"]
    raised = by_item["raise"]
    assert [r["status"] for r in raised] == ["ok", "error"]
    assert raised[-1]["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED")


def test_runner_skips_tasks_once_the_budget_is_spent(tmp_path):
    log = runner.RowLog(None)
    runner.run_tasks([{"part": "p", "item": "late", "fn": f"{FAKE}:fake_raises"}], budget_s=1.0,
                     log=log)
    assert log.rows == [{"part": "p", "item": "late", "status": "skipped",
                         "reason": "budget of 1 s spent"}]


def _plan(parts, platform="gpu", memory=80 * 2**30, smoke=False):
    sz = accelerator.SMOKE if smoke else accelerator.FULL
    return accelerator.plan_tasks(parts, sz, platform, memory, smoke, 989.0, legacy=False)


def test_plan_runs_cudnn_on_copies_first_and_skips_what_cannot_fit():
    tasks, skipped = _plan(list(accelerator.DEFAULT_PARTS))
    items = [t["item"] for t in tasks]
    assert items[:4] == ["copies_cudnn 16,4096,1024", "default 16,4096,1024",
                         "copies_cudnn 8,2048,512", "default 8,2048,512"]
    assert all(t["part"] != "tune" for t in tasks)
    # XLA on 16 copies of 5120 tokens x 32 heads needs far more than 80 GiB
    assert [s["item"] for s in skipped] == ["copies_xla 16,4096,1024"]
    assert "exceeds 90% of the device's 80 GiB" in skipped[0]["reason"]
    assert "copies_xla 8,2048,512" in items
    assert all(t["cap_s"] > 0 and t["fn"].count(":") == 1 for t in tasks)
    tune_tasks, _ = _plan(["tune"])
    assert len(tune_tasks) == 2 * 6 + 1     # two (dtype, head_dim) x six launches + split
    cpu_tasks, _ = _plan(["dualkv"], platform="cpu", memory=None, smoke=True)
    assert [t["item"] for t in cpu_tasks][:2] == ["copies_xla 3,40,17", "split_xla 3,40,17"]


def test_memory_estimate_of_the_copies_baselines():
    # XLA materialises 16 x 32 x 5120^2 fp32 scores (and three companions): ~200 GiB;
    # cuDNN only the bf16 q/k/v/o/dO/dq/dk/dv of the copies: ~3 GiB
    shape = (16, 4096, 1024, 32, 8, 128)
    assert accelerator.copies_memory_bytes("copies_xla", *shape) > 150 * 2**30
    assert 2**30 < accelerator.copies_memory_bytes("copies_cudnn", *shape) < 4 * 2**30


def test_headline_is_ours_over_cudnn_on_copies_at_the_headline_shape():
    rows = [{"part": "dualkv", "status": "ok", "N": 16, "P": 4096, "R": 1024,
             "impl": "copies_cudnn", "ms": 23.6},
            {"part": "dualkv", "status": "ok", "N": 16, "P": 4096, "R": 1024,
             "impl": "default", "ms": 11.8},
            {"part": "dualkv", "status": "ok", "N": 8, "P": 2048, "R": 512,
             "impl": "default", "ms": 1.0}]
    head = accelerator.headline(rows, "H100", smoke=False)
    assert head["value"] == 2.0 and head["target"] == 2.0 and head["machine"] == "H100"
    assert accelerator.headline(rows[1:], "H100", smoke=False)["value"] == 0.0


def test_tuned_table_from_sweep_rows_is_read_back_by_the_dispatcher(tmp_path):
    import jax.numpy as jnp

    from kernels.shared_prefix_attention import BlockSizes, LaunchConfig, SplitOptions
    from kernels.shared_prefix_attention.smem import launch_fits
    from kernels.shared_prefix_attention.tuned import choose_block_sizes, choose_split_options

    def row(launch, cfg, ms, default=False, ok=True, kind="triton"):
        return {"part": "tune", "status": "ok", "kind": kind, "launch": launch,
                "dtype": "float32", "head_dim": 128, "N": 8, "P": 2048, "R": 512,
                "config": cfg, "ms": ms, "is_default": default, "ok": ok}

    fast = {"block_q": 64, "block_k": 32, "num_warps": 4, "num_stages": 3}
    wrong = {"block_q": 128, "block_k": 32, "num_warps": 8, "num_stages": 2}
    base = {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}
    rows = [row("dq_resp", base, 10.0, default=True), row("dq_resp", fast, 8.0),
            row("dq_resp", wrong, 5.0, ok=False),            # fastest but wrong: dropped
            row("fwd_resp", base, 10.0, default=True),
            row("fwd_resp", fast, 9.9),                      # 1% faster: not worth a change
            row(None, {"joint_prompt": False}, 3.0, default=True, kind="split"),
            row(None, {"joint_prompt": True}, 2.5, kind="split")]
    table = tune.best_table(rows, "NVIDIA H100 80GB HBM3", "0.11.2")
    path = tune.write_table(table, tmp_path)
    assert path.name == "nvidia_h100_80gb_hbm3.json"
    kind = "NVIDIA H100 80GB HBM3"
    chosen = choose_block_sizes(jnp.float32, 128, device_kind=kind, directory=tmp_path)
    assert chosen.launch("dq_resp") == LaunchConfig(**fast)
    assert chosen.launch("fwd_resp") == choose_block_sizes(jnp.float32, 128).launch("fwd_resp")
    assert choose_split_options(jnp.float32, 128, device_kind=kind,
                                directory=tmp_path) == SplitOptions(joint_prompt=True)
    assert tune.best_table(rows[3:5], kind, "0.11.2") is None
    # every candidate of the sweep fits the chip as it is (nothing for the fit to shrink)
    defaults = {"fwd_resp": {**base, "block_q": 128},   # 128x128 shrunk to 128x64 for fp32
                "dkdv_prompt": base}
    for launch, default in defaults.items():
        cands = tune.candidates(launch, 128, "float32")
        assert cands[0] == default
        assert len(cands) > 10
        assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
        for cfg in cands:
            assert launch_fits(launch, LaunchConfig(**cfg), 128, jnp.float32)
    assert isinstance(chosen, BlockSizes)


def _blocker(tmp_path) -> Path:
    """A sitecustomize.py making the optional packages unimportable in every process that
    has its folder on PYTHONPATH (the bench's task processes inherit it)."""
    folder = tmp_path / "block"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import importlib.abc, sys
        class _Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {OPTIONAL!r}:
                    raise ImportError("blocked for the test: " + name)
        sys.meta_path.insert(0, _Block())
    """))
    return folder


def _blocked_env(tmp_path):
    return {**os.environ, "PYTHONPATH": f"{_blocker(tmp_path)}{os.pathsep}{ROOT}"}


def _absent_env(tmp_path):
    """Like _blocked_env, but the optional packages look absent the way an uninstalled
    package does to importlib.util.find_spec (None, not an error): transformers probes for
    wandb that way on import."""
    folder = tmp_path / "absent"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        f"import sys\nfor _name in {OPTIONAL!r}:\n    sys.modules[_name] = None\n")
    return {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}"}


def test_import_path_needs_none_of_the_optional_packages(tmp_path):
    """The modules the check imports (and those its parts import lazily) import without
    wandb, gguf, reasoning-gym or math-verify, as on the stock GPU image."""
    modules = ["experiments.bench.accelerator", "experiments.bench.accelerator.kernel_parts",
               "experiments.bench.accelerator.model_parts", "experiments.bench.accelerator.tune",
               "experiments.bench.accelerator.micro", "experiments.common.benchmarking", "rl.rollout",
               "rl.learner", "rl.trajectory", "models.config", "models.decoder",
               "models.attention", "kernels.shared_prefix_attention.cudnn"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"assert not any(m.split('.')[0] in {OPTIONAL!r} for m in sys.modules)\n"
            "try:\n    import wandb\nexcept ImportError:\n    print('blocked')\n")
    out = subprocess.run([sys.executable, "-c", code], env=_blocked_env(tmp_path), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "blocked"


def test_refuses_on_cpu_without_smoke():
    with pytest.raises(SystemExit, match="no accelerator here"):
        accelerator.main(["--parts", "decode", "--budget", "5"])


@pytest.mark.slow  # every part in its own process on 2 cores (kernels interpreted): minutes
def test_smoke_runs_every_part_without_optional_packages(tmp_path):
    out = tmp_path / "acc.json"
    before = {name: (ROOT / "experiments" / "results" / name).read_bytes()
              for name in ("bench_spa_kernel.json", "bench_segment_decode_kernel.json")}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.accelerator", "--smoke", "--budget", "1500",
         "--parts", *accelerator.DEFAULT_PARTS, "tune", *accelerator.CPU_PARTS,
         "--out", str(out),
         "--tuned-dir", str(tmp_path / "tuned")],
        env=_blocked_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    lines = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    assert lines == saved["rows"] and saved["smoke"] is True
    # complete exactly when every row ran
    counts = {}
    for r in saved["rows"][1:]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    assert saved["row_status"] == counts
    assert saved["complete"] is (set(counts) <= {"ok"})
    assert {r["part"] for r in saved["rows"]} == {"probe", *accelerator.DEFAULT_PARTS, "tune",
                                                  *accelerator.CPU_PARTS}
    assert not [r for r in saved["rows"] if r.get("status") not in ("ok", "skipped")]
    correct = saved["correctness"]
    assert {(r["kernel"], r["impl"], r["dtype"]) for r in correct} == {
        *((k, i, d) for k in ("shared_prefix fwd+vjp", "segment_decode")
          for i in ("pallas_triton", "pallas_mosaic") for d in ("float32", "bfloat16")),
        *(("shared_prefix fwd+vjp", "split_xla", d) for d in ("float32", "bfloat16")),
        *((k, "pallas_triton", d) for k in ("tree_decode", "tree_attention fwd+vjp")
          for d in ("float32", "bfloat16"))}
    assert all(r["ok"] for r in correct), correct
    assert all(r["max_rel_err"] < 1e-4 for r in correct if r["dtype"] == "float32")
    dual = {r["impl"]: r for r in saved["dualkv"]}
    assert set(dual) == {"copies_xla", "split_xla", "pallas_triton"}
    assert all(r["ms"] > 0 and r["compile_s"] > 0 for r in dual.values())
    assert saved["headline"]["value"] > 0 and saved["headline"]["target"] == 2.0
    assert saved["decode"][0]["max_rel_err"] < 0.05   # segment decode == replicated (bf16)
    assert saved["sampler"][0]["tokens"] == 2 * 2 * 5   # groups x samples x new tokens
    assert {r["packed"] for r in saved["train"]} == {True, False}
    # the CPU micro-benchmarks ran (tiny shapes) and, in --smoke, left their old files alone
    assert saved["spa_kernel"][0]["ms"]["xla"] > 0 and saved["decode_kernel"][0]["xla_ms"] > 0
    assert all((ROOT / "experiments" / "results" / name).read_bytes() == before[name]
               for name in before)
    tuned = [r for r in saved["tune"] if r["item"] != "table"]
    assert {r["kind"] for r in tuned} == {"triton", "split"}
    assert all(r["ok"] for r in tuned if r["kind"] == "triton")


# ----------------------------------------------------------------------------- the speed check
def test_speed_plan_is_model_by_model_with_the_torch_peers_beside():
    tasks = speed.plan_speed_tasks(list(speed.SPEED_PARTS), speed.SPEED_FULL, "gpu", 989.0)
    items = [(t["part"], t["item"]) for t in tasks]
    assert items[:6] == [
        ("decode_step", "qwen2.5-0.5b rows=64 scan+unrolled"),
        ("train", "qwen2.5-0.5b packed remat=none"), ("torch", "qwen2.5-0.5b train"),
        ("sampler", "qwen2.5-0.5b scan"), ("torch", "qwen2.5-0.5b generate"),
        ("sampler", "qwen2.5-0.5b unrolled")]
    assert ("decode_step", "qwen2.5-0.5b rows=256 unrolled") in items
    assert {("train", f"qwen2.5-0.5b packed remat={r}") for r in ("dots", "full")} <= set(items)
    buffers = [t for t in tasks if t["item"].endswith("command buffers")]
    assert len(buffers) == 1 and "WHILE" in buffers[0]["env"]["XLA_FLAGS"]
    # the same samples on both sides of every peer pair
    train = next(t for t in tasks if t["part"] == "train")["args"]
    peer = next(t for t in tasks if t["item"] == "qwen2.5-0.5b train")["args"]
    assert all(train[k] == peer[k] for k in ("model", "groups", "group_size", "prompt",
                                             "response"))
    # the torch peers run in their own processes with JAX off the accelerator (on the H100
    # JAX's preallocation took the memory the torch step ran out of)
    for t in tasks:
        if t["part"] == "torch":
            assert t["env"]["JAX_PLATFORMS"] == "cpu"
            assert t["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        else:
            assert "JAX_PLATFORMS" not in t.get("env", {})
    cpu = speed.plan_speed_tasks(["decode_step"], speed.SPEED_SMOKE, "cpu", None)
    assert [t["item"] for t in cpu] == ["tiny rows=4 scan+unrolled", "tiny rows=8 unrolled"]
    with pytest.raises(SystemExit):   # the speed parts need --speed
        accelerator.main(["--parts", "torch", "--smoke"])


def test_peer_ratios_pair_rows_of_the_same_samples():
    shape = {"model": "m", "groups": 8, "group_size": 8, "P": 256, "R": 256}
    rows = [{"part": "train", "status": "ok", "step_s": 0.2, **shape},
            {"part": "torch", "kind": "train", "status": "ok", "step_s": 0.35, **shape},
            {"part": "sampler", "status": "ok", "tokens_per_s": 30000.0, **shape},
            {"part": "torch", "kind": "generate", "status": "ok", "tokens_per_s": 3000.0,
             "ms_per_step": 21.0, **shape},
            {"part": "decode_step", "kind": "decode step", "status": "ok", "model": "m",
             "rows": 64, "ms_per_step": 1.5},
            {"part": "decode_step", "kind": "decode step", "status": "ok", "model": "m",
             "rows": 256, "ms_per_step": 2.0},
            {"part": "train", "status": "ok", "step_s": 0.1, **{**shape, "P": 128}}]
    out = speed.peer_ratios(rows)
    assert out[0]["vs_torch_per_sample"] == 1.75 and out[2]["vs_hf_generate"] == 10.0
    assert out[4]["vs_hf_generate_step"] == 14.0
    assert "vs_hf_generate_step" not in out[5] and "vs_torch_per_sample" not in out[6]
    assert [{k: v for k, v in r.items() if not k.startswith("vs_")} for r in out] == rows
    head = speed.speed_headline(out[4:6] + [{**out[4], "kind": "decode step", "tokens_per_s":
                                             60000.0, "rows": 64, "model": "qwen2.5-0.5b"}],
                                "H200", smoke=False)
    assert head["value"] == 60000.0 and head["target"] == 50_000.0


def test_decode_bytes_per_step_against_a_hand_count():
    """qwen2.5-0.5b: the weights a step reads counted from the config by hand (tied head:
    the embedding once), bf16; the KV entries of 8 groups x 8 rows."""
    import jax

    from models.config import get_config
    from models.decoder import init_params

    cfg = get_config("qwen2.5-0.5b", dtype="bfloat16", param_dtype="bfloat16")
    e, f, h, k, d, layers = 896, 4864, 14, 2, 64, 24
    per_layer = (e * h * d + h * d + 2 * (e * k * d + k * d)   # q, k, v (+ biases)
                 + h * d * e + 3 * e * f + 2 * e)               # o, MLP, two norms
    n_params = layers * per_layer + 151936 * e + e              # + embedding, final norm
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    weights = decode_parts.weight_bytes(params, cfg)
    assert weights == 2 * n_params and 0.98e9 < weights < 1.0e9  # "reads ~1 GB per step"
    moved = decode_parts.decode_bytes_per_step(cfg, weights=weights, rows=64, group_size=8,
                                               prompt_tokens=255, response_tokens=32.5,
                                               kv_itemsize=2)
    entry = 2 * layers * k * d * 2           # k and v of one token over the layers, bf16
    assert moved["kv_bytes"] == round(8 * 255 * entry + 64 * 32.5 * entry)
    assert moved["bytes_per_step"] == weights + moved["kv_bytes"]
    untied = cfg.replace(tie_word_embeddings=False)
    params = jax.eval_shape(lambda: init_params(untied, 0))
    assert decode_parts.weight_bytes(params, untied) == weights  # the head replaces the table


def test_torch_parts_import_without_torch(tmp_path):
    """The stock GPU image has torch, but the check must import where it is absent: the
    torch tasks then write a skipped row."""
    code = ("import importlib.abc, sys\n"
            "class B(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'transformers'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, B())\n"
            "from experiments.bench.accelerator import torch_parts\n"
            "rows = []\n"
            "torch_parts.train(rows.append, model='tiny', groups=1, group_size=2, prompt=4,"
            " response=3, peak_tflops=None)\n"
            "assert rows[0]['status'] == 'skipped' and 'torch' in rows[0]['reason'], rows\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow  # a dozen task processes (jax, torch) on 2 cores: minutes
def test_speed_smoke_runs_every_part_with_its_torch_peer(tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.accelerator", "--speed", "--smoke",
         "--budget", "1500", "--out", str(out)],
        env=_absent_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    lines = [json.loads(x) for x in out.with_suffix(".jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if not k.startswith("vs_")}
            for r in saved["rows"]] == lines
    assert saved["complete"] and saved["speed"] and saved["smoke"]
    assert not [r for r in saved["rows"] if r.get("status") != "ok"], saved["rows"]
    steps = [r for r in saved["decode_step"] if r["kind"] == "decode step"]
    assert {(r["rows"], r["layer_loop"]) for r in steps} == {(4, "scan"), (4, "unrolled"),
                                                            (8, "unrolled")}
    for r in steps:
        assert r["ms_per_step"] > 0 and r["bytes_per_step"] > r["weight_bytes"] > 0
        assert r["roofline_share"] == pytest.approx(r["roofline_ms"] / r["ms_per_step"],
                                                    rel=1e-2)
        assert r["tokens_made"] == r["rows"] * 5
    assert steps[0]["vs_hf_generate_step"] > 0       # 4 rows = HF generate's 2 x 2
    train = {(r["packed"], r["remat"]): r for r in saved["train"] if "step_s" in r}
    assert set(train) == {(True, "none"), (True, "full"), (False, "none")}
    assert all(r["vs_torch_per_sample"] > 0 and r["peak_memory_per_row_mb"] > 0
               for r in train.values())
    assert all(r["vs_hf_generate"] > 0 and r["tokens"] == 2 * 2 * 5 for r in saved["sampler"])
    # the first model's decode and packed train rows carry a profiler trace's summary
    traces = {r["kind"]: r for r in saved["decode_step"] + saved["train"]
              if r.get("kind", "").endswith("trace")}
    assert set(traces) == {"decode trace", "train trace"}
    for r in traces.values():
        assert r["events"] > 0 and 0 < r["busy_us"] <= r["window_us"] and r["top"]
    assert traces["decode trace"]["steps"] == 5
    torch_rows = {r["kind"]: r for r in saved["torch"]}
    assert torch_rows["train"]["step_s"] > 0 and torch_rows["generate"]["tokens"] == 2 * 2 * 5
    assert saved["headline"]["value"] > 0 and saved["headline"]["target"] == 50_000.0


def test_torch_train_peer_accumulates_micro_batches_when_the_batch_does_not_fit(monkeypatch):
    """A forward of more than 2 rows raises the CUDA out-of-memory error: the peer retries
    with 2 micro-batches of 2 rows (4 samples) and says so in its row."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from experiments.bench.accelerator import torch_parts
    real = torch_parts.hf_model
    seen = []

    def small_memory_model(*args):
        cfg, net, device = real(*args)
        forward = net.forward

        def guarded(*a, input_ids=None, **kw):
            seen.append(int(input_ids.shape[0]))
            if input_ids.shape[0] > 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            return forward(*a, input_ids=input_ids, **kw)
        net.forward = guarded
        return cfg, net, device

    monkeypatch.setattr(torch_parts, "hf_model", small_memory_model)
    rows = []
    torch_parts.train(rows.append, model="tiny", groups=2, group_size=2, prompt=5, response=4,
                      peak_tflops=None, repeats=1)
    assert rows[0]["status"] == "ok" and rows[0]["micro_batches"] == 2 and rows[0]["samples"] == 4
    assert seen[0] == 4 and set(seen[1:]) == {2}


def test_gpu_check_steps_log_their_own_exit_status(tmp_path):
    """experiments/bench/gpu_check.sh's step(): the exit status it logs is the command's
    (a failure, a timeout), not the one of the `date` inside its echo."""
    import subprocess
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "experiments/bench/gpu_check.sh").read_text()
    start = script.index("step() {")
    body = script[start:script.index("\n}\n", start) + 3]
    run = f"OUT={tmp_path} LOGS={tmp_path}\n{body}\nstep ok 5 true\nstep bad 5 false\nstep slow 1 sleep 5\n"
    subprocess.run(["bash", "-c", run], check=True, capture_output=True, text=True)
    log = (tmp_path / "once.log").read_text()
    assert " ok exit 0\n" in log and " bad exit 1\n" in log
    assert " slow exit 124 (timed out)\n" in log


def test_train_flops_is_the_hand_count_of_what_the_step_computes():
    """A hand count for a small config, matmul by matmul (2 FLOPs a multiply-add, the
    backward twice the forward): no vocabulary head on prompt positions."""
    from types import SimpleNamespace

    from experiments.bench.accelerator.model_parts import train_flops

    cfg = SimpleNamespace(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                          intermediate_size=16, num_layers=3, vocab_size=11)
    g, n, p, r = 2, 3, 5, 4
    per_token_fwd = (2 * 8 * 8 + 2 * 8 * 4 + 2 * 8 * 4 + 2 * 8 * 8  # q, k, v, o
                     + 2 * 8 * 16 * 2 + 2 * 16 * 8)                 # gate, up, down
    tokens = g * (p + n * r)                                        # 34 packed tokens
    head_fwd = 2 * 8 * 11 * (g * n * r)                             # 24 scored positions
    pairs = g * (15 + n * (4 * 5 + 10))                             # 1+..+5; 20 + 1+..+4
    attn_fwd = pairs * 2 * (2 * 4 + 2 * 4)                          # 2 heads: QK, PV
    want = 3 * (3 * per_token_fwd * tokens + head_fwd + 3 * attn_fwd)
    assert train_flops(cfg, g, n, p, r) == want


def test_the_h100_mfu_quoted_in_the_docs_is_the_corrected_count():
    """The H100 train row's MFU as printed (28.45 %) used a FLOP count with the head on
    prompt tokens; the docs quote it rescaled by train_flops' count of what the step
    computes: 27.6 %."""
    from models.config import get_config

    from experiments.bench.accelerator.model_parts import train_flops

    raw = json.loads((ROOT / "experiments/results/accelerator_speed_nvidia_h100_80gb_hbm3.json")
                     .read_text())
    row = next(r for r in raw["rows"] if r.get("part") == "train" and r.get("packed", True)
               and r.get("model") == "qwen2.5-0.5b")
    cfg = get_config("qwen2.5-0.5b")
    g, n, p, r = 8, 8, row["P"], row["R"]
    e, h, k, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f
    printed = (6 * (cfg.num_layers * layer + e * cfg.vocab_size) * g * (p + n * r)
               + 12 * g * (p * p / 2 + n * (r * p + r * r / 2)) * h * d * cfg.num_layers)
    mfu = row["mfu"] * train_flops(cfg, g, n, p, r) / printed
    quoted = f"{100 * mfu:.1f} %"
    assert quoted == "27.6 %"
    for page in ("docs/results/gpu-h100.md", "docs/results/index.md", "README.md"):
        assert f"MFU {quoted}" in (ROOT / page).read_text() or \
            f"{quoted} MFU" in (ROOT / page).read_text(), page


def test_an_incomplete_run_is_not_called_complete(tmp_path):
    """write_json: a finished run with a skipped or timed-out row is not complete."""
    from types import SimpleNamespace

    args = SimpleNamespace(smoke=True, speed=False, budget=1.0, parts=["dualkv"])
    probe = {"machine": "m", "device_kind": "cpu", "platform": "cpu", "jax_version": "x"}
    rows = [{"part": "probe"}, {"part": "dualkv", "impl": "xla", "status": "ok", "ms": 1.0},
            {"part": "dualkv", "impl": "copies_xla", "status": "timeout"}]
    accelerator.write_json(tmp_path / "a.json", probe, rows, args, 0.0, done=True)
    saved = json.loads((tmp_path / "a.json").read_text())
    assert saved["complete"] is False and saved["row_status"] == {"ok": 1, "timeout": 1}
    accelerator.write_json(tmp_path / "b.json", probe, rows[:2], args, 0.0, done=True)
    assert json.loads((tmp_path / "b.json").read_text())["complete"] is True
