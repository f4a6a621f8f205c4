"""rl.learner.proximal: exact proximal log-probs at each token's own version against a float64
log-softmax of models.decoder.forward logits with that version's snapshot; the EWMA
update against numpy; errors for missing versions and bad arguments."""
import jax
import numpy as np
import pytest
from test_trainer import CFG, GROUP, TEMP, make_traj

from models.decoder import forward, init_params
from rl.learner import batch_from_trajectory, ewma_update, exact_proximal_logprobs, policy_logprobs

VERSIONS = (2, 5, 7)


@pytest.fixture(scope="module")
def setup():
    snaps = {v: init_params(CFG, 10 + v) for v in VERSIONS + (9,)}  # 9: held, never used
    batch = batch_from_trajectory(make_traj(4), group_size=GROUP, model_config=CFG)
    mask = np.asarray(batch.loss_mask)
    rng = np.random.default_rng(0)
    # Versions mix inside rows too (a resumed response changes version mid-way).
    ver = np.where(mask, rng.choice(VERSIONS, size=mask.shape), 0).astype(np.int32)
    assert set(np.unique(ver[mask])) == set(VERSIONS)
    return snaps, batch.replace(versions=ver)


def _ref_logprob(logits, tokens, b, t):
    """float64 log softmax(logits / T) of token t of row b (predicted at position t - 1)."""
    z = logits[b, t - 1] / TEMP
    m = z.max()
    return z[tokens[b, t]] - (m + np.log(np.exp(z - m).sum()))


def test_exact_proximal_matches_forward_with_each_tokens_snapshot(setup):
    snaps, batch = setup
    got = np.asarray(exact_proximal_logprobs(snaps, CFG, batch, TEMP))
    tokens, mask, ver = np.asarray(batch.tokens), np.asarray(batch.loss_mask), np.asarray(batch.versions)
    assert got.shape == tokens.shape and got.dtype == np.float32
    logits = {v: np.asarray(forward(p, CFG, tokens), np.float64) for v, p in snaps.items()}
    ref = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            if mask[b, t]:
                ref[b, t] = _ref_logprob(logits[int(ver[b, t])], tokens, b, t)
    np.testing.assert_allclose(got, ref, atol=2e-5)
    assert (got[~mask] == 0).all()
    # Versions matter: the single-policy log-probs of one snapshot differ elsewhere.
    one = np.asarray(policy_logprobs(snaps[2], CFG, batch, TEMP))
    sel = mask & (ver == 2)
    np.testing.assert_allclose(one[sel], got[sel], atol=1e-6)
    assert np.abs(one[mask & (ver != 2)] - got[mask & (ver != 2)]).max() > 1e-3


def test_missing_version_is_named(setup):
    snaps, batch = setup
    partial = {v: p for v, p in snaps.items() if v != 5}
    with pytest.raises(ValueError, match=r"no parameter snapshot for version\(s\) \[5\].*hold \[2, 7, 9\]"):
        exact_proximal_logprobs(partial, CFG, batch, TEMP)
    with pytest.raises(ValueError, match="temperature"):
        exact_proximal_logprobs(snaps, CFG, batch, 0.0)
    with pytest.raises(ValueError, match="TrainBatch"):
        exact_proximal_logprobs(snaps, CFG, {"tokens": 1}, TEMP)


def test_ewma_update_matches_numpy():
    rng = np.random.default_rng(1)
    a = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": [rng.normal(size=(5,)).astype(np.float32)]}
    b = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": [rng.normal(size=(5,)).astype(np.float32)]}
    for beta in (0.0, 0.3, 0.95):
        out = ewma_update(a, b, beta)
        for x, y, o in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(out)):
            ref = beta * x.astype(np.float64) + (1 - beta) * y.astype(np.float64)
            np.testing.assert_allclose(np.asarray(o), ref, rtol=1e-6, atol=1e-7)
            assert o.dtype == x.dtype
    # Repeated updates converge to the target params.
    p = a
    for _ in range(60):
        p = ewma_update(p, b, 0.8)
    np.testing.assert_allclose(np.asarray(p["w"]), b["w"], atol=1e-5)
    for bad in (1.0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="beta"):
            ewma_update(a, b, bad)
    with pytest.raises(ValueError, match="different trees"):
        ewma_update(a, {"w": b["w"]}, 0.5)
    with pytest.raises(ValueError, match="shapes differ"):
        ewma_update(a, {"w": b["w"][:2], "b": b["b"]}, 0.5)
