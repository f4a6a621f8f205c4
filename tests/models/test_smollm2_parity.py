"""SmolLM2-135M-Instruct (Q4_1 GGUF): our loader + decoder + tokenizer vs transformers
loading the SAME file (transformers dequantises with gguf-py and un-permutes Q/K itself,
so every step of our GGUF path is checked against an independent implementation)."""
import functools
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.assets import load_model, smollm2_gguf_path
from models.decoder import decode_step, forward, prefill
from models.kv_cache import init_cache

MESSAGES = [
    {"role": "user", "content": "Write a short poem about the sea, then count from 1 to 5."},
]
TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\tand   runs of    spaces\n\n\nnewlines  ",
    "Digits 1234567890, 3.14159 and 1,000,000 and x^2+y^2=z^2",
    "Unicode: naïve café, Ünïcödé, 日本語のテキスト, emoji 🤖🚀, Ελληνικά",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "don't won't it's we're they'll I'd",
]


class _PlainReader(gguf.GGUFReader):
    """GGUFReader over a plain-ndarray view of the memmap: same bytes, ~4x faster to open."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, value):
        self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value


@pytest.fixture(scope="module")
def hf():
    """transformers model + tokenizer from the GGUF. Only for speed, the file is parsed once
    (transformers would parse it 3 times) and gguf's name map is memoised; what transformers
    computes from them is unchanged."""
    path = smollm2_gguf_path()
    readers = {}

    def reader(p, mode="r"):
        key = (os.fspath(p), mode)
        if key not in readers:
            readers[key] = _PlainReader(p, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def ours():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def prompt_ids(ours, hf):
    """Chat-templated prompt ids; ours and transformers' must agree."""
    text = ours[2].apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = ours[2].encode(text)
    assert ids == hf[1].encode(text, add_special_tokens=False)
    return ids


def test_config_and_special_tokens(ours, hf):
    config, _, tok = ours
    hc = hf[0].config
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (hc.vocab_size, hc.hidden_size, hc.num_hidden_layers)
    assert (config.num_heads, config.num_kv_heads, config.intermediate_size) == (
        hc.num_attention_heads, hc.num_key_value_heads, hc.intermediate_size)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert tok.eos_token_ids == (hf[1].eos_token_id,) and tok.bos_token_id == hf[1].bos_token_id
    assert tok.vocab_size == len(hf[1])


def test_tokenizer_matches_transformers(ours, hf):
    tok, hf_tok = ours[2], hf[1]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(ours, hf):
    tok, hf_tok = ours[2], hf[1]
    conversations = [
        MESSAGES,
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Ünïcödé? 42"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == hf_tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"content": "no role"}])


def test_logits_match_transformers(ours, hf, prompt_ids):
    config, params, _ = ours
    logits = np.asarray(forward(params, config, np.asarray([prompt_ids], np.int32)))[0]
    with torch.no_grad():
        ref = hf[0](torch.tensor([prompt_ids])).logits[0].numpy()
    assert logits.shape == ref.shape == (len(prompt_ids), config.vocab_size)
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))
    assert np.abs(logits - ref).max() <= 1e-3


def test_greedy_generation_matches_transformers(ours, hf, prompt_ids):
    config, params, _ = ours
    n_new, t = 16, len(prompt_ids)
    with torch.no_grad():
        out = hf[0].generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n_new,
                             attention_mask=torch.ones(1, t, dtype=torch.long))
    ref = out[0, t:].tolist()
    # Our cache path: prefill the prompt, then one decode step per token, argmax each time.
    cache = init_cache(config, 1, t + n_new)
    logits, cache = prefill(params, config, np.asarray([prompt_ids], np.int32), np.asarray([t], np.int32), cache)
    new = [int(np.argmax(logits[0, t - 1]))]
    while len(new) < n_new:
        step_logits, cache = decode_step(params, config, np.asarray([new[-1]], np.int32), cache)
        new.append(int(np.argmax(step_logits[0])))
    # transformers stops early only at eos; then our tokens must agree up to and including it.
    assert len(ref) == n_new or ref[-1] in config.eos_token_ids
    assert new[: len(ref)] == ref
