"""The learner's remat option (TrainConfig.remat: "none" / "dots" / "full") and the head
chunk sized per device (models.logprobs.head_chunk_for_memory).

Rematerialisation recomputes, it must not change the update: the step with "dots" and
"full" gives the parameters, loss and gradient norm of the step without remat (the slow
twin, which stores every activation), on the packed and the unpacked layout; each policy
needs less compiled scratch memory than no remat; the default (None) leaves the model
config alone; bad names fail early."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from models.config import get_config
from models.decoder import init_params
from models.logprobs import DEFAULT_CHUNK, head_chunk_for_memory
from rl.learner import TrainConfig, batch_from_trajectory, init_train_state
from rl.learner.step import learner_model_config, train_step
from rl.trajectory import Trajectory

CFG = get_config("tiny")
G, N, P, R = 4, 4, 32, 64


@pytest.fixture(scope="module")
def trajectory():
    b = G * N
    rng = np.random.default_rng(0)
    rmask = np.arange(R) < rng.integers(R // 2, R + 1, b)[:, None]
    return Trajectory.create(
        prompt_ids=np.repeat(rng.integers(3, 250, (G, P)), N, axis=0),
        prompt_lengths=np.full(b, P), response_ids=rng.integers(3, 250, (b, R)) * rmask,
        response_mask=rmask, behaviour_logprobs=np.where(rmask, -1.0, 0.0),
        versions=np.zeros((b, R)), group_ids=np.repeat(np.arange(G), N),
        finished=np.ones(b, bool), truncated=np.zeros(b, bool),
        rewards={"r": rng.normal(size=b)})


@pytest.mark.parametrize("packed", [True, False])
def test_remat_policies_give_the_update_of_the_step_without_remat(trajectory, packed):
    params = init_params(CFG, 0)
    batch = batch_from_trajectory(trajectory, group_size=N, model_config=CFG, packed=packed)
    out = {}
    for remat in ("none", "dots", "full"):
        config = TrainConfig(packed=packed, remat=remat, micro_batches=2)
        state = init_train_state(params, config, 0)
        step = jax.jit(functools.partial(train_step, config=config, model_config=CFG))
        compiled = step.lower(state, batch).compile()
        new, metrics = compiled(state, batch)
        out[remat] = (new.params, metrics, compiled.memory_analysis().temp_size_in_bytes)
    ref_params, ref_metrics, ref_bytes = out["none"]
    for remat in ("dots", "full"):
        new_params, metrics, scratch = out[remat]
        for k in ("loss", "grad_norm", "entropy"):
            np.testing.assert_allclose(float(metrics[k]), float(ref_metrics[k]), rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=1e-5, atol=1e-7),
                     new_params, ref_params)
        assert scratch < 0.75 * ref_bytes, (remat, scratch, ref_bytes)


def test_remat_option_sets_the_learner_model_config_only_when_asked():
    assert learner_model_config(TrainConfig(), CFG) is CFG  # None: the model's own setting
    assert learner_model_config(TrainConfig(remat="dots"), CFG).remat == "dots"
    assert learner_model_config(TrainConfig(remat="none"), CFG.replace(remat=True)).remat == "none"
    with pytest.raises(ValueError, match="TrainConfig.remat must be None"):
        TrainConfig(remat="all")


def test_head_chunk_sized_for_the_device_memory():
    # 3 fp32 [C, V] arrays within 1/16 of the memory, a power of two, clamped
    for vocab, memory in ((151936, 80e9), (49152, 80e9), (151936, 141e9), (32000, 24e9)):
        c = head_chunk_for_memory(vocab, memory)
        assert c & (c - 1) == 0 and 256 <= c <= 16384
        assert 3 * 4 * vocab * c <= memory / 16 < 3 * 4 * vocab * 2 * c or c in (256, 16384)
    assert head_chunk_for_memory(151936, 80e9) == 2048
    assert head_chunk_for_memory(49152, 80e9) == 8192
    assert head_chunk_for_memory(49152, None) == DEFAULT_CHUNK
    assert head_chunk_for_memory(256, 16e9) == 16384 and head_chunk_for_memory(10**6, 1e8) == 256
    with pytest.raises(ValueError, match="memory_bytes > 0"):
        head_chunk_for_memory(1000, 0)


def test_bf16_matmuls_with_fp32_master_weights():
    """dtype bfloat16 + param_dtype float32: every matmul that touches a weight -- the
    projections, the MLP and the vocabulary head, forward and backward -- takes bf16
    operands, while the state (params and AdamW moments) stays fp32 and the loss is fp32.
    (Attention's own products on this CPU path keep an fp32 softmax; on a GPU they are
    cuDNN's.) Weight dims: hidden 64, MLP 128, vocabulary 256; the batch avoids them."""
    cfg = CFG.replace(dtype="bfloat16", param_dtype="float32")
    g, n, p, r = 2, 3, 5, 7
    rng = np.random.default_rng(0)
    traj = Trajectory.create(
        prompt_ids=np.repeat(rng.integers(3, 250, (g, p)), n, axis=0),
        prompt_lengths=np.full(g * n, p), response_ids=rng.integers(3, 250, (g * n, r)),
        response_mask=np.ones((g * n, r), bool), behaviour_logprobs=-np.ones((g * n, r)),
        versions=np.zeros((g * n, r)), group_ids=np.repeat(np.arange(g), n),
        finished=np.ones(g * n, bool), truncated=np.zeros(g * n, bool),
        rewards={"r": rng.normal(size=g * n)})
    config = TrainConfig(packed=True, remat="full")
    batch = batch_from_trajectory(traj, group_size=n, model_config=cfg, packed=True)
    state = jax.eval_shape(lambda: init_train_state(init_params(cfg, 0), config, 0))
    step = functools.partial(train_step, config=config, model_config=cfg)
    jaxpr = jax.make_jaxpr(step)(state, batch)

    def dots(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for sub in jaxprs_in_params(eqn.params):
                yield from dots(sub)

    weight_dims = {cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size}
    weighted = [e for e in dots(jaxpr.jaxpr)
                if any(weight_dims & set(v.aval.shape) for v in e.invars)]
    assert len(weighted) > 20
    assert all(v.aval.dtype == jax.numpy.bfloat16 for e in weighted for v in e.invars), \
        [[(str(v.aval.dtype), v.aval.shape) for v in e.invars] for e in weighted
         if any(v.aval.dtype != jax.numpy.bfloat16 for v in e.invars)]
    new_state, metrics = jax.eval_shape(step, state, batch)
    leaves = jax.tree.leaves((new_state.params, new_state.opt_state))
    assert all(x.dtype == jax.numpy.float32 for x in leaves if x.ndim)
    assert metrics["loss"].dtype == jax.numpy.float32
