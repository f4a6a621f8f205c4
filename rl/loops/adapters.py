"""LoRA / QLoRA in the training loops: what a LoRA run keeps beside the train state.

A LoRA run (TrainConfig.lora set) trains adapters only (models.lora); `LoraRun` holds the
rest, built once by `lora_run` inside rl.loops.context.open_run:

  * base: the frozen base params (stored int8 / int4 with LoraConfig.qlora), shared by
    the learner (the step's third argument; with a KL term it is also the reference:
    the base with adapters off, no second copy), the sampler and every async snapshot;
  * base_hash: an identity of the base (`base_hash`, xxh3-128 over every leaf's dtype,
    shape and bytes, as rl.runtime.checkpoint checksums leaves) recorded in the run's
    config record, so every checkpoint carries it and a resume on another base is refused
    naming both hashes (`check_base`); checkpoints hold the adapters + optimizer state only
    (the TrainState), never the base;
  * policy(adapters): the params the sampler and the evals run for one policy version:
    sampler="composed" (default): base + adapters on the fly (models.lora.compose: (x A) B
    beside each attention projection, W + A B per layer inside the scan for the MLP);
    sampler="merged": W + (alpha/r) A B for every target, one jitted merge per policy
    version (`merged_params`; untargeted kernels stay as stored). Both sample the same
    tokens (tests/rl/test_lora_loop.py). Measured (experiments/bench/lora.py
    --time-models '' --decode-models tiny,smollm2-135m, one decode step of 8 rows, 2-core
    EPYC at load ~4): SmolLM2-135M on the fly 148 ms, merged 152 ms, + 202 ms per merge;
    tiny 0.84 vs 0.82 ms, + 0.25 ms per merge. Decode speed is the same within noise, so
    on the fly is the default: no merge per version, no second full-precision copy of the
    targeted kernels (a QLoRA base stays quantized in the sampler too: int8 on the fly
    129 ms), and the sampler computes the adapted layers in the learner's own form;
  * snapshots(ring): a read-only {version: composed params} view of a ring of adapter
    versions (async snapshots hold adapters only: the base is shared) for
    rl.learner.proximal.exact_proximal_logprobs, and composed(adapters) for EWMA.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash

from models.lora import PROJECTIONS, LoraConfig, compose, init_lora, merge, quantize_base
from rl.learner.config import TrainConfig
from rl.loops.validation import ConfigError
from rl.runtime.checkpoint import leaf_bytes

Params = Any
SAMPLERS = ("merged", "composed")
DEFAULT_SAMPLER = "composed"  # measured: see the module docstring
BASE_KEY = "lora_base.xxh3_128"  # the config record's field holding the base hash


# ----------------------------------------------------------------------------- identity
def base_hash(base: Params) -> str:
    """xxh3-128 hex digest over every leaf of `base` in tree order: its path, dtype, shape
    and native-order bytes (a quantized base hashes its stored int8 / uint8 bytes)."""
    h = xxhash.xxh3_128()
    flat, _ = jax.tree_util.tree_flatten_with_path(base)
    for path, x in flat:
        a = leaf_bytes(x)
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
    return h.hexdigest()


def check_base(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """ConfigError naming both hashes when the checkpoint's config record `saved` was
    trained on another base than `current` holds (a record without a base hash: a full
    fine-tune's, left to the config comparison)."""
    if not saved or BASE_KEY not in saved or BASE_KEY not in current:
        return
    if saved[BASE_KEY] != current[BASE_KEY]:
        raise ConfigError(
            f"cannot resume: the checkpoint's adapters were trained on a base with "
            f"{BASE_KEY} {saved[BASE_KEY]}, but the base given now hashes to "
            f"{current[BASE_KEY]}; load the same base model (and --qlora format) as the run")


def latest_record(ckpt_dir: Path) -> dict | None:
    """The config record in the latest checkpoint's JSON meta (orbax's meta/metadata file),
    read without restoring any array, or None when it cannot be read (the restore then
    reports the damage). Lets a LoRA resume refuse other LoRA settings or another base
    with the clear ConfigError before the adapters' shapes fail to restore."""
    steps = sorted(int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit())
    try:
        meta = json.loads((ckpt_dir / str(steps[-1]) / "meta" / "metadata").read_text())
    except (IndexError, OSError, ValueError):
        return None
    return meta.get("config") if isinstance(meta, dict) else None


# ----------------------------------------------------------------------------- sampler params
@functools.partial(jax.jit, static_argnums=(2,))
def _merged_nodes(base: Params, adapters: Params, config: LoraConfig) -> dict:
    """{"attn/q_proj": {"kernel": W + (alpha/r) A B, bias...}} of the targets only (the
    rest of models.lora.merge's output is dead code here)."""
    merged = merge(base, adapters, config)["layers"]
    return {f"{PROJECTIONS[n][0]}/{n}": merged[PROJECTIONS[n][0]][n] for n in config.projections}


def merged_params(base: Params, adapters: Params, config: LoraConfig) -> Params:
    """The adapted policy as plain weights: base with every target's kernel replaced by
    W + (alpha/r) A B (float32 for a quantized base, else the kernel's dtype); untargeted
    leaves ARE the base's arrays (the sampler never donates them). Jitted, returning the
    targets only (one merge per policy version); equals models.lora.merge on the targets."""
    layers = dict(base["layers"])
    for key, node in _merged_nodes(base, adapters, config).items():
        parent, name = key.split("/")
        layers[parent] = {**layers[parent], name: node}
    return {**base, "layers": layers}


class ComposedSnapshots(Mapping):
    """Read-only {version: base + adapters of that version} over a ring of adapter
    snapshots (e.g. rl.learner.snapshots.ParamSnapshots); composing is tree surgery."""

    def __init__(self, ring: Mapping[int, Params], lora: LoraRun):
        self._ring, self._lora = ring, lora

    def __getitem__(self, version: int) -> Params:
        return self._lora.composed(self._ring[version])

    def __iter__(self) -> Iterator[int]:
        return iter(self._ring)

    def __len__(self) -> int:
        return len(self._ring)


@dataclasses.dataclass
class LoraRun:
    """A LoRA run's frozen base (stored as LoraConfig.qlora says), its hash, the config
    and how the sampler gets the policy (SAMPLERS). See the module docstring."""

    base: Params
    config: LoraConfig
    base_hash: str
    sampler: str = DEFAULT_SAMPLER

    def __post_init__(self):
        self._copies: dict[Any, Params] = {}

    def base_for(self, adapters: Params) -> Params:
        """The base on the device the adapters live on: self.base, or (adapters committed
        to one other device, e.g. an async rollout device) a copy made once per device."""
        sharding = getattr(jax.tree.leaves(adapters)[0], "sharding", None)
        base_sh = getattr(jax.tree.leaves(self.base)[0], "sharding", None)
        if (not isinstance(sharding, jax.sharding.SingleDeviceSharding) or base_sh is None
                or sharding.device_set == base_sh.device_set):
            return self.base
        (device,) = sharding.device_set
        if device not in self._copies:
            self._copies[device] = jax.device_put(self.base, device)
        return self._copies[device]

    def composed(self, adapters: Params) -> Params:
        return compose(self.base_for(adapters), adapters, self.config)

    def policy(self, adapters: Params) -> Params:
        """The params the sampler / evals run for these adapters (merged or composed)."""
        if self.sampler == "merged":
            return merged_params(self.base_for(adapters), adapters, self.config)
        return self.composed(adapters)

    def snapshots(self, ring: Mapping[int, Params]) -> Mapping[int, Params]:
        return ComposedSnapshots(ring, self)


def lora_run(params: Params, config: TrainConfig, seed: int, *,
             sampler: str = DEFAULT_SAMPLER) -> tuple[LoraRun, Params]:
    """(LoraRun, fresh adapters) for a LoRA run from the model's full `params` (the base):
    quantized when config.lora.qlora says so, hashed; adapters from init_lora(base,
    config.lora, seed) (A random, B = 0: the policy starts as the base)."""
    lc = config.lora
    if sampler not in SAMPLERS:
        raise ValueError(f"LoRA sampler must be one of {SAMPLERS}, got {sampler!r}")
    base = quantize_base(params, lc.qlora) if lc.qlora else params
    adapters = init_lora(base, lc, seed)
    return LoraRun(base=base, config=lc, base_hash=base_hash(base), sampler=sampler), adapters


def identity(params: Params) -> Params:
    return params


def policy_fn(lora: LoraRun | None) -> Callable[[Params], Params]:
    """state.params -> the sampler's params: identity for a full fine-tune."""
    return identity if lora is None else lora.policy
