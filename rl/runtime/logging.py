"""Metrics sinks of a run: a JSONL file in the run dir (always) and wandb (offline by
default: the run is stored under the run dir and never needs a network; `wandb sync`
uploads it later, or pass mode="online").

Also the atomic file writes every result file uses: write a temporary file in the same
directory, flush it to disk, then rename it over the target, so a crash never leaves a
half-written file behind.

Multi-process runs: only process 0 writes (metrics.jsonl, wandb); the other processes
keep their records in memory, so the loop's code is the same on every process.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Mapping

WANDB_MODES = ("offline", "online", "disabled")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
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


class MetricsLogger:
    """log(step, metrics, kind) appends {"step", "kind", **metrics} to run_dir/metrics.jsonl
    (one write per record) and to wandb under "<kind>/<name>".

    With `resume_step`, records after that step (written after the checkpoint being
    resumed) are dropped first, atomically, so the file matches the resumed run;
    `records` holds what was kept.

    writer: whether this process writes the file and wandb (default: it is JAX process 0;
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
        self.path = self.run_dir / "metrics.jsonl"
        if self.writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.records: list[dict] = []
            if self.writer:
                atomic_write_text(self.path, "")
        else:
            self.records = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
            if self.writer:
                atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._wandb = None
        if wandb_mode != "disabled" and self.writer:
            self._wandb = self._init_wandb(wandb_mode, project, run_name, config, resume_step)

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
        self.records.append(record)
        if not self.writer:
            return record
        line = (json.dumps(record) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write of the whole line: no torn records on a crash
        finally:
            os.close(fd)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in record.items()
                             if k not in ("step", "kind") and v is not None}, step=int(step))
        return record

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
