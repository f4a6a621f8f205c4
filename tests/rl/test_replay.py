"""Rollout replay (rl.loops.replay) in the synchronous loop: the replay count; the FIFO's
capacity, informative-only admission and bit-exact JSON state; replay refused without an
off-policy correction; a replayed group keeps its original versions and behaviour
log-probs and the learner weights it by the clipped ratio π_θ/μ (checked against a
float64 hand computation); replay + dps and replay + dots runs resume bit for bit (the
buffer, the HMM beliefs, DOTS's reference difficulties all in the checkpoint).

Tiny-synthetic preset, 2 groups of 4, 8 eval prompts (the geometry of test_sync_loop)."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.decoder import forward
from rl.learner import TrainConfig, init_train_state, make_train_step
from rl.loops import (SchedulerOptions, StreamSampler, build_batch, rollout_spec, run,
                      sample_batch_groups)
from rl.loops.buffer import ScoredGroup
from rl.loops.replay import (
    ReplayBuffer,
    ReplayConfig,
    replay_count,
    replay_train_config,
)
from rl.loops.scheduling import make_prompt_source
from rl.objectives import AdvantageConfig, LossConfig
from rl.run import PRESETS, LoggingConfig, load_policy
from rl.trajectory import Trajectory

PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=4, prompts_per_step=2, group_size=4, eval_prompts=8,
                           eval_every=0, save_every=0, eval_greedy=False)
CLIP = 0.2
# PPO-clip with token-mean, no entropy / dual clip: the hand loss below is the whole loss.
BEHAVIOUR = TrainConfig(
    loss=LossConfig(name="ppo_clip", params={"clip_low": CLIP, "clip_high": CLIP,
                                             "dual_clip": None}, aggregation="token-mean"),
    advantage=AdvantageConfig("grpo"), optimizer=PRESET.train.optimizer, old_logp="behaviour")


def cfg(run_dir, loop=LOOP, **sections):
    """The preset with the BEHAVIOUR learner and this loop (and other sections, e.g.
    scheduler=), writing into run_dir, no wandb, no progress bar."""
    return dataclasses.replace(PRESET, train=BEHAVIOUR, loop=loop, run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False), **sections)


def tiny_group(seed: int, rewards, version: int = 0, n: int = 4) -> ScoredGroup:
    rng = np.random.default_rng(seed)
    traj = Trajectory(
        prompt_ids=rng.integers(0, 9, (n, 3)).astype(np.int32),
        prompt_lengths=np.full(n, 3, np.int32),
        response_ids=rng.integers(0, 9, (n, 2)).astype(np.int32),
        response_mask=np.ones((n, 2), bool),
        behaviour_logprobs=-rng.random((n, 2)).astype(np.float32),
        versions=np.full((n, 2), version, np.int32), group_ids=np.zeros(n, np.int32),
        finished=np.zeros(n, bool), truncated=np.ones(n, bool))
    return ScoredGroup(traj=traj, rewards={"correct": np.asarray(rewards, np.float64)})


def test_replay_count_is_the_rounded_fraction_within_buffer_and_one_fresh_group():
    assert replay_count(0.5, 8, 100) == 4
    assert replay_count(0.5, 8, 3) == 3          # no more than the buffer holds
    assert replay_count(0.99, 8, 100) == 7       # at least one fresh group
    assert replay_count(0.3, 8, 100) == 2        # round(2.4)
    assert replay_count(0.0, 8, 100) == 0
    with pytest.raises(ValueError, match="fresh"):
        ReplayConfig(fraction=1.0)


def test_buffer_is_a_bounded_fifo_of_informative_groups_with_an_exact_json_state():
    buf = ReplayBuffer(capacity=3, accuracy_name="correct")
    groups = [tiny_group(i, [0, 1, 0, 0.5]) for i in range(5)]
    flat = tiny_group(9, [1, 1, 1, 1])
    buf.push(groups[:2] + [flat], step=1)
    buf.push(groups[2:], step=2)
    held = [g for g, _ in buf.items]
    assert [id(g) for g in held] == [id(g) for g in groups[2:]]  # FIFO: the two oldest evicted, the all-equal group never stored
    assert buf.stats() == {"replay_buffer_groups": 3, "replay_pushed": 5, "replay_evicted": 2,
                           "replay_skipped": 1}
    restored = ReplayBuffer(capacity=3)
    restored.restore(json.loads(json.dumps(buf.state())))
    assert [s for _, s in restored.items] == [2, 2, 2]
    for (a, _), (b, _) in zip(buf.items, restored.items):
        assert a.live == b.live and sorted(a.rewards) == sorted(b.rewards)
        pairs = [(a.rewards[k], b.rewards[k]) for k in a.rewards]
        for x, y in pairs + list(zip(jax.tree.leaves(a.traj), jax.tree.leaves(b.traj))):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    pick = buf.sample(2, np.random.default_rng([0, 7]))
    again = restored.sample(2, np.random.default_rng([0, 7]))
    assert len({id(g) for g in pick}) == 2 and all(any(g is h for h in held) for g in pick)
    assert [np.asarray(g.traj.prompt_ids).tobytes() for g in pick] == [
        np.asarray(g.traj.prompt_ids).tobytes() for g in again]
    with pytest.raises(ValueError, match="held"):
        buf.sample(4, np.random.default_rng(0))


@pytest.fixture(scope="module")
def policy():
    config, params, task = load_policy(PRESET, 0)
    return config, jax.device_put(params, jax.devices()[0]), task


def test_replay_needs_an_offpolicy_correction(policy):
    config, params, task = policy
    current = dataclasses.replace(BEHAVIOUR, old_logp="current")
    with pytest.raises(ValueError, match="old_logp"):
        make_prompt_source(SchedulerOptions(replay_fraction=0.5), task, LOOP, params,
                           config=current)
    assert replay_train_config(current, ReplayConfig(0.5)).old_logp == "behaviour"
    assert replay_train_config(current, ReplayConfig(0.0)).old_logp == "current"
    versions = dataclasses.replace(BEHAVIOUR, old_logp="versions")
    assert replay_train_config(versions, ReplayConfig(0.5)) is versions


def hand_token_logprobs(params, model_config, tokens, temperature):
    """[B, T-1] float64 log π(token t+1): the log-softmax written out in float64."""
    z = np.asarray(forward(params, model_config, jnp.asarray(tokens)), np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return np.take_along_axis(logp[:, :-1], np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]


def test_replayed_group_keeps_its_versions_and_logprobs_and_gets_the_clipped_ratio(policy):
    config, params, task = policy
    source = make_prompt_source(SchedulerOptions(replay_fraction=0.5), task, LOOP, params,
                                config=BEHAVIOUR)
    step_fn = make_train_step(BEHAVIOUR, config)
    state = init_train_state(jax.tree.map(jnp.array, params), BEHAVIOUR, 0)
    spec = rollout_spec(config, task, dataclasses.replace(PRESET, train=BEHAVIOUR, loop=LOOP))
    sampler = StreamSampler(spec, BEHAVIOUR, LOOP, source=source)
    first, state, pos, stats = sample_batch_groups(state, 0, sampler)
    assert stats["replayed_groups"] == 0 and pos == 2 and len(source.replay) >= 1
    stored = [g for g, _ in source.replay.items]
    for _ in range(3):  # three updates: version 3, params well away from version 0's
        state, _ = step_fn(state, build_batch(first, spec, BEHAVIOUR))
    groups, state, pos, stats = sample_batch_groups(state, pos, sampler)
    assert stats["replayed_groups"] == 1 and stats["fresh_groups"] == 1 and pos == 3
    fresh, replayed = groups
    assert any(replayed is g for g in stored)  # the very group sampled at version 0, unchanged
    mask = np.asarray(replayed.traj.response_mask)
    assert (np.asarray(replayed.traj.versions)[mask] == 0).all()
    assert (np.asarray(fresh.traj.versions)[np.asarray(fresh.traj.response_mask)] == 3).all()
    batch = build_batch(groups, spec, BEHAVIOUR)
    rows = slice(4, 8)  # the replayed group's rows: its recorded μ and versions reach the batch
    resp = np.asarray(batch.loss_mask[rows])
    np.testing.assert_array_equal(np.asarray(batch.behaviour_logprobs[rows])[resp],
                                  np.asarray(replayed.traj.behaviour_logprobs)[mask])
    np.testing.assert_array_equal(np.asarray(batch.versions[rows])[resp], 0)

    # the step's loss against a float64 hand PPO-clip with ρ = π_θ / μ (μ recorded)
    tokens = np.asarray(batch.tokens)
    logp = hand_token_logprobs(state.params, config, tokens, BEHAVIOUR.temperature)
    m = np.asarray(batch.loss_mask)[:, 1:]
    mu = np.asarray(batch.behaviour_logprobs, np.float64)[:, 1:]
    ratio = np.exp(logp - mu)
    r = np.asarray(batch.rewards, np.float64)[:, 0].reshape(-1, 4)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    a = adv[:, None]
    per_token = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - CLIP, 1 + CLIP))
    want = per_token[m].sum() / m.sum()
    assert np.abs(ratio[4:][m[4:]] - 1).max() > 0.05  # the old group is really off-policy
    _, metrics = step_fn(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-4, atol=1e-6)
    on_policy = per_token.copy()  # what ignoring μ (ratio 1) would give: a different loss
    on_policy[4:] = -a[4:] * np.ones_like(ratio[4:])
    assert abs(on_policy[m].sum() / m.sum() - want) > 1e-3


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()

    def measured(k):
        return k.endswith(("_s", "_mb")) or k == "tokens_per_s"

    return [{k: v for k, v in json.loads(x).items() if not measured(k)} for x in lines]


@pytest.mark.parametrize("name", ["dps", "dots"])
def test_replay_with_a_scheduler_resumes_bit_exactly(policy, tmp_path, name):
    config, params, _ = policy
    _, _, task = load_policy(PRESET, 0)
    opts = SchedulerOptions(name, pool_size=6, reference_size=3, replay_fraction=0.5)
    full = run(config, params, task, cfg(tmp_path / "full", scheduler=opts))
    assert [r["replayed_groups"] for r in full.train] == [0, 1, 1, 1]
    short = dataclasses.replace(LOOP, steps=2)
    run(config, params, task, cfg(tmp_path / "split", short, scheduler=opts))
    resumed = run(config, params, task, cfg(tmp_path / "split", scheduler=opts), resume=True)
    train = [r for r in records(tmp_path / "full") if r["kind"] == "train"]
    assert train == [r for r in records(tmp_path / "split") if r["kind"] == "train"]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)))
    with pytest.raises(ValueError, match="replay"):  # resuming without replay is refused
        run(config, params, task, cfg(tmp_path / "split", dataclasses.replace(LOOP, steps=5),
                                      scheduler=SchedulerOptions(name, pool_size=6,
                                                                 reference_size=3)),
            resume=True)


def test_train_flags_build_the_options_and_async_refuses_them(tmp_path, capsys):
    from experiments.common.flags import build_train_parser, config_from_args
    from experiments.common.train_cli import main

    def scheduler_from_args(args):
        return config_from_args(args).scheduler

    args = build_train_parser().parse_args(["--prompt-scheduler", "dars", "--dars-budget", "256",
                                            "--dars-schedule", "hw"])
    assert scheduler_from_args(args) == SchedulerOptions("dars", dars_budget=256,
                                                         dars_schedule="hw")
    args = build_train_parser().parse_args(["--replay-fraction", "0.25", "--replay-capacity", "9"])
    assert scheduler_from_args(args) == SchedulerOptions(replay_fraction=0.25, replay_capacity=9)
    with pytest.raises(ValueError, match="fresh"):
        scheduler_from_args(build_train_parser().parse_args(["--replay-fraction", "1"]))
    with pytest.raises(SystemExit):
        main(["--max-staleness", "1", "--replay-fraction", "0.5", "--run-dir",
              str(tmp_path / "a"), "--steps", "1", "--wandb", "disabled"])
    assert "synchronous" in capsys.readouterr().err
