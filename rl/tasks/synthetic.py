"""A symbol-sequence task the `tiny` model learns from scratch by RL, tokenizer-free.

Prompt: [BOS, s_1 .. s_k, SEP] with k symbols from an alphabet of A; the response is
k·repeats tokens (the sampler's budget; no stop id) and should be f(s) written `repeats`
times: f = "copy" (s itself), "reverse" (s_k .. s_1) or "shift" (s_i + 1 mod A,
position-wise); "count" counts on from s_1 instead (s_1 + 1, s_1 + 2, ... mod A for all
k·repeats tokens: each token follows from the one before, a rule a tiny model learns fast). Reward "correct" = fraction of the k·repeats positions right, so a random
policy earns partial, per-position credit: 1 / vocab_size per position for a uniform
policy over the whole vocabulary (the vocabulary is the alphabet plus 4 special ids, kept
tiny on purpose). repeats > 1 makes long responses (32-128 tokens) from short prompts:
the off-policy testbed (experiments/repro/staleness_testbed.py), where log-ratio tails
grow with the response.

Token ids: 0 pad, 1 BOS, 2 EOS (unused by the task), 3 SEP, symbols 4 .. 4 + A - 1.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from rl.tasks.base import Prompt, check_count, in_eval_split

PAD, BOS, EOS, SEP = 0, 1, 2, 3
FIRST_SYMBOL = 4
KINDS = ("copy", "reverse", "shift", "count")
ENUMERATED = 1_000_000  # up to this many sequences (A^k) the eval split is listed whole


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """kind: "copy" | "reverse" | "shift" | "count"; length: k symbols; alphabet: A symbols;
    seed: fixes the train/eval split and both streams; eval_fraction: share of all A^k
    sequences held out for eval; repeats: f(s) written this many times (the response is
    k·repeats tokens)."""

    kind: str = "reverse"
    length: int = 4
    alphabet: int = 4
    seed: int = 0
    eval_fraction: float = 0.125
    name: str = "synthetic"
    repeats: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"SyntheticTask.kind must be one of {KINDS}, got {self.kind!r}")
        check_count("SyntheticTask.length", self.length, 1)
        check_count("SyntheticTask.alphabet", self.alphabet, 2)
        check_count("SyntheticTask.repeats", self.repeats, 1)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"SyntheticTask.eval_fraction must be in (0, 1), got {self.eval_fraction}")

    # ------------------------------------------------------------------ geometry
    @property
    def vocab_size(self) -> int:
        """Model vocabulary the task needs: 4 special ids + the alphabet."""
        return FIRST_SYMBOL + self.alphabet

    @property
    def reward_names(self) -> tuple[str, ...]:
        return ("correct",)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def max_prompt_len(self) -> int:
        return self.length + 2

    @property
    def max_new_tokens(self) -> int:
        return self.length * self.repeats

    def random_baseline(self) -> float:
        """Expected reward of a policy uniform over the whole vocabulary."""
        return 1.0 / self.vocab_size

    # ------------------------------------------------------------------ data
    def target(self, symbols: Sequence[int]) -> tuple[int, ...]:
        """f(s) written `repeats` times, for symbols given as 0-based alphabet indices."""
        s = tuple(int(x) for x in symbols)
        if self.kind == "count":
            return tuple((s[0] + 1 + j) % self.alphabet for j in range(self.max_new_tokens))
        if self.kind == "copy":
            f = s
        elif self.kind == "reverse":
            f = s[::-1]
        else:
            f = tuple((x + 1) % self.alphabet for x in s)
        return f * self.repeats

    def _is_eval(self, symbols: tuple[int, ...]) -> bool:
        return in_eval_split(bytes(symbols), self.seed, self.eval_fraction)

    def _prompt(self, symbols: tuple[int, ...], index: int) -> Prompt:
        ids = (BOS,) + tuple(FIRST_SYMBOL + x for x in symbols) + (SEP,)
        text = " ".join(map(str, symbols))
        return Prompt(ids=ids, answer=self.target(symbols), text=text, index=index)

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        """Positions start .. start + count - 1 of the train stream: position i draws
        sequences from rng([seed, i]) until one is outside the eval split."""
        check_count("start", start)
        check_count("count", count)
        out = []
        for i in range(start, start + count):
            rng = np.random.default_rng([self.seed, 0, i])
            while True:
                s = tuple(int(x) for x in rng.integers(0, self.alphabet, self.length))
                if not self._is_eval(s):
                    break
            out.append(self._prompt(s, i))
        return out

    def eval_sequences(self, count: int | None = None) -> list[tuple[int, ...]]:
        """Eval-split sequences in a seeded order: every one when there are at most
        ENUMERATED sequences in all (A^k), else the first `count` distinct ones drawn from
        rng([seed, 1]) (a space too large to list)."""
        if self.alphabet ** self.length <= ENUMERATED:
            items = [s for s in itertools.product(range(self.alphabet), repeat=self.length)
                     if self._is_eval(s)]
            order = np.random.default_rng([self.seed, 1]).permutation(len(items))
            return [items[i] for i in order]
        rng, seen, out = np.random.default_rng([self.seed, 1]), set(), []
        while len(out) < (count or 1):
            s = tuple(int(x) for x in rng.integers(0, self.alphabet, self.length))
            if s not in seen and self._is_eval(s):
                seen.add(s)
                out.append(s)
        return out

    def eval_prompts(self, count: int) -> list[Prompt]:
        """The first `count` eval items (cycling if count exceeds the split's size)."""
        check_count("count", count)
        items = self.eval_sequences(count)
        if not items:
            raise ValueError("the eval split is empty; raise eval_fraction or the alphabet/length")
        return [self._prompt(items[j % len(items)], j) for j in range(count)]

    # ------------------------------------------------------------------ verifier
    def reward(self, prompt: Prompt, response: Sequence[int] | str) -> dict[str, float]:
        """{"correct": fraction of the k·repeats positions where response token == target};
        missing positions count as wrong, extra tokens are ignored."""
        if isinstance(response, str):
            raise ValueError("SyntheticTask.reward takes response token ids, not text")
        n = self.max_new_tokens
        resp = [int(t) for t in response][:n]
        want = [FIRST_SYMBOL + x for x in prompt.answer]
        hits = sum(int(a == b) for a, b in zip(resp, want))
        return {"correct": hits / n}

    def describe(self, prompt: Prompt, response: Sequence[int]) -> str:
        def sym(t):
            t = int(t)
            return str(t - FIRST_SYMBOL) if t >= FIRST_SYMBOL else "<%d>" % t
        return f"{prompt.text} -> {' '.join(sym(t) for t in response)} (want {' '.join(map(str, prompt.answer))})"
