"""`CalculatorEnv`: arithmetic problems for a chat model that answers with the help of
`<calc>EXPR</calc>` calls to a calculator tool (the class docstring has the format, the chat
wrapping and the reward). The tool itself is `rl.envs.arithmetic.calculate`, a safe
arithmetic evaluator (never eval/exec); `find_calls` reads a turn's tool calls and
`parse_final_answer` its final answer.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from rl.envs.arithmetic import (
    CalculatorError,
    calculate,
    count_operations,
    format_number,
    reduction_steps,
)
from rl.envs.base import StepResult
from rl.tasks.base import Prompt, check_count, in_eval_split

SYSTEM_PROMPT = (
    "You are a math assistant with a calculator. To use it, reply with only a calculator call, "
    "for example <calc>1234 * 5678</calc>, and the result comes back in the next message. "
    "When you know the result, reply with the final answer as \\boxed{NUMBER}."
)
CHAIN_SYSTEM_PROMPT = (
    "You are a math assistant with a calculator that does one operation per call. To use "
    "it, reply with only a calculator call, for example <calc>1234 * 5678</calc>, and the "
    "result comes back in the next message; use the results in your next calls. When you "
    "know the result, reply with the final answer as \\boxed{NUMBER}."
)
NO_TOOL_SYSTEM_PROMPT = ("You are a math assistant. Reply with the final answer as "
                         "\\boxed{NUMBER}.")
KINDS = ("add", "mul", "muladd")
EXAMPLES = ("352 * 47", "5802 + 917 + 3409")  # the worked examples of the prompt
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPEN_CALL = re.compile(r"<calc>(.*)$", re.DOTALL)
_HOLE_A, _HOLE_O = "\x00turn\x00", "\x00obs\x00"


def find_calls(text: str) -> list[str]:
    """The expressions of the tool calls in a turn: every `<calc>EXPR</calc>`, or, when
    there is none, an unclosed `<calc>EXPR` running to the end of the turn."""
    calls = _CALL.findall(text)
    if not calls:
        m = _OPEN_CALL.search(text)
        if m:
            calls = [m.group(1)]
    return [c.strip() for c in calls]


def parse_final_answer(text: str) -> Fraction | None:
    """The number a final-answer turn gives: its last \\boxed{...}, else its last number
    (its commas dropped, as in 12,345); None if there is none or it is not a number."""
    from rl.tasks.reasoning_gym import extract_answer

    answer = extract_answer(text, "0")
    if answer is None:
        return None
    try:
        return Fraction(answer.strip().rstrip(".").replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


class CalculatorEpisode:
    """One problem: turns with tool calls get the calculator's results back; the first turn
    without a call is the final answer and ends the episode."""

    def __init__(self, env: "CalculatorEnv", answer: int):
        self.env, self.answer = env, answer
        self.turns = self.tool_calls = self.tool_errors = 0
        self.correct = 0.0
        self.final: str | None = None

    def step(self, turn_text: str) -> StepResult:
        """turn_text: the turn decoded WITH special tokens (CalculatorEnv.decode_turn), so a
        turn that ended on the end-of-message token ends with its text."""
        if self.final is not None or self.turns >= self.env.max_turns:
            raise ValueError("CalculatorEpisode.step after the episode ended")
        self.turns += 1
        end = self.env.turn_end
        closed = turn_text.endswith(end)
        body = turn_text[:-len(end)] if closed else turn_text
        calls = find_calls(body)[:self.env.max_calls_per_turn] if self.env.tool else []
        if calls:
            results = [self.env.run_tool(c) for c in calls]
            errors = sum(r.startswith("error:") for r in results)
            self.tool_calls += len(calls)
            self.tool_errors += errors
            text = "\n".join(f"Calculator: {c} = {r}" if not r.startswith("error:")
                             else f"Calculator: {c} -> {r}" for c, r in zip(calls, results))
            done = self.turns >= self.env.max_turns
            return StepResult(self.env.wrap_observation(text, closed), 0.0, done,
                              {"tool_calls": len(calls), "tool_errors": errors})
        value = parse_final_answer(body)
        self.final = "" if value is None else format_number(value)
        self.correct = float(value is not None and value == self.answer)
        return StepResult("", self.correct, True, {"tool_calls": 0, "answer": self.final})

    def outcome(self) -> dict[str, float]:
        return {"correct": self.correct}


@dataclasses.dataclass(frozen=True)
class CalculatorEnv:
    """Arithmetic with a calculator tool for a chat model (SmolLM2-135M-Instruct).

    Problems (a deterministic generator of our own): kind "add" = `terms` numbers of
    min_digits .. max_digits digits summed, "mul" = two such numbers multiplied, "muladd" =
    a * b + c; `kinds` picks among them uniformly. The question is "What is {expr}?".
    Split: an expression belongs to the eval split iff its salted hash says so
    (rl.tasks.in_eval_split, eval_fraction of all); train position i draws from
    rng([seed, 0, i]) until it gets a train item, eval item j from rng([seed, 1, .]),
    distinct expressions only.

    Prompt: the chat template of [system: system_prompt, `shots` worked examples (user:
    "What is 352 * 47?", assistant: "<calc>352 * 47</calc>", tool_role: "Calculator: 352 *
    47 = 16544", assistant: "The answer is \\boxed{16544}."), user: question] with the
    assistant generation prompt. With one example SmolLM2-135M-Instruct calls the tool
    (greedy) on about 5 problems in 8; with none, never. tool=False is the no-tool
    baseline: NO_TOOL_SYSTEM_PROMPT, examples answered directly, and every turn is the
    final answer (calls are not run), so the episode is one turn.

    ops_per_call > 0 (0: any expression) makes it a multi-call task: the calculator takes
    at most that many operations a call and answers a longer call with an error that says
    to split it, so "a * b + c" or a 3-term sum with ops_per_call=1 needs that many
    dependent calls, each using the last result; the system prompt is CHAIN_SYSTEM_PROMPT,
    and a worked example with more operations shows one call and result per step
    (rl.envs.arithmetic.reduction_steps: "5802 + 917" = 6719, then "6719 + 3409").
    max_turns must leave room for the calls and the answer.

    Protocol: a turn is one assistant message: it ends on
    `turn_end` (<|im_end|>, one token; the stop id), or at max_turn_tokens. A turn holding
    `<calc>EXPR</calc>` (up to max_calls_per_turn of them; an unclosed `<calc>EXPR` at the
    end of the turn counts) is a tool call: each expression goes to `calculate` and the
    results come back as a `tool_role` message, "Calculator: EXPR = VALUE" (or
    "Calculator: EXPR -> error: WHY"), one line per call; then the assistant's next turn.
    The first turn without a call is the final answer: its last \\boxed{} or else its last
    number. Reward "correct" = 1 if it equals the exact answer; info["tool_calls"] counts
    each turn's calls. A turn that is cut at max_turn_tokens (not closed by turn_end) is
    closed by the observation, which then starts with turn_end's text.

    Why <|im_end|> ends a tool call rather than a single-token closing tag: no closing tag
    such as </calc> is one token in SmolLM2's vocabulary (`</calc>` = 3 tokens) and the
    sampler stops on single ids; <|im_end|> is one id, the model ends every message with
    it, and a whole message is parsed for the call.
    """

    tokenizer: Any = None
    kinds: tuple[str, ...] = ("mul", "add", "muladd")
    min_digits: int = 3
    max_digits: int = 4
    terms: int = 3
    seed: int = 0
    eval_fraction: float = 0.5
    tool: bool = True
    system_prompt: str | None = None
    shots: int = 1
    tool_role: str = "user"
    turn_end: str = "<|im_end|>"
    max_turns: int = 3
    max_turn_tokens: int = 64
    max_calls_per_turn: int = 4
    ops_per_call: int = 0
    max_prompt_len: int = 256
    max_episode_tokens: int = 512
    name: str = "calculator"

    def __post_init__(self):
        if self.tokenizer is None:
            raise ValueError("CalculatorEnv needs a tokenizer (encode, decode, "
                             "apply_chat_template): pass tokenizer=models.assets.load_model(..)[2]")
        kinds = (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)
        if not kinds or any(k not in KINDS for k in kinds):
            raise ValueError(f"CalculatorEnv.kinds must be a non-empty subset of {KINDS}, got "
                             f"{self.kinds!r}")
        object.__setattr__(self, "kinds", kinds)
        check_count("CalculatorEnv.min_digits", self.min_digits, 1)
        check_count("CalculatorEnv.max_digits", self.max_digits, self.min_digits)
        if self.max_digits > 12:
            raise ValueError(f"CalculatorEnv.max_digits must be <= 12, got {self.max_digits}")
        check_count("CalculatorEnv.terms", self.terms, 2)
        check_count("CalculatorEnv.ops_per_call", self.ops_per_call)
        if self.system_prompt is None:
            object.__setattr__(self, "system_prompt", NO_TOOL_SYSTEM_PROMPT if not self.tool
                               else CHAIN_SYSTEM_PROMPT if self.ops_per_call else SYSTEM_PROMPT)
        if not 0 <= self.shots <= len(EXAMPLES):
            raise ValueError(f"CalculatorEnv.shots must be in 0 .. {len(EXAMPLES)}, got {self.shots}")
        for f in ("seed", "max_turns", "max_turn_tokens", "max_calls_per_turn",
                  "max_prompt_len", "max_episode_tokens"):
            check_count(f"CalculatorEnv.{f}", getattr(self, f), 0 if f == "seed" else 1)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        self.stop_ids  # noqa: B018 -- checks turn_end and the template now, not mid-rollout
        self._wrap_parts

    def run_tool(self, expression: str) -> str:
        """The tool's reply to one call: calculate(expression), or, past ops_per_call
        operations (when set), an error that says to split it."""
        if self.ops_per_call:
            try:
                n = count_operations(expression)
            except CalculatorError as err:
                return f"error: {err}"
            if n > self.ops_per_call:
                return (f"error: {n} operations, at most {self.ops_per_call} per call; "
                        "split the problem")
        return calculate(expression)

    def tool_steps(self, expression: str) -> list[str]:
        """The calls a worked example shows: the whole expression, or its one-operation
        steps (reduction_steps) when it has more operations than ops_per_call."""
        if self.ops_per_call and count_operations(expression) > self.ops_per_call:
            return reduction_steps(expression)
        return [expression]

    # ------------------------------------------------------------------ chat plumbing
    @property
    def reward_names(self) -> tuple[str, ...]:
        return ("correct",)

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        ids = self.tokenizer.encode(self.turn_end)
        if len(ids) != 1:
            raise ValueError(f"turn_end {self.turn_end!r} is {len(ids)} tokens {ids}; the sampler "
                             "stops on single ids, so it must be one token (e.g. '<|im_end|>')")
        return (int(ids[0]),)

    @functools.cached_property
    def _wrap_parts(self) -> tuple[str, str, str]:
        """(after_end, before_obs, after_obs): the chat template's text between an assistant
        message's turn_end and the observation, and after it (through the next assistant
        header), read off the template itself."""
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": _HOLE_A}]
        a = self.tokenizer.apply_chat_template(base, add_generation_prompt=False)
        b = self.tokenizer.apply_chat_template(
            base + [{"role": self.tool_role, "content": _HOLE_O}], add_generation_prompt=True)
        tail = a[a.index(_HOLE_A) + len(_HOLE_A):]
        if not b.startswith(a) or not tail.startswith(self.turn_end) or b.count(_HOLE_O) != 1:
            raise ValueError(f"the chat template does not end an assistant message with "
                             f"turn_end={self.turn_end!r} followed by the next message; set "
                             "turn_end to the template's end-of-message token")
        before, after = b[len(a):].split(_HOLE_O)
        return tail[len(self.turn_end):], before, after

    def wrap_observation(self, text: str, closed: bool = True) -> str:
        """The observation as chat text: [turn_end if the turn was not closed] + the
        template's text after turn_end + a `tool_role` message holding `text` + the
        assistant header the next turn follows."""
        after_end, before, after = self._wrap_parts
        return ("" if closed else self.turn_end) + after_end + before + text + after

    def decode_turn(self, ids: Sequence[int]) -> str:
        """The turn's text WITH special tokens (so a closed turn ends with turn_end)."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)

    def encode_observation(self, text: str) -> list[int]:
        """Token ids of an observation (already chat-wrapped by the episode)."""
        return [int(t) for t in self.tokenizer.encode(text)]

    # ------------------------------------------------------------------ problems
    def _problem(self, rng: np.random.Generator) -> tuple[str, int]:
        kind = self.kinds[int(rng.integers(len(self.kinds)))]

        def number() -> int:
            d = int(rng.integers(self.min_digits, self.max_digits + 1))
            return int(rng.integers(10 ** (d - 1), 10 ** d))

        if kind == "add":
            xs = [number() for _ in range(self.terms)]
            return " + ".join(map(str, xs)), sum(xs)
        a, b = number(), number()
        if kind == "mul":
            return f"{a} * {b}", a * b
        c = number()
        return f"{a} * {b} + {c}", a * b + c

    def _is_eval(self, expr: str) -> bool:
        return in_eval_split(expr.encode(), self.seed, self.eval_fraction)

    def question(self, expr: str) -> str:
        return f"What is {expr}?"

    def messages(self, expr: str) -> list[dict[str, str]]:
        """The prompt's chat messages: system, the `shots` worked examples (question, tool
        call, calculator result, boxed answer; with ops_per_call, a call and a result per
        allowed step; without the tool: question, boxed answer), then the question."""
        out = [{"role": "system", "content": self.system_prompt}]
        for ex in EXAMPLES[:self.shots]:
            out.append({"role": "user", "content": self.question(ex)})
            for step in self.tool_steps(ex) if self.tool else ():
                out += [{"role": "assistant", "content": f"<calc>{step}</calc>"},
                        {"role": self.tool_role, "content": f"Calculator: {step} = {calculate(step)}"}]
            out.append({"role": "assistant", "content": f"The answer is \\boxed{{{calculate(ex)}}}."})
        return out + [{"role": "user", "content": self.question(expr)}]

    def _prompt(self, expr: str, answer: int, index: int) -> Prompt:
        messages = self.messages(expr)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tuple(int(t) for t in self.tokenizer.encode(text))
        if len(ids) > self.max_prompt_len:
            raise ValueError(f"a calculator prompt has {len(ids)} tokens, more than "
                             f"max_prompt_len={self.max_prompt_len}: raise max_prompt_len or "
                             "shorten system_prompt")
        return Prompt(ids=ids, answer=answer, text=expr, index=index)

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        check_count("start", start)
        check_count("count", count)
        out = []
        for i in range(start, start + count):
            rng = np.random.default_rng([self.seed, 0, i])
            while True:
                expr, answer = self._problem(rng)
                if not self._is_eval(expr):
                    break
            out.append(self._prompt(expr, answer, i))
        return out

    def eval_problems(self, count: int) -> list[tuple[str, int]]:
        """The first `count` distinct eval-split problems (expression, answer)."""
        check_count("count", count)
        rng = np.random.default_rng([self.seed, 1])
        out, seen = [], set()
        for _ in range(1000 * count + 1000):
            if len(out) == count:
                return out
            expr, answer = self._problem(rng)
            if expr not in seen and self._is_eval(expr):
                seen.add(expr)
                out.append((expr, answer))
        raise ValueError(f"fewer than {count} distinct eval problems; widen the digit range")

    def eval_prompts(self, count: int) -> list[Prompt]:
        return [self._prompt(e, a, j) for j, (e, a) in enumerate(self.eval_problems(count))]

    # ------------------------------------------------------------------ episodes
    def reset(self, prompt: Prompt) -> CalculatorEpisode:
        if isinstance(prompt.answer, bool) or not isinstance(prompt.answer, int):
            raise ValueError(f"CalculatorEnv prompt.answer must be an int, got {prompt.answer!r}")
        return CalculatorEpisode(self, prompt.answer)

    def describe(self, prompt: Prompt, turns: Sequence[str]) -> str:
        return f"{prompt.text} = {prompt.answer}: " + " | ".join(t.strip() for t in turns)
