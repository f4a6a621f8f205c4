"""Reward functions of your own (rl.tasks.rewards) around a file task: loaded by
"module:function", by file path, by registered name or from a callable; their rewards
first, the task's own logged; and a clear error, when the task is built, for a function
that cannot be found, raises, hangs, returns NaN, a string, a bool or other names."""
import math
import re
import sys
import time
from pathlib import Path

import pytest

from models.assets import load_tokenizer
from models.tiny_hf import write_tiny_model
from rl.loops.config import RewardConfig, RunConfig
from rl.run.policy import make_task, with_logged_reward_weights
from rl.tasks.rewards import (
    RewardedTask,
    RewardFunctionError,
    call_with_time_limit,
    check_result,
    register_reward,
    reward_spec,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "byo"
SPEC = f"file:{DATA / 'problems.jsonl'}"
OPTIONS = {"verifier": "exact", "eval_fraction": 0.3}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA))
    yield
    sys.modules.pop("rewards", None)


def task_with(tok, function, timeout_s=10.0):
    return make_task(SPEC, tokenizer=tok, reward=RewardConfig(function=function,
                                                              timeout_s=timeout_s), **OPTIONS)


def test_module_function_rewards_come_first_and_the_task_rewards_are_logged(tok, on_path):
    task = task_with(tok, "rewards:exact_digits")
    assert isinstance(task, RewardedTask)
    assert task.reward_names == ("digits", "short", "correct", "format")
    assert task.logged_rewards == ("correct", "format")
    prompt = next(p for p in task.train_prompts(0, 20) if p.answer["answer"] == "42")
    got = task.reward(prompt, "6 * 7 = \\boxed{42}")
    # digits of "6 * 7 = \boxed{42}" are "6742" != "42"; 18 characters; the task's exact
    # verifier reads the box
    assert got == {"digits": 0.0, "short": -0.18, "correct": 1.0, "format": 1.0}
    assert task.reward(prompt, tok.encode("42")) == {"digits": 1.0, "short": -0.02,
                                                     "correct": 1.0, "format": 0.0}
    # the prompt text given to the function is the rendered chat prompt
    seen = []
    register_reward("spy", lambda p, r, e: seen.append((p, r, e)) or {"x": 1.0})
    spy = task_with(tok, "spy")
    spy.reward(prompt, "hi")
    text, response, entry = seen[-1]
    assert text == tok.decode(prompt.ids, skip_special_tokens=False) and response == "hi"
    assert entry["answer"] == "42" and entry["row"] == {"question": "What is 6 times 7?",
                                                        "answer": "42"}
    # everything but the rewards is the task's
    assert spy.stop_ids == spy.task.stop_ids and spy.max_new_tokens == spy.task.max_new_tokens
    cfg = with_logged_reward_weights(RunConfig(), task)
    assert dict(cfg.train.reward_weights) == {"correct": 0.0, "format": 0.0}
    kept = RunConfig().override("train.reward_weights", {"correct": 0.5})
    assert dict(with_logged_reward_weights(kept, task).train.reward_weights) == {
        "correct": 0.5, "format": 0.0}
    # GDPO normalises each named reward on its own, weighted by its params' weights
    gdpo = with_logged_reward_weights(kept.override("train.advantage.name", "gdpo"), task)
    assert dict(dict(gdpo.train.advantage.params)["weights"]) == {
        "digits": 1.0, "short": 1.0, "correct": 0.5, "format": 0.0}


def test_file_path_registered_name_and_callable(tok):
    by_file = task_with(tok, f"{DATA / 'rewards.py'}:exact_digits")
    assert by_file.reward_names[:2] == ("digits", "short")

    def length_bonus(prompt, response, entry):
        return {"length": len(response) / 10}

    spec = reward_spec(length_bonus)
    assert spec == f"{__name__}:test_file_path_registered_name_and_callable.<locals>.length_bonus"
    cfg = RunConfig(reward=length_bonus)
    assert cfg.reward.function == spec and RunConfig.from_json(cfg.to_json()) == cfg
    task = make_task(SPEC, tokenizer=tok, reward=cfg.reward, **OPTIONS)
    assert task.reward(task.eval_prompts(1)[0], "abcd")["length"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="lambda"):
        RunConfig(reward=lambda p, r, e: {"x": 1.0})


@pytest.mark.parametrize("name, message", [
    ("raises", r"'rewards:raises' on prompt '.*' raised KeyError: 'no such column'"),
    ("nan_on_answer", r"returned r=nan \(not finite\)"),
    ("returns_text", r"returned r='1.0' \(str\); rewards must be floats"),
    ("returns_bool", r"returned r=True \(bool\)"),
    ("changes_names", r"returned rewards \['b'\], other names than on its first call \['a'\]"),
])
def test_bad_functions_are_refused_when_the_task_is_built(tok, on_path, name, message):
    with pytest.raises(RewardFunctionError, match=message):
        task_with(tok, f"rewards:{name}")


def test_a_hanging_function_is_stopped_at_its_time_limit(tok, on_path):
    t0 = time.perf_counter()
    with pytest.raises(RewardFunctionError, match=r"did not return within 0.5 s .*timeout_s"):
        task_with(tok, "rewards:hangs", timeout_s=0.5)
    assert time.perf_counter() - t0 < 5


def test_functions_that_cannot_be_found(tok, on_path):
    for spec, message in [("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
                          ("rewards:missing", "'rewards' has no 'missing'"),
                          ("rewards:math", "not callable"),
                          ("missing.py:f", "file 'missing.py' not found"),
                          ("justaname", "neither 'module:function'")]:
        with pytest.raises(RewardFunctionError, match=message):
            task_with(tok, spec)


def test_a_failure_during_training_names_the_prompt(tok):
    calls = []

    def late_nan(prompt, response, entry):
        calls.append(1)
        return {"r": math.nan if len(calls) > 2 else 0.0}  # fine on the two probe calls

    register_reward("late_nan", late_nan)
    task = task_with(tok, "late_nan")
    prompt = task.eval_prompts(1)[0]
    want = re.escape(f"on prompt '{prompt.text}' returned r=nan")
    with pytest.raises(RewardFunctionError, match=want):
        task.reward(prompt, "x")


def test_checks_of_results_and_calls():
    assert check_result({"a": 1, "b": 0.5}, None, "f") == {"a": 1.0, "b": 0.5}
    import numpy as np

    assert check_result({"a": np.float32(0.25)}, ("a",), "f") == {"a": 0.25}
    for bad in (None, {}, [("a", 1.0)], {"": 1.0}, {"a": None}, {"a": math.inf}):
        with pytest.raises(RewardFunctionError):
            check_result(bad, None, "f")
    assert call_with_time_limit(lambda x: x + 1, (1,), 1.0, "f") == 2
    with pytest.raises(ValueError, match="timeout_s"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="environment scores its own episodes"):
        RunConfig(task="env:guess_number", reward="m:f").validate()
