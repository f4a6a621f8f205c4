"""Guess the number: a multi-turn game the `tiny` model learns from scratch, tokenizer-free.

Rules. A hidden number x is drawn uniformly from [0, K). Each model turn is ONE token, a
guess; the environment answers with one feedback token: "higher" (x > guess), "lower"
(x < guess), or "invalid" (the token is not a number; the turn is spent). A correct guess
ends the episode; so do `max_turns` = T turns without it. A single turn finds x with
probability at most 1/K, so the game needs the feedback: the optimal policy is binary
search.

Token ids (the model's vocabulary is `vocab_size` = 8 + K):
    0 PAD, 1 BOS, 2 EOS (unused), 3 SEP, 4 HIGHER, 5 LOWER, 6 INVALID, 7 (reserved),
    8 .. 8 + K - 1 the numbers 0 .. K - 1.
Episode tokens: prompt [BOS, SEP], then guess, feedback, guess, feedback, ..., guess.
Every prompt is the same [BOS, SEP]: the hidden number lives in `Prompt.answer` only.
The codec: `decode_turn([8 + g]) == "g"` (other ids -> "<id>"), `encode_observation`
maps "higher" / "lower" / "invalid" to their single ids. Turns have no stop id
(`max_turn_tokens` = 1).

Reward ("score", once per episode; the turn that finds x carries it, other turns 0):
    reward="graded" (the default):  score = 1 - (t - 1) / T  if x is found at turn t
                                    (1 <= t <= T), 0 otherwise;
    reward="found":                 score = 1 if x is found within T turns, else 0
                                    (a binary outcome: groups whose episodes all fail or
                                    all succeed are common, TRACE's regime).

Baselines, exact (`random_expected_score`, `consistent_random_expected_score`,
`optimal_expected_score`; all averaged over the uniform hidden number; with graded=False
the found-within-T probability, each turn's value 1 in place of 1 - (t - 1) / T):

  * a policy guessing uniformly among `choices` tokens every turn, ignoring feedback,
    of which exactly one is x (choices = K: uniform over the numbers; choices =
    vocab_size: uniform over the whole vocabulary, an untrained model's policy): the
    first hit is geometric with p = 1 / choices, so
        E[score] = sum_{t=1..T} (1 - p)^(t-1) p (1 - (t - 1) / T);
  * a policy guessing uniformly among the numbers still consistent with the feedback:
    exact recursion over the interval size (memoised, in fractions);
  * the optimum: at most 2^(d-1) hidden values can be found at turn d (each found value
    is a distinct node of the binary higher/lower decision tree), so the best policy
    (binary search, a complete search tree) finds the i-th value of breadth-first order
    at turn floor(log2 i) + 1:
        E[score] = (1 / K) sum_{i=1..min(K, 2^T - 1)} (1 - floor(log2 i) / T).
    K = 8, T = 4: random over numbers 0.2758, over the 16-token vocabulary 0.1467,
    consistent-random 0.4831, optimal 0.5938. Found within T = 3 (reward="found"): random
    over numbers 0.3301, over the vocabulary 0.1760, consistent-random 0.6192, optimal
    0.875 (7 of 8 values).

Splits: prompts carry no content, so the eval split is the hidden values themselves:
eval prompt j has x = j mod K (every value equally often, so a mean over a multiple of K
eval episodes is the exact expectation over x); train position i draws x from
rng([seed, 0, i]).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from rl.envs.base import StepResult
from rl.tasks.base import Prompt, check_count

PAD, BOS, EOS, SEP, HIGHER, LOWER, INVALID = 0, 1, 2, 3, 4, 5, 6
FIRST_NUMBER = 8
FEEDBACK = {"higher": HIGHER, "lower": LOWER, "invalid": INVALID}
MAX_K = 1024


def turn_value(turn: int, max_turns: int, graded: bool = True) -> Fraction:
    """The score of finding x at `turn`: 1 - (turn - 1) / T graded, else 1."""
    return 1 - Fraction(turn - 1, max_turns) if graded else Fraction(1)


def random_expected_score(choices: int, max_turns: int, graded: bool = True) -> float:
    """Exact E[score] of guessing uniformly among `choices` tokens (one of them the hidden
    number) every turn, ignoring feedback: sum_t (1-p)^(t-1) p value(t), p = 1/choices
    (value(t) = 1 - (t-1)/T graded, else 1: the chance to find x within T turns)."""
    check_count("choices", choices, 1)
    check_count("max_turns", max_turns, 1)
    p, total = Fraction(1, choices), Fraction(0)
    for t in range(1, max_turns + 1):
        total += (1 - p) ** (t - 1) * p * turn_value(t, max_turns, graded)
    return float(total)


def consistent_random_expected_score(k: int, max_turns: int, graded: bool = True) -> float:
    """Exact E[score] of guessing uniformly among the numbers still consistent with the
    feedback (a uniformly random search tree), x uniform in [0, k); graded as above."""
    check_count("k", k, 1)
    check_count("max_turns", max_turns, 1)

    @functools.lru_cache(maxsize=None)
    def f(n: int, turn: int) -> Fraction:  # x uniform over an interval of n candidates
        if n == 0 or turn > max_turns:
            return Fraction(0)
        hit = Fraction(1, n) * turn_value(turn, max_turns, graded)
        rest = sum(Fraction(j, n) * f(j, turn + 1) + Fraction(n - 1 - j, n) * f(n - 1 - j, turn + 1)
                   for j in range(n)) / n
        return hit + rest

    return float(f(k, 1))


def optimal_expected_score(k: int, max_turns: int, graded: bool = True) -> float:
    """Exact E[score] of the best policy (binary search): the i-th value in breadth-first
    order of a complete search tree is found at turn floor(log2 i) + 1 (not graded: the
    min(k, 2^T - 1) values found within T turns, over k)."""
    check_count("k", k, 1)
    check_count("max_turns", max_turns, 1)
    found = min(k, 2 ** max_turns - 1)
    total = sum(turn_value(i.bit_length(), max_turns, graded) for i in range(1, found + 1))
    return float(total / k)


class GuessEpisode:
    """One game's state: the hidden number, turns taken, whether it was found (graded:
    the score falls with the turn that finds it; else 1 when found)."""

    def __init__(self, hidden: int, k: int, max_turns: int, graded: bool = True):
        self.hidden, self.k, self.max_turns, self.graded = hidden, k, max_turns, graded
        self.turns = 0
        self.found_at: int | None = None

    def score(self) -> float:
        if self.found_at is None:
            return 0.0
        return 1.0 - (self.found_at - 1) / self.max_turns if self.graded else 1.0

    def step(self, turn_text: str) -> StepResult:
        """turn_text: decode_turn of the turn's one token ("3", or "<5>" for a non-number)."""
        if self.found_at is not None or self.turns >= self.max_turns:
            raise ValueError("GuessEpisode.step after the episode ended")
        self.turns += 1
        text = turn_text.strip()
        guess = int(text) if text.isdigit() and int(text) < self.k else None
        info = {"guess": guess, "turn": self.turns}
        if guess == self.hidden:
            self.found_at = self.turns
            return StepResult("", self.score(), True, {**info, "found": True})
        done = self.turns >= self.max_turns
        if guess is None:
            obs = "invalid"
        else:
            obs = "higher" if self.hidden > guess else "lower"
        return StepResult(obs, 0.0, done, {**info, "found": False})

    def outcome(self) -> dict[str, float]:
        return {"score": self.score()}


@dataclasses.dataclass(frozen=True)
class GuessNumberEnv:
    """k: numbers 0 .. k-1 (K); max_turns: T guesses per episode; seed: the train stream;
    reward: "graded" (1 - (t - 1) / T at the turn t that finds x) or "found" (1 when x is
    found within T turns); either way the episode's one reward is named "score"."""

    k: int = 8
    max_turns: int = 4
    seed: int = 0
    reward: str = "graded"
    name: str = "guess_number"

    def __post_init__(self):
        check_count("GuessNumberEnv.k", self.k, 2)
        if self.k > MAX_K:
            raise ValueError(f"GuessNumberEnv.k must be <= {MAX_K}, got {self.k}")
        check_count("GuessNumberEnv.max_turns", self.max_turns, 1)
        check_count("GuessNumberEnv.seed", self.seed)
        if self.reward not in ("graded", "found"):
            raise ValueError(f"GuessNumberEnv.reward must be 'graded' or 'found', got "
                             f"{self.reward!r}")

    # ------------------------------------------------------------------ geometry
    @property
    def vocab_size(self) -> int:
        """Model vocabulary the game needs: 8 special ids + the K numbers."""
        return FIRST_NUMBER + self.k

    @property
    def reward_names(self) -> tuple[str, ...]:
        return ("score",)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def max_turn_tokens(self) -> int:
        return 1

    @property
    def max_prompt_len(self) -> int:
        return 2

    @property
    def max_episode_tokens(self) -> int:
        """Prompt + T guesses + T - 1 feedback tokens, plus 1 spare."""
        return self.max_prompt_len + 2 * self.max_turns

    # ------------------------------------------------------------------ baselines
    def random_baseline(self, over: str = "numbers") -> float:
        """Exact E[score] of a feedback-blind uniform policy over "numbers" (K) or the
        whole "vocab" (vocab_size ids: what an untrained model roughly does)."""
        if over not in ("numbers", "vocab"):
            raise ValueError(f"over must be 'numbers' or 'vocab', got {over!r}")
        return random_expected_score(self.k if over == "numbers" else self.vocab_size,
                                     self.max_turns, self.graded)

    def consistent_random_baseline(self) -> float:
        return consistent_random_expected_score(self.k, self.max_turns, self.graded)

    def optimal_score(self) -> float:
        return optimal_expected_score(self.k, self.max_turns, self.graded)

    @property
    def graded(self) -> bool:
        return self.reward == "graded"

    # ------------------------------------------------------------------ prompts
    def _prompt(self, hidden: int, index: int) -> Prompt:
        return Prompt(ids=(BOS, SEP), answer=hidden, text=f"x={hidden}", index=index)

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        """Train stream positions start .. start + count - 1: x from rng([seed, 0, i])."""
        check_count("start", start)
        check_count("count", count)
        return [self._prompt(int(np.random.default_rng([self.seed, 0, i]).integers(self.k)), i)
                for i in range(start, start + count)]

    def eval_prompts(self, count: int) -> list[Prompt]:
        """Eval prompt j hides x = j mod K (each value equally often)."""
        check_count("count", count)
        return [self._prompt(j % self.k, j) for j in range(count)]

    # ------------------------------------------------------------------ episodes + codec
    def reset(self, prompt: Prompt) -> GuessEpisode:
        hidden = prompt.answer
        if isinstance(hidden, bool) or not isinstance(hidden, int) or not 0 <= hidden < self.k:
            raise ValueError(f"GuessNumberEnv prompt.answer must be an int in [0, {self.k}), "
                             f"got {hidden!r}")
        return GuessEpisode(hidden, self.k, self.max_turns, self.graded)

    def decode_turn(self, ids: Sequence[int]) -> str:
        """Number ids -> their decimal value; any other id -> "<id>"; space-joined."""
        out = []
        for t in ids:
            t = int(t)
            out.append(str(t - FIRST_NUMBER) if FIRST_NUMBER <= t < self.vocab_size else f"<{t}>")
        return " ".join(out)

    def encode_observation(self, text: str) -> list[int]:
        """"higher" / "lower" / "invalid" -> its one id."""
        if text not in FEEDBACK:
            raise ValueError(f"guess_number observations are {sorted(FEEDBACK)}, got {text!r}")
        return [FEEDBACK[text]]

    def describe(self, prompt: Prompt, turns: Sequence[str]) -> str:
        return f"x={prompt.answer}: guesses {' '.join(turns)}"
