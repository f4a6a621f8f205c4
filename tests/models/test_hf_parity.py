"""HF parity: tiny random transformers models (Llama / Qwen2 / Qwen3), saved with
save_pretrained, loaded with load_hf_checkpoint; our logits must match transformers'
within 1e-4 (fp32) at every valid position of padded and packed batches. Also the
loader's error messages and the save_hf_checkpoint -> transformers round trip."""
import json

import numpy as np
import pytest

# Required test deps (the dev extra): a missing install must fail, not skip.
import torch  # noqa: E402
import transformers  # noqa: E402

from models.config import config_from_hf  # noqa: E402
from models.convert import params_from_hf  # noqa: E402
from models.decoder import forward  # noqa: E402
from models.hf_loader import _read_tensors, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

VOCAB, BATCH, SEQ = 96, 3, 10
LENGTHS = (10, 6, 3)  # right-padded ragged rows
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def make_hf(kind: str, seed: int, **kw):
    """A tiny random HF model; every parameter (norms and biases too) is randomised so
    that a wrong mapping of any tensor shows up in the logits."""
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[kind]
    cfg = cls(**{**COMMON, **kw})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def hf_logits(model, tokens, positions=None, mask=None) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            position_ids=None if positions is None else torch.tensor(positions),
            attention_mask=None if mask is None else torch.tensor(mask),
        )
    return out.logits.float().numpy()


def padded_batch(seed: int, offset: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int64)
    valid = (np.arange(SEQ)[None, :] < np.array(LENGTHS)[:, None]).astype(np.int64)
    positions = np.broadcast_to(np.arange(SEQ) + offset, (BATCH, SEQ)).astype(np.int64)
    return tokens, valid, positions


def assert_parity(model, path, seed=0, offset=0):
    """Save `model`, load it with ours, compare logits on a padded batch."""
    model.save_pretrained(path)
    config, params = load_hf_checkpoint(path)
    tokens, valid, positions = padded_batch(seed, offset)
    ref = hf_logits(model, tokens, positions, valid)
    ours = np.asarray(forward(params, config, tokens, positions, segment_ids=valid))
    assert np.isfinite(ours).all(), "padding rows must give finite logits"
    err = np.abs(ours - ref)[valid.astype(bool)].max()
    assert err < 1e-4, f"max abs logit error {err}"
    return config, params


def test_llama_parity_padded_and_packed(tmp_path):
    model = make_hf("llama", 0, head_dim=8)
    config, params = assert_parity(model, tmp_path / "llama")
    assert config.arch == "llama" and config.tie_word_embeddings is False
    # Two sequences packed in one row (segments 1 and 2, positions restart), one padded
    # tail: each segment must match transformers run on that sequence alone.
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, VOCAB, 6), rng.integers(0, VOCAB, 3)
    tokens = np.zeros((1, SEQ), np.int64)
    tokens[0, :9] = np.concatenate([a, b])
    segs = np.array([[1] * 6 + [2] * 3 + [0]])
    pos = np.array([list(range(6)) + list(range(3)) + [0]])
    ours = np.asarray(forward(params, config, tokens, pos, segment_ids=segs))[0]
    np.testing.assert_allclose(ours[:6], hf_logits(model, a[None])[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[6:9], hf_logits(model, b[None])[0], atol=1e-4, rtol=0)


def test_qwen2_parity_with_qkv_bias(tmp_path):
    config, params = assert_parity(make_hf("qwen2", 1, tie_word_embeddings=True), tmp_path / "q2")
    assert config.attention_bias and config.tie_word_embeddings
    assert "bias" in params["layers"]["attn"]["q_proj"]


def test_qwen3_parity_with_qk_norm(tmp_path):
    # head_dim differs from hidden/heads, as in the real Qwen3-0.6B.
    model = make_hf("qwen3", 2, head_dim=16, tie_word_embeddings=True)
    config, _ = assert_parity(model, tmp_path / "q3")
    assert config.qk_norm and config.head_dim == 16


def test_llama3_rope_scaling_parity(tmp_path):
    # Small original context so all three frequency bands (kept / smoothed / divided) occur,
    # and positions offset by 40 so the scaled frequencies matter.
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    model = make_hf("llama", 3, head_dim=8, rope_scaling=scaling, rope_theta=500.0)
    config, _ = assert_parity(model, tmp_path / "l3", seed=1, offset=40)
    assert config.rope_scaling.kind == "llama3" and config.rope_scaling.factor == 4.0


def test_linear_rope_scaling_parity(tmp_path):
    model = make_hf("llama", 4, head_dim=8, rope_scaling={"rope_type": "linear", "factor": 2.5})
    config, _ = assert_parity(model, tmp_path / "lin", seed=2, offset=17)
    assert config.rope_scaling.kind == "linear"


def test_sharded_checkpoint_and_save_roundtrip(tmp_path):
    model = make_hf("llama", 0, head_dim=8)  # same config as the first test: no recompile
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    config, params = load_hf_checkpoint(tmp_path / "sharded")
    tokens, valid, positions = padded_batch(7)
    ref = hf_logits(model, tokens, positions, valid)
    ours = np.asarray(forward(params, config, tokens, positions, segment_ids=valid))
    assert np.abs(ours - ref)[valid.astype(bool)].max() < 1e-4

    # Our writer -> transformers reads every tensor (nothing missing/unexpected) -> same logits.
    save_hf_checkpoint(tmp_path / "ours", config, params)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    again = hf_logits(reloaded.float().eval(), tokens, positions, valid)
    assert np.abs(again - ref)[valid.astype(bool)].max() < 1e-5


def test_tied_save_roundtrip_through_transformers(tmp_path):
    model = make_hf("qwen3", 2, head_dim=16, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "src")
    config, params = load_hf_checkpoint(tmp_path / "src")
    save_hf_checkpoint(tmp_path / "ours", config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    tokens, valid, positions = padded_batch(3)
    ref = hf_logits(model, tokens, positions, valid)
    again = hf_logits(reloaded, tokens, positions, valid)
    assert np.abs(again - ref)[valid.astype(bool)].max() < 1e-5


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "llama"
    make_hf("llama", 0, head_dim=8).save_pretrained(path)
    return path


def test_unknown_architecture_is_named(llama_dir):
    hf = json.loads((llama_dir / "config.json").read_text())
    hf["model_type"] = "gpt2"
    with pytest.raises(ValueError, match="gpt2"):
        config_from_hf(hf)


def test_dynamic_rope_is_rejected(llama_dir):
    hf = json.loads((llama_dir / "config.json").read_text())
    hf["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="dynamic"):
        config_from_hf(hf)


def test_missing_tensor_is_named(llama_dir):
    config = config_from_hf(json.loads((llama_dir / "config.json").read_text()))
    tensors = _read_tensors(llama_dir)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        params_from_hf(tensors, config)


def test_misshaped_tensor_is_named(llama_dir):
    config = config_from_hf(json.loads((llama_dir / "config.json").read_text()))
    tensors = _read_tensors(llama_dir)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.ones((15, 32), np.float32)
    with pytest.raises(ValueError, match=r"k_proj\.weight' has shape \(15, 32\), expected \(16, 32\)"):
        params_from_hf(tensors, config)


def test_unexpected_tensor_is_named(llama_dir):
    config = config_from_hf(json.loads((llama_dir / "config.json").read_text()))
    tensors = _read_tensors(llama_dir)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.ones((32,), np.float32)
    tensors["model.rotary_emb.inv_freq"] = np.ones((4,), np.float32)  # ignored buffer
    with pytest.raises(ValueError, match=r"does not use: 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        params_from_hf(tensors, config)
