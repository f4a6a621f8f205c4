"""Tokenizer: a byte-level BPE rebuilt from GGUF-style metadata vs a naive loop-based BPE
written here (pre-tokenizer regex, byte->unicode alphabet, rank-ordered merges), plus the
tokenizer.json route, special tokens and the chat template."""
import json

import jinja2
import pytest
import regex
from hypothesis import given
from hypothesis import strategies as st

from models.tokenizer import Tokenizer

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = (
    "the quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs 12 miles in 2024! "
    "Il était une fois, à côté de la forêt, un café très agréable. 东京 東京 日本 "
    "  indented   text\n\nwith newlines and tabs\tthat it's what they're doing, we'll see.  "
)
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves,
    the other 68 bytes to chr(256 + k) in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTES = byte_alphabet()


def to_symbols(text: str) -> list[str]:
    return [BYTES[b] for b in text.encode("utf-8")]


def train_merges(corpus: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE training on the corpus's GPT-2 pre-tokens (most frequent pair first)."""
    words = [to_symbols(w) for w in regex.findall(GPT2_RE, corpus)]
    merges = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=lambda p: counts[p])
        merges.append(best)
        words = [merge_word(w, best) for w in words]
    return merges


def merge_word(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


MERGES = train_merges(CORPUS, 60)
TOKENS = CONTROL + [BYTES[b] for b in range(256)] + [a + b for a, b in MERGES] + USER_DEFINED
TYPES = [3] * len(CONTROL) + [1] * (256 + len(MERGES)) + [4] * len(USER_DEFINED)
VOCAB = {t: i for i, t in enumerate(TOKENS)}
assert len(VOCAB) == len(TOKENS)


def metadata(pre: str, **extra) -> dict:
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES],
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.chat_template": TEMPLATE,
    }
    md.update(extra)
    return md


def naive_pretokenize(text: str, pre: str) -> list[str]:
    if pre == "smollm":  # every digit on its own, then GPT-2's regex on the rest
        pieces = [p for p in regex.split(r"(\p{N})", text) if p]
        return [w for p in pieces for w in regex.findall(GPT2_RE, p)]
    pattern = {"gpt2": GPT2_RE, "qwen2": QWEN2_RE, "llama-bpe": LLAMA3_RE}[pre]
    return regex.findall(pattern, text)


def naive_encode(text: str, pre: str) -> list[int]:
    """Loop-based byte-level BPE: split around special tokens, pre-tokenize, then merge the
    lowest-ranked adjacent pair until none is left."""
    rank = {pair: r for r, pair in enumerate(MERGES)}
    special = "(" + "|".join(regex.escape(t) for t in CONTROL + USER_DEFINED) + ")"
    ids = []
    for chunk in regex.split(special, text):
        if not chunk:
            continue
        if chunk in CONTROL + USER_DEFINED:
            ids.append(VOCAB[chunk])
            continue
        for word in naive_pretokenize(chunk, pre):
            symbols = to_symbols(word)
            if pre == "llama-bpe" and "".join(symbols) in VOCAB:  # llama3 BPE: whole-word lookup first
                ids.append(VOCAB["".join(symbols)])
                continue
            while len(symbols) > 1:
                pairs = [(rank[p], p) for p in zip(symbols, symbols[1:]) if p in rank]
                if not pairs:
                    break
                symbols = merge_word(symbols, min(pairs)[1])
            ids += [VOCAB[s] for s in symbols]
    return ids


TOKENIZERS = {pre: Tokenizer.from_gguf_metadata(metadata(pre)) for pre in ("smollm", "gpt2", "qwen2", "llama-bpe")}
FIXED_TEXTS = [
    CORPUS,
    "x = 1234567 + 89; y=3.5e10",
    "   spaces   and\n\n\nnewlines \r\n tabs\t\t",
    "<|im_start|>user\nthe fox<|im_end|>\n<think>the dog</think>",
    "Ünïcödé 東京 🤖 it'S THEY'RE",
    "",
]


@pytest.mark.parametrize("pre", sorted(TOKENIZERS))
def test_encode_matches_naive_bpe_fixed(pre):
    tok = TOKENIZERS[pre]
    for text in FIXED_TEXTS:
        ids = tok.encode(text)
        assert ids == naive_encode(text, pre), (pre, text)
        assert tok.decode(ids, skip_special_tokens=False) == text


@given(st.text(alphabet=st.sampled_from(list("the fox dog 0123456789.,!?'s\n\t éà東京🤖")), max_size=40)
       | st.text(max_size=30))
def test_encode_matches_naive_bpe_random(text):
    for pre, tok in TOKENIZERS.items():
        assert tok.encode(text) == naive_encode(text, pre), (pre, text)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_and_decode():
    tok = TOKENIZERS["smollm"]
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (2,) and tok.pad_token_id == 0
    assert tok.vocab_size == len(TOKENS)
    ids = tok.encode("<|im_start|>the<|im_end|><think>")
    assert ids[0] == 1 and ids[-2:] == [2, VOCAB["<think>"]]
    # Control tokens are dropped by decode by default; user-defined ones are text.
    assert tok.decode(ids) == "the<think>"
    assert tok.encode("the fox", add_special_tokens=True) == tok.encode("the fox")  # no add_bos_token
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([len(TOKENS)])
    with pytest.raises(ValueError, match="str"):
        tok.encode(123)


def test_add_bos_and_eot():
    tok = Tokenizer.from_gguf_metadata(metadata("gpt2", **{"tokenizer.ggml.add_bos_token": True,
                                                          "tokenizer.ggml.eot_token_id": 1}))
    assert tok.encode("the", add_special_tokens=True) == [0] + tok.encode("the")
    assert tok.eos_token_ids == (2, 1)


def test_bad_metadata():
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        Tokenizer.from_gguf_metadata(metadata("made-up-pre"))
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata(metadata("gpt2", **{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="token types"):
        Tokenizer.from_gguf_metadata(metadata("gpt2", **{"tokenizer.ggml.token_type": TYPES[:-1]}))


def test_chat_template():
    tok = TOKENIZERS["smollm"]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi é"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi é<|im_end|>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(msgs) == expected + "<|im_start|>assistant\n"
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    no_template = Tokenizer.from_gguf_metadata({k: v for k, v in metadata("gpt2").items() if k != "tokenizer.chat_template"})
    with pytest.raises(ValueError, match="chat_template"):
        no_template.apply_chat_template(msgs)


def test_sandbox_blocks_unsafe_template():
    tok = Tokenizer.from_gguf_metadata(metadata("gpt2", **{"tokenizer.chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_from_file_matches_gguf_route(tmp_path):
    src = TOKENIZERS["smollm"]
    src.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE,
        "bos_token": {"content": "<|endoftext|>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    for text in FIXED_TEXTS:
        assert tok.encode(text) == naive_encode(text, "smollm")
    assert tok.bos_token_id == 0 and tok.pad_token_id == 0 and tok.eos_token_ids == (2, 1)
    msgs = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs) == src.apply_chat_template(msgs)
    bare = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert bare.chat_template is None and bare.eos_token_ids == ()
    with pytest.raises(ValueError, match="not a file"):
        Tokenizer.from_file(tmp_path / "missing.json")
