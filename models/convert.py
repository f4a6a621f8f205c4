"""The one mapping between HF (PyTorch) tensor names and Tandem's parameter pytree.

Our tree (layer params stacked on a leading [layers] axis, matching `nn.scan`):
  embed/embedding                 [vocab, embed]
  layers/input_norm/scale         [layers, embed]
  layers/attn/q_proj/kernel       [layers, embed, heads, head_dim]     (+ bias [layers, heads, head_dim])
  layers/attn/k_proj/kernel       [layers, embed, kv_heads, head_dim]  (+ bias)
  layers/attn/v_proj/kernel       [layers, embed, kv_heads, head_dim]  (+ bias)
  layers/attn/o_proj/kernel       [layers, heads, head_dim, embed]
  layers/attn/{q,k}_norm/scale    [layers, head_dim]                   (qwen3)
  layers/post_attn_norm/scale     [layers, embed]
  layers/mlp/{gate,up}_proj/kernel [layers, embed, mlp]
  layers/mlp/down_proj/kernel     [layers, mlp, embed]
  final_norm/scale                [embed]
  lm_head/kernel                  [embed, vocab]                       (untied only)
torch Linear weights are [out, in]; ours are [in, out] with heads split out.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import ModelConfig

Params = dict[str, Any]

_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _layer_specs(c: ModelConfig) -> list[tuple[str, tuple[str, ...], tuple[int, ...], Callable, Callable]]:
    """(hf suffix, our path inside layers, torch shape, to_ours, to_hf) for one layer."""
    E, H, K, D, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size

    def proj_in(heads):  # torch [heads*D, E] -> ours [E, heads, D]
        return (lambda w: w.T.reshape(E, heads, D), lambda w: w.reshape(E, heads * D).T)

    def bias(heads):  # torch [heads*D] -> ours [heads, D]
        return (lambda b: b.reshape(heads, D), lambda b: b.reshape(heads * D))

    def transpose():
        return (lambda w: w.T, lambda w: w.T)

    def same():
        return (lambda w: w, lambda w: w)

    specs = [
        ("input_layernorm.weight", ("input_norm", "scale"), (E,), *same()),
        ("post_attention_layernorm.weight", ("post_attn_norm", "scale"), (E,), *same()),
        ("self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), (H * D, E), *proj_in(H)),
        ("self_attn.k_proj.weight", ("attn", "k_proj", "kernel"), (K * D, E), *proj_in(K)),
        ("self_attn.v_proj.weight", ("attn", "v_proj", "kernel"), (K * D, E), *proj_in(K)),
        # torch o_proj [E, H*D] -> ours [H, D, E]
        ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), (E, H * D),
         lambda w: w.T.reshape(H, D, E), lambda w: w.reshape(H * D, E).T),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), (F, E), *transpose()),
        ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), (F, E), *transpose()),
        ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), (E, F), *transpose()),
    ]
    if c.attention_bias:
        specs += [
            ("self_attn.q_proj.bias", ("attn", "q_proj", "bias"), (H * D,), *bias(H)),
            ("self_attn.k_proj.bias", ("attn", "k_proj", "bias"), (K * D,), *bias(K)),
            ("self_attn.v_proj.bias", ("attn", "v_proj", "bias"), (K * D,), *bias(K)),
        ]
    if c.qk_norm:
        specs += [
            ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (D,), *same()),
            ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (D,), *same()),
        ]
    return specs


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _is_ignorable(name: str) -> bool:
    # Rotary inverse-frequency buffers are derived from the config, not learned.
    return name.endswith("rotary_emb.inv_freq")


def params_from_hf(state_dict: Mapping[str, Any], config: ModelConfig) -> Params:
    """Tandem params (jnp arrays in config.param_dtype) from HF tensors (numpy-like).

    Raises ValueError naming the tensor on a missing tensor, a wrong shape, or a tensor
    that this config has no place for.
    """
    c = config
    dtype = _NP_DTYPES[c.param_dtype]
    used: set[str] = set()

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in state_dict:
            raise ValueError(f"missing tensor {name!r} in checkpoint (expected shape {shape})")
        arr = np.asarray(state_dict[name])
        if tuple(arr.shape) != shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(arr.shape)}, expected {shape} for this config"
            )
        used.add(name)
        # Keep float32 through the reshapes; cast once at the end.
        return arr.astype(np.float32)

    params: Params = {}
    E, V = c.hidden_size, c.vocab_size
    _set(params, ("embed", "embedding"), fetch("model.embed_tokens.weight", (V, E)))
    _set(params, ("final_norm", "scale"), fetch("model.norm.weight", (E,)))
    if not c.tie_word_embeddings:
        _set(params, ("lm_head", "kernel"), fetch("lm_head.weight", (V, E)).T)
    elif "lm_head.weight" in state_dict:
        # Some tied checkpoints store the head anyway; accept it only if it really is tied.
        head = np.asarray(state_dict["lm_head.weight"], dtype=np.float32)
        if head.shape != (V, E) or not np.array_equal(head, _get(params, ("embed", "embedding"))):
            raise ValueError(
                "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' but the "
                "config has tie_word_embeddings=True; set tie_word_embeddings=False"
            )
        used.add("lm_head.weight")
    for suffix, path, shape, to_ours, _ in _layer_specs(c):
        stacked = np.stack(
            [to_ours(fetch(f"model.layers.{i}.{suffix}", shape)) for i in range(c.num_layers)]
        )
        _set(params, ("layers", *path), stacked)

    extra = sorted(k for k in state_dict if k not in used and not _is_ignorable(k))
    if extra:
        shown = ", ".join(repr(k) for k in extra[:5]) + (" ..." if len(extra) > 5 else "")
        raise ValueError(
            f"checkpoint has {len(extra)} tensor(s) this config does not use: {shown} "
            f"(arch={c.arch!r}, num_layers={c.num_layers}, attention_bias={c.attention_bias}, "
            f"qk_norm={c.qk_norm}, tie_word_embeddings={c.tie_word_embeddings})"
        )
    return jax.tree.map(lambda a: jnp.asarray(a.astype(dtype)), params)


def hf_from_params(params: Params, config: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named numpy tensors (in config.param_dtype) from Tandem params; inverse of
    params_from_hf."""
    c = config
    dtype = _NP_DTYPES[c.param_dtype]

    def arr(path: tuple[str, ...]) -> np.ndarray:
        try:
            value = _get(params, path)
        except KeyError:
            raise ValueError(f"params are missing {'/'.join(path)} for this config") from None
        return np.asarray(value).astype(np.float32)

    out = {
        "model.embed_tokens.weight": arr(("embed", "embedding")),
        "model.norm.weight": arr(("final_norm", "scale")),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = arr(("lm_head", "kernel")).T
    for suffix, path, _, _, to_hf in _layer_specs(c):
        stacked = arr(("layers", *path))
        for i in range(c.num_layers):
            out[f"model.layers.{i}.{suffix}"] = to_hf(stacked[i])
    return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}
