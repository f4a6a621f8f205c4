"""LoRA / QLoRA on the decoder (models/lora.py): a fresh adapter (B = 0) leaves the logits
exactly unchanged; the adapted forward (factored on attention, merged per layer on the MLP)
equals the merged params' forward and a float64 numpy merge; adapter gradients through the
adapted forward equal those through the merged params; the prefill/decode path runs the
adapted model; int8 / int4 dequantisation errors within their stated bounds (float64);
dequantise-on-use equals the dequantised params; config errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import lora as L
from models.config import get_config
from models.decoder import decode_step, forward, init_params, prefill
from models.kv_cache import init_cache
from models.logprobs import token_logprobs
from models.packed import check_params

CFG = get_config("tiny", vocab_size=32, max_position_embeddings=32)
LCFG = L.LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base():
    return init_params(CFG, 0)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)), jnp.int32)


def trained(adapters, seed=1, size=0.05):
    """Adapters as after training: every A and B entry nonzero."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + size * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])


def test_fresh_adapters_give_exactly_the_base_logits(base, tokens):
    ad = L.init_lora(base, LCFG, 1)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(ad)[1::2])  # B = 0
    assert np.asarray(ad["layers"]["attn"]["q_proj"]["lora_a"]).std() > 0.05  # A is random
    np.testing.assert_array_equal(forward(L.compose(base, ad, LCFG), CFG, tokens),
                                  forward(base, CFG, tokens))


def test_adapted_forward_equals_merged_and_float64_merge(base, tokens):
    ad = trained(L.init_lora(base, LCFG, 1))
    adapted = np.asarray(forward(L.compose(base, ad, LCFG), CFG, tokens))
    merged = L.merge(base, ad, LCFG)
    np.testing.assert_allclose(adapted, forward(merged, CFG, tokens), atol=1e-5, rtol=0)
    assert np.abs(adapted - np.asarray(forward(base, CFG, tokens))).max() > 0.1  # it adapts
    s = LCFG.alpha / LCFG.rank
    for parent, name in (("attn", "o_proj"), ("mlp", "down_proj"), ("attn", "k_proj")):
        w = np.asarray(base["layers"][parent][name]["kernel"], np.float64)
        a = np.asarray(ad["layers"][parent][name]["lora_a"], np.float64)
        b = np.asarray(ad["layers"][parent][name]["lora_b"], np.float64)
        want = w + s * np.stack([a[i] @ b[i] for i in range(w.shape[0])]).reshape(w.shape)
        np.testing.assert_allclose(merged["layers"][parent][name]["kernel"], want, atol=1e-6)
    # untargeted leaves pass through untouched
    np.testing.assert_array_equal(merged["embed"]["embedding"], base["embed"]["embedding"])


def test_targets_select_projections_and_others_stay_base(base, tokens):
    cfg = L.LoraConfig(rank=2, targets=("q_proj", "down_*"))
    assert cfg.projections == ("q_proj", "down_proj")
    ad = L.init_lora(base, cfg, 3)
    assert set(ad["layers"]["attn"]) == {"q_proj"} and set(ad["layers"]["mlp"]) == {"down_proj"}
    ad = trained(ad)
    merged = L.merge(base, ad, cfg)
    np.testing.assert_array_equal(merged["layers"]["attn"]["v_proj"]["kernel"],
                                  base["layers"]["attn"]["v_proj"]["kernel"])
    np.testing.assert_allclose(forward(L.compose(base, ad, cfg), CFG, tokens),
                               forward(merged, CFG, tokens), atol=1e-5, rtol=0)
    assert L.LoraConfig(targets="*").projections == tuple(L.PROJECTIONS)


def test_adapter_gradients_match_the_merged_path(base, tokens):
    ad = trained(L.init_lora(base, LCFG, 1))
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def total(params):
        return jnp.sum(token_logprobs(params, CFG, tokens, pos, 1.0, None)[0])

    g_adapted = jax.grad(lambda a: total(L.compose(base, a, LCFG)))(ad)
    g_merged = jax.grad(lambda a: total(L.merge(base, a, LCFG)))(ad)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(g_merged))
    assert scale > 1e-3
    for got, want in zip(jax.tree.leaves(g_adapted), jax.tree.leaves(g_merged)):
        np.testing.assert_allclose(got, want, atol=1e-4 * scale, rtol=1e-3)


def test_prefill_and_decode_run_the_adapted_model(base, tokens):
    ad = trained(L.init_lora(base, LCFG, 1))
    adapted, merged = L.compose(base, ad, LCFG), L.merge(base, ad, LCFG)
    b, t = tokens.shape
    outs = []
    for params in (adapted, merged):
        cache = init_cache(CFG, b, 16)
        logits, cache = prefill(params, CFG, tokens, jnp.full((b,), t, jnp.int32), cache)
        step_logits, _ = decode_step(params, CFG, tokens[:, 0], cache)
        outs.append((np.asarray(logits), np.asarray(step_logits)))
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _error_and_bound(w, n_in, fmt):
    """|dequantise(quantise(w)) - w| in float64, and the module docstring's bound."""
    q = L.quantize_kernel(jnp.asarray(w, jnp.float32), n_in, fmt)
    err = np.abs(np.asarray(L.dequantize_kernel(q["qkernel"], q["qscale"]), np.float64) - w)
    if fmt == "int8":  # per output channel: absmax over the input axes / 254
        assert q["qkernel"].dtype == np.int8 and q["qkernel"].shape == w.shape
        bound = np.abs(w).max(axis=tuple(range(1, 1 + n_in)), keepdims=True) / 254
    else:  # blocks of min(64, last) along the last axis: absmax_block / 14
        assert q["qkernel"].dtype == np.uint8 and q["qkernel"].shape[-1] == w.shape[-1] // 2
        blk = min(64, w.shape[-1])
        blocks = np.abs(w).reshape(w.shape[:-1] + (w.shape[-1] // blk, blk))
        bound = np.repeat(blocks.max(axis=-1), blk, axis=-1) / 14
    return err, np.broadcast_to(bound * (1 + 2 ** -20), w.shape)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_dequantisation_error_within_the_stated_bound(base, fmt):
    rng = np.random.default_rng(5)
    for name, (parent, n_in) in L.PROJECTIONS.items():
        w = np.asarray(base["layers"][parent][name]["kernel"], np.float64)
        err, bound = _error_and_bound(w, n_in, fmt)
        assert np.all(err <= bound), name
        assert (err / bound).max() > 0.9  # the bound is tight: some element nearly reaches it
        # channels of very different magnitudes, all-zero channels and an all-zero block
        w = w * rng.lognormal(0, 2, w.shape[-1])
        w[0, ..., :min(64, w.shape[-1])] = 0.0
        err, bound = _error_and_bound(w, n_in, fmt)
        assert np.all(err <= bound), name
        assert np.all(err[0, ..., :min(64, w.shape[-1])] == 0)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_base_dequantises_on_use(base, tokens, fmt):
    qbase = L.quantize_base(base, fmt)
    assert "kernel" not in qbase["layers"]["mlp"]["up_proj"]
    assert L.count_bytes(qbase) < 0.5 * L.count_bytes(base)
    plain = L.dequantize_base(qbase)
    np.testing.assert_allclose(forward(qbase, CFG, tokens), forward(plain, CFG, tokens),
                               atol=1e-6, rtol=0)
    ad = trained(L.init_lora(qbase, LCFG, 1))
    np.testing.assert_allclose(forward(L.compose(qbase, ad, LCFG), CFG, tokens),
                               forward(L.merge(qbase, ad, LCFG), CFG, tokens), atol=1e-5, rtol=0)
    # the quantized model stays close to the original (int4 is coarser than int8)
    gap = np.abs(np.asarray(forward(qbase, CFG, tokens)) - np.asarray(forward(base, CFG, tokens)))
    assert gap.max() < (0.02 if fmt == "int8" else 0.3)


def test_param_checks_see_adapted_and_quantized_params_as_plain(base):
    for params in (base, L.quantize_base(base, "int4"), L.quantize_base(base, "int8")):
        check_params(L.compose(params, L.init_lora(params, LCFG, 1), LCFG), CFG)
    bad = L.quantize_base(init_params(get_config("tiny", vocab_size=32, num_heads=2,
                                                 max_position_embeddings=32), 0), "int8")
    with pytest.raises(ValueError, match="params do not match the config"):
        check_params(bad, CFG)


def test_config_and_shape_errors(base):
    with pytest.raises(ValueError, match="matches no projection"):
        L.LoraConfig(targets=("qproj",))
    with pytest.raises(ValueError, match="dropout must be 0"):
        L.LoraConfig(dropout=0.1)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        L.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="qlora must be None or one of"):
        L.LoraConfig(qlora="nf3")
    ad = L.init_lora(base, LCFG, 1)
    with pytest.raises(ValueError, match="LoraConfig.targets select"):
        L.compose(base, ad, L.LoraConfig(rank=4, targets=("q_proj",)))
    with pytest.raises(ValueError, match="at rank 2 needs"):
        L.compose(base, ad, L.LoraConfig(rank=2))
    with pytest.raises(ValueError, match="already quantized"):
        L.quantize_base(L.quantize_base(base, "int8"), "int4")
