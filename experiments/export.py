"""Export the trained policy of a training run as a Hugging Face model directory.

    python -m experiments.export --run-dir runs/smollm2-rg --out exported/smollm2-rg
    python -m experiments.export --run-dir RUN --out DIR --step 100 --force

Reads RUN/model.json (written by `python -m experiments.train`: the model name, its
ModelConfig, the task and seed) and the params of one checkpoint in RUN/checkpoints (the
latest, or --step N; only the params are read, never the optimizer state), and writes DIR:

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

`load_run(run_dir, step=None) -> RunPolicy` is the library entry point (used by
experiments.evaluate too); errors are `ExportError` with a message saying what to do.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from experiments import export_lora
from models.config import ModelConfig, RopeScaling

MODEL_JSON = "model.json"
NO_TOKENIZER_MODELS = ("tiny",)  # random-init models whose tokens are a task's own ids
# Files export_hf writes (and --force replaces), plus HF files that would shadow them.
_HF_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
             "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "tandem_export.json",
             *export_lora.ADAPTER_FILES)


class ExportError(ValueError):
    """A run directory cannot be loaded or exported; the message says what to do."""


class RunPolicy(NamedTuple):
    """The policy of one checkpoint of a training run.

    model_config: ModelConfig; params: the checkpoint's params (jax arrays in
    config.param_dtype); tokenizer: models.tokenizer.Tokenizer, or None for models with
    no text tokenizer ("tiny"); meta: the run's model.json dict; step: the checkpoint step;
    adapters: a LoRA run's adapters (then params are base + merged adapters), else None.
    """

    model_config: ModelConfig
    params: Any
    tokenizer: Any
    meta: dict
    step: int
    adapters: Any = None


# ----------------------------------------------------------------------------- model.json
def model_config_to_dict(config: ModelConfig) -> dict:
    """A JSON-ready dict of a ModelConfig; model_config_from_dict rebuilds it."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def model_config_from_dict(d: dict) -> ModelConfig:
    """ModelConfig from model_config_to_dict's dict (ValueError on unknown fields)."""
    if not isinstance(d, dict):
        raise TypeError(f"model_config must be a JSON object, got {type(d).__name__}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"model_config has fields this ModelConfig does not know: {unknown}")
    kw = dict(d)
    if isinstance(kw.get("rope_scaling"), dict):
        kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
    kw["eos_token_ids"] = tuple(kw.get("eos_token_ids") or ())
    return ModelConfig(**kw)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


def model_record(preset: Any, config: ModelConfig, seed: int, **overrides: Any) -> dict:
    """The model.json of a training run: {"model", "model_config", "task", "task_options",
    "seed", "preset"}. `preset` is experiments.train's Preset (read with getattr, so any
    object with model / task / task_options / name works; task may be a name or a spec
    string such as "reasoning_gym:chain_sum"); keyword overrides (e.g. task=...,
    task_options=...) replace the preset's fields."""
    task = overrides.pop("task", getattr(preset, "task", None))
    options = overrides.pop("task_options", getattr(preset, "task_options", None)) or {}
    record = {
        "model": overrides.pop("model", getattr(preset, "model", None)),
        "model_config": model_config_to_dict(config),
        "task": task if task is None or isinstance(task, str) else repr(task),
        "task_options": _jsonable(dict(options)),
        "seed": int(seed),
        "preset": overrides.pop("preset", getattr(preset, "name", None)),
    }
    record.update(_jsonable(overrides))
    return record


# ----------------------------------------------------------------------------- load a run
def _read_model_json(run_dir: Path) -> tuple[dict, ModelConfig]:
    path = run_dir / MODEL_JSON
    if not path.is_file():
        raise ExportError(
            f"{str(path)!r} not found: the run predates model.json or was not made by "
            "`python -m experiments.train` (which writes it at the start of a run); retrain "
            "with experiments.train, or write model.json by hand (experiments.export."
            "model_record gives its fields)")
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
        if "model_config" not in meta:
            raise ValueError("no 'model_config' entry")
        config = model_config_from_dict(meta["model_config"])
    except (ValueError, TypeError) as err:  # bad JSON, fields, or ModelConfig values
        raise ExportError(f"{str(path)!r} is not a valid model.json ({err}); it should be "
                          "the one experiments.train wrote for this run") from err
    return meta, config


def _restore_params(ckpt_dir: Path, config: ModelConfig, step: int | None,
                    abstract_params: Any = None) -> tuple[Any, int, dict]:
    """(params, step, checkpoint meta) of checkpoint `step` (default: latest), restoring only
    the params subtree of the saved TrainState (no optimizer state is read or needed),
    verified against the checksums saved with it (rl.runtime.checkpoint; older checkpoints
    have none and are read unverified). abstract_params: their shapes (default the
    model's params; a LoRA run's adapters)."""
    import jax
    import orbax.checkpoint as ocp

    from models.decoder import init_params
    from rl.runtime.checkpoint import CHECKSUM_KEY, CheckpointError, verify

    hint = "train with --save-every or let it finish"
    if not ckpt_dir.is_dir():
        raise ExportError(f"run has no checkpoint ({str(ckpt_dir)!r} does not exist); {hint}")
    manager = ocp.CheckpointManager(
        ckpt_dir.absolute(), item_names=("state", "meta"),
        options=ocp.CheckpointManagerOptions(create=False),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    try:
        steps = sorted(manager.all_steps())
        if not steps:
            raise ExportError(f"run has no checkpoint in {str(ckpt_dir)!r}; {hint}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ExportError(f"checkpoint step {step} not found in {str(ckpt_dir)!r}; "
                              f"available steps: {steps}")
        abstract = {"params": abstract_params if abstract_params is not None
                    else jax.eval_shape(lambda: init_params(config, 0))}
        _check_shapes(manager, step, abstract, ckpt_dir)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=device), abstract)
        try:
            out = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args,
                                             partial_restore=True),
                meta=ocp.args.JsonRestore()))
        except Exception as err:  # orbax raises many types for damaged or mismatched files
            raise ExportError(
                f"checkpoint step {step} in {str(ckpt_dir)!r} could not be read as this run's "
                f"params ({type(err).__name__}: {str(err)[:300]}); it is incomplete, corrupted "
                "or does not match model.json's model_config") from err
        meta = dict(out["meta"]) if isinstance(out["meta"], dict) else {}
        if CHECKSUM_KEY in meta:
            try:
                verify(f"checkpoint step {step} in {str(ckpt_dir)!r}", out["state"], meta,
                       meta.pop(CHECKSUM_KEY), partial=True)
            except CheckpointError as err:
                raise ExportError(str(err)) from err
    finally:
        manager.close()
    return out["state"]["params"], int(step), meta


def _check_shapes(manager, step: int, abstract: dict, ckpt_dir: Path) -> None:
    """ExportError naming the first params leaf whose presence or shape differs between
    checkpoint `step` and model.json's model_config."""
    import jax

    try:
        tree = manager.item_metadata(step)["state"]
        tree = getattr(tree, "tree", tree)
        saved = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in
                 jax.tree_util.tree_flatten_with_path({"params": tree["params"]})[0]}
    except Exception:  # noqa: BLE001  unreadable metadata: the restore reports the damage
        return
    wanted = {jax.tree_util.keystr(k): tuple(v.shape)
              for k, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    where = f"checkpoint step {step} in {str(ckpt_dir)!r}"
    for key in sorted(set(saved) | set(wanted)):
        if saved.get(key) != wanted.get(key):
            raise ExportError(
                f"{where} does not match model.json's model_config: {key} has shape "
                f"{saved.get(key, 'missing')} in the checkpoint, the config gives "
                f"{wanted.get(key, 'none')}; model.json must be the one this run wrote")


def load_tokenizer(meta: dict):
    """The Tokenizer of the run's model (model.json "model"), or None for models with no
    text tokenizer ("tiny"). Reads only the tokenizer (GGUF metadata or tokenizer files),
    never the weights."""
    from models.assets import resolve_model_path
    from models.tokenizer import Tokenizer

    model = meta.get("model")
    if model is None or model in NO_TOKENIZER_MODELS:
        return None
    try:
        path = resolve_model_path(model)
    except (ValueError, FileNotFoundError) as err:
        raise ExportError(f"cannot find the run's model {model!r} (model.json 'model') to read "
                          f"its tokenizer: {err}") from err
    if path.is_file():  # .gguf
        from models.gguf_loader import _Reader, read_metadata

        return Tokenizer.from_gguf_metadata(read_metadata(_Reader(path)))
    if not (path / "tokenizer.json").is_file():
        raise ExportError(f"the run's model directory {str(path)!r} has no tokenizer.json")
    cfg = path / "tokenizer_config.json"
    return Tokenizer.from_file(path / "tokenizer.json", cfg if cfg.is_file() else None)


def load_run(run_dir: str | os.PathLike, step: int | None = None) -> RunPolicy:
    """The policy of a training run: model.json + the params of checkpoint `step` (default:
    the latest) + the model's tokenizer. Raises ExportError (a ValueError) saying what to
    do when the run dir, its model.json or its checkpoints are missing or unreadable."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"run dir {str(run_dir)!r} does not exist; pass the --run-dir of a "
                          "run made by `python -m experiments.train`")
    meta, config = _read_model_json(run_dir)
    lora = meta.get("lora")  # a LoRA run: the checkpoint holds adapters (experiments.export_lora)
    abstract = None if lora is None else export_lora.abstract_adapters(config, lora)
    params, step, ck_meta = _restore_params(run_dir / "checkpoints", config, step, abstract)
    adapters = None
    if lora is not None:
        adapters, params = params, export_lora.merged_run_params(config, meta, params, ck_meta)
    tokenizer = load_tokenizer(meta)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ExportError(f"the tokenizer of {meta.get('model')!r} has {tokenizer.vocab_size} "
                          f"tokens but the run's model only {config.vocab_size} embeddings")
    return RunPolicy(model_config=config, params=params, tokenizer=tokenizer, meta=meta,
                     step=step, adapters=adapters)


# ----------------------------------------------------------------------------- export
def tokenizer_files(tokenizer) -> dict[str, str]:
    """{file name: text} of tokenizer.json and tokenizer_config.json for a Tandem Tokenizer.
    tokenizer_class PreTrainedTokenizerFast makes transformers use tokenizer.json as it is
    (pre-tokenizer, added/special tokens, post-processor), so encode ids agree with Tandem's."""
    backend = tokenizer._tok  # the `tokenizers.Tokenizer` Tandem encodes with
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


def export_hf(run_policy: RunPolicy, out_dir: str | os.PathLike, *, force: bool = False,
              run_dir: str | os.PathLike | None = None, adapters_only: bool = False) -> list[str]:
    """Write run_policy as a HF model directory (see the module docstring); returns the
    file names written. A non-empty out_dir raises ExportError unless force=True.
    adapters_only (a LoRA run): the adapters alone, PEFT layout (experiments.export_lora)."""
    from models.hf_loader import save_hf_checkpoint
    from rl.runtime.logging import atomic_write_json, atomic_write_text

    out = Path(out_dir)
    if adapters_only and run_policy.adapters is None:
        raise ExportError("--adapters-only needs a LoRA run (experiments.train --lora-rank R)")
    _prepare_out_dir(out, force)
    config, tok = run_policy.model_config, run_policy.tokenizer
    if adapters_only:
        written = export_lora.write_adapters(out, run_policy.adapters, run_policy.meta)
    else:
        save_hf_checkpoint(out, config, run_policy.params)
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
        "step": run_policy.step, "tokenizer": tok is not None,
        **{k: meta.get(k) for k in ("model", "preset", "task", "task_options", "seed")}}))
    written.append("tandem_export.json")
    return written


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.export",
        description="Write a training run's policy as a Hugging Face model directory "
                    "(config.json, model.safetensors, tokenizer files, generation_config.json).")
    p.add_argument("--run-dir", required=True, help="run dir of python -m experiments.train")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the latest)")
    p.add_argument("--force", action="store_true", help="overwrite the model files of a "
                   "non-empty --out")
    p.add_argument("--adapters-only", action="store_true", help="a LoRA run: write its "
                   "adapters alone (PEFT adapter_model.safetensors + adapter_config.json) "
                   "instead of the merged full weights")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        out = Path(args.out)
        if out.is_dir() and any(out.iterdir()) and not args.force:
            _prepare_out_dir(out, force=False)  # fail before reading the checkpoint
        policy = load_run(args.run_dir, args.step)
        written = export_hf(policy, out, force=args.force, run_dir=args.run_dir,
                            adapters_only=args.adapters_only)
    except ExportError as err:
        sys.exit(f"error: {err}")
    print(f"exported step {policy.step} of {args.run_dir} (model {policy.meta.get('model')!r}) "
          f"to {out}: {', '.join(written)}")
    if policy.tokenizer is None:
        print(f"note: no tokenizer written: model {policy.meta.get('model')!r} has no text "
              "tokenizer (its tokens are the task's own ids); AutoModelForCausalLM loads the "
              "directory, AutoTokenizer does not", file=sys.stderr)
    return {"out": str(out), "step": policy.step, "files": written,
            "tokenizer": policy.tokenizer is not None}


if __name__ == "__main__":
    main()
