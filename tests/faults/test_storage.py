"""A disk that fills up (or turns read-only, or refuses permission, or runs out of quota)
at each kind of write a run makes: the run stops within one step with one
`StorageError` line naming what, where, why and the last good checkpoint; orbax's
background tracebacks stay out of the log; the run dir stays resumable from the last good
checkpoint (the unfinished `<step>.orbax-checkpoint-tmp` is removed on resume) and the
resumed run equals the uninterrupted one, bit for bit.

The disk: a real 8 MB tmpfs when this process may mount one (root in a container) — the
checkpoint and side-file writes then fail in the kernel, in orbax's tensorstore writer
threads, as they would on a full disk; elsewhere those failures are injected in Python
(OSError(ENOSPC) from orbax's finalizing rename, from the metrics append, from the
atomic side-file write). The metrics records are always injected: a full tmpfs still
takes a small append into the file's last, partly used page, so which record fails
first is not up to the test. Permission denied, read-only and quota exceeded are
injected too (root ignores file modes; no quota here).
"""
import contextlib
import dataclasses
import errno
import logging
import os
import subprocess
import warnings

import pytest
from conftest import (
    LOOP,
    assert_same_state,
    cfg,
    checkpoint_steps,
    comparable,
    lock_is_free,
    records,
)

from rl.loops import AsyncConfig, run, run_async
from rl.runtime import logging as run_logging
from rl.runtime.checkpoint import Checkpointer, remove_unfinished_saves
from rl.runtime.logging import MetricsLogger
from rl.runtime.storage import (
    StorageError,
    StorageWarning,
    free_space_warning,
    quiet_orbax_echoes,
    storage_reason,
)

EVERY = dataclasses.replace(LOOP, save_every=1, keep_checkpoints=3)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """A directory whose file system can be made full: fill() / free() (see module doc)."""
    from conftest import SmallDisk, mount_tmpfs

    path = tmp_path / "disk"
    real = mount_tmpfs(path, 8 << 20)
    yield SmallDisk(path, 8 << 20) if real else Simulated(path, monkeypatch)
    if real:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@pytest.fixture
def injected(tmp_path, monkeypatch):
    """A 'disk' whose fill() makes the run's writes raise OSError(ENOSPC) (module doc)."""
    return Simulated(tmp_path / "disk", monkeypatch)


class Simulated:
    """The same interface where no tmpfs can be mounted: while 'full', the run's writes
    raise OSError(ENOSPC) (orbax's finalizing rename, the metrics append, atomic writes)."""

    def __init__(self, path, mp):
        self.path, self.full = path, False
        fail_writes(mp, errno.ENOSPC, when=lambda: self.full)

    def fill(self, leave=0):
        self.full = True

    def free(self):
        self.full = False


def fail_writes(mp, code, when=lambda: True, metrics=True):
    """Inject OSError(code) into the run's writes (while when()): orbax's finalizing rename
    (in its writer thread) and, with metrics, the metrics append."""
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def failing_finalize(self, *a, **k):
        if when():
            raise OSError(code, os.strerror(code), str(self.get()))
        return await finalize(self, *a, **k)

    mp.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", failing_finalize)
    if not metrics:
        return
    write = os.write

    def failing_write(fd, data):
        if when():
            raise OSError(code, os.strerror(code))
        return write(fd, data)

    mp.setattr(run_logging.os, "write", failing_write)


@pytest.fixture(scope="module")
def reference(policy, tmp_path_factory):
    config, params, task = policy
    run_dir = tmp_path_factory.mktemp("reference")
    res = run(config, params, task, cfg(run_dir, EVERY))
    return res.state, comparable(records(run_dir))


def synchronous_saves(monkeypatch):
    """Each checkpoint on disk before the run goes on (so a fill hits only what follows)."""
    save = Checkpointer.save

    def save_and_wait(self, *a, **k):
        save(self, *a, **k)
        self.wait()

    monkeypatch.setattr(Checkpointer, "save", save_and_wait)


def at_record(monkeypatch, step, kind, action, before):
    """Call action() just before (or after) the `kind` record of `step` is first written."""
    log = MetricsLogger.log
    armed = [True]

    def patched(self, s, metrics, kind_="train", **kw):
        kind_ = kw.get("kind", kind_)
        hit = (s, kind_) == (step, kind) and armed[0]
        armed[0] = armed[0] and not hit
        if hit and before:
            action()
        out = log(self, s, metrics, kind_)
        if hit and not before:
            action()
        return out

    monkeypatch.setattr(MetricsLogger, "log", patched)


def fill_before_record(monkeypatch, disk, step, kind):
    at_record(monkeypatch, step, kind, disk.fill, before=True)


def fill_after_record(monkeypatch, disk, step, kind):
    at_record(monkeypatch, step, kind, disk.fill, before=False)


def stopped_then_resumed(policy, disk, reference, caplog, what, last_good, loop=EVERY,
                         **sections):
    config, params, task = policy
    run_fn = run if "asynchronous" not in sections else run_async
    run_dir = disk.path / "run"
    with caplog.at_level(logging.ERROR), pytest.raises(StorageError) as info:
        run_fn(config, params, task, cfg(run_dir, loop, **sections))
    err = info.value
    line = str(err)
    failed = int(what.split("step ")[1].split()[0])
    train = [r["step"] for r in records(run_dir) if r["kind"] == "train"]
    assert max(train) <= failed + 1  # stopped within one step
    assert "\n" not in line and what in line and "no space left on device (ENOSPC)" in line
    assert f"the last good checkpoint is step {last_good} " in line and "--resume" in line
    assert err.last_good[0] == last_good and last_good in checkpoint_steps(run_dir)
    assert not [r for r in caplog.records if r.exc_info]  # no traceback wall in the log
    assert lock_is_free(run_dir)
    disk.free()
    res = run_fn(config, params, task, cfg(run_dir, loop, **sections), resume=True)
    assert_same_state(res.state, reference[0])
    assert comparable(records(run_dir)) == reference[1]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]
    return err


def test_full_disk_in_orbax_background_write(policy, disk, reference, caplog, monkeypatch):
    opened = []
    init = Checkpointer.__init__

    def remember(self, *a, **k):
        init(self, *a, **k)
        opened.append(self)

    monkeypatch.setattr(Checkpointer, "__init__", remember)

    def fill():  # once the save of step 2 is on disk: the save of step 3 is the one to fail
        opened[-1].wait()
        disk.fill()

    at_record(monkeypatch, 3, "train", fill, before=False)
    err = stopped_then_resumed(policy, disk, reference, caplog, "cannot write checkpoint step 3",
                               last_good=2)
    assert err.path.endswith("checkpoints")


def test_unfinished_saves_are_removed_while_late_writes_still_land(tmp_path):
    """A failed save's writer threads can go on adding files to its tmp folder while the
    next open deletes it (the "Directory not empty" race): the removal retries until they
    stop; finished checkpoints beside it are kept."""
    import threading
    import time

    tmp = tmp_path / "3.orbax-checkpoint-tmp-17"
    (tmp / "state").mkdir(parents=True)
    (tmp_path / "2").mkdir()
    stop = time.monotonic() + 0.5

    def late_writes():  # a leftover writer: new files as fast as it can for half a second
        i = 0
        while time.monotonic() < stop:
            with contextlib.suppress(FileNotFoundError):
                (tmp / "state").mkdir(parents=True, exist_ok=True)
                (tmp / "state" / f"chunk{i}").write_bytes(b"x" * 64)
            i += 1

    writer = threading.Thread(target=late_writes)
    writer.start()
    try:  # many opens during the writes: a plain rmtree fails on some
        while writer.is_alive():
            remove_unfinished_saves(tmp_path)
    finally:
        writer.join()
    remove_unfinished_saves(tmp_path)  # what the writer added after the last pass
    assert not tmp.exists() and (tmp_path / "2").is_dir()


def test_full_disk_at_the_metrics_record(policy, injected, reference, caplog, monkeypatch):
    synchronous_saves(monkeypatch)
    fill_before_record(monkeypatch, injected, 3, "train")
    err = stopped_then_resumed(policy, injected, reference, caplog,
                               "cannot write the train record of step 3", last_good=2)
    assert err.path.endswith("metrics.jsonl")


def test_full_disk_at_the_eval_record(policy, injected, reference, caplog, monkeypatch):
    synchronous_saves(monkeypatch)
    fill_before_record(monkeypatch, injected, 2, "eval")
    stopped_then_resumed(policy, injected, reference, caplog,
                         "cannot write the eval record of step 2", last_good=1)


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_full_disk_at_an_async_side_file(policy, disk, caplog, monkeypatch, tmp_path, store):
    config, params, task = policy
    acfg = AsyncConfig(max_staleness=1, mode="deterministic", snapshot_store=store)
    straight = run_async(config, params, task, cfg(tmp_path / "a", EVERY, asynchronous=acfg))
    reference = (straight.state, [{k: v for k, v in r.items() if not k.startswith("buffer_")}
                                  for r in comparable(records(tmp_path / "a"))])
    synchronous_saves(monkeypatch)
    # memory: the ring's snapshots/2/v1.npz comes first; disk: its hard links there
    fill_after_record(monkeypatch, disk, 2, "train")
    config, params, task = policy
    run_dir = disk.path / "run"
    with caplog.at_level(logging.ERROR), pytest.raises(StorageError) as info:
        run_async(config, params, task, cfg(run_dir, EVERY, asynchronous=acfg))
    line = str(info.value)
    if store == "memory":
        assert "snapshots/2/v1.npz" in line and "step 1 " in line
    else:
        # the links need no space: the orbax checkpoint after them is what fails
        assert "cannot write checkpoint step 2 " in line and "step 1 " in line
    disk.free()
    res = run_async(config, params, task, cfg(run_dir, EVERY, asynchronous=acfg), resume=True)
    assert_same_state(res.state, reference[0])
    got = [{k: v for k, v in r.items() if not k.startswith("buffer_")
            and k != "dropped_on_resume_groups"} for r in comparable(records(run_dir))]
    assert got == reference[1]


@pytest.mark.parametrize("code", [errno.EACCES, errno.EDQUOT, errno.EROFS])
def test_permission_quota_and_read_only_are_named(policy, tmp_path, monkeypatch, code):
    config, params, task = policy
    state = {"on": False}
    synchronous_saves(monkeypatch)
    fail_writes(monkeypatch, code, when=lambda: state["on"], metrics=False)
    # the save of step 2 fails (its finalizing rename)
    at_record(monkeypatch, 2, "train", lambda: state.update(on=True), before=False)
    with pytest.raises(StorageError) as info:
        run(config, params, task, cfg(tmp_path / "r", EVERY))
    line = str(info.value)
    assert info.value.errno == code and f"({errno.errorcode[code]})" in line
    assert "cannot write checkpoint step 2 " in line and "last good checkpoint is step 1 " in line
    assert lock_is_free(tmp_path / "r")


def test_storage_reasons_of_orbax_and_os_errors():
    assert storage_reason(OSError(errno.ENOSPC, "x")) == "no space left on device (ENOSPC)"
    orbax = ValueError('RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database at local file '
                       '"/x/3.orbax-checkpoint-tmp/": Failed to write 138110 bytes to file 4: '
                       "No space left on device [os_error_code='28']")
    assert storage_reason(orbax) == "no space left on device (ENOSPC)"
    chained = RuntimeError("wrapped")
    chained.__cause__ = PermissionError(errno.EACCES, "Permission denied")
    assert storage_reason(chained) == "permission denied (EACCES)"
    assert storage_reason(ValueError("Read-only file system")) == "read-only file system (EROFS)"
    assert storage_reason(ValueError("shape mismatch")) is None
    assert storage_reason(OSError(errno.ENOENT, "x")) is None


def test_late_echoes_of_a_failed_save_are_dropped_and_other_asyncio_errors_kept(caplog):
    """A failed save's late writes land after its tmp folder is gone, maybe while the next
    run (or test) goes on: asyncio logs their futures at garbage collection. Those echoes
    are dropped; an asyncio error of anything else still reaches the log."""
    quiet_orbax_echoes()
    late = ValueError('NOT_FOUND: Error writing "opt_state.mu/0.0" in OCDBT database at local '
                      'file "/r/checkpoints/3.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/'
                      'ocdbt.process_0/": Error reading Byte range [197180, 199158)')
    full = ValueError("RESOURCE_EXHAUSTED: No space left on device [os_error_code='28']")
    other = ValueError("NOT_FOUND: /data/shard-7 (a missing input, not a checkpoint)")
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR):
        for err in (late, full, other):
            log.error("Future exception was never retrieved", exc_info=(type(err), err, None))
    kept = [r.exc_info[1] for r in caplog.records if r.exc_info]
    assert kept == [other]


def test_free_space_warning_before_a_save(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 0, free["bytes"]))
    free = {"bytes": 10**9}
    assert free_space_warning(tmp_path, 10**6) is None
    free["bytes"] = 1.5e6
    assert "room for one more checkpoint only" in free_space_warning(tmp_path, 10**6)
    free["bytes"] = 0.5e6
    assert "will not fit" in free_space_warning(tmp_path, 10**6)
    import jax.numpy as jnp

    state = {"w": jnp.ones((1000,), jnp.float32)}  # 4 kB
    free["bytes"] = 6000  # < 2 checkpoints of it
    with Checkpointer(tmp_path / "ck") as ck, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ck.save(1, state)
    assert [w for w in seen if issubclass(w.category, StorageWarning)]


def test_cli_full_disk_is_one_line_and_exit_74(disk, capfd, monkeypatch):
    from experiments.common.train_cli import main

    run_dir = disk.path / "run"
    opened, init = [], Checkpointer.__init__
    monkeypatch.setattr(Checkpointer, "__init__",
                        lambda self, *a, **k: (init(self, *a, **k), opened.append(self))[0])

    def fill():  # the save of step 3 is the one that finds the disk full
        opened[-1].wait()
        disk.fill()

    at_record(monkeypatch, 3, "train", fill, before=False)
    with pytest.raises(SystemExit) as info:
        main(["--steps", "8", "--prompts-per-step", "2", "--group-size", "4",
              "--eval-prompts", "8", "--eval-every", "4", "--save-every", "1",
              "--wandb", "disabled", "--no-progress", "--run-dir", str(run_dir)])
    err = capfd.readouterr().err  # the file descriptor: orbax's threads write there too
    assert info.value.code == 74, err[-3000:]
    lines = [x for x in err.strip().splitlines() if "StorageWarning" not in x
             and not x.startswith("  ")]  # the free-space warning and its source line
    assert len(lines) == 1 and lines[0].startswith("storage error: cannot write "), err[-3000:]
    assert "no space left on device (ENOSPC)" in lines[0]
    assert "the last good checkpoint is step 2 " in lines[0]
    assert "Traceback" not in err and "ERROR" not in err
    assert lock_is_free(run_dir)
