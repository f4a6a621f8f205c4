"""TrainConfig.packed: the packed shared-prefix forward inside train_step gives the naive
step's loss, metrics, gradient norm and SGD-updated params (one and two micro-batches,
KL to a reference and an entropy bonus on, so every log-prob call goes packed); batches
whose groups do not share their prompt fall back to the naive rows; bad layouts raise.

The naive step (tested against hand-written per-sequence gradients in test_trainer.py) is
the reference; the chunked vocabulary head (TrainConfig.logprob_chunk, the default) is
checked against its full-logits twin on both layouts. One geometry (B=8 rows in 4 groups of 2, T=9, vocab 16): four compilations."""
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import init_params
from rl.learner import (
    OptimizerConfig,
    TrainConfig,
    batch_from_trajectory,
    init_train_state,
    make_train_step,
)
from rl.objectives import AdvantageConfig, LossConfig
from rl.trajectory import Trajectory

CFG = get_config("tiny", vocab_size=16, max_position_embeddings=32)
B, GROUP, P_MAX, R_MAX = 8, 2, 4, 5
FAST = {"xla_backend_optimization_level": 0}
# SGD (not AdamW, whose first step is ~lr*sign(g) and amplifies rounding); ppo_clip at
# ratio 1, token-mean, KL to a reference and an entropy bonus: every log-prob path is used.
NAIVE = TrainConfig(
    loss=LossConfig(name="ppo_clip", aggregation="token-mean", kl_coef=0.1, entropy_coef=0.01),
    advantage=AdvantageConfig("grpo"),
    optimizer=OptimizerConfig(name="sgd", learning_rate=1.0, max_grad_norm=None),
    temperature=0.7,
)
PACKED = replace(NAIVE, packed=True)
PACKED_MB = replace(PACKED, micro_batches=2)
METRICS = ("loss", "pg_loss", "kl", "entropy", "approx_kl", "grad_norm", "tokens",
           "response_len", "reward_mean", "adv_abs_mean")


def make_traj(seed, *, shared=True):
    """Groups of GROUP rows; shared=True gives each group one prompt (random length), with
    ragged responses (lengths 0..R_MAX: row 3 is empty)."""
    rng = np.random.default_rng(seed)
    n_groups = B // GROUP
    plen = np.repeat(rng.integers(1, P_MAX + 1, n_groups), GROUP)
    prompts = np.repeat(rng.integers(3, CFG.vocab_size, (n_groups, P_MAX)), GROUP, axis=0)
    if not shared:  # a different last prompt token in every row
        prompts[np.arange(B), plen - 1] = (prompts[np.arange(B), plen - 1] + np.arange(B)) \
            % (CFG.vocab_size - 3) + 3
    rlen = rng.integers(1, R_MAX + 1, B)
    rlen[3] = 0
    pmask = np.arange(P_MAX)[None] < plen[:, None]
    rmask = np.arange(R_MAX)[None] < rlen[:, None]
    return Trajectory.create(
        prompt_ids=prompts * pmask, prompt_lengths=plen,
        response_ids=rng.integers(3, CFG.vocab_size, (B, R_MAX)) * rmask, response_mask=rmask,
        behaviour_logprobs=np.where(rmask, -rng.random((B, R_MAX)) * 3, 0.0),
        versions=np.zeros((B, R_MAX)), group_ids=np.repeat(np.arange(n_groups), GROUP),
        finished=np.zeros(B, bool), truncated=np.ones(B, bool),
        rewards={"r": rng.normal(size=B)})


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 5)


@pytest.fixture(scope="module")
def ref_params(params):
    # a different frozen reference, so the KL term and its log-probs are not trivial
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(9), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                     for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def naive_result(params, ref_params):
    batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=CFG)
    return run(NAIVE, params, ref_params, batch)


def run(config, params, ref_params, batch):
    state = init_train_state(jax.tree.map(jnp.array, params), config, 0)  # donated: a copy
    new_state, metrics = make_train_step(config, CFG, compiler_options=FAST)(
        state, batch, ref_params)
    return new_state.params, {k: float(v) for k, v in metrics.items()}


def assert_same_step(got, want, params):
    (got_params, got_m), (want_params, want_m) = got, want
    for key in METRICS:
        np.testing.assert_allclose(got_m[key], want_m[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert want_m["grad_norm"] > 1e-2 and abs(want_m["kl"]) > 1e-4
    moved = max(float(jnp.max(jnp.abs(w - p))) for w, p in
                zip(jax.tree.leaves(want_params), jax.tree.leaves(params)))
    assert moved > 1e-3  # the SGD step really moves the params
    for g, w in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0)


def test_packed_batch_layout():
    traj = make_traj(0)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, packed=True)
    pk = batch.packed
    assert pk is not None and batch_from_trajectory(
        traj, group_size=GROUP, model_config=CFG).packed is None  # off by default
    assert pk.prompt_tokens.shape == (B // GROUP, P_MAX)  # fixed widths: one compiled shape
    assert pk.response_tokens.shape == (B // GROUP, GROUP, R_MAX)
    np.testing.assert_array_equal(pk.rows, np.arange(B).reshape(-1, GROUP))
    plen, resp = np.asarray(traj.prompt_lengths), np.asarray(traj.response_ids)
    rlen = np.asarray(traj.response_mask).sum(1)
    for row in range(B):
        g, n = divmod(row, GROUP)
        assert pk.prompt_lengths[g] == plen[row] and pk.response_lengths[g, n] == rlen[row]
        np.testing.assert_array_equal(pk.prompt_tokens[g, :plen[row]],
                                      np.asarray(traj.prompt_ids)[row, :plen[row]])
        np.testing.assert_array_equal(pk.response_tokens[g, n], resp[row])


def test_packed_step_equals_naive(params, ref_params, naive_result):
    batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=CFG, packed=True)
    assert batch.packed is not None
    assert_same_step(run(PACKED, params, ref_params, batch), naive_result, params)


def test_packed_two_micro_batches_equal_naive(params, ref_params, naive_result):
    batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=CFG, packed=True)
    assert_same_step(run(PACKED_MB, params, ref_params, batch), naive_result, params)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_chunked_head_step_equals_full_logits_twin(params, ref_params, naive_result, packed):
    """TrainConfig.logprob_chunk: the chunked head (3 tokens per chunk, so chunks straddle
    rows) gives the same step as the slow twin with full [B, T-1, V] logits (chunk 0),
    entropy bonus and KL reference included."""
    batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=CFG,
                                  packed=packed)
    config = PACKED if packed else NAIVE
    slow = run(replace(config, logprob_chunk=0), params, ref_params, batch)
    assert_same_step(run(replace(config, logprob_chunk=3), params, ref_params, batch), slow,
                     params)
    assert_same_step(run(replace(config, logprob_chunk=3, head_remat=True), params, ref_params,
                         batch), slow, params)
    assert_same_step(slow, naive_result, params)


def test_unshared_prompts_fall_back_to_naive(params, ref_params):
    traj = make_traj(1, shared=False)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, packed=True)
    assert batch.packed is None  # groups do not share their prompt: the naive rows
    naive = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG)
    assert_same_step(run(PACKED, params, ref_params, batch),
                     run(NAIVE, params, ref_params, naive), params)


def test_packed_errors(params, ref_params):
    with pytest.raises(ValueError, match="TrainConfig.packed must be True or False"):
        TrainConfig(packed=1)
    batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=CFG, packed=True)
    # 4 groups cannot be split into 8 micro-batches of whole groups
    config = replace(PACKED, micro_batches=8)
    with pytest.raises(ValueError, match="do not split into micro_batches=8 whole groups"):
        run(config, params, ref_params, batch)
    # a hand-made packed layout whose rows are not contiguous groups
    shuffled = batch.replace(packed=batch.packed.replace(rows=batch.packed.rows[::-1]))
    with pytest.raises(ValueError, match="rows must be arange"):
        run(PACKED, params, ref_params, shuffled)
