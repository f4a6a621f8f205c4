"""The sampler's host-side helpers that now run as one compiled program each: an empty
state (`init_state`) against the values its docstring promises, built here with numpy;
`read_slots` (one padded gather) against numpy indexing of the state's host copy, for
slot lists of every size (the padded and the unpadded path), in any order; and the
loop's `rollout_seed` against the eager split it replaced."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import init_params
from rl.loops.rollouts import rollout_seed
from rl.rollout import decode_segment, init_state, prefill, read_slots, sample_keys

CFG = get_config("tiny")
SLOTS, N, P, R = 6, 3, 8, 12  # 6 slots: not a power of two, so padding is exercised
PER_SLOT = ("prompt_ids", "prompt_lengths", "response_ids", "logprobs", "versions",
            "num_generated", "budget", "done", "stopped", "keys", "pending")


@pytest.mark.parametrize("layout", ["segmented", "replicated"])
def test_an_empty_state_holds_the_documented_values(layout):
    st = init_state(CFG, num_slots=SLOTS, max_prompt_len=P, max_new_tokens=R, group_size=N,
                    kv_layout=layout, stop_ids=(2, 7))
    want = {"pending": np.zeros(SLOTS, np.int32), "prompt_ids": np.zeros((SLOTS, P), np.int32),
            "prompt_lengths": np.zeros(SLOTS, np.int32),
            "response_ids": np.zeros((SLOTS, R), np.int32),
            "logprobs": np.zeros((SLOTS, R), np.float32),
            "versions": np.full((SLOTS, R), -1, np.int32),
            "num_generated": np.zeros(SLOTS, np.int32), "budget": np.zeros(SLOTS, np.int32),
            "done": np.ones(SLOTS, bool), "stopped": np.zeros(SLOTS, bool),
            "keys": np.zeros((SLOTS, 2), np.uint32)}
    for name, ref in want.items():
        got = np.asarray(getattr(st, name))
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        np.testing.assert_array_equal(got, ref, err_msg=name)
    stops = np.asarray(st.stop_ids)
    assert stops.shape == (64,) and stops[:2].tolist() == [2, 7] and (stops[2:] == -1).all()
    kv = (CFG.num_kv_heads, CFG.head_dim)
    dt = jnp.dtype(CFG.dtype)
    if layout == "segmented":
        shapes = {"k_prompt": (CFG.num_layers, SLOTS // N, P, *kv),
                  "k_resp": (CFG.num_layers, SLOTS // N, N, R, *kv),
                  "prompt_lengths": (SLOTS // N,), "resp_lengths": (SLOTS // N, N)}
    else:
        shapes = {"k": (CFG.num_layers, SLOTS, P + R, *kv), "lengths": (SLOTS,)}
    for name, shape in shapes.items():
        leaf = np.asarray(getattr(st.cache, name))
        assert leaf.shape == shape, name
        assert leaf.dtype == (dt if name.startswith("k") else np.int32), name
        assert not leaf.any(), name
    assert st.kv_layout == layout and st.num_slots == SLOTS


def test_an_empty_state_takes_the_cache_dtype():
    st = init_state(CFG, num_slots=SLOTS, max_prompt_len=P, max_new_tokens=R, group_size=N,
                    cache_dtype="float32")
    assert st.cache.k_prompt.dtype == jnp.float32 and st.cache.v_resp.dtype == jnp.float32


@pytest.fixture(scope="module")
def decoded():
    params = init_params(CFG, 0)
    st = init_state(CFG, num_slots=SLOTS, max_prompt_len=P, max_new_tokens=R, group_size=N)
    st = prefill(params, st, [[5, 17, 33], [9, 10, 11, 12, 13]],
                 np.arange(SLOTS).reshape(2, N), sample_keys(3, [0, 1], N),
                 max_new_tokens=10)
    return decode_segment(params, st, 7, 4)


@pytest.mark.parametrize("slots", [[], [0], [4, 1], [5, 0, 3], [2, 3, 4, 5, 0],
                                   list(range(SLOTS)), [5, 4, 3, 2, 1, 0]])
def test_read_slots_equals_numpy_indexing_of_the_host_state(decoded, slots):
    host = {f: np.asarray(getattr(decoded, f)) for f in PER_SLOT}
    got = read_slots(decoded, slots)
    assert len(got) == len(slots)
    for s, smp in zip(slots, got):
        n, p = int(host["num_generated"][s]), int(host["prompt_lengths"][s])
        assert n == 7 and p in (3, 5)
        np.testing.assert_array_equal(smp.prompt_ids, host["prompt_ids"][s, :p])
        np.testing.assert_array_equal(smp.response_ids, host["response_ids"][s, :n])
        np.testing.assert_array_equal(smp.logprobs, host["logprobs"][s, :n])
        np.testing.assert_array_equal(smp.versions, host["versions"][s, :n])
        assert (smp.versions == 4).all()
        np.testing.assert_array_equal(smp.key, host["keys"][s])
        assert smp.budget == int(host["budget"][s]) == 10
        assert smp.done == bool(host["done"][s]) and smp.stopped == bool(host["stopped"][s])


def test_read_slots_still_refuses_bad_slots(decoded):
    with pytest.raises(ValueError, match="distinct"):
        read_slots(decoded, [1, 1])
    with pytest.raises(ValueError, match="num_slots"):
        read_slots(decoded, [SLOTS])


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1])
def test_rollout_seed_equals_the_eager_split(seed):
    rng = jax.random.PRNGKey(seed)
    key, sub = jax.random.split(rng)
    want = int(jax.random.randint(sub, (), 0, np.iinfo(np.int32).max))
    got, kept = rollout_seed(np.asarray(rng))
    assert got == want and isinstance(got, int)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(key))
