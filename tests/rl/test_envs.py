"""rl.envs: the calculator tool against hand arithmetic, its refusals; the guess-number game's
feedback, rewards and exact baselines against brute force; the calculator environment's
chat wrapping against SmolLM2's own chat template (real tokenizer); make_env specs."""
import dataclasses
import itertools
import random
import time
from fractions import Fraction

import numpy as np
import pytest

from rl.envs import (
    CalculatorEnv,
    Environment,
    Episode,
    GuessNumberEnv,
    calculate,
    check_step_result,
    make_env,
    parse_env_spec,
)
from rl.envs.arithmetic import count_operations, evaluate, reduction_steps
from rl.envs.calculator import find_calls, parse_final_answer
from rl.envs.guess_number import (
    consistent_random_expected_score,
    optimal_expected_score,
    random_expected_score,
)

# ----------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expr, want", [
    ("12 * 34 + 5", Fraction(413)),
    ("7 / 2", Fraction(7, 2)),
    ("-(3 - 10) ** 2", Fraction(-49)),
    ("2 ** -3", Fraction(1, 8)),
    ("17 // 5", Fraction(3)),
    ("-17 % 5", Fraction(3)),
    ("1.5 * 4", Fraction(6)),
    ("+(((8)))", Fraction(8)),
    ("12,345 * 2", Fraction(24690)),
    ("3^3", Fraction(27)),
    ("6 × 7 ÷ 3", Fraction(14)),
    ("10 ** 30", Fraction(10 ** 30)),
    ("123456789 * 987654321", Fraction(121932631112635269)),
])
def test_calculator_evaluates_allowed_expressions(expr, want):
    assert evaluate(expr) == want
    shown = calculate(expr)
    assert shown == (str(want.numerator) if want.denominator == 1 else repr(float(want)))


def test_calculator_matches_integer_arithmetic_on_random_trees():
    rng = random.Random(0)

    def tree(depth):  # (text, value) by Python int arithmetic, written here
        if depth == 0 or rng.random() < 0.3:
            v = rng.randint(0, 9999)
            return str(v), v
        (ta, a), (tb, b) = tree(depth - 1), tree(depth - 1)
        op = rng.choice("+-*")
        v = a + b if op == "+" else a - b if op == "-" else a * b
        return f"({ta} {op} {tb})", v

    for _ in range(200):
        text, value = tree(3)
        if abs(value) <= 10 ** 30:
            assert calculate(text) == str(value), text


@pytest.mark.parametrize("expr, why", [
    ("x + 1", "names are not allowed"),
    ("__import__('os').system('ls')", "function calls are not allowed"),
    ("(1).real", "attributes are not allowed"),
    ("abs(-3)", "function calls are not allowed"),
    ("(1, 2)[0]", "subscripts are not allowed"),
    ("(lambda: 1)()", "function calls are not allowed"),
    ("lambda: 1", "lambdas are not allowed"),
    ("[i for i in (1, 2)]", "comprehensions are not allowed"),
    ("'ab' * 3", "strings are not allowed"),
    ("1 if 1 else 2", "conditional expressions are not allowed"),
    ("1 < 2", "comparisons are not allowed"),
    ("1 & 3", "operator BitAnd is not allowed"),
    ("~1", "operator Invert is not allowed"),
    ("True + 1", "bool constants are not allowed"),
    ("1j * 2", "complex constants are not allowed"),
    ("1 / 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1 +", "not a valid arithmetic expression"),
    ("", "empty expression"),
    ("1" * 31, "more than 30 digits"),
    ("1 + " * 60 + "1", "expression too long"),
    ("1+" * 40 + "1", "expression too large"),
    ("10 ** 31", "number too large"),
    ("1e400", "number too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("x = 1", "not a valid arithmetic expression"),
])
def test_calculator_refuses_with_a_clear_error(expr, why):
    out = calculate(expr)
    assert out.startswith("error: ") and why in out, out


@pytest.mark.parametrize("expr", ["2 ** 10 ** 10", "9 ** 9 ** 9", "(10 ** 30) ** 64",
                                  "2 ** 64 ** 64", "1.0000001 ** 1e30", "(2 ** 64) ** 64"])
def test_huge_powers_are_refused_before_computing(expr):
    t0 = time.perf_counter()
    out = calculate(expr)
    assert out.startswith("error: ") and time.perf_counter() - t0 < 0.05, out


def test_calculator_never_raises_on_junk():
    rng = random.Random(1)
    alphabet = "0123456789+-*/%().,^ eEjx_'\"[]{}:;=<>!&|~@#\\\n"
    for _ in range(2000):
        out = calculate("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))))
        assert isinstance(out, str)
    assert calculate(None).startswith("error: ")


def test_find_calls():
    assert find_calls("ok <calc>1 + 2</calc> and <calc> 3*4 </calc>") == ["1 + 2", "3*4"]
    assert find_calls("let me compute <calc>12 * 34") == ["12 * 34"]
    assert find_calls("the answer is 5") == []


@pytest.mark.parametrize("text, want", [
    ("The answer is \\boxed{12,345}.", Fraction(12345)),  # digit-group commas dropped
    ("so it is 1,234,567.", Fraction(1234567)),  # no box: the last number
    ("first 7 then \\boxed{-42}", Fraction(-42)),
    ("\\boxed{3.5}", Fraction(7, 2)),
    ("no number here", None),
    ("\\boxed{x}", None),
])
def test_parse_final_answer(text, want):
    assert parse_final_answer(text) == want

# ----------------------------------------------------------------------------- guess number


def test_guess_game_feedback_end_and_rewards():
    env = GuessNumberEnv(k=8, max_turns=4)
    assert env.vocab_size == 16 and env.decode_turn([8 + 3]) == "3"
    assert env.decode_turn([4]) == "<4>" and env.encode_observation("lower") == [5]
    ep = env.reset(env.train_prompts(0, 1)[0].__class__(ids=(1, 3), answer=5))
    r1 = ep.step(env.decode_turn([8 + 3]))
    assert (r1.observation, r1.reward, r1.done) == ("higher", 0.0, False)
    r2 = ep.step(env.decode_turn([8 + 6]))
    assert (r2.observation, r2.done) == ("lower", False)
    r3 = ep.step(env.decode_turn([8 + 5]))
    assert r3.done and r3.reward == pytest.approx(1 - 2 / 4) and ep.outcome() == {"score": 0.5}
    assert check_step_result(r3) is None and isinstance(ep, Episode)
    with pytest.raises(ValueError, match="after the episode ended"):
        ep.step("5")

    ep = env.reset(env.eval_prompts(3)[2])  # x = 2
    obs = [ep.step(env.decode_turn([t])) for t in (2, 8 + 7, 8 + 0, 8 + 1)]
    assert [o.observation for o in obs[:3]] == ["invalid", "lower", "higher"]
    assert [o.done for o in obs] == [False, False, False, True]
    assert ep.outcome() == {"score": 0.0} and sum(o.reward for o in obs) == 0.0

    ep = env.reset(env.eval_prompts(1)[0])  # x = 0, found at once
    assert ep.step("0").reward == 1.0 and ep.outcome() == {"score": 1.0}

    found = GuessNumberEnv(k=8, max_turns=4, reward="found")
    ep = found.reset(found.eval_prompts(6)[5])  # x = 5, found at turn 3: 1, not 1 - 2/4
    assert [ep.step(g).reward for g in ("3", "6", "5")] == [0.0, 0.0, 1.0]
    assert ep.outcome() == {"score": 1.0} and found.optimal_score() == 1.0
    with pytest.raises(ValueError, match="reward must be 'graded' or 'found'"):
        GuessNumberEnv(reward="binary")


def test_guess_prompts_and_splits():
    env = GuessNumberEnv(k=5, max_turns=3, seed=7)
    assert isinstance(env, Environment)
    train = env.train_prompts(10, 200)
    assert all(p.ids == (1, 3) for p in train) and [p.index for p in train] == list(range(10, 210))
    assert [p.answer for p in env.train_prompts(10, 200)] == [p.answer for p in train]
    assert set(p.answer for p in train) == set(range(5))
    assert [p.answer for p in env.eval_prompts(12)] == [j % 5 for j in range(12)]
    with pytest.raises(ValueError, match="answer must be an int"):
        env.reset(train[0].__class__(ids=(1, 3), answer=5))


def _hand_score(guesses, x, turns, graded=True):
    for t, g in enumerate(guesses, 1):
        if g == x:
            return Fraction(1) - Fraction(t - 1, turns) if graded else Fraction(1)
    return Fraction(0)


@pytest.mark.parametrize("graded", [True, False])
@pytest.mark.parametrize("k, turns, extra", [(5, 3, 0), (4, 4, 0), (3, 3, 5), (6, 2, 8)])
def test_random_baseline_equals_enumeration(k, turns, extra, graded):
    """A feedback-blind uniform policy over k numbers + `extra` non-number tokens: every
    guess sequence enumerated, for every hidden number (graded score, or found within T)."""
    tokens = list(range(k + extra))  # ids >= k are never a number
    total = sum(_hand_score(seq, x, turns, graded) for x in range(k)
                for seq in itertools.product(tokens, repeat=turns))
    want = total / (k * len(tokens) ** turns)
    assert random_expected_score(k + extra, turns, graded) == pytest.approx(float(want),
                                                                            abs=1e-12)


def test_env_baselines_name_numbers_and_vocab():
    env = GuessNumberEnv(k=8, max_turns=4)
    assert env.random_baseline() == pytest.approx(random_expected_score(8, 4))
    assert env.random_baseline("vocab") == pytest.approx(random_expected_score(16, 4))
    assert env.random_baseline() == pytest.approx(0.27581787109375)


def _best_policy_score(k, turns, graded=True):
    """Max over every deterministic policy (a guess for every feedback history) of the
    mean score, by enumeration: policy = {history (tuple of feedbacks): guess}."""
    histories = [h for n in range(turns) for h in itertools.product("hl", repeat=n)]
    best = Fraction(0)
    for guesses in itertools.product(range(k), repeat=len(histories)):
        policy = dict(zip(histories, guesses))
        total = Fraction(0)
        for x in range(k):
            h = ()
            for t in range(1, turns + 1):
                g = policy[h]
                if g == x:
                    total += 1 - Fraction(t - 1, turns) if graded else 1
                    break
                h += ("h" if x > g else "l",)
        best = max(best, total / k)
    return best


@pytest.mark.parametrize("graded", [True, False])
@pytest.mark.parametrize("k, turns", [(4, 2), (3, 3), (5, 2), (7, 2)])
def test_optimal_score_is_the_best_deterministic_policy(k, turns, graded):
    assert optimal_expected_score(k, turns, graded) == pytest.approx(
        float(_best_policy_score(k, turns, graded)))


@pytest.mark.parametrize("k, turns", [(8, 4), (16, 3), (12, 5), (2, 1)])
def test_binary_search_through_the_env_reaches_the_optimum(k, turns):
    env = GuessNumberEnv(k=k, max_turns=turns)
    scores = []
    for p in env.eval_prompts(k):
        ep, lo, hi = env.reset(p), 0, k - 1
        while True:
            g = (lo + hi) // 2
            r = ep.step(str(g))
            if r.done:
                break
            lo, hi = (g + 1, hi) if r.observation == "higher" else (lo, g - 1)
        scores.append(ep.outcome()["score"])
    assert np.mean(scores) == pytest.approx(optimal_expected_score(k, turns))


@pytest.mark.parametrize("reward", ["graded", "found"])
def test_consistent_random_baseline_matches_simulation(reward):
    k, turns, n = 8, 4 if reward == "graded" else 3, 20000
    env = GuessNumberEnv(k=k, max_turns=turns, reward=reward)
    graded = reward == "graded"
    rng = np.random.default_rng(0)
    scores = np.empty(n)
    for i, p in enumerate(env.train_prompts(0, n)):
        ep, lo, hi = env.reset(p), 0, k - 1
        while True:
            g = int(rng.integers(lo, hi + 1))
            r = ep.step(str(g))
            if r.done:
                break
            lo, hi = (g + 1, hi) if r.observation == "higher" else (lo, g - 1)
        scores[i] = ep.outcome()["score"]
    se = scores.std() / np.sqrt(n)
    assert abs(scores.mean() - consistent_random_expected_score(k, turns, graded)) < 4 * se
    assert env.consistent_random_baseline() == consistent_random_expected_score(k, turns, graded)
    assert random_expected_score(k, turns, graded) < consistent_random_expected_score(
        k, turns, graded) < optimal_expected_score(k, turns, graded)
    if not graded:  # a binary outcome
        assert set(np.unique(scores)) == {0.0, 1.0}

# ----------------------------------------------------------------------------- calculator env


def test_reduction_steps_chain_to_the_value_on_random_trees():
    """Each step has one operation; fed through the calculator in order, each step's value
    is the next one's operand and the last is the whole expression's (Python ints here)."""
    rng = random.Random(1)

    def tree(depth):  # (text, value, operations) by Python int arithmetic, written here
        if depth == 0 or rng.random() < 0.3:
            v = rng.randint(0, 999)
            return str(v), v, 0
        (ta, a, na), (tb, b, nb) = tree(depth - 1), tree(depth - 1)
        op = rng.choice("+-*")
        v = a + b if op == "+" else a - b if op == "-" else a * b
        return f"({ta} {op} {tb})", v, na + nb + 1

    for _ in range(200):
        text, value, ops = tree(3)
        steps = reduction_steps(text)
        assert count_operations(text) == len(steps) == ops, text
        assert all(count_operations(s) == 1 for s in steps)
        assert (calculate(steps[-1]) if steps else text) == str(value), text
    assert reduction_steps("5802 + 917 + 3409") == ["5802 + 917", "6719 + 3409"]
    assert reduction_steps("12 * 34 + 5") == ["12 * 34", "408 + 5"] and reduction_steps("7") == []
    assert count_operations("-3 * 4") == 1  # a sign is not an operation ...
    assert reduction_steps("-(3 + 4) * 2") == ["3 + 4", "-7 * 2"]  # ... but its operand may be
    with pytest.raises(ValueError, match="names are not allowed"):
        count_operations("x + 1")


@pytest.fixture(scope="module")
def tok():
    from gguf import GGUFReader

    from models.assets import smollm2_gguf_path
    from models.gguf_loader import read_metadata
    from models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_metadata(GGUFReader(smollm2_gguf_path())))


def _chat(env, expr, *messages):
    """The conversation written out by hand: system, the one worked example, the question."""
    assert env.shots == 1
    return [{"role": "system", "content": env.system_prompt},
            {"role": "user", "content": "What is 352 * 47?"},
            {"role": "assistant", "content": "<calc>352 * 47</calc>"},
            {"role": "user", "content": "Calculator: 352 * 47 = 16544"},
            {"role": "assistant", "content": "The answer is \\boxed{16544}."},
            {"role": "user", "content": f"What is {expr}?"}, *messages]


def test_observation_wrapping_equals_the_chat_template(tok):
    env = CalculatorEnv(tokenizer=tok)
    assert isinstance(env, Environment) and env.stop_ids == (tok.encode("<|im_end|>")[0],)
    prompt = env.train_prompts(0, 1)[0]
    assert list(prompt.ids) == tok.encode(tok.apply_chat_template(_chat(env, prompt.text)))
    call = f"<calc>{prompt.text}</calc>"
    turn = tok.encode(call) + list(env.stop_ids)  # a turn that stopped on <|im_end|>
    ep = env.reset(prompt)
    r = ep.step(env.decode_turn(turn))
    assert not r.done and r.info["tool_calls"] == 1 and check_step_result(r) is None
    obs = env.encode_observation(r.observation)
    want_value = prompt.answer  # the generator's answer (checked by hand in another test)
    result_line = f"Calculator: {prompt.text} = {want_value}"
    want = tok.encode(tok.apply_chat_template(_chat(
        env, prompt.text, {"role": "assistant", "content": call},
        {"role": "user", "content": result_line})))
    assert list(prompt.ids) + turn + obs == want
    # the final answer turn
    final = tok.encode(f"So the answer is \\boxed{{{want_value}}}.") + list(env.stop_ids)
    r2 = ep.step(env.decode_turn(final))
    assert r2.done and r2.reward == 1.0 and ep.outcome() == {"correct": 1.0}
    assert ep.tool_calls == 1


def test_a_cut_turn_is_closed_by_the_observation(tok):
    env = CalculatorEnv(tokenizer=tok, kinds=("mul",))
    prompt = env.eval_prompts(1)[0]
    turn = tok.encode(f"Let me use it: <calc>{prompt.text}</calc> and then")  # no <|im_end|>
    r = env.reset(prompt).step(env.decode_turn(turn))
    want = tok.encode(tok.apply_chat_template(_chat(
        env, prompt.text, {"role": "assistant", "content": tok.decode(turn)},
        {"role": "user", "content": f"Calculator: {prompt.text} = {prompt.answer}"})))
    assert list(prompt.ids) + turn + env.encode_observation(r.observation) == want


def test_calculator_env_problems_answers_and_rewards(tok):
    env = CalculatorEnv(tokenizer=tok, min_digits=2, max_digits=3)
    train, evals = env.train_prompts(0, 100), env.eval_prompts(64)
    assert not {p.text for p in train} & {p.text for p in evals}
    assert len({p.text for p in evals}) == 64
    assert [p.text for p in env.train_prompts(0, 100)] == [p.text for p in train]
    for p in train + evals:  # the answer by hand: split on ' + ' then ' * '
        want = sum(int(np.prod([int(f) for f in term.split(" * ")], dtype=object))
                   for term in p.text.split(" + "))
        assert p.answer == want
        digits = [len(n) for n in p.text.replace(" * ", " ").replace(" + ", " ").split()]
        assert all(2 <= d <= 3 for d in digits)
    end = env.turn_end
    cases = [(f"The answer is {train[0].answer:,}.{end}", 1.0),
             (f"\\boxed{{{train[0].answer}}}{end}", 1.0),
             (f"The answer is {train[0].answer + 1}.{end}", 0.0),
             (f"I do not know.{end}", 0.0)]
    for text, want in cases:
        ep = env.reset(train[0])
        r = ep.step(text)
        assert r.done and r.reward == want and ep.outcome() == {"correct": want}
    ep = env.reset(train[0])  # only tool calls: the last turn ends the episode, no answer
    rs = [ep.step(f"<calc>1/0</calc>{end}") for _ in range(env.max_turns)]
    assert [r.done for r in rs] == [False] * (env.max_turns - 1) + [True]
    assert "error: division by zero" in rs[0].observation and rs[0].info["tool_errors"] == 1
    assert ep.outcome() == {"correct": 0.0} and ep.tool_calls == env.max_turns


def test_calculator_env_config_errors(tok):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        CalculatorEnv()
    with pytest.raises(ValueError, match="must be one token"):
        CalculatorEnv(tokenizer=tok, turn_end="</calc>")
    with pytest.raises(ValueError, match="kinds"):
        CalculatorEnv(tokenizer=tok, kinds=("div",))
    with pytest.raises(ValueError, match="max_prompt_len"):
        CalculatorEnv(tokenizer=tok, max_prompt_len=10).train_prompts(0, 1)

# ----------------------------------------------------------------------------- registry


def test_make_env_specs():
    env = make_env("guess_number:k=16,max_turns=5")
    assert (env.k, env.max_turns) == (16, 5) and isinstance(env, GuessNumberEnv)
    assert make_env("guess_number", k=12).k == 12
    assert parse_env_spec("calculator:kinds=mul+add,min_digits=4") == (
        "calculator", {"kinds": ("mul", "add"), "min_digits": 4})
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("chess")
    with pytest.raises(ValueError, match="rejected its options"):
        make_env("guess_number:colour=3")
    with pytest.raises(ValueError, match="both in the spec"):
        make_env("guess_number:k=4", k=5)
    with pytest.raises(ValueError, match="not key=value"):
        make_env("guess_number:k")


def test_no_tool_baseline_is_one_turn(tok):
    env = CalculatorEnv(tokenizer=tok, tool=False)
    prompt = env.eval_prompts(1)[0]
    want = [{"role": "system", "content": "You are a math assistant. Reply with the final "
                                          "answer as \\boxed{NUMBER}."},
            {"role": "user", "content": "What is 352 * 47?"},
            {"role": "assistant", "content": "The answer is \\boxed{16544}."},
            {"role": "user", "content": f"What is {prompt.text}?"}]
    assert list(prompt.ids) == tok.encode(tok.apply_chat_template(want))
    ep = env.reset(prompt)
    r = ep.step(f"<calc>{prompt.text}</calc>{env.turn_end}")  # not run: the final answer
    assert r.done and r.reward == 0.0 and ep.tool_calls == 0


def test_one_operation_per_call_needs_dependent_calls(tok):
    env = CalculatorEnv(tokenizer=tok, kinds=("add",), terms=3, ops_per_call=1, shots=2,
                        max_turns=4, max_prompt_len=400)
    prompt = env.eval_prompts(1)[0]
    a, b, c = (int(x) for x in prompt.text.split(" + "))
    # the prompt by hand: the chained worked example shows one call per operation
    example_2 = [{"role": "user", "content": "What is 5802 + 917 + 3409?"},
                 {"role": "assistant", "content": "<calc>5802 + 917</calc>"},
                 {"role": "user", "content": "Calculator: 5802 + 917 = 6719"},
                 {"role": "assistant", "content": "<calc>6719 + 3409</calc>"},
                 {"role": "user", "content": "Calculator: 6719 + 3409 = 10128"},
                 {"role": "assistant", "content": "The answer is \\boxed{10128}."}]
    want = _chat(dataclasses.replace(env, shots=1), prompt.text)
    want = want[:-1] + example_2 + want[-1:]
    assert "one operation per call" in want[0]["content"]
    assert list(prompt.ids) == tok.encode(tok.apply_chat_template(want))
    end, ep = env.turn_end, env.reset(prompt)
    r = ep.step(f"<calc>{prompt.text}</calc>{end}")  # the whole sum: refused, not computed
    assert "error: 2 operations, at most 1 per call" in r.observation and not r.done
    assert str(a + b + c) not in r.observation and r.info["tool_errors"] == 1
    r = ep.step(f"<calc>{a} + {b}</calc>{end}")
    assert f"Calculator: {a} + {b} = {a + b}" in r.observation and r.info["tool_errors"] == 0
    r = ep.step(f"<calc>{a + b} + {c}</calc>{end}")
    assert f"= {a + b + c}" in r.observation
    r = ep.step(f"The answer is \\boxed{{{a + b + c}}}.{end}")
    assert r.done and r.reward == 1.0 and ep.tool_calls == 3 and ep.tool_errors == 1
    # without the limit the same call is answered at once
    free = CalculatorEnv(tokenizer=tok, kinds=("add",), terms=3)
    assert f"= {a + b + c}" in free.reset(prompt).step(f"<calc>{prompt.text}</calc>{end}").observation

