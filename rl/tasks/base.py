"""The `Task` protocol (prompts with deterministic train/eval splits + a verifier) and
the helpers tasks share.

A task hands out `Prompt`s: token ids (what the sampler sees), the answer the verifier
checks against, and the text for display. `reward(prompt, response)` returns one float
per name in `reward_names`, so multi-reward estimators (GDPO) can treat them apart.
Splits are deterministic functions of the task's seed: an item's split is decided by a
salted CRC32 of its content, so train and eval never share an item and every process
sees the same prompts in the same order.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Prompt:
    """ids: prompt token ids; answer: what the verifier compares with; text: readable
    form (or None); index: position of the prompt in its split's stream."""

    ids: tuple[int, ...]
    answer: Any
    text: str | None = None
    index: int = 0


@runtime_checkable
class Task(Protocol):
    """A verifiable task. `train_prompts(start, count)` is the train stream from position
    `start` (the loop's data position); `eval_prompts(count)` the first `count` eval items;
    both deterministic given the task's seed. `reward` returns {name: float} with exactly
    `reward_names`. Sampling settings the task needs: `stop_ids`, `max_prompt_len`,
    `max_new_tokens`."""

    name: str
    reward_names: tuple[str, ...]
    stop_ids: tuple[int, ...]
    max_prompt_len: int
    max_new_tokens: int

    def train_prompts(self, start: int, count: int) -> list[Prompt]: ...

    def eval_prompts(self, count: int) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, response: Sequence[int] | str) -> dict[str, float]: ...

    def describe(self, prompt: Prompt, response: Sequence[int]) -> str: ...


def in_eval_split(key: bytes, seed: int, eval_fraction: float) -> bool:
    """True if the item with content `key` belongs to the eval split (deterministic:
    salted CRC32 bucket, about `eval_fraction` of all items)."""
    h = zlib.crc32(key, zlib.crc32(f"tandem-split-{seed}".encode()))
    return (h % 1_000_003) < eval_fraction * 1_000_003


def check_count(name: str, value: Any, minimum: int = 0) -> int:
    """A non-negative int argument, or a clear ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def chat_prompt_text(tokenizer: Any, content: str, *, chat: bool = True,
                     system_prompt: str | None = None) -> str:
    """The prompt text of a user message `content`: rendered with the tokenizer's chat
    template (after an optional system message) when `chat`, else `content` itself."""
    if not chat:
        return content
    messages = [{"role": "user", "content": content}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages)


def encode_prompt(tokenizer: Any, text: str, max_prompt_len: int, what: str,
                  remedy: str = "shorten the prompts") -> tuple[int, ...]:
    """Token ids of a prompt text; ValueError naming `what` (e.g. "a 'chain_sum' prompt")
    and `remedy` when it is longer than max_prompt_len."""
    ids = tuple(tokenizer.encode(text))
    if len(ids) > max_prompt_len:
        raise ValueError(f"{what} has {len(ids)} tokens, more than max_prompt_len="
                         f"{max_prompt_len}: raise max_prompt_len (within the model's "
                         f"context) or {remedy}")
    return ids
