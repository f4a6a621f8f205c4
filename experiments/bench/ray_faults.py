"""Faults on Ray rollout workers, from outside the run, the way a machine fails: rollout
workers killed with SIGKILL mid-run, the learner killed with SIGKILL then resumed, and
SIGTERM to the learner.

    python -m experiments.bench.ray_faults [--steps 40] [--kills 3]

Every run is `python -m experiments.train --preset tiny-synthetic` with 32-token responses
(--task-option length=32 alphabet=8: the worker is sampling most of the time, so a kill
lands on a request in flight), the deterministic schedule at η = 1 on one Ray worker
(--async-backend ray), a checkpoint every 2 steps. The parts:

  reference    the run undisturbed
  worker_kills `kill -9` of the worker process (found by its process title,
               ray::RolloutWorker) --kills times, after steps 5, 15, 25 ...: Ray restarts it,
               the learner sends its request again
  learner_kill `kill -9` of the learner after step 15 (its Ray session's processes killed
               with it: a host gone), then the same command with --resume
  sigterm      SIGTERM to the learner after step 15: it checkpoints and exits, and no
               rollout-worker process is left; then --resume

The rule, written before the runs: a part passes when its run finishes all --steps steps
and every step's record (loss, reward_mean, grad_norm, tokens, behaviour versions) equals
the reference's: the same groups trained once each, none lost (the deterministic schedule
makes a resent request's groups the same groups); the restarts are counted in the run's
ray_worker_restarts. Headline: the steps that differ from the reference over the three
parts (target 0). Writes experiments/results/bench_ray_faults.json and
docs/results/ray-faults.md with its README and index rows.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.common.benchmarking import machine, results_path, write_results
from experiments.common.docs_rows import add_docs_only_flag, docs_from_json, write_page_and_rows
from experiments.common.seeds import read_metrics

RESULT = results_path(__file__)
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/results/ray-faults.md"
README, INDEX = ROOT / "README.md", ROOT / "docs/results/index.md"
TITLE, ROW_AFTER = "Ray worker faults", "Ray workers on tool latency"
COMPARED = ("loss", "reward_mean", "grad_norm", "tokens", "behaviour_version_min",
            "behaviour_version_max")
WORKER_TITLE = "ray::RolloutWorker"


def train_command(run_dir: Path, args, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "experiments.train", "--preset", "tiny-synthetic",
            "--task-option", "length=32", "--task-option", "alphabet=8",
            "--run-dir", str(run_dir), "--steps", str(args.steps), "--eval-every", "0",
            "--set", "loop.save_every=2", "--no-progress", "--wandb", "disabled",
            "--max-staleness", "1", "--async-mode", "deterministic", "--async-backend", "ray",
            *(["--resume"] if resume else [])]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"kind": "train"' in line for line in path.read_text().splitlines())


def processes(pattern: str, session: int | None = None) -> list[int]:
    """pids whose command line contains `pattern` (in session `session` when given)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            sid = os.getsid(int(pid))
        except (OSError, ProcessLookupError):
            continue
        if pattern in cmd and (session is None or sid == session):
            out.append(int(pid))
    return out


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def start(cmd: list[str]) -> subprocess.Popen:
    """The run in a session of its own (its Ray processes in it too)."""
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def kill_session(sid: int) -> int:
    """SIGKILL what is left of a session; how many processes were left."""
    left = processes("", session=sid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, signal.SIGKILL)
    return len(left)


def worker_kills(run_dir: Path, args) -> dict:
    proc = start(train_command(run_dir, args))
    events = []
    for i in range(args.kills):
        after = 5 + 10 * i
        wait_for(lambda after=after: steps_done(run_dir) >= after, 600, f"step {after}", proc)
        pid = wait_for(lambda: processes(WORKER_TITLE, proc.pid), 120, "a worker", proc)[0]
        os.kill(pid, signal.SIGKILL)
        events.append({"after_step": after, "killed_pid": pid})
        wait_for(lambda pid=pid: [p for p in processes(WORKER_TITLE, proc.pid) if p != pid], 120,
                 "the restarted worker", proc)
    code, err = finish(proc)
    kill_session(proc.pid)
    return {"exit": code, "events": events, "log_lines": warning_lines(err)}


def learner_kill(run_dir: Path, args) -> dict:
    proc = start(train_command(run_dir, args))
    wait_for(lambda: steps_done(run_dir) >= 15, 600, "step 15", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = kill_session(proc.pid)
    before = steps_done(run_dir)
    resumed = start(train_command(run_dir, args, resume=True))
    code, err = finish(resumed)
    kill_session(resumed.pid)
    return {"exit": code, "records_before_resume": before, "session_processes_left": left,
            "log_lines": warning_lines(err)}


def sigterm(run_dir: Path, args) -> dict:
    proc = start(train_command(run_dir, args))
    wait_for(lambda: steps_done(run_dir) >= 15, 600, "step 15", proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, timeout=300)
    time.sleep(2)
    workers_left = len(processes(WORKER_TITLE, proc.pid))
    kill_session(proc.pid)
    stopped_at = steps_done(run_dir)
    resumed = start(train_command(run_dir, args, resume=True))
    code2, err2 = finish(resumed)
    kill_session(resumed.pid)
    return {"exit": code, "stopped_after_steps": stopped_at, "workers_left": workers_left,
            "resume_exit": code2, "log_lines": warning_lines(err + err2)}


def warning_lines(err: str) -> list[str]:
    """The run's own warning / error lines about workers and preemption."""
    keys = ("rollout worker", "preempted", "Preempted", "resum")
    return [line.strip() for line in err.splitlines() if any(k in line for k in keys)][:20]


def compare(reference: list[dict], train: list[dict]) -> dict:
    """Each step's COMPARED fields against the reference (a resumed run's repeated steps:
    the last record of each step)."""
    by_step = {r["step"]: r for r in train}
    ref = {r["step"]: r for r in reference}
    differ = [s for s in ref if s not in by_step
              or any(by_step[s].get(k) != ref[s].get(k) for k in COMPARED)]
    last = by_step[max(by_step)] if by_step else {}
    return {"steps": len(by_step), "differing_steps": differ,
            "ray_worker_restarts": last.get("ray_worker_restarts"),
            "ray_request_resends": last.get("ray_request_resends")}


def measure(args) -> dict:
    parts = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        proc = start(train_command(tmp / "reference", args))
        code, err = finish(proc)
        kill_session(proc.pid)
        if code != 0:
            raise RuntimeError(f"the reference run failed ({code}):\n{err[-3000:]}")
        reference, _ = read_metrics(tmp / "reference")
        for name, fn in (("worker_kills", worker_kills), ("learner_kill", learner_kill),
                         ("sigterm", sigterm)):
            out = fn(tmp / name, args)
            train, _ = read_metrics(tmp / name)
            out.update(compare(reference, train))
            out["passed"] = (out.get("exit") == 0 and out.get("resume_exit", 0) == 0
                             and out.get("workers_left", 0) == 0
                             and out["steps"] == args.steps and not out["differing_steps"])
            parts[name] = out
            print(f"{name}: {json.dumps(out)}", flush=True)
    return {"parts": parts, "reference_steps": len(reference)}


def summary_row(result: dict, link: str, index: bool = False) -> str:
    p, h = result["parts"], result["headline"]
    text = (f"| [{TITLE}]({link}) | `kill -9` of a Ray rollout worker ×{len(p['worker_kills']['events'])}"
            f", of the learner then `--resume`, SIGTERM then `--resume`: steps differing from the "
            f"undisturbed run {h['value']} (of {3 * result['config']['steps']}) |")
    if not index:
        return text
    return text + f" {h['target']} | " + ("met |" if h["value"] <= h["target"] else "missed |")


def render_page(result: dict) -> str:
    p, h, cfg = result["parts"], result["headline"], result["config"]
    wk, lk, st = p["worker_kills"], p["learner_kill"], p["sigterm"]

    def verdict(part):
        return "passed" if part["passed"] else "failed"
    lines = "\n".join(f"    {line}" for part in p.values() for line in part["log_lines"][:6])
    return f"""# Ray rollout-worker faults

<!-- generated by `python -m experiments.bench.ray_faults` from
experiments/results/bench_ray_faults.json; do not edit by hand -->

`tiny-synthetic` with 32-token responses, {cfg['steps']} steps, the deterministic schedule at
η = 1 on one Ray rollout worker (`--async-backend ray`), a checkpoint every 2 steps; each
part against the same run undisturbed, step by step (loss, reward, gradient norm, tokens
and behaviour versions equal: the same groups trained once each). Machine: {h['machine']}.

| part | what was done | steps | steps differing | restarts counted (resends) | verdict |
|---|---|---|---|---|---|
| worker_kills | `kill -9` of the worker after steps {', '.join(str(e['after_step']) for e in wk['events'])} | {wk['steps']} | {len(wk['differing_steps'])} | {wk['ray_worker_restarts']:g} ({wk['ray_request_resends']:g}) | {verdict(wk)} |
| learner_kill | `kill -9` of the learner after step 15 ({lk['session_processes_left']} of its session's processes left, killed), then `--resume` | {lk['steps']} | {len(lk['differing_steps'])} | {lk['ray_worker_restarts']:g} ({lk['ray_request_resends']:g}) | {verdict(lk)} |
| sigterm | SIGTERM to the learner after step 15: exit {st['exit']}, stopped after {st['stopped_after_steps']} steps, {st['workers_left']} worker processes left; then `--resume` | {st['steps']} | {len(st['differing_steps'])} | {st['ray_worker_restarts']:g} ({st['ray_request_resends']:g}) | {verdict(st)} |

A killed worker's request is sent again to the process Ray restarts; the deterministic
schedule fixes each request's inputs (params version, rng, data position), so the groups
that come back are the ones that were lost, and nothing is trained twice. "Restarts
counted" is the run's `ray_worker_restarts`: one per request whose worker died (a kill
while the worker was idle between requests costs no resend and is not counted there);
`ray_request_resends` adds the resends made while Ray was still restarting it. The lines the runs logged:

{lines}

Command: `{result['command']}`.
"""


def write_docs(result: dict) -> None:
    write_page_and_rows(PAGE, render_page(result),
                        lambda link, index=False: summary_row(result, link, index=index),
                        TITLE, ROW_AFTER)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.ray_faults",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULT)
    add_docs_only_flag(p)
    args = p.parse_args(argv)
    if args.docs_only:
        return docs_from_json(RESULT, write_docs)
    need = max(20, 10 * args.kills + 5)
    if args.steps < need:
        raise SystemExit(f"--steps {args.steps}: the kills come after steps 5, 15, 25, ... "
                         f"and the learner's after step 15; use at least {need}")
    res = measure(args)
    differ = sum(len(part["differing_steps"]) for part in res["parts"].values())
    result = {"headline": {"metric": "steps differing from the undisturbed run after kill -9 "
                                     "of a Ray rollout worker x3, kill -9 of the learner + "
                                     "resume, SIGTERM + resume (tiny-synthetic)",
                           "value": differ, "target": 0, "machine": machine()},
              **res, "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
              "command": "python -m experiments.bench.ray_faults " + " ".join(sys.argv[1:])}
    write_results(args.out, result)
    if args.out == RESULT:
        write_docs(result)
    print(json.dumps(result["headline"], indent=1))
    return result


if __name__ == "__main__":
    main()
