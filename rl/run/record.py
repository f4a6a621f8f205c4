"""The run record: what a run dir holds besides its checkpoints, written and read by the
library so that a run started from Python is evaluable and exportable like one started
from the command line.

    run_dir/model.json        the model and how it was built: {"model" (name / path /
                              "tiny"), "model_config" (every ModelConfig field), "task",
                              "task_options", "seed", "task_seed", "preset" [, "lora"]}
    run_dir/run_config.json   the whole RunConfig (rl.loops.config), so
                              `train(RunConfig.load(run_dir), resume=True)` continues the run
    run_dir/checkpoints/      orbax TrainState checkpoints (rl.runtime.checkpoint)

    write_record(run_dir, cfg, model_config)   both files (process 0 does this)
    policy = load_run(run_dir, step=None)      RunPolicy: ModelConfig, params of one
                                               checkpoint (the latest by default; a LoRA
                                               run's adapters merged into its rebuilt base),
                                               the tokenizer, model.json, the step

A LoRA run's checkpoints hold the adapters only: model.json's "lora" (rank, alpha,
targets, qlora and, for "tiny", the base's init seed) lets `load_run` rebuild the frozen
base (quantized as in training), check it against the base hash in the checkpoint's
config record (rl.loops.adapters.base_hash) and merge W + (alpha / r) A B
(models.lora.merge). Errors are RunDirError, saying what to do.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from models.config import ModelConfig, RopeScaling
from rl.loops.config import RUN_CONFIG_FILE, RunConfig

MODEL_JSON = "model.json"
NO_TOKENIZER_MODELS = ("tiny",)  # random-init models whose tokens are a task's own ids


class RunDirError(ValueError):
    """A run directory cannot be read; the message says what to do."""


class RunPolicy(NamedTuple):
    """The policy of one checkpoint of a training run.

    model_config: ModelConfig; params: the checkpoint's params (jax arrays in
    config.param_dtype); tokenizer: models.tokenizer.Tokenizer, or None for models with no
    text tokenizer ("tiny"); meta: the run's model.json dict; step: the checkpoint step;
    adapters: a LoRA run's adapters (then params are base + merged adapters), else None.
    """

    model_config: ModelConfig
    params: Any
    tokenizer: Any
    meta: dict
    step: int
    adapters: Any = None


# ----------------------------------------------------------------------------- writing
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


def model_record(cfg: RunConfig, model_config: ModelConfig) -> dict:
    """The model.json of a run of `cfg` whose model is `model_config`."""
    from rl.run.policy import task_seed

    seed = cfg.loop.seed
    record = {
        "model": cfg.model.name,
        "model_config": model_config_to_dict(model_config),
        "task": cfg.task.spec,
        "task_options": json.loads(json.dumps(cfg.task.kwargs, default=repr)),
        "seed": int(seed),
        "preset": cfg.name,
        "task_seed": task_seed(cfg),
    }
    lora = cfg.train.lora
    if lora is not None:
        rec = {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
               "qlora": lora.qlora}
        if cfg.model.name == "tiny":
            rec["base_init_seed"] = int(cfg.model.init_seed + seed)
        record["lora"] = rec
    return record


def write_record(run_dir: str | os.PathLike, cfg: RunConfig, model_config: ModelConfig) -> None:
    """model.json and run_config.json into run_dir (atomic writes; run_dir created)."""
    from rl.runtime.logging import atomic_write_json

    run_dir = Path(run_dir)
    atomic_write_json(run_dir / MODEL_JSON, model_record(cfg, model_config))
    dataclasses.replace(cfg, run_dir=str(run_dir)).save(run_dir / RUN_CONFIG_FILE)


# ----------------------------------------------------------------------------- reading
def read_model_json(run_dir: Path) -> tuple[dict, ModelConfig]:
    """(model.json as a dict, its ModelConfig); RunDirError when missing or malformed."""
    path = run_dir / MODEL_JSON
    if not path.is_file():
        raise RunDirError(
            f"{str(path)!r} not found: the run predates model.json or was not made by "
            "rl.run.train / `python -m experiments.train` (which write it at the start of a "
            "run); retrain, or write model.json by hand (rl.run.record.model_record gives its "
            "fields)")
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
        if "model_config" not in meta:
            raise ValueError("no 'model_config' entry")
        config = model_config_from_dict(meta["model_config"])
    except (ValueError, TypeError) as err:  # bad JSON, fields, or ModelConfig values
        raise RunDirError(f"{str(path)!r} is not a valid model.json ({err}); it should be "
                          "the one the run's training wrote") from err
    return meta, config


def restore_params(ckpt_dir: Path, config: ModelConfig, step: int | None,
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
        raise RunDirError(f"run has no checkpoint ({str(ckpt_dir)!r} does not exist); {hint}")
    manager = ocp.CheckpointManager(
        ckpt_dir.absolute(), item_names=("state", "meta"),
        options=ocp.CheckpointManagerOptions(create=False),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    try:
        steps = sorted(manager.all_steps())
        if not steps:
            raise RunDirError(f"run has no checkpoint in {str(ckpt_dir)!r}; {hint}")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise RunDirError(f"checkpoint step {step} not found in {str(ckpt_dir)!r}; "
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
            raise RunDirError(
                f"checkpoint step {step} in {str(ckpt_dir)!r} could not be read as this run's "
                f"params ({type(err).__name__}: {str(err)[:300]}); it is incomplete, corrupted "
                "or does not match model.json's model_config") from err
        meta = dict(out["meta"]) if isinstance(out["meta"], dict) else {}
        if CHECKSUM_KEY in meta:
            try:
                verify(f"checkpoint step {step} in {str(ckpt_dir)!r}", out["state"], meta,
                       meta.pop(CHECKSUM_KEY), partial=True)
            except CheckpointError as err:
                raise RunDirError(str(err)) from err
    finally:
        manager.close()
    return out["state"]["params"], int(step), meta


def _check_shapes(manager, step: int, abstract: dict, ckpt_dir: Path) -> None:
    """RunDirError naming the first params leaf whose presence or shape differs between
    checkpoint `step` and model.json's model_config."""
    import jax

    try:
        tree = manager.item_metadata(step)["state"]
        tree = getattr(tree, "tree", tree)
        saved = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in
                 jax.tree_util.tree_flatten_with_path({"params": tree["params"]})[0]}
    except Exception:
        return
    wanted = {jax.tree_util.keystr(k): tuple(v.shape)
              for k, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    where = f"checkpoint step {step} in {str(ckpt_dir)!r}"
    for key in sorted(set(saved) | set(wanted)):
        if saved.get(key) != wanted.get(key):
            raise RunDirError(
                f"{where} does not match model.json's model_config: {key} has shape "
                f"{saved.get(key, 'missing')} in the checkpoint, the config gives "
                f"{wanted.get(key, 'none')}; model.json must be the one this run wrote")


def load_tokenizer(meta: dict):
    """The Tokenizer of the run's model (model.json "model"), or None for models with no
    text tokenizer ("tiny"). Reads only the tokenizer (GGUF metadata or tokenizer files),
    never the weights."""
    from models.assets import load_tokenizer as load_model_tokenizer

    model = meta.get("model")
    if model is None or model in NO_TOKENIZER_MODELS:
        return None
    try:
        return load_model_tokenizer(model)
    except (ValueError, FileNotFoundError) as err:
        raise RunDirError(f"cannot read the tokenizer of the run's model {model!r} (model.json "
                          f"'model'): {err}") from err


# ----------------------------------------------------------------------------- LoRA runs
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
            raise RunDirError(f"cannot load the LoRA run's base model {meta.get('model')!r} "
                              f"(model.json 'model'): {err}") from err
    return quantize_base(base, rec["qlora"]) if rec.get("qlora") else base


def merged_run_params(config: ModelConfig, meta: dict, adapters: Any, ckpt_meta: dict) -> Any:
    """Full params W + (alpha/r) A B of a LoRA checkpoint (see the module docstring)."""
    from models.lora import merge
    from rl.loops.adapters import BASE_KEY, base_hash

    base = rebuild_base(config, meta)
    want = (ckpt_meta.get("config") or {}).get(BASE_KEY)
    if want is None:
        raise RunDirError("the LoRA checkpoint records no base hash (config record "
                          f"{BASE_KEY!r}); it was not written by the LoRA training loop")
    got = base_hash(base)
    if got != want:
        raise RunDirError(f"the rebuilt base ({meta.get('model')!r}) hashes to {got}, but the "
                          f"checkpoint's adapters were trained on a base with {BASE_KEY} "
                          f"{want}; use the model files the run was trained on")
    return merge(base, adapters, lora_config(meta["lora"]))


# ----------------------------------------------------------------------------- load a run
def is_run_dir(path: str | os.PathLike) -> bool:
    """True for a directory holding model.json and checkpoints/."""
    p = Path(path)
    return p.is_dir() and (p / MODEL_JSON).is_file() and (p / "checkpoints").is_dir()


def load_run(run_dir: str | os.PathLike, step: int | None = None) -> RunPolicy:
    """The policy of a training run: model.json + the params of checkpoint `step` (default:
    the latest) + the model's tokenizer. Raises RunDirError (a ValueError) saying what to
    do when the run dir, its model.json or its checkpoints are missing or unreadable."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"run dir {str(run_dir)!r} does not exist; pass the run dir of a "
                          "run made by rl.run.train or `python -m experiments.train`")
    meta, config = read_model_json(run_dir)
    lora = meta.get("lora")  # a LoRA run: the checkpoint holds adapters
    abstract = None if lora is None else abstract_adapters(config, lora)
    params, step, ck_meta = restore_params(run_dir / "checkpoints", config, step, abstract)
    adapters = None
    if lora is not None:
        adapters, params = params, merged_run_params(config, meta, params, ck_meta)
    tokenizer = load_tokenizer(meta)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise RunDirError(f"the tokenizer of {meta.get('model')!r} has {tokenizer.vocab_size} "
                          f"tokens but the run's model only {config.vocab_size} embeddings")
    return RunPolicy(model_config=config, params=params, tokenizer=tokenizer, meta=meta,
                     step=step, adapters=adapters)
