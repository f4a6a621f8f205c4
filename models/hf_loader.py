"""Load / save HF-format checkpoint directories: config.json + model.safetensors, or
sharded model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models.config import ModelConfig, config_from_hf, config_to_hf
from models.convert import Params, hf_from_params, params_from_hf

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    if (directory / _INDEX).exists():
        weight_map = json.loads((directory / _INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / _SINGLE).exists():
        files = [_SINGLE]
    else:
        raise ValueError(f"{directory} has neither {_SINGLE} nor {_INDEX}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        if not (directory / name).exists():
            raise ValueError(f"checkpoint shard {name!r} listed in {_INDEX} is missing in {directory}")
        with safe_open(directory / name, framework="np") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_hf_checkpoint(
    path: str | os.PathLike, *, dtype: str | None = None, param_dtype: str | None = None
) -> tuple[ModelConfig, Params]:
    """(config, params) from a HF directory. dtype / param_dtype override the compute and
    storage dtypes ("float32" | "bfloat16"); by default both follow config.json's dtype."""
    directory = Path(path)
    if not (directory / "config.json").exists():
        raise ValueError(f"no config.json in {directory}")
    config = config_from_hf(json.loads((directory / "config.json").read_text()))
    overrides: dict[str, Any] = {}
    if param_dtype is not None:
        overrides["param_dtype"] = param_dtype
    if dtype is not None:
        overrides["dtype"] = dtype
    if overrides:
        config = config.replace(**overrides)
    return config, params_from_hf(_read_tensors(directory), config)


def save_hf_checkpoint(path: str | os.PathLike, config: ModelConfig, params: Params) -> None:
    """Write config.json + model.safetensors that transformers and load_hf_checkpoint read."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = hf_from_params(params, config)
    (directory / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    save_file(tensors, str(directory / _SINGLE), metadata={"format": "pt"})
