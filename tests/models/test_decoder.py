"""Decoder building blocks: attention vs a float64 loop, preset sizes vs the published
parameter counts, config round trips and validation, input validation, remat, and
forward under a (data=2, fsdp=2, tensor=2) mesh of 8 forced host devices."""
import math
import os
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attention, attention_xla_grouped, attention_xla_repeated
from models.config import PRESETS, ModelConfig, config_from_hf, config_to_hf, get_config
from models.decoder import forward, init_params, param_logical_axes

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- attention
def loop_attention(q, k, v, mask):
    """float64 triple loop: per row, query, head; GQA head h reads kv head h // group."""
    b, lq, h, d = q.shape
    lk, kvh = k.shape[1], k.shape[2]
    group = h // kvh
    out = np.zeros((b, lq, h, d))
    for bi in range(b):
        for i in range(lq):
            for hi in range(h):
                allowed = [j for j in range(lk) if mask[bi, i, j]]
                if not allowed:
                    continue  # fully masked row -> zeros
                s = np.array([q[bi, i, hi] @ k[bi, j, hi // group] for j in allowed]) / math.sqrt(d)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, i, hi] = sum(pj * v[bi, j, hi // group] for pj, j in zip(p, allowed))
    return out


_attn = jax.jit(attention, static_argnames="impl")


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (4, 1)])
def test_attention_matches_float64_loop(impl, heads, kv_heads):
    rng = np.random.default_rng(heads * 10 + kv_heads)
    b, lq, lk, d = 2, 5, 7, 8
    q = rng.standard_normal((b, lq, heads, d))
    k = rng.standard_normal((b, lk, kv_heads, d))
    v = rng.standard_normal((b, lk, kv_heads, d))
    mask = rng.random((b, lq, lk)) < 0.6
    mask[1, 2] = False  # a fully masked query row must give zeros, not NaN
    out = np.asarray(_attn(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                           mask=jnp.asarray(mask), impl=impl))
    np.testing.assert_allclose(out, loop_attention(q, k, v, mask), atol=2e-5, rtol=0)
    assert not out[1, 2].any()


@pytest.mark.parametrize("path", [attention_xla_grouped, attention_xla_repeated],
                         ids=["grouped", "repeated"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_both_xla_layouts_match_the_float64_reference_forward_and_vjp(path, heads, kv_heads):
    """impl="xla" takes the repeated layout on CPU and the grouped one on accelerators:
    each, forward and vjp, against the reference's arithmetic in float64."""
    rng = np.random.default_rng(heads + kv_heads)
    b, lq, lk, d = 2, 5, 7, 8
    q, k, v = (rng.standard_normal((b, n, h, d)) for n, h in ((lq, heads), (lk, kv_heads),
                                                              (lk, kv_heads)))
    w = rng.standard_normal((b, lq, heads, d))
    mask = rng.random((b, lq, lk)) < 0.6
    mask[1, 2] = False

    def grads(f, dtype):
        loss = lambda q, k, v: jnp.sum(f(q, k, v, jnp.asarray(mask)) * w)  # noqa: E731
        args = [jnp.asarray(x, dtype) for x in (q, k, v)]
        return [np.asarray(x) for x in (f(*args, jnp.asarray(mask)),
                                        *jax.grad(loss, argnums=(0, 1, 2))(*args))]

    with jax.enable_x64():
        want = grads(lambda q, k, v, m: attention(q, k, v, mask=m, impl="reference"),
                     jnp.float64)
    got = grads(jax.jit(path), jnp.float32)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=0, err_msg=name)
    assert not got[0][1, 2].any() and not got[1][1, 2].any()  # masked row: zeros, no grad


def test_attention_rejects_bad_impl_and_shapes():
    q = jnp.ones((1, 2, 4, 8))
    k = jnp.ones((1, 3, 2, 8))
    with pytest.raises(ValueError, match="no pallas kernel for dense attention; use impl='xla'"):
        attention(q, k, k, impl="pallas")
    with pytest.raises(ValueError, match="impl must be one of"):
        attention(q, k, k, impl="cuda")
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of kv heads \(3\)"):
        attention(q, jnp.ones((1, 3, 3, 8)), jnp.ones((1, 3, 3, 8)))
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(q, k, k, mask=jnp.ones((1, 2, 4), bool))


# ----------------------------------------------------------------------------- configs
# Parameter counts published for the released checkpoints.
PUBLISHED_PARAMS = {
    "smollm2-135m": 134_515_008,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts(name):
    shapes = jax.eval_shape(partial(init_params, get_config(name)), jax.random.PRNGKey(0))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == PUBLISHED_PARAMS[name]


def test_logical_axes_cover_every_param():
    config = get_config("tiny", attention_bias=True, qk_norm=True, tie_word_embeddings=False)
    shapes = jax.eval_shape(partial(init_params, config), jax.random.PRNGKey(0))
    axes = param_logical_axes(config)
    flat = jax.tree.leaves_with_path(shapes)
    assert len(flat) == 17  # 3 top-level + 14 per-layer tensors
    for path, leaf in flat:
        names = axes
        for key in path:
            names = names[key.key]
        assert isinstance(names, tuple) and len(names) == len(leaf.shape), (path, names)
    assert axes["layers"]["attn"]["q_proj"]["kernel"] == ("layers", "embed", "heads", "head_dim")
    assert axes["lm_head"]["kernel"] == ("embed", "vocab")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_roundtrip(name):
    assert config_from_hf(config_to_hf(PRESETS[name])) == PRESETS[name]


def test_config_validation_messages():
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt2'.*'smollm2-135m'"):
        get_config("gpt2")
    with pytest.raises(ValueError, match=r"arch must be one of .* got 'gpt2'"):
        get_config("tiny", arch="gpt2")
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        get_config("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match=r"hidden_size must be a positive int"):
        get_config("tiny", hidden_size=0)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        get_config("tiny", dtype="float16")
    with pytest.raises(ValueError, match=r"has no field\(s\) \['layers'\]"):
        get_config("tiny", layers=3)
    hf = config_to_hf(get_config("tiny"))
    with pytest.raises(ValueError, match=r"attention_bias=True \(biases on o_proj\)"):
        config_from_hf({**hf, "attention_bias": True})
    assert isinstance(get_config("tiny"), ModelConfig)


# ----------------------------------------------------------------------------- forward
TINY = get_config("tiny")


def test_forward_rejects_bad_tokens_and_positions():
    params = init_params(TINY, 0)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 5))
    bad = tokens.copy()
    bad[0, 3] = TINY.vocab_size + 4
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=256\).*\[260\]"):
        forward(params, TINY, bad)
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        forward(params, TINY, tokens.astype(np.float32))
    pos = np.broadcast_to(np.arange(5) + TINY.max_position_embeddings - 2, (2, 5))
    with pytest.raises(ValueError, match=r"positions must be in \[0, max_position_embeddings=512\)"):
        forward(params, TINY, tokens, pos)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 5\)"):
        forward(params, TINY, tokens, segment_ids=np.ones((2, 4), np.int32))


def test_remat_checkpoints_each_layer():
    # Tracing only (compiling two backward passes would cost ~10 s of the test budget):
    # with remat the gradient's jaxpr holds a checkpoint around the scanned layer.
    params = jax.eval_shape(partial(init_params, TINY), jax.random.PRNGKey(0))
    tokens = jnp.zeros((1, 4), jnp.int32)

    def grad_jaxpr(cfg):
        loss = lambda p: forward(p, cfg, tokens).sum()  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss))(params))

    assert "remat" in grad_jaxpr(TINY.replace(remat=True))  # jax.checkpoint's primitive
    assert "remat" not in grad_jaxpr(TINY)
    assert "remat" not in grad_jaxpr(TINY.replace(remat="none"))
    full, dots = grad_jaxpr(TINY.replace(remat="full")), grad_jaxpr(TINY.replace(remat="dots"))
    assert "remat" in full and "policy=None" in full
    assert "policy=<function" in dots  # the "dots" policy rides along
    with pytest.raises(ValueError, match="ModelConfig.remat must be"):
        TINY.replace(remat="some")


def test_remat_dots_saves_the_projection_outputs():
    # The projections are custom_vjp calls (models.weight_grads.project), which the plain
    # dots policy would recompute: "dots" must keep q and k per layer,
    # "full" must not. The residuals a vjp closes over are the saved values.
    tokens = jnp.zeros((1, 5), jnp.int32)
    L, H, K, D = TINY.num_layers, TINY.num_heads, TINY.num_kv_heads, TINY.head_dim

    def residual_shapes(cfg):
        params = init_params(cfg, jax.random.PRNGKey(0))
        _, vjp = jax.vjp(lambda p: forward(p, cfg, tokens).sum(), params)
        return {tuple(x.shape) for x in jax.tree.leaves(vjp)}

    dots, full = residual_shapes(TINY.replace(remat="dots")), residual_shapes(TINY.replace(remat="full"))
    for projected in [(L, 1, 5, H, D), (L, 1, 5, K, D)]:
        assert projected in dots and projected not in full


# ----------------------------------------------------------------------------- sharding
SHARDED_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from models.config import get_config
    from models.decoder import forward, param_logical_axes
    from models.sharding import logical_to_mesh_sharding, make_mesh, mesh_context

    assert len(jax.devices()) == 8
    config = get_config("tiny")
    data = np.load(sys.argv[1], allow_pickle=True)
    params = data["params"].item()
    tokens, segs, single = data["tokens"], data["segs"], data["single"]

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = logical_to_mesh_sharding(param_logical_axes(config), mesh)
    placed = jax.device_put(params, shardings)
    q = placed["layers"]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "fsdp", "tensor", None), q.sharding.spec
    assert len(q.sharding.device_set) == 8
    with mesh_context(mesh):
        sharded = forward(placed, config, tokens, segment_ids=segs)
    assert sharded.sharding.spec[0] == ("data", "fsdp"), sharded.sharding.spec
    err = float(np.abs(np.asarray(sharded) - single)[segs.astype(bool)].max())
    assert err <= 1e-5, err
    try:
        make_mesh(data=4, fsdp=4)
    except ValueError as e:
        assert "16 devices needed but only 8" in str(e)
    else:
        raise AssertionError("make_mesh accepted too many devices")
    print("SHARDED_OK", err)
""")


def test_forward_on_8_device_mesh_matches_single_device(tmp_path):
    # The 1-device logits come from this process; the subprocess only runs the sharded one.
    params = jax.tree.map(np.asarray, init_params(TINY, 0))
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (4, 8))
    segs = (np.arange(8)[None] < np.array([8, 5, 8, 2])[:, None]).astype(np.int32)
    single = np.asarray(forward(params, TINY, tokens, segment_ids=segs))
    np.savez(tmp_path / "case.npz", params=np.array(params, dtype=object), tokens=tokens,
             segs=segs, single=single)
    env = {**os.environ,
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, str(tmp_path / "case.npz")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SHARDED_OK" in proc.stdout, proc.stderr[-3000:]
