"""Checkpointer tests: bit-exact round trip of a TrainState with AdamW moments and the
JSON record, keep-last-k, and clear errors for a missing, corrupted or mismatched
checkpoint."""
import glob
import shutil

import jax
import numpy as np
import pytest

from models.config import get_config
from models.decoder import init_params
from rl.learner import OptimizerConfig, TrainConfig, init_train_state
from rl.runtime.checkpoint import Checkpointer, CheckpointError

CFG = get_config("tiny", vocab_size=16)
CONFIG = TrainConfig(optimizer=OptimizerConfig(learning_rate=1e-3))


def random_state(seed):
    """A TrainState whose every float leaf (params and Adam moments) is random noise."""
    state = init_train_state(init_params(CFG, seed), CONFIG, seed)
    rng = np.random.default_rng(seed)
    noisy = jax.tree.map(
        lambda x: rng.normal(size=x.shape).astype(x.dtype) if np.issubdtype(x.dtype, np.floating)
        else x, state)
    return noisy.replace(step=np.int32(7), version=np.int32(7))


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb))


def test_round_trip_is_bit_exact_and_keeps_last_k(tmp_path):
    states = {s: random_state(s) for s in (1, 2, 3)}
    with Checkpointer(tmp_path / "ck", keep=2) as ck:
        for s, st in states.items():
            ck.save(s, st, {"data_position": 10 * s})
        ck.wait()
        assert ck.all_steps() == [2, 3]
    template = init_train_state(init_params(CFG, 0), CONFIG, 0)
    ck = Checkpointer(tmp_path / "ck", keep=2)
    state, meta = ck.restore(template)
    assert meta == {"data_position": 30, "step": 3}
    assert leaves_equal(state, states[3]) and not leaves_equal(state, states[2])
    state2, meta2 = ck.restore(template, step=2)
    assert meta2["data_position"] == 20 and leaves_equal(state2, states[2])
    with pytest.raises(CheckpointError, match="step 1 not found"):
        ck.restore(template, step=1)
    ck.close()


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    template = init_train_state(init_params(CFG, 0), CONFIG, 0)
    with Checkpointer(tmp_path / "empty") as ck:
        with pytest.raises(CheckpointError, match="no checkpoint found"):
            ck.restore(template)


# After a failed read, orbax's async machinery reports an "event loop is closed" error
# from a finalizer; the failure itself is what this test checks.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupted_or_mismatched_checkpoint_is_a_clear_error(tmp_path):
    state = random_state(4)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(7, state, {"data_position": 1})
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    # Garble the array data of one copy.
    files = glob.glob(str(tmp_path / "ck" / "7" / "state" / "**" / "d" / "*"), recursive=True)
    assert files
    for f in files:
        with open(f, "wb") as fh:
            fh.write(b"not a checkpoint")
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="corrupted"):
        ck.restore(state)
    # A template of another model does not fit the intact copy.
    other = init_train_state(init_params(CFG.replace(vocab_size=32), 0), CONFIG, 0)
    with Checkpointer(tmp_path / "ck2") as ck, pytest.raises(CheckpointError, match="does not match"):
        ck.restore(other)
    # Remove the JSON record: restoring must not silently succeed without it.
    shutil.rmtree(tmp_path / "ck2" / "7" / "meta")
    with Checkpointer(tmp_path / "ck2") as ck, pytest.raises(CheckpointError):
        ck.restore(state)


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)
