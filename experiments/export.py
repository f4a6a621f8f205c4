"""Export the trained policy of a training run (or any model Tandem loads) as a Hugging
Face model directory.

    python -m experiments.export --model runs/smollm2-rg --out exported/smollm2-rg
    python -m experiments.export --model RUN --out DIR --step 100 --force --dtype float32
    python -m experiments.export --model smollm2-135m --out smollm2-hf    # GGUF -> HF dir

--model takes what evaluate and generate take: a training run dir (--run-dir is the same),
a registered name, a .gguf file or an HF directory (then its weights are written as they
load, e.g. a GGUF file dequantised into safetensors). --dtype bfloat16 | float16 | float32:
the tensors' type in model.safetensors (default: the model's own dtype, that of the model
the run started from: config.json's torch_dtype for an HF directory, the float type of a
GGUF file's weights, bfloat16 for a quantised GGUF; the run's param dtype when the model
cannot be found). float16 refuses weights beyond its range. Every file gets the usual
mode under the umask (0644 under 022), readable by the other users of a shared directory.

Reads the run record (RUN/model.json, written by rl.run.train / `python -m
experiments.train`: the model name, its ModelConfig, the task and seed) and the params of
one checkpoint in RUN/checkpoints (the latest, or --step N; only the params are read, never
the optimizer state) with rl.run.load_run, and writes DIR:

  config.json, model.safetensors   the weights (config.param_dtype) and the HF config
  generation_config.json           bos / eos / pad ids (every id that ends a generation)
  tokenizer.json                   the tokenizer Tandem used (its `tokenizers` backend)
  tokenizer_config.json            chat template and special tokens, so that transformers'
                                   apply_chat_template renders what Tandem's renders
  tandem_export.json               where it came from (run dir, step, model, task, seed)

which `transformers.AutoModelForCausalLM.from_pretrained(DIR)`,
`AutoTokenizer.from_pretrained(DIR)` and `models.assets.load_model(DIR)` load.

Models with no text tokenizer (model "tiny": random init, its tokens are the task's own
ids): the weights, config.json and generation_config.json are exported, no tokenizer
files are written, and the command says so (AutoTokenizer cannot load such a directory).

DIR must be empty or absent; --force overwrites the HF files of a non-empty DIR (other
files in it are left alone).

A LoRA run (`--lora-rank R`): its checkpoints hold the adapters only; rl.run.load_run
rebuilds the frozen base and merges W + (alpha / r) A B, which is what DIR gets.
`--adapters-only` writes the adapters alone in PEFT's layout instead:
adapter_model.safetensors with, per layer i and target,
    base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj...}.lora_A.weight  [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj...}.lora_B.weight  [out, r]
(A_i transposed, B_i transposed: the HF weight becomes W_hf + (alpha / r) lora_B @ lora_A)
and adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, base model).

Errors are rl.run.RunDirError (the run dir cannot be read) or ExportError (the output
cannot be written), each with a message saying what to do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from models.config import ModelConfig
from rl.run.record import RunDirError, RunPolicy, load_run, lora_config

HF_PARENT = {"attn": "self_attn", "mlp": "mlp"}
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
# Files export_hf writes (and --force replaces), plus HF files that would shadow them.
_HF_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
             "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "tandem_export.json",
             *ADAPTER_FILES)


class ExportError(ValueError):
    """The export cannot be written; the message says what to do."""


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


# ----------------------------------------------------------------------------- LoRA adapters
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


# ----------------------------------------------------------------------------- export
def tokenizer_files(tokenizer) -> dict[str, str]:
    """{file name: text} of tokenizer.json and tokenizer_config.json for a Tandem Tokenizer.
    tokenizer_class PreTrainedTokenizerFast makes transformers use tokenizer.json as it is
    (pre-tokenizer, added/special tokens, post-processor), so encode ids agree with Tandem's."""
    backend = tokenizer.backend  # the `tokenizers.Tokenizer` Tandem encodes with
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "clean_up_tokenization_spaces": False,  # decode exactly as Tandem's decode
        "model_max_length": None,
        "chat_template": tokenizer.chat_template,
    }
    config = {k: v for k, v in config.items() if v is not None}
    return {"tokenizer.json": backend.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n"}


def generation_config(config: ModelConfig, tokenizer=None) -> dict:
    """generation_config.json: bos / pad and every eos id (model's and tokenizer's)."""
    eos = list(dict.fromkeys(list(config.eos_token_ids)
                             + list(getattr(tokenizer, "eos_token_ids", ()) or ())))
    out = {"bos_token_id": config.bos_token_id,
           "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
           "pad_token_id": config.pad_token_id}
    return {k: v for k, v in out.items() if v is not None}


def _prepare_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"out dir {str(out)!r} is not empty; pass --force to overwrite "
                              "its model files, or choose another --out")
        stale = [out / n for n in _HF_FILES] + list(out.glob("model-*-of-*.safetensors"))
        for path in stale:
            if path.is_file():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)


EXPORT_DTYPES = ("bfloat16", "float16", "float32")


def model_dtype(meta: dict, config: ModelConfig) -> str:
    """The model's own dtype (module docstring) for a run's model.json / a loaded model."""
    from models.assets import inspect_model

    model = meta.get("model")
    if model and model not in ("tiny",):
        try:
            return inspect_model(model).float_dtype
        except (ValueError, FileNotFoundError, OSError):
            pass  # the model moved: the run's own dtype
    return config.param_dtype


def export_hf(run_policy: RunPolicy, out_dir: str | os.PathLike, *, force: bool = False,
              run_dir: str | os.PathLike | None = None, adapters_only: bool = False,
              dtype: str | None = None) -> list[str]:
    """Write run_policy as a HF model directory (see the module docstring); returns the
    file names written. A non-empty out_dir raises ExportError unless force=True.
    adapters_only (a LoRA run): the adapters alone, PEFT layout (the PEFT layout).
    dtype: the weights' type in the file (default: the model's own, model_dtype)."""
    from models.hf_loader import save_hf_checkpoint
    from rl.runtime.logging import atomic_write_json, atomic_write_text

    out = Path(out_dir)
    if adapters_only and run_policy.adapters is None:
        raise ExportError("--adapters-only needs a LoRA run (experiments.train --lora-rank R)")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    _prepare_out_dir(out, force)
    config, tok = run_policy.model_config, run_policy.tokenizer
    dtype = dtype or model_dtype(run_policy.meta, config)
    if adapters_only:
        written = write_adapters(out, run_policy.adapters, run_policy.meta)
    else:
        try:
            save_hf_checkpoint(out, config, run_policy.params, dtype=dtype)
        except ValueError as err:
            raise ExportError(f"{err} (--dtype)") from err
        written = ["config.json", "model.safetensors"]
    atomic_write_json(out / "generation_config.json", generation_config(config, tok))
    written.append("generation_config.json")
    if tok is not None:
        for name, text in tokenizer_files(tok).items():
            atomic_write_text(out / name, text)
            written.append(name)
    meta = run_policy.meta
    atomic_write_json(out / "tandem_export.json", _jsonable({
        "run_dir": None if run_dir is None else str(Path(run_dir).absolute()),
        "step": run_policy.step, "tokenizer": tok is not None, "dtype": dtype,
        **{k: meta.get(k) for k in ("model", "preset", "task", "task_options", "seed")}}))
    written.append("tandem_export.json")
    return written


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.export",
        description="Write a training run's policy as a Hugging Face model directory "
                    "(config.json, model.safetensors, tokenizer files, generation_config.json).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="RUN_DIR|NAME|FILE.gguf|HF_DIR",
                     help="a training run dir, or a model: registered name, .gguf file, HF dir")
    src.add_argument("--run-dir", help="run dir of python -m experiments.train (= --model RUN_DIR)")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the latest)")
    p.add_argument("--force", action="store_true", help="overwrite the model files of a "
                   "non-empty --out")
    p.add_argument("--dtype", choices=EXPORT_DTYPES,
                   help="weights' type in model.safetensors (default: the model's own dtype)")
    p.add_argument("--adapters-only", action="store_true", help="a LoRA run: write its "
                   "adapters alone (PEFT adapter_model.safetensors + adapter_config.json) "
                   "instead of the merged full weights")
    return p


def model_policy(source: str) -> RunPolicy:
    """A RunPolicy of a model that is not a run (registered name, .gguf, HF dir): its
    weights as load_model reads them, step None."""
    from models.assets import load_model

    config, params, tokenizer = load_model(source)
    return RunPolicy(model_config=config, params=params, tokenizer=tokenizer,
                     meta={"model": source}, step=None)


def main(argv: list[str] | None = None) -> dict:
    from rl.run.record import is_run_dir

    args = build_parser().parse_args(argv)
    source = args.model or args.run_dir
    run_dir = source if args.run_dir or is_run_dir(source) else None
    try:
        out = Path(args.out)
        if out.is_dir() and any(out.iterdir()) and not args.force:
            _prepare_out_dir(out, force=False)  # fail before reading the checkpoint
        if run_dir is None and args.step is not None:
            raise ExportError(f"--step is for a training run dir; {source!r} is not one")
        policy = load_run(run_dir, args.step) if run_dir else model_policy(source)
        written = export_hf(policy, out, force=args.force, run_dir=run_dir,
                            adapters_only=args.adapters_only, dtype=args.dtype)
    except (ExportError, RunDirError) as err:
        sys.exit(f"error: {err}")
    except (ValueError, FileNotFoundError) as err:  # a model that cannot load
        sys.exit(f"error: {err}")
    what = f"step {policy.step} of {run_dir}" if run_dir else f"model {source!r}"
    print(f"exported {what} (model {policy.meta.get('model')!r}) to {out}: {', '.join(written)}")
    if policy.tokenizer is None:
        print(f"note: no tokenizer written: model {policy.meta.get('model')!r} has no text "
              "tokenizer (its tokens are the task's own ids); AutoModelForCausalLM loads the "
              "directory, AutoTokenizer does not", file=sys.stderr)
    return {"out": str(out), "step": policy.step, "files": written,
            "tokenizer": policy.tokenizer is not None,
            "dtype": json.loads((out / "tandem_export.json").read_text())["dtype"]}


if __name__ == "__main__":
    main()
