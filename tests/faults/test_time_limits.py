"""Environment and tool time limits: a hanging environment step (and reset, outcome), an
episode past its wall limit and a tool that never returns each end only their own
episodes, with EndReason.TIMEOUT, counted in the episode metrics; every other episode of
the batch is what it is without the fault (the same tokens, masks and outcome; log-probs
to float rounding).

A scripted environment on the tiny model (the shapes of tests/rl/test_multiturn.py), and
rl.envs.tools.ToolWorker on the functions of tests/faults/hang_tools.py."""
import threading
import time

import numpy as np
import pytest

from models.config import get_config
from models.decoder import init_params
from rl.envs.base import EndReason, StepResult, ToolTimeout
from rl.envs.tools import ToolError, ToolWorker
from rl.loops.config import LoopConfig
from rl.loops.episodes import EnvTask, sample_episodes, take_episode_metrics
from rl.loops.rollouts import RolloutSpec
from rl.rollout.multiturn import MultiTurnConfig, MultiTurnEngine, TimeLimits
from rl.rollout.sampler_state import SamplingConfig
from tests.rl.scripted_env import IdTextEnv

CFG = get_config("tiny")
STOPS = tuple(range(3, 256, 23))
RELEASE = threading.Event()  # set at the end of the module: hung calls return then


@pytest.fixture(scope="module", autouse=True)
def release_hung_calls():
    yield
    RELEASE.set()


class Episode:
    """Turn k's observation is k+1 ids; done after 3 turns; `fault` on the chosen turn:
    "hang" (step never returns until RELEASE), "slow" (every step takes 0.2 s), "tool"
    (step calls a ToolWorker that sleeps 60 s), "hang_outcome"."""

    def __init__(self, fault, tool):
        self.fault, self.tool, self.turn = fault, tool, 0

    def step(self, text):
        self.turn += 1
        if self.fault == "hang" and self.turn == 2:
            RELEASE.wait(120)
        if self.fault == "slow":
            time.sleep(0.2)
        if self.fault == "tool" and self.turn == 2:
            self.tool(60)
        obs = " ".join(str(40 + j) for j in range(self.turn + 1))
        return StepResult(observation=obs, reward=0.5, done=self.turn >= 3)

    def outcome(self):
        if self.fault == "hang_outcome":
            RELEASE.wait(120)
        return {"score": float(self.turn)}


class Env(IdTextEnv):
    name = "scripted-faults"
    reward_names = ("score",)
    stop_ids = STOPS
    PROMPTS = ((5, 17, 33), (9, 10, 11, 12), (7, 7, 8), (100, 101, 102), (60,), (31, 32))

    def __init__(self, faults=None, tool=None, step_timeout_s=None):
        self.faults, self.tool = faults or {}, tool
        if step_timeout_s is not None:
            self.step_timeout_s = step_timeout_s

    def reset(self, prompt):
        if self.faults.get(prompt.index) == "hang_reset":
            RELEASE.wait(120)
        return Episode(self.faults.get(prompt.index), self.tool)


def prompts():
    return Env().prompts()


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


NO_LIMITS = TimeLimits()


def rollout(params, env, limits=NO_LIMITS):
    eng = MultiTurnEngine(CFG, env, MultiTurnConfig(
        num_slots=4, group_size=2, segment_len=5, sampling=SamplingConfig(temperature=0.7),
        time_limits=limits))
    eng.submit(prompts())
    batches, v = [], 0
    while not eng.idle:
        eng.step(params, v)
        v += 1
        if (b := eng.harvest()) is not None:
            batches.append(b)
    rows = [(b.trajectory, i, b.episodes[i]) for b in batches for i in range(len(b.episodes))]
    return sorted(rows, key=lambda r: (r[2].group_id, r[2].sample))


@pytest.fixture(scope="module")
def clean(params):
    return rollout(params, Env())


def assert_others_intact(clean, rows, bad):
    """Every episode outside group `bad`: the same tokens, masks and outcome."""
    assert len(rows) == len(clean)
    for (tc, i, rc), (tb, j, rb) in zip(clean, rows):
        assert rc.group_id == rb.group_id
        if rb.group_id == bad:
            continue
        for field in ("prompt_ids", "response_ids", "response_mask", "env_mask", "turn_ids"):
            np.testing.assert_array_equal(np.asarray(getattr(tc, field))[i],
                                          np.asarray(getattr(tb, field))[j], err_msg=field)
        # log-probs to float rounding: the slots decoding around a row change the shapes
        # its numbers are computed in (as in tests/rl/test_multiturn.py)
        np.testing.assert_allclose(np.asarray(tc.behaviour_logprobs)[i],
                                   np.asarray(tb.behaviour_logprobs)[j], atol=1e-5)
        assert rc.outcome == rb.outcome and rc.end_reason == rb.end_reason == EndReason.DONE


@pytest.mark.parametrize("fault,via", [("hang", "config"), ("hang", "env"),
                                       ("hang_reset", "config"), ("hang_outcome", "config")])
def test_a_hanging_environment_call_ends_only_its_episodes(params, clean, fault, via):
    bad = 2
    env = Env({bad: fault}, step_timeout_s=0.3 if via == "env" else None)
    t0 = time.monotonic()
    rows = rollout(params, env, TimeLimits(step_s=0.3 if via == "config" else 0.0))
    assert time.monotonic() - t0 < 30  # two hung calls of 0.3 s, not 120 s
    assert_others_intact(clean, rows, bad)
    hit = [rec for _, _, rec in rows if rec.group_id == bad]
    for rec in hit:
        assert rec.end_reason == EndReason.TIMEOUT and "time limit of 0.3 s" in rec.message
        assert rec.outcome == {"score": 0.0}  # a call into it may still be running
    if fault == "hang":
        assert all(rec.turns == 2 for rec in hit)


def test_episodes_past_their_wall_limit_end_with_timeout(params):
    # every step takes 0.2 s: an episode needs 3 turns, the limit allows about 2
    # (the wall limit counts the engine's time, which episodes decoding together share)
    rows = rollout(params, Env({i: "slow" for i in range(6)}), TimeLimits(episode_s=0.5))
    for traj, j, rec in rows:
        assert rec.end_reason == EndReason.TIMEOUT and "wall time limit of 0.5 s" in rec.message
        assert 1 <= rec.turns < 3 and rec.outcome == {"score": float(rec.turns)}
        assert float(traj.rewards["score"][j]) == rec.outcome["score"]


def test_an_episode_cut_mid_turn_keeps_its_tokens(params):
    rows = rollout(params, Env(), TimeLimits(episode_s=1e-9))  # every episode, at once
    for traj, j, rec in rows:
        assert rec.end_reason == EndReason.TIMEOUT and rec.turns == 0
        n = int(np.asarray(traj.response_mask)[j].sum())
        assert 1 <= n <= 5  # the first decode segment, cut
        assert rec.spans == [("model", 0, n)]
        assert not np.asarray(traj.env_mask)[j].any()
        assert (np.asarray(traj.turn_ids)[j][:n] == 0).all()


def test_a_hanging_tool_is_killed_and_counted(params, clean):
    bad = 3
    with ToolWorker("hang_tools:sleep_for", timeout_s=0.5) as tool:
        rows = rollout(params, Env({bad: "tool"}, tool=tool))
        assert tool.timeouts == 2  # the group's two episodes, one killed worker each
    assert_others_intact(clean, rows, bad)
    for _, _, rec in rows:
        if rec.group_id == bad:
            assert rec.end_reason == EndReason.TIMEOUT and "worker process was killed" in rec.message
            assert rec.outcome == {"score": 2.0}  # the episode itself answers


def test_tool_worker_results_errors_timeouts_and_restarts():
    with ToolWorker("hang_tools:echo", timeout_s=5) as tool:
        assert tool("hi") == "echo hi" and tool(text="there") == "echo there"
    with ToolWorker("hang_tools:fail", timeout_s=5) as tool, \
            pytest.raises(ToolError, match="ValueError: cannot do 'x'"):
        tool("x")
    sleeper = ToolWorker("hang_tools:sleep_for", timeout_s=0.5)
    try:
        tool_pid = None
        assert sleeper(0) == "woke"
        tool_pid = sleeper._proc.pid
        t0 = time.monotonic()
        with pytest.raises(ToolTimeout, match="within 0.5 s"):
            sleeper(60)
        assert time.monotonic() - t0 < 5 and sleeper._proc is None
        assert sleeper(0) == "woke" and sleeper._proc.pid != tool_pid  # a fresh worker
    finally:
        sleeper.close()
    with ToolWorker("hang_tools:die", timeout_s=5) as tool, \
            pytest.raises(RuntimeError, match="died during a call"):
        tool("x")
    with pytest.raises(ValueError, match="module:function"):
        ToolWorker("hang_tools.echo", timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s"):
        ToolWorker("hang_tools:echo", timeout_s=0)


def test_timeouts_are_counted_in_the_episode_metrics(params):
    task = EnvTask(Env({0: "hang"}))
    loop = LoopConfig(env_step_timeout_s=0.3)
    spec = RolloutSpec(task, CFG, group_size=2, segment_len=5,
                       sampling=SamplingConfig(temperature=0.7),
                       time_limits=TimeLimits(loop.env_step_timeout_s, loop.episode_timeout_s))
    traj = sample_episodes(params, 0, spec, prompts()[:2], seed=0)
    assert traj.batch_size == 4
    metrics = take_episode_metrics(task)
    assert metrics["episode_end_timeout"] == 0.5 and metrics["episode_end_done"] == 0.5


def test_time_limit_settings_are_checked():
    with pytest.raises(ValueError, match="TimeLimits.step_s"):
        TimeLimits(step_s=-1)
    with pytest.raises(ValueError, match="episode_timeout_s"):
        LoopConfig(episode_timeout_s=float("inf"))
    with pytest.raises(ValueError, match="time_limits must be a TimeLimits"):
        MultiTurnConfig(num_slots=2, group_size=2, segment_len=4, time_limits=1.0)
    from experiments.common.flags import config_from_argv

    cfg, _ = config_from_argv(["--env-step-timeout", "5", "--episode-timeout", "60",
                               "--save-every-minutes", "10"])
    assert (cfg.loop.env_step_timeout_s, cfg.loop.episode_timeout_s,
            cfg.loop.save_every_minutes) == (5.0, 60.0, 10.0)
