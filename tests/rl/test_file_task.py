"""File tasks (rl.tasks.file_task) on the hand-written prompt files in tests/data/byo/: each
format read (JSONL, JSON, CSV, Parquet: the same rows as the JSONL they were made from),
column mapping, the GSM8K and \\boxed{} answer columns, the split by salted hash (checked
against in_eval_split computed here) or by two files, dedupe, prompts through the chat
template, rewards, and a clear error for each bad input."""
import json
from pathlib import Path

import pytest

from models.assets import load_tokenizer
from models.tiny_hf import write_tiny_model
from rl.tasks import make_task
from rl.tasks.base import in_eval_split
from rl.tasks.file_task import FileTask, read_rows

DATA = Path(__file__).resolve().parents[1] / "data" / "byo"
JSONL = DATA / "problems.jsonl"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_tiny_model(tmp_path_factory.mktemp("tiny")))


def jsonl_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_format_reads_the_rows_as_written():
    rows = jsonl_rows(JSONL)
    assert read_rows(JSONL) == rows
    assert read_rows(DATA / "problems.parquet") == rows[:8]  # made from the first 8
    assert read_rows(DATA / "math_style.json") == json.loads((DATA / "math_style.json").read_text())
    csv = read_rows(DATA / "problems.csv")
    assert [r["question"] for r in csv] == ["What is 2 + 3?", "What is 7 - 4?",
                                            "What is 6 times 7?", "What is 1,000 + 1?"]
    assert [r["answer"] for r in csv] == ["5", "3", "42", "1,001"]
    assert csv[0]["system"] == "You are a careful calculator." and csv[1]["system"] is None


def test_hashed_split_dedupe_and_stream(tok):
    task = FileTask(str(JSONL), tokenizer=tok, seed=3, eval_fraction=0.3, verifier="exact")
    rows = jsonl_rows(JSONL)
    distinct = list(dict.fromkeys(r["question"] for r in rows))
    assert task.duplicates == len(rows) - len(distinct) == 1  # "What is 2 + 3?" twice
    want_eval = [q for q in distinct if in_eval_split(q.encode(), 3, 0.3)]
    want_train = [q for q in distinct if q not in want_eval]
    assert [p.text for p in task.eval_prompts(100)] == want_eval  # file order, all of it
    assert task.sizes == {"train": len(want_train), "eval": len(want_eval), "duplicates": 1,
                          "overlap": 0}
    n = len(want_train)
    stream = task.train_prompts(0, 3 * n)
    for epoch in range(3):  # each epoch visits every train row once
        assert sorted(p.text for p in stream[epoch * n:(epoch + 1) * n]) == sorted(want_train)
    assert [p.index for p in stream] == list(range(3 * n))
    assert [p.text for p in task.train_prompts(n + 1, 2)] == [p.text for p in stream[n + 1:n + 3]]
    assert [p.text for p in stream[:n]] != [p.text for p in stream[n:2 * n]]  # reshuffled
    other = FileTask(str(JSONL), tokenizer=tok, seed=4, eval_fraction=0.3, verifier="exact")
    assert [p.text for p in other.eval_prompts(100)] != want_eval  # the seed salts the split


def test_two_files_split_and_overlap_is_dropped(tok):
    task = make_task(f"file:{JSONL}", tokenizer=tok, eval_path=str(DATA / "eval.jsonl"))
    assert [p.text for p in task.eval_prompts(10)] == ["What is 5 + 5?", "What is 9 - 3?",
                                                       "What is 2 + 3?"]
    train = {p.text for p in task.train_prompts(0, task.sizes["train"])}
    assert "What is 2 + 3?" not in train and task.sizes["overlap"] == 1
    assert task.sizes["train"] == 15 - 1 and task.name == f"file:{JSONL}"


def test_prompts_go_through_the_chat_template(tok):
    task = FileTask(str(DATA / "problems.csv"), tokenizer=tok, system="system",
                    eval_fraction=0.5, instruction="Answer in \\boxed{}.")
    by_text = {p.text: p for p in task.train_prompts(0, 4) + task.eval_prompts(4)}
    p = by_text["What is 2 + 3?"]
    want = ("<|im_start|>system\nYou are a careful calculator.<|im_end|>\n<|im_start|>user\n"
            "What is 2 + 3?\nAnswer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(p.ids, skip_special_tokens=False) == want
    assert p.answer["system"] == "You are a careful calculator."
    assert p.answer["source"].endswith(":1")
    no_system = by_text["What is 7 - 4?"]  # an empty system cell: no system message
    assert tok.decode(no_system.ids, skip_special_tokens=False).startswith("<|im_start|>user\n")
    plain = FileTask(str(JSONL), tokenizer=tok, chat=False, instruction="")
    q = plain.eval_prompts(1)[0]
    assert tok.decode(q.ids, skip_special_tokens=False) == q.text


def test_answer_columns_and_rewards(tok):
    gsm = FileTask(str(DATA / "gsm8k_style.jsonl"), tokenizer=tok, eval_fraction=0.5,
                   verifier="numeric")
    answers = {e["question"][:10]: e["answer"] for e in gsm._train + gsm._eval}
    assert answers == {"Ann has 3 ": "7", "A box hold": "36", "Tom reads ": "1000",
                       "A shirt co": "15", "Sam needs ": "3"}
    prompt = next(p for p in gsm.train_prompts(0, 5) + gsm.eval_prompts(5)
                  if p.answer["answer"] == "1000")
    assert gsm.reward(prompt, "25 * 40 = 1,000 so \\boxed{1,000}") == {"correct": 1.0,
                                                                         "format": 1.0}
    assert gsm.reward(prompt, "\\boxed{100}") == {"correct": 0.0, "format": 1.0}
    assert gsm.reward(prompt, "it is 1000 pages") == {"correct": 1.0, "format": 0.0}
    assert gsm.reward(prompt, tok.encode("\\boxed{1000.0}"))["correct"] == 1.0  # from ids
    assert gsm.logged_rewards == ("format",)
    math = FileTask(str(DATA / "math_style.json"), tokenizer=tok, question="problem",
                    answer="solution", eval_fraction=0.5)  # default verifier: math
    refs = {e["answer"] for e in math._train + math._eval}
    assert refs == {"\\frac{3}{4}", "7", "4", "0.75"}
    frac = next(p for p in math.train_prompts(0, 4) + math.eval_prompts(4)
                if p.answer["answer"] == "\\frac{3}{4}")
    assert frac.answer["row"]["level"] == "Level 1"
    assert math.reward(frac, "\\boxed{0.75}")["correct"] == 1.0
    assert math.reward(frac, "\\boxed{6/8}")["correct"] == 1.0
    assert math.reward(frac, "\\boxed{3/5}")["correct"] == 0.0


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_bad_input_is_a_clear_error(tmp_path, tok):
    with pytest.raises(ValueError, match="prompt file .*missing.jsonl' not found"):
        FileTask(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"unknown format '.txt'"):
        FileTask(write(tmp_path, "a.txt", "x"))
    with pytest.raises(ValueError, match=r"no column 'problem'; its columns are \['question', "
                                         r"'answer'\]"):
        FileTask(str(JSONL), question="problem")
    empty_answer = write(tmp_path, "e.jsonl", '{"question": "q1", "answer": "1"}\n'
                                              '{"question": "q2", "answer": "  "}\n')
    with pytest.raises(ValueError, match=r"row 2 of .*e.jsonl' has no answer"):
        FileTask(empty_answer)
    no_mark = write(tmp_path, "g.jsonl", '{"question": "q1", "answer": "It is 4."}\n')
    with pytest.raises(ValueError, match=r"row 1 .* answer_format='gsm8k' finds nothing"):
        FileTask(no_mark, answer_format="gsm8k")
    null_q = write(tmp_path, "n.jsonl", '{"question": null, "answer": "1"}\n')
    with pytest.raises(ValueError, match="row 1 .* empty question"):
        FileTask(null_q)
    clash = write(tmp_path, "c.jsonl", '{"question": "1+1?", "answer": "2"}\n'
                                       '{"question": "1 +1?", "answer": "2"}\n'
                                       '{"question": " 1+1? ", "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"rows 1 and 3 .* different answers \('2' and '3'\)"):
        FileTask(clash)
    bad_regex = write(tmp_path, "r.jsonl", '{"question": "q", "answer": "(unclosed"}\n')
    with pytest.raises(ValueError, match="row 1 .* not a valid regular expression"):
        FileTask(bad_regex, verifier="regex")
    with pytest.raises(ValueError, match="the eval split of .* is empty"):
        FileTask(write(tmp_path, "one.jsonl", '{"question": "q", "answer": "1"}\n'))
    with pytest.raises(ValueError, match=r"the prompt of row .*:\d+ has \d+ tokens, more than "
                                         "max_prompt_len=20"):
        FileTask(str(JSONL), tokenizer=tok, max_prompt_len=20)
    with pytest.raises(ValueError, match="could not be read as json"):
        FileTask(write(tmp_path, "broken.jsonl", '{"question": "q", "answer"\n'))
    with pytest.raises(ValueError, match="unknown option"):
        make_task(f"file:{JSONL}", questions="q")
    with pytest.raises(ValueError, match="verifier must be one of"):
        FileTask(str(JSONL), verifier="dataset")
