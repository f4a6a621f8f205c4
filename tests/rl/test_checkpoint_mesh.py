"""Checkpoints across meshes: a TrainState saved on 8 forced CPU devices as fsdp=4 x
tensor=2 restores (orbax, target shardings) onto 4 devices as data=2 x fsdp=2 and onto
one device; the restored arrays are bit-identical to the saved ones and the next step's
loss on both equals (<= 1e-6) that of the never-saved state."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import init_params
from rl.learner import (
    OptimizerConfig,
    TrainConfig,
    TrainState,
    abstract_train_state,
    batch_from_trajectory,
    init_train_state,
    make_train_step,
)
from rl.runtime.checkpoint import Checkpointer
from rl.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]
CFG = get_config("tiny", vocab_size=16, max_position_embeddings=32)
CONFIG = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-2), temperature=0.7)
FAST = {"xla_backend_optimization_level": 0}
B, GROUP, W = 8, 4, 4


def make_batch(seed):
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(1, W + 1, B), rng.integers(1, W + 1, B)
    pm, rm = np.arange(W)[None] < plen[:, None], np.arange(W)[None] < rlen[:, None]
    traj = Trajectory.create(
        prompt_ids=rng.integers(3, 16, (B, W)) * pm, prompt_lengths=plen,
        response_ids=rng.integers(3, 16, (B, W)) * rm, response_mask=rm,
        behaviour_logprobs=np.where(rm, -rng.random((B, W)), 0.0), versions=np.zeros((B, W)),
        group_ids=np.repeat(np.arange(B // GROUP), GROUP), finished=np.ones(B, bool),
        truncated=np.zeros(B, bool), rewards={"r": rng.normal(size=B)})
    return batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, seq_len=2 * W)


def noisy_state():
    """A TrainState whose every float leaf (params, Adam moments) is seeded noise, so
    the moments matter and any mix-up of shards would show."""
    state = init_train_state(init_params(CFG, 3), CONFIG, 0)
    rng = np.random.default_rng(4)
    state = jax.tree.map(lambda x: (0.1 * rng.normal(size=x.shape)).astype(x.dtype)
                         if np.issubdtype(x.dtype, np.floating) else np.asarray(x), state)
    # Second moments must be >= 0 for AdamW.
    return state.replace(opt_state=jax.tree.map(np.abs, state.opt_state),
                         step=np.int32(5), version=np.int32(5))


# 8 devices: save on fsdp=4 x tensor=2, restore onto data=2 x fsdp=2 (4 of the devices)
# and take the next step there.
_SCRIPT = textwrap.dedent("""
    import sys, jax, numpy as np
    from rl.runtime.checkpoint import Checkpointer
    from rl.runtime.mesh import make_mesh_preset
    from rl.learner import abstract_train_state, make_train_step, state_shardings
    sys.path.insert(0, "tests/rl")
    from test_checkpoint_mesh import CFG, CONFIG, FAST, make_batch, noisy_state
    assert len(jax.devices()) == 8
    ckdir, out = sys.argv[1], sys.argv[2]
    mesh_a = make_mesh_preset("fsdp+tp", tensor=2)
    state = jax.device_put(noisy_state(), state_shardings(CFG, CONFIG, mesh_a))
    assert tuple(state.params["embed"]["embedding"].sharding.spec) == ("tensor", "fsdp")
    with Checkpointer(ckdir) as ck:
        ck.save(5, state, {"mesh": "fsdp=4,tensor=2"})
    mesh_b = make_mesh_preset("dp+fsdp", jax.devices()[:4], data=2)
    with Checkpointer(ckdir) as ck:
        restored, meta = ck.restore(abstract_train_state(CFG, CONFIG),
                                    shardings=state_shardings(CFG, CONFIG, mesh_b))
    emb = restored.params["embed"]["embedding"]
    assert emb.sharding.mesh.shape == {"data": 2, "fsdp": 2, "tensor": 1}, emb.sharding
    assert len(emb.sharding.device_set) == 4
    got = {f"r{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(restored))}
    _, m_b = make_train_step(CONFIG, CFG, mesh_b, compiler_options=FAST)(restored, make_batch(2))
    np.savez(out, loss_b=np.asarray(m_b["loss"]), **got)
""")


def test_checkpoint_restores_onto_other_meshes(tmp_path):
    # XLA:CPU's concurrency-optimized scheduler can deadlock data x fsdp programs on
    # forced devices (seen at the default optimisation level): keep the plain schedule.
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=8"
               " --xla_cpu_enable_concurrency_optimized_scheduler=false")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "ck"),
                          str(tmp_path / "out.npz")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = np.load(tmp_path / "out.npz")
    saved = noisy_state()
    for i, x in enumerate(jax.tree.leaves(saved)):  # data=2 x fsdp=2 holds what was saved
        np.testing.assert_array_equal(res[f"r{i}"], np.asarray(x))

    # This process has one device: restore there with one target sharding for all arrays.
    with Checkpointer(tmp_path / "ck") as ck:
        state, meta = ck.restore(abstract_train_state(CFG, CONFIG),
                                 shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert meta["mesh"] == "fsdp=4,tensor=2" and isinstance(state, TrainState)
    for i, x in enumerate(jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(jax.tree.leaves(saved)[i]))
    step = make_train_step(CONFIG, CFG, compiler_options=FAST)
    _, m1 = step(state, make_batch(2))
    _, m_ref = step(jax.tree.map(jnp.asarray, saved), make_batch(2))  # never checkpointed
    loss_ref, loss_1, loss_b = float(m_ref["loss"]), float(m1["loss"]), float(res["loss_b"])
    assert abs(loss_ref) > 1e-3  # a real loss, not a degenerate zero
    assert abs(loss_1 - loss_ref) <= 1e-6 and abs(loss_b - loss_ref) <= 1e-6, (
        loss_ref, loss_1, loss_b)


def test_bad_shardings_are_a_clear_error(tmp_path):
    template = abstract_train_state(CFG, CONFIG)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), template))
        with pytest.raises(ValueError, match="shardings` must be one jax.sharding.Sharding"):
            ck.restore(template, shardings={"params": None})
