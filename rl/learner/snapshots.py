"""`ParamSnapshots`: a bounded ring of parameter pytrees keyed by policy version.

The asynchronous loop keeps the params of the last few versions so that (a) the
deterministic staleness mode can sample step v's batch with exactly the params of
version v − k, and (b) `rl.learner.proximal.exact_proximal_logprobs` can recompute log π at each
token's own behaviour version (the "missing old logits"). It is a read-only `Mapping`
{version: params} for its readers, so it can be passed wherever a mapping is expected.

Stored params are copies (`copy=True`, the default): the learner's jitted step donates
its state, which would otherwise invalidate the arrays held here. Copies stay on the
device the source lives on unless `device` (a `jax.Device` or `jax.sharding.Sharding`)
says where to put them (e.g. the rollout devices). Thread-safe: the learner puts while
the rollout thread reads.

Two stores. In memory (`directory=None`, the default) the ring holds `capacity` pytrees:
capacity × the params' bytes. On disk (`directory=...`) every version put is also
written to directory/v{version}.npz (atomically; `save_params_file`'s format) and memory
holds at most two versions: the newest one put and the last one read back from disk
(`resident()`); reading any other version loads its file, bit for bit (same dtypes,
values, tree and shardings). Evicting a version deletes its file. The disk ring owns its
directory: ring files an earlier process left there are deleted when it opens.

The params file format (`save_params_file` / `load_params_file`): one uncompressed .npz,
streamed leaf by leaf (host memory: one leaf at a time), "leaf_{i}" = leaf i in tree
order and "dtypes" = the leaves' dtype names; a dtype numpy cannot store natively
(ml_dtypes' bfloat16, float8, int4, ...) is stored as its unsigned-int bit pattern and
viewed back on load.
"""
from __future__ import annotations

import os
import shutil
import threading
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl.runtime.logging import atomic_write_stream

Params = Any


@jax.jit
def copy_params(params: Params) -> Params:
    """A copy of every leaf in one compiled program (fresh buffers, so the learner step may
    donate the originals): one launch per version instead of one per leaf."""
    return jax.tree.map(jnp.copy, params)


class ParamSnapshots(Mapping):
    """Keep the params of at most `capacity` versions; putting one more evicts the oldest.

    snaps = ParamSnapshots(capacity=3)                  # in memory
    snaps = ParamSnapshots(capacity=34, directory=d)    # on disk, <= 2 versions in memory
    snaps.put(0, params0); snaps.put(1, params1)
    snaps[1]; snaps.get(1); 0 in snaps; snaps.versions() == [0, 1]
    snaps.oldest, snaps.newest  # 0, 1 (None while empty)
    snaps.evicted               # how many versions the ring has dropped so far
    snaps.resident()            # the versions held in memory (all of them in memory)
    snaps.save(1, path)         # version 1 as a params file (disk: a hard link)
    """

    def __init__(self, capacity: int, *, directory: str | os.PathLike | None = None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ParamSnapshots capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.directory = None if directory is None else Path(directory)
        self._items: dict[int, Params] = {}  # in memory: every version; on disk: <= 2
        self._files: dict[int, _OnDisk] = {}  # on disk: every version held
        self._newest: int | None = None  # on disk: the version put last (resident)
        self._lock = threading.Lock()
        self.evicted = 0
        self._max_evicted: int | None = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for f in self.directory.iterdir():  # an earlier process's ring
                if _is_ring_file(f.name):
                    f.unlink(missing_ok=True)

    # ------------------------------------------------------------------ writing
    def put(self, version: int, params: Params, *, copy: bool = True,
            device: jax.Device | jax.sharding.Sharding | None = None) -> Params:
        """Store `params` as `version` (replacing an entry of the same version) and evict
        the oldest versions past capacity. Returns the stored pytree (the copy). On disk,
        the version's file is written before this returns."""
        version = _check_version(version)
        if device is not None:
            stored = jax.device_put(params, device)  # a transfer is a copy already
            if copy:
                stored = copy_params(stored)
        elif copy:
            stored = copy_params(params)
        else:
            stored = params
        if self.directory is None:
            with self._lock:
                self._items[version] = stored
                self._evict_past_capacity(self._items)
            return stored
        leaves, treedef = jax.tree.flatten(stored)
        path = self.directory / f"v{version}.npz"
        save_params_file(path, leaves)  # outside the lock: readers go on meanwhile
        entry = _OnDisk(path, treedef, tuple(getattr(x, "sharding", None) for x in leaves))
        with self._lock:
            self._files[version] = entry
            self._items.pop(version, None)
            if self._newest is None or version >= self._newest:
                self._newest = version
            if self._newest == version:
                self._items[version] = stored
            self._evict_past_capacity(self._files)
            self._trim_resident()
        return stored

    def clear(self) -> None:
        """Drop every version (on disk: their files too)."""
        with self._lock:
            self._items.clear()
            for entry in self._files.values():
                entry.path.unlink(missing_ok=True)
            self._files.clear()
            self._newest = None

    def save(self, version: int, path: str | os.PathLike) -> bool:
        """Version `version` as a params file at `path` (load_params_file reads it): on
        disk a hard link to the ring's file (a copy where links fail), True; in memory its
        leaves streamed to the file, False."""
        version = _check_version(version)
        path = Path(path)
        with self._lock:  # the file can't be evicted (deleted) while it is linked
            entry = self._files.get(version)
            if entry is not None:
                path.unlink(missing_ok=True)
                try:
                    os.link(entry.path, path)
                except OSError:  # no hard links here: copy
                    with open(entry.path, "rb") as src:
                        atomic_write_stream(path, lambda f: shutil.copyfileobj(src, f, 1 << 24))
                return True
        save_params_file(path, jax.tree.leaves(self[version]))
        return False

    def _evict_past_capacity(self, held: dict) -> None:  # under the lock
        while len(held) > self.capacity:
            old = min(held)
            if held is self._files:
                self._files.pop(old).path.unlink(missing_ok=True)
                if self._newest == old:
                    self._newest = max(self._files, default=None)
            self._items.pop(old, None)
            self.evicted += 1
            self._max_evicted = old if self._max_evicted is None else max(self._max_evicted, old)

    def _trim_resident(self, keep: int | None = None) -> None:  # under the lock
        """On disk: memory keeps the newest version and at most one other: `keep` (the one
        just read; -1: none), else the highest (the next read of the deterministic loop,
        v + 1 - k, is never lower)."""
        others = [v for v in self._items if v != self._newest]
        if others:
            keep = max(others) if keep is None else keep
            for v in others:
                if v != keep:
                    del self._items[v]

    # ------------------------------------------------------------------ reading
    def __getitem__(self, version: int) -> Params:
        version = _check_version(version)
        with self._lock:
            if version in self._items:
                return self._items[version]
            entry = self._files.get(version)
            if entry is not None:  # on disk: open it here, so eviction can't delete it first
                f = open(entry.path, "rb")  # noqa: SIM115  (closed after the load)
                self._trim_resident(keep=-1)  # the cached read goes before this one loads
            else:
                held = sorted(self._files if self.directory is not None else self._items)
                evicted = self._max_evicted is not None and version <= self._max_evicted \
                    and (not held or version < held[0])
        if entry is not None:
            with f:
                leaves = load_params_file(f)
            params = entry.treedef.unflatten(
                [jax.device_put(x, s) for x, s in zip(leaves, entry.shardings)])
            with self._lock:
                if self._files.get(version) is entry:  # still held: the read cache
                    self._items[version] = params
                    self._trim_resident(keep=version)
            return params
        if evicted:
            raise KeyError(f"params of version {version} were evicted from the snapshot ring "
                           f"(capacity {self.capacity}, holds versions {held}); raise the "
                           "snapshot capacity to at least max_staleness + 1")
        raise KeyError(f"no params snapshot of version {version} (the ring holds versions "
                       f"{held}); versions are put by the learner after each update")

    def get(self, version: int, default: Any = None) -> Params:
        """The params of `version`; unlike `self[version]`, `default` when absent."""
        try:
            return self[version]
        except KeyError:
            return default

    def __contains__(self, version: object) -> bool:
        with self._lock:
            return version in (self._items if self.directory is None else self._files)

    def __iter__(self) -> Iterator[int]:
        return iter(self.versions())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items if self.directory is None else self._files)

    def versions(self) -> list[int]:
        """Stored versions, oldest first."""
        with self._lock:
            return sorted(self._items if self.directory is None else self._files)

    def resident(self) -> list[int]:
        """The versions held in memory, oldest first (in memory: all; on disk: <= 2)."""
        with self._lock:
            return sorted(self._items)

    @property
    def oldest(self) -> int | None:
        v = self.versions()
        return v[0] if v else None

    @property
    def newest(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def __repr__(self) -> str:
        where = "" if self.directory is None else f", directory={str(self.directory)!r}"
        return f"ParamSnapshots(capacity={self.capacity}, versions={self.versions()}{where})"


class _OnDisk(NamedTuple):
    path: Path
    treedef: Any
    shardings: tuple


def _is_ring_file(name: str) -> bool:
    """v{N}.npz, or the temp file of one (.v{N}.npz.*.tmp)."""
    stem = name.lstrip(".").split(".npz")[0]
    return name.endswith((".npz", ".tmp")) and stem[:1] == "v" and stem[1:].isdigit()


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"a policy version must be an int >= 0, got {version!r}")
    return int(version)


# ----------------------------------------------------------------------------- files
def save_params_file(path: str | os.PathLike, leaves: list) -> None:
    """`leaves` (arrays; e.g. jax.tree.leaves(params)) as one uncompressed .npz at `path`,
    written atomically and streamed one leaf at a time (module doc: the format)."""
    def write(f: BinaryIO) -> None:
        names = []
        with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED,
                             allowZip64=True) as zf:
            for i, leaf in enumerate(leaves):
                arr = np.asarray(jax.device_get(leaf))
                names.append(arr.dtype.name)
                if not _numpy_native(arr.dtype):
                    arr = arr.view(f"u{arr.dtype.itemsize}")
                _write_member(zf, f"leaf_{i}", arr)
            _write_member(zf, "dtypes", np.asarray(names, dtype=np.str_))
    atomic_write_stream(path, write)


def load_params_file(file: str | os.PathLike | BinaryIO) -> list[np.ndarray]:
    """The leaves `save_params_file` wrote, in tree order, with their own dtypes."""
    with np.load(file, allow_pickle=False) as data:
        names = data["dtypes"].tolist()
        out = []
        for i, name in enumerate(names):
            arr = data[f"leaf_{i}"]
            dtype = jnp.dtype(name)
            out.append(arr if arr.dtype == dtype else arr.view(dtype))
    return out


def _numpy_native(dtype: np.dtype) -> bool:
    """Whether an .npy header round-trips `dtype` (not so for ml_dtypes' types)."""
    fmt = np.lib.format
    return fmt.descr_to_dtype(fmt.dtype_to_descr(dtype)) == dtype


def _write_member(zf: zipfile.ZipFile, name: str, arr: np.ndarray) -> None:
    with zf.open(name + ".npy", "w", force_zip64=True) as fid:
        np.lib.format.write_array(fid, np.asarray(arr), allow_pickle=False)
