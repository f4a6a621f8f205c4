"""`PythonToolEnv`: math word problems for a chat model that may run Python, any number of
turns, in the sandbox (rl.envs.sandbox), its answer checked by math-verify.

Problems: a reasoning-gym dataset (default "gsm_symbolic": grade-school word problems;
"basic_arithmetic", "chain_sum", ... work too), item i of `create_dataset(dataset,
seed=seed)`; a question belongs to the eval split iff its salted hash says so
(rl.tasks.in_eval_split, eval_fraction of all): train position i is the i-th train item,
eval item j the j-th eval item.

Protocol (as rl.envs.calculator's): a turn is one assistant message, ending on `turn_end`
(<|im_end|>) or at max_turn_tokens. A turn holding a ```python ... ``` block (or
<python>...</python>; an unclosed block at the end of the turn counts) is a tool call: the
code runs in the sandbox, a fresh process and temp dir per call under `limits`, and its
stdout (or the error's last line, or "killed: over N s ...") comes back as a `tool_role`
message "Output:\\n...". The first turn without code is the final answer: its last
\\boxed{...} (else its last number), compared with the reference by math-verify
(rl.tasks.math_answers.math_equal). Reward "correct" = 1 if equal; info["tool_calls"]
counts each turn's calls, info["tool_errors"] those that failed or were killed.
tool=False is the no-tool baseline: every turn is the final answer.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

from rl.envs.base import StepResult
from rl.envs.calculator import CalculatorEnv
from rl.envs.sandbox import SandboxLimits, run_python
from rl.tasks.base import Prompt, check_count, in_eval_split

SYSTEM_PROMPT = (
    "You are a math assistant who can run Python. To run code, reply with only a code block "
    "```python\n...\n``` that prints what you need; its output comes back in the next "
    "message. When you know the result, reply with the final answer as \\boxed{NUMBER}.")
NO_TOOL_PROMPT = "You are a math assistant. Reply with the final answer as \\boxed{NUMBER}."
EXAMPLE = ("A shop sells 17 boxes of 24 pens and 9 single pens. How many pens does it sell?",
           "print(17 * 24 + 9)", "417")
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```|<python>(.*?)</python>", re.DOTALL)
_OPEN = re.compile(r"```(?:python|py)?\s*\n(.*)$|<python>(.*)$", re.DOTALL)


def find_code(text: str) -> list[str]:
    """The code blocks of a turn: every closed ```python block / <python> tag, or, when
    there is none, an unclosed one running to the end of the turn."""
    blocks = [a or b for a, b in _BLOCK.findall(text)]
    if not blocks:
        m = _OPEN.search(text)
        if m:
            blocks = [m.group(1) or m.group(2) or ""]
    return [b.strip("\n") for b in blocks if b.strip()]


class PythonEpisode:
    """One problem: turns with code get the sandbox's output back; the first turn without
    code is the final answer and ends the episode."""

    def __init__(self, env: "PythonToolEnv", answer: str):
        self.env, self.answer = env, answer
        self.turns = self.tool_calls = self.tool_errors = 0
        self.correct = 0.0

    def step(self, turn_text: str) -> StepResult:
        from rl.tasks.math_answers import extract_final_boxed, math_equal
        from rl.tasks.verifiers import extract_answer

        self.turns += 1
        end = self.env.turn_end
        closed = turn_text.endswith(end)
        body = turn_text[:-len(end)] if closed else turn_text
        code = find_code(body)[:self.env.max_calls_per_turn] if self.env.tool else []
        if code:
            results = [run_python(c, self.env.limits) for c in code]
            errors = sum(not r.ok for r in results)
            self.tool_calls += len(code)
            self.tool_errors += errors
            text = "\n".join("Output:\n" + r.observation(self.env.max_output_chars)
                             for r in results)
            done = self.turns >= self.env.max_turns
            return StepResult(self.env.wrap_observation(text, closed), 0.0, done,
                              {"tool_calls": len(code), "tool_errors": errors})
        final = extract_final_boxed(body) or extract_answer(body, self.answer)
        self.correct = float(final is not None and math_equal(final, self.answer))
        return StepResult("", self.correct, True, {"tool_calls": 0, "answer": final})

    def outcome(self) -> dict[str, float]:
        return {"correct": self.correct}


@dataclasses.dataclass(frozen=True)
class PythonToolEnv(CalculatorEnv):
    """Word problems with a sandboxed Python tool (module doc). The chat plumbing (turn_end,
    tool_role, the observation's wrapping, decode / encode) is CalculatorEnv's; the fields
    here: dataset (reasoning-gym), limits (rl.envs.sandbox.SandboxLimits),
    max_output_chars per observation."""

    dataset: str = "gsm_symbolic"
    limits: SandboxLimits = SandboxLimits()
    max_output_chars: int = 1000
    max_turns: int = 4
    max_turn_tokens: int = 160
    max_calls_per_turn: int = 2
    max_prompt_len: int = 512
    max_episode_tokens: int = 1024
    name: str = "python"

    def __post_init__(self):
        if self.system_prompt is None:
            object.__setattr__(self, "system_prompt", SYSTEM_PROMPT if self.tool else NO_TOOL_PROMPT)
        if not isinstance(self.limits, SandboxLimits):
            object.__setattr__(self, "limits", SandboxLimits(**dict(self.limits)))
        if self.shots > 1:
            raise ValueError(f"PythonToolEnv.shots must be 0 or 1, got {self.shots}")
        check_count("PythonToolEnv.max_output_chars", self.max_output_chars, 1)
        super().__post_init__()
        self._items  # noqa: B018 -- a bad dataset name fails now, not mid-rollout

    @functools.cached_property
    def _items(self) -> Any:
        import reasoning_gym
        return reasoning_gym.create_dataset(self.dataset, seed=self.seed, size=1_000_000)

    def _split(self, eval_side: bool, count: int, start: int = 0) -> list[tuple[int, dict]]:
        out, k, i = [], 0, 0
        while len(out) < count:
            item = self._items[i]
            if in_eval_split(item["question"].encode(), self.seed, self.eval_fraction) == eval_side:
                if k >= start:
                    out.append((k, item))
                k += 1
            i += 1
        return out

    def messages(self, question: str) -> list[dict[str, str]]:
        out = [{"role": "system", "content": self.system_prompt}]
        if self.shots:
            q, code, answer = EXAMPLE
            out.append({"role": "user", "content": q})
            if self.tool:
                out += [{"role": "assistant", "content": f"```python\n{code}\n```"},
                        {"role": self.tool_role, "content": f"Output:\n{answer}"}]
            out.append({"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."})
        return out + [{"role": "user", "content": question}]

    def _item_prompt(self, item: dict, index: int) -> Prompt:
        p = self._prompt(item["question"], str(item["answer"]), index)
        return dataclasses.replace(p, text=item["question"])

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        check_count("start", start)
        check_count("count", count)
        return [self._item_prompt(item, k) for k, item in self._split(False, count, start)]

    def eval_prompts(self, count: int) -> list[Prompt]:
        check_count("count", count)
        return [self._item_prompt(item, k) for k, item in self._split(True, count)]

    def reset(self, prompt: Prompt) -> PythonEpisode:
        return PythonEpisode(self, str(prompt.answer))

    def describe(self, prompt: Prompt, turns: Sequence[str]) -> str:
        return f"{prompt.text} = {prompt.answer}: " + " | ".join(t.strip() for t in turns)
