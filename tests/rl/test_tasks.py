"""Task tests: deterministic, disjoint train/eval splits; synthetic targets and partial
credit against hand-written references; the random-policy baseline by Monte Carlo.
(reasoning-gym tasks: tests/rl/test_reasoning_gym.py.)"""

import numpy as np
import pytest

from rl.tasks import Prompt, SyntheticTask, Task, make_task
from rl.tasks.synthetic import BOS, FIRST_SYMBOL, SEP


def test_synthetic_prompts_targets_and_splits():
    task = SyntheticTask(kind="reverse", length=4, alphabet=4, seed=3)
    assert isinstance(task, Task)
    train = task.train_prompts(0, 300)
    assert [p.ids for p in train[100:110]] == [p.ids for p in task.train_prompts(100, 10)]
    assert [p.ids for p in train] != [p.ids for p in SyntheticTask(seed=4).train_prompts(0, 300)]
    evals = task.eval_prompts(500)
    eval_set = {p.ids for p in evals}
    assert not eval_set & {p.ids for p in train}
    assert 10 <= len(eval_set) <= 64  # about 1/8 of the 256 sequences
    for p in train[:20] + evals[:20]:
        syms = [t - FIRST_SYMBOL for t in p.ids[1:-1]]
        assert p.ids[0] == BOS and p.ids[-1] == SEP and len(syms) == 4
        assert all(0 <= s < 4 for s in syms)
        assert list(p.answer) == syms[::-1]
    copy, shift = SyntheticTask(kind="copy", alphabet=5), SyntheticTask(kind="shift", alphabet=5)
    assert copy.target([0, 4, 2]) == (0, 4, 2) and shift.target([0, 4, 2]) == (1, 0, 3)


def test_synthetic_reward_is_fraction_of_positions():
    task = SyntheticTask(kind="reverse", length=4, alphabet=4)
    p = Prompt(ids=(BOS, 4, 5, 6, 7, SEP), answer=(3, 2, 1, 0))
    assert task.reward(p, [7, 6, 5, 4]) == {"correct": 1.0}
    assert task.reward(p, [7, 0, 5, 2]) == {"correct": 0.5}
    assert task.reward(p, [7]) == {"correct": 0.25}  # missing positions are wrong
    assert task.reward(p, [4, 5, 6, 7, 7, 7]) == {"correct": 0.0}
    with pytest.raises(ValueError, match="token ids"):
        task.reward(p, "7 6 5 4")


def test_synthetic_random_policy_baseline_by_monte_carlo():
    task = SyntheticTask(kind="reverse", length=4, alphabet=4)
    rng = np.random.default_rng(0)
    prompts = task.train_prompts(0, 500)
    total = 0.0
    for p in prompts:
        total += task.reward(p, rng.integers(0, task.vocab_size, 4).tolist())["correct"]
    assert abs(total / len(prompts) - task.random_baseline()) < 0.02
    assert 0.1 <= task.random_baseline() <= 0.25


def test_synthetic_bad_options():
    with pytest.raises(ValueError, match="kind"):
        SyntheticTask(kind="sort")
    with pytest.raises(ValueError, match="alphabet"):
        SyntheticTask(alphabet=1)
    with pytest.raises(ValueError, match="count"):
        SyntheticTask().train_prompts(0, -1)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess")
