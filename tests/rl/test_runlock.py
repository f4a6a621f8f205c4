"""Run-dir lock: a second process (a real subprocess) that tries to train in a locked run
dir gets RunLockError naming the holder's pid; after the holder is killed with SIGKILL
the lock is free; re-entrant in one process; rl.loops.run holds it while it trains
(refusing a second writer before compiling) and gives it back at the end. Whether the
lock is held is checked with a raw fcntl.flock on a new open file, not with RunLock."""
import dataclasses
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl.runtime.runlock import RunLock, RunLockError, check_run_dir_free

REPO = Path(__file__).resolve().parents[2]


def lock_is_free(run_dir):
    """True if a fresh open file description can take the flock (then gives it back)."""
    fd = os.open(Path(run_dir) / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops a flock taken here
    return True


def python(code, *args, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kw)


TRY_LOCK = """
    import sys
    from rl.runtime.runlock import RunLock, RunLockError
    try:
        RunLock(sys.argv[1])
    except RunLockError as err:
        print(err)
        sys.exit(3)
    print("acquired")
"""


HOLD_LOCK = """
    import sys, time
    from rl.runtime.runlock import RunLock
    lock = RunLock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
"""


def test_second_process_gets_the_holders_pid(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        assert lock.held and not lock_is_free(tmp_path / "run")
        p = python(TRY_LOCK, tmp_path / "run")
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 3, out
        assert f"pid {os.getpid()} on host" in out and "is in use" in out
    assert lock_is_free(tmp_path / "run")
    p = python(TRY_LOCK, tmp_path / "run")
    assert p.communicate(timeout=120)[0].strip() == "acquired" and p.returncode == 0


def test_lock_of_a_killed_holder_is_free(tmp_path):
    holder = python(HOLD_LOCK, tmp_path / "run")
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=f"pid {holder.pid} on host"):
            RunLock(tmp_path / "run")
        with pytest.raises(RunLockError, match=f"pid {holder.pid}"):
            check_run_dir_free(tmp_path / "run")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    assert lock_is_free(tmp_path / "run")
    with RunLock(tmp_path / "run"):
        assert not lock_is_free(tmp_path / "run")


def test_reentrant_in_one_process_and_disabled_lock(tmp_path):
    outer = RunLock(tmp_path / "run")
    inner = RunLock(tmp_path / "run")  # the same process: re-entrant
    check_run_dir_free(tmp_path / "run")
    inner.release()
    inner.release()  # idempotent
    assert not lock_is_free(tmp_path / "run")
    outer.release()
    assert lock_is_free(tmp_path / "run")
    assert (tmp_path / "run" / ".lock").read_text() == ""  # the holder's record is cleared
    off = RunLock(tmp_path / "other", enabled=False)
    assert not off.held and not (tmp_path / "other").exists()
    off.release()


def test_the_loop_holds_the_lock_and_refuses_a_second_writer(tmp_path):
    from rl.loops import run
    from rl.run import PRESETS, LoggingConfig, RunHooks, load_policy

    preset = PRESETS["tiny-synthetic"]
    loop = dataclasses.replace(preset.loop, steps=1, prompts_per_step=2, group_size=4,
                               eval_prompts=8, eval_every=0, save_every=0, eval_greedy=False)
    run_cfg = dataclasses.replace(preset, loop=loop, run_dir=str(tmp_path / "run"),
                                  logging=LoggingConfig(wandb="disabled", progress=False))
    config, params, task = load_policy(preset, 0)
    holder = python(HOLD_LOCK, tmp_path / "run")
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=f"pid {holder.pid}"):
            run(config, params, task, run_cfg)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any work
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    seen = []
    run(config, params, task, run_cfg,
        hooks=RunHooks(on_eval=lambda rec: seen.append(lock_is_free(tmp_path / "run"))))
    assert seen == [False, False]  # held while training (evals at steps 0 and 1)
    assert lock_is_free(tmp_path / "run")  # given back at the end
