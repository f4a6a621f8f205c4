"""GGUF (llama.cpp's file format) -> HF-style config + state dict -> our params.

The loader never maps names into our params itself: it produces what an HF checkpoint
would hold (HF tensor names, torch layout [out, in], float32) plus a config.json-style
dict, and hands both to `models.config.config_from_hf` and `models.convert.params_from_hf`,
the one place that knows our parameter tree.

Dequantisation is our own vectorised numpy, written from the GGML block layouts:
each quantised tensor is a run of fixed-size blocks, and every block decodes on its own,
so each decoder maps bytes [n_blocks, block_bytes] -> values [n_blocks, block_size].
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

QT = GGMLQuantizationType
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


# ---------------------------------------------------------------------------------------
# Dequantisation. Layouts (little-endian, per block), as in ggml's block_* structs:
#   Q4_0 (32 values, 18 B): d f16 | qs u8[16]        x = d * (nibble - 8)
#   Q4_1 (32, 20 B):  d f16 | m f16 | qs u8[16]      x = d * nibble + m
#   Q5_0 (32, 22 B):  d f16 | qh u32 | qs u8[16]     x = d * (nibble | hbit << 4) - 16 d
#   Q5_1 (32, 24 B):  d f16 | m f16 | qh u32 | qs    x = d * (nibble | hbit << 4) + m
#   Q8_0 (32, 34 B):  d f16 | qs i8[32]              x = d * q
#   Q4_K (256, 144 B): d f16 | dmin f16 | 6-bit scales/mins packed in 12 B | qs u8[128]
#   Q5_K (256, 176 B): d f16 | dmin f16 | scales 12 B | qh u8[32] | qs u8[128]
#   Q6_K (256, 210 B): ql u8[128] | qh u8[64] | scales i8[16] | d f16
# In the 32-value formats value j < 16 is the low nibble of qs[j], value j + 16 its high one.
# ---------------------------------------------------------------------------------------


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """f16 stored at byte `start` of every block -> float32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """u8 [n, 16] -> u8 [n, 32]: the 16 low nibbles, then the 16 high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits_32(blocks: np.ndarray, start: int) -> np.ndarray:
    """u32 bit field at byte `start` -> u8 [n, 32], bit j of the field at column j."""
    qh = np.ascontiguousarray(blocks[:, start : start + 4]).view("<u4")  # [n, 1]
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:18]).astype(np.float32) - 8.0
    return _half(b, 0) * q


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    return _half(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _half(b, 2)


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 6:22]) | (_high_bits_32(b, 2) << 4)
    return _half(b, 0) * (q.astype(np.float32) - 16.0)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:24]) | (_high_bits_32(b, 4) << 4)
    return _half(b, 0) * q.astype(np.float32) + _half(b, 2)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    q = np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32)
    return _half(b, 0) * q


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K / Q5_K -> (scales, mins), each float32 [n, 8] of 6-bit ints.

    Sub-blocks 0-3 keep their 6 bits in the low bits of bytes 0-3 (scale) and 4-7 (min);
    sub-blocks 4-7 take 4 low bits from bytes 8-11 and their top 2 bits from the spare
    high bits of bytes 0-3 (scale) and 4-7 (min).
    """
    lo_sc, lo_mn = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_mn = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    scales = np.concatenate([lo_sc, hi_sc], axis=1).astype(np.float32)
    mins = np.concatenate([lo_mn, hi_mn], axis=1).astype(np.float32)
    return scales, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """u8 [n, 128] -> u8 [n, 8, 32]: chunk c of 32 bytes gives sub-block 2c (low nibbles)
    and sub-block 2c + 1 (high nibbles)."""
    chunks = qs.reshape(-1, 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    scales, mins = _k_scales_mins(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144]).astype(np.float32)
    x = (_half(b, 0) * scales)[:, :, None] * q - (_half(b, 2) * mins)[:, :, None]
    return x.reshape(-1, 256)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    scales, mins = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]  # [n, 32]: bit s of qh[l] is the 5th bit of value l of sub-block s
    hbit = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    q = (_k_nibbles(b[:, 48:176]) | (hbit << 4)).astype(np.float32)
    x = (_half(b, 0) * scales)[:, :, None] * q - (_half(b, 2) * mins)[:, :, None]
    return x.reshape(-1, 256)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    # Two halves of 128 values; each half has 4 quarters of 32, quarter k holding
    # nibble (k // 2 == 0: low, else high) of ql bytes [32 (k % 2), +32) and bits 2k..2k+1 of qh.
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [n, half, which 32 bytes, l]
    nib = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # [n, half, quarter, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    hb = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = (nib | (hb << 4)).astype(np.float32) - 32.0
    # 16 int8 scales, one per 16 values: half h, quarter k, l // 16 -> scale 8h + 2k + l // 16.
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    sc = sc.reshape(-1, 2, 4, 2, 1)
    x = _half(b, 208)[:, :, None, None, None] * sc * q.reshape(-1, 2, 4, 2, 16)
    return x.reshape(-1, 256)


_BLOCK_DECODERS: dict[QT, tuple[int, int, Callable[[np.ndarray], np.ndarray]]] = {
    # qtype: (values per block, bytes per block, decoder)
    QT.Q4_0: (32, 18, _deq_q4_0),
    QT.Q4_1: (32, 20, _deq_q4_1),
    QT.Q5_0: (32, 22, _deq_q5_0),
    QT.Q5_1: (32, 24, _deq_q5_1),
    QT.Q8_0: (32, 34, _deq_q8_0),
    QT.Q4_K: (256, 144, _deq_q4_k),
    QT.Q5_K: (256, 176, _deq_q5_k),
    QT.Q6_K: (256, 210, _deq_q6_k),
}
SUPPORTED_TYPES: tuple[QT, ...] = (QT.F32, QT.F16, QT.BF16, *_BLOCK_DECODERS)


def dequantize(data: np.ndarray, qtype: int | QT, shape: tuple[int, ...], *, name: str = "tensor") -> np.ndarray:
    """Decode one GGUF tensor's raw data to float32.

    Args:
      data: the tensor's bytes (any dtype/shape; only the raw bytes are read), e.g.
        `GGUFReader.tensors[i].data`.
      qtype: its GGML type.
      shape: the numpy shape of the result (GGUF's dims reversed), e.g. [out, in].
      name: the tensor's name, for error messages.
    Returns:
      float32 array of `shape`.
    Raises:
      ValueError: unsupported type, byte count not matching the shape, or non-finite values.
    """
    try:
        qtype = QT(int(qtype))
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown GGML type id {int(qtype)}") from None
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    n = int(np.prod(shape, dtype=np.int64))
    if qtype in (QT.F32, QT.F16, QT.BF16):
        width = 4 if qtype == QT.F32 else 2
        if raw.size != n * width:
            raise ValueError(f"tensor {name!r} ({qtype.name}, shape {tuple(shape)}) has {raw.size} bytes, expected {n * width}")
        if qtype == QT.F32:
            out = raw.view("<f4").astype(np.float32)
        elif qtype == QT.F16:
            out = raw.view("<f2").astype(np.float32)
        else:  # bf16 is the top half of a float32
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif qtype in _BLOCK_DECODERS:
        block_size, block_bytes, decode = _BLOCK_DECODERS[qtype]
        if n % block_size or raw.size != (n // block_size) * block_bytes:
            raise ValueError(
                f"tensor {name!r} ({qtype.name}, shape {tuple(shape)}) has {raw.size} bytes; "
                f"{qtype.name} needs a multiple of {block_size} values in {block_bytes}-byte blocks"
            )
        out = decode(raw.reshape(-1, block_bytes)).reshape(-1)
    else:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(
            f"tensor {name!r} has GGML type {qtype.name}, which this loader cannot dequantise; "
            f"supported types: {supported}. Re-export the model with one of them."
        )
    out = out.reshape(shape)
    if not np.isfinite(out).all():
        raise ValueError(f"tensor {name!r} ({qtype.name}) decodes to non-finite values; the file is corrupt")
    return out


# ---------------------------------------------------------------------------------------
# Layout: llama.cpp's Q/K row permutation.
# ---------------------------------------------------------------------------------------


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of q_proj / k_proj rows for llama-arch models.

    llama.cpp rotates interleaved pairs (GPT-J style), so its converter reorders the rows of
    each head from HF's [first half | second half] (rotate_half) to interleaved
    [x0, x_{d/2}, x1, x_{d/2+1}, ...]. This puts them back.

    Args:
      w: [n_heads * head_dim, ...] weight (or bias) in GGUF row order.
      n_heads: number of heads the rows are split into (num_kv_heads for k_proj).
    Returns:
      [n_heads * head_dim, ...] in HF row order.
    """
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------
# Names and config.
# ---------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF name, e.g. 'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(
            f"GGUF tensor {gguf_name!r} has no HF counterpart this loader knows "
            f"(known per-layer tensors: {sorted(_BLOCK_NAMES)})"
        )
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _field_value(field) -> Any:
    """A metadata field as a Python value; float32 scalars are rounded to their shortest
    decimal (1e-05, not 9.99999974e-06), the value the model's author wrote."""
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of an open GGUF file as plain Python values."""
    return {key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def hf_config_from_metadata(metadata: Mapping[str, Any], *, vocab_size: int, tied: bool) -> dict[str, Any]:
    """Build a config.json-style dict (HF key names) from GGUF metadata.

    Args:
      metadata: from `read_metadata`.
      vocab_size: rows of the token embedding.
      tied: True when the file has no separate `output.weight`.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF general.architecture is {arch!r}; supported: {SUPPORTED_ARCHS}")

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in metadata:
            raise ValueError(f"GGUF metadata lacks {full!r}, which the {arch} config needs")
        return metadata[full]

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(metadata.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // n_heads))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
            "partial rotary embeddings are not supported"
        )
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    else:
        raise ValueError(f"GGUF {arch}.rope.scaling.type is {scaling_type!r}; supported: 'none', 'linear'")
    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata]
    eos = list(dict.fromkeys(int(e) for e in eos))
    return {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": bool(tied),
        "attention_bias": arch == "qwen2",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap: the same bytes (still mapped,
    not read into memory), but the parser's ~10^6 small slices skip np.memmap's
    Python-level __getitem__/__array_finalize__, which makes opening a file ~4x faster."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every key/value of a GGUF file's metadata (tokenizer.ggml.*, tokenizer.chat_template,
    <arch>.*) as plain Python values, without reading its tensors (for
    `Tokenizer.from_gguf_metadata`)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path {path!r} is not a file; pass the path of a .gguf file")
    return read_metadata(_Reader(path))


def _numpy_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dims innermost first; numpy wants them outermost first."""
    return tuple(int(d) for d in reversed(tensor.shape))


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """Read a GGUF file as an HF checkpoint would look.

    Returns:
      hf_config: config.json-style dict (HF key names).
      state_dict: HF tensor name -> float32 numpy array in torch layout ([out, in] for
        linear weights), Q/K rows already in HF's rotate_half order.
      metadata: every GGUF key/value (tokenizer.ggml.*, tokenizer.chat_template, ...).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path {path!r} is not a file; pass the path of a .gguf file")
    reader = _Reader(path)
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path!r} has no token_embd.weight tensor; is it a decoder LM?")
    vocab_size = _numpy_shape(tensors["token_embd.weight"])[0]
    n_tokens = len(metadata.get("tokenizer.ggml.tokens", ()))
    if n_tokens > vocab_size:
        raise ValueError(f"{path!r}: the tokenizer has {n_tokens} tokens but the embedding only {vocab_size} rows")
    hf_config = hf_config_from_metadata(metadata, vocab_size=vocab_size, tied="output.weight" not in tensors)

    permute = hf_config["model_type"] == "llama"  # llama.cpp reorders Q/K rows only for llama
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    state_dict: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        hf_name = hf_tensor_name(name)
        value = dequantize(tensor.data, tensor.tensor_type, _numpy_shape(tensor), name=name)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if permute and kind in heads:
            value = unpermute_qk(value, heads[kind])
        state_dict[hf_name] = value
    return hf_config, state_dict, metadata


def load_gguf(path: str | os.PathLike, *, dtype: Any = None, param_dtype: Any = None, return_metadata: bool = False):
    """Load a GGUF file into (ModelConfig, params).

    Args:
      path: a .gguf file (architectures: llama, qwen2, qwen3).
      dtype: compute dtype override, "float32" | "bfloat16" (default: float32).
      param_dtype: parameter dtype override (default: float32).
      return_metadata: also return the GGUF metadata (for `Tokenizer.from_gguf_metadata`).
    Returns:
      (config, params), or (config, params, metadata) with return_metadata=True.
    """
    from models.config import config_from_hf
    from models.convert import params_from_hf

    hf_config, state_dict, metadata = read_gguf(path)
    config = config_from_hf(hf_config)
    overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v is not None}
    if overrides:
        config = config.replace(**overrides)
    params = params_from_hf(state_dict, config)
    return (config, params, metadata) if return_metadata else (config, params)
