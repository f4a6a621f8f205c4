"""ParamSnapshots: a bounded ring keyed by version — eviction order, clear errors for
evicted / unknown versions, copies that survive the source being deleted (the learner
donates its state), the Mapping interface rl.learner.proximal reads."""
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.learner import ParamSnapshots


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
