"""Dead threads and workers are loud: an exception in the asynchronous loop's rollout
thread, in orbax's checkpoint writer thread, or in a task's reward worker process stops
the run within one step, with that exception's message and the step, never a hang and
never a silent continue (each failure injected into a real run of the tiny config)."""
import dataclasses
import threading

import pytest
from conftest import LOOP, PRESET, cfg, checkpoint_steps, lock_is_free, records

from rl.loops import AsyncConfig, run, run_async
from rl.runtime.checkpoint import CheckpointError
from rl.tasks import SyntheticTask, math_answers

SAVING = dataclasses.replace(LOOP, steps=6, save_every=1, keep_checkpoints=3)
EVAL_ROWS, STEP_ROWS = 8, 8  # reward calls: the step-0 eval, then each step's batch


class RewardTask(SyntheticTask):
    """The preset's task whose reward, from call `fail_at` on (counting only the calls
    made in thread `thread`, if given), asks the math-verify worker (rl.tasks.math_answers)
    to compare two answers, or raises `error`."""

    def __init__(self, fail_at, error=None, thread=None):
        base = SyntheticTask(**PRESET.task.kwargs)
        super().__init__(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        object.__setattr__(self, "_state", [0, fail_at, error, thread])

    def reward(self, prompt, response):
        thread = self._state[3]
        if thread is not None and threading.current_thread().name != thread:
            return SyntheticTask.reward(self, prompt, response)
        self._state[0] += 1
        if self._state[0] >= self._state[1]:
            if self._state[2] is not None:
                raise self._state[2]
            math_answers.math_equal("1/2", "0.5")  # needs the worker process
        return SyntheticTask.reward(self, prompt, response)


@pytest.fixture
def broken_math_worker(monkeypatch):
    """The math-verify worker process cannot start (its interpreter exits at once)."""
    math_answers.shutdown_worker()
    monkeypatch.setattr(math_answers, "_BOOT", "import sys; sys.exit(3)")
    yield
    math_answers.shutdown_worker()


def train_steps(run_dir):
    return [r["step"] for r in records(run_dir) if r["kind"] == "train"]


def test_a_dead_reward_worker_stops_the_sync_run_at_its_step(policy, tmp_path,
                                                             broken_math_worker):
    config, params, _ = policy
    task = RewardTask(fail_at=2 * EVAL_ROWS + 2 * STEP_ROWS + 3)  # step 3's rewards
    with pytest.raises(RuntimeError, match="math-verify worker process did not start") as info:
        run(config, params, task, cfg(tmp_path / "r", SAVING))
    assert "during step 3 " in " ".join(getattr(info.value, "__notes__", []))
    assert train_steps(tmp_path / "r") == [1, 2]
    assert checkpoint_steps(tmp_path / "r")[-1] == 2 and lock_is_free(tmp_path / "r")


def test_a_dead_reward_worker_stops_the_threaded_async_run(policy, tmp_path,
                                                           broken_math_worker):
    config, params, _ = policy
    task = RewardTask(fail_at=2 * STEP_ROWS + 3, thread="tandem-rollout")  # its 3rd batch
    acfg = AsyncConfig(max_staleness=1)
    with pytest.raises(RuntimeError, match=r"step \d+: the rollout thread failed: RuntimeError: "
                       "the math-verify worker process did not start") as info:
        run_async(config, params, task, cfg(tmp_path / "r", SAVING, asynchronous=acfg))
    failed_at = int(str(info.value).split()[1].rstrip(":"))
    # the producer runs at most η = 1 step ahead: the learner stops at the step it waits for
    assert train_steps(tmp_path / "r") == list(range(1, failed_at))
    assert failed_at <= 4 and lock_is_free(tmp_path / "r")


def test_a_raising_producer_stops_the_run_within_one_step(policy, tmp_path):
    config, params, _ = policy
    task = RewardTask(fail_at=3 * STEP_ROWS + 1, error=ConnectionError("verifier down"),
                      thread="tandem-rollout")
    acfg = AsyncConfig(max_staleness=1, rollout="continuous")
    with pytest.raises(RuntimeError, match=r"rollout thread failed: ConnectionError: verifier") \
            as info:
        run_async(config, params, task, cfg(tmp_path / "r", SAVING, asynchronous=acfg))
    assert isinstance(info.value.__cause__, ConnectionError)
    failed_at = int(str(info.value).split()[1].rstrip(":"))
    steps = train_steps(tmp_path / "r")
    assert steps == list(range(1, failed_at)) and failed_at <= 5
    assert checkpoint_steps(tmp_path / "r")[-1] == steps[-1]  # the final checkpoint


@pytest.mark.parametrize("loop_kind", ["sync", "async"])
def test_a_failing_checkpoint_writer_stops_the_run_within_one_step(policy, tmp_path,
                                                                   monkeypatch, loop_kind):
    from orbax.checkpoint._src.path import atomicity

    from rl.runtime.checkpoint import Checkpointer
    from rl.runtime.logging import MetricsLogger

    finalize, log, armed = atomicity.AtomicRenameTemporaryPath.finalize, MetricsLogger.log, []
    opened, init = [], Checkpointer.__init__

    def remember(self, *a, **k):
        init(self, *a, **k)
        opened.append(self)

    async def failing(self, *a, **k):  # in orbax's writer thread
        if armed:
            raise RuntimeError("storage controller reset")
        return await finalize(self, *a, **k)

    def arm_at_step_3(self, step, metrics, kind="train"):
        out = log(self, step, metrics, kind)
        if (step, kind) == (3, "train"):
            opened[-1].wait()  # the save of step 2 is on disk:
            armed.append(True)  # the save of step 3 is the one to fail
        return out

    monkeypatch.setattr(Checkpointer, "__init__", remember)
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", failing)
    monkeypatch.setattr(MetricsLogger, "log", arm_at_step_3)
    config, params, task = policy
    sections = {} if loop_kind == "sync" else {
        "asynchronous": AsyncConfig(max_staleness=1, mode="deterministic")}
    with pytest.raises(CheckpointError) as info:
        (run if loop_kind == "sync" else run_async)(
            config, params, task, cfg(tmp_path / "r", SAVING, **sections))
    line = str(info.value)
    assert line.startswith("checkpoint step 3 could not be written to ")
    assert "(RuntimeError: storage controller reset)" in line
    assert "the last good checkpoint is step 2" in line and "\n" not in line
    assert max(train_steps(tmp_path / "r")) <= 4  # stopped within one step
    assert lock_is_free(tmp_path / "r")
