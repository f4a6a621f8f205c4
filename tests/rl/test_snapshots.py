"""ParamSnapshots: a bounded ring keyed by version — eviction order, clear errors for
evicted / unknown versions, copies that survive the source being deleted (the learner
donates its state), the Mapping interface rl.learner.proximal reads. The disk store:
the same ring with every version a file and at most two in memory, read back bit for bit
(bfloat16 and int leaves included), eviction deleting the file, an earlier process's
files cleared; the params file format against numpy's own npz reader."""
import os
import threading
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.learner import ParamSnapshots
from rl.learner.snapshots import load_params_file, save_params_file


def tree(x):
    return {"w": jnp.full((2, 3), float(x)), "b": jnp.arange(3.0) + x}


def test_ring_evicts_the_oldest_and_errors_clearly():
    snaps = ParamSnapshots(capacity=3)
    assert snaps.oldest is None and snaps.newest is None and len(snaps) == 0
    for v in range(5):
        snaps.put(v, tree(v))
    # Hand-worked: capacity 3 after putting 0..4 keeps 2, 3, 4; 0 and 1 were evicted.
    assert snaps.versions() == [2, 3, 4] and list(snaps) == [2, 3, 4]
    assert (snaps.oldest, snaps.newest, snaps.evicted, len(snaps)) == (2, 4, 2, 3)
    assert 3 in snaps and 1 not in snaps
    np.testing.assert_array_equal(snaps[3]["w"], np.full((2, 3), 3.0))
    with pytest.raises(KeyError, match="version 1 were evicted"):
        snaps[1]
    with pytest.raises(KeyError, match="no params snapshot of version 9"):
        snaps[9]
    assert snaps.get(0) is None and snaps.get(0, "x") == "x"
    assert isinstance(snaps, Mapping) and sorted(dict(snaps)) == [2, 3, 4]
    # Re-putting a held version replaces it without evicting anything.
    snaps.put(3, tree(30))
    assert snaps.versions() == [2, 3, 4] and float(snaps[3]["b"][0]) == 30.0


def test_put_copies_so_a_donated_source_does_not_matter():
    src = tree(1)
    snaps = ParamSnapshots(capacity=2)
    stored = snaps.put(7, src)
    for leaf in jax.tree.leaves(src):
        leaf.delete()  # what donation does to the learner's old params
    assert stored is snaps[7]
    np.testing.assert_array_equal(np.asarray(snaps[7]["b"]), [1.0, 2.0, 3.0])
    kept = tree(2)
    assert snaps.put(8, kept, copy=False) is kept  # no copy when asked


def test_put_onto_a_device():
    dev = jax.devices()[-1]
    stored = ParamSnapshots(capacity=1).put(0, tree(0), device=dev)
    assert all(leaf.devices() == {dev} for leaf in jax.tree.leaves(stored))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_capacity(bad):
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        ParamSnapshots(bad)


@pytest.mark.parametrize("bad", [-1, 1.0, "3", True])
def test_bad_version(bad):
    with pytest.raises(ValueError, match="policy version must be an int >= 0"):
        ParamSnapshots(2).put(bad, tree(0))


def mixed(x):
    """A tree with every kind of leaf the ring may hold: fp32, bf16, int, 0-d."""
    return {"w": jnp.full((2, 3), float(x)) / 7, "b": (jnp.arange(3.0) + x).astype(jnp.bfloat16),
            "n": jnp.int32(x), "s": {"t": jnp.float32(x) / 3}}


def same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def ring_files(folder):
    return sorted(f for f in os.listdir(folder))


def test_disk_ring_is_the_memory_ring_with_two_versions_in_memory(tmp_path):
    mem, disk = ParamSnapshots(4), ParamSnapshots(4, directory=tmp_path / "ring")
    assert disk.directory == tmp_path / "ring" and mem.directory is None
    for v in range(9):
        mem.put(v, mixed(v))
        disk.put(v, mixed(v))
        # every version held has its file, and only those: eviction deleted the rest
        assert ring_files(tmp_path / "ring") == sorted(f"v{u}.npz" for u in disk.versions())
        assert len(disk.resident()) <= 2 and disk.newest in disk.resident()
        for u in disk.versions()[::-1]:  # reads from disk, bit for bit
            same(disk[u], mixed(u))
            assert len(disk.resident()) <= 2
    assert mem.versions() == disk.versions() == [5, 6, 7, 8] and mem.resident() == [5, 6, 7, 8]
    assert (disk.oldest, disk.newest, disk.evicted, len(disk)) == (5, 8, 5, 4)
    assert 6 in disk and 4 not in disk and sorted(dict(disk)) == [5, 6, 7, 8]
    with pytest.raises(KeyError, match="version 4 were evicted"):
        disk[4]
    with pytest.raises(KeyError, match="no params snapshot of version 9"):
        disk[9]
    disk.put(6, mixed(60))  # replacing a held version replaces its file
    same(disk[6], mixed(60))
    assert disk.versions() == [5, 6, 7, 8]
    disk.clear()
    assert len(disk) == 0 and ring_files(tmp_path / "ring") == []


def test_disk_ring_reads_survive_the_source_and_keep_the_device(tmp_path):
    dev = jax.devices()[-1]
    disk = ParamSnapshots(3, directory=tmp_path)
    src = mixed(1)
    disk.put(1, src, device=dev)
    disk.put(2, mixed(2))
    for leaf in jax.tree.leaves(src):
        leaf.delete()  # donated
    got = disk[1]  # loaded from its file
    same(got, mixed(1))
    assert all(leaf.devices() == {dev} for leaf in jax.tree.leaves(got))
    assert disk[1] is got  # the read cache: no second load


def test_disk_ring_clears_an_earlier_process_files(tmp_path):
    (tmp_path / "v3.npz").write_bytes(b"old")
    (tmp_path / ".v4.npz.abc.tmp").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("kept")
    ParamSnapshots(2, directory=tmp_path)
    assert ring_files(tmp_path) == ["notes.txt"]


def test_disk_ring_threads_read_while_it_is_put(tmp_path):
    disk = ParamSnapshots(3, directory=tmp_path)
    disk.put(0, mixed(0))
    errors = []

    def read():
        for _ in range(30):
            for v in disk.versions():
                try:
                    same(disk[v], mixed(v))
                except KeyError:  # evicted between versions() and the read
                    pass
                except Exception as err:  # noqa: BLE001
                    errors.append(err)

    t = threading.Thread(target=read)
    t.start()
    for v in range(1, 12):
        disk.put(v, mixed(v))
    t.join()
    assert not errors and len(disk.resident()) <= 2


def test_save_links_on_disk_and_writes_in_memory(tmp_path):
    disk = ParamSnapshots(2, directory=tmp_path / "ring")
    mem = ParamSnapshots(2)
    for snaps in (disk, mem):
        snaps.put(3, mixed(3))
    assert disk.save(3, tmp_path / "d.npz") is True
    assert os.stat(tmp_path / "d.npz").st_ino == os.stat(tmp_path / "ring" / "v3.npz").st_ino
    assert mem.save(3, tmp_path / "m.npz") is False
    for name in ("d.npz", "m.npz"):
        same(jax.tree.unflatten(jax.tree.structure(mixed(0)), load_params_file(tmp_path / name)),
             mixed(3))
    disk.put(4, mixed(4)); disk.put(5, mixed(5))  # v3 evicted: its ring name is gone,
    assert not (tmp_path / "ring" / "v3.npz").exists()
    same(jax.tree.unflatten(jax.tree.structure(mixed(0)), load_params_file(tmp_path / "d.npz")),
         mixed(3))  # the link still holds it


def test_params_file_is_an_npz_numpy_reads(tmp_path):
    leaves = jax.tree.leaves(mixed(2))
    save_params_file(tmp_path / "p.npz", leaves)
    data = np.load(tmp_path / "p.npz")  # an ordinary npz: leaf_i + dtypes
    assert data["dtypes"].tolist() == [str(x.dtype) for x in leaves]
    bf16 = [i for i, x in enumerate(leaves) if x.dtype == jnp.bfloat16]
    assert bf16 and data[f"leaf_{bf16[0]}"].dtype == np.uint16  # its bit pattern
    assert not [f for f in os.listdir(tmp_path) if f != "p.npz"]  # no temp file left
