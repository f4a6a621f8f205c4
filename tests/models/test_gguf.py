"""GGUF loader: our dequantisers vs gguf's own (an independent implementation), the Q/K
row un-permutation vs a hand-written loop and vs RoPE itself, and a tiny GGUF file
written with gguf.GGUFWriter read back through read_gguf."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from models.gguf_loader import dequantize, read_gguf, read_gguf_metadata, unpermute_qk

# (values per block, bytes per block, byte offsets of the f16 scale fields)
BLOCKS = {
    QT.Q4_0: (32, 18, (0,)),
    QT.Q4_1: (32, 20, (0, 2)),
    QT.Q5_0: (32, 22, (0,)),
    QT.Q5_1: (32, 24, (0, 2)),
    QT.Q8_0: (32, 34, (0,)),
    QT.Q4_K: (256, 144, (0, 2)),
    QT.Q5_K: (256, 176, (0, 2)),
    QT.Q6_K: (256, 210, (208,)),
}


def random_blocks(rng: np.random.Generator, qtype: QT, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random raw bytes [rows, blocks_per_row * block_bytes] whose f16 scale fields are finite."""
    _, nbytes, f16_at = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, nbytes), dtype=np.uint8)
    for off in f16_at:
        scale = rng.normal(0.0, 0.05, size=(rows * blocks_per_row, 1)).astype("<f2")
        raw[:, off : off + 2] = scale.view(np.uint8)
    return raw.reshape(rows, blocks_per_row * nbytes)


@pytest.mark.parametrize("qtype", list(BLOCKS), ids=lambda q: q.name)
def test_block_dequantisers_match_gguf(qtype):
    rng = np.random.default_rng(int(qtype) + 100)
    block_size = BLOCKS[qtype][0]
    raw = random_blocks(rng, qtype, rows=5, blocks_per_row=3)
    ours = dequantize(raw, qtype, (5, 3 * block_size), name="w")
    ref = gguf_dequantize(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (5, 3 * block_size)
    np.testing.assert_array_equal(ours, ref.astype(np.float32))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.BF16, QT.F16], ids=lambda q: q.name)
def test_roundtrip_through_gguf_quantizer(qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.normal(size=(4, 64)).astype(np.float32)
    raw = gguf_quantize(x, qtype)
    ours = dequantize(raw, qtype, x.shape, name="w")
    np.testing.assert_allclose(ours, gguf_dequantize(raw, qtype), rtol=0, atol=0)
    # And the decoded values are near the originals: the layout, not just agreement.
    tol = {QT.Q4_0: 0.5, QT.Q4_1: 0.5, QT.Q5_0: 0.25, QT.Q5_1: 0.25, QT.Q8_0: 0.05, QT.BF16: 0.02, QT.F16: 2e-3}[qtype]
    assert np.abs(ours - x).max() < tol


def test_float_types_exact():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(x, QT.F32, (3, 8)), x)
    np.testing.assert_array_equal(dequantize(x.astype(np.float16), QT.F16, (3, 8)), x.astype(np.float16).astype(np.float32))
    bf16_bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation, exactly representable
    expected = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(dequantize(bf16_bits, QT.BF16, (3, 8)), expected)


def test_unsupported_type_names_the_tensor():
    raw = np.zeros((1, 84), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"blk\.7\.ffn_up\.weight.*Q2_K"):
        dequantize(raw, QT.Q2_K, (1, 256), name="blk.7.ffn_up.weight")


def test_wrong_byte_count_and_nonfinite_rejected():
    rng = np.random.default_rng(1)
    raw = random_blocks(rng, QT.Q8_0, rows=1, blocks_per_row=2)
    with pytest.raises(ValueError, match="bytes"):
        dequantize(raw, QT.Q8_0, (1, 96), name="w")
    raw[0, 0:2] = np.array([np.inf], dtype="<f2").view(np.uint8)
    with pytest.raises(ValueError, match="non-finite"):
        dequantize(raw, QT.Q8_0, (1, 64), name="w")


def llama_cpp_permute_loop(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows, written as a loop: within each head,
    row i * d/2 + j (half i, index j) moves to row 2 j + i."""
    out = np.empty_like(w)
    hd = w.shape[0] // n_heads
    for h in range(n_heads):
        for i in range(2):
            for j in range(hd // 2):
                out[h * hd + 2 * j + i] = w[h * hd + i * (hd // 2) + j]
    return out


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(2)
    for n_heads, hd, cols in [(3, 8, 5), (2, 4, 1), (4, 6, 7)]:
        w = rng.normal(size=(n_heads * hd, cols))
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute_loop(w, n_heads), n_heads), w)
        bias = rng.normal(size=(n_heads * hd,))
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute_loop(bias, n_heads), n_heads), bias)
    with pytest.raises(ValueError, match="heads"):
        unpermute_qk(np.ones((10, 2)), 3)


def _rope_rotate_half(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """HF convention: pairs (x_j, x_{j+d/2}) rotate by pos * theta^(-2j/d). x: [d]."""
    d = x.shape[0]
    out = np.empty_like(x)
    for j in range(d // 2):
        a = pos * theta ** (-2.0 * j / d)
        out[j] = x[j] * np.cos(a) - x[j + d // 2] * np.sin(a)
        out[j + d // 2] = x[j + d // 2] * np.cos(a) + x[j] * np.sin(a)
    return out


def _rope_interleaved(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """llama.cpp's llama convention: pairs (x_{2j}, x_{2j+1}) rotate by pos * theta^(-2j/d)."""
    d = x.shape[0]
    out = np.empty_like(x)
    for j in range(d // 2):
        a = pos * theta ** (-2.0 * j / d)
        out[2 * j] = x[2 * j] * np.cos(a) - x[2 * j + 1] * np.sin(a)
        out[2 * j + 1] = x[2 * j + 1] * np.cos(a) + x[2 * j] * np.sin(a)
    return out


def test_unpermuted_weights_give_gguf_attention_scores_under_hf_rope():
    """The permuted weights under interleaved RoPE (llama.cpp) and the un-permuted ones under
    rotate_half RoPE (HF) must give the same q.k score: checks the permutation's direction."""
    rng = np.random.default_rng(3)
    hd, hidden = 8, 6
    wq_gguf, wk_gguf = rng.normal(size=(hd, hidden)), rng.normal(size=(hd, hidden))
    wq_hf, wk_hf = unpermute_qk(wq_gguf, 1), unpermute_qk(wk_gguf, 1)
    x_q, x_k = rng.normal(size=hidden), rng.normal(size=hidden)
    for pq, pk in [(5, 2), (3, 0), (11, 7)]:
        s_cpp = _rope_interleaved(wq_gguf @ x_q, pq) @ _rope_interleaved(wk_gguf @ x_k, pk)
        s_hf = _rope_rotate_half(wq_hf @ x_q, pq) @ _rope_rotate_half(wk_hf @ x_k, pk)
        np.testing.assert_allclose(s_hf, s_cpp, rtol=1e-10)


def _write_tiny_llama(path, rng, *, replace=None):
    """A 2-layer llama GGUF (hidden 64, 4 heads, 2 kv heads) with mixed tensor types.
    `replace` maps a GGUF tensor name to (raw bytes, qtype) stored instead.
    Returns the HF-layout float32 weights the file should decode to."""
    replace = replace or {}
    hidden, ffn, n_heads, n_kv, hd, vocab = 64, 96, 4, 2, 16, 40
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(2)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    expected = {}

    def put(gguf_name, hf_name, value, qtype, permute_heads=None):
        if gguf_name in replace:
            w.add_tensor(gguf_name, replace[gguf_name][0], raw_dtype=replace[gguf_name][1])
            return
        stored = llama_cpp_permute_loop(value, permute_heads) if permute_heads else value
        if qtype == QT.F32:
            w.add_tensor(gguf_name, stored.astype(np.float32))
            expected[hf_name] = stored.astype(np.float32)
        else:
            raw = gguf_quantize(stored.astype(np.float32), qtype)
            w.add_tensor(gguf_name, raw, raw_dtype=qtype)
            deq = gguf_dequantize(raw, qtype).astype(np.float32)
            expected[hf_name] = unpermute_qk(deq, permute_heads) if permute_heads else deq

    put("token_embd.weight", "model.embed_tokens.weight", rng.normal(size=(vocab, hidden)), QT.Q8_0)
    put("output_norm.weight", "model.norm.weight", rng.normal(size=hidden), QT.F32)
    for i in range(2):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", rng.normal(size=hidden), QT.F32)
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", rng.normal(size=hidden), QT.F32)
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", rng.normal(size=(n_heads * hd, hidden)), QT.Q4_1, n_heads)
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", rng.normal(size=(n_kv * hd, hidden)), QT.Q4_0, n_kv)
        put(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", rng.normal(size=(n_kv * hd, hidden)), QT.F16)
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", rng.normal(size=(hidden, n_heads * hd)), QT.BF16)
        put(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", rng.normal(size=(ffn, hidden)), QT.Q5_0)
        put(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", rng.normal(size=(ffn, hidden)), QT.Q5_1)
        put(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", rng.normal(size=(hidden, ffn)), QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_read_gguf_tiny_llama(tmp_path):
    rng = np.random.default_rng(4)
    expected = _write_tiny_llama(tmp_path / "tiny.gguf", rng)
    cfg, sd, md = read_gguf(tmp_path / "tiny.gguf")
    assert sorted(sd) == sorted(expected)
    for name, value in expected.items():
        assert sd[name].dtype == np.float32 and sd[name].shape == value.shape, name
        np.testing.assert_array_equal(sd[name], value, err_msg=name)
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 96, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["vocab_size"] == 40 and cfg["max_position_embeddings"] == 128
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 50000.0
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == [2, 3]
    assert md["general.architecture"] == "llama" and len(md["tokenizer.ggml.tokens"]) == 40


def test_read_gguf_metadata_without_the_tensors(tmp_path):
    _write_tiny_llama(tmp_path / "tiny.gguf", np.random.default_rng(4))
    md = read_gguf_metadata(tmp_path / "tiny.gguf")
    assert md["general.architecture"] == "llama"
    assert md["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(40)]  # as written
    assert (md["llama.block_count"], md["llama.attention.head_count_kv"]) == (2, 2)
    assert md["tokenizer.ggml.bos_token_id"] == 1 and md["llama.rope.freq_base"] == 50000.0
    assert not any(k.startswith("GGUF.") for k in md)
    assert md == read_gguf(tmp_path / "tiny.gguf")[2]
    with pytest.raises(ValueError, match="not a file"):
        read_gguf_metadata(tmp_path / "missing.gguf")


def test_read_gguf_unsupported_tensor_type_names_it(tmp_path):
    rng = np.random.default_rng(5)
    q2k = rng.integers(0, 256, size=(64, 84), dtype=np.uint8)  # 64 rows of one 84-byte Q2_K block
    _write_tiny_llama(tmp_path / "bad.gguf", rng, replace={"blk.1.ffn_down.weight": (q2k, QT.Q2_K)})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight.*Q2_K"):
        read_gguf(tmp_path / "bad.gguf")


def test_read_gguf_unknown_tensor_name(tmp_path):
    rng = np.random.default_rng(6)
    w = GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    for key, value in [("context_length", 8), ("embedding_length", 4), ("feed_forward_length", 8),
                       ("block_count", 1), ("head_count", 2), ("layer_norm_rms_eps", 1e-5)]:
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", rng.normal(size=(6, 4)).astype(np.float32))
    w.add_tensor("blk.0.ffn_mystery.weight", rng.normal(size=(4,)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"ffn_mystery"):
        read_gguf(tmp_path / "odd.gguf")


def test_config_metadata_errors():
    from models.gguf_loader import hf_config_from_metadata

    base = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.feed_forward_length": 96,
            "llama.block_count": 2, "llama.attention.head_count": 4, "llama.context_length": 128,
            "llama.attention.layer_norm_rms_epsilon": 1e-5}
    assert hf_config_from_metadata(base, vocab_size=10, tied=False)["head_dim"] == 16
    with pytest.raises(ValueError, match="architecture"):
        hf_config_from_metadata({**base, "general.architecture": "gpt2"}, vocab_size=10, tied=False)
    with pytest.raises(ValueError, match="block_count"):
        hf_config_from_metadata({k: v for k, v in base.items() if k != "llama.block_count"}, vocab_size=10, tied=False)
    with pytest.raises(ValueError, match="partial rotary"):
        hf_config_from_metadata({**base, "llama.rope.dimension_count": 8}, vocab_size=10, tied=False)
    with pytest.raises(ValueError, match="yarn"):
        hf_config_from_metadata({**base, "llama.rope.scaling.type": "yarn"}, vocab_size=10, tied=False)


def test_not_a_file():
    with pytest.raises(ValueError, match="not a file"):
        read_gguf("/nonexistent/model.gguf")
