"""Checked mode (rl.learner.checked): under jit a non-finite reward, behaviour log-prob,
loss or gradient stops the step with the step and the group named; a finite batch gives
exactly the unchecked step's update. Same geometry as tests/rl/test_trainer.py."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import init_params
from rl.learner import NonFiniteError, batch_from_trajectory, make_train_step
from tests.rl.test_trainer import CFG, FAST, GROUP, PG_CONFIG, fresh_state, make_traj

# Both steps compile with XLA:CPU's default fusion emitters (the suite turns them off to
# compile faster, tests/conftest.py): with the older emitters the extra checks change
# where fusions split and with it the float rounding, so "exactly equal" would test the
# codegen rather than checked mode. The library runs with the defaults. (A jaxlib without
# the option never had it turned off: conftest only sets flags XLA accepts.)
if "xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", ""):
    FAST = {**FAST, "xla_cpu_use_fusion_emitters": True}


@pytest.fixture(scope="module")
def setup():
    params = init_params(CFG, 3)
    batch = batch_from_trajectory(make_traj(11), group_size=GROUP, model_config=CFG)
    checked = make_train_step(PG_CONFIG, CFG, compiler_options=FAST, checked=True)
    return params, batch, checked


def test_checked_step_equals_unchecked_step(setup):
    params, batch, checked = setup
    plain = make_train_step(PG_CONFIG, CFG, compiler_options=FAST)
    s1, m1 = checked(fresh_state(params), batch)
    s2, m2 = plain(fresh_state(params), batch)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert m1.keys() == m2.keys() and float(m1["loss"]) == float(m2["loss"])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_reward_names_step_group_and_row(setup, value):
    params, batch, checked = setup
    bad = batch.replace(rewards=jnp.asarray(batch.rewards).at[6, 0].set(value))
    state = fresh_state(params)
    state = state.replace(step=state.step + 6)  # the 7th update of a run
    with pytest.raises(NonFiniteError, match=r"^step 7: group 1 \(rows 4\.\.7\) has a non-finite "
                                             r"reward \(first: row 6, reward column 0\)"):
        checked(state, bad)


def test_non_finite_behaviour_logprob_names_the_group(setup):
    params, batch, checked = setup
    mask = np.asarray(batch.loss_mask)
    row = 2
    col = int(np.flatnonzero(mask[row])[0])
    logp = jnp.asarray(batch.behaviour_logprobs).at[row, col].set(jnp.nan)
    with pytest.raises(NonFiniteError, match=r"^step 1: group 0 \(row 2\) has non-finite "
                                             "behaviour log-probs"):
        checked(fresh_state(params), batch.replace(behaviour_logprobs=logp))
    # NaN outside the response tokens is not read by the loss: no error
    pad = int(np.flatnonzero(~mask[row])[0])
    ok = jnp.asarray(batch.behaviour_logprobs).at[row, pad].set(jnp.nan)
    checked(fresh_state(params), batch.replace(behaviour_logprobs=ok))


def test_non_finite_params_stop_at_the_loss(setup):
    params, batch, checked = setup
    leaves, treedef = jax.tree.flatten(params)
    leaves = [leaves[0].at[...].set(jnp.nan)] + leaves[1:]  # every weight of one leaf NaN
    broken = jax.tree.unflatten(treedef, leaves)
    with pytest.raises(NonFiniteError, match=r"^step 1: the (loss|gradient norm) is non-finite"):
        checked(fresh_state(broken), batch)
