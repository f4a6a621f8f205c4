"""IcePop and the masked-importance-sampling rejection masks (rl.objectives.rejection)
against float64 numpy twins written from the papers' formulas and from verl's rejection
rule (its ±20 log-ratio clamp included), at random ratios that straddle the bounds; the
train step applies them as a batch's own loss weights would be; the config checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.learner import OffPolicyConfig
from rl.objectives import get_correction
from rl.objectives.rejection import icepop_weights, rejection_weights


def ratios(seed=0, b=6, t=9, scale=1.2):
    rng = np.random.default_rng(seed)
    mask = rng.random((b, t)) < 0.8
    mask[0] = False  # an empty row
    behav = -rng.random((b, t)) * 3
    prox = behav + rng.normal(scale=scale, size=(b, t))
    prox[~mask] = np.nan  # masked entries never reach the result
    return prox, behav, mask


def icepop_twin(prox, behav, mask, alpha, beta):
    rho = np.exp(np.where(mask, prox - behav, 0.0))
    keep = mask & (rho >= alpha) & (rho <= beta)
    return np.where(keep, rho, 0.0), keep


def verl_twin(prox, behav, mask, level, upper, lower=None):
    """verl's compute_rollout_rejection_mask, re-derived: the kept-token mask."""
    lower = 1.0 / upper if lower is None else lower
    lr = np.where(mask, prox - behav, 0.0)
    if level == "token":
        agg = lr
    elif level == "sequence":
        agg = np.broadcast_to(lr.sum(axis=1, keepdims=True), lr.shape)
    else:
        agg = np.broadcast_to(lr.sum(axis=1, keepdims=True)
                              / np.maximum(mask.sum(axis=1, keepdims=True), 1), lr.shape)
    w = np.exp(np.clip(agg, -20.0, 20.0))
    return mask & (w >= lower) & (w <= upper)


@pytest.mark.parametrize("alpha, beta", [(None, None), (0.2, 5.0), (0.8, 1.5)])
def test_icepop_keeps_the_ratio_inside_the_band(alpha, beta):
    prox, behav, mask = ratios(1)
    a, b = (0.5, 5.0) if alpha is None else (alpha, beta)
    want_w, want_keep = icepop_twin(prox, behav, mask, a, b)
    got = icepop_weights(jnp.asarray(prox), jnp.asarray(behav), jnp.asarray(mask),
                         cap=beta, low=alpha)
    np.testing.assert_array_equal(np.asarray(got.keep), want_keep)
    np.testing.assert_allclose(np.asarray(got.weights), want_w, rtol=1e-6)
    assert 0 < want_keep.sum() < mask.sum()  # both sides of the band are hit
    assert float(got.metrics["icepop_masked_frac"]) == pytest.approx(
        1 - want_keep.sum() / mask.sum())
    rho = np.exp(prox - behav)[mask]
    assert float(got.metrics["icepop_low_frac"]) == pytest.approx(np.mean(rho < a))
    assert float(got.metrics["icepop_high_frac"]) == pytest.approx(np.mean(rho > b))


@pytest.mark.parametrize("level, cap, low", [("token", None, None), ("token", 1.5, 0.9),
                                              ("sequence", None, None), ("sequence", 3.0, None),
                                              ("geometric", None, None), ("geometric", 1.3, 0.8)])
def test_rejection_matches_verls_rule(level, cap, low):
    prox, behav, mask = ratios(2, scale=0.4 if level != "token" else 1.0)
    default = {"token": 2.0, "sequence": 8.0, "geometric": 1.01}[level]
    want = verl_twin(prox, behav, mask, level, cap or default, low)
    got = rejection_weights(jnp.asarray(prox), jnp.asarray(behav), jnp.asarray(mask),
                            level=level, cap=cap, low=low)
    np.testing.assert_array_equal(np.asarray(got.keep), want)
    np.testing.assert_array_equal(np.asarray(got.weights), want.astype(np.float32))
    assert float(got.metrics["rs_masked_frac"]) == pytest.approx(1 - want.sum() / mask.sum())
    rows = mask.any(axis=1)
    rejected = (mask & ~want).any(axis=1)
    assert float(got.metrics["rs_seq_masked_frac"]) == pytest.approx(rejected[rows].mean())
    if level != "token":  # a sequence is kept or rejected whole
        for r in np.flatnonzero(rows):
            assert want[r][mask[r]].all() or not want[r][mask[r]].any()


def test_sequence_rejection_survives_huge_log_ratios():
    """Σ_t log ρ of 200 tokens at +0.5 each is 100: in log space nothing overflows."""
    behav = np.zeros((2, 200), np.float32)
    prox = np.full((2, 200), 0.5, np.float32)
    prox[1] = 0.0
    mask = np.ones((2, 200), bool)
    got = rejection_weights(jnp.asarray(prox), jnp.asarray(behav), jnp.asarray(mask),
                            level="sequence")
    assert np.asarray(got.keep).tolist() == [[False] * 200, [True] * 200]
    assert np.isfinite(float(got.metrics["rs_log_ratio_mean"]))


def test_they_are_registered_and_their_configs_checked():
    assert get_correction("icepop") is icepop_weights
    assert get_correction("rejection") is rejection_weights
    OffPolicyConfig("rejection", level="geometric", cap=1.001)
    OffPolicyConfig("icepop", cap=5.0, low=0.5)
    for kw, match in [({"correction": "icepop", "level": "sequence"}, "level='token'"),
                      ({"correction": "truncated_is", "low": 0.5}, "takes none"),
                      ({"correction": "icepop", "low": 2.0, "cap": 1.5}, "exceeds cap"),
                      ({"correction": "rejection", "level": "tokens"}, "works at level"),
                      ({"correction": "icepop", "low": -1.0}, "low must be > 0")]:
        with pytest.raises(ValueError, match=match):
            OffPolicyConfig(**kw)


def test_the_step_applies_them_as_loss_weights():
    """The train step with correction "icepop" / "rejection" gives the loss of the same step
    with no correction and the twin's weights as the batch's own loss weights."""
    import dataclasses

    from test_registered_corrections import BASE, CFG, batch_and_params
    from models.decoder import forward
    from rl.learner import init_train_state
    from rl.learner.jitted import make_train_step

    batch, params = batch_and_params()
    tokens = np.asarray(batch.tokens)
    z = np.asarray(forward(params, CFG, jnp.asarray(tokens), jnp.asarray(batch.positions)),
                   np.float64) / BASE.temperature
    z = z - z.max(axis=-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = np.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    mask = np.asarray(batch.loss_mask)[:, 1:]
    mu = np.asarray(batch.behaviour_logprobs, np.float64)[:, 1:]
    cases = {OffPolicyConfig("icepop", cap=2.0, low=0.7): icepop_twin(logp, mu, mask, 0.7, 2.0)[0],
             OffPolicyConfig("rejection", cap=1.5): verl_twin(logp, mu, mask, "token", 1.5)}
    plain = dataclasses.replace(BASE, old_logp="current")

    def state():  # the step donates its state: a fresh one per call
        return init_train_state(jax.tree.map(jnp.array, params), plain, 0)

    for off, w in cases.items():
        assert 0 < (w > 0).sum() < mask.sum()
        weights = np.ones(tokens.shape, np.float32)
        weights[:, 1:] = np.where(mask, w, 1.0)
        _, want = make_train_step(plain, CFG)(state(), batch.replace(loss_weights=weights))
        _, got = make_train_step(dataclasses.replace(plain, offpolicy=off), CFG)(state(), batch)
        assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=2e-5, abs=1e-7)
