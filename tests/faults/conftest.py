"""Shared pieces of the fault-injection suite (tests/faults/): the tiny config in the
geometry of tests/rl/test_sync_loop.py and tests/test_train_job.py (2 groups of 4, 8 eval
prompts: the compiled sampler and train step are shared with them inside one pytest
process), how a run is compared with the uninterrupted one (params, optimizer state and
the non-timing metric records, bit for bit), a way to send a real signal at the k-th
call of any function, subprocess runs of `python -m experiments.train` that share one
persistent XLA compilation cache, and a small disk (a tmpfs, where this process may
mount one).

The number of random fault points each test draws: TANDEM_FAULT_SAMPLES (default 1, the
CI sample; e.g. 8 for a longer hunt); the draws come from TANDEM_FAULT_SEED (default 0).
"""
import contextlib
import dataclasses
import errno
import functools
import json
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest

from rl.run import PRESETS, LoggingConfig, load_policy

REPO = Path(__file__).resolve().parents[2]
PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=4, prompts_per_step=2, group_size=4,
                           eval_prompts=8, eval_every=2, save_every=0, eval_greedy=False)
SAMPLES = int(os.environ.get("TANDEM_FAULT_SAMPLES", "1"))
SEED = int(os.environ.get("TANDEM_FAULT_SEED", "0"))
TIMING = ("tokens_per_s", "peak_rss_mb", "peak_rss_per_step")


def cfg(run_dir, loop=LOOP, **sections):
    """The preset with this loop (and other sections), writing into run_dir, quiet."""
    return dataclasses.replace(PRESET, loop=loop, run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False), **sections)


def draws(n_points: int, name: str) -> list[int]:
    """SAMPLES distinct points in [0, n_points) for test `name` (seeded)."""
    rng = random.Random(f"{SEED}:{name}")
    return sorted(rng.sample(range(n_points), min(SAMPLES, n_points)))


@pytest.fixture(scope="module")
def policy():
    config, params, task = load_policy(PRESET, 0)
    return config, jax.device_put(params, jax.devices()[0]), task


def records(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def comparable(recs) -> list[dict]:
    """Records without what differs run to run (timings, memory)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s") and k not in TIMING}
            for r in recs]


def state_leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def assert_same_state(a, b):
    la, lb = state_leaves(a), state_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def restore(run_dir, step=None):
    """(state, meta) of a run dir's checkpoint (default: the latest)."""
    from rl.learner import init_train_state
    from rl.runtime.checkpoint import Checkpointer

    _, params, _ = load_policy(PRESET, 0)
    with Checkpointer(Path(run_dir) / "checkpoints") as ck:
        return ck.restore(init_train_state(params, PRESET.train, 0), step=step)


def checkpoint_steps(run_dir) -> list[int]:
    folder = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def lock_is_free(run_dir) -> bool:
    from rl.runtime.runlock import RunLock, RunLockError

    try:
        RunLock(run_dir).release()
    except RunLockError:
        return False
    return True


# ----------------------------------------------------------------------------- signals
class SignalAt:
    """Send `sig` to this process at the k-th call (0-based) of obj.name, just before the
    call runs (a real signal: the handler runs in the main thread as for `kill`)."""

    def __init__(self, monkeypatch, obj, name, k, sig=signal.SIGTERM, after=False):
        self.calls, self.sent = 0, False
        original = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            fire = self.calls == k
            self.calls += 1
            if fire and not after:
                self.send(sig)
            out = original(*args, **kwargs)
            if fire and after:
                self.send(sig)
            return out

        monkeypatch.setattr(obj, name, wrapper)

    def send(self, sig):
        self.sent = True
        os.kill(os.getpid(), sig)


class CallCounter:
    """Count the calls of obj.name (to size the space of fault points)."""

    def __init__(self, monkeypatch, obj, name):
        self.calls = 0
        original = getattr(obj, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapper)


# ----------------------------------------------------------------------------- subprocesses
@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory):
    """A persistent compilation cache the suite's subprocesses share (a run after the first
    starts in seconds instead of compiling for ~20 s)."""
    return tmp_path_factory.getbasetemp().parent / "tandem-fault-xla-cache"


def train_env(cache) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(cache, *args, **popen) -> subprocess.Popen:
    """`python -m experiments.train *args` in a subprocess (stdout/stderr piped)."""
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *map(str, args)],
                            cwd=REPO, env=train_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def wait_for(predicate, proc, timeout=300.0, poll=0.02):
    """Poll until predicate() (True) or the process ends / timeout (False)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            return predicate()
        time.sleep(poll)
    return False


def train_steps_logged(run_dir) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines()
               if line.endswith("}") and '"kind": "train"' in line)


# ----------------------------------------------------------------------------- a small disk
class SmallDisk:
    """A directory on a tmpfs of `size` bytes (mount_tmpfs): fill() takes every free byte
    (a filler file), free() gives them back."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        self.filler = path / f".filler-{uuid.uuid4().hex[:6]}"

    def fill(self, leave: int = 0) -> None:
        with open(self.filler, "ab") as f:
            chunk = b"\0" * 4096
            while True:
                free = os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize
                if free <= leave:
                    return
                try:
                    f.write(chunk[:max(1, min(len(chunk), free - leave))])
                    f.flush()
                except OSError as err:
                    if err.errno == errno.ENOSPC:
                        return
                    raise

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()


def mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, check=False)
    return proc.returncode == 0
