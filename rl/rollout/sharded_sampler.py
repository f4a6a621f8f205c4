"""The sampler on a (data, fsdp, tensor) mesh: `rl.rollout.sampler`'s pure fill and segment-decode
bodies (`fill_impl`, `decode_segment_impl`) jitted with explicit in/out shardings.

Placement follows the logical rules of `models.sharding`: sampler slots and the groups
of the segmented KV cache over ("data", "fsdp") (a group's N samples and its prompt
segment stay on one device), kv heads / heads over "tensor", params by their own axes.
The whole cache is never gathered: each device decodes its own groups with its own
heads (`experiments/bench/scaling.py` checks the compiled HLO for full-array gathers).
Same rng streams as the one-device sampler, so the tokens are the same on any mesh.

    sampler = ShardedSampler(model_config, mesh)
    state = sampler.init_state(num_slots=64, group_size=8, max_prompt_len=128, max_new_tokens=256)
    params = sampler.place_params(params)
    state = sampler.prefill(params, state, prompts, group_slots=range(len(prompts)),
                            keys=sample_keys(seed, group_ids, 8))
    state = sampler.decode_segment(params, state, num_tokens=32, version=v)
    samples = read_slots(state, range(64))            # rl.rollout.sampler works on the result
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.chunked_prefill import DEFAULT_CHUNK
from models.config import ModelConfig
from models.sharding import DEFAULT_RULES, LogicalRules, logical_to_mesh_sharding, mesh_context
from rl.rollout.sampler import check_prompt
from rl.rollout.sampler_core import SegmentedFill, decode_segment_impl, fill_impl
from rl.rollout.sampler_state import SamplerState, SamplingConfig, init_state, state_logical_axes
from rl.runtime.mesh import param_shardings, replicated, validate_mesh

Params = Any


class ShardedSampler:
    """fill / prefill / decode_segment of `rl.rollout.sampler` compiled for one mesh. States and
    params must be placed with `init_state` / `place_state` / `place_params`; every call
    returns the state with the same shardings (it donates the state it gets)."""

    def __init__(self, model_config: ModelConfig, mesh: jax.sharding.Mesh, *,
                 rules: LogicalRules = DEFAULT_RULES,
                 compiler_options: Mapping[str, Any] | None = None):
        validate_mesh(mesh, model_config, rules=rules)
        self.model_config, self.mesh, self.rules = model_config, mesh, rules
        self._opts = None if compiler_options is None else dict(compiler_options)
        self._params_sh = param_shardings(model_config, mesh, rules)
        self._jits: dict[Any, Any] = {}

    # ------------------------------------------------------------------ placement
    def state_shardings(self, state: SamplerState) -> SamplerState:
        """NamedSharding tree of `state` from its logical axes
        (rl.rollout.sampler_state.state_logical_axes)."""
        return logical_to_mesh_sharding(state_logical_axes(state), self.mesh, self.rules)

    def _check_state(self, state: SamplerState) -> None:
        if not isinstance(state, SamplerState):
            raise ValueError(f"state must be a SamplerState, got {type(state).__name__}")
        if state.config != self.model_config:
            raise ValueError("the state was built for another ModelConfig than this sampler's")
        groups = state.cache.groups if state.kv_layout == "segmented" else None
        validate_mesh(self.mesh, self.model_config, num_slots=state.num_slots, groups=groups,
                      rules=self.rules)

    def place_state(self, state: SamplerState) -> SamplerState:
        self._check_state(state)
        return jax.device_put(state, self.state_shardings(state))

    def place_params(self, params: Params) -> Params:
        return jax.device_put(params, self._params_sh)

    def init_state(self, *, num_slots: int, max_prompt_len: int, max_new_tokens: int,
                   group_size: int | None = None, sampling: SamplingConfig = SamplingConfig(),
                   stop_ids: Sequence[int] = (), attn_impl: str | None = None,
                   kv_layout: str | None = None, cache_dtype: str | None = None,
                   prefill_chunk: int | None = DEFAULT_CHUNK, layer_loop: str = "scan"
                   ) -> SamplerState:
        """rl.rollout.init_state, placed on the mesh. ValueError (before compiling) if the
        slots, or the groups of a segmented cache, do not divide by data*fsdp."""
        def build():
            return init_state(self.model_config, num_slots=num_slots,
                              max_prompt_len=max_prompt_len, max_new_tokens=max_new_tokens,
                              group_size=group_size, sampling=sampling, stop_ids=stop_ids,
                              attn_impl=attn_impl, kv_layout=kv_layout, cache_dtype=cache_dtype,
                              prefill_chunk=prefill_chunk, layer_loop=layer_loop)

        state = jax.eval_shape(build)  # validates the arguments, allocates nothing
        self._check_state(state)
        # Build the (mostly zero) state directly in its shardings: nothing is gathered.
        return jax.jit(build, out_shardings=self.state_shardings(state))()

    # ------------------------------------------------------------------ jitted bodies
    def _jit(self, kind: str, state: SamplerState):
        key = (kind, jax.tree.structure(state))
        if key not in self._jits:
            st = self.state_shardings(state)
            rep = replicated(self.mesh)
            if kind == "fill":
                ins = (self._params_sh, st, rep)
                fn = fill_impl
            else:
                ins = (self._params_sh, st, rep, rep)
                fn = decode_segment_impl
            self._jits[key] = jax.jit(fn, in_shardings=ins, out_shardings=st, donate_argnums=1,
                                      compiler_options=self._opts)
        return self._jits[key]

    def fill(self, params: Params, state: SamplerState, fill: Any) -> SamplerState:
        """rl.rollout.fill_impl with explicit shardings (the fill's host arrays are
        replicated: they are small next to the cache)."""
        self._check_state(state)
        with mesh_context(self.mesh, self.rules):
            return self._jit("fill", state)(params, state, fill)

    def prefill(self, params: Params, state: SamplerState, prompts: Sequence[Sequence[int]],
                group_slots: Sequence[int], keys: Any, *, max_new_tokens: int | None = None
                ) -> SamplerState:
        """Start G groups in a segmented state: prompt g is prefilled once into group slot
        group_slots[g] (slots group_slots[g] * N .. + N - 1); keys [G, N, 2] uint32 (see
        rl.rollout.sample_keys); max_new_tokens (default: the state's) is each sample's
        budget. One compiled shape: every group slot is in the fill (unused ones dropped)."""
        self._check_state(state)
        if state.kv_layout != "segmented":
            raise ValueError("ShardedSampler.prefill builds segmented fills; for a replicated "
                             "state build a rl.rollout.ReplicatedFill and call fill()")
        n, n_groups = state.group_size, state.cache.groups
        g = len(prompts)
        slots = np.asarray(group_slots, np.int64).reshape(-1)
        if slots.size != g or g == 0:
            raise ValueError(f"group_slots must give one group slot per prompt ({g}), got "
                             f"{slots.size}")
        if slots.min() < 0 or slots.max() >= n_groups or len(np.unique(slots)) != g:
            raise ValueError(f"group_slots must be distinct and in [0, {n_groups}), got "
                             f"{slots.tolist()}")
        keys = np.asarray(keys)
        if keys.shape != (g, n, 2):
            raise ValueError(f"keys must be [G, N, 2] = {(g, n, 2)} uint32, got shape {keys.shape}")
        budget = state.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= budget <= state.max_new_tokens:
            raise ValueError(f"max_new_tokens must be in [1, {state.max_new_tokens}], got {budget}")
        p_max, r_max = state.max_prompt_len, state.max_new_tokens
        prompt_ids = np.zeros((n_groups, p_max), np.int32)
        prompt_lengths = np.ones((n_groups,), np.int32)
        group_slot = np.full((n_groups,), n_groups, np.int32)  # out of range: dropped
        all_keys = np.zeros((n_groups, n, 2), np.uint32)
        for i, p in enumerate(prompts):
            ids = check_prompt(p, p_max, self.model_config, f"prompts[{i}]")
            prompt_ids[i, :ids.size], prompt_lengths[i] = ids, ids.size
            group_slot[i], all_keys[i] = slots[i], keys[i]
        fill = SegmentedFill(
            prompt_ids=prompt_ids, prompt_lengths=prompt_lengths,
            resp_ids=np.zeros((n_groups, n, 1), np.int32),
            num_generated=np.zeros((n_groups, n), np.int32), group_slot=group_slot,
            keys=all_keys, budget=np.full((n_groups, n), budget, np.int32),
            logprobs=np.zeros((n_groups, n, r_max), np.float32),
            versions=np.full((n_groups, n, r_max), -1, np.int32),
            done=np.zeros((n_groups, n), bool), stopped=np.zeros((n_groups, n), bool))
        return self.fill(params, state, fill)

    def decode_segment(self, params: Params, state: SamplerState, num_tokens: int,
                       version: int) -> SamplerState:
        """rl.rollout.decode_segment with explicit shardings: every live slot advances by
        at most num_tokens tokens drawn from `params`, stamped with `version`."""
        self._check_state(state)
        for name, v, low in (("num_tokens", num_tokens, 1), ("version", version, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        with mesh_context(self.mesh, self.rules):
            return self._jit("decode", state)(params, state, jnp.int32(num_tokens),
                                              jnp.int32(version))

    def lower_decode(self, params: Params, state: SamplerState) -> jax.stages.Lowered:
        """The decode-segment program lowered for these inputs: `.compile()` gives an
        executable called as (params, state, num_tokens int32, version int32) -> state,
        whose `.as_text()` is the HLO (for counting collectives)."""
        self._check_state(state)
        with mesh_context(self.mesh, self.rules):
            return self._jit("decode", state).lower(params, state, jnp.int32(1), jnp.int32(0))

    def decode_hlo(self, params: Params, state: SamplerState) -> str:
        """The compiled decode-segment program's HLO text."""
        return self.lower_decode(params, state).compile().as_text()
