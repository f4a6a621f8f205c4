"""Running benchmark tasks each in its own process, under one time budget, writing every
row the moment it exists. Imports nothing heavy (no jax): the parent process must not
take the accelerator's memory from the tasks it starts.

A task is a JSON-able dict {"part", "item", "fn": "module:function", "args": {...},
"cap_s": seconds[, "env": {NAME: value} added to its process's environment]}. Its process runs `fn(emit, **args)`; every `emit(row)` appends one JSON
line to a file the parent reads when the process ends (also when it crashed or was killed
at its time limit), so rows written before a failure survive. A task that exits non-zero
or runs out of time adds a row with its error; a task that finds the budget spent adds a
row saying so; nothing is retried.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

MIN_TASK_SECONDS = 5.0        # below this much budget left, a task is skipped, not started
WORKER_FLAG = "--worker"


class RowLog:
    """Rows appended to a JSON-lines file (flushed per row) and kept in memory."""

    def __init__(self, path: Path | None, on_row: Callable[[dict], None] | None = None):
        self.path, self.rows, self.on_row = path, [], on_row
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.on_row is not None:
            self.on_row(row)


def _tail(text: str, lines: int = 12, chars: int = 1500) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def run_task(task: dict, timeout_s: float, env: dict | None = None) -> list[dict]:
    """Run one task in a fresh process with a wall-clock limit; return its rows (plus an
    error row if it failed or ran out of time). The process runs in its own session and
    its whole process group is killed at the limit."""
    base = {"part": task["part"], "item": task["item"]}
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.jsonl"
        cmd = [sys.executable, "-m", task.get("module", "experiments.bench.accelerator"),
               WORKER_FLAG, json.dumps(task), "--worker-out", str(rows_file)]
        start = time.perf_counter()
        if task.get("env"):
            env = {**(os.environ if env is None else env), **task["env"]}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)
        status, out = "ok", ""
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                status = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            status = "timeout"
        seconds = round(time.perf_counter() - start, 1)
        rows = []
        if rows_file.exists():
            for line in rows_file.read_text().splitlines():
                if line.strip():
                    rows.append({**base, **json.loads(line)})
    if status != "ok":
        what = (f"killed at its time limit of {timeout_s:.0f} s" if status == "timeout"
                else f"process ended with {status}")
        rows.append({**base, "status": "timeout" if status == "timeout" else "error",
                     "error": f"{what} after {len(rows)} row(s); output tail:\n{_tail(out)}",
                     "seconds": seconds})
    for row in rows:
        row.setdefault("process_seconds", seconds)
    return rows


def run_tasks(tasks: list[dict], budget_s: float, log: RowLog,
              env: dict | None = None) -> None:
    """Run `tasks` in order, each capped at min(its cap_s, the budget left)."""
    deadline = time.perf_counter() + budget_s
    for task in tasks:
        left = deadline - time.perf_counter()
        if left < MIN_TASK_SECONDS:
            log.add({"part": task["part"], "item": task["item"], "status": "skipped",
                     "reason": f"budget of {budget_s:.0f} s spent"})
            continue
        for row in run_task(task, min(float(task.get("cap_s", left)), left), env):
            log.add(row)


def worker_main(task_json: str, rows_out: str) -> int:
    """Entry of a task's process: run `fn(emit, **args)`, each row to `rows_out` at once.
    An exception becomes a row with its error (exit status 0: the row says it)."""
    task = json.loads(task_json)
    out = Path(rows_out)

    def emit(row: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")

    module, name = task["fn"].split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
        fn(emit, **task.get("args", {}))
    except Exception as e:  # noqa: BLE001 - any failure becomes a row
        emit({"status": "error", "error": f"{type(e).__name__}: {str(e)[:800]}",
              "traceback": _tail(traceback.format_exc(), 8)})
    return 0
