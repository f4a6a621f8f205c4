"""A tiny random model as a Hugging Face directory, with a byte-level tokenizer and a chat
template: a stand-in for "your own checkpoint" that loads in seconds, for the docs, the
tests and for trying a pipeline end to end before pointing it at a real model.

    path = write_tiny_model("tiny-model")          # config.json, model.safetensors,
    config, params, tok = load_model(path)         # tokenizer.json, tokenizer_config.json

The tokenizer is byte-level BPE without merges: one token per UTF-8 byte (ids 0-255, in
byte order), then the specials <|im_start|> (256, bos), <|im_end|> (257, eos, pad) and
<|endoftext|> (258, also ends a generation); any text round-trips. The chat template is
ChatML ("<|im_start|>role\\ncontent<|im_end|>\\n" per message, "<|im_start|>assistant\\n"
to prompt a reply). The model is models.config's "tiny" decoder (2 layers, width 64) with
the vocabulary cut to these 259 tokens, random weights from `seed`, in float32.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: each byte as a printable character (bytes that print as
    themselves keep their character; the others take code points from 256 up, in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer():
    """The `tokenizers.Tokenizer` described in the module docstring."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = byte_to_char()
    vocab = {chars[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
    return backend


def tiny_config():
    """The ModelConfig of the tiny directory (see the module docstring)."""
    from models.config import get_config

    return get_config("tiny", vocab_size=256 + len(SPECIAL_TOKENS), bos_token_id=256,
                      eos_token_ids=(257, 258), pad_token_id=257)


def write_tiny_model(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write the tiny model directory (module docstring) to `path` (created; existing files
    of the same names are replaced) and return it."""
    from models.decoder import init_params
    from models.hf_loader import save_hf_checkpoint

    out = Path(path)
    config = tiny_config()
    save_hf_checkpoint(out, config, init_params(config, seed))
    byte_tokenizer().save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
                  "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[1],
                  "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 256, "eos_token_id": [257, 258], "pad_token_id": 257}, indent=2) + "\n")
    return out


__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "byte_to_char", "byte_tokenizer", "tiny_config",
           "write_tiny_model"]
