"""Reward functions a user might write, for tests/rl/test_byo_rewards.py."""
import math
import time


def exact_digits(prompt, response, entry):
    """1.0 when the response's digits are the answer's, and a length penalty."""
    digits = "".join(c for c in response if c.isdigit())
    return {"digits": float(digits == entry["answer"]), "short": -len(response) / 100.0}


def raises(prompt, response, entry):
    raise KeyError("no such column")


def hangs(prompt, response, entry):
    time.sleep(30)
    return {"r": 1.0}


def nan_on_answer(prompt, response, entry):
    return {"r": math.nan if entry["answer"] in response else 0.0}


def returns_text(prompt, response, entry):
    return {"r": "1.0"}


def returns_bool(prompt, response, entry):
    return {"r": True}


def changes_names(prompt, response, entry):
    return {"a": 0.0} if not response else {"b": 1.0}
