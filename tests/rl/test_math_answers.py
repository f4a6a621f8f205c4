"""rl.tasks.math_answers against hand-written references: math-verify equivalences that must
hold and ones that must not, final-\\boxed extraction (nested braces, several boxes), the
format rule, and the timeout (pathological answers give False within timeout + 3 s from
the main thread and from a worker thread, and the next check works again)."""
import threading
import time

import pytest

from rl.tasks import math_answers as ma
from rl.tasks.math_answers import (
    extract_final_boxed,
    has_final_boxed_format,
    math_answer_rewards,
    math_equal,
)

EQUAL = [  # (prediction, reference): equal per math-verify
    ("0.5", "1/2"), ("\\frac{1}{2}", "0.5"), ("\\dfrac12", "1/2"), ("1/2", "\\frac{1}{2}"),
    ("3.0", "3"), ("\u22122", "-2"), ("\\sqrt{4}", "2"), ("1+x", "x+1"), ("1+2x", "2x+1"),
    ("50\\%", "0.5"), ("1,000", "1000"), ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"),
    ("(x-1)(x+1)", "x^2-1"), ("\\{2, 1\\}", "\\{1, 2\\}"), ("[1, 2)", "[1,2)"),
    ("(2,3)\\cup(0,1)", "(0,1)\\cup(2,3)"), ("x = 3", "3"), ("$\\frac12$", "0.5"),
]
NOT_EQUAL = [
    ("0.33", "1/3"), ("2", "3"), ("42", "41"), ("(1,2)", "[1,2)"), ("x+2", "x+1"),
    ("\\sqrt{2}", "1.41"), ("-2", "2"), ("", "3"), ("3", ""), ("x", "y"),
]
PATHOLOGICAL = ["10^{10^{10}}", "9^9^9^9^9", "10**10**10", "(10^{10})!", "9^{9^{9^{9}}}"]


@pytest.mark.parametrize("prediction,reference", EQUAL)
def test_equivalences_hold(prediction, reference):
    assert math_equal(prediction, reference)


@pytest.mark.parametrize("prediction,reference", NOT_EQUAL)
def test_non_equivalences(prediction, reference):
    assert not math_equal(prediction, reference)


def test_extract_final_boxed():
    assert extract_final_boxed("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_final_boxed("\\boxed{1} then \\boxed{2} and \\boxed{3}") == "3"
    assert extract_final_boxed("$\\boxed{\\left\\{1, \\frac{2}{3}\\right\\}}$") == (
        "\\left\\{1, \\frac{2}{3}\\right\\}")
    assert extract_final_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"  # escaped braces
    assert extract_final_boxed("\\boxed{a_{b_{c}} + {d}}") == "a_{b_{c}} + {d}"
    assert extract_final_boxed("\\fbox{7} is it") == "7"
    assert extract_final_boxed("\\boxed {5}") == "5"
    assert extract_final_boxed("\\boxed{}") == ""
    assert extract_final_boxed("the answer is 5") is None
    assert extract_final_boxed("\\boxed{4} then \\boxed{\\frac{1}{2}") is None  # unclosed last


def test_format_rule():
    assert has_final_boxed_format("So the answer is \\boxed{5}.")
    assert has_final_boxed_format("2 + 3 = 5, hence $\\boxed{5}$ \n")
    assert has_final_boxed_format("\\[ \\boxed{\\frac{1}{2}} \\]")
    assert not has_final_boxed_format("\\boxed{2} + \\boxed{3} = \\boxed{5}")  # boxed everything
    assert not has_final_boxed_format("\\boxed{5} because 2 + 3 = 5.")  # more text after
    assert not has_final_boxed_format("the answer is 5")
    assert not has_final_boxed_format("\\boxed{5")  # never closed


def test_rewards():
    assert math_answer_rewards("2+3 = \\boxed{5}.", "5") == {"correct": 1.0, "format": 1.0}
    assert math_answer_rewards("\\boxed{0.5}", "\\frac{1}{2}") == {"correct": 1.0, "format": 1.0}
    assert math_answer_rewards("2+3 = \\boxed{6}.", "5") == {"correct": 0.0, "format": 1.0}
    # correct reads the LAST boxed answer, whatever the format
    assert math_answer_rewards("\\boxed{5} because 2+3", "5") == {"correct": 1.0, "format": 0.0}
    assert math_answer_rewards("\\boxed{2}+\\boxed{3}=\\boxed{5}", "5") == {
        "correct": 1.0, "format": 0.0}
    assert math_answer_rewards("\\boxed{5} no wait \\boxed{6}", "5") == {
        "correct": 0.0, "format": 0.0}
    assert math_answer_rewards("it is 5", "5") == {"correct": 0.0, "format": 0.0}


def _timed(prediction, timeout_s):
    start = time.perf_counter()
    result = math_equal(prediction, "3", timeout_s=timeout_s)
    return result, time.perf_counter() - start


def test_timeout_main_thread_and_worker_thread():
    timeout_s = 1.0
    ma.start_worker()  # its start is not part of the timeout
    pid = ma._WORKER.proc.pid
    result, elapsed = _timed(PATHOLOGICAL[0], timeout_s)
    assert result is False and elapsed < timeout_s + 3.0
    assert ma._WORKER.proc.pid != pid  # it really timed out: the worker was replaced

    for prediction in PATHOLOGICAL[1:]:
        ma.start_worker()
        result, elapsed = _timed(prediction, timeout_s)
        assert result is False and elapsed < timeout_s + 3.0, prediction

    ma.start_worker()
    out = {}

    def in_thread():
        try:
            out["main"] = _timed(PATHOLOGICAL[0], timeout_s)
            out["normal"] = math_equal("\\dfrac{1}{2}", "0.5")
        except BaseException as e:  # noqa: BLE001  (report it to the test, not the thread)
            out["error"] = e

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and "error" not in out
    result, elapsed = out["main"]
    assert result is False and elapsed < timeout_s + 3.0
    assert out["normal"] is True  # the restarted worker answers again
    assert math_equal("x+1", "1+x") and not math_equal("2", "3")
