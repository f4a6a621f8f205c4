"""Named verifiers (is a model's answer the reference answer?) and the parsers that read an
answer out of a data file's answer column or out of a response.

Verifiers, by name (`VERIFIERS`; `verify(name, prediction, reference, ...)` -> 0.0 / 1.0):

  exact    equal after `normalize_answer`: surrounding whitespace, `$`, a final `.`, a
           `\\text{..}` wrapper and case dropped, inner whitespace collapsed, thousands
           separators dropped from a number ("1,000" = "1000"); nothing else is forgiven
  numeric  both parse as numbers (`parse_number`: integers, decimals, scientific notation,
           fractions a/b, \\frac{a}{b}, a trailing %, thousands separators) and
           |prediction - reference| <= tolerance * max(1, |reference|)
  math     math-verify equality (rl.tasks.math_answers.math_equal: 1/2 = 0.5 = \\frac12,
           2x+1 = 1+2x), with its time limit
  regex    the reference is a Python regular expression the whole normalised prediction
           must match (re.fullmatch), e.g. "(?i)paris( france)?"

All are strict: a wrong answer scores 0, never partial credit. reasoning-gym tasks also
offer "dataset" (the dataset's own score_answer, which gives partial credit) and "strict"
(that score, counted only when it is full credit): rl.tasks.reasoning_gym.

Answer parsers for a reference column (`parse_reference(text, answer_format)`):

  plain    the text as it is (stripped)
  gsm8k    what follows the last "####" (GSM8K's "... reasoning ... #### 72"), commas
           dropped from a number
  boxed    the content of the last \\boxed{...} (MATH-style solutions)
  auto     gsm8k when the text has "####", else boxed when it has a \\boxed{}, else plain

The model's answer in a response: `extract_answer(text, reference)`: the last \\boxed{...};
without one the last number (numeric reference) or the text after the last "answer is" /
"answer:" / "=" on the last line.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction

from rl.tasks.math_answers import extract_final_boxed, math_equal

ANSWER_FORMATS = ("auto", "plain", "gsm8k", "boxed")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_ANSWER_IS = re.compile(r"(?:answer\s*(?:is\s*:?|:)|=)\s*(.+?)\s*$", re.IGNORECASE | re.DOTALL)
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_TEXT_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm)\{(.*)\}$", re.DOTALL)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}$")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")
_GSM8K_MARK = "####"


# ----------------------------------------------------------------------------- responses
def extract_answer(text: str, reference: str) -> str | None:
    """The response's answer: its last \\boxed{...}; else (no box) the last number if
    `reference` is a number, else the text after the last "answer is" / "answer:" /
    "=" on the last non-empty line, else that line; trailing "." and "$" dropped."""
    boxed = extract_final_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if _NUMBER.fullmatch(reference.strip()):
        numbers = _NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    m = _ANSWER_IS.search(lines[-1])
    answer = (m.group(1) if m else lines[-1]).strip().rstrip(".$").strip()
    return answer or None


# ----------------------------------------------------------------------------- references
def parse_gsm8k(text: str) -> str | None:
    """What follows the last "####" (commas dropped from a number), or None without one."""
    head, mark, tail = str(text).rpartition(_GSM8K_MARK)
    if not mark:
        return None
    answer = tail.strip().rstrip(".").strip()
    if _THOUSANDS.match(answer):
        answer = answer.replace(",", "")
    return answer or None


def parse_reference(text: str, answer_format: str = "auto") -> str | None:
    """The reference answer of an answer-column value (module docstring); None when the
    format finds none (no "####" for gsm8k, no closed \\boxed{} for boxed, empty text)."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    text = str(text)
    if answer_format == "auto":
        answer_format = ("gsm8k" if _GSM8K_MARK in text else
                         "boxed" if extract_final_boxed(text) is not None else "plain")
    if answer_format == "gsm8k":
        return parse_gsm8k(text)
    if answer_format == "boxed":
        boxed = extract_final_boxed(text)
        return None if boxed is None or not boxed.strip() else boxed.strip()
    return text.strip() or None


# ----------------------------------------------------------------------------- verifiers
def normalize_answer(text: str) -> str:
    """The form `exact` compares (module docstring)."""
    s = str(text).strip()
    for _ in range(3):  # "$\\text{Paris}$." peels in a few rounds
        before = s
        s = s.strip().strip("$").strip()
        s = s[:-1] if s.endswith(".") else s
        m = _TEXT_WRAPPER.match(s)
        s = m.group(1) if m else s
        if s == before:
            break
    s = " ".join(s.split()).lower()
    return s.replace(",", "") if _THOUSANDS.match(s) else s


def parse_number(text: str) -> float | None:
    """The number `text` spells (module docstring), or None."""
    s = normalize_answer(text).replace(" ", "")
    percent = s.endswith("%") or s.endswith("\\%")
    s = s.removesuffix("\\%").removesuffix("%")
    m = _FRAC.match(s)
    if m:
        num, den = int(m.group(2)), int(m.group(3))
        value = None if den == 0 else float(Fraction(num, den)) * (-1 if m.group(1) else 1)
    elif re.fullmatch(r"[-+]?\d+/\d+", s):
        num, den = s.split("/")
        value = None if int(den) == 0 else float(Fraction(int(num), int(den)))
    elif _PLAIN_NUMBER.match(s):
        value = float(s)
    else:
        return None
    if value is None or not math.isfinite(value):
        return None
    return value / 100.0 if percent else value


def exact_match(prediction: str, reference: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(reference)


def numeric_equal(prediction: str, reference: str, tolerance: float = 1e-6) -> bool:
    p, r = parse_number(prediction), parse_number(reference)
    return p is not None and r is not None and abs(p - r) <= tolerance * max(1.0, abs(r))


def regex_match(prediction: str, reference: str) -> bool:
    """re.fullmatch(reference, normalised prediction); ValueError for a bad pattern."""
    try:
        pattern = re.compile(reference)
    except re.error as err:
        raise ValueError(f"regex verifier: the reference {reference!r} is not a valid "
                         f"regular expression ({err})") from err
    return pattern.fullmatch(" ".join(str(prediction).strip().split())) is not None


VERIFIERS: dict[str, Callable[..., bool]] = {
    "exact": exact_match, "numeric": numeric_equal, "math": math_equal, "regex": regex_match,
}


def check_verifier(name: str, allowed: tuple[str, ...] = tuple(VERIFIERS)) -> str:
    if name not in allowed:
        raise ValueError(f"unknown verifier {name!r}; available: {list(allowed)}")
    return name


def verify(name: str, prediction: str | None, reference: str, *, tolerance: float = 1e-6,
           timeout_s: float = 2.0) -> float:
    """1.0 if verifier `name` accepts `prediction` (None: no answer found) for `reference`,
    else 0.0. tolerance: numeric's; timeout_s: math's."""
    check_verifier(name)
    if prediction is None:
        return 0.0
    if name == "numeric":
        return float(numeric_equal(prediction, reference, tolerance))
    if name == "math":
        return float(math_equal(prediction, reference, timeout_s=timeout_s))
    return float(VERIFIERS[name](prediction, reference))


__all__ = ["ANSWER_FORMATS", "VERIFIERS", "check_verifier", "exact_match", "extract_answer",
           "normalize_answer", "numeric_equal", "parse_gsm8k", "parse_number",
           "parse_reference", "regex_match", "verify"]
