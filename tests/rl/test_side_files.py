"""rl.loops.side_files' param ring beside a checkpoint: one params file per version under
snapshots/STEP/ (streamed one version at a time from a memory ring, hard links from a disk
ring: nothing written), read back bit for bit; the layout before (snapshots/STEP.npz, all
versions in one npz) still loads; a missing one is a CheckpointError naming both layouts;
an interrupted save leaves no STEP folder; pruning removes both layouts and unfinished
folders, never the disk ring's."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.learner import ParamSnapshots
from rl.learner import snapshots as snapshots_module
from rl.loops import side_files
from rl.loops.side_files import iter_snapshots, load_snapshots, prune_side_files, save_snapshots
from rl.runtime.checkpoint import CheckpointError


def tree(x):
    return {"w": jnp.full((2, 3), float(x)) / 7, "b": (jnp.arange(3.0) + x).astype(jnp.bfloat16)}


def same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def count_writes(monkeypatch):
    """The leaves of each params file written (through rl.learner.snapshots)."""
    calls = []
    write = snapshots_module.save_params_file

    def spy(path, leaves):
        calls.append(len(leaves))
        return write(path, leaves)

    monkeypatch.setattr(snapshots_module, "save_params_file", spy)
    return calls


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_save_writes_one_file_per_version_and_loads_exactly(tmp_path, monkeypatch, store):
    ring = tmp_path / "snapshots" / "ring"
    snaps = ParamSnapshots(4, directory=None if store == "memory" else ring)
    for v in range(6):
        snaps.put(v, tree(v))
    calls = count_writes(monkeypatch)
    save_snapshots(tmp_path, 6, snaps, [3, 4, 5])
    folder = tmp_path / "snapshots" / "6"
    assert sorted(os.listdir(folder)) == ["v3.npz", "v4.npz", "v5.npz"]
    if store == "memory":  # streamed: one version's leaves per file, never the ring at once
        assert calls == [2, 2, 2]
    else:  # hard links to the ring's own files: nothing written
        assert calls == []
        for v in (3, 4, 5):
            assert os.stat(folder / f"v{v}.npz").st_ino == \
                os.stat(tmp_path / "snapshots" / "ring" / f"v{v}.npz").st_ino
    got = list(iter_snapshots(tmp_path, 6, tree(0)))
    assert [v for v, _ in got] == [3, 4, 5]
    for v, params in got:
        same(params, tree(v))
    assert sorted(load_snapshots(tmp_path, 6, tree(0))) == [3, 4, 5]
    assert not [f for f in os.listdir(tmp_path / "snapshots") if f.startswith(".")]


def test_the_layout_before_still_loads(tmp_path):
    leaves = {f"v{v}_{i}": np.asarray(x)
              for v in (1, 2) for i, x in enumerate(jax.tree.leaves(tree(v)))}
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots" / "4.npz").write_bytes(
        side_files.npz_bytes({"versions": np.asarray([1, 2], np.int64), **leaves}))
    got = load_snapshots(tmp_path, 4, tree(0))
    assert sorted(got) == [1, 2]
    for v in (1, 2):
        same(got[v], tree(v))


def test_missing_or_foreign_snapshots_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError,
                       match=r"snapshots/3'? \(or .*snapshots/3\.npz'?\).* missing"):
        list(iter_snapshots(tmp_path, 3, tree(0)))
    snaps = ParamSnapshots(2)
    snaps.put(0, {"w": jnp.zeros((5,))})
    save_snapshots(tmp_path, 1, snaps, [0])
    with pytest.raises(CheckpointError, match="another model"):
        list(iter_snapshots(tmp_path, 1, tree(0)))


def test_an_interrupted_save_leaves_no_step_folder(tmp_path, monkeypatch):
    snaps = ParamSnapshots(3)
    for v in range(3):
        snaps.put(v, tree(v))
    write = snapshots_module.save_params_file
    calls = []

    def full_disk(path, leaves):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return write(path, leaves)

    monkeypatch.setattr(snapshots_module, "save_params_file", full_disk)
    with pytest.raises(OSError) as info:
        save_snapshots(tmp_path, 2, snaps, [0, 1, 2])
    assert info.value.filename == str(tmp_path / "snapshots" / "2" / "v1.npz")
    assert os.listdir(tmp_path / "snapshots") == []


class Steps:
    def __init__(self, steps):
        self._steps = steps

    def all_steps(self):
        return self._steps


def test_prune_removes_both_layouts_and_unfinished_folders(tmp_path):
    snaps = ParamSnapshots(2, directory=tmp_path / "snapshots" / "ring")
    snaps.put(0, tree(0))
    for step in (1, 2, 3):
        save_snapshots(tmp_path, step, snaps, [0])
    (tmp_path / "snapshots" / "0.npz").write_bytes(b"old layout")
    (tmp_path / "snapshots" / ".1.tmp").mkdir()
    (tmp_path / "rollout_state").mkdir()
    (tmp_path / "rollout_state" / "1.npz").write_bytes(b"april")
    (tmp_path / "rollout_state" / "3.npz").write_bytes(b"april")
    prune_side_files(tmp_path, Steps([3]))
    assert sorted(os.listdir(tmp_path / "snapshots")) == ["3", "ring"]
    assert os.listdir(tmp_path / "rollout_state") == ["3.npz"]
    assert os.listdir(tmp_path / "snapshots" / "ring") == ["v0.npz"]
