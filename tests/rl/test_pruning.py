"""Online rollout pruning (rl.rollout.pruning, ARRoL): the quality head's online update
against a float64 numpy hand computation, the balancing rule on hand cases, the hidden
state the engine scores against a full forward pass, a pruned rollout freeing its slots
(a new group starts there) and being counted, pruned rows reaching the learner with no
loss tokens and out of the group baseline, pruning off = the engine unchanged (the same
tokens as `generate`), and the sync loop with --prune: learns, resumes bit for bit."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from experiments.common.train_cli import main
from models.config import get_config
from models.decoder import Decoder, init_params
from rl.learner import TrainConfig
from rl.loops import run
from rl.loops.buffer import ScoredGroup
from rl.loops import RolloutSpec, build_batch
from rl.objectives import AdvantageConfig, compute_advantages
from rl.rollout import RolloutConfig, RolloutEngine, generate
from rl.rollout.pruning import (
    PruneConfig,
    Pruner,
    QualityHead,
    balanced_prune,
    pruned_rows,
    settle_rollouts,
)
from rl.rollout.sampler_state import SamplingConfig
from rl.run import PRESETS, LoggingConfig, load_policy
from rl.tasks import SyntheticTask
from rl.trajectory import Trajectory

N = 4


def hand_update(w, b, x, y, lr, l2, epochs):
    """The module doc's update, written out in float64 numpy."""
    w, b = np.array(w, np.float64), float(b)
    z = np.array(x, np.float64)
    z = z / np.sqrt((z ** 2).sum(axis=1, keepdims=True))
    y = np.array(y, np.float64)
    for _ in range(epochs):
        p = 1.0 / (1.0 + np.exp(-(z @ w + b)))
        w, b = w - lr * ((p - y) @ z / len(y) + l2 * w), b - lr * (p - y).mean()
    return w, b


def test_head_update_matches_a_float64_hand_computation():
    rng = np.random.default_rng(0)
    cfg = PruneConfig(lr=0.7, l2=0.01, epochs=3, warmup=5)
    head = QualityHead(cfg, 6)
    w, b = np.zeros(6), 0.0
    for m in (5, 3):  # two online batches
        x, y = rng.normal(size=(m, 6)) * 3.0, rng.random(m) > 0.5
        head.update(x, y)
        w, b = hand_update(w, b, x, y, 0.7, 0.01, 3)
        np.testing.assert_allclose(head.w, w, rtol=1e-12, atol=1e-15)
        assert abs(head.b - b) < 1e-12
    x = rng.normal(size=(4, 6))
    z = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_allclose(head.predict(x), 1 / (1 + np.exp(-(z @ w + b))), rtol=1e-12)
    assert head.seen == 8 and head.ready == (0 < head.positives < 8)
    again = QualityHead(cfg, 6)
    again.restore(json.loads(json.dumps(head.state())))  # plain JSON, exact
    assert np.array_equal(again.w, head.w) and again.b == head.b and again.seen == 8


def test_balanced_prune_hand_cases():
    # mostly-correct group: drop the confident ones until the mean is 0.5
    # remove 0 -> mean(.9,.9,.1) = .633; then remove 1 -> mean(.9,.1) = .5
    assert balanced_prune([.9, .9, .9, .1], [True] * 4, 0.5, 2) == [0, 1]
    # mostly-wrong group: drop the least promising (index 3, p=.05), then stop (.2,.8,.1 -> .367
    # is closer than removing any other)
    assert balanced_prune([.2, .8, .1, .05], [True] * 4, 0.5, 3) == [2, 3]
    assert balanced_prune([.2, .8, .3, .7], [True] * 4, 0.5, 2) == []  # already balanced
    assert balanced_prune([.9, .9, .9, .1], [False, False, True, True], 0.5, 2) == [2]
    assert balanced_prune([.9, .9, .9, .1], [True] * 4, 0.5, 0) == []


@pytest.fixture(scope="module")
def tiny():
    config = get_config("tiny", vocab_size=16)
    return config, init_params(config, 0)


def rc(**kw):
    base = dict(num_slots=N, group_size=N, segment_len=2, max_prompt_len=6, max_new_tokens=6,
                sampling=SamplingConfig(temperature=1.0), seed=3)
    return RolloutConfig(**{**base, **kw})


PROMPTS = [[1, 5, 6, 7, 3], [1, 4, 4, 9, 3], [1, 8, 3]]


class PruneGroupZero(Pruner):
    """Prunes every live sample of group 0 at its pruning point, nothing else; keeps the
    hidden states it was shown."""

    def __init__(self, config):
        super().__init__(PruneConfig(prune_at=2), config.hidden_size)
        self.shown = {}

    def decide(self, group_id, hidden, live):
        super().decide(group_id, hidden, live)
        self.shown[group_id] = hidden
        return [i for i in range(len(live)) if live[i]] if group_id == 0 else []


def test_pruned_rollout_frees_its_slots_and_is_counted(tiny):
    config, params = tiny
    pruner = PruneGroupZero(config)
    engine = RolloutEngine(config, rc(), pruner=pruner)
    engine.submit(PROMPTS[:2])
    info = engine.step(params, 0)
    assert (info.started_groups, info.pruned, info.live_slots) == (1, N, 0)
    assert engine.prune_counts == {"pruned": N, "pruned_tokens": 2 * N, "tokens_saved": 4 * N}
    first = engine.harvest()  # the group left as soon as no sample was live
    assert pruned_rows(first).all() and np.asarray(first.response_mask).sum(axis=1).tolist() == [2] * N
    # the hidden state the head saw = the final-normed hidden state at the last position
    resp = np.asarray(first.response_ids)[:, :2]
    for i in range(N):
        seq = np.asarray(PROMPTS[0] + resp[i].tolist())[None]
        h, _ = Decoder(config, return_hidden=True).apply(
            {"params": params}, seq, np.arange(seq.shape[1])[None],
            np.tril(np.ones((1, seq.shape[1], seq.shape[1]), bool)))
        np.testing.assert_allclose(pruner.shown[0][i], np.asarray(h[0, -1], np.float32),
                                   rtol=2e-4, atol=2e-4)
    info = engine.step(params, 0)
    assert info.started_groups == 1  # group 1 took the freed block at once
    while not engine.idle:
        engine.step(params, 0)
        if (part := engine.harvest()) is not None:
            second = part
    assert not pruned_rows(second).any() and np.asarray(second.truncated).all()
    assert np.asarray(second.response_mask).sum() == 6 * N
    assert set(pruner.pending) == {0, 1}


def test_pruning_off_is_the_engine_unchanged(tiny):
    config, params = tiny
    gen = generate(params, config, PROMPTS, max_new_tokens=6, rng=3, num_samples=N, stop_ids=(),
                   segment_len=2, sampling=SamplingConfig(temperature=1.0))

    def sample(pruner):
        engine = RolloutEngine(config, rc(num_slots=3 * N), pruner=pruner)
        engine.submit(PROMPTS)
        while not engine.idle:
            engine.step(params, 0)
            if (traj := engine.harvest()) is not None:
                return traj

    off = sample(None)
    idle = sample(Pruner(PruneConfig(warmup=10 ** 6), config.hidden_size))  # never ready
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(idle)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    ids, lp = np.asarray(off.response_ids), np.asarray(off.behaviour_logprobs)
    for g in range(3):
        for j in range(N):
            assert ids[g * N + j].tolist() == gen.tokens[g][j]
            assert np.array_equal(lp[g * N + j], gen.logprobs[g][j])
    assert not pruned_rows(off).any()


def test_pruned_rows_never_reach_the_learner_as_complete(tiny):
    config, _ = tiny
    rng = np.random.default_rng(1)
    b, r = 2 * N, 6
    lengths = np.array([6, 2, 2, 6, 6, 6, 6, 6])
    mask = np.arange(r)[None] < lengths[:, None]
    cut = np.array([False, True, True, False, False, False, False, False])
    traj = Trajectory.create(
        prompt_ids=np.tile([1, 5, 6, 3], (b, 1)), prompt_lengths=np.full(b, 4),
        response_ids=np.where(mask, rng.integers(4, 16, (b, r)), 0), response_mask=mask,
        behaviour_logprobs=np.where(mask, -1.0, 0.0), versions=np.zeros((b, r), int),
        group_ids=np.repeat([0, 1], N), finished=np.zeros(b, bool), truncated=~cut)
    correct = np.array([1.0, 0.0, 1.0, 0.25, 0.75, 0.5, 1.0, 0.0])
    pruner = Pruner(PruneConfig(warmup=0, lr=0.5, epochs=2), 8)
    feats = rng.normal(size=(2, N, 8))
    pruner.pending = {0: feats[0], 1: feats[1]}
    out, rewards, stats = settle_rollouts(pruner, traj, {"correct": correct}, correct, N)
    assert stats["pruned"] == 2
    # the head learned from the 6 survivors only, label = reward > 0.5
    keep = ~cut
    w, b0 = hand_update(np.zeros(8), 0.0, feats.reshape(b, 8)[keep], correct[keep] > 0.5,
                        0.5, PruneConfig().l2, 2)
    np.testing.assert_allclose(pruner.head.w, w, rtol=1e-12, atol=1e-15)
    assert pruner.head.seen == 6 and not pruner.pending
    # pruned rows: no response, rewards = the survivors' mean (1 + 0.25) / 2
    assert np.asarray(out.response_mask)[cut].sum() == 0
    np.testing.assert_array_equal(rewards["correct"], [1, .625, .625, .25, .75, .5, 1, 0])
    task = SyntheticTask(length=4, alphabet=4)
    tc = TrainConfig(advantage=AdvantageConfig("dr_grpo"))
    groups = [ScoredGroup(traj=jax.tree.map(lambda x: np.asarray(x)[g * N:(g + 1) * N], out),
                          rewards={"correct": rewards["correct"][g * N:(g + 1) * N]}, live=True)
              for g in range(2)]
    batch = build_batch(groups, RolloutSpec(task, config, group_size=N, segment_len=2), tc)
    lm = np.asarray(batch.loss_mask)
    assert lm[cut].sum() == 0 and (lm[~cut].sum(axis=1) == lengths[~cut]).all()
    adv = np.asarray(compute_advantages(tc.advantage, batch.rewards[:, 0], N).advantages)
    # survivors centred on the survivors' own mean, as if the pruned rows were never there
    want = np.array([1 - .625, 0, 0, .25 - .625, .75 - .5625, .5 - .5625, 1 - .5625,
                     0 - .5625])
    np.testing.assert_allclose(adv, want, atol=1e-6)


PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=2, prompts_per_step=2, group_size=4,
                           eval_prompts=8, eval_every=0, save_every=0, eval_greedy=False)
ROLLOUT = dataclasses.replace(PRESET.rollout, segment_len=2)


def cfg(run_dir, loop=LOOP, prune=None):
    """The preset with this loop and online pruning `prune`, writing into run_dir, no
    wandb, no progress bar."""
    return dataclasses.replace(PRESET, loop=loop, rollout=ROLLOUT, prune=prune,
                               run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False))


def test_sync_loop_with_prune_resumes_bit_exactly(tmp_path):
    config, params, task = load_policy(PRESET, 0)
    prune = PruneConfig(warmup=8, threshold=0.2)  # random policy: some rows > 1/4 right
    full = run(config, params, task, cfg(tmp_path / "full", prune=prune))
    run(config, params, task, cfg(tmp_path / "split", dataclasses.replace(LOOP, steps=1), prune))
    resumed = run(config, params, task, cfg(tmp_path / "split", prune=prune), resume=True)

    def records(d):
        def measured(k):
            return k.endswith(("_s", "_mb")) or k == "tokens_per_s"
        return [{k: v for k, v in json.loads(x).items() if not measured(k)}
                for x in (d / "metrics.jsonl").read_text().splitlines()
                if json.loads(x)["kind"] == "train"]

    assert records(tmp_path / "full") == records(tmp_path / "split")
    assert records(tmp_path / "full")[-1]["prune_pruned"] > 0  # the head restored, ready
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="no pruner state"):  # a checkpoint without --prune
        Pruner(prune, config.hidden_size).restore(None)


def test_train_with_prune_learns(tmp_path):
    out = main(["--steps", "40", "--segment-len", "2", "--prune", "--prune-warmup", "32",
                "--eval-prompts", "32", "--eval-every", "0", "--save-every", "0",
                "--run-dir", str(tmp_path / "run"), "--wandb", "disabled", "--no-progress"])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    evals = [r for r in lines if r["kind"] == "eval"]
    assert sum(r["prune_pruned"] for r in train) > 0 and train[-1]["prune_tokens_saved"] > 0
    assert evals[-1]["greedy_reward"] >= evals[0]["greedy_reward"] + 0.15, out
