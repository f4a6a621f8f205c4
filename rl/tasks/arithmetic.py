"""Templated arithmetic word problems for a real chat model (SmolLM2), with a verifier.

Problems are generated from a handful of templates with numbers, names and items drawn
from a seeded RNG, so every prompt is a deterministic function of (seed, split, index).
The answer parser takes the last \\boxed{...} in the response, else the last number.
Two named rewards, so GDPO has something to decouple:
  * "correct": 1 if the parsed answer equals the true one, else 0;
  * "format":  1 if the response states its answer as \\boxed{<number>}, else 0.
Problem generation, parsing and text rewards need no tokenizer; prompt ids do.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np

from rl.tasks.base import Prompt, check_count, in_eval_split

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "coins")
INSTRUCTION = "Give the final answer as \\boxed{number}."

# (template, how the answer follows from the numbers a, b, c)
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?", "a+b"),
    ("{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?", "a-b"),
    ("There are {a} boxes with {b} {item} in each box. How many {item} are there in total?", "a*b"),
    ("{name} buys {a} bags of {item}. Each bag has {b} {item}. {name} eats {c} of them. "
     "How many {item} are left?", "a*b-c"),
    ("{name} had {a} {item}, found {b} more and then lost {c}. How many {item} does {name} have?", "a+b-c"),
)

_RULES = {
    "a+b": lambda a, b, c: a + b,
    "a-b": lambda a, b, c: a - b,
    "a*b": lambda a, b, c: a * b,
    "a*b-c": lambda a, b, c: a * b - c,
    "a+b-c": lambda a, b, c: a + b - c,
}
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_BOXED = re.compile(r"\\boxed\{\s*([^{}]*)\}")


@dataclasses.dataclass(frozen=True)
class Problem:
    """A word problem: question text and its integer answer."""

    question: str
    answer: int
    key: bytes  # identity for the train/eval split


def _to_number(s: str) -> float | None:
    m = re.fullmatch(r"\s*\$?\s*(" + _NUMBER + r")\s*\$?\s*\.?\s*", s)
    if not m:
        return None
    try:
        return float(m.group(1).replace(",", ""))
    except ValueError:
        return None


def parse_answer(text: str) -> tuple[float | None, bool]:
    """(answer, boxed): the number in the last \\boxed{...} whose content is a number
    (boxed=True), else the last number anywhere in the text (boxed=False), else None."""
    for content in reversed(_BOXED.findall(text)):
        value = _to_number(content)
        if value is not None:
            return value, True
    numbers = re.findall(_NUMBER, text)
    for raw in reversed(numbers):
        try:
            return float(raw.replace(",", "")), False
        except ValueError:
            continue
    return None, False


def arithmetic_rewards(text: str, answer: int) -> dict[str, float]:
    """{"correct", "format"} for a response text (see the module docstring)."""
    value, boxed = parse_answer(text)
    correct = value is not None and abs(value - answer) < 1e-6
    return {"correct": float(correct), "format": float(boxed)}


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """tokenizer: models.tokenizer.Tokenizer (needed for prompt ids and for scoring token
    ids); max_operand: numbers are drawn in [2, max_operand]; chat: wrap the question in
    the tokenizer's chat template; seed / eval_fraction: the split."""

    tokenizer: Any = None
    seed: int = 0
    max_operand: int = 20
    eval_fraction: float = 0.1
    chat: bool = True
    max_prompt_len: int = 128
    max_new_tokens: int = 64
    name: str = "arithmetic"

    def __post_init__(self):
        check_count("ArithmeticTask.max_operand", self.max_operand, 3)
        check_count("ArithmeticTask.max_prompt_len", self.max_prompt_len, 1)
        check_count("ArithmeticTask.max_new_tokens", self.max_new_tokens, 1)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"ArithmeticTask.eval_fraction must be in (0, 1), got {self.eval_fraction}")

    @property
    def reward_names(self) -> tuple[str, ...]:
        return ("correct", "format")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self._tok().eos_token_ids)

    # ------------------------------------------------------------------ problems
    def _draw(self, rng: np.random.Generator) -> Problem:
        t = int(rng.integers(len(TEMPLATES)))
        template, rule = TEMPLATES[t]
        a, b, c = (int(x) for x in rng.integers(2, self.max_operand + 1, 3))
        if rule == "a-b" and b > a:
            a, b = b, a
        if rule == "a*b-c":
            c = int(rng.integers(1, a * b + 1))
        if rule == "a+b-c":
            c = int(rng.integers(1, a + b + 1))
        name = NAMES[int(rng.integers(len(NAMES)))]
        item = ITEMS[int(rng.integers(len(ITEMS)))]
        if "c" not in rule:
            c = 0  # unused: keep it out of the problem's identity
        answer = _RULES[rule](a, b, c)
        text = template.format(name=name, item=item, a=a, b=b, c=c)
        key = f"{t}|{a}|{b}|{c}".encode()  # the arithmetic, not the names, decides the split
        return Problem(question=text, answer=answer, key=key)

    def problems(self, split: str, start: int, count: int) -> list[Problem]:
        """Problems start .. start + count - 1 of the "train" or "eval" stream. Position i
        draws from rng([seed, split, i]) until the problem falls in that split."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        check_count("start", start)
        check_count("count", count)
        want_eval = split == "eval"
        out = []
        for i in range(start, start + count):
            rng = np.random.default_rng([self.seed, int(want_eval), i])
            while True:
                p = self._draw(rng)
                if in_eval_split(p.key, self.seed, self.eval_fraction) == want_eval:
                    break
            out.append(p)
        return out

    # ------------------------------------------------------------------ prompts
    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("ArithmeticTask needs a tokenizer for token ids; pass "
                             "tokenizer=models.assets.load_model(...)[2]")
        return self.tokenizer

    def prompt_text(self, problem: Problem) -> str:
        content = f"{problem.question} {INSTRUCTION}"
        if not self.chat:
            return content
        return self._tok().apply_chat_template([{"role": "user", "content": content}])

    def _prompt(self, problem: Problem, index: int) -> Prompt:
        text = self.prompt_text(problem)
        ids = tuple(self._tok().encode(text))
        if len(ids) > self.max_prompt_len:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prompt_len={self.max_prompt_len}; "
                             "raise ArithmeticTask.max_prompt_len")
        return Prompt(ids=ids, answer=problem.answer, text=problem.question, index=index)

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        return [self._prompt(p, start + k) for k, p in enumerate(self.problems("train", start, count))]

    def eval_prompts(self, count: int) -> list[Prompt]:
        return [self._prompt(p, k) for k, p in enumerate(self.problems("eval", 0, count))]

    # ------------------------------------------------------------------ verifier
    def reward(self, prompt: Prompt, response: Sequence[int] | str) -> dict[str, float]:
        """Rewards of a response given as text, or as token ids (decoded, special tokens
        dropped)."""
        text = response if isinstance(response, str) else self._tok().decode(list(response))
        return arithmetic_rewards(text, int(prompt.answer))

    def describe(self, prompt: Prompt, response: Sequence[int]) -> str:
        return f"{prompt.text} -> {self._tok().decode(list(response))!r} (want {prompt.answer})"
