"""One writer per run dir: an OS file lock on `<run_dir>/.lock`.

The training loops (rl.loops.run / run_async) hold a RunLock for their whole run, taken
before anything is compiled, so a second process that tries to train in the same run
dir (e.g. `--resume` while the first still runs) fails at once with RunLockError naming
the holder's pid and host, instead of both interleaving metrics.jsonl and checkpoints.

The lock is `fcntl.flock` (exclusive, non-blocking) on an open file: the kernel drops it
when the holding process dies, however it dies (SIGKILL included), so a killed run never
leaves a stale lock; the file itself stays (while held it holds the holder's pid, host
and start time as JSON, for the error message) and means nothing without the flock. Inside
one process the lock is re-entrant (a count per path): experiments.train checks it
before loading the model and the loop then holds it. Multi-process runs: only process 0
(the one that writes metrics and results) takes it; the others pass `enabled=False`.
flock works across processes of one host and on local file systems; on network file
systems its reach depends on the mount (NFS v4 maps it to a lease).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

_HELD: dict[str, list] = {}  # resolved lock path -> [fd, count] held by this process
_GUARD = threading.Lock()


class RunLockError(RuntimeError):
    """Another process is training in this run dir."""


def lock_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / ".lock"


def _holder(fd: int) -> str:
    """'pid P on host H since T' from a lock file's JSON ('an unknown process' if unreadable)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {int(info['pid'])} on host {info['host']} (since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown process (it has not written its pid yet)"


class RunLock:
    """Hold the run dir's lock from construction until release() (or the end of a `with`).

    RunLock(run_dir) creates run_dir if needed and raises RunLockError if another
    process holds the lock. enabled=False makes a no-op lock (e.g. processes other than
    0 of a multi-process run). release() is idempotent.
    """

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True):
        self.path = lock_path(run_dir).absolute()
        self._key: str | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        with _GUARD:
            if key in _HELD:  # re-entrant within this process
                _HELD[key][1] += 1
                self._key = key
                return
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise RunLockError(
                    f"run dir {str(self.path.parent)!r} is in use: {holder} is training in it "
                    f"(it holds {str(self.path)!r}). Wait for that run to finish or stop it, "
                    "or choose another --run-dir") from None
            except BaseException:
                os.close(fd)
                raise
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            with contextlib.suppress(OSError):  # only for the message: a full disk is fine
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode(), 0)
            _HELD[key] = [fd, 1]
            self._key = key

    @property
    def held(self) -> bool:
        return self._key is not None

    def release(self) -> None:
        """Give the lock back (the last release in this process unlocks the file)."""
        if self._key is None:
            return
        with _GUARD:
            entry = _HELD[self._key]
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[self._key]
                with contextlib.suppress(OSError):
                    os.ftruncate(entry[0], 0)
                fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])
        self._key = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_run_dir_free(run_dir: str | os.PathLike) -> None:
    """Raise RunLockError if another process holds run_dir's lock (takes and gives it back)."""
    if lock_path(run_dir).parent.is_dir():
        RunLock(run_dir).release()
