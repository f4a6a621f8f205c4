"""Stopping a run cleanly when the world asks it to: SIGTERM (a scheduler's preemption
notice, `kill`, `docker stop`) and SIGINT (Ctrl-C).

While `stop_signals()` is entered (the loops enter it for the whole run, through
rl.loops.context.open_run; experiments.train enters it before loading the model), the
first SIGTERM or SIGINT does not kill the process: it is *recorded*, and the loop acts on
it at the next safe point:

  * at a step boundary (`RunControl.boundary`, before the first step and after every
    step): the run saves a checkpoint of the last completed step, flushes its metrics,
    releases the run lock and raises `Preempted`;
  * inside an *abandonable* phase (`RunControl.abandonable`: sampling a step's rollouts,
    an eval pass; one process only), the next `abandon_point()` raises `StepAbandoned`:
    the half-sampled step is dropped (the train state is the one of the last completed
    step, untouched) and the run stops the same way, without waiting for the step.

A second SIGINT raises KeyboardInterrupt at once (stop now: the loops still close the
checkpointer and the lock); a second SIGTERM is ignored (the save in progress goes on;
schedulers follow SIGTERM with SIGKILL after their grace period anyway). Handlers can only
be installed from the main thread; elsewhere `stop_signals()` installs nothing and the
signals keep their usual effect. On leaving the outermost `stop_signals()` the previous
handlers come back and the recorded request is forgotten.

Several processes (jax.distributed): every process must stop after the same step, or
their collectives would hang. `agree(*flags)` ORs boolean flags over all processes with
jax.experimental.multihost_utils.process_allgather (a collective every process calls at
the same point); `RunControl.boundary` agrees on (stop, time-based save due, time limit
reached) once per step, and also asks JAX's own preemption service
(multihost_utils.reached_preemption_sync_point). That service is on by default: once
`jax.distributed.initialize` has run, JAX's notifier owns SIGTERM (it replaced this
module's handler when it started, and a SIGTERM to any process then makes every process
reach the same sync step, the one after the furthest process's current step); SIGINT
stays this module's, agreed through `agree`. With the service off
(jax_enable_preemption_service=False) SIGTERM is this module's too. Abandoning a step
needs no agreement in one process and is off with several (they stop at the next
boundary instead).

Exit statuses of `python -m experiments.train` (what a job script or scheduler sees):
EXIT_OK 0 (finished, or stopped at the time limit), EXIT_PREEMPTED 0 (stopped by a signal
after saving: resume with --resume; `--preempted-exit-code` changes it, e.g. for
a supervisor that restarts only failed jobs), EXIT_ERROR 1 (the run cannot go on: its
one-line message says why), EXIT_USAGE 2 (bad flags), EXIT_STORAGE 74 (a write failed:
disk full, permission, read-only file system, quota; rl.runtime.storage), EXIT_INTERRUPTED
130 (KeyboardInterrupt: a second Ctrl-C, or raised by a hook).
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

EXIT_OK = 0
EXIT_PREEMPTED = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STORAGE = 74  # sysexits.h EX_IOERR
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for Ctrl-C

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped at a signal after saving a checkpoint of its last completed step.

    signal: "SIGTERM" | "SIGINT"; step: the checkpoint's step (the last completed step);
    checkpoint_dir: where it is; abandoned: what was dropped unfinished ("" if the run
    stopped at a step boundary, else e.g. "step 7's rollouts" or "the eval of step 6",
    which a resume runs first)."""

    def __init__(self, signal_name: str, step: int, checkpoint_dir: str, abandoned: str = ""):
        self.signal, self.step, self.checkpoint_dir = signal_name, int(step), str(checkpoint_dir)
        self.abandoned = abandoned
        what = f" ({abandoned} abandoned)" if abandoned else ""
        super().__init__(f"stopped by {signal_name} after step {step}{what}: checkpoint "
                         f"{step} is saved in {self.checkpoint_dir!r}; continue with --resume")


class StepAbandoned(Exception):
    """Raised by `abandon_point()` inside an abandonable phase once a stop was requested
    (caught by the loops, never by user code)."""


# ----------------------------------------------------------------------------- the handlers
_GUARD = threading.Lock()
_depth = 0
_previous: dict[int, object] = {}
_installed = False
_requested: str | None = None  # the first stop signal's name
_abandonable = 0


def _handler(signum: int, frame) -> None:
    global _requested
    name = signal.Signals(signum).name
    if _requested is None:
        _requested = name
        return
    if signum == signal.SIGINT:  # asked twice: stop now
        raise KeyboardInterrupt(f"{name} received twice")


def requested() -> str | None:
    """The name of the stop signal received under `stop_signals()` ("SIGTERM" or "SIGINT"),
    None if none was."""
    return _requested


def request_stop(name: str = "SIGTERM") -> None:
    """Record a stop request as if the signal had arrived (what the handler does; for
    tests and for code that learns of a preemption another way)."""
    global _requested
    if _requested is None:
        _requested = str(name)


@contextlib.contextmanager
def stop_signals() -> Iterator[bool]:
    """Record SIGTERM / SIGINT instead of dying, for the duration (re-entrant; module doc).
    Yields whether the handlers are installed (False outside the main thread)."""
    global _depth, _installed, _requested, _abandonable
    with _GUARD:
        _depth += 1
        if _depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                _previous[sig] = signal.getsignal(sig)
                signal.signal(sig, _handler)
            _installed = True
        installed = _installed
    try:
        yield installed
    finally:
        with _GUARD:
            _depth -= 1
            if _depth == 0:
                if _installed:
                    for sig, old in _previous.items():
                        # a handler installed outside Python (None) cannot be put back
                        signal.signal(sig, signal.SIG_DFL if old is None else old)
                    _previous.clear()
                _installed, _requested, _abandonable = False, None, 0


@contextlib.contextmanager
def abandonable(allowed: bool = True) -> Iterator[None]:
    """Inside: `abandon_point()` raises StepAbandoned once a stop is requested (only if
    `allowed`; the loops allow it where dropping the work in progress loses nothing)."""
    global _abandonable
    if not allowed:
        yield
        return
    _abandonable += 1
    try:
        yield
    finally:
        _abandonable -= 1


def abandon_point() -> None:
    """Where long work may stop early (between decode segments of a rollout or an eval):
    raise StepAbandoned if a stop was requested inside an abandonable phase."""
    if _requested is not None and _abandonable > 0:
        raise StepAbandoned(_requested)


# ----------------------------------------------------------------------------- agreement
def agree(*flags: bool) -> tuple[bool, ...]:
    """Each flag ORed over all processes (one process: as given). A collective: every
    process calls it at the same point with the same number of flags."""
    import jax

    if jax.process_count() == 1:
        return tuple(bool(f) for f in flags)
    from jax.experimental import multihost_utils

    local = np.asarray([int(bool(f)) for f in flags], np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(local))
    return tuple(bool(x) for x in gathered.reshape(-1, len(flags)).any(axis=0))


def jax_preemption_notice(step: int) -> bool:
    """True when JAX's preemption service (jax.distributed with jax_enable_preemption_service)
    says every process has reached the step to save at; False in one process or without
    the service. Call it at every step, from the same first step on every process."""
    import jax

    if jax.process_count() == 1:
        return False
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    except RuntimeError:  # the service is off
        return False


class Boundary(NamedTuple):
    """What every process does after a step (RunControl.boundary): stop (a signal),
    save (the time-based save is due), out_of_time (the run's time limit is reached)."""

    stop: bool
    save: bool
    out_of_time: bool


class RunControl:
    """The loop's side of stopping and time-based saving.

    boundary(step, time_s) -> Boundary, agreed by all processes: stop when a stop signal
    was received (or JAX's preemption service says so); save when save_every_minutes have
    passed since the last save (`saved()` restarts that clock; 0 = never by time);
    out_of_time when time_limit_s > 0 and the run clock `time_s` reached it.
    abandonable(): the phases the loop may drop at a stop request (one process only)."""

    def __init__(self, *, save_every_minutes: float = 0.0, time_limit_s: float = 0.0):
        import jax

        self.save_every_s = 60.0 * float(save_every_minutes)
        self.time_limit_s = float(time_limit_s)
        self.single_process = jax.process_count() == 1
        self._last_save = time.monotonic()
        self._notice = False  # the stop came from JAX's preemption service

    @property
    def signal_name(self) -> str:
        """What stopped the run: the stop signal received here ("SIGTERM" / "SIGINT"), or
        with several processes "a preemption notice" (JAX's preemption service) or "a
        signal to another process"."""
        if requested() is not None:
            return requested()
        return "a preemption notice" if self._notice else "a signal to another process"

    def saved(self) -> None:
        """A checkpoint was just written: the time-based save counts from now."""
        self._last_save = time.monotonic()

    def boundary(self, step: int, time_s: float = 0.0) -> Boundary:
        due = self.save_every_s > 0 and time.monotonic() - self._last_save >= self.save_every_s
        late = self.time_limit_s > 0 and time_s >= self.time_limit_s
        stop, due, late = agree(requested() is not None, due, late)
        if not stop and jax_preemption_notice(step):
            stop = self._notice = True
        return Boundary(stop, due, late)

    def abandonable(self, allowed: bool = True):
        """abandonable(allowed and this is the only process)."""
        return abandonable(allowed and self.single_process)
