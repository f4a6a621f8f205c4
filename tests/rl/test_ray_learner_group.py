"""A jax.distributed learner group with Ray rollout workers (rl/loops/ray_workers.py):
`python -m experiments.train` as 2 learner processes x 1 CPU device (localhost
coordinator, gloo collectives), each with its own Ray rollout worker sampling that
process's half of every step's prompts on the deterministic schedule (η = 1), trains to
the same losses, rewards and parameters as the in-process deterministic run of 1 process x
2 devices on the same `dp` mesh, also when stopped after 2 steps and resumed; the ring's
versions are saved beside the checkpoint by process 0. The refusals say which async settings a learner group cannot run."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_multiprocess import finish, free_port
from test_train_multiprocess import records

from rl.learner import init_train_state
from rl.runtime.checkpoint import Checkpointer
from rl.runtime.distributed import DistributedConfig

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "3", "--mesh", "dp", "--prompts-per-step", "2", "--group-size", "4",
        "--eval-prompts", "8", "--eval-every", "0", "--wandb", "disabled", "--no-progress",
        "--max-staleness", "1", "--async-mode", "deterministic"]
RAY = ["--async-backend", "ray", "--rollout-workers", "1", "--worker-cpus", "0.5",
       "--ray-address", "local"]  # each learner process its own local Ray: no shared state


def launch(run_dir, devices, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               f" --xla_force_host_platform_device_count={devices}")
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "RAY_ADDRESS"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *ARGS, "--run-dir",
                             str(run_dir), *flags], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def group(run_dir, *flags):
    """The two learner processes of a group run (a fresh coordinator port)."""
    coord = ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    return [launch(run_dir, 1, *RAY, *coord, "--process-id", str(i), *flags) for i in (0, 1)]


def test_a_learner_group_with_ray_workers_equals_the_one_process_run(tmp_path):
    """The group stopped after 2 steps and resumed (`--resume`: fresh workers in both
    processes, the ring and the rng chain from the checkpoint) to 3 equals the straight
    one-process run of 3 steps."""
    one, two = tmp_path / "one", tmp_path / "two"
    procs = [launch(one, 2), *group(two, "--steps", "2")]
    outs = finish(procs, timeout=500)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    procs = group(two, "--resume")
    for p, out in zip(procs, finish(procs, timeout=500)):
        assert p.returncode == 0, out[-3000:]
    a = records(one)
    b = [r for r in records(two) if r["kind"] == "train"] + records(two)[-1:]
    b = records(two)[:1] + b  # the first run's step-0 eval, steps 1-3, the last eval
    assert [r["kind"] for r in a] == [r["kind"] for r in b] and len(a) == 5  # eval, 3, eval
    assert [r.get("step") for r in b[1:4]] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("reward", "reward_mean", "loss", "grad_norm", "tokens"):
            if key in ra:
                np.testing.assert_allclose(rb[key], ra[key], rtol=1e-5, atol=1e-6, err_msg=key)
    trained = [r for r in b if r["kind"] == "train"]
    assert [r["ray_request_lag"] for r in trained] == [0.0, 1.0, 1.0]  # v - max(v - η, 0)
    assert all(r["ray_workers"] == 1.0 and r["ray_worker_restarts"] == 0 for r in trained)
    # the deterministic resume's ring (versions 2, 3 at η = 1), written once by process 0
    assert sorted(x.name for x in (two / "snapshots" / "3").iterdir()) == ["v2.npz", "v3.npz"]
    from rl.run import PRESETS, load_policy

    preset = PRESETS["tiny-synthetic"]
    _, params, _ = load_policy(preset, 0)
    template = init_train_state(params, preset.train, 0)
    states = []
    for run_dir in (one, two):
        with Checkpointer(run_dir / "checkpoints") as ck:
            states.append(ck.restore(template, step=3)[0])
    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(states[0].params),
                               jax.tree.leaves(states[1].params)))
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("sets, match", [
    (["async.mode=deterministic"], "with Ray rollout workers"),
    (["async.mode=threaded", "async.backend=ray"], "deterministic schedule"),
    (["async.mode=deterministic", "async.backend=ray", "async.proximal=exact"],
     "proximal='exact'"),
    (["async.mode=deterministic", "async.backend=ray", "async.proximal=ewma"],
     "proximal='ewma'"),
])
def test_a_learner_group_refuses_what_it_cannot_run(sets, match):
    from rl.run import PRESETS

    group = DistributedConfig(coordinator="localhost:1234", num_processes=2, process_id=0)
    base = dataclasses.replace(PRESETS["tiny-synthetic"], distributed=group)
    with pytest.raises(ValueError, match=match):
        base.overrides(sets).validate()
    ok = base.overrides(["async.mode=deterministic", "async.backend=ray",
                         "async.proximal=versions"])
    ok.validate()
