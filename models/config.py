"""Model hyper-parameters: `ModelConfig`, presets, and conversion to/from HF config.json.

One config covers the Llama family (Llama 3.x, SmolLM2), Qwen2 (q/k/v biases) and Qwen3
(per-head q/k RMSNorm). Configs are frozen and hashable so they can be jit static args.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")
ROPE_KINDS = ("linear", "llama3")
REMAT_POLICIES = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `None` on ModelConfig means plain RoPE."""

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(
                f"RopeScaling.kind must be one of {ROPE_KINDS}, got {self.kind!r}"
            )
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.kind == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    "RopeScaling: need 0 < low_freq_factor < high_freq_factor, got "
                    f"{self.low_freq_factor} and {self.high_freq_factor}"
                )
            if self.original_max_position_embeddings <= 0:
                raise ValueError(
                    "RopeScaling.original_max_position_embeddings must be > 0, got "
                    f"{self.original_max_position_embeddings}"
                )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters. Shapes: embeddings [vocab_size, hidden_size], attention
    with num_heads query heads and num_kv_heads key/value heads of size head_dim."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype
    # rematerialise each layer in the backward: False / "none" (store its activations),
    # True / "full" (store only the layer's input), "dots" (store the matmul outputs,
    # recompute the rest); REMAT_POLICIES
    remat: bool | str = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                "ModelConfig.rope_scaling must be a RopeScaling or None, got "
                f"{type(self.rope_scaling).__name__}"
            )
        if not isinstance(self.remat, bool) and self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat must be True, False or one of {REMAT_POLICIES}, "
                             f"got {self.remat!r}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}"
                )
        # Accept any iterable of ids but store a tuple so the config stays hashable.
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for name in ("bos_token_id", "pad_token_id"):
            tok = getattr(self, name)
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"ModelConfig.{name}={tok} is outside the vocabulary [0, {self.vocab_size})"
                )
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"ModelConfig.eos_token_ids contains {tok}, outside [0, {self.vocab_size})"
                )

    def replace(self, **kw) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        unknown = set(kw) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"ModelConfig has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **kw)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,), pad_token_id=0,
    ),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        # Token ids of the Instruct tokenizer (the weights Tandem ships with): bos
        # <|im_start|>=1, eos <|im_end|>=2, and <|endoftext|>=0 also stops generation.
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2, 0), pad_token_id=2,
    ),
    "qwen2.5-0.5b": ModelConfig(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151643,),
    ),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_ids=(151645,),
    ),
    "llama-3.2-1b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,),
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """Preset `name` with some fields overridden, e.g. get_config("tiny", dtype="bfloat16")."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available presets: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the old (`rope_theta` + `rope_scaling`) or the
    new transformers>=5 (`rope_parameters`) layout of config.json."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind == "linear":
        return float(theta), RopeScaling(kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return float(theta), RopeScaling(
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        )
    # "dynamic" rescales RoPE by the current sequence length, which would make cached keys
    # depend on how long the sequence later grows; not supported rather than subtly wrong.
    raise ValueError(
        f"unsupported rope scaling type {kind!r}; supported: 'default', 'linear', 'llama3'"
    )


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a HF config.json dict (model_type "llama", "qwen2" or "qwen3")."""
    hf = dict(hf_config)
    arch = hf.get("model_type")
    if arch not in ARCHS:
        raise ValueError(
            f"unsupported architecture model_type={arch!r}; supported: {list(ARCHS)}"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only 'silu' / SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=True (MLP projections have no bias)")
    if arch == "qwen2":
        attention_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias.
        if hf.get("use_sliding_window"):
            raise ValueError("unsupported config: qwen2 use_sliding_window=True")
    else:
        # Llama/Qwen3 `attention_bias` also adds an o_proj bias, which we do not model.
        if hf.get("attention_bias"):
            raise ValueError(
                f"unsupported config: {arch} attention_bias=True (biases on o_proj)"
            )
        attention_bias = False
    num_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    theta, scaling = _rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    param_dtype = "bfloat16" if dtype == "bfloat16" else "float32"
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(hf["max_position_embeddings"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=arch == "qwen3",
        param_dtype=param_dtype,
        dtype=param_dtype,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
    )


_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def config_to_hf(config: ModelConfig) -> dict:
    """A config.json dict that transformers (old or new layout) and config_from_hf read back."""
    if config.arch in ("llama", "qwen3") and config.attention_bias:
        raise ValueError(
            f"config_to_hf: {config.arch} has no q/k/v-only bias in HF; set attention_bias=False"
        )
    if config.arch == "qwen2" and not config.attention_bias:
        raise ValueError("config_to_hf: HF qwen2 always has q/k/v biases; set attention_bias=True")
    if config.qk_norm != (config.arch == "qwen3"):
        raise ValueError(f"config_to_hf: qk_norm={config.qk_norm} does not match arch {config.arch!r}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings,
            )
        rope = {**scaling, "rope_theta": config.rope_theta}
    eos = list(config.eos_token_ids)
    out = {
        "architectures": [_HF_CLASS[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": config.param_dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id,
    }
    if config.arch != "qwen2":
        out["attention_bias"] = False
        out["mlp_bias"] = False
    return out
