"""Checkpoints of a training run: an orbax CheckpointManager holding the TrainState
(params, opt_state, step, version, rng) plus a small JSON record (data position, step,
anything the loop needs to continue exactly).

Saves are asynchronous (the step loop goes on while orbax writes) and atomic (orbax
writes into a temporary directory and renames it when complete), and only the last
`keep` checkpoints are kept. Restoring needs a template state with the same tree
(e.g. a freshly initialised one); a missing, incomplete or corrupted checkpoint raises
`CheckpointError` saying what is wrong and where.

Meshes and processes: orbax stores each array whole (not per device), so a checkpoint
written under one mesh restores onto any other. The restored arrays take the template's
shardings, or `shardings=` (e.g. `rl.learner.state_shardings(model, train, new_mesh)`,
with `rl.learner.abstract_train_state` as a template that allocates nothing). In a
multi-process run every process calls save / restore with the same arguments and orbax
coordinates them (each writes or reads the shards it holds).

Integrity: orbax notices a truncated or missing file, but not a flipped bit inside
array data (it restores the damaged values). So every save also records, inside its
JSON item (written atomically with the arrays), the xxh3-128 checksum, dtype and shape
of each state leaf's bytes, plus a checksum of the JSON record itself; restore
recomputes them and raises CheckpointError naming the checkpoint and the leaf's tree
path (e.g. `params/layers/attn/q/kernel`). Hashing reads the host bytes synchronously in
save(), before orbax copies the state: on a SmolLM2-135M TrainState (1.6 GB) save()
blocks ~80 ms longer (xxh3 at ~23 GB/s on one CPU core; on an accelerator add one more
device-to-host copy), see experiments/bench/checkpoint_checksums.py. Checkpoints written
before checksums existed restore with a CheckpointWarning (they cannot be verified;
refusing them would strand older runs).
In a multi-process run a leaf no process holds whole is gathered one leaf at a time
(a collective: every process hashes the same bytes; replicated leaves are read from
the local copy), so each process needs host memory for the largest leaf.
`restore(template, fallback=True)` skips damaged latest checkpoints (each with a
CheckpointWarning saying why), restores the newest good one and renames the skipped
step directories to `<step>.damaged` so the resumed run can write those steps again.

Failures while writing: a save that cannot be written (disk full, permission denied,
read-only file system, quota) raises `rl.runtime.storage.StorageError`, one line naming
the checkpoint, the directory, the cause and the last good checkpoint, whether it fails
at once in save() or later in orbax's writer thread (then from the next save(), wait(),
poll() or close(): poll() is the loops' non-blocking check after every step, so a
failed background write stops the run within one step). Any other failure of the writer
is a CheckpointError saying which step could not be written. Orbax's own logged
tracebacks of those failures are kept out of the log while the Checkpointer is open
(rl.runtime.storage.OrbaxErrorLog). A failed save leaves the earlier checkpoints intact
(orbax writes into `<step>.orbax-checkpoint-tmp` and renames only a complete one); with
cleanup_tmp=True (the loops, which hold the run lock) such leftovers of a failed or killed
save are deleted when the Checkpointer opens (`remove_unfinished_saves`: retried while late
writes of a failed save still land). Before each save, `free_space_warning` warns
(StorageWarning) when the disk has room for fewer than two more checkpoints the size of
the last one.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import xxhash
from jax.experimental import multihost_utils

from rl.runtime.mesh import with_shardings
from rl.runtime.storage import (
    OrbaxErrorLog,
    StorageError,
    StorageWarning,
    free_space_warning,
    quiet_orbax_echoes,
    tree_bytes,
)

# Orbax logs every save at INFO; a training loop's progress bar is the better place.
logging.getLogger("absl").setLevel(logging.WARNING)
# Orbax also logs each failure of its writer threads with a traceback, from several threads
# (some still running after the save was reported failed); the Checkpointer raises those
# failures as one exception, so their tracebacks stay out of the log (module doc).
ORBAX_ERRORS = OrbaxErrorLog()
logging.getLogger("absl").addFilter(ORBAX_ERRORS)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not match the state."""


class CheckpointWarning(UserWarning):
    """A checkpoint restored without verification, or skipped in favour of an older one."""


CHECKSUM_KEY = "_checksums"  # reserved key of the JSON record
FALLBACK_HINT = ("pass --resume-from-last-good (experiments.train) or resume_from_last_good=True "
                 "(rl.loops.run / run_async; Checkpointer.restore(fallback=True))")


def leaf_bytes(x: Any) -> np.ndarray:
    """The full value of one state leaf as contiguous host numpy. A jax.Array that spans
    processes is read from the local replica when fully replicated, else gathered (a
    collective: every process must call this for the same leaves in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:
            x = x.addressable_data(0)
        else:
            x = multihost_utils.process_allgather(x, tiled=True)
    return np.ascontiguousarray(np.asarray(x))


def leaf_checksum(x: Any) -> list:
    """[dtype name, shape, xxh3-128 hex digest of the native-order bytes] of one leaf."""
    a = leaf_bytes(x)
    digest = xxhash.xxh3_128_hexdigest(memoryview(a.reshape(-1).view(np.uint8)))
    return [str(a.dtype), list(a.shape), digest]


def state_checksums(state: Any) -> dict[str, list]:
    """{tree path "params/layers/attn/q/kernel": leaf_checksum} of every leaf of `state`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf_checksum(x)
            for path, x in flat}


def record_checksum(record: dict) -> str:
    """xxh3-128 of the canonical JSON text of `record` (sorted keys, no spaces)."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return xxhash.xxh3_128_hexdigest(text.encode())


def remove_unfinished_saves(directory: Path, patience_s: float = 10.0) -> None:
    """Delete `<step>.orbax-checkpoint-tmp*` folders under `directory` (unfinished saves).
    A save of this process that failed can still have writes in flight on orbax's threads
    (a full disk fails one file, the others go on), so a folder that fills again while it
    is being deleted ("Directory not empty") is retried until `patience_s` has passed."""
    if not directory.is_dir():
        return
    for tmp in directory.glob("*.orbax-checkpoint-tmp*"):
        deadline = time.monotonic() + patience_s
        while True:
            try:
                shutil.rmtree(tmp)
                break
            except FileNotFoundError:
                break
            except OSError as err:
                if err.errno != errno.ENOTEMPTY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


class Checkpointer:
    """Keep the last `keep` checkpoints of a run under `directory` (created if needed).

    save(step, state, meta) starts an async save (returns at once); wait() blocks until
    pending saves are on disk; restore(template, step=None) -> (state, meta) reads the
    latest (or given) step; close() waits and releases the manager, and then `lock` (a
    held rl.runtime.runlock.RunLock, or anything with release(): the loops pass their run
    dir's, so it is given back whenever the checkpointer is closed).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, async_save: bool = True,
                 lock: Any = None, cleanup_tmp: bool = False):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            if lock is not None:
                lock.release()
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self._lock = lock
        self.directory = Path(directory).absolute()
        self._pending: int | None = None  # the step of the save orbax may still be writing
        self._failed = False  # a save failed (what closing orbax then says is its echo)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=cleanup_tmp)
        if cleanup_tmp and jax.process_index() == 0:
            remove_unfinished_saves(self.directory)
        ORBAX_ERRORS.take()
        quiet_orbax_echoes()  # a failed save's leftover writes fail noisily (storage doc)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options,
                                                  item_names=("state", "meta"))
        except BaseException as err:
            if lock is not None:
                lock.release()
            failure = StorageError.of(err, what="checkpoints", path=self.directory)
            if failure is not None:
                raise failure from None
            raise

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> None:
        """Start saving `state` and the JSON-serialisable `meta` as checkpoint `step`."""
        meta = dict(meta or {})
        if CHECKSUM_KEY in meta:
            raise ValueError(f"meta key {CHECKSUM_KEY!r} is reserved for the checksums; rename it")
        meta.setdefault("step", int(step))
        meta[CHECKSUM_KEY] = {"algorithm": "xxh3_128", "arrays": state_checksums(state)}
        meta[CHECKSUM_KEY]["record"] = record_checksum(meta)
        self.wait()  # the previous save's failure surfaces here, before this one starts
        self._check_free_space(state)
        try:
            self._manager.save(int(step), args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as err:
            raise self._write_error(err, int(step)) from err
        self._pending = int(step)

    def wait(self) -> None:
        """Block until every started save is complete on disk. StorageError (or
        CheckpointError) if the last one failed (module doc)."""
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._write_error(err, step) from err
        if step is not None and step not in self._manager.all_steps():
            logged = ORBAX_ERRORS.take()  # an error orbax logged without raising it
            why = logged[-1] if logged else "orbax did not finalize it"
            raise self._write_error(RuntimeError(why), step) from None

    def poll(self) -> None:
        """Without blocking: raise the failure of a background save that has finished
        (as wait() would); nothing while it is still writing or when it succeeded."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self.wait()

    def last_good(self, exclude: int | None = None) -> tuple[int, Path] | None:
        """(step, directory) of the newest checkpoint written completely (not `exclude`),
        or None."""
        done = [s for s in self._manager.all_steps() if s not in (self._pending, exclude)]
        if not done:
            return None
        step = max(done)
        return step, self.directory / str(step)

    def _write_error(self, err: BaseException, step: int | None) -> Exception:
        """StorageError (a storage cause) or CheckpointError for a save that failed."""
        what = "checkpoint" if step is None else f"checkpoint step {step}"
        self._pending, self._failed = None, True
        good = self.last_good(exclude=step)
        failure = StorageError.of(err, what=what, path=self.directory, last_good=good)
        if failure is not None:
            return failure
        if isinstance(err, CheckpointError):
            return err
        then = (f"the last good checkpoint is step {good[0]}" if good is not None
                else "no checkpoint was written before it")
        return CheckpointError(f"{what} could not be written to {str(self.directory)!r} "
                               f"({type(err).__name__}: {str(err)[:300]}); {then}")

    def _check_free_space(self, state: Any) -> None:
        """Warn (StorageWarning) when the disk has room for fewer than two more checkpoints
        the size of the last one on disk (else of this state's array bytes)."""
        good = self.last_good()
        need = tree_bytes(good[1]) if good is not None else 0
        if need == 0:
            need = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
        message = free_space_warning(self.directory, need)
        if message is not None:
            warnings.warn(message, StorageWarning, stacklevel=3)

    # ------------------------------------------------------------------ restore
    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, template: Any, step: int | None = None, *, shardings: Any = None,
                fallback: bool = False) -> tuple[Any, dict]:
        """(state, meta) of checkpoint `step` (default: the latest). `template` gives the
        tree, shapes and dtypes (arrays or jax.ShapeDtypeStruct), and the shardings to
        restore into unless `shardings` is given: a tree like the template's of
        jax.sharding.Sharding (e.g. rl.learner.state_shardings(..., mesh)) or one
        Sharding for every array. Any mesh works, whatever mesh wrote the checkpoint.
        Every leaf and the JSON record are checked against the checksums saved with them.
        fallback=True (latest only): a damaged checkpoint is skipped for the next older
        one (module doc); without it the error says how to fall back."""
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint found in {str(self.directory)!r}; nothing to resume from "
                "(run without --resume first, or point --run-dir at an existing run)")
        if step is not None and fallback:
            raise ValueError("restore: fallback=True picks among the kept checkpoints; "
                             "give step=None with it, or no fallback with an explicit step")
        if step is not None and step not in steps:
            raise CheckpointError(f"checkpoint step {step} not found in {str(self.directory)!r}; "
                                  f"available steps: {steps}")
        if shardings is None:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        else:
            try:
                abstract = with_shardings(template, shardings)
            except ValueError as err:  # tree structures differ
                raise ValueError("restore: `shardings` must be one jax.sharding.Sharding or a "
                                 f"tree shaped like the template ({err})") from err
        if step is not None:
            return self._restore_step(abstract, step)
        skipped: list[int] = []
        for s in reversed(steps):
            try:
                out = self._restore_step(abstract, s)
            except CheckpointError as err:
                older = [x for x in steps if x < s]
                if not fallback:
                    hint = (f"; to resume from the previous checkpoint (step {older[-1]}) "
                            f"{FALLBACK_HINT}" if older else "; no older checkpoint is kept")
                    raise CheckpointError(f"{err}{hint}") from err
                where = f"falling back to step {older[-1]}" if older else "no older one is kept"
                warnings.warn(f"skipping checkpoint step {s} ({where}): {err}", CheckpointWarning,
                              stacklevel=2)
                skipped.append(s)
                continue
            self._set_aside(skipped)
            return out
        raise CheckpointError(f"no intact checkpoint in {str(self.directory)!r}: steps {steps} "
                              "all failed verification (see the warnings above); start afresh")

    def _restore_step(self, abstract: Any, step: int) -> tuple[Any, dict]:
        """Restore one step into `abstract` and verify it against its checksums."""
        where = f"checkpoint step {step} in {str(self.directory / str(step))!r}"
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as err:  # orbax raises many types for damaged files
            raise CheckpointError(
                f"{where} is corrupted, incomplete or does not match this run's "
                f"model/optimizer ({type(err).__name__}: {str(err)[:300]})") from err
        state, meta = out["state"], out["meta"]
        if not isinstance(meta, dict) or meta.get("step") != step:
            said = meta.get("step") if isinstance(meta, dict) else meta
            raise CheckpointError(f"{where} is inconsistent: its metadata says step {said!r}")
        meta = dict(meta)
        sums = meta.pop(CHECKSUM_KEY, None)
        if sums is None:
            warnings.warn(f"{where} was written without checksums (an older version of this "
                          "library): restored without verifying its data", CheckpointWarning,
                          stacklevel=3)
        else:
            verify(where, state, meta, sums)
        return state, meta

    def _set_aside(self, steps: list[int]) -> None:
        """Rename skipped step directories to <step>.damaged (kept for inspection), so a
        resumed run can save those steps again; orbax ignores the renamed ones."""
        if not steps:
            return
        if jax.process_index() == 0:
            for s in steps:
                src = self.directory / str(s)
                dst, n = self.directory / f"{s}.damaged", 1
                while dst.exists():
                    dst, n = self.directory / f"{s}.damaged.{n}", n + 1
                src.rename(dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("tandem_checkpoint_set_aside")
        self._manager.reload()

    def close(self) -> None:
        """Wait for the pending save (its failure is raised), release orbax's resources,
        then the lock (always)."""
        try:
            try:
                self.wait()
            finally:
                try:
                    self._manager.close()
                except Exception as err:
                    if not self._failed:  # else: the echo of the failure already raised
                        raise self._write_error(err, None) from err
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify(where: str, state: Any, meta: dict, sums: Any, *, partial: bool = False) -> None:
    """Raise CheckpointError unless `meta` (without the checksums) and every leaf of
    `state` match the checksums `sums` saved with them. partial=True: `state` may be a
    subtree restored alone (e.g. {"params": ...}); each of its leaves must be checksummed."""
    if not isinstance(sums, dict) or not isinstance(sums.get("arrays"), dict):
        raise CheckpointError(f"{where}: its checksum record is damaged ({str(sums)[:200]})")
    rest = {k: v for k, v in sums.items() if k != "record"}
    if sums.get("record") != record_checksum({**meta, CHECKSUM_KEY: rest}):
        raise CheckpointError(f"{where}: its JSON record (meta) fails its checksum: the file "
                              "was modified or damaged after it was written")
    saved = sums["arrays"]
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]
    if (set(paths) - set(saved)) if partial else (sorted(paths) != sorted(saved)):
        missing, extra = sorted(set(saved) - set(paths)), sorted(set(paths) - set(saved))
        raise CheckpointError(f"{where} holds other arrays than this run's state (saved only: "
                              f"{missing[:5]}, restored only: {extra[:5]}); it does not match "
                              "this run's model/optimizer")
    for path, (_, x) in zip(paths, flat):
        dtype, shape, digest = leaf_checksum(x)
        want_dtype, want_shape, want = saved[path]
        if (dtype, shape) != (want_dtype, list(want_shape)):
            raise CheckpointError(f"{where}: array {path} was saved as {want_dtype}{want_shape} "
                                  f"but restores as {dtype}{shape}: the template does not match "
                                  "this checkpoint's model/optimizer")
        if digest != want:
            raise CheckpointError(f"{where}: array {path} fails its checksum (saved {want}, "
                                  f"read {digest}): the checkpoint's data is damaged")
