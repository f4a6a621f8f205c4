"""reasoning-gym tasks: rewards on hand-written right / wrong / malformed answers, the
answer extraction, mixture proportions against their weights (binomial bounds), split
disjointness, options passed through, and the clear errors (unknown name with close
names, weight <= 0, a prompt longer than max_prompt_len, options that do not exist)."""
import re

import numpy as np
import pytest

from rl.tasks import Task, make_task
from rl.tasks.reasoning_gym import ReasoningGymTask, extract_answer, parse_mixture


class _CharTokenizer:
    """Characters <-> ids, with a visible chat wrapper: enough to check prompt assembly
    and id-based scoring without a model file."""

    eos_token_ids = (2,)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 2)

    def apply_chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def _chain_sum(**kw):
    return make_task("reasoning_gym:chain_sum", tokenizer=_CharTokenizer(), min_terms=2,
                     max_terms=2, max_digits=2, max_prompt_len=400, **kw)


def _terms(question: str) -> int:
    """The chain_sum answer recomputed from the question text (independent reference)."""
    expr = re.search(r"problem: (.*) =", question).group(1)
    total, sign = 0, 1
    for tok in expr.split():
        if tok in "+-":
            sign = 1 if tok == "+" else -1
        else:
            total += sign * int(tok)
    return total


def test_rewards_on_hand_written_answers():
    task = _chain_sum(verifier="dataset")
    assert isinstance(task, Task) and task.reward_names == ("correct", "format")
    assert task.logged_rewards == ()
    prompt = task.eval_prompts(1)[0]
    want = _terms(prompt.text)
    assert str(want) == prompt.answer["answer"]
    cases = {  # response -> (correct, format)
        f"{prompt.text.split(': ')[1]} {want}, so \\boxed{{{want}}}": (1.0, 1.0),
        f"\\boxed{{{want}}}.": (1.0, 1.0),
        f"The answer is {want}.": (1.0, 0.0),               # right, but not the documented form
        f"\\boxed{{{want + 1}}}": (0.0, 1.0),                # well-formed, wrong
        f"\\boxed{{3}} + \\boxed{{4}} = \\boxed{{{want}}}": (1.0, 0.0),  # boxing everything
        f"\\boxed{{{want}}} is what I think, or maybe 12": (1.0, 0.0),   # box not at the end
        f"\\boxed{{{want}": (1.0, 0.0),  # cut off inside the box: the number still counts
        "": (0.0, 0.0),
        "I do not know.": (0.0, 0.0),
    }
    for text, (correct, fmt) in cases.items():
        assert task.reward(prompt, text) == {"correct": correct, "format": fmt}, text
    ids = _CharTokenizer().encode(f"so \\boxed{{{want}}}")  # scoring from token ids
    assert task.reward(prompt, ids) == {"correct": 1.0, "format": 1.0}
    # the default, "strict": the same verdicts on these (each is full credit or none), and
    # the dataset's own score logged beside them as "dataset"
    strict = _chain_sum()
    assert strict.verifier == "strict" and strict.reward_names == ("correct", "format", "dataset")
    assert strict.logged_rewards == ("dataset",)
    for text, (correct, fmt) in cases.items():
        assert strict.reward(prompt, text) == {"correct": correct, "format": fmt,
                                               "dataset": correct}, text


def test_strict_verifier_gives_no_partial_credit():
    """The leak of issue 36: reasoning-gym's default scorer gives len(ref) / len(answer) to an
    answer that merely contains the reference ("82 + 16 = 198" scored 0.667 for 98)."""
    strict, by_dataset = _chain_sum(), _chain_sum(verifier="dataset")
    prompt = strict.eval_prompts(1)[0]
    ref = prompt.answer["answer"]
    padded = f"\\boxed{{1{ref}}}"  # a wrong answer that contains the reference
    partial = len(ref) / (len(ref) + 1)
    assert by_dataset.reward(prompt, padded)["correct"] == pytest.approx(partial)
    assert strict.reward(prompt, padded) == {"correct": 0.0, "format": 1.0,
                                             "dataset": pytest.approx(partial)}
    exact = _chain_sum(verifier="exact")  # the named verifiers apply too
    assert exact.reward(prompt, f"\\boxed{{{ref}}}")["correct"] == 1.0
    assert exact.reward(prompt, padded)["correct"] == 0.0


def test_answer_extraction():
    assert extract_answer("x \\boxed{1} then \\boxed{\\frac{1}{2}}", "0.5") == "\\frac{1}{2}"
    assert extract_answer("3 + 4 = 7, and 7 - 1 = 6.", "6") == "6"
    assert extract_answer("1,234 apples", "1234") == "1234"
    assert extract_answer("no number here", "5") is None
    assert extract_answer("Let me think.\nThe answer is: laaB.", "laaB") == "laaB"
    assert extract_answer("thinking\nwuad", "wuad") == "wuad"
    assert extract_answer("  \n ", "word") is None


def test_answers_match_the_questions_and_options_pass_through():
    task = _chain_sum()
    for p in task.train_prompts(0, 60) + task.eval_prompts(40):
        assert int(p.answer["answer"]) == _terms(p.text), p.text
        assert len(re.findall(r"\d+", p.text.split(": ")[1])) == 2  # min_terms=max_terms=2
        assert all(len(n) <= 2 for n in re.findall(r"\d+", p.text))  # max_digits=2
    text = _CharTokenizer().decode(list(task.train_prompts(3, 1)[0].ids))
    assert text.startswith("<user>") and text.endswith("</user><assistant>")
    assert "\\boxed{ANSWER}" in text


def test_splits_are_disjoint_deterministic_and_seeded():
    task = _chain_sum()
    train = task.entries("train", 0, 1500)
    evals = task.entries("eval", 0, 300)
    assert not {e["question"] for e in train} & {e["question"] for e in evals}
    assert [e["question"] for e in train[700:720]] == [
        e["question"] for e in task.entries("train", 700, 20)]  # resumable from a position
    other = _chain_sum(seed=1).entries("train", 0, 50)
    assert [e["question"] for e in other] != [e["question"] for e in train[:50]]
    assert len({e["question"] for e in evals}) > 250  # 256 held-out problems are distinct


def test_mixture_follows_its_weights():
    task = ReasoningGymTask("chain_sum=1,leg_counting=3", tokenizer=_CharTokenizer(),
                            max_prompt_len=2000)
    n = 2000
    names = [e["metadata"]["source_dataset"] for e in task.entries("train", 0, n)]
    share = names.count("leg_counting") / n
    sigma = np.sqrt(0.75 * 0.25 / n)
    assert abs(share - 0.75) < 4 * sigma, share
    assert set(names) == {"chain_sum", "leg_counting"}
    entry = next(e for e in task.entries("eval", 0, 20)
                 if e["metadata"]["source_dataset"] == "leg_counting")
    prompt = next(p for p in task.eval_prompts(20) if p.answer is not None
                  and p.answer["question"] == entry["question"])
    assert task.reward(prompt, f"\\boxed{{{entry['answer']}}}")["correct"] == 1.0
    assert task.name == "reasoning_gym:chain_sum=1,leg_counting=3"


def test_mixture_options_are_per_dataset():
    task = make_task("reasoning_gym:chain_sum=1,basic_arithmetic=1", tokenizer=_CharTokenizer(),
                     max_prompt_len=400, **{"chain_sum.max_terms": 2, "chain_sum.min_terms": 2})
    chains = [e for e in task.entries("train", 0, 80)
              if e["metadata"]["source_dataset"] == "chain_sum"]
    assert chains and all(e["metadata"]["num_terms"] == 2 for e in chains)
    with pytest.raises(ValueError, match="ambiguous"):
        make_task("reasoning_gym:chain_sum=1,basic_arithmetic=1", max_terms=2)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset 'chain_summ'.*chain_sum"):
        make_task("reasoning_gym:chain_summ")
    with pytest.raises(ValueError, match="must be > 0"):
        make_task("reasoning_gym:chain_sum=1,leg_counting=0")
    with pytest.raises(ValueError, match="must be > 0"):
        parse_mixture("chain_sum=-1") and ReasoningGymTask("chain_sum=-1")
    with pytest.raises(ValueError, match="not a number"):
        parse_mixture("chain_sum=x")
    with pytest.raises(ValueError, match="needs datasets"):
        make_task("reasoning_gym")
    with pytest.raises(ValueError, match="rejected options"):
        make_task("reasoning_gym:chain_sum", no_such_option=3)
    task = make_task("reasoning_gym:leg_counting", tokenizer=_CharTokenizer(), max_prompt_len=40)
    with pytest.raises(ValueError, match="max_prompt_len=40"):
        task.train_prompts(0, 1)
    with pytest.raises(ValueError, match="tokenizer"):
        make_task("reasoning_gym:chain_sum").train_prompts(0, 1)


def test_prompt_plus_budget_beyond_the_context_is_a_clear_error():
    from types import SimpleNamespace

    from rl.run import check_context

    task = _chain_sum()
    check_context(SimpleNamespace(max_position_embeddings=1024), task)  # 400 + 128 fits
    with pytest.raises(ValueError, match=r"= 528, more than the model's context \(512\)"):
        check_context(SimpleNamespace(max_position_embeddings=512), task)


def test_math_verifier_accepts_equal_forms_the_dataset_rejects():
    opts = {"tokenizer": _CharTokenizer(), "max_prompt_len": 400}
    by_dataset = make_task("reasoning_gym:fraction_simplification", verifier="dataset", **opts)
    by_math = make_task("reasoning_gym:fraction_simplification", verifier="math", **opts)
    prompt = by_math.eval_prompts(1)[0]
    num, den = (int(x) for x in re.findall(r"\d+", prompt.answer["answer"]))  # LaTeX ref
    decimal = f"so \\boxed{{{num / den!r}}}"
    assert by_dataset.reward(prompt, decimal)["correct"] < 0.1  # its scorer wants a fraction
    assert by_math.reward(prompt, decimal) == {"correct": 1.0, "format": 1.0,
                                               "dataset": by_dataset.reward(prompt, decimal)[
                                                   "correct"]}
    # equality, not form: math-verify also takes the unreduced fraction, which this
    # dataset (reduce to lowest terms) rightly refuses, so "math" suits answer-is-a-value sets
    unreduced = f"\\boxed{{\\frac{{{2 * num}}}{{{2 * den}}}}}"
    assert by_math.reward(prompt, unreduced)["correct"] == 1.0
    assert by_dataset.reward(prompt, unreduced)["correct"] < 0.1
    assert by_math.reward(prompt, f"\\boxed{{{num}/{den + 1}}}")["correct"] == 0.0
    with pytest.raises(ValueError, match="verifier"):
        make_task("reasoning_gym:chain_sum", verifier="sympy")
