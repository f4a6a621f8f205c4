"""`make_train_step`: `rl.learner.step.train_step` jitted with explicit in/out shardings.

Shardings come from the models' logical axis rules: params by `models.sharding`, the
optimizer moments like their params, batch rows (packed: groups) over ("data", "fsdp");
the state is donated. One jax.jit object per (configs, mesh, rules), so every
`JittedTrainStep` with the same key shares its compilations.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import numpy as np
import optax

from models.config import ModelConfig
from models.decoder import init_params, param_logical_axes
from models.lora import init_lora, lora_logical_axes, quantized_logical_axes
from models.sharding import DEFAULT_RULES, LogicalRules, logical_to_mesh_sharding, mesh_context
from rl.learner.batch import TrainBatch, TrainState, init_train_state
from rl.learner.checked import checked_train_step, checkified, throw
from rl.learner.config import TrainConfig, make_optimizer
from rl.learner.step import train_step
from rl.runtime.mesh import batch_sharding

Params = Any


# ----------------------------------------------------------------------------- jit + shardings
def abstract_train_state(model_config: ModelConfig, config: TrainConfig) -> TrainState:
    """Shapes and dtypes (jax.ShapeDtypeStruct leaves) of a TrainState; allocates nothing."""
    def build():
        params = init_params(model_config, 0)
        if config.lora is not None:  # the state holds the adapters only
            params = init_lora(params, config.lora, 0)
        return init_train_state(params, config, 0)
    return jax.eval_shape(build)


def _param_axes(model_config: ModelConfig, config: TrainConfig) -> Params:
    axes = param_logical_axes(model_config)
    return axes if config.lora is None else lora_logical_axes(axes, config.lora)


def ref_shardings(model_config: ModelConfig, config: TrainConfig, mesh: jax.sharding.Mesh,
                  rules: LogicalRules = DEFAULT_RULES) -> Params:
    """NamedSharding tree of the step's third argument: the KL reference (the params'
    shardings) or, with config.lora, the frozen base as stored (quantized with qlora)."""
    axes = param_logical_axes(model_config)
    if config.lora is not None and config.lora.qlora:
        axes = quantized_logical_axes(axes, config.lora.qlora)
    return logical_to_mesh_sharding(axes, mesh, rules)


def state_shardings(model_config: ModelConfig, config: TrainConfig, mesh: jax.sharding.Mesh,
                    rules: LogicalRules = DEFAULT_RULES) -> TrainState:
    """NamedSharding tree of a TrainState: params by the logical rules, optimizer moments
    like their params, counters, scalars and rng replicated."""
    params_sh = logical_to_mesh_sharding(_param_axes(model_config, config), mesh, rules)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = abstract_train_state(model_config, config)
    opt_sh = optax.tree_map_params(make_optimizer(config.optimizer, config.vcpo), lambda _, s: s,
                                   abstract.opt_state, params_sh,
                                   transform_non_params=lambda _: replicated)
    return TrainState(params=params_sh, opt_state=opt_sh, step=replicated, version=replicated,
                      rng=replicated)


@functools.lru_cache(maxsize=64)
def _jitted(config: TrainConfig, model_config: ModelConfig, mesh: jax.sharding.Mesh | None,
            rules: LogicalRules, with_ref: bool, compiler_options: tuple | None,
            checked: bool = False):
    """One jax.jit object per (configs, mesh, ...): every JittedTrainStep with the same key
    shares its compilations (e.g. a run resumed in the same process compiles nothing).
    checked: the checkify'd rl.learner.checked step, returning (error, (state, metrics))."""
    step = checked_train_step if checked else train_step
    body = partial(step, config=config, model_config=model_config)
    if checked:
        body = checkified(body)
    opts = None if compiler_options is None else dict(compiler_options)
    if mesh is None:
        return jax.jit(body, donate_argnums=0, compiler_options=opts)
    st = state_shardings(model_config, config, mesh, rules)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ins = (st, batch_sharding(mesh)) + (
        (ref_shardings(model_config, config, mesh, rules),) if with_ref else ())
    outs = (rep, (st, rep)) if checked else (st, rep)  # the error's scalars: replicated
    return jax.jit(body, in_shardings=ins, out_shardings=outs, donate_argnums=0,
                   compiler_options=opts)


def _check_packed_rows(batch: TrainBatch) -> None:
    """The step relies on rows[g, n] = g * N + n (contiguous groups, as batch_from_trajectory
    builds them): check it on host-side arrays (traced ones are left alone)."""
    rows = batch.packed.rows
    if isinstance(rows, jax.core.Tracer) or (isinstance(rows, jax.Array)
                                              and not rows.is_fully_addressable):
        return  # traced, or spread over several processes: nothing to read on host
    rows = np.asarray(rows)
    b = batch.tokens.shape[0]
    if rows.size != b or not np.array_equal(rows.reshape(-1), np.arange(b)):
        raise ValueError("TrainBatch.packed.rows must be arange(B).reshape(G, N) (groups as "
                         "contiguous row blocks); build the batch with "
                         "batch_from_trajectory(..., packed=True)")


# XLA CPU: hand only the dots to YNNPACK. Its default also fuses reductions and
# elementwise work (the vocabulary head's log-sum-exp and entropy sums), which ran several
# times slower than XLA's own loops: the SmolLM2 packed GRPO step took 32.5 s with the
# default and 26.8 s with dots only (experiments/bench/learner.py measures it).
CPU_DEFAULT_OPTIONS = (("xla_cpu_experimental_ynn_fusion_type", "LIBRARY_FUSION_TYPE_DOT"),)


@functools.lru_cache(maxsize=1)
def cpu_default_options() -> tuple:
    """CPU_DEFAULT_OPTIONS when the default backend is the CPU and this jaxlib knows them
    (checked once by compiling a trivial function), else ()."""
    if jax.default_backend() != "cpu":
        return ()
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(dict(CPU_DEFAULT_OPTIONS))
    except Exception:  # an older / newer jaxlib without the option: XLA's defaults
        return ()
    return CPU_DEFAULT_OPTIONS


class JittedTrainStep:
    """`train_step` compiled for one (TrainConfig, ModelConfig[, mesh]); call it as
    `state, metrics = step(state, batch[, ref_params])`. The state is donated: do not
    use the state you passed in after the call. With a mesh, inputs are placed with
    explicit shardings (B must be divisible by data * fsdp * micro_batches) and the
    model's activation annotations become sharding constraints. checked: run the
    rl.learner.checked step (checkify): a non-finite reward, behaviour log-prob, loss or
    gradient norm raises rl.learner.checked.NonFiniteError naming the update and group."""

    def __init__(self, config: TrainConfig, model_config: ModelConfig,
                 mesh: jax.sharding.Mesh | None = None, rules: LogicalRules = DEFAULT_RULES,
                 compiler_options: Mapping[str, Any] | None = None, checked: bool = False):
        self.config, self.model_config, self.mesh, self.rules = config, model_config, mesh, rules
        self.checked = bool(checked)
        # the CPU defaults, overridable key by key by the caller's options
        opts = {**dict(cpu_default_options()), **dict(compiler_options or {})}
        self._opts = tuple(sorted(opts.items())) or None

    def place_state(self, state: TrainState) -> TrainState:
        """Put `state` on the mesh with its shardings (without a mesh: commit it to the
        default device, so fresh and restored states hit the same compiled step)."""
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        return jax.device_put(state, state_shardings(self.model_config, self.config, self.mesh,
                                                     self.rules))

    def __call__(self, state: TrainState, batch: TrainBatch, ref_params: Params | None = None
                 ) -> tuple[TrainState, dict]:
        b = batch.tokens.shape[0]
        if b == 0:
            raise ValueError("the batch is empty (0 rows); nothing to train on")
        if self.config.packed and batch.packed is not None:
            _check_packed_rows(batch)
        if self.mesh is not None:
            rows = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
            if b % (rows * self.config.micro_batches):
                raise ValueError(f"batch of {b} rows must be divisible by data*fsdp*micro_batches = "
                                 f"{rows * self.config.micro_batches} on this mesh")
            g = None if batch.packed is None else batch.packed.prompt_tokens.shape[0]
            if self.config.packed and g is not None and g % (rows * self.config.micro_batches):
                raise ValueError(f"the packed batch has {g} groups; with TrainConfig.packed they "
                                 "must be divisible by data*fsdp*micro_batches = "
                                 f"{rows * self.config.micro_batches} on this mesh")
            t = None if batch.tree is None else batch.tree.tokens.shape[0]
            if self.config.tree and t is not None and t % (rows * self.config.micro_batches):
                raise ValueError(f"the tree batch has {t} groups; with TrainConfig.tree they "
                                 "must be divisible by data*fsdp*micro_batches = "
                                 f"{rows * self.config.micro_batches} on this mesh")
        out = self._apply(lambda fn, *args: fn(*args), state, batch, ref_params)
        if not self.checked:
            return out
        err, out = out
        throw(err)
        return out

    def lower(self, state: TrainState, batch: TrainBatch, ref_params: Params | None = None):
        """The step lowered for these arguments (`.compile().as_text()` gives the HLO, e.g.
        to count collectives); nothing runs and the state is not donated."""
        return self._apply(lambda fn, *args: fn.lower(*args), state, batch, ref_params)

    def _apply(self, call, state, batch, ref_params):
        fn = _jitted(self.config, self.model_config, self.mesh, self.rules,
                     ref_params is not None, self._opts, self.checked)
        args = (state, batch) + ((ref_params,) if ref_params is not None else ())
        if self.mesh is None:
            return call(fn, *args)
        with mesh_context(self.mesh, self.rules):
            return call(fn, *args)


def make_train_step(config: TrainConfig, model_config: ModelConfig,
                    mesh: jax.sharding.Mesh | None = None, rules: LogicalRules = DEFAULT_RULES,
                    compiler_options: Mapping[str, Any] | None = None,
                    checked: bool = False) -> JittedTrainStep:
    """The jitted step (see JittedTrainStep). Without a mesh: plain jit on the default
    device; with one: explicit in/out shardings from the logical rules. compiler_options
    are passed to XLA (e.g. {"xla_backend_optimization_level": 0} compiles about twice
    as fast on CPU and runs slower: useful for short CPU runs and tests), on top of
    `cpu_default_options()` on CPU (a key given here wins). checked: the checkify'd step
    of rl.learner.checked (what the loops use by default)."""
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(model_config, ModelConfig):
        raise ValueError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    if mesh is not None:  # heads / kv_heads / mlp / vocab vs the mesh: a clear error, before compiling
        from rl.runtime.mesh import validate_mesh
        validate_mesh(mesh, model_config, rules=rules)
    return JittedTrainStep(config, model_config, mesh, rules, compiler_options, checked)
