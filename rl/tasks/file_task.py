"""A task from a prompt file of your own: JSONL, JSON, CSV or Parquet, with a question and
an answer column (GSM8K / MATH style), read with Hugging Face `datasets` from local files
only (no network; no cache left behind).

    task = FileTask("data/train.jsonl", tokenizer=tok, question="problem", answer="solution")
    task = make_task("file:data/gsm8k_train.parquet", tokenizer=tok, eval_path="data/test.parquet")

Columns: `question` and `answer` name the question and reference-answer columns (default
"question" / "answer"); `system` optionally names a column holding each row's system
prompt (else `system_prompt`, one for all rows, or none). The answer column is read with
`answer_format` (rl.tasks.verifiers.parse_reference): "gsm8k" takes what follows "####",
"boxed" the last \\boxed{...}, "plain" the text, "auto" (default) the first that applies.

Checks when the task is built, each a ValueError naming the file and the row (1-based, in
file order): a missing file, an unknown format, a missing column (the columns there are
listed), an empty question, an answer the format finds nothing in, the same question twice
with different answers, a regex reference that does not compile (verifier "regex"), a
prompt longer than max_prompt_len (all rows are encoded up front when a tokenizer is
given), an empty train or eval split.

Rows: one entry per distinct question (whitespace-normalised; repeats with the same answer
are dropped, `duplicates` counts them): {"question", "answer" (the parsed reference),
"system", "row" (the file's row as read), "source" ("FILE:ROW")}; the prompt's answer is
that entry, which a reward function receives.

Split: with `eval_path`, that file is the eval split and any train row whose question is
also there is dropped (`overlap` counts them); without it, a salted hash of the question
(rl.tasks.base.in_eval_split, seed) puts about `eval_fraction` of the rows in eval, the
same split on every run with that seed. The train stream visits every train row once per
epoch in an order shuffled per epoch (rng([seed, epoch])); the eval split is in file order
(eval_prompts(n) gives at most all of it).

Prompt: the question, then `instruction` on a new line (default: give the final answer in
\\boxed{}), rendered with the tokenizer's chat template (chat=True; after the system
prompt). Rewards: "correct" = the verifier (rl.tasks.verifiers: "math" by default,
"exact", "numeric" with `tolerance`, "regex") on the response's extracted answer
(extract_answer) against the reference; "format" = exactly one final \\boxed{}, logged and
not trained on (`logged_rewards`: weight 0 unless TrainConfig.reward_weights names it), as
smollm2-rg found a format reward teaching a model to box a bare guess.
"""
from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rl.tasks.base import Prompt, chat_prompt_text, check_count, encode_prompt, in_eval_split
from rl.tasks.math_answers import has_final_boxed_format
from rl.tasks.verifiers import VERIFIERS, extract_answer, parse_reference, verify

INSTRUCTION = ("Think briefly if needed, then give the final answer at the end in the form "
               "\\boxed{ANSWER}.")
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
FILE_PREFIX = "file:"


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a local JSONL / JSON (a list of objects, or one object per line) / CSV /
    Parquet file as dicts, read with HF `datasets` (its cache in a temporary directory,
    removed afterwards). ValueError for a missing file, another suffix or an unreadable
    file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} not found (working directory "
                         f"{str(Path.cwd())!r})")
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"prompt file {str(path)!r}: unknown format {path.suffix!r}; use one "
                         f"of {sorted(FORMATS)}")
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-datasets-") as cache:
            try:
                ds = datasets.load_dataset(builder, data_files=str(path.absolute()),
                                           split="train", cache_dir=cache)
            except Exception as err:  # datasets raises many types for a malformed file
                raise ValueError(f"prompt file {str(path)!r} could not be read as "
                                 f"{builder} ({type(err).__name__}: {str(err)[:300]})") from err
            rows = ds.to_list()
    finally:
        if bars:
            datasets.enable_progress_bars()
    if not rows:
        raise ValueError(f"prompt file {str(path)!r} holds no rows")
    return rows


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


def question_key(question: str) -> str:
    """What makes two questions the same: their words (whitespace-normalised)."""
    return " ".join(question.split())


@dataclasses.dataclass(frozen=True)
class FileTask:
    """A prompt file as a task (module docstring). path / eval_path: the train file and an
    optional eval file; question / answer / system: column names; system_prompt: one
    system prompt for all rows; answer_format: how the answer column is read; verifier /
    tolerance / math_timeout_s: what "correct" is; seed: the split and shuffle seed;
    eval_fraction: the hashed split's eval share; instruction, chat: the prompt;
    max_prompt_len / max_new_tokens: the sampling budget."""

    path: str
    tokenizer: Any = None
    seed: int = 0
    question: str = "question"
    answer: str = "answer"
    system: str | None = None
    system_prompt: str | None = None
    answer_format: str = "auto"
    eval_path: str | None = None
    eval_fraction: float = 0.1
    instruction: str = INSTRUCTION
    chat: bool = True
    max_prompt_len: int = 256
    max_new_tokens: int = 256
    verifier: str = "math"
    tolerance: float = 1e-6
    math_timeout_s: float = 2.0
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "path", str(self.path))
        if self.eval_path is not None:
            object.__setattr__(self, "eval_path", str(self.eval_path))
        if self.verifier not in VERIFIERS:
            raise ValueError(f"FileTask.verifier must be one of {list(VERIFIERS)}, got "
                             f"{self.verifier!r}")
        parse_reference("x", self.answer_format)  # validates the name
        check_count("FileTask.seed", self.seed)
        check_count("FileTask.max_prompt_len", self.max_prompt_len, 1)
        check_count("FileTask.max_new_tokens", self.max_new_tokens, 1)
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"FileTask.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance >= 0):
            raise ValueError(f"FileTask.tolerance must be a number >= 0, got {self.tolerance!r}")
        if not self.name:
            object.__setattr__(self, "name", FILE_PREFIX + self.path)
        train, dup = self._entries(self.path)
        if self.eval_path is None:
            flags = [in_eval_split(question_key(e["question"]).encode(), self.seed,
                                   self.eval_fraction) for e in train]
            evals = [e for e, f in zip(train, flags) if f]
            train = [e for e, f in zip(train, flags) if not f]
            overlap = 0
        else:
            evals, dup_eval = self._entries(self.eval_path)
            dup += dup_eval
            held_out = {question_key(e["question"]) for e in evals}
            kept = [e for e in train if question_key(e["question"]) not in held_out]
            train, overlap = kept, len(train) - len(kept)
        for split, entries in (("train", train), ("eval", evals)):
            if not entries:
                how = (f"{self.eval_path!r}" if split == "eval" and self.eval_path else
                       f"the hashed split (eval_fraction={self.eval_fraction}) of {self.path!r}"
                       if self.eval_path is None else f"{self.path!r} minus the eval questions")
                raise ValueError(f"the {split} split of {how} is empty: give more rows, change "
                                 "eval_fraction, or pass an eval file (eval_path)")
        self.__dict__.update(_train=train, _eval=evals, duplicates=dup, overlap=overlap,
                             _orders={})
        if self.tokenizer is not None:  # every prompt fits, checked now
            for e in train + evals:
                self._ids(e)

    # ------------------------------------------------------------------ rows
    def _entries(self, path: str) -> tuple[list[dict], int]:
        """(distinct entries of a file, how many repeated rows were dropped)."""
        rows = read_rows(path)
        columns = list(rows[0])
        wanted = [c for c in (self.question, self.answer, self.system) if c is not None]
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise ValueError(f"prompt file {path!r} has no column {missing[0]!r}; its columns "
                             f"are {columns} (map yours with the options question=, answer=, "
                             "system=)")
        out: list[dict] = []
        first: dict[str, dict] = {}
        for i, row in enumerate(rows, start=1):
            where = f"{path}:{i}"
            question = _text(row[self.question])
            if not question:
                raise ValueError(f"row {i} of {path!r} has an empty question "
                                 f"(column {self.question!r})")
            raw = row[self.answer]
            answer = None if raw is None else parse_reference(_text(raw), self.answer_format)
            if answer is None:
                raise ValueError(f"row {i} of {path!r} has no answer: column {self.answer!r} "
                                 f"holds {raw!r}, in which answer_format={self.answer_format!r} "
                                 "finds nothing")
            if self.verifier == "regex":
                from rl.tasks.verifiers import regex_match

                try:
                    regex_match("", answer)
                except ValueError as err:
                    raise ValueError(f"row {i} of {path!r}: {err}") from None
            system = self.system_prompt if self.system is None else (_text(row[self.system])
                                                                     or None)
            key = question_key(question)
            seen = first.get(key)
            if seen is not None:
                if seen["answer"] != answer:
                    raise ValueError(f"rows {seen['source'].rsplit(':', 1)[1]} and {i} of "
                                     f"{path!r} ask the same question with different answers "
                                     f"({seen['answer']!r} and {answer!r}); fix the file")
                continue
            entry = {"question": question, "answer": answer, "system": system,
                     "row": dict(row), "source": where}
            first[key] = entry
            out.append(entry)
        return out, len(rows) - len(out)

    @property
    def sizes(self) -> dict[str, int]:
        """{"train", "eval", "duplicates", "overlap"}: rows per split, and what was dropped."""
        return {"train": len(self._train), "eval": len(self._eval),
                "duplicates": self.duplicates, "overlap": self.overlap}

    # ------------------------------------------------------------------ prompts
    @property
    def reward_names(self) -> tuple[str, ...]:
        return ("correct", "format")

    @property
    def logged_rewards(self) -> tuple[str, ...]:
        return ("format",)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self._tok().eos_token_ids)

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("FileTask needs a tokenizer for token ids; pass "
                             "tokenizer=models.assets.load_model(...)[2]")
        return self.tokenizer

    def prompt_text(self, entry: dict) -> str:
        content = entry["question"] + (f"\n{self.instruction}" if self.instruction else "")
        return chat_prompt_text(self._tok() if self.chat else None, content, chat=self.chat,
                                system_prompt=entry["system"])

    def _ids(self, entry: dict) -> tuple[int, ...]:
        if "_ids" not in entry:
            entry["_ids"] = encode_prompt(self._tok(), self.prompt_text(entry),
                                          self.max_prompt_len,
                                          f"the prompt of row {entry['source']}",
                                          "shorten the question")
        return entry["_ids"]

    def _prompt(self, entry: dict, index: int) -> Prompt:
        answer = {k: v for k, v in entry.items() if k != "_ids"}
        return Prompt(ids=self._ids(entry), answer=answer, text=entry["question"], index=index)

    def _order(self, epoch: int) -> np.ndarray:
        orders = self.__dict__["_orders"]
        if epoch not in orders:
            if len(orders) > 4:
                orders.clear()
            orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self._train))
        return orders[epoch]

    def train_prompts(self, start: int, count: int) -> list[Prompt]:
        check_count("start", start)
        check_count("count", count)
        n = len(self._train)
        return [self._prompt(self._train[int(self._order(i // n)[i % n])], i)
                for i in range(start, start + count)]

    def eval_prompts(self, count: int) -> list[Prompt]:
        check_count("count", count)
        return [self._prompt(e, k) for k, e in enumerate(self._eval[:count])]

    # ------------------------------------------------------------------ verifier
    def rewards_of_text(self, text: str, entry: dict) -> dict[str, float]:
        """{"correct", "format"} of a response text for an entry."""
        answer = extract_answer(text, entry["answer"])
        correct = verify(self.verifier, answer, entry["answer"], tolerance=self.tolerance,
                         timeout_s=self.math_timeout_s)
        return {"correct": correct, "format": float(has_final_boxed_format(text))}

    def reward(self, prompt: Prompt, response: Sequence[int] | str) -> dict[str, float]:
        text = response if isinstance(response, str) else self._tok().decode(list(response))
        return self.rewards_of_text(text, prompt.answer)

    def describe(self, prompt: Prompt, response: Sequence[int]) -> str:
        text = self._tok().decode(list(response))
        return f"{prompt.text!r} -> {text!r} (want {prompt.answer['answer']!r})"


def make_file_task(path: str, **kwargs) -> FileTask:
    """FileTask(path, **kwargs), the "file:PATH" spec of rl.tasks.make_task."""
    if not path:
        raise ValueError("a file task needs a path: write 'file:PATH' (JSONL, JSON, CSV or "
                         "Parquet)")
    unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(FileTask)})
    if unknown:
        raise ValueError(f"file task: unknown option(s) {unknown}; the options are "
                         f"{sorted(f.name for f in dataclasses.fields(FileTask))}")
    return FileTask(path, **kwargs)
