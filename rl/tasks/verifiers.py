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

The model's answer in a response: `extract_answer(text, reference)`: what the response
states as its answer, not a stray number: its last \\boxed{...}; else the first value after
its last explicit answer marker ("answer is", "answer:", "final answer", "####"); else the
last number (numeric reference) or the last line's text after "=". So "The answer is 86,
not 85" answers 86, "The answer is 85. Check: 80 + 5 = 85" answers 85, and a LaTeX
fraction ("\\frac{170}{2}") reaches the math verifier whole. The cases that gamed the
older last-number rule, and how each reads now, are tests/rl/test_verifiers.py's
adversarial table (docs/guides/byo.md#what-counts-as-the-answer).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction

from rl.tasks.math_answers import extract_final_boxed, math_equal

ANSWER_FORMATS = ("auto", "plain", "gsm8k", "boxed")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
# a number (thousands commas, decimals, a/b, a percent sign) or a LaTeX fraction
_VALUE = re.compile(r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?")
# what a response says its answer is; the last one counts
_MARKER = re.compile(r"(?:final\s+answer|answer|the\s+result)\s*(?:is|:|=)\s*:?|####",
                     re.IGNORECASE)
_SENTENCE = re.compile(r"[^\n]*?(?=(?:[.;!?](?:\s|$))|\n|$)")
_EQUALS = re.compile(r"=\s*(.+?)\s*$", re.DOTALL)
_ALTERNATIVE = re.compile(rf"({_VALUE.pattern})\s*,?\s*or\s+({_VALUE.pattern})", re.IGNORECASE)
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_TEXT_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm)\{(.*)\}$", re.DOTALL)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}$")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")
_GSM8K_MARK = "####"


# ----------------------------------------------------------------------------- responses
def extract_answer(text: str, reference: str) -> str | None:
    """The answer the response states, in this order of precedence (module doc):

      1. its last \\boxed{...}, whole (a LaTeX expression goes to the verifier as written);
      2. after its last explicit answer marker ("answer is", "answer:", "final answer",
         "the result is", "####"), the first value: for a numeric reference the first number
         or \\frac{a}{b} after the marker ("The answer is 86, not 85" states 86), else the
         rest of that sentence;
      3. without a marker: the last number or \\frac{a}{b} (numeric reference), else the
         text after the last "=" on the last non-empty line, else that line.

    A trailing "." and "$" are dropped; a number's thousands commas are dropped."""
    boxed = extract_final_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numeric = bool(_NUMBER.fullmatch(reference.strip()))
    percent = reference.strip().endswith("%")
    marks = list(_MARKER.finditer(text))
    if marks:
        stated = _SENTENCE.match(text[marks[-1].end():].strip())
        sentence = stated.group(0) if stated else ""
        if numeric or percent:
            first = _VALUE.search(sentence) or _VALUE.search(text[marks[-1].end():])
            if first:
                return None if hedged(sentence, first) else _clean_number(first.group(0), percent)
        else:
            answer = sentence.strip().rstrip(".$").strip()
            if answer:
                return answer
    if numeric or percent:
        values = list(_VALUE.finditer(text))
        if not values:
            return None
        return None if hedged(text, values[-1]) else _clean_number(values[-1].group(0), percent)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    m = _EQUALS.search(lines[-1])
    answer = (m.group(1) if m else lines[-1]).strip().rstrip(".$").strip()
    return answer or None


def hedged(text: str, value: re.Match) -> bool:
    """Whether the answer `value` (a match in `text`) is one of alternatives offered as
    "84 or 85" (either side), with different values: such a response states no answer."""
    for alt in _ALTERNATIVE.finditer(text):
        a, b = alt.group(1).replace(",", ""), alt.group(2).replace(",", "")
        if a != b and (alt.start(1) == value.start() or alt.start(2) == value.start()):
            return True
    return False


def _clean_number(value: str, percent: bool) -> str:
    """A matched value as the verifiers read it: thousands commas dropped, a final period
    gone (a \\frac kept whole); a percent sign kept only for a reference in percent ("85%"
    answers "85" as the number written)."""
    v = value.strip()
    if v.lstrip("-").startswith("\\"):
        return v
    v = v.replace(",", "").rstrip(".")
    return v if percent else v.rstrip("%")


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
