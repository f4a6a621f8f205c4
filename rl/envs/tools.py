"""`ToolWorker`: run a tool function in a worker process with a hard time limit, so a tool
that hangs (a runaway computation, a blocked call into other code) can be stopped.

    tool = ToolWorker("rl.envs.arithmetic:calculate", timeout_s=2.0)
    tool("12 * 34")          # -> "408", computed in the worker process
    tool("...")              # past 2 s: the worker is killed, ToolTimeout is raised
    tool.close()             # (also at exit)

The function is named "module:qualname" and imported in the worker, a fresh Python
interpreter started with this interpreter's sys.path (so the parent's threads, JAX and
locks are not forked into it); it is started lazily by the first call (its start-up is not
counted against timeout_s) and kept for the next calls. Arguments and results travel
pickled over pipes (they must be picklable); an exception raised by the tool is raised
again in the caller as ToolError with the tool's exception type and message. Past
timeout_s the worker is killed and the call raises `rl.envs.base.ToolTimeout`; the next
call starts a new worker. Calls from several threads are served one at a time (a lock).

A ToolTimeout out of an environment call ends that episode with EndReason.TIMEOUT
(rl.rollout.episodes); an environment may instead catch it and show the model an error.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Self

from rl.envs.base import ToolTimeout

STARTUP_TIMEOUT_S = 120.0  # a fresh interpreter importing the tool's module on a busy machine
_HEADER = struct.Struct("<Q")

# The worker's program: import the function, then answer length-prefixed pickled
# (args, kwargs) frames with ("ok", result) or ("error", type name, message) frames.
_SERVE = r"""
import importlib, pickle, signal, struct, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
sys.path[:0] = pickle.loads(bytes.fromhex(sys.argv[2]))
module, _, name = sys.argv[1].partition(":")
fn = importlib.import_module(module)
for part in name.split("."):
    fn = getattr(fn, part)
inp, out = sys.stdin.buffer, sys.stdout.buffer
head = struct.Struct("<Q")
def send(obj):
    data = pickle.dumps(obj)
    out.write(head.pack(len(data)) + data)
    out.flush()
send(("ready",))
while True:
    raw = inp.read(head.size)
    if len(raw) < head.size:
        break
    args, kwargs = pickle.loads(inp.read(head.unpack(raw)[0]))
    try:
        send(("ok", fn(*args, **kwargs)))
    except Exception as e:
        send(("error", type(e).__name__, str(e)))
"""


class ToolError(RuntimeError):
    """The tool raised: `kind` is its exception's type name, the message its message."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class ToolWorker:
    """Call the function `target` ("module:qualname") in a worker process, each call
    within timeout_s seconds (module doc)."""

    def __init__(self, target: str, *, timeout_s: float):
        module, sep, name = str(target).partition(":")
        if not sep or not module or not name:
            raise ValueError(f"ToolWorker target must be 'module:function', got {target!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise ValueError(f"ToolWorker timeout_s must be a number > 0, got {timeout_s!r}")
        self.target, self.timeout_s = str(target), float(timeout_s)
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self.timeouts = 0  # calls that ran out of time
        _WORKERS.add(self)

    # -------------------------------------------------------------- the process
    def _start(self) -> None:
        path = pickle.dumps(list(sys.path)).hex()
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVE, self.target, path],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buf = b""
        try:
            reply = self._read(time.monotonic() + STARTUP_TIMEOUT_S)
        except EOFError:
            reply = None
        if reply != ("ready",):
            self._kill()
            raise RuntimeError(f"the tool worker for {self.target!r} did not start (can "
                               "this interpreter import it? see its stderr above)")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()

    def _read_exactly(self, n: int, deadline: float) -> bytes | None:
        """n bytes from the worker; None at the deadline; EOFError if it died."""
        fd = self._proc.stdout.fileno()
        while len(self._buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("the worker closed its pipe")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _read(self, deadline: float) -> Any:
        head = self._read_exactly(_HEADER.size, deadline)
        if head is None:
            return None
        body = self._read_exactly(_HEADER.unpack(head)[0], deadline)
        return None if body is None else pickle.loads(body)

    # -------------------------------------------------------------- calls
    def __call__(self, *args, **kwargs) -> Any:
        """target(*args, **kwargs) in the worker: its result; ToolError if it raised;
        ToolTimeout (the worker killed) past timeout_s."""
        data = pickle.dumps((args, kwargs))
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            try:
                self._proc.stdin.write(_HEADER.pack(len(data)) + data)
            except (BrokenPipeError, OSError, ValueError):
                self._kill()
                raise RuntimeError(f"the tool worker for {self.target!r} died") from None
            try:
                reply = self._read(time.monotonic() + self.timeout_s)
            except EOFError:
                self._kill()
                raise RuntimeError(f"the tool worker for {self.target!r} died during a "
                                   "call") from None
            if reply is None:
                self._kill()
                self.timeouts += 1
                raise ToolTimeout(f"tool {self.target!r} did not finish within "
                                  f"{self.timeout_s:g} s; its worker process was killed")
        if reply[0] == "error":
            raise ToolError(reply[1], reply[2])
        return reply[1]

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            self._kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_WORKERS: weakref.WeakSet[ToolWorker] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for worker in list(_WORKERS):
        worker.close()


__all__ = ["ToolError", "ToolWorker"]  # ToolTimeout lives in rl.envs.base (documented there)
