"""Tasks from reasoning-gym (PyPI `reasoning-gym`): 100+ procedural reasoning datasets,
each with its own verifier, generated locally (no download).

    task = ReasoningGymTask({"chain_sum": 1.0, "leg_counting": 1.0}, tokenizer=tok,
                            dataset_options={"chain_sum": {"max_terms": 3}})
    make_task("reasoning_gym:basic_arithmetic", tokenizer=tok, max_terms=2)   # same, by spec

A prompt is the dataset's question plus `instruction` (which fixes the answer form:
one final `\\boxed{...}`), rendered with the tokenizer's chat template. Rewards:

  * "correct": the verdict of the task's verifier on the extracted answer
    (`extract_answer`: the content of the response's last `\\boxed{...}`; without
    one, the last number when the reference is a number, else what follows the last
    "answer is" / "answer:" / "=" (else the last line)). By default ("strict") the
    dataset's own `score_answer(answer, entry)` counted only when it is full credit: 0 or
    1, no partial credit for a wrong answer that merely contains the reference;
    verifier="dataset" gives that score as it is (a float in [0, 1]), and the named
    verifiers of rl.tasks.verifiers apply too. So "correct" measures whether the model got
    it right, and "format" whether it wrote it the documented way;
  * "dataset" (every verifier but "dataset"): the dataset's own score, partial credit
    included, logged beside "correct" and not trained on (`logged_rewards`);
  * "format": 1 only for the documented final-answer form: exactly one `\\boxed{...}`,
    at the very end of the response (trailing whitespace / `.` / `$` allowed); boxing
    every intermediate number earns nothing.
Mixtures: the dataset of stream position i is drawn from rng([seed, split, i]) with
probability weight / sum(weights). Splits: train items come from reasoning-gym seed
`seed * 2**20`, eval items from `seed * 2**20 + 2**19` (reasoning-gym draws item j of
seed s from Random(s + j), so the two ranges never meet for j < 2**19) and, on top,
an item is kept in a split only if a salted hash of its question puts it there
(`in_eval_split`), so a question text can never be in both even when a small problem
space repeats questions.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl.tasks.base import Prompt, chat_prompt_text, check_count, encode_prompt, in_eval_split
from rl.tasks.verifiers import VERIFIERS as NAMED_VERIFIERS
from rl.tasks.verifiers import extract_answer, verify

INSTRUCTION = ("Think briefly if needed, then give the final answer at the end in the form "
               "\\boxed{ANSWER}.")
_SPLIT_STRIDE = 2 ** 20  # reasoning-gym seeds per task seed
_EVAL_OFFSET = 2 ** 19   # eval items start this far into the task seed's range
_MAX_ATTEMPTS = 64       # items tried per stream position until one falls in the split
VERIFIERS = ("strict", "dataset", *NAMED_VERIFIERS)


def dataset_names() -> list[str]:
    """All reasoning-gym dataset names."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _check_dataset(name: str) -> None:
    names = dataset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        hint = f"; close names: {close}" if close else ""
        raise ValueError(f"unknown reasoning-gym dataset {name!r}{hint} (all names: "
                         "rl.tasks.reasoning_gym.dataset_names())")


def parse_mixture(spec: str) -> dict[str, float]:
    """"chain_sum" -> {"chain_sum": 1.0}; "chain_sum=1,leg_counting=2" -> weights."""
    out: dict[str, float] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty dataset name in reasoning-gym spec {spec!r}")
        name, _, weight = part.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"weight of {name!r} in {spec!r} is not a number: {weight!r}") from None
        if name.strip() in out:
            raise ValueError(f"dataset {name.strip()!r} appears twice in {spec!r}")
        out[name.strip()] = w
    return out


def _freeze(mapping: Mapping[str, Any]) -> tuple:
    return tuple(sorted((str(k), v) for k, v in mapping.items()))


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask:
    """datasets: {name: weight} (or a spec string "a=1,b=2"); dataset_options:
    {name: {option: value}} passed to reasoning_gym.create_dataset (for a single
    dataset a flat {option: value} works too); verifier: what "correct" is (VERIFIERS):
    "strict" (default: the dataset's own score_answer counted only when it is full credit,
    so "82 + 16 = 198" earns nothing for 98), "dataset" (that score as it is, with its
    partial credit), or a named verifier of rl.tasks.verifiers on the extracted answer
    and the entry's answer: "exact", "numeric" (tolerance), "math" (math-verify, so
    `\\frac{1}{2}` = `0.5`; timeout math_timeout_s; it checks value, not form: an unreduced
    fraction passes, so use it for sets whose answer is a value) or "regex". With any
    verifier but "dataset" the dataset's own score is a third reward, "dataset", logged and
    not trained on (logged_rewards: weight 0 unless TrainConfig.reward_weights names it);
    tokenizer: models.tokenizer.Tokenizer; seed: the split seed; chat: wrap prompts in the
    chat template; max_prompt_len / max_new_tokens: sampling budget (a longer prompt is a
    clear error)."""

    datasets: Any
    tokenizer: Any = None
    dataset_options: Any = None
    seed: int = 0
    instruction: str = INSTRUCTION
    chat: bool = True
    system_prompt: str | None = None
    eval_fraction: float = 0.5
    max_prompt_len: int = 256
    max_new_tokens: int = 128
    name: str = ""
    verifier: str = "strict"
    math_timeout_s: float = 2.0
    tolerance: float = 1e-6

    def __post_init__(self):
        weights = parse_mixture(self.datasets) if isinstance(self.datasets, str) else dict(
            self.datasets)
        if not weights:
            raise ValueError("ReasoningGymTask needs at least one dataset")
        for n, w in weights.items():
            _check_dataset(n)
            if not (isinstance(w, (int, float)) and np.isfinite(w) and w > 0):
                raise ValueError(f"mixture weight of {n!r} must be > 0, got {w!r}")
        opts = dict(self.dataset_options or {})
        if opts and not all(isinstance(v, Mapping) for v in opts.values()):
            if len(weights) > 1:
                raise ValueError("with several datasets, dataset_options must be "
                                 "{dataset: {option: value}}")
            opts = {next(iter(weights)): opts}
        for n in opts:
            if n not in weights:
                raise ValueError(f"dataset_options names {n!r}, which is not in the mixture "
                                 f"{sorted(weights)}")
        object.__setattr__(self, "datasets", _freeze(weights))
        object.__setattr__(self, "dataset_options",
                           _freeze({n: _freeze(o) for n, o in opts.items()}))
        if not self.name:
            object.__setattr__(self, "name", "reasoning_gym:" + ",".join(
                n if len(weights) == 1 else f"{n}={w:g}" for n, w in self.datasets))
        if self.verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {list(VERIFIERS)} ('strict': the "
                             "dataset's score_answer, full credit only; 'dataset': that score "
                             f"with partial credit), got {self.verifier!r}")
        check_count("ReasoningGymTask.seed", self.seed)
        check_count("ReasoningGymTask.max_prompt_len", self.max_prompt_len, 1)
        check_count("ReasoningGymTask.max_new_tokens", self.max_new_tokens, 1)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        for n, _ in self.datasets:  # options are checked now, not at the first prompt
            self._dataset(n, "train")

    # ------------------------------------------------------------------ data
    @property
    def reward_names(self) -> tuple[str, ...]:
        return ("correct", "format") + self.logged_rewards

    @property
    def logged_rewards(self) -> tuple[str, ...]:
        """Rewards that are logged, not trained on: the dataset's own score beside a
        verifier of another name."""
        return () if self.verifier == "dataset" else ("dataset",)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self._tok().eos_token_ids)

    def _dataset(self, name: str, split: str):
        cache = self.__dict__.setdefault("_cache", {})
        key = (name, split)
        if key not in cache:
            import reasoning_gym

            base = self.seed * _SPLIT_STRIDE + (_EVAL_OFFSET if split == "eval" else 0)
            options = dict(dict(self.dataset_options).get(name, ()))
            try:
                cache[key] = reasoning_gym.create_dataset(name, seed=base, size=_EVAL_OFFSET,
                                                          **options)
            except (TypeError, AssertionError, ValueError) as err:
                raise ValueError(f"reasoning-gym dataset {name!r} rejected options {options}: "
                                 f"{err}") from err
        return cache[key]

    def entries(self, split: str, start: int, count: int) -> list[dict]:
        """Items start .. start + count - 1 of the "train" or "eval" stream (reasoning-gym
        entries: question, answer, metadata; metadata["source_dataset"] names the set).
        The eval stream holds each question once (small problem spaces repeat them), so
        an accuracy on n eval prompts is over n distinct problems."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        check_count("start", start)
        check_count("count", count)
        if split == "eval":
            return self._distinct_eval(start + count)[start:]
        return self._stream(split, start, count)

    def _distinct_eval(self, count: int) -> list[dict]:
        out, seen, i = [], set(), 0
        while len(out) < count:
            if i >= 4 * count + 1000:
                raise ValueError(f"the eval split has fewer than {count} distinct problems "
                                 f"({len(out)} found): ask for fewer eval prompts or widen the "
                                 "dataset options")
            (entry,) = self._stream("eval", i, 1)
            i += 1
            if entry["question"] not in seen:
                seen.add(entry["question"])
                out.append(entry)
        return out

    def _stream(self, split: str, start: int, count: int) -> list[dict]:
        names = [n for n, _ in self.datasets]
        p = np.array([w for _, w in self.datasets], np.float64)
        p = p / p.sum()
        want_eval = split == "eval"
        out = []
        for i in range(start, start + count):
            rng = np.random.default_rng([self.seed, int(want_eval), i])
            name = names[int(rng.choice(len(names), p=p))] if len(names) > 1 else names[0]
            ds = self._dataset(name, split)
            for attempt in range(_MAX_ATTEMPTS):
                j = (i * _MAX_ATTEMPTS + attempt) % _EVAL_OFFSET
                entry = ds[j]
                key = f"{name}|{entry['question']}".encode()
                if in_eval_split(key, self.seed, self.eval_fraction) == want_eval:
                    break
            else:
                raise ValueError(f"no {split} item of {name!r} in {_MAX_ATTEMPTS} tries: the "
                                 "dataset's problem space is too small for a train/eval split")
            entry = dict(entry)
            entry.setdefault("metadata", {})
            entry["metadata"] = {**entry["metadata"], "source_dataset": name}
            out.append(entry)
        return out

    # ------------------------------------------------------------------ prompts
    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("ReasoningGymTask needs a tokenizer for token ids; pass "
                             "tokenizer=models.assets.load_model(...)[2]")
        return self.tokenizer

    def prompt_text(self, entry: dict) -> str:
        content = f"{entry['question'].strip()}\n{self.instruction}"
        return chat_prompt_text(self._tok() if self.chat else None, content, chat=self.chat,
                                system_prompt=self.system_prompt)

    def _prompt(self, entry: dict, index: int) -> Prompt:
        ids = encode_prompt(self._tok(), self.prompt_text(entry), self.max_prompt_len,
                            f"a {entry['metadata']['source_dataset']!r} prompt",
                            "pick smaller dataset options")
        return Prompt(ids=ids, answer=entry, text=entry["question"], index=index)

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        return [self._prompt(e, start + k) for k, e in enumerate(self.entries("train", start,
                                                                               count))]

    def eval_prompts(self, count: int) -> list[Prompt]:
        return [self._prompt(e, k) for k, e in enumerate(self.entries("eval", 0, count))]

    # ------------------------------------------------------------------ verifier
    def rewards_of_text(self, text: str, entry: dict) -> dict[str, float]:
        """{"correct", "format"} of a response text for a reasoning-gym entry."""
        from rl.tasks.math_answers import has_final_boxed_format

        answer = extract_answer(text, str(entry["answer"]))
        name = entry["metadata"]["source_dataset"]
        score = 0.0
        if answer is not None:
            score = float(self._dataset(name, "train").score_answer(answer, entry))
        out = {"correct": score, "format": float(has_final_boxed_format(text))}
        if self.verifier == "dataset":
            return out
        if self.verifier == "strict":
            out["correct"] = float(score == 1.0)
        else:
            out["correct"] = verify(self.verifier, answer, str(entry["answer"]),
                                    tolerance=self.tolerance, timeout_s=self.math_timeout_s)
        out["dataset"] = score
        return out

    def reward(self, prompt: Prompt, response: Sequence[int] | str) -> dict[str, float]:
        text = response if isinstance(response, str) else self._tok().decode(list(response))
        return self.rewards_of_text(text, prompt.answer)

    def describe(self, prompt: Prompt, response: Sequence[int]) -> str:
        text = self._tok().decode(list(response))
        return f"{prompt.text!r} -> {text!r} (want {prompt.answer['answer']!r})"



_TASK_FIELDS = {f.name for f in dataclasses.fields(ReasoningGymTask)}


def make_reasoning_gym_task(datasets: Any, **kwargs) -> ReasoningGymTask:
    """ReasoningGymTask with reasoning-gym options given flat: for one dataset any
    keyword that is not a task field is a dataset option (`max_terms=2`); in a mixture
    prefix it with the dataset (`**{"chain_sum.max_terms": 2}`)."""
    weights = parse_mixture(datasets) if isinstance(datasets, str) else dict(datasets)
    options = {n: dict(o) for n, o in dict(kwargs.pop("dataset_options", None) or {}).items()}
    for key in [k for k in kwargs if k not in _TASK_FIELDS]:
        dataset, dot, option = key.rpartition(".")
        if not dot:
            if len(weights) > 1:
                raise ValueError(f"option {key!r} is ambiguous in a mixture: write "
                                 f"'<dataset>.{key}' (datasets: {sorted(weights)})")
            dataset, option = next(iter(weights)), key
        options.setdefault(dataset, {})[option] = kwargs.pop(key)
    return ReasoningGymTask(weights, dataset_options=options, **kwargs)
