"""The files the asynchronous loop writes beside each checkpoint, so that a resume finds
what the orbax checkpoint does not hold:

    run_dir/snapshots/STEP/v{V}.npz  the param ring's versions V = max(v - η, 0) .. v at
                                     the save (deterministic mode), one params file per
                                     version (rl.learner.snapshots.save_params_file: its
                                     leaves in tree order, bit-exact dtypes); with the disk
                                     ring (AsyncConfig.snapshot_store="disk") hard links to
                                     the ring's own files under run_dir/snapshots/ring/, so a
                                     save writes nothing; in memory each version is streamed
                                     to its file, one leaf at a time
    run_dir/rollout_state/STEP.npz   APRIL's state between rounds (its FIFO of unfinished
                                     groups, counters, "base" data position), the nested
                                     dict flattened to "a/b/c" keys

Each file is written atomically (rl.runtime.logging); a STEP folder is filled as .STEP.tmp
and renamed when complete. The layout before (run_dir/snapshots/STEP.npz, all versions in
one npz: "versions" [n] int64 and "v{version}_{i}", leaf i of that version) still loads. A
resume that misses a side file raises CheckpointError; `prune_side_files` deletes those of
steps orbax no longer keeps (files and STEP folders; the ring's folder is the disk ring's).
"""
from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.learner.snapshots import ParamSnapshots, load_params_file
from rl.runtime.checkpoint import CheckpointError
from rl.runtime.logging import atomic_write_bytes

SIDE_FOLDERS = ("snapshots", "rollout_state")


def flatten_arrays(d: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_arrays(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v)
    return out


def unflatten_arrays(flat: Any) -> dict:
    out: dict = {}
    for key in flat.keys():
        node = out
        *path, leaf = key.split("/")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = np.asarray(flat[key])
    return out


def save_snapshots(run_dir: Path, step: int, snaps: ParamSnapshots, versions: list[int]) -> None:
    """The ring's params of `versions` as run_dir/snapshots/STEP/v{version}.npz (module
    doc): hard links to a disk ring's files, else streamed one version at a time. An
    OSError names the file of the final folder."""
    folder = run_dir / "snapshots"
    final, tmp = folder / str(step), folder / f".{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a save interrupted before
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        for v in versions:
            name = f"v{v}.npz"
            try:
                snaps.save(v, tmp / name)
            except OSError as err:
                raise OSError(err.errno, err.strerror, str(final / name)) from err
        if final.exists():  # the same step saved before (an earlier, interrupted run)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def iter_snapshots(run_dir: Path, step: int, template: Any) -> Iterator[tuple[int, Any]]:
    """(version, params) saved for `step`, oldest first, one version read at a time; leaves
    as jax arrays of `template`'s dtypes (CheckpointError if the tree does not match, or
    if neither layout is there)."""
    folder = run_dir / "snapshots"
    leaves, treedef = jax.tree.flatten(template)
    if (folder / str(step)).is_dir():
        files = {int(f.name[1:-4]): f for f in (folder / str(step)).glob("v*.npz")
                 if f.name[1:-4].isdigit()}
        for v in sorted(files):
            got = load_params_file(files[v])
            shapes = [np.shape(x) for x in got]
            if shapes != [np.shape(x) for x in leaves]:
                raise CheckpointError(
                    f"cannot resume the async run: {str(files[v])!r} holds {len(got)} leaves of "
                    f"shapes {shapes[:4]}..., not the params' {len(leaves)}: the snapshots "
                    "belong to another model")
            yield v, jax.tree.unflatten(treedef, [jnp.asarray(x, dtype=leaf.dtype)
                                                  for x, leaf in zip(got, leaves)])
        return
    data = load_npz(folder / f"{step}.npz", also=folder / str(step))  # the layout before
    for v in data["versions"].tolist():
        yield int(v), jax.tree.unflatten(
            treedef, [jnp.asarray(raw_leaf(data[f"v{v}_{i}"], leaf.dtype), dtype=leaf.dtype)
                      for i, leaf in enumerate(leaves)])


def raw_leaf(arr: np.ndarray, dtype: Any) -> np.ndarray:
    """A leaf of the layout before: numpy stored ml_dtypes' types (bfloat16, ...) as raw
    bytes ("V2"); view those as `dtype`."""
    return arr.view(dtype) if arr.dtype.kind == "V" and arr.dtype.itemsize == \
        np.dtype(dtype).itemsize else arr


def load_snapshots(run_dir: Path, step: int, template: Any) -> dict[int, Any]:
    """{version: params} of iter_snapshots (every version in memory at once)."""
    return dict(iter_snapshots(run_dir, step, template))


def save_rollout_state(run_dir: Path, step: int, state: dict) -> None:
    """A nested dict of arrays (APRIL's state) as run_dir/rollout_state/STEP.npz."""
    atomic_write_bytes(run_dir / "rollout_state" / f"{step}.npz", npz_bytes(flatten_arrays(state)))


def load_rollout_state(run_dir: Path, step: int) -> dict:
    """The nested dict `save_rollout_state` wrote for `step`."""
    return unflatten_arrays(load_npz(run_dir / "rollout_state" / f"{step}.npz"))


def prune_side_files(run_dir: Path, ckpt) -> None:
    """Delete side files of checkpoints orbax no longer keeps (steps before its oldest):
    STEP.npz files, STEP folders and unfinished .STEP.tmp folders."""
    steps = ckpt.all_steps()
    if not steps:
        return
    for name in SIDE_FOLDERS:
        folder = run_dir / name
        for f in folder.iterdir() if folder.is_dir() else ():
            step = f.name.removesuffix(".npz") if f.is_file() else \
                f.name.removeprefix(".").removesuffix(".tmp")
            if not (step.isdigit() and int(step) < steps[0]):
                continue
            if f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """The bytes of an uncompressed .npz holding `arrays`."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def load_npz(path: Path, also: Path | None = None):
    """np.load(path); CheckpointError naming the file (or `also`, the newer layout's
    path, too) if it is missing."""
    if not path.exists():
        what = repr(str(path)) if also is None else f"{str(also)!r} (or {str(path)!r})"
        raise CheckpointError(f"cannot resume the async run: {what}, written beside the "
                              "checkpoint, is missing")
    return np.load(path)
