"""Signals to the main job (`experiments.train`), at a random point of a 20-step run:

  * SIGTERM / SIGINT (a real signal at a random decode segment of main(), in this
    process): exit status 0 (or --preempted-exit-code) after one "preempted: ..." line on
    stderr and no traceback, its lock is free, and `--resume` ends with the params,
    optimizer state and metric records of the uninterrupted run;
  * SIGKILL to a `python -m experiments.train` subprocess after a random number of logged
    steps: nothing runs at all, yet `--resume --resume-from-last-good` always succeeds (a
    save cut short leaves only a temporary directory, removed on resume) and ends with
    the uninterrupted run's state and records: no metric step duplicated or missing;
  * two processes (jax.distributed on localhost, 1 CPU device each), SIGTERM from outside
    to one of them: both stop after the same step, each with exit status 0 and one line.

The subprocesses share one persistent XLA compilation cache (conftest.xla_cache); the
resumes and the reference run in this process (same programs as the other fault tests).
"""
import json
import re
import signal

import pytest
from conftest import (
    REPO,
    assert_same_state,
    checkpoint_steps,
    comparable,
    draws,
    free_port,
    launch,
    lock_is_free,
    records,
    restore,
    train_env,
    train_steps_logged,
    wait_for,
)

from experiments.common.train_cli import main

STEPS = 20
ARGS = ["--steps", str(STEPS), "--prompts-per-step", "2", "--group-size", "4",
        "--eval-prompts", "8", "--eval-every", "10", "--save-every", "3", "--wandb",
        "disabled", "--no-progress"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run, in this process: (final state, comparable records)."""
    run_dir = tmp_path_factory.mktemp("full")
    main([*ARGS, "--run-dir", str(run_dir)])
    return restore(run_dir, STEPS)[0], comparable(records(run_dir))


def stopped_step(line: str) -> int:
    """K of a "preempted: stopped by ... after step K..." line."""
    return int(re.search(r" after step (\d+)", line).group(1))


def stop_after(xla_cache, run_dir, logged, sig):
    """Start the run, send `sig` once `logged` train records are on disk; (returncode,
    stderr)."""
    proc = launch(xla_cache, *ARGS, "--run-dir", run_dir)
    try:
        started = wait_for(lambda: train_steps_logged(run_dir) >= logged, proc)
        assert started, proc.communicate()[1][-3000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("k", draws(STEPS + 3, "cli-signal"))  # segments: 1 a step or eval
def test_the_cli_exits_0_after_a_stop_then_resume_is_exact(full_run, tmp_path, capfd,
                                                            monkeypatch, k):
    """SIGTERM / SIGINT at a random decode segment of experiments.train's main(): status
    0 (--preempted-exit-code changes it), one "preempted:" line, no traceback."""
    from conftest import SignalAt

    from rl.rollout.engine import RolloutEngine

    sig = (signal.SIGTERM, signal.SIGINT)[k % 2]
    run_dir = tmp_path / "r"
    stop = SignalAt(monkeypatch, RolloutEngine, "step", k, sig=sig)
    code = 0 if k % 3 else 143
    with pytest.raises(SystemExit) as info:
        main([*ARGS, "--run-dir", str(run_dir), "--preempted-exit-code", str(code)])
    err = capfd.readouterr().err
    assert stop.sent and info.value.code == code, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"preempted: stopped by {sig.name} after step ")
    assert "Traceback" not in err
    step = stopped_step(lines[-1])
    assert step in checkpoint_steps(run_dir) and lock_is_free(run_dir)
    monkeypatch.undo()
    main([*ARGS, "--run-dir", str(run_dir), "--resume"])
    state, want = full_run
    assert_same_state(restore(run_dir, STEPS)[0], state)
    assert comparable(records(run_dir)) == want


@pytest.mark.parametrize("logged", [7 + k for k in draws(STEPS - 8, "sigkill")])
def test_sigkill_then_resume_from_last_good_is_exact(full_run, xla_cache, tmp_path, logged):
    # from the 7th logged step on, the save of step 3 has finished (the save of 6 waited
    # for it), so a finished checkpoint exists whatever the save in flight
    run_dir = tmp_path / "r"
    code, _ = stop_after(xla_cache, run_dir, logged, signal.SIGKILL)
    if code == 0:
        pytest.fail("the run finished before SIGKILL")
    assert code == -signal.SIGKILL
    main([*ARGS, "--run-dir", str(run_dir), "--resume", "--resume-from-last-good"])
    got = records(run_dir)
    train = [r["step"] for r in got if r["kind"] == "train"]
    evals = [r["step"] for r in got if r["kind"] == "eval"]
    assert train == list(range(1, STEPS + 1)) and evals == [0, 10, 20]
    state, want = full_run
    assert_same_state(restore(run_dir, STEPS)[0], state)
    assert comparable(got) == want
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


def test_two_processes_stop_after_the_same_step(xla_cache, tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "mp"
    coord = ["--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    env = train_env(xla_cache)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.train", *ARGS, "--steps", "200",
                               "--mesh", "dp", "--run-dir", str(run_dir), *coord,
                               "--process-id", str(i)], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in (0, 1)]
    try:
        assert wait_for(lambda: train_steps_logged(run_dir) >= 3, procs[0]), \
            procs[0].communicate()[1][-3000:]
        procs[1].send_signal(signal.SIGTERM)  # only process 1 hears it
        outs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    last = [o.strip().splitlines()[-1] for o in outs]
    # jax.distributed's preemption service owns SIGTERM there and syncs the stop step
    for line in last:
        assert line.startswith("preempted: stopped by a preemption notice after step "), line
    steps = {stopped_step(x) for x in last}
    assert len(steps) == 1
    step = steps.pop()
    assert step in checkpoint_steps(run_dir) and lock_is_free(run_dir)
    train = [r["step"] for r in records(run_dir) if r["kind"] == "train"]
    assert train == list(range(1, step + 1))
    assert json.loads((run_dir / "run_config.json").read_text())["mesh"] == "dp"
