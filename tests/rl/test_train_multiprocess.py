"""The main job across processes: `python -m experiments.train` run as 2 processes × 1 CPU
device (localhost coordinator, gloo collectives; each process samples its own half of the
prompts) trains to the same params, losses and rewards as 1 process × 2 devices on the
same `dp` mesh, and only process 0 writes the results files."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from test_multiprocess import finish, free_port

from rl.learner import init_train_state
from rl.run import PRESETS, load_policy
from rl.runtime.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "2", "--mesh", "dp", "--prompts-per-step", "2", "--group-size", "4",
        "--eval-prompts", "8", "--eval-every", "0", "--wandb", "disabled", "--no-progress"]


def launch(run_dir, devices, *flags):
    # the suite's compile flags (tests/conftest.py), for both sides of the comparison
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               f" --xla_force_host_platform_device_count={devices}")
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *ARGS, "--run-dir",
                             str(run_dir), *flags], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if json.loads(x)["kind"] in ("train", "eval")]


def test_two_process_training_equals_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    coord = ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    procs = [launch(one, 2),
             launch(two, 1, *coord, "--process-id", "0"),
             launch(two, 1, *coord, "--process-id", "1")]
    outs = finish(procs, timeout=400)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    a, b = records(one), records(two)
    assert [r["kind"] for r in a] == [r["kind"] for r in b] and len(a) == 4  # eval, 2 train, eval
    for ra, rb in zip(a, b):
        for key in ("reward", "reward_mean", "loss", "grad_norm", "tokens"):
            if key in ra:
                np.testing.assert_allclose(rb[key], ra[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert (one / "summary.json").exists() and (two / "summary.json").exists()
    preset = PRESETS["tiny-synthetic"]
    _, params, _ = load_policy(preset, 0)
    template = init_train_state(params, preset.train, 0)
    states = []
    for run_dir in (one, two):
        with Checkpointer(run_dir / "checkpoints") as ck:
            states.append(ck.restore(template, step=2)[0])
    diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)))
    assert diff <= 1e-5, diff
