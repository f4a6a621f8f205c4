"""Task tests: deterministic, disjoint train/eval splits; synthetic targets and partial
credit against hand-written references; the random-policy baseline by Monte Carlo;
the arithmetic answer parser, rewards and answers recomputed from the question text."""
import re

import numpy as np
import pytest

from rl.tasks import Prompt, SyntheticTask, Task, make_task
from rl.tasks.arithmetic import ArithmeticTask, arithmetic_rewards, parse_answer
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


@pytest.mark.parametrize("text, value, boxed", [
    ("so the total is \\boxed{42}.", 42.0, True),
    ("first \\boxed{3}, no wait \\boxed{ 1,204 }", 1204.0, True),
    ("\\boxed{x+1} hmm, it is 17 apples", 17.0, False),
    ("She has -3.5 then 12", 12.0, False),
    ("\\boxed{$7$}", 7.0, True),
    ("no digits here", None, False),
])
def test_parse_answer(text, value, boxed):
    assert parse_answer(text) == (value, boxed)


def test_arithmetic_rewards_are_two_named_rewards():
    assert arithmetic_rewards("3 + 4 = 7 so \\boxed{7}", 7) == {"correct": 1.0, "format": 1.0}
    assert arithmetic_rewards("the answer is 7", 7) == {"correct": 1.0, "format": 0.0}
    assert arithmetic_rewards("\\boxed{8}", 7) == {"correct": 0.0, "format": 1.0}
    assert arithmetic_rewards("", 7) == {"correct": 0.0, "format": 0.0}


def _answer_from_question(q: str) -> int:
    """Independent reference: the numbers in the question and the template's wording."""
    n = [int(x) for x in re.findall(r"\d+", q)]
    if "gets" in q:
        return n[0] + n[1]
    if "gives" in q:
        return n[0] - n[1]
    if "boxes" in q:
        return n[0] * n[1]
    if "bags" in q:
        return n[0] * n[1] - n[2]
    return n[0] + n[1] - n[2]


class _FakeTokenizer:
    """Characters <-> ids, enough to check prompt assembly and id-based scoring."""
    eos_token_ids = (2,)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 2)

    def apply_chat_template(self, messages):
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_arithmetic_problems_and_splits():
    task = ArithmeticTask(seed=1, max_operand=12, max_prompt_len=400)
    train = task.problems("train", 0, 400)
    evals = task.problems("eval", 0, 40)
    assert [p.question for p in train[50:60]] == [p.question for p in task.problems("train", 50, 10)]
    assert not {p.key for p in train} & {p.key for p in evals}
    for p in train + evals:
        assert p.answer == _answer_from_question(p.question), p.question
        assert p.answer >= 0
    assert len({p.key.split(b"|")[0] for p in train}) == 5  # every template shows up
    with pytest.raises(ValueError, match="tokenizer"):
        task.train_prompts(0, 1)
    tok_task = ArithmeticTask(tokenizer=_FakeTokenizer(), seed=1, max_operand=12, max_prompt_len=400)
    prompt = tok_task.train_prompts(7, 1)[0]
    text = _FakeTokenizer().decode(list(prompt.ids))
    assert text.startswith("<user>") and train[7].question in text and "\\boxed{number}" in text
    assert prompt.answer == train[7].answer and tok_task.stop_ids == (2,)
    ids = _FakeTokenizer().encode(f"It is \\boxed{{{prompt.answer}}}")
    assert tok_task.reward(prompt, ids) == {"correct": 1.0, "format": 1.0}
    with pytest.raises(ValueError, match="max_prompt_len"):
        ArithmeticTask(tokenizer=_FakeTokenizer(), max_prompt_len=20).train_prompts(0, 1)
