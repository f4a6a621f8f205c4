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
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from rl.runtime.mesh import with_shardings

# Orbax logs every save at INFO; a training loop's progress bar is the better place.
logging.getLogger("absl").setLevel(logging.WARNING)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not match the state."""


class Checkpointer:
    """Keep the last `keep` checkpoints of a run under `directory` (created if needed).

    save(step, state, meta) starts an async save (returns at once); wait() blocks until
    pending saves are on disk; restore(template, step=None) -> (state, meta) reads the
    latest (or given) step; close() waits and releases the manager.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2, async_save: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> None:
        """Start saving `state` and the JSON-serialisable `meta` as checkpoint `step`."""
        meta = dict(meta or {})
        meta.setdefault("step", int(step))
        self._manager.save(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self._manager.wait_until_finished()

    # ------------------------------------------------------------------ restore
    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, template: Any, step: int | None = None, *,
                shardings: Any = None) -> tuple[Any, dict]:
        """(state, meta) of checkpoint `step` (default: the latest). `template` gives the
        tree, shapes and dtypes (arrays or jax.ShapeDtypeStruct), and the shardings to
        restore into unless `shardings` is given: a tree like the template's of
        jax.sharding.Sharding (e.g. rl.learner.state_shardings(..., mesh)) or one
        Sharding for every array. Any mesh works, whatever mesh wrote the checkpoint."""
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint found in {str(self.directory)!r}; nothing to resume from "
                "(run without --resume first, or point --run-dir at an existing run)")
        if step is None:
            step = steps[-1]
        elif step not in steps:
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
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as err:  # orbax raises many types for damaged files
            raise CheckpointError(
                f"checkpoint step {step} in {str(self.directory)!r} is corrupted, incomplete or "
                f"does not match this run's model/optimizer ({type(err).__name__}: "
                f"{str(err)[:300]}); delete it to fall back to an older step, or start afresh"
            ) from err
        state, meta = out["state"], out["meta"]
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} is "
                                  f"inconsistent: its metadata says step {meta.get('step') if isinstance(meta, dict) else meta!r}")
        return state, dict(meta)

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
