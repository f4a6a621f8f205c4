"""Ghost gradient norms (models.ghost_norms): each row's ‖∇_θ Σ_t log π(y_t)‖² from one
batched backward equals the float64 sum of squares of a per-row jax.grad of a hand-written
log-softmax, for tied and untied heads, biases, qk-norm, remat, repeated tokens (the tied
table's lookup and cross terms), padded chunks and an empty row; the vmap(grad) twin
(rl.learner.vcpo) meets the same reference; params the ghost ops do not cover raise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import forward, init_params
from models.ghost_norms import ghost_logprob_grads, outer_sum_sq_norms
from models.logprobs import token_logprobs
from models.lora import LoraConfig, compose, init_lora
from rl.learner.vcpo import per_trajectory_grad_sq_norms, per_trajectory_logprob_grads

TEMP = 0.7
B, T = 5, 12

CONFIGS = {
    "tied": {"tie_word_embeddings": True},
    "untied_bias_qknorm": {"tie_word_embeddings": False, "attention_bias": True, "qk_norm": True},
    "tied_remat": {"tie_word_embeddings": True, "remat": "full"},
}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 16, (B, T)).astype(np.int32)  # vocab 16: tokens repeat
    tokens[1, 3:9] = tokens[1, 2]  # a run of one token: input rows of the table repeat
    mask = rng.random((B, T)) < 0.6
    mask[3] = False  # an empty row: norm 0
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    return tokens, positions, mask


def _reference(params, cfg, tokens, mask):
    """[B] float64 Σ over leaves of ∇² for each row alone (hand-written log-softmax)."""
    def seq_logprob(p, tok, m):
        z = forward(p, cfg, tok[None])[0].astype(jnp.float32) / TEMP
        zmax = jnp.max(z, axis=-1, keepdims=True)
        logp = z - (zmax + jnp.log(jnp.sum(jnp.exp(z - zmax), axis=-1, keepdims=True)))
        picked = logp[jnp.arange(T - 1), tok[1:]]
        return jnp.sum(picked * m[1:])

    grad = jax.jit(jax.grad(seq_logprob))
    return np.array([sum(float(np.sum(np.asarray(g, np.float64) ** 2))
                         for g in jax.tree.leaves(grad(params, tokens[i], mask[i].astype(np.float32))))
                     for i in range(B)])


@pytest.mark.parametrize("impl, name", [("ghost", name) for name in sorted(CONFIGS)]
                         + [("vmap", "tied")])  # the twin: one config (it is the slow one)
def test_row_norms_match_per_row_grads(impl, name):
    cfg = get_config("tiny", vocab_size=16, max_position_embeddings=32, **CONFIGS[name])
    params = init_params(cfg, 1)
    tokens, positions, mask = _inputs()
    fn = ghost_logprob_grads if impl == "ghost" else per_trajectory_logprob_grads
    logp, norms = jax.jit(lambda p: fn(p, cfg, tokens, positions, mask, TEMP, 2))(params)
    want = _reference(params, cfg, tokens, mask)
    assert want[3] == 0.0 and want.min() == 0.0 and np.all(want[[0, 1, 2, 4]] > 1.0)
    np.testing.assert_allclose(np.asarray(norms, np.float64), want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(logp, token_logprobs(params, cfg, tokens, positions, TEMP)[0],
                               atol=1e-5)
    # the public entry (rl.learner) dispatches to the same function
    method = "ghost" if impl == "ghost" else "exact"
    public = per_trajectory_grad_sq_norms(params, cfg, tokens, positions, mask, TEMP, 2,
                                          method=method)
    np.testing.assert_allclose(public, norms, rtol=1e-6)


def test_outer_sum_sq_norms_both_forms_against_float64():
    rng = np.random.default_rng(0)
    for s, i, o in [(3, 40, 50), (30, 4, 5)]:  # the per-row matrix form, then the Gram form
        x, g = rng.normal(size=(2, s, i)), rng.normal(size=(2, s, o))
        want = [np.sum(np.einsum("si,so->io", x[b], g[b]) ** 2) for b in range(2)]
        got = outer_sum_sq_norms(jnp.asarray(x, jnp.float32), jnp.asarray(g, jnp.float32))
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_params_outside_the_ghost_ops_raise():
    cfg = get_config("tiny", vocab_size=16, max_position_embeddings=32)
    params = init_params(cfg, 1)
    tokens, positions, mask = _inputs()
    run = lambda p: ghost_logprob_grads(p, cfg, tokens, positions, mask, TEMP, 2)
    with pytest.raises(ValueError, match="leave out params.*extra/w"):
        run({**params, "extra": {"w": jnp.zeros(3)}})
    lora = LoraConfig(rank=2)
    composed = compose(params, init_lora(params, lora, 0), lora)
    with pytest.raises(ValueError, match="plain params only"):
        run(composed)
    with pytest.raises(ValueError, match="method must be"):
        per_trajectory_grad_sq_norms(params, cfg, tokens, positions, mask, method="vmap")


def test_how_the_norms_are_computed_may_change_on_resume():
    """A run checkpointed with the vmap twin (the default before the ghost norms) resumes
    with the ghost norms and another chunk; VCPO's baseline may not change."""
    import dataclasses

    from rl.loops.config import RunConfig
    from rl.loops.validation import ConfigError, check_resume_config, config_record
    from rl.objectives import VCPOConfig

    def record(**vcpo):
        cfg = RunConfig()
        train = dataclasses.replace(cfg.train, vcpo=VCPOConfig(enabled=True, **vcpo))
        return config_record(train, cfg.loop)

    check_resume_config(record(grad_norms="exact", chunk=2), record(grad_norms="ghost", chunk=8))
    with pytest.raises(ConfigError, match="baseline"):
        check_resume_config(record(baseline="opob"), record(baseline="group_mean"))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_ghost_norms_lower_for_accelerators(platform):
    """The ghost pass (custom vjps, the lookup's scatter, the Grams) lowers for GPU and TPU
    from this CPU machine."""
    cfg = get_config("tiny", vocab_size=16, max_position_embeddings=32)
    params = init_params(cfg, 0)
    tokens, positions, mask = _inputs()
    exported = jax.export.export(
        jax.jit(lambda p, t, q, m: ghost_logprob_grads(p, cfg, t, q, m, TEMP, 2)),
        platforms=[platform])(params, tokens, positions, mask)
    assert exported.platforms == (platform,)
    assert exported.out_avals[1].shape == (B,)


def test_the_head_window_gives_the_same_norms_or_nan():
    """window=K runs the head only at the K logit positions from each row's first loss
    token: rows whose loss tokens all lie there get the full pass's norms and log-probs (on
    the loss tokens); a row with a loss token beyond the window gets NaN, not a wrong norm."""
    cfg = get_config("tiny", vocab_size=16, max_position_embeddings=32)
    params = init_params(cfg, 1)
    tokens, positions, _ = _inputs()
    mask = np.zeros((B, T), bool)  # response-like loss spans [from, to) of token indices
    for row, (lo, hi) in enumerate([(4, 9), (6, 12), (2, 4), (0, 0), (1, 12)]):
        mask[row, lo:hi] = True
    mask[0, 6] = False  # a gap inside a span (a tool's output in a multi-turn response)
    m = mask[:, 1:]
    first = np.where(m.any(1), m.argmax(1), 0)
    last = np.where(m.any(1), T - 2 - m[:, ::-1].argmax(1), 0)
    span = last - first + 1
    width = 6
    assert list(span <= width) == [True, True, True, True, False]
    assert (first > 0).sum() == 3  # windows that start inside the row
    run = jax.jit(lambda p, w: ghost_logprob_grads(p, cfg, tokens, positions, mask, TEMP, 2,
                                                   window=w), static_argnums=1)
    lp_full, n_full = run(params, None)
    lp_win, n_win = run(params, width)
    covered = (span <= width) | ~m.any(1)
    np.testing.assert_allclose(np.asarray(n_win)[covered], np.asarray(n_full)[covered], rtol=1e-5)
    assert np.isnan(np.asarray(n_win)[~covered]).all()
    np.testing.assert_allclose(np.where(m, lp_win, 0)[covered], np.where(m, lp_full, 0)[covered],
                               atol=1e-6)
    _, n_all = run(params, T)  # a window as wide as the row: every row covered
    np.testing.assert_allclose(n_all, n_full, rtol=1e-5)
