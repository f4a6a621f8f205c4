"""Exporting a LoRA run (experiments.train --lora-rank R): its checkpoints hold the adapters
and optimizer state only, so experiments.export rebuilds the frozen base and merges.

model.json of a LoRA run carries "lora" (`lora_record`): rank, alpha, targets, qlora and,
for the random-init model "tiny", the base's init seed (named models are loaded again by
name, models.assets.load_model). `merged_run_params` rebuilds the base (quantized as in
training with qlora), checks its identity against the base hash the checkpoint's config
record holds (rl.loops.adapters.base_hash; a mismatch is an ExportError naming both
hashes) and returns full weights W + (alpha / r) A B (models.lora.merge; a quantized base
comes back dequantised, float32), which experiments.export writes as a HF directory.

`write_adapters` (experiments.export --adapters-only) writes the adapters alone in PEFT's
layout: adapter_model.safetensors with, per layer i and target,
    base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj...}.lora_A.weight  [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj...}.lora_B.weight  [out, r]
(A_i transposed, B_i transposed: the HF weight becomes W_hf + (alpha / r) lora_B @ lora_A)
and adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, base model).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from models.config import ModelConfig

# models.lora (jax, flax) is imported inside the functions: experiments.export stays light

HF_PARENT = {"attn": "self_attn", "mlp": "mlp"}
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def lora_record(lora: Any, model: str, base_init_seed: int | None) -> dict:
    """{"lora": {...}} for model.json of a LoRA run ({} for a full fine-tune)."""
    if lora is None:
        return {}
    rec = {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
           "qlora": lora.qlora}
    if model == "tiny":
        rec["base_init_seed"] = int(base_init_seed)
    return {"lora": rec}


def lora_config(rec: dict):
    """The models.lora.LoraConfig of a model.json "lora" record."""
    from models.lora import LoraConfig

    return LoraConfig(rank=int(rec["rank"]), alpha=float(rec["alpha"]),
                      targets=tuple(rec["targets"]), qlora=rec.get("qlora"))


def abstract_adapters(config: ModelConfig, rec: dict) -> Any:
    """ShapeDtypeStructs of the adapters a checkpoint of this run holds."""
    import jax

    from models.decoder import init_params
    from models.lora import init_lora

    return jax.eval_shape(lambda: init_lora(init_params(config, 0), lora_config(rec), 0))


def rebuild_base(config: ModelConfig, meta: dict) -> Any:
    """The run's frozen base as trained on: init_params for "tiny" (recorded seed), else
    the named model loaded again; quantized with qlora."""
    from experiments.export import ExportError
    from models.decoder import init_params
    from models.lora import quantize_base

    rec = meta["lora"]
    if meta.get("model") == "tiny":
        base = init_params(config, int(rec["base_init_seed"]))
    else:
        from models.assets import load_model

        try:
            _, base, _ = load_model(meta["model"])
        except (ValueError, FileNotFoundError) as err:
            raise ExportError(f"cannot load the LoRA run's base model {meta.get('model')!r} "
                              f"(model.json 'model'): {err}") from err
    return quantize_base(base, rec["qlora"]) if rec.get("qlora") else base


def merged_run_params(config: ModelConfig, meta: dict, adapters: Any, ckpt_meta: dict) -> Any:
    """Full params W + (alpha/r) A B of a LoRA checkpoint (see the module docstring)."""
    from experiments.export import ExportError
    from models.lora import merge
    from rl.loops.adapters import BASE_KEY, base_hash

    base = rebuild_base(config, meta)
    want = (ckpt_meta.get("config") or {}).get(BASE_KEY)
    if want is None:
        raise ExportError("the LoRA checkpoint records no base hash (config record "
                          f"{BASE_KEY!r}); it was not written by the LoRA training loop")
    got = base_hash(base)
    if got != want:
        raise ExportError(f"the rebuilt base ({meta.get('model')!r}) hashes to {got}, but the "
                          f"checkpoint's adapters were trained on a base with {BASE_KEY} "
                          f"{want}; export with the model files the run was trained on")
    return merge(base, adapters, lora_config(meta["lora"]))


def peft_tensors(adapters: Any, rec: dict) -> dict[str, np.ndarray]:
    """{PEFT name: float32 array} of the adapters (layout in the module docstring)."""
    from models.lora import PROJECTIONS

    out = {}
    for name in lora_config(rec).projections:
        parent = PROJECTIONS[name][0]
        node = adapters["layers"][parent][name]
        a, b = np.asarray(node["lora_a"], np.float32), np.asarray(node["lora_b"], np.float32)
        for i in range(a.shape[0]):
            key = f"base_model.model.model.layers.{i}.{HF_PARENT[parent]}.{name}"
            out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def write_adapters(out: Path, adapters: Any, meta: dict) -> list[str]:
    """adapter_model.safetensors + adapter_config.json into `out`; the names written."""
    from safetensors.numpy import save_file

    from rl.runtime.logging import atomic_write_text

    rec = meta["lora"]
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(adapters, rec), str(out / ADAPTER_FILES[0]), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rec["rank"]),
              "lora_alpha": float(rec["alpha"]), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "target_modules": list(lora_config(rec).projections),
              "base_model_name_or_path": meta.get("model"),
              "tandem_qlora": rec.get("qlora")}
    atomic_write_text(out / ADAPTER_FILES[1], json.dumps(config, indent=2) + "\n")
    return list(ADAPTER_FILES)
