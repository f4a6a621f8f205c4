"""Trajectory's multi-turn fields: validation, concatenation, and the learner's loss mask
(observation tokens are context, never targets)."""
import numpy as np
import pytest

from models.config import get_config
from rl.learner.batch import batch_from_trajectory
from rl.trajectory import Trajectory, concat_trajectories


def episode_batch(turns=3):
    # row 0: prompt [5, 6], response = turn 0 (2 tokens), obs (2), turn 1 (1 token)
    # row 1: prompt [5, 6], response = turn 0 (1 token), obs (1), turn 1 (2), obs (1), turn 2 (1)
    resp = np.array([[7, 8, 9, 9, 7, 0, 0], [8, 9, 7, 8, 9, 7, 0]])
    rmask = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]], bool)
    env = np.array([[0, 0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 1, 0, 0]], bool)
    turn = np.array([[0, 0, 0, 0, 1, 0, 0], [0, 0, 1, 1, 1, 2, 0]])
    lp = np.where(rmask & ~env, -0.5, 0.0)
    return Trajectory.create(
        prompt_ids=[[5, 6], [5, 6]], prompt_lengths=[2, 2], response_ids=resp,
        response_mask=rmask, behaviour_logprobs=lp, versions=np.zeros_like(resp),
        group_ids=[0, 0], finished=[True, True], truncated=[False, False],
        rewards={"r": [1.0, 0.0]}, env_mask=env, turn_ids=turn,
        turn_rewards=np.zeros((2, turns)))


def test_loss_mask_excludes_observation_tokens():
    traj = episode_batch()
    batch = batch_from_trajectory(traj, group_size=2, model_config=get_config("tiny", vocab_size=16))
    # hand-written: token t of the row is [prompt(2), response...]; targets = model tokens
    want = np.zeros((2, 9), bool)
    want[0, [2, 3, 6]] = True
    want[1, [2, 4, 5, 7]] = True
    np.testing.assert_array_equal(np.asarray(batch.loss_mask), want)
    assert traj.num_model_tokens() == 7 and traj.num_tokens() == 11


def test_multi_turn_fields_are_validated():
    traj = episode_batch()
    with pytest.raises(ValueError, match="come together"):
        traj.replace(turn_ids=None).validate()
    bad = np.asarray(traj.env_mask).copy()
    bad[0, 6] = True  # outside the response
    with pytest.raises(ValueError, match="outside response_mask"):
        traj.replace(env_mask=bad).validate()
    with pytest.raises(ValueError, match="non-finite"):
        traj.replace(turn_rewards=np.full((2, 3), np.nan, np.float32)).validate()


def test_concat_pads_turns_and_refuses_mixing():
    a, b = episode_batch(turns=2), episode_batch(turns=4)
    both = concat_trajectories([a, b])
    assert both.turn_rewards.shape == (4, 4)
    np.testing.assert_array_equal(np.asarray(both.env_mask[2:]), np.asarray(b.env_mask))
    single = a.replace(env_mask=None, turn_ids=None, turn_rewards=None)
    with pytest.raises(ValueError, match="cannot mix"):
        concat_trajectories([a, single])
