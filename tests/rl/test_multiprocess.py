"""Multi-process runs on localhost (jax.distributed, gloo CPU collectives): 2 processes x 2
forced CPU devices train the same params as 1 process x 4 devices; their orbax
checkpoint restores in a 1-device process; a process count that disagrees with the
coordinator, and malformed flags, are clear errors."""
import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments.common.flags import add_distributed_flags, distributed_from_args
from rl.runtime.distributed import (
    DistributedConfig,
    distributed_config,
    initialize_distributed,
    process_shard,
)

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("mp_worker.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(out, devices, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               f" --xla_force_host_platform_device_count={devices}")
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, WORKER, str(out), *map(str, flags)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=300):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_two_processes_match_one_process_and_checkpoint_restores(tmp_path):
    port = free_port()
    coord = ("--coordinator", f"localhost:{port}", "--num-processes", 2)
    procs = [launch(tmp_path / "mp", 2, *coord, "--process-id", i) for i in (0, 1)]
    procs.append(launch(tmp_path / "one", 4))
    outs = finish(procs)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    mp, one = np.load(tmp_path / "mp" / "params.npz"), np.load(tmp_path / "one" / "params.npz")
    names = [k for k in one.files if k.startswith("p")]
    diff = max(float(np.abs(mp[k] - one[k]).max()) for k in names)
    assert diff <= 1e-5, diff
    assert float(mp["loss"]) == pytest.approx(float(one["loss"]), abs=1e-6)

    # The checkpoint both processes wrote restores here, on one device, bit for bit.
    sys.path.insert(0, str(Path(WORKER).parent))
    import mp_worker

    from models.config import get_config
    from models.decoder import init_params
    from rl.learner import OptimizerConfig, TrainConfig, init_train_state
    from rl.runtime.checkpoint import Checkpointer

    cfg = get_config("tiny", vocab_size=16, max_position_embeddings=32)
    config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-2), temperature=0.7)
    init = init_params(cfg, 3)
    template = init_train_state(init, config, 0)
    with Checkpointer(tmp_path / "mp" / "ckpt") as ck:
        state, meta = ck.restore(template)
    assert meta["processes"] == 2 and int(state.step) == mp_worker.STEPS
    leaves = jax.tree.leaves(state.params)
    assert len(leaves) == len(names)
    for i, x in enumerate(leaves):
        np.testing.assert_array_equal(np.asarray(x), mp[f"p{i}"])
    moved = max(float(np.abs(np.asarray(a) - mp[f"p{i}"]).max())
                for i, a in enumerate(jax.tree.leaves(init)))
    assert moved > 1e-3  # the steps changed the params: the comparison means something


def test_process_count_disagreeing_with_coordinator_is_a_clear_error(tmp_path):
    port = free_port()
    good = launch(tmp_path, 1, "--check-only", "--coordinator", f"localhost:{port}",
                  "--num-processes", 2, "--process-id", 0)
    bad = launch(tmp_path, 1, "--check-only", "--coordinator", f"localhost:{port}",
                 "--num-processes", 3, "--process-id", 1)
    out_good, out_bad = finish([good, bad], timeout=120)
    assert good.returncode == 0, out_good[-2000:]
    assert bad.returncode != 0
    assert "ValueError: this process was launched with --num-processes 3" in out_bad, out_bad[-2000:]
    assert "runs 2 processes" in out_bad


def parse(argv, environ=None):
    parser = add_distributed_flags(argparse.ArgumentParser())
    return distributed_from_args(parser.parse_args(argv), environ=environ or {})


def test_flags_and_environment():
    assert not parse([]).enabled
    assert initialize_distributed(parse([])) is False  # single process: nothing to do
    cfg = parse(["--coordinator", "h:1234", "--num-processes", "4", "--process-id", "3"])
    assert (cfg.coordinator, cfg.num_processes, cfg.process_id) == ("h:1234", 4, 3)
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:9999", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    assert parse([], env) == DistributedConfig("10.0.0.1:9999", 2, 1)
    assert parse(["--process-id", "0"], env).process_id == 0  # the flag wins
    assert parse(["--distributed-auto"]).enabled
    # the library's own entry point takes values (the flags above are experiments' view)
    assert distributed_config("h:1", 2, 1, environ=env) == DistributedConfig("h:1", 2, 1)
    assert distributed_config(environ=env) == DistributedConfig("10.0.0.1:9999", 2, 1)


@pytest.mark.parametrize("argv, env, match", [
    (["--coordinator", "h:1"], {}, "missing: --num-processes, --process-id"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], {}, "HOST:PORT"),
    (["--coordinator", "h:99999", "--num-processes", "2", "--process-id", "0"], {}, "HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], {}, r"\[0, --num-processes=2\)"),
    (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], {}, ">= 1"),
    ([], {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES must be an int"),
    (["--distributed-auto", "--process-id", "1"], {}, "do not also give --process-id"),
])
def test_bad_flags_are_clear_errors(argv, env, match):
    with pytest.raises(ValueError, match=match):
        parse(argv, env)


def test_process_shard_gives_contiguous_global_slices():
    items = list(range(12))
    parts = [process_shard(items, process_index=i, process_count=3) for i in range(3)]
    assert parts == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9, 10, 11])]
    assert process_shard(items) == (0, items)  # this (single) process holds everything
    with pytest.raises(ValueError, match="multiple of 5"):
        process_shard(items, process_index=0, process_count=5)
    with pytest.raises(ValueError, match="process_index"):
        process_shard(items, process_index=3, process_count=3)


def test_only_the_writer_process_writes_metrics(tmp_path):
    from rl.runtime.logging import MetricsLogger, read_jsonl

    quiet = MetricsLogger(tmp_path / "other", wandb_mode="offline", writer=False)
    assert quiet.log(1, {"loss": 0.5}) == {"step": 1, "kind": "train", "loss": 0.5}
    assert quiet.records == [{"step": 1, "kind": "train", "loss": 0.5}]
    quiet.close()
    assert not (tmp_path / "other").exists()  # no file, no wandb directory
    main = MetricsLogger(tmp_path / "main", wandb_mode="disabled")  # process 0 by default
    assert main.writer
    main.log(2, {"loss": 0.25})
    main.close()
    assert read_jsonl(tmp_path / "main" / "metrics.jsonl") == [{"step": 2, "kind": "train", "loss": 0.25}]


def test_global_batch_in_one_process_is_the_local_batch():
    from rl.learner import TrainBatch, global_batch
    from rl.runtime.mesh import batch_sharding, make_mesh_preset

    rng = np.random.default_rng(0)
    local = TrainBatch(tokens=rng.integers(0, 9, (4, 6)).astype(np.int32),
                       positions=np.tile(np.arange(6, dtype=np.int32), (4, 1)),
                       loss_mask=rng.random((4, 6)) > 0.5,
                       behaviour_logprobs=rng.normal(size=(4, 6)).astype(np.float32),
                       versions=np.zeros((4, 6), np.int32),
                       rewards=rng.normal(size=(4, 1)).astype(np.float32),
                       group_size=2, reward_names=("r",))
    mesh = make_mesh_preset("single")
    out = global_batch(local, mesh)
    assert out.group_size == 2 and out.reward_names == ("r",) and out.packed is None
    for name in ("tokens", "positions", "loss_mask", "behaviour_logprobs", "versions", "rewards"):
        arr = getattr(out, name)
        assert arr.sharding == batch_sharding(mesh)
        np.testing.assert_array_equal(np.asarray(arr), getattr(local, name))
    with pytest.raises(ValueError, match="takes a TrainBatch"):
        global_batch({"tokens": local.tokens}, mesh)
