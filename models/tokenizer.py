"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` plus the model's chat template.

Two sources:

  * `Tokenizer.from_file("tokenizer.json", "tokenizer_config.json")` for HF checkpoints;
  * `Tokenizer.from_gguf_metadata(metadata)` for GGUF files, which carry no tokenizer.json:
    the byte-level BPE is rebuilt from tokenizer.ggml.tokens / merges / token_type, with the
    pre-tokenizer llama.cpp uses for tokenizer.ggml.pre.
"""
from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizer split patterns, keyed by llama.cpp's tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's own regex (ByteLevel's built-in), with every digit first split off on its own.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_GPT2 = ("gpt2", "default")
_LLAMA3 = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx")
_QWEN2 = ("qwen2", "deepseek-r1-qwen")
SUPPORTED_GGUF_PRE = _DIGITS_THEN_GPT2 + _GPT2 + _LLAMA3 + _QWEN2

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _gguf_pre_tokenizer(pre: str):
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or {"content": ...}."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text.

    Attributes:
      bos_token_id, pad_token_id: int or None.
      eos_token_ids: tuple of ids that end a generation.
      vocab_size: ids in [0, vocab_size) are valid (added tokens included).
      chat_template: the jinja2 template source, or None.
      backend (read-only): the `tokenizers.Tokenizer` that encodes and decodes (what an
        export writes as tokenizer.json).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        pad_token: str | None = None,
    ):
        self._tok = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.pad_token = pad_token
        self.bos_token_id = self._id_of(bos_token, "bos_token")
        self.pad_token_id = self._id_of(pad_token, "pad_token")
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(self._id_of(t, "eos_token") for t in eos_tokens))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._template = None if chat_template is None else _compile_template(chat_template)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def _id_of(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{what} {token!r} is not in the vocabulary")
        return tid

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike, tokenizer_config_json: str | os.PathLike | None = None) -> "Tokenizer":
        """Load an HF tokenizer.json, and (optionally) its tokenizer_config.json for the chat
        template and special tokens. A chat_template.jinja / generation_config.json next to
        the config file is used too (eos ids listed there also stop generation)."""
        tokenizer_json = os.fspath(tokenizer_json)
        if not os.path.isfile(tokenizer_json):
            raise ValueError(f"tokenizer_json {tokenizer_json!r} is not a file")
        backend = HFTokenizer.from_file(tokenizer_json)
        if tokenizer_config_json is None:
            return cls(backend)
        tokenizer_config_json = os.fspath(tokenizer_config_json)
        with open(tokenizer_config_json, encoding="utf-8") as f:
            cfg = json.load(f)
        folder = os.path.dirname(tokenizer_config_json)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        eos = [_token_content(cfg.get("eos_token"))]
        gen_file = os.path.join(folder, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file, encoding="utf-8") as f:
                gen_eos = json.load(f).get("eos_token_id")
            gen_eos = [] if gen_eos is None else gen_eos if isinstance(gen_eos, list) else [gen_eos]
            eos += [backend.id_to_token(int(i)) for i in gen_eos]
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_tokens=[t for t in eos if t is not None],
            pad_token=_token_content(cfg.get("pad_token")),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Rebuild the byte-level BPE tokenizer a GGUF file describes.

        Args:
          metadata: GGUF key/values, e.g. from `models.gguf_loader.read_gguf(path)[2]`.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
            )
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in SUPPORTED_GGUF_PRE:
            raise ValueError(f"GGUF tokenizer.ggml.pre is {pre!r}; supported: {SUPPORTED_GGUF_PRE}")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
        types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        if len(types) != len(tokens):
            raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("GGUF tokenizer.ggml.tokens contains duplicate tokens")
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3))
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        # Control tokens stay whole and are special (skipped by decode); user-defined ones
        # stay whole but are ordinary text. Both are already in the vocab, so ids do not move.
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        )

        def token(key: str) -> str | None:
            tid = metadata.get(f"tokenizer.ggml.{key}")
            return None if tid is None else tokens[int(tid)]

        bos = token("bos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
        eos = [t for t in (token("eos_token_id"), token("eot_token_id")) if t is not None]
        return cls(
            backend,
            chat_template=metadata.get("tokenizer.chat_template"),
            bos_token=bos,
            eos_tokens=eos,
            pad_token=token("padding_token_id"),
        )

    # -- use -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Special-token strings in `text` (e.g. '<|im_start|>') map to their ids;
        `add_special_tokens` adds the BOS the model's post-processor asks for, if any."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text (special tokens dropped unless skip_special_tokens=False)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render chat messages ([{"role": ..., "content": ...}, ...]) with the model's
        template into prompt text (encode it with `encode`; the template writes any BOS)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template; pass tokenizer_config.json or use a GGUF with one")
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a str 'role' and a 'content', got {m!r}")
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    # The settings HF chat templates are written for: blocks eat their newline/indent.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # Llama 3 templates
    return env.from_string(source)
