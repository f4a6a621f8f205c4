"""SIGTERM / SIGINT inside a run (real signals, sent to this process at chosen points):
the run stops at its next safe point with a checkpoint of its last completed step, the
metrics written so far are a prefix of the uninterrupted run's, the lock is free, and
`resume=True` then ends with the same params, optimizer state and metric records as the
uninterrupted run, bit for bit. Points: before the first step (while the run sets up),
at a random decode segment of the run (train rollouts or an eval), during an eval, during
a checkpoint save, for the synchronous loop and the asynchronous one (deterministic and
threaded).

In-process runs of the suite's tiny config (tests/faults/conftest.py); each point costs
one interrupted run and one resume (~2 s once compiled)."""
import dataclasses
import signal
import threading

import pytest
from conftest import (
    LOOP,
    CallCounter,
    SignalAt,
    assert_same_state,
    cfg,
    checkpoint_steps,
    comparable,
    draws,
    lock_is_free,
    records,
)

import rl.loops.evaluation as evaluation_module
from rl.loops import AsyncConfig, run, run_async
from rl.rollout.engine import RolloutEngine
from rl.runtime import preemption
from rl.runtime.checkpoint import Checkpointer
from rl.runtime.preemption import Preempted
from rl.tasks import SyntheticTask

SAVING = dataclasses.replace(LOOP, save_every=2)  # checkpoints at 2 and 4


def process_relative(recs):
    """comparable records without the async loop's counters that count from the start of
    the process (buffer_*) and its resume note (dropped_on_resume_groups), as documented
    in rl.loops.asynchronous."""
    return [{k: v for k, v in r.items() if not k.startswith("buffer_")
             and k != "dropped_on_resume_groups"} for r in comparable(recs)]


@pytest.fixture(scope="module")
def timeline(policy, tmp_path_factory):
    """The uninterrupted SAVING run: (final state, records, which RolloutEngine.step calls
    were inside an eval)."""
    config, params, task = policy
    in_eval, marks = [False], []
    with pytest.MonkeyPatch.context() as mp:
        counter = CallCounter(mp, RolloutEngine, "step")
        original_step, original_eval = RolloutEngine.step, evaluation_module.eval_report

        def step(self, *a, **k):
            marks.append(in_eval[0])
            return original_step(self, *a, **k)

        def evaluate(*a, **k):
            in_eval[0] = True
            try:
                return original_eval(*a, **k)
            finally:
                in_eval[0] = False

        mp.setattr(RolloutEngine, "step", step)
        mp.setattr(evaluation_module, "eval_report", evaluate)
        run_dir = tmp_path_factory.mktemp("timeline")
        res = run(config, params, task, cfg(run_dir, SAVING))
    assert counter.calls == len(marks) and any(marks) and not all(marks)
    return res.state, comparable(records(run_dir)), marks


def interrupted_then_resumed(policy, run_dir, reference, loop=SAVING, **sections):
    """The run (a signal is armed by the caller) must stop with Preempted; check the stop,
    then resume and compare with `reference` (state, records)."""
    config, params, task = policy
    run_fn = run if "asynchronous" not in sections else run_async
    with pytest.raises(Preempted) as info:
        run_fn(config, params, task, cfg(run_dir, loop, **sections))
    err = info.value
    assert err.signal in ("SIGTERM", "SIGINT") and "continue with --resume" in str(err)
    assert err.step in checkpoint_steps(run_dir)
    assert lock_is_free(run_dir) and preemption.requested() is None
    got, want = process_relative(records(run_dir)), process_relative(reference[1])
    assert got == want[:len(got)]  # what was written is what the full run writes
    assert max((r["step"] for r in got if r["kind"] == "train"), default=0) == err.step
    resumed = run_fn(config, params, task, cfg(run_dir, loop, **sections), resume=True)
    assert_same_state(resumed.state, reference[0])
    assert process_relative(records(run_dir)) == want
    return err


def test_sigterm_before_the_first_step(policy, timeline, tmp_path, monkeypatch):
    # make_evaluator asks for the eval prompts before the first step and the step-0 eval
    SignalAt(monkeypatch, SyntheticTask, "eval_prompts", 0)
    err = interrupted_then_resumed(policy, tmp_path / "r", timeline)
    assert err.step == 0 and checkpoint_steps(tmp_path / "r") == [2, 4]  # keep=2
    assert records(tmp_path / "r")[0]["kind"] == "eval"  # the resumed run ran eval 0 first


@pytest.mark.parametrize("k", draws(31, "segment"))
def test_sigterm_at_a_random_decode_segment(policy, timeline, tmp_path, monkeypatch, k):
    marks = timeline[2]
    k = k % len(marks)
    sig = (signal.SIGTERM, signal.SIGINT)[k % 2]
    SignalAt(monkeypatch, RolloutEngine, "step", k, sig=sig)
    err = interrupted_then_resumed(policy, tmp_path / "r", timeline)
    assert err.signal == sig.name


def test_sigterm_during_an_eval_leaves_it_to_the_resumed_run(policy, timeline, tmp_path,
                                                             monkeypatch):
    marks = timeline[2]
    evals = [i for i, m in enumerate(marks) if m]
    k = evals[len(evals) // 2]  # inside the eval of step 2
    SignalAt(monkeypatch, RolloutEngine, "step", k)
    err = interrupted_then_resumed(policy, tmp_path / "r", timeline)
    assert err.abandoned == "the eval of step 2" and err.step == 2


@pytest.mark.parametrize("after", [False, True], ids=["entering", "writing"])
def test_sigterm_during_a_checkpoint_save(policy, timeline, tmp_path, monkeypatch, after):
    SignalAt(monkeypatch, Checkpointer, "save", 0, after=after)  # step 2's save
    err = interrupted_then_resumed(policy, tmp_path / "r", timeline)
    assert err.step == 2 and checkpoint_steps(tmp_path / "r") == [2, 4]


DETERMINISTIC = AsyncConfig(max_staleness=1, mode="deterministic")


@pytest.fixture(scope="module")
def async_reference(policy, tmp_path_factory):
    config, params, task = policy
    run_dir = tmp_path_factory.mktemp("async")
    res = run_async(config, params, task, cfg(run_dir, SAVING, asynchronous=DETERMINISTIC))
    return res.state, comparable(records(run_dir))


@pytest.mark.parametrize("k", draws(7, "async"))  # 4 steps and 3 evals: 7 decode segments
def test_sigterm_in_the_deterministic_async_loop(policy, async_reference, tmp_path,
                                                 monkeypatch, k):
    SignalAt(monkeypatch, RolloutEngine, "step", k)
    interrupted_then_resumed(policy, tmp_path / "b", async_reference,
                             asynchronous=DETERMINISTIC)


def test_sigterm_in_the_threaded_async_loop(policy, tmp_path):
    """Threaded: the producer's queued groups are dropped on resume (documented), so the
    continuation differs from an uninterrupted run; the stop itself is clean and resumes."""
    from rl.run import RunHooks

    config, params, task = policy
    acfg = AsyncConfig(max_staleness=1)

    def stop_after_step_one(record):
        if record["step"] == 1:
            signal.raise_signal(signal.SIGTERM)

    with pytest.raises(Preempted) as info:
        run_async(config, params, task, cfg(tmp_path / "b", SAVING, asynchronous=acfg),
                  hooks=RunHooks(on_step=stop_after_step_one))
    assert info.value.step == 1 and info.value.abandoned == "step 2's rollouts"
    assert checkpoint_steps(tmp_path / "b") == [1] and lock_is_free(tmp_path / "b")
    assert not [t for t in threading.enumerate() if t.name == "tandem-rollout"]
    res = run_async(config, params, task, cfg(tmp_path / "b", SAVING, asynchronous=acfg),
                    resume=True)
    assert [r["step"] for r in res.train] == [1, 2, 3, 4]


@pytest.mark.parametrize("loop_kind", ["sync", "async"])
def test_time_based_saves(policy, tmp_path, monkeypatch, loop_kind):
    """save_every_minutes: a save after the first step that ends that long after the last
    save (here 1 µs: after every step), in both loops; 0 keeps the schedule as it was."""
    config, params, task = policy
    saved = []
    save = Checkpointer.save
    monkeypatch.setattr(Checkpointer, "save",
                        lambda self, step, *a, **k: (saved.append(step), save(self, step, *a, **k)))
    sections = {} if loop_kind == "sync" else {
        "asynchronous": AsyncConfig(max_staleness=1, mode="deterministic")}
    run_fn = run if loop_kind == "sync" else run_async
    run_fn(config, params, task, cfg(tmp_path / "off", LOOP, **sections))
    assert saved == [4]  # save_every=0: the end only
    saved.clear()
    timed = dataclasses.replace(LOOP, save_every_minutes=1e-6 / 60)
    run_fn(config, params, task, cfg(tmp_path / "on", timed, **sections))
    assert saved == [1, 2, 3, 4] and checkpoint_steps(tmp_path / "on") == [3, 4]


def test_a_stop_requested_by_code_stops_like_a_signal(policy, timeline, tmp_path):
    """rl.runtime.preemption.request_stop: code that learns of a preemption another way
    (a maintenance notice) stops the run as a signal does."""
    from rl.run import RunHooks

    config, params, task = policy

    def notice_after_step_one(record):
        if record["step"] == 1:
            preemption.request_stop("a maintenance notice")

    with pytest.raises(Preempted) as info:
        run(config, params, task, cfg(tmp_path / "r", SAVING),
            hooks=RunHooks(on_step=notice_after_step_one))
    assert info.value.signal == "a maintenance notice" and info.value.step == 1
    resumed = run(config, params, task, cfg(tmp_path / "r", SAVING), resume=True)
    assert_same_state(resumed.state, timeline[0])
    assert comparable(records(tmp_path / "r")) == timeline[1]
