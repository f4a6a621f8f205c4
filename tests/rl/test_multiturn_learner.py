"""The learner on multi-turn episodes: observation tokens are context, never targets.

Episodes are built by hand (prompt shared by each group of GROUP rows; 1..3 model turns of
1..2 tokens, an observation of 1..2 tokens after every turn but the last) with the loss
targets written down independently of Trajectory.model_mask. Against an independent
reference (per-sequence jax.grad through models.decoder.forward with test_trainer's
hand-written log-softmax): the step's update (naive and packed, outcome and turn credit),
behaviour log-probs / versions on observations change nothing, an observation's id does
change the gradient (it is context); turn credit against a float64 Python loop; exact
proximal log-probs of an episode whose turns came from different versions against a hand
computation per snapshot. Same geometry as tests/rl/test_trainer.py (vocab 16, T = 16)."""
import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import init_params
from rl.learner import TrainConfig, batch_from_trajectory, init_train_state, make_train_step
from rl.learner.config import OffPolicyConfig
from rl.learner.proximal import exact_proximal_logprobs
from rl.objectives import LossConfig
from rl.objectives.turn_credit import (
    TurnCreditConfig,
    episode_turns,
    token_turn_advantages,
    turn_advantages,
)
from rl.trajectory import Trajectory
from tests.rl.test_trainer import (
    CFG,
    FAST,
    LR,
    PG_CONFIG,
    TEMP,
    grpo_advantages_np,
    hand_seq_logprob,
)

B, GROUP, P_MAX, R_MAX, K = 8, 4, 4, 12, 3
TURN = TurnCreditConfig(name="turn", coef=0.5, gamma=0.9)


def make_episodes(seed, *, equal_turn_group=False):
    """(Trajectory, targets [B, P_MAX + R_MAX] bool: the model tokens in the batch's row
    layout, written down while building the episodes)."""
    rng = np.random.default_rng(seed)
    plen = np.repeat(rng.integers(1, P_MAX + 1, B // GROUP), GROUP)
    prompts = np.repeat(rng.integers(3, CFG.vocab_size, (B // GROUP, P_MAX)), GROUP, axis=0)
    prompts = prompts * (np.arange(P_MAX)[None] < plen[:, None])
    resp, env, tid, ver = (np.zeros((B, R_MAX), t) for t in (np.int32, bool, np.int32, np.int32))
    turn_rewards = np.zeros((B, K))
    targets = np.zeros((B, P_MAX + R_MAX), bool)
    for b in range(B):
        n_turns, first_version, pos = int(rng.integers(1, K + 1)), int(rng.integers(0, 2)), 0
        for k in range(n_turns):
            for is_obs in (False, True):
                if is_obs and k == n_turns - 1:
                    break
                n = int(rng.integers(1, 3))
                resp[b, pos:pos + n] = rng.integers(3, CFG.vocab_size, n)
                env[b, pos:pos + n] = is_obs
                tid[b, pos:pos + n] = k  # an observation carries the turn it answers
                ver[b, pos:pos + n] = first_version + k
                if not is_obs:
                    targets[b, plen[b] + pos:plen[b] + pos + n] = True
                pos += n
            turn_rewards[b, k] = rng.normal() if not (equal_turn_group and b < GROUP) else 1.0
    rmask = resp > 0
    traj = Trajectory.create(
        prompt_ids=prompts, prompt_lengths=plen, response_ids=resp, response_mask=rmask,
        behaviour_logprobs=np.where(rmask, -rng.random((B, R_MAX)) * 3, 0.0), versions=ver,
        group_ids=np.repeat(np.arange(B // GROUP), GROUP), finished=np.ones(B, bool),
        truncated=np.zeros(B, bool), rewards={"r": rng.normal(size=B)}, env_mask=env,
        turn_ids=tid, turn_rewards=turn_rewards)
    return traj, targets


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 11)


def step(config, params, batch):
    state = init_train_state(jax.tree.map(jnp.array, params), config, 0)  # donated: a copy
    new, metrics = make_train_step(config, CFG, compiler_options=FAST)(state, batch)
    return new.params, {k: float(v) for k, v in metrics.items()}


@partial(jax.jit, compiler_options=FAST)
def _weighted_grad(params, tokens, weights):
    """∇ Σ_t weights[t] log π(token t) of ONE sequence [1, T] (hand log-softmax)."""
    return jax.grad(hand_seq_logprob)(params, tokens, weights)


_hand_logprob = jax.jit(hand_seq_logprob, compiler_options=FAST)


def expected_sgd(params, batch, token_adv):
    """θ + (LR / B) Σ_i Σ_t A_it ∇ log π(token t) of PG_CONFIG's step (seq-mean-token-sum at
    ratio 1), A_it = token_adv [B, T] (0 off the targets), accumulated in float64."""
    out = jax.tree.map(lambda p: np.asarray(p, np.float64), params)
    for i in range(B):
        g = _weighted_grad(params, batch.tokens[i:i + 1], jnp.asarray(token_adv[i], jnp.float32))
        out = jax.tree.map(lambda e, gi: e + LR / B * np.asarray(gi, np.float64), out, g)
    return out


def assert_params_close(got, want, params, *, moved=1e-3):
    delta = [np.asarray(w, np.float64) - np.asarray(p) for w, p in
             zip(jax.tree.leaves(want), jax.tree.leaves(params))]
    scale = max(float(np.abs(d).max()) for d in delta)
    assert scale > moved  # the step really moves the params
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   atol=1e-5 * scale, rtol=1e-4)


def turn_advantages_loop(turn_rewards, n_turns, group, gamma, eps):
    """float64 loops: return-to-go per turn, normalised over the group's alive episodes."""
    b, k = turn_rewards.shape
    ret = [[0.0] * k for _ in range(b)]
    for i in range(b):
        for t in range(n_turns[i]):
            ret[i][t] = sum(gamma ** (u - t) * float(turn_rewards[i, u])
                            for u in range(t, n_turns[i]))
    out = np.zeros((b, k))
    for g0 in range(0, b, group):
        for t in range(k):
            alive = [i for i in range(g0, g0 + group) if n_turns[i] > t]
            if len(alive) < 2:
                continue
            mean = sum(ret[i][t] for i in alive) / len(alive)
            std = math.sqrt(sum((ret[i][t] - mean) ** 2 for i in alive) / (len(alive) - 1))
            for i in alive:
                out[i, t] = (ret[i][t] - mean) / (std + eps)
    return out


# ----------------------------------------------------------------------------- the mask
def test_loss_mask_is_the_model_tokens_only():
    traj, targets = make_episodes(0)
    for packed in (False, True):
        batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, packed=packed)
        np.testing.assert_array_equal(np.asarray(batch.loss_mask), targets)
        assert (batch.packed is not None) == packed
        assert batch.token_advantages is None  # outcome only: nothing per token


# ----------------------------------------------------------------------------- turn credit
def test_turn_advantages_equal_a_float64_loop():
    rng = np.random.default_rng(3)
    b, group = 12, 4
    n = rng.integers(1, K + 1, b)
    n[4:8] = K  # a group where every episode has every turn
    r = rng.normal(size=(b, K)) * (np.arange(K)[None] < n[:, None])
    r[8:12, 0] = 2.0  # equal first-turn rewards ...
    n[8:12] = 1  # ... and one turn each: equal returns -> exactly 0
    n[0], n[1:4] = 3, 1  # only episode 0 reaches turns 1, 2: fewer than 2 alive -> 0
    cfg = TurnCreditConfig(name="turn", gamma=0.8)
    got = np.asarray(turn_advantages(np.asarray(r, np.float64), n, group, cfg))
    want = turn_advantages_loop(r, n, group, 0.8, cfg.eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # float32 vs float64
    assert (got[8:12] == 0).all() and (got[0, 1:] == 0).all()
    assert np.abs(got[4:8]).max() > 0.5


def test_token_turn_advantages_place_the_turn_term_on_model_tokens():
    traj, _ = make_episodes(1)
    mm, tid = np.asarray(traj.model_mask), np.asarray(traj.turn_ids)
    n = np.asarray(episode_turns(tid, mm))
    assert n.tolist() == [int(tid[i][mm[i]].max()) + 1 for i in range(B)]
    per = np.asarray(token_turn_advantages(TURN, np.asarray(traj.turn_rewards, np.float64),
                                           tid, mm, GROUP))
    adv = turn_advantages_loop(np.asarray(traj.turn_rewards), n, GROUP, TURN.gamma, TURN.eps)
    for i in range(B):
        for t in range(R_MAX):
            want = TURN.coef * adv[i, tid[i, t]] if mm[i, t] else 0.0
            assert per[i, t] == pytest.approx(want, abs=1e-6)
    assert token_turn_advantages(TurnCreditConfig(), traj.turn_rewards, tid, mm, GROUP) is None
    with pytest.raises(ValueError, match="single-turn"):
        batch_from_trajectory(traj.replace(env_mask=None, turn_ids=None, turn_rewards=None),
                              group_size=GROUP, model_config=CFG, turn_credit=TURN)
    with pytest.raises(ValueError, match="gamma"):
        TurnCreditConfig(name="turn", gamma=1.5)


# ----------------------------------------------------------------------------- the step
@pytest.mark.parametrize("credit", [None, TURN], ids=["outcome", "turn"])
def test_step_trains_on_model_tokens_like_the_reference(params, credit):
    traj, targets = make_episodes(2)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, turn_credit=credit)
    got, metrics = step(PG_CONFIG, params, batch)
    adv = grpo_advantages_np(np.asarray(traj.rewards["r"]), GROUP)[:, None] * targets
    if credit is not None:  # + λ Â of each model token's turn, from the float64 loop
        n = np.asarray(episode_turns(traj.turn_ids, traj.model_mask))
        turn = turn_advantages_loop(np.asarray(traj.turn_rewards), n, GROUP, TURN.gamma, TURN.eps)
        plen, tid = np.asarray(traj.prompt_lengths), np.asarray(traj.turn_ids)
        for i in range(B):
            cols = np.flatnonzero(targets[i])
            adv[i, cols] += TURN.coef * turn[i, tid[i, cols - plen[i]]]
    assert_params_close(got, expected_sgd(params, batch, adv), params)
    assert metrics["tokens"] == targets.sum()


def test_packed_equals_naive_on_episodes(params):
    traj, _ = make_episodes(4)
    naive = step(PG_CONFIG, params, batch_from_trajectory(traj, group_size=GROUP,
                                                          model_config=CFG, turn_credit=TURN))
    packed_cfg = dataclasses.replace(PG_CONFIG, packed=True)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG, packed=True,
                                  turn_credit=TURN)
    assert batch.packed is not None
    got = step(packed_cfg, params, batch)
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(naive[0])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=0)
    for key in ("loss", "tokens", "adv_abs_mean", "entropy", "grad_norm"):
        np.testing.assert_allclose(got[1][key], naive[1][key], rtol=1e-5, atol=1e-6)


OFFPOLICY = [  # configs that read the behaviour log-probs and versions
    TrainConfig(loss=LossConfig(name="ppo_clip"), old_logp="behaviour", temperature=TEMP,
                optimizer=PG_CONFIG.optimizer,
                offpolicy=OffPolicyConfig(correction="truncated_is", level="sequence")),
    TrainConfig(loss=LossConfig(name="ppo_clip"), old_logp="versions", temperature=TEMP,
                optimizer=PG_CONFIG.optimizer),
]


@pytest.mark.parametrize("config", OFFPOLICY, ids=["behaviour", "versions"])
def test_observation_logprobs_and_versions_change_nothing(params, config):
    traj, _ = make_episodes(5)
    env = np.asarray(traj.env_mask)
    rng = np.random.default_rng(0)
    other = traj.replace(
        behaviour_logprobs=np.where(env, -rng.random(env.shape) * 20, traj.behaviour_logprobs),
        versions=np.where(env, rng.integers(0, 50, env.shape), traj.versions))
    want = step(config, params, batch_from_trajectory(traj, group_size=GROUP, model_config=CFG))
    got = step(config, params, batch_from_trajectory(other, group_size=GROUP, model_config=CFG))
    assert want[1]["grad_norm"] > 1e-3
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert got[1] == want[1]


def test_an_observation_token_is_context(params):
    traj, targets = make_episodes(6)
    env = np.asarray(traj.env_mask)
    row = 0 if env[0].any() else int(np.flatnonzero(env.any(axis=1))[0])
    col = int(np.flatnonzero(env[row])[0])  # a model token follows every observation
    ids = np.asarray(traj.response_ids).copy()
    ids[row, col] = 3 + (ids[row, col] - 3 + 5) % (CFG.vocab_size - 3)
    changed = traj.replace(response_ids=ids)
    adv = grpo_advantages_np(np.asarray(traj.rewards["r"]), GROUP)[:, None] * targets
    got = []
    for t in (traj, changed):
        batch = batch_from_trajectory(t, group_size=GROUP, model_config=CFG)
        np.testing.assert_array_equal(np.asarray(batch.loss_mask), targets)  # still no target
        new, _ = step(PG_CONFIG, params, batch)
        assert_params_close(new, expected_sgd(params, batch, adv), params)
        got.append(new)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])))
    assert diff > 1e-4  # the gradient depends on the observation's id


# ----------------------------------------------------------------------------- async
def test_exact_proximal_logprobs_of_episodes_with_mixed_versions(params):
    traj, targets = make_episodes(7)
    batch = batch_from_trajectory(traj, group_size=GROUP, model_config=CFG)
    versions = np.asarray(batch.versions)
    assert len(set(versions[targets].tolist())) >= 3  # turns of one episode differ too
    assert any(len(set(versions[i][targets[i]].tolist())) > 1 for i in range(B))
    snaps = {v: jax.tree.map(lambda x, v=v: x + 0.02 * v * jnp.sin(x * (v + 1)), params)
             for v in range(K + 1)}
    got = np.asarray(exact_proximal_logprobs(snaps, CFG, batch, TEMP))
    want = np.zeros(targets.shape)
    for i in range(B):
        tokens = batch.tokens[i:i + 1]
        for t in np.flatnonzero(targets[i]):
            onehot = np.zeros(targets.shape[1], np.float32)
            onehot[t] = 1.0
            want[i, t] = float(_hand_logprob(snaps[int(versions[i, t])], tokens, onehot))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert (got[~targets] == 0).all()
    # the right snapshot per token: the newest params alone would differ
    newest = np.asarray(exact_proximal_logprobs({v: snaps[K] for v in snaps}, CFG, batch, TEMP))
    assert np.abs(newest - want)[targets].max() > 1e-3

