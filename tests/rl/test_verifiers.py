"""Named verifiers and answer parsers (rl.tasks.verifiers) on hand-written answers whose
verdicts are known: equal forms accepted, near misses and partial matches refused, the
GSM8K "####" and \\boxed{} reference parsers, and the clear errors."""
import pytest

from rl.tasks.verifiers import (
    VERIFIERS,
    extract_answer,
    normalize_answer,
    parse_number,
    parse_reference,
    verify,
)


def test_exact_forgives_only_presentation():
    accept = [("Paris", "paris"), ("$42$", "42"), ("42.", "42"), ("\\text{Paris}", "Paris"),
              ("1,000", "1000"), ("  new   york ", "New York"), ("$\\text{yes}$.", "yes")]
    refuse = [("198", "98"), ("42.0", "42"), ("Paris, France", "Paris"), ("1,00", "100"),
              ("", "0")]
    for pred, ref in accept:
        assert verify("exact", pred, ref) == 1.0, (pred, ref)
    for pred, ref in refuse:
        assert verify("exact", pred, ref) == 0.0, (pred, ref)
    assert normalize_answer(" $\\text{Foo  Bar}$. ") == "foo bar"


def test_numeric_parses_numbers_and_uses_a_relative_tolerance():
    assert parse_number("1,234.5") == 1234.5
    assert parse_number("\\frac{3}{4}") == 0.75 and parse_number("-\\dfrac{1}{8}") == -0.125
    assert parse_number("3/8") == 0.375 and parse_number("25%") == 0.25
    assert parse_number("1e-3") == 0.001 and parse_number("$7$.") == 7.0
    for bad in ("seven", "1/0", "\\frac{1}{0}", "2x", "", "inf", "nan"):
        assert parse_number(bad) is None, bad
    assert verify("numeric", "0.75", "\\frac{3}{4}") == 1.0
    assert verify("numeric", "42.0", "42") == 1.0
    assert verify("numeric", "198", "98") == 0.0
    # tolerance is relative to max(1, |reference|): 1e-6 of 1e6 is 1
    assert verify("numeric", "1000000.5", "1000000") == 1.0
    assert verify("numeric", "1000002", "1000000") == 0.0
    assert verify("numeric", "0.1004", "0.1", tolerance=1e-3) == 1.0
    assert verify("numeric", "0.102", "0.1", tolerance=1e-3) == 0.0
    assert verify("numeric", "abc", "1") == 0.0


def test_math_verifier_is_math_verify_equality():
    assert verify("math", "\\frac{1}{2}", "0.5") == 1.0
    assert verify("math", "1+2x", "2x+1") == 1.0
    assert verify("math", "\\frac{1}{3}", "0.5") == 0.0


def test_regex_reference_must_match_the_whole_answer():
    assert verify("regex", "Paris", "(?i)paris( france)?") == 1.0
    assert verify("regex", "paris france", "(?i)paris( france)?") == 1.0
    assert verify("regex", "Paris, Texas", "(?i)paris( france)?") == 0.0
    with pytest.raises(ValueError, match="not a valid regular expression"):
        verify("regex", "x", "([unclosed")


def test_no_answer_scores_zero_and_unknown_names_are_refused():
    for name in VERIFIERS:
        assert verify(name, None, "1") == 0.0
    with pytest.raises(ValueError, match=r"unknown verifier 'fuzzy'.*exact"):
        verify("fuzzy", "1", "1")


def test_reference_parsers():
    gsm = "She buys 3 + 4 = 7 apples.\n#### 7"
    assert parse_reference(gsm, "gsm8k") == "7" == parse_reference(gsm)
    assert parse_reference("25 * 40 = 1000\n#### 1,000") == "1000"
    assert parse_reference("no marker", "gsm8k") is None
    math = "So $x = \\boxed{\\frac{3}{4}}$, not \\boxed{1}? No: \\boxed{\\frac{3}{4}}."
    assert parse_reference(math, "boxed") == "\\frac{3}{4}" == parse_reference(math)
    assert parse_reference("\\boxed{}", "boxed") is None
    assert parse_reference("\\boxed{12", "boxed") is None  # never closed
    assert parse_reference("  42 ", "plain") == "42" == parse_reference("  42 ")
    assert parse_reference("", "plain") is None
    # auto: "####" wins over a box, a box over plain text
    assert parse_reference("\\boxed{3}\n#### 4") == "4"
    with pytest.raises(ValueError, match="answer_format"):
        parse_reference("1", "latex")


def test_response_extraction():
    assert extract_answer("so \\boxed{12} and then \\boxed{\\frac{1}{2}}", "0.5") == "\\frac{1}{2}"
    assert extract_answer("3 + 4 = 7, minus 1 is 6.", "6") == "6"
    assert extract_answer("The answer is: Paris.", "Paris") == "Paris"
    assert extract_answer("", "5") is None


# response, reference, the answer it states (None: it states none), its verdict
ADVERSARIAL = [
    ("The answer is 86, not 85", "85", "86", 0.0),  # the last number is not the answer
    ("The answer is 85. Check: 80 + 5 = 85", "85", "85", 1.0),
    ("The answer is 85. Check: 85 = 80 + 5", "85", "85", 1.0),  # a number after the answer
    ("I first thought 85, but the answer is 86.", "85", "86", 0.0),  # a restated wrong one
    ("85. Wait, no: 86", "85", "86", 0.0),
    ("It could be 84 or 85", "85", None, 0.0),  # a hedge states no answer
    ("The answer is 84 or 85.", "85", None, 0.0),
    ("The answer is 85 or 84.", "85", None, 0.0),
    ("We get 7. So 3 or 4 were eaten, and 7 remain.", "7", "7", 1.0),  # "or" elsewhere
    ("so it is \\frac{170}{2}", "85", "\\frac{170}{2}", 1.0),  # LaTeX whole, not its "2"
    ("Final answer: 1,234 apples", "1234", "1234", 1.0),
    ("That is 85% of them", "85", "85", 1.0),  # percent: the number as written
    ("That is 85% of them", "85%", "85%", 1.0),
    ("answer: 12 dollars", "12", "12", 1.0),  # units
    ("#### 72", "72", "72", 1.0),
    ("The result is -3.", "-3", "-3", 1.0),
]


@pytest.mark.parametrize("text, reference, stated, verdict", ADVERSARIAL)
def test_extraction_reads_what_the_response_states(text, reference, stated, verdict):
    assert extract_answer(text, reference) == stated
    assert verify("numeric", extract_answer(text, reference), reference) == verdict
    assert verify("math", extract_answer(text, reference), reference) == verdict


def test_the_committed_smollm2_examples_score_as_recorded():
    """Re-check of the committed real-model evals under today's extraction: every example
    completion of the smollm2-rg base and final evals keeps the rewards it was recorded with
    (their responses state one number; none of them games the older rule)."""
    import json
    from pathlib import Path

    from rl.tasks import make_task

    root = Path(__file__).resolve().parents[2] / "experiments" / "results"
    for name in ("smollm2_rg_eval_base.json", "smollm2_rg_eval_s0_final.json"):
        d = json.loads((root / name).read_text())
        options = {k: v for k, v in d["task_options"].items()
                   if k in ("max_digits", "max_terms", "min_terms")}
        task = make_task("reasoning_gym:chain_sum", seed=0, verifier="dataset", **options)
        assert len(d["examples"]) == 32
        for e in d["examples"]:
            assert task.rewards_of_text(e["response"], e["answer"]) == pytest.approx(e["rewards"])
