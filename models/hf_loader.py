"""Load / save HF-format checkpoint directories: config.json + model.safetensors, or
sharded model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
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


SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
               "float16": np.dtype(np.float16)}


def usual_file_mode(path: str | os.PathLike) -> None:
    """Give a file the mode a new file gets under the process's umask (0644 under the common
    022): safetensors writes 0600, which other users of a shared directory cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_hf_checkpoint(path: str | os.PathLike, config: ModelConfig, params: Params,
                       dtype: str | None = None) -> None:
    """Write config.json + model.safetensors that transformers and load_hf_checkpoint read.
    dtype: the tensors' type in the file, "float32" | "bfloat16" | "float16" (default
    config.param_dtype; each weight rounded to nearest); config.json's torch_dtype says it.
    ValueError when a weight overflows float16. Files get the umask's usual mode."""
    dtype = dtype or config.param_dtype
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = hf_from_params(params, config)
    out = {}
    for name, value in tensors.items():
        cast = value.astype(np.float32).astype(SAVE_DTYPES[dtype])
        if not np.isfinite(cast.astype(np.float32)).all():
            raise ValueError(f"tensor {name!r} overflows {dtype} (max |w| = "
                             f"{float(np.abs(value.astype(np.float32)).max()):.4g}); save as "
                             "bfloat16 or float32")
        out[name] = np.ascontiguousarray(cast)
    hf = config_to_hf(config)
    hf["torch_dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(out, str(directory / _SINGLE), metadata={"format": "pt"})
    usual_file_mode(directory / _SINGLE)
