"""Storage failures of a run (disk full, permission denied, read-only file system, quota)
as one clear error instead of a wall of tracebacks.

    reason = storage_reason(err)   # "no space left on device (ENOSPC)" or None
    raise StorageError.of(err, what="checkpoint step 12", path=ckpt_dir, last_good=(10, dir10))

`storage_reason` recognises an OSError with a storage errno anywhere in an exception's
chain (`__cause__` / `__context__`), and the same errors as orbax / tensorstore report
them from their writer threads (a ValueError whose text carries `os_error_code='28'` or
the C library's message). `StorageError` is one line: what could not be written, where,
why, and the last good checkpoint to resume from (experiments.train exits with status 74,
rl.runtime.preemption.EXIT_STORAGE).

`free_space_warning(directory, need_bytes)` is the check before each checkpoint save: a
message when the file system holding `directory` has room for fewer than two more
checkpoints of `need_bytes` (the early warning) or less than one (this save will fail);
`tree_bytes(path)` measures a checkpoint on disk.

`OrbaxErrorLog`: a logging filter rl.runtime.checkpoint installs on orbax's logger
("absl"): orbax logs every failure of its background writer with a full traceback
(several, from several threads, some after the save was reported failed) besides raising
it to the caller; the filter drops those records from the log (the Checkpointer raises
the failure as one exception) and keeps the last few messages (for an error orbax logs
but never raises).
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path

STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large",
    errno.EIO: "input/output error",
}
ADVICE = {
    errno.ENOSPC: "free some space or move the run dir to a larger disk",
    errno.EDQUOT: "free some of your quota or move the run dir",
    errno.EACCES: "make the run dir writable for this user",
    errno.EPERM: "make the run dir writable for this user",
    errno.EROFS: "remount the file system writable or move the run dir",
    errno.EFBIG: "raise the file size limit (ulimit -f) or move the run dir",
    errno.EIO: "check the disk (I/O error) or move the run dir",
}
_OS_CODE = re.compile(r"os_error_code='?(\d+)")
_TEXTS = {os.strerror(code): code for code in STORAGE_ERRNOS}


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def storage_errno(err: BaseException) -> int | None:
    """The storage errno (a key of STORAGE_ERRNOS) behind `err` or its chain, None if it
    is not a storage failure."""
    for e in _chain(err):
        if isinstance(e, StorageError):
            return e.errno
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e.errno
        text = str(e)
        m = _OS_CODE.search(text)
        if m and int(m.group(1)) in STORAGE_ERRNOS:
            return int(m.group(1))
        for message, code in _TEXTS.items():
            if message in text:
                return code
    return None


def storage_reason(err: BaseException) -> str | None:
    """'no space left on device (ENOSPC)' etc. for a storage failure, else None."""
    code = storage_errno(err)
    return None if code is None else f"{STORAGE_ERRNOS[code]} ({errno.errorcode[code]})"


class StorageError(RuntimeError):
    """A run could not write to its run dir. One line: what, where, why, the last good
    checkpoint, what to do. Attributes: what, path, reason, errno, last_good ((step,
    directory) or None)."""

    def __init__(self, what: str, path: str | os.PathLike, reason: str, *, code: int | None,
                 last_good: tuple[int, str | os.PathLike] | None = None):
        self.what, self.path, self.reason, self.errno = what, str(path), reason, code
        self.last_good = None if last_good is None else (int(last_good[0]), str(last_good[1]))
        if self.last_good is None:
            good = "no checkpoint was saved before it, so the run starts again from step 0"
            then = "then run it again"
        else:
            step, where = self.last_good
            good = f"the last good checkpoint is step {step} ({where!r})"
            then = "then continue with --resume"
        advice = ADVICE.get(code, "fix the storage")
        super().__init__(f"cannot write {what} to {self.path!r}: {reason}; {good}; {advice}, "
                         f"{then}")

    @classmethod
    def of(cls, err: BaseException, *, what: str, path: str | os.PathLike,
           last_good: tuple[int, str | os.PathLike] | None = None) -> StorageError | None:
        """The StorageError for `err` if it is a storage failure (storage_errno), else None."""
        code = storage_errno(err)
        if code is None:
            return None
        return cls(what, path, f"{STORAGE_ERRNOS[code]} ({errno.errorcode[code]})", code=code,
                   last_good=last_good)

    def with_last_good(self, last_good: tuple[int, str | os.PathLike] | None) -> StorageError:
        """The same error naming `last_good` as the checkpoint to resume from."""
        return StorageError(self.what, self.path, self.reason, code=self.errno,
                            last_good=last_good)


class StorageWarning(UserWarning):
    """The next checkpoints may not fit on the disk."""


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes of the regular files under `path` (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # removed meanwhile (orbax deletes old checkpoints in the background)
    return total


def free_space_warning(directory: str | os.PathLike, need_bytes: int) -> str | None:
    """A warning when the file system of `directory` has room for fewer than two more
    writes of `need_bytes` (None when it has, or when its free space cannot be read)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if need_bytes <= 0 or free >= 2 * need_bytes:
        return None
    mb = 1e6
    where = (f"{free / mb:.1f} MB free in {str(directory)!r} "
             f"for checkpoints of ~{need_bytes / mb:.1f} MB")
    if free < need_bytes:
        return f"{where}: this checkpoint will not fit; free space now, or the save fails"
    return f"{where}: room for one more checkpoint only; free space before the next save"


# ----------------------------------------------------------------------------- orbax's log
class OrbaxErrorLog(logging.Filter):
    """Drops orbax's ERROR records that carry a traceback (its background writer's
    failures, which the Checkpointer raises as one exception) and keeps their messages
    in `messages` (for an error orbax logs but never raises)."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        path = Path(record.pathname).as_posix()
        if record.levelno >= logging.ERROR and record.exc_info and "/orbax/" in path:
            with self._lock:
                self.messages = [*self.messages[-19:], record.getMessage()]
            return False
        return True

    def take(self) -> list[str]:
        with self._lock:
            out, self.messages = self.messages, []
        return out


_echoes_quiet = False


def _closed_loop_echo(err: BaseException | None) -> bool:
    return isinstance(err, RuntimeError) and str(err) == "Event loop is closed"


def _abandoned_save_echo(err: BaseException | None) -> bool:
    """A late write of a failed save into its tmp folder, which the next open (or the
    failure handling) has already removed: tensorstore reports NOT_FOUND for it."""
    text = "" if err is None else str(err)
    return "NOT_FOUND" in text and ".orbax-checkpoint-tmp" in text


def quiet_orbax_echoes() -> None:
    """Keep the echoes of a failed checkpoint write out of stderr (process-wide, idempotent;
    rl.runtime.checkpoint calls it when a Checkpointer opens). When one of orbax's writer
    operations fails, orbax closes that save's event loop while its other writes are
    still running in tensorstore; as those finish they call back into the closed loop,
    and each prints a "RuntimeError: Event loop is closed" traceback (through
    sys.unraisablehook, from tensorstore's threads), and their futures
    report the write error through asyncio's logger ("Future exception was never
    retrieved"), as do late writes into the failed save's tmp folder once it is removed
    (NOT_FOUND, possibly while a later test or run is going). The failure itself reaches
    the caller as one exception (Checkpointer.wait / poll); these echoes are dropped.
    Nothing else is: other exceptions pass to the previous hooks, and asyncio records
    whose exception is neither a storage failure nor such a late write stay."""
    global _echoes_quiet
    if _echoes_quiet:
        return
    _echoes_quiet = True

    def storage_echo(record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (err is not None and (storage_errno(err) is not None
                                         or _abandoned_save_echo(err)))

    logging.getLogger("asyncio").addFilter(storage_echo)
    previous = sys.unraisablehook

    def unraisable(info) -> None:
        if not _closed_loop_echo(info.exc_value):
            previous(info)

    sys.unraisablehook = unraisable
