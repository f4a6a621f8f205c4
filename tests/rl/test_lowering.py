"""The jitted programs that use the Pallas kernels lower for "cuda" and "tpu" on this CPU.

The train step with packed=True (shared-prefix attention forward and backward; also with
TrainConfig.remat="full", the layers recomputed in the backward), the
sampler's segmented fill (shared-prefix forward) and its decode segment (segment decode,
masked, bounded, and bounded with the layers unrolled: issue 33's fast path) are traced once on abstract inputs (jax.ShapeDtypeStruct: random
weights are never materialised, no model file is read) for the `tiny` and `smollm2-135m`
configs in bf16, then lowered for each platform. With attn_impl=None (the default), the
tpu module must hold the Mosaic kernels and the cuda module the Triton decode kernels and,
for shared-prefix attention in bf16, the split design's cuDNN fused-attention calls
(forward, and backward in the train step), whatever jax.default_backend() of this host is. Ragged lengths are runtime values; the static
geometry is non-power-of-two (P, R, N, heads).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.dispatch import lowered_kernels
from models.config import get_config
from models.decoder import init_params
from rl.learner import TrainConfig, batch_from_trajectory
from rl.learner.jitted import abstract_train_state
from rl.learner.step import train_step
from rl.rollout.sampler_core import SegmentedFill, decode_segment_impl, fill_impl
from rl.rollout.sampler_state import SamplingConfig, init_state
from rl.trajectory import Trajectory
from tests.kernels.test_lowering_kernels import (
    CUDNN_BWD,
    CUDNN_FWD,
    DECODE,
    SPA_BWD,
    SPA_FWD,
    cudnn_calls,
)

MODELS = ("tiny", "smollm2-135m")
PLATFORMS = ("cuda", "tpu")
GROUPS, N, P_MAX, R_MAX = 2, 3, 11, 7


def bf16_config(name):
    return get_config(name, dtype="bfloat16")


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


@functools.lru_cache(maxsize=None)
def lowered_names(program: str, model: str, platform: str) -> dict[str, list[str]]:
    traced = traced_program(program, model)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    found = lowered_kernels(text)
    return {"cuda": found["triton"] + cudnn_calls(text), "tpu": found["mosaic"]}


@functools.lru_cache(maxsize=None)
def traced_program(program: str, model: str):
    cfg = bf16_config(model)
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    if program in ("train_step", "train_step_remat"):
        config = TrainConfig(packed=True, remat="full" if program == "train_step_remat" else None)
        fn = functools.partial(train_step, config=config, model_config=cfg)
        return jax.jit(fn).trace(abstract_train_state(cfg, config), abstract(packed_batch(cfg)))
    state = jax.eval_shape(lambda: init_state(
        cfg, num_slots=GROUPS * N, max_prompt_len=P_MAX, max_new_tokens=R_MAX,
        sampling=SamplingConfig(), group_size=N,
        layer_loop="unrolled" if program == "decode_unrolled" else "scan"))
    if program == "fill":
        return jax.jit(fill_impl).trace(params, state, segmented_fill())
    bound = None if program == "decode" else 9
    fn = functools.partial(decode_segment_impl, kv_bound=bound)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return jax.jit(fn).trace(params, state, scalar, scalar)


def packed_batch(cfg):
    """Host arrays of a packed batch: GROUPS groups of N rows, ragged lengths."""
    b = GROUPS * N
    rng = np.random.default_rng(0)
    plen = np.repeat([P_MAX, 4], N)
    rlen = np.array([R_MAX, 1, 0, 5, R_MAX, 2])
    pmask, rmask = np.arange(P_MAX) < plen[:, None], np.arange(R_MAX) < rlen[:, None]
    traj = Trajectory.create(
        prompt_ids=np.repeat(rng.integers(3, 50, (GROUPS, P_MAX)), N, axis=0) * pmask,
        prompt_lengths=plen, response_ids=rng.integers(3, 50, (b, R_MAX)) * rmask,
        response_mask=rmask, behaviour_logprobs=np.where(rmask, -1.0, 0.0),
        versions=np.zeros((b, R_MAX)), group_ids=np.repeat(np.arange(GROUPS), N),
        finished=np.zeros(b, bool), truncated=np.ones(b, bool), rewards={"r": rng.normal(size=b)})
    batch = batch_from_trajectory(traj, group_size=N, model_config=cfg, packed=True)
    assert batch.packed is not None
    return batch


def i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def segmented_fill():
    return SegmentedFill(
        prompt_ids=i32(GROUPS, P_MAX), prompt_lengths=i32(GROUPS), resp_ids=i32(GROUPS, N, 5),
        num_generated=i32(GROUPS, N), group_slot=i32(GROUPS),
        keys=jax.ShapeDtypeStruct((GROUPS, N, 2), jnp.uint32), budget=i32(GROUPS, N),
        logprobs=jax.ShapeDtypeStruct((GROUPS, N, R_MAX), jnp.float32),
        versions=i32(GROUPS, N, R_MAX), done=jax.ShapeDtypeStruct((GROUPS, N), bool),
        stopped=jax.ShapeDtypeStruct((GROUPS, N), bool))


# bf16 shared-prefix attention on cuda: the split design on cuDNN; elsewhere the kernels
EXPECTED = {"train_step": lambda p: [CUDNN_FWD, CUDNN_BWD] if p == "cuda" else SPA_FWD[p] + SPA_BWD[p],
            "train_step_remat": lambda p: ([CUDNN_FWD, CUDNN_BWD] if p == "cuda"
                                           else SPA_FWD[p] + SPA_BWD[p]),
            "fill": lambda p: [CUDNN_FWD] if p == "cuda" else SPA_FWD[p],
            "decode": lambda p: DECODE[p], "decode_bounded": lambda p: DECODE[p],
            "decode_unrolled": lambda p: DECODE[p]}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("program", sorted(EXPECTED))
def test_program_holds_the_platform_kernels(program, model, platform):
    names = lowered_names(program, model, platform)
    other = {"cuda": "tpu", "tpu": "cuda"}[platform]
    assert sorted(set(names[platform])) == sorted(EXPECTED[program](platform)), names
    assert names[other] == []


@pytest.mark.parametrize("program", ["train_step", "decode"])
def test_cpu_lowering_keeps_the_xla_path(program):
    """Traced on this CPU host with attn_impl=None, the CPU lowering holds no kernel."""
    assert lowered_names(program, "tiny", "cpu") == {"cuda": [], "tpu": []}
