"""Worker of tests/rl/test_multiprocess.py (not collected by pytest): a few train steps of
the tiny model on a (data=1, fsdp=2, tensor=2) mesh over all devices of all processes.

    python tests/rl/mp_worker.py OUT_DIR [--coordinator H:P --num-processes K --process-id I]
    python tests/rl/mp_worker.py OUT_DIR --check-only ...   # join the run, print, exit

Each process builds the same global batches, keeps only its own groups
(rl.runtime.distributed.process_shard) and hands them to rl.learner.global_batch; process 0
writes the final params to OUT_DIR/params.npz. Every process also saves the final state
with rl.runtime.checkpoint.Checkpointer into OUT_DIR/ckpt (orbax coordinates the processes).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.common.flags import add_distributed_flags, distributed_from_args
from rl.runtime.distributed import initialize_distributed

STEPS, GROUPS, GROUP, P_MAX, R_MAX = 3, 2, 4, 4, 4
MESH = "data=1,fsdp=2,tensor=2"


def global_trajectory(step, vocab):
    """The step's global trajectory (identical on every process)."""
    import numpy as np

    from rl.trajectory import Trajectory

    b = GROUPS * GROUP
    rng = np.random.default_rng(100 + step)
    plen, rlen = rng.integers(1, P_MAX + 1, b), rng.integers(1, R_MAX + 1, b)
    pmask = np.arange(P_MAX)[None] < plen[:, None]
    rmask = np.arange(R_MAX)[None] < rlen[:, None]
    return Trajectory.create(
        prompt_ids=rng.integers(3, vocab, (b, P_MAX)) * pmask, prompt_lengths=plen,
        response_ids=rng.integers(3, vocab, (b, R_MAX)) * rmask, response_mask=rmask,
        behaviour_logprobs=np.where(rmask, -rng.random((b, R_MAX)), 0.0),
        versions=np.zeros((b, R_MAX)), group_ids=np.repeat(np.arange(GROUPS), GROUP),
        finished=np.ones(b, bool), truncated=np.zeros(b, bool),
        rewards={"r": rng.normal(size=b)})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--check-only", action="store_true")
    add_distributed_flags(parser)
    args = parser.parse_args()
    multi = initialize_distributed(distributed_from_args(args))  # before any other JAX call

    import jax
    import numpy as np

    if args.check_only:
        print(f"joined: process {jax.process_index()} of {jax.process_count()}", flush=True)
        return

    from models.config import get_config
    from models.decoder import init_params
    from rl.learner import (
        OptimizerConfig,
        TrainConfig,
        batch_from_trajectory,
        global_batch,
        init_train_state,
        make_train_step,
    )
    from rl.runtime.checkpoint import Checkpointer
    from rl.runtime.distributed import is_main_process, process_local, process_shard
    from rl.runtime.mesh import make_mesh_preset, validate_mesh

    cfg = get_config("tiny", vocab_size=16, max_position_embeddings=32)
    config = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-2), temperature=0.7)
    mesh = make_mesh_preset(MESH)
    validate_mesh(mesh, cfg, batch=GROUPS * GROUP)
    step = make_train_step(config, cfg, mesh, compiler_options={"xla_backend_optimization_level": 0})
    state = step.place_state(init_train_state(init_params(cfg, 3), config, 0))
    for i in range(STEPS):
        traj = global_trajectory(i, cfg.vocab_size)
        offset, groups = process_shard(list(range(GROUPS)))
        rows = np.arange(groups[0] * GROUP, (groups[-1] + 1) * GROUP)
        local = jax.tree.map(lambda x: np.asarray(x)[rows], traj)
        batch = batch_from_trajectory(local, group_size=GROUP, model_config=cfg,
                                      seq_len=P_MAX + R_MAX)
        state, metrics = step(state, global_batch(batch, mesh) if multi else batch)
    params = process_local(state.params)
    with Checkpointer(Path(args.out) / "ckpt") as ck:
        ck.save(STEPS, state, {"processes": jax.process_count()})
    if is_main_process():
        leaves = {f"p{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(params))}
        np.savez(Path(args.out) / "params.npz", loss=float(metrics["loss"]), **leaves)
    print(f"process {jax.process_index()}: done, loss {float(metrics['loss']):.6f}", flush=True)


if __name__ == "__main__":
    main()
