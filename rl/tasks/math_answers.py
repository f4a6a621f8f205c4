"""Math answers: the final \\boxed{...} of a response, equivalence through math-verify with a
timeout that works in any thread, and the two rewards a math task hands out.

  * `extract_final_boxed(text)`: the content of the last \\boxed{...} (or \\fbox{...}), braces
    balanced, so \\boxed{\\frac{1}{2}} gives \\frac{1}{2}; None if there is none (or if the last
    one is never closed, e.g. a truncated response).
  * `math_equal(prediction, reference, timeout_s=2.0)`: True when math-verify finds the two
    answers equal (1/2 = 0.5 = \\frac{1}{2} = \\dfrac12, 2x+1 = 1+2x, 50\\% = 0.5, sets and
    intervals as math-verify supports them). Both are answer expressions, not whole
    responses: each is wrapped in \\boxed{...} before `math_verify.parse`, so its LaTeX
    extraction reads the whole expression (a bare `x+1` or `\\sqrt{4}` is otherwise not
    found, and a bare `2x+1` is read as `2`). The reference is math-verify's gold side.
  * `math_answer_rewards(text, reference, timeout_s=2.0)` -> {"correct", "format"}:
    "correct" = math_equal(last boxed answer, reference) and does NOT require the format
    (a right answer followed by chatter still counts); "format" = 1 only if the response
    has exactly one \\boxed/\\fbox and nothing but whitespace, `$`, `\\]`, `\\)` or `.` after it.

The timeout: math-verify's own timeouts use signal.alarm, which works only in the main
thread (in whole seconds, once per parse and per comparison, so they add up; and a signal
cannot stop a long C call). Tandem scores rewards from a producer thread too
(rl.loops.asynchronous), so every check, from any thread, the main one included, runs in
ONE worker process: this file loaded by path in a fresh interpreter (math-verify, sympy),
started lazily or by `start_worker()`, its start not counted against timeout_s. The caller
waits on a pipe for at most timeout_s; past it the worker is killed, a fresh one is started
at once (ready 0.5-0.8 s later), and the answer is False. Measured on the 2-core CPU: the
worker answers a trivial pair in 0.13 ms, the same as math-verify in-process (sympy's work,
0.2-40 ms per pair once warm, dominates), so the main thread gets no in-process path; a
timeout returns after timeout_s + 15-25 ms. Calls from several threads are served one at a
time (a lock; waiting for it is not counted against a caller's timeout_s, so a caller
behind a timed-out pair also waits for the fresh worker). The worker caps its address
space at 4 GiB (a runaway bignum is a MemoryError -> False) and ignores Ctrl-C (it exits
when the parent closes its pipe). Identical strings are equal without asking the worker.

Imports only the standard library at module level (the worker loads this file by path).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# what may follow the one boxed answer for "format": whitespace, $, \], \), a full stop
_FORMAT_TAIL = re.compile(r"(?:\s|\$|\\\]|\\\)|\.)*")

WORKER_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can take seconds
WORKER_MEMORY_LIMIT_BYTES = 4 << 30


def _closing_brace(text: str, open_index: int) -> int | None:
    """Index of the `}` that closes the `{` at open_index (escaped \\{ \\} skipped), or None."""
    depth = 0
    i = open_index
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # \{ \} \\ and commands: the next character is never a group brace
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _final_box(text: str) -> tuple[str, int] | None:
    """(content, index just past the closing brace) of the last \\boxed{..}/\\fbox{..}."""
    matches = list(_BOX_OPEN.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    close = _closing_brace(text, m.end() - 1)
    if close is None:
        return None
    return text[m.end():close], close + 1


def extract_final_boxed(text: str) -> str | None:
    """The content of the LAST \\boxed{...} or \\fbox{...} in `text`, with balanced braces
    (\\boxed{\\frac{1}{2}} -> \\frac{1}{2}); None if there is none or the last one is unclosed."""
    box = _final_box(text)
    return None if box is None else box[0]


def has_final_boxed_format(text: str) -> bool:
    """Exactly one \\boxed/\\fbox, closed, with only whitespace, `$`, `\\]`, `\\)` or `.` after it."""
    if len(_BOX_COMMAND.findall(text)) != 1:
        return False
    box = _final_box(text)
    return box is not None and _FORMAT_TAIL.fullmatch(text, box[1]) is not None


# ---------------------------------------------------------------- math-verify itself


def _wrap(answer: str) -> str:
    return "\\boxed{" + answer + "}"


def _verify_here(prediction: str, reference: str, timeout_s: int | None = None) -> bool:
    """math-verify on two answer strings, in this process (the worker calls it with no
    timeout: the parent's deadline is the timeout)."""
    from math_verify import parse, verify

    gold = parse(_wrap(reference), parsing_timeout=timeout_s)
    pred = parse(_wrap(prediction), parsing_timeout=timeout_s)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout_s))


class _Overdue(BaseException):
    """The worker's own late stop (not an Exception, so math-verify cannot swallow it)."""


def _overdue(signum, frame):
    raise _Overdue


def _serve() -> None:
    """The worker's loop: one JSON [prediction, reference, timeout_s] per stdin line ->
    "1"/"0" line. The parent kills it at timeout_s; its own alarm at timeout_s + 10 s only
    ends a check whose parent has gone (it exits when stdin closes). Ctrl-C is the parent's."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries cannot corrupt the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _overdue)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notices
    with contextlib.suppress(ImportError, ValueError, OSError):  # best effort (not on all OSes)
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_LIMIT_BYTES,) * 2)
    _verify_here("1/2", "0.5")  # import and warm up before saying ready
    out.write(b"ready\n")
    for line in sys.stdin.buffer:
        try:
            prediction, reference, timeout_s = json.loads(line)
            signal.setitimer(signal.ITIMER_REAL, float(timeout_s) + 10.0)
            ok = _verify_here(prediction, reference)
        except (Exception, _Overdue):  # noqa: BLE001  MemoryError, RecursionError, bad input
            ok = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(b"1\n" if ok else b"0\n")


_BOOT = ("import importlib.util as u, sys; "
         "s = u.spec_from_file_location('_tandem_math_worker', sys.argv[1]); "
         "m = u.module_from_spec(s); s.loader.exec_module(m); m._serve()")


class _Worker:
    """One worker process and the read side of its pipe."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.ready = False
        self._buf = b""

    def readline(self, deadline: float) -> bytes | None:
        """The next line from the worker, or None at the deadline or if the worker died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def send(self, payload: bytes) -> bool:
        try:
            view = memoryview(payload)
            while view:
                view = view[self.proc.stdin.write(view):]
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def kill(self) -> None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # already gone
            self.proc.kill()
            self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


_LOCK = threading.Lock()
_WORKER: _Worker | None = None


def _ready_worker() -> _Worker:
    """The running worker (started if needed), once it has said "ready". Lock held."""
    global _WORKER
    for _ in range(2):
        if _WORKER is None or _WORKER.proc.poll() is not None:
            if _WORKER is not None:
                _WORKER.kill()
            _WORKER = _Worker()
        if _WORKER.ready:
            return _WORKER
        if _WORKER.readline(time.monotonic() + WORKER_STARTUP_TIMEOUT_S) == b"ready":
            _WORKER.ready = True
            return _WORKER
        _WORKER.kill()
        _WORKER = None
    raise RuntimeError("the math-verify worker process did not start (is math-verify "
                       "installed for this interpreter? see its stderr above)")


def _restart_worker() -> None:
    """Kill the worker (timed out or died) and start a fresh one now. Lock held."""
    global _WORKER
    if _WORKER is not None:
        _WORKER.kill()
    _WORKER = _Worker()


def shutdown_worker() -> None:
    """Stop the worker process (a later call starts a new one). Runs at exit."""
    global _WORKER
    with _LOCK:
        if _WORKER is not None:
            _WORKER.kill()
            _WORKER = None


atexit.register(shutdown_worker)


def start_worker() -> None:
    """Start the worker now and wait until it is ready (else the first math_equal does)."""
    with _LOCK:
        _ready_worker()


def math_equal(prediction: str, reference: str, *, timeout_s: float = 2.0) -> bool:
    """True when math-verify finds answer `prediction` equal to answer `reference` (the
    gold side). Never hangs, never raises on odd input: past timeout_s (measured from the
    moment the worker has the pair) it returns False. Works from any thread."""
    if prediction is None or reference is None:
        return False
    prediction, reference = str(prediction).strip(), str(reference).strip()
    if not prediction or not reference:
        return False
    if prediction == reference:
        return True
    payload = json.dumps([prediction, reference, timeout_s]).encode() + b"\n"
    with _LOCK:
        worker = _ready_worker()
        if not worker.send(payload):  # died since: once more with a fresh one
            _restart_worker()
            worker = _ready_worker()
            if not worker.send(payload):
                _restart_worker()
                return False
        answer = worker.readline(time.monotonic() + timeout_s)
        if answer is None:  # timed out or died: kill, restart in the background
            _restart_worker()
            return False
        return answer == b"1"


def math_answer_rewards(text: str, reference: str, *, timeout_s: float = 2.0
                        ) -> dict[str, float]:
    """{"correct": the last boxed answer equals `reference` (math_equal; no format needed),
    "format": exactly one \\boxed{} and it ends the response (has_final_boxed_format)}."""
    answer = extract_final_boxed(text)
    correct = answer is not None and math_equal(answer, reference, timeout_s=timeout_s)
    return {"correct": float(correct), "format": float(has_final_boxed_format(text))}


__all__ = ["extract_final_boxed", "has_final_boxed_format", "math_answer_rewards",
           "math_equal", "shutdown_worker", "start_worker"]
