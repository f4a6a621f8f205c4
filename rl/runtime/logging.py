"""Metrics sinks of a run: a JSONL file in the run dir (always) and wandb (offline by
default: the run is stored under the run dir and never needs a network; `wandb sync`
uploads it later, or pass mode="online").

Also the atomic file writes every result file uses: write a temporary file in the same
directory, flush it to disk, then rename it over the target, so a crash never leaves a
half-written file behind.

Multi-process runs: only process 0 writes (metrics.jsonl, wandb); the other processes
keep their records in memory, so the loop's code is the same on every process.

Each record is on disk (in the kernel's hands: it survives the process being killed) once
log() returns; close() also fsyncs the file (it survives the machine going down). A
write that fails for lack of space or permission raises rl.runtime.storage.StorageError
naming the file and the record.

The step profile: `StepProfile` times the phases of one training step (prefill, decode,
reward, learner, host work, transfers; `other_s` is the rest of the step's wall time, so
the phases always sum to `step_s`) and its peak resident memory (`peak_rss_mb`: Linux's
VmHWM, reset at the start of each step through /proc/self/clear_refs where that file is
writable, else the process's high-water mark so far); `profile_summary` averages the
train records of a run (mean seconds and share per phase, steps/hour without the first,
compiling step, peak memory).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from rl.runtime.storage import StorageError

WANDB_MODES = ("offline", "online", "disabled")
PROBLEMS_FILE = "eval_problems.jsonl"  # each eval's per-problem results (MetricsLogger)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file + fsync + rename). An OSError (e.g.
    no space left) names `path` and leaves no temp file behind."""
    atomic_write_stream(path, lambda f: f.write(data))


def atomic_write_stream(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """atomic_write_bytes for content too big to hold in memory at once: write(f) streams
    it into the temp file (a binary, seekable file object), then fsync + rename; the same
    errors and cleanup."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


def _clean(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Plain floats (NaN/inf become None so the JSON stays valid)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (str, bool)) or v is None:
            out[k] = v
            continue
        f = float(v)
        out[k] = f if math.isfinite(f) else None
    return out


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSONL file; a torn last line (crash mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class JsonlFile:
    """An append-only JSONL file of records {"step", ...}: with `resume_step`, the records
    after that step (written after the checkpoint being resumed) are dropped first,
    atomically; `records` holds what was kept and what was appended since. append() is one
    write of the whole line (no torn record on a crash; a failed write leaves no partial
    line). writer=False keeps the records in memory only (the other processes of a run)."""

    def __init__(self, path: Path, *, writer: bool, resume_step: int | None, what: str):
        self.path, self.writer, self.what = Path(path), writer, what
        self.records: list[dict] = [] if resume_step is None else [
            r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
        if self.writer:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
            except OSError as err:
                raise self.failure(err, f"the {what}") from err

    def append(self, record: dict, what: str) -> None:
        self.records.append(record)
        if not self.writer:
            return
        line = (json.dumps(record) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                end = os.fstat(fd).st_size
                try:  # one write of the whole line: no torn records on a crash
                    if os.write(fd, line) != len(line):
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
                except OSError:
                    with contextlib.suppress(OSError):  # no torn line left behind
                        os.ftruncate(fd, end)
                    raise
            finally:
                os.close(fd)
        except OSError as err:
            raise self.failure(err, what) from err

    def failure(self, err: OSError, what: str) -> Exception:
        return StorageError.of(err, what=what, path=self.path) or err

    def fsync(self) -> None:
        if self.writer and self.path.exists():
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


class MetricsLogger:
    """log(step, metrics, kind) appends {"step", "kind", **metrics} to run_dir/metrics.jsonl
    (one write per record) and to wandb under "<kind>/<name>"; log_problems(step, record)
    appends an eval's per-problem results to run_dir/eval_problems.jsonl (not to wandb).

    With `resume_step`, records after that step (written after the checkpoint being
    resumed) are dropped first, atomically, so the files match the resumed run;
    `records` holds what was kept.

    writer: whether this process writes the files and wandb (default: it is JAX process 0;
    every other process of a multi-process run only keeps `records`).
    """

    def __init__(self, run_dir: str | os.PathLike, *, wandb_mode: str = "offline",
                 project: str = "tandem", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, resume_step: int | None = None,
                 writer: bool | None = None):
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode must be one of {WANDB_MODES}, got {wandb_mode!r}")
        if writer is None:
            import jax  # lazily: this module stays importable without initialising JAX

            writer = jax.process_index() == 0
        self.writer = bool(writer)
        self.run_dir = Path(run_dir)
        self.metrics = JsonlFile(self.run_dir / "metrics.jsonl", writer=self.writer,
                                 resume_step=resume_step, what="metrics file")
        self.problems = JsonlFile(self.run_dir / PROBLEMS_FILE, writer=self.writer,
                                  resume_step=resume_step, what="per-problem eval file")
        self._wandb = None
        if wandb_mode != "disabled" and self.writer:
            self._wandb = self._init_wandb(wandb_mode, project, run_name, config, resume_step)

    @property
    def path(self) -> Path:
        return self.metrics.path

    @property
    def records(self) -> list[dict]:
        return self.metrics.records

    def _init_wandb(self, mode, project, run_name, config, resume_step):
        import wandb  # imported lazily: slow, and not needed with wandb disabled

        id_file = self.run_dir / "wandb_id.txt"
        if resume_step is not None and id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            atomic_write_text(id_file, run_id)
        return wandb.init(project=project, name=run_name, id=run_id, resume="allow", mode=mode,
                          dir=str(self.run_dir), config=dict(config or {}))

    def log(self, step: int, metrics: Mapping[str, Any], kind: str = "train") -> dict:
        """Record scalar metrics at `step`; returns the record written."""
        record = {"step": int(step), "kind": kind, **_clean(metrics)}
        self.metrics.append(record, f"the {kind} record of step {int(step)}")
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in record.items()
                             if k not in ("step", "kind") and v is not None}, step=int(step))
        return record

    def log_problems(self, step: int, record: Mapping[str, Any]) -> dict:
        """Append an eval's per-problem record {"step", **record} (e.g. the pass, the
        prompts' indices and each one's accuracy); returns it."""
        out = {"step": int(step), **record}
        self.problems.append(out, f"the per-problem eval of step {int(step)}")
        return out

    def close(self) -> None:
        """Flush the files to the disk (fsync) and finish wandb."""
        self.metrics.fsync()
        self.problems.fsync()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


# ----------------------------------------------------------------------------- step profile
PHASES = ("prefill_s", "decode_s", "reward_s", "learner_s", "host_s", "transfer_s")
"""The step profile's timed phases (seconds); a loop may add its own (e.g. the async
loop's wait_s, proximal_s); other_s = step_s - the sum of all of them."""
EXTRA_PHASES = ("wait_s", "proximal_s")  # the asynchronous loop's own phases


def reset_peak_rss() -> bool:
    """Reset the process's resident high-water mark (VmHWM) to its current RSS (Linux,
    /proc/self/clear_refs "5"); False where that is not possible (then peak_rss_mb reports
    the high-water mark since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    """The process's peak resident memory in MB (10^6 bytes): VmHWM from /proc/self/status,
    else getrusage's ru_maxrss; None if neither is available."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # kB
    try:
        import resource
        import sys

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb / 1e6 if sys.platform == "darwin" else kb * 1024 / 1e6  # bytes on macOS
    except (ImportError, OSError):
        return None


class StepProfile:
    """Wall time of one step split into phases, plus its peak resident memory.

        prof = StepProfile()
        prof.start()                      # resets the memory high-water mark
        with prof.phase("reward_s"): ...  # or prof.add("decode_s", seconds)
        record.update(prof.finish())      # {step_s, <phase>_s..., other_s, peak_rss_mb}

    Phases must not nest (each second belongs to one phase); what no phase covers is
    other_s, so the phases always sum to step_s."""

    def __init__(self, phases: Sequence[str] = PHASES):
        self.phases = tuple(phases)
        self.times = dict.fromkeys(self.phases, 0.0)
        self.memory_per_step = False
        self._t0: float | None = None

    def start(self) -> None:
        self.times = dict.fromkeys(self.phases, 0.0)
        self.memory_per_step = reset_peak_rss()
        self._t0 = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        if name not in self.times:
            raise ValueError(f"StepProfile: unknown phase {name!r}; phases are {self.phases}")
        self.times[name] += float(seconds)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def finish(self) -> dict[str, float | bool | None]:
        """The step's record: step_s (since start()), each phase, other_s, peak_rss_mb and
        peak_rss_per_step (whether the mark was reset at start())."""
        if self._t0 is None:
            raise RuntimeError("StepProfile.finish() before start()")
        step = time.perf_counter() - self._t0
        out: dict[str, float | bool | None] = {"step_s": step, **self.times}
        out["other_s"] = step - sum(self.times.values())
        out["peak_rss_mb"] = peak_rss_mb()
        out["peak_rss_per_step"] = self.memory_per_step
        self._t0 = None
        return out


class NullProfile:
    """A StepProfile that records nothing (the default where no profile is asked for)."""

    def add(self, name: str, seconds: float) -> None:
        """Ignore the phase (nothing is recorded)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield


NULL_PROFILE = NullProfile()


def profile_summary(records: Sequence[Mapping[str, Any]], *, skip_first: int = 1) -> dict | None:
    """The step profile of a run from its train records (those with step_s): per phase the
    mean seconds and share of the mean step, steps/hour (3600 / mean step_s) and the peak
    memory, over the records after the first `skip_first` (the first step compiles); None
    if no record has a profile. With a single profiled step, that one is used (and
    "compile_step_included" says so)."""
    prof = [r for r in records if r.get("step_s") is not None]
    if not prof:
        return None
    used = prof[skip_first:] or prof
    names = [k for k in (*PHASES, *EXTRA_PHASES, "other_s") if any(k in r for r in used)]
    step = sum(float(r["step_s"]) for r in used) / len(used)
    phases = {}
    for k in names:
        mean = sum(float(r.get(k) or 0.0) for r in used) / len(used)
        phases[k] = {"mean_s": mean, "share": mean / step if step > 0 else None}
    mem = [float(r["peak_rss_mb"]) for r in prof if r.get("peak_rss_mb") is not None]
    return {
        "steps_measured": len(used),
        "compile_step_included": len(used) == len(prof) and skip_first > 0,
        "first_step_s": float(prof[0]["step_s"]),
        "step_s_mean": step,
        "steps_per_hour": 3600.0 / step if step > 0 else None,
        "phases": phases,
        "peak_rss_mb": max(mem) if mem else None,
        "peak_rss_mb_per_step": [None if r.get("peak_rss_mb") is None else float(r["peak_rss_mb"])
                                 for r in prof],
        "peak_rss_per_step": all(bool(r.get("peak_rss_per_step")) for r in prof),
    }


def format_profile(summary: Mapping[str, Any]) -> str:
    """The step profile summary as lines of text (what experiments.train prints)."""
    n = summary["steps_measured"]
    head = (f"step profile ({n} step{'s' * (n != 1)}"
            f"{', compile step included' if summary['compile_step_included'] else ', first step excluded'}): "
            f"{summary['step_s_mean']:.2f} s/step, {summary['steps_per_hour']:.0f} steps/hour")
    lines = [head]
    for k, v in summary["phases"].items():
        lines.append(f"  {k[:-2]:<13} {v['mean_s']:8.3f} s  {100 * (v['share'] or 0):5.1f} %")
    if summary["peak_rss_mb"] is not None:
        how = "per step" if summary["peak_rss_per_step"] else "process high-water mark"
        lines.append(f"  peak memory   {summary['peak_rss_mb'] / 1e3:8.2f} GB resident ({how})")
    return "\n".join(lines)
