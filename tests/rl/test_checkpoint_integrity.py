"""Checkpoint integrity: a bit flipped inside stored array data that orbax itself restores
without complaint (checked with a plain orbax CheckpointManager, independent of the
Checkpointer) is a CheckpointError naming the checkpoint and the damaged leaf's tree
path; truncated and missing data files, a damaged or edited JSON record and a template of
another dtype are clear errors; restore(fallback=True) skips a damaged latest checkpoint
for the previous one (bit-identical to what was saved), sets the damaged one aside and
the step can be saved again; checkpoints written without checksums restore with a
warning."""
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from models.config import get_config
from models.decoder import init_params
from rl.learner import OptimizerConfig, TrainConfig, init_train_state
from rl.runtime.checkpoint import Checkpointer, CheckpointError, CheckpointWarning

CFG = get_config("tiny", vocab_size=16)
CONFIG = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3))

# Orbax's async reader reports closed event loops from finalizers after failed reads.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def random_state(seed):
    """A TrainState whose every float leaf is random noise (hard to compress)."""
    state = init_train_state(init_params(CFG, seed), CONFIG, seed)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype)
                        if np.issubdtype(x.dtype, np.floating) else np.asarray(x), state)


def host_leaves(state):
    """{tree path: numpy array}, paths spelled independently of the code under test."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out["/".join(names)] = np.asarray(x)
    return out


def data_files(step_dir):
    """The stored chunk files of the state item (ocdbt layout), largest first."""
    files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
    return sorted(files, key=os.path.getsize, reverse=True)


def orbax_restore(directory, step, template):
    """Plain orbax, no checksums: what the checkpoint restores to by itself."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    with ocp.CheckpointManager(directory, item_names=("state",)) as m:
        return m.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]


def flip_accepted_bit(directory, step, template, want=lambda path: True):
    """Flip one bit in a chunk file of checkpoint `step` (largest first) at an offset
    orbax still reads and that changes a leaf whose path satisfies `want`; returns the
    tree paths whose restored values changed."""
    original = host_leaves(template)
    for path in data_files(os.path.join(directory, str(step))):
        raw = open(path, "rb").read()
        for frac in (0.5, 0.3, 0.7, 0.1, 0.9, 0.2, 0.8):
            damaged = bytearray(raw)
            damaged[int(len(raw) * frac)] ^= 0x04
            with open(path, "wb") as fh:
                fh.write(bytes(damaged))
            try:
                restored = host_leaves(orbax_restore(directory, step, template))
            except Exception:  # this offset broke the chunk's framing: orbax notices
                continue
            changed = [k for k, v in restored.items() if not np.array_equal(v, original[k])]
            if changed and all(want(k) for k in changed):
                return changed
        with open(path, "wb") as fh:
            fh.write(raw)
    raise AssertionError("no single-bit flip that orbax accepts was found")


def leaves_equal(a, b):
    la, lb = host_leaves(a), host_leaves(b)
    return la.keys() == lb.keys() and all(
        la[k].dtype == lb[k].dtype and np.array_equal(la[k], lb[k]) for k in la)


def test_flipped_bit_that_orbax_accepts_is_named(tmp_path):
    state = random_state(1)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(5, state, {"data_position": 3})
    changed = flip_accepted_bit(tmp_path / "ck", 5, state)
    assert len(changed) == 1  # one flipped bit damages one leaf, and orbax restored it
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError) as info:
        ck.restore(state)
    msg = str(info.value)
    assert f"array {changed[0]} fails its checksum" in msg
    assert str(tmp_path / "ck" / "5") in msg
    assert "no older checkpoint is kept" in msg


def test_truncated_and_missing_data_files_are_clear_errors(tmp_path):
    state = random_state(2)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state, {"data_position": 0})
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    big = data_files(tmp_path / "ck" / "1")[0]
    with open(big, "r+b") as fh:
        fh.truncate(os.path.getsize(big) // 2)
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="corrupted"):
        ck.restore(state)
    os.remove(data_files(tmp_path / "ck2" / "1")[0])
    with Checkpointer(tmp_path / "ck2") as ck, pytest.raises(CheckpointError, match="step 1"):
        ck.restore(state)


def test_edited_or_broken_meta_record_is_a_clear_error(tmp_path):
    state = random_state(3)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(2, state, {"data_position": 10})
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    meta_file = tmp_path / "ck" / "2" / "meta" / "metadata"
    record = json.loads(meta_file.read_text())
    record["data_position"] = 11  # still valid JSON: only the record checksum can tell
    meta_file.write_text(json.dumps(record))
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="JSON record"):
        ck.restore(state)
    meta2 = tmp_path / "ck2" / "2" / "meta" / "metadata"
    meta2.write_bytes(meta2.read_bytes()[:-7])  # truncated JSON
    with Checkpointer(tmp_path / "ck2") as ck, pytest.raises(CheckpointError, match="step 2"):
        ck.restore(state)


def test_template_of_another_dtype_is_named(tmp_path):
    state = random_state(4)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state, {})
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == np.float32 else x, state)
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError,
                                                           match="saved as float32"):
        ck.restore(bf16)


def test_fallback_restores_the_previous_good_checkpoint_exactly(tmp_path):
    states = {s: random_state(10 + s) for s in (1, 2, 3)}
    with Checkpointer(tmp_path / "ck", keep=2) as ck:
        for s, st in states.items():
            ck.save(s, st, {"data_position": 10 * s})
    flip_accepted_bit(tmp_path / "ck", 3, states[3])
    template = random_state(0)
    with Checkpointer(tmp_path / "ck", keep=2) as ck:
        with pytest.raises(CheckpointError, match="--resume-from-last-good") as info:
            ck.restore(template)
        assert "previous checkpoint (step 2)" in str(info.value)
        with pytest.raises(ValueError, match="fallback"):
            ck.restore(template, step=2, fallback=True)
        with pytest.warns(CheckpointWarning, match="skipping checkpoint step 3 .*checksum"):
            state, meta = ck.restore(template, fallback=True)
        assert leaves_equal(state, states[2]) and meta == {"data_position": 20, "step": 2}
        assert ck.all_steps() == [2] and (tmp_path / "ck" / "3.damaged").is_dir()
        ck.save(3, states[1], {"data_position": 99})  # the step can be written again
        ck.wait()
        state3, meta3 = ck.restore(template)
        assert leaves_equal(state3, states[1]) and meta3["data_position"] == 99


def test_fallback_over_an_incomplete_checkpoint_and_when_none_is_good(tmp_path):
    states = {s: random_state(20 + s) for s in (1, 2)}
    with Checkpointer(tmp_path / "ck", keep=2) as ck:
        for s, st in states.items():
            ck.save(s, st, {"data_position": s})
    shutil.rmtree(tmp_path / "ck" / "2" / "meta")  # the JSON item is missing
    template = random_state(0)
    with Checkpointer(tmp_path / "ck") as ck, pytest.warns(CheckpointWarning, match="step 2"):
        state, meta = ck.restore(template, fallback=True)
    assert leaves_equal(state, states[1]) and meta["data_position"] == 1
    os.remove(data_files(tmp_path / "ck" / "1")[0])
    with Checkpointer(tmp_path / "ck") as ck, pytest.warns(CheckpointWarning):
        with pytest.raises(CheckpointError, match="no intact checkpoint"):
            ck.restore(template, fallback=True)


def test_checkpoint_without_checksums_restores_with_a_warning(tmp_path):
    state = random_state(5)
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(tmp_path / "old", options=options,
                               item_names=("state", "meta")) as m:  # the pre-checksum layout
        m.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          meta=ocp.args.JsonSave({"step": 4, "data_position": 8})))
    with Checkpointer(tmp_path / "old") as ck, pytest.warns(CheckpointWarning,
                                                            match="without checksums"):
        restored, meta = ck.restore(random_state(0))
    assert leaves_equal(restored, state) and meta == {"step": 4, "data_position": 8}


def test_reserved_meta_key_is_refused(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(ValueError, match="reserved"):
        ck.save(1, random_state(6), {"_checksums": 1})


def test_export_refuses_damaged_params(tmp_path):
    from rl.run import PRESETS, RunDirError, load_run
    from rl.run.record import model_record
    from rl.runtime.logging import atomic_write_json

    preset = PRESETS["tiny-synthetic"]  # its run seed (loop.seed) is 0
    state = random_state(7)
    atomic_write_json(tmp_path / "run" / "model.json", model_record(preset, CFG))
    with Checkpointer(tmp_path / "run" / "checkpoints") as ck:
        ck.save(1, state, {"data_position": 0})
    policy = load_run(tmp_path / "run")  # intact: verified and exported
    assert leaves_equal(policy.params, state.params)
    changed = flip_accepted_bit(tmp_path / "run" / "checkpoints", 1, state,
                                want=lambda path: path.startswith("params/"))
    with pytest.raises(RunDirError, match=f"array {changed[0]} fails its checksum"):
        load_run(tmp_path / "run")
