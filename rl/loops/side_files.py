"""The files the asynchronous loop writes beside each checkpoint, so that a resume finds
what the orbax checkpoint does not hold:

    run_dir/snapshots/STEP.npz      the param ring's versions max(v - η, 0) .. v at the
                                    save (deterministic mode): "versions" [n] int64 and
                                    "v{version}_{i}", leaf i of that version's params in
                                    tree order
    run_dir/rollout_state/STEP.npz  APRIL's state between rounds (its FIFO of unfinished
                                    groups, counters, "base" data position), the nested
                                    dict flattened to "a/b/c" keys

Each is written atomically (rl.runtime.logging.atomic_write_bytes); a resume that misses one
raises CheckpointError; `prune_side_files` deletes those of steps orbax no longer keeps.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.learner.snapshots import ParamSnapshots
from rl.loops.producer import flatten_arrays, unflatten_arrays
from rl.runtime.checkpoint import CheckpointError
from rl.runtime.logging import atomic_write_bytes

SIDE_FOLDERS = ("snapshots", "rollout_state")


def save_snapshots(run_dir: Path, step: int, snaps: ParamSnapshots, versions: list[int]) -> None:
    """The ring's params of `versions` as run_dir/snapshots/STEP.npz."""
    arrays = {}
    for v in versions:
        for i, leaf in enumerate(jax.tree.leaves(snaps[v])):
            arrays[f"v{v}_{i}"] = np.asarray(jax.device_get(leaf))
    atomic_write_bytes(run_dir / "snapshots" / f"{step}.npz",
                       npz_bytes({"versions": np.asarray(versions, np.int64), **arrays}))


def load_snapshots(run_dir: Path, step: int, template: Any) -> dict[int, Any]:
    """{version: params} from run_dir/snapshots/STEP.npz, leaves cast to `template`'s dtypes."""
    data = load_npz(run_dir / "snapshots" / f"{step}.npz")
    leaves, treedef = jax.tree.flatten(template)
    out = {}
    for v in data["versions"].tolist():
        out[int(v)] = jax.tree.unflatten(
            treedef, [jnp.asarray(data[f"v{v}_{i}"], dtype=leaf.dtype) for i, leaf in enumerate(leaves)])
    return out


def save_rollout_state(run_dir: Path, step: int, state: dict) -> None:
    """A nested dict of arrays (APRIL's state) as run_dir/rollout_state/STEP.npz."""
    atomic_write_bytes(run_dir / "rollout_state" / f"{step}.npz", npz_bytes(flatten_arrays(state)))


def load_rollout_state(run_dir: Path, step: int) -> dict:
    """The nested dict `save_rollout_state` wrote for `step`."""
    return unflatten_arrays(load_npz(run_dir / "rollout_state" / f"{step}.npz"))


def prune_side_files(run_dir: Path, ckpt) -> None:
    """Delete side files of checkpoints orbax no longer keeps (steps before its oldest)."""
    steps = ckpt.all_steps()
    if not steps:
        return
    for name in SIDE_FOLDERS:
        folder = run_dir / name
        for f in folder.glob("*.npz") if folder.is_dir() else ():
            if f.stem.isdigit() and int(f.stem) < steps[0]:
                f.unlink(missing_ok=True)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """The bytes of an uncompressed .npz holding `arrays`."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def load_npz(path: Path):
    """np.load(path); CheckpointError naming the file if it is missing."""
    if not path.exists():
        raise CheckpointError(f"cannot resume the async run: {str(path)!r}, written beside the "
                              "checkpoint, is missing")
    return np.load(path)
