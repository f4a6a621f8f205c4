"""TRACE turn-level trees (rl.rollout.trace, rl.loops.trace_rollouts): the mixed-outcome
probability against an enumeration of every outcome vector, the allocation rule against
"closest to p = 1/2" with a head set by hand, anchors of a hand-built episode, replay,
continued episodes against independent references (a full forward pass for their
log-probs, a fresh replay of the whole transcript for their outcome, the turn limit counted
from the prompt), hidden states against the model's logits, the loop end to end (the
prefix is never a loss target), a resume that restores the predictor, and the refusals."""
import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest

from experiments.common.flags import build_train_parser, config_from_args
from models.config import get_config
from models.decoder import forward, hidden_states, init_params
from models.logprobs import head_matrix
from rl.envs.base import EndReason, StepResult
from rl.envs.guess_number import GuessNumberEnv
from rl.loops import run
from rl.loops.episodes import EnvTask, sample_episode_groups
from rl.loops.rollouts import RolloutSpec
from rl.loops.trace_rollouts import (
    TraceRound,
    anchor_examples,
    hidden_at,
    row_tokens,
    trace_groups,
)
from rl.rollout.episodes import EpisodeRecord
from rl.rollout.multiturn import EpisodeStart
from rl.rollout.trace import (
    Anchor,
    ReplayMismatch,
    TraceAllocator,
    TraceConfig,
    episode_anchors,
    mixed_probability,
    replay,
    top_scores,
    unique_anchors,
)
from rl.run import PRESETS, LoggingConfig, RunConfig, load_policy
from rl.tasks.base import Prompt

N = 4


def test_mixed_probability_matches_enumeration():
    for p in (0.0, 0.1, 0.5, 0.73, 1.0):
        for k in (1, 2, 3, 5):
            want = sum(np.prod([p if o else 1 - p for o in out])
                       for out in itertools.product((0, 1), repeat=k) if 0 < sum(out) < k)
            assert mixed_probability(p, k) == pytest.approx(want, abs=1e-12)


def test_top_scores_and_unique_anchors():
    assert top_scores([0.2, 0.9, 0.9, 0.1, 0.5], 3) == [1, 2, 4]  # ties: lower index first
    assert top_scores([0.3], 0) == []
    pr = Prompt(ids=(1, 3), answer=0)
    a = [Anchor(pr, 1, (9, 4), ("1",), ("higher",)), Anchor(pr, 1, (10, 4), ("2",), ("higher",)),
         Anchor(pr, 1, (9, 4), ("1",), ("higher",)), Anchor(pr, 2, (9, 4, 12, 5), ("1", "4"),
                                                            ("higher", "lower"))]
    assert unique_anchors(a) == [0, 1, 3]
    assert a[3].continued_prompt().ids == (1, 3, 9, 4, 12, 5)


def test_stages_and_config_checks():
    assert TraceConfig().stages(2) == (1, 1)
    assert TraceConfig().stages(8) == (4, 4)
    assert TraceConfig(root_share=0.25).stages(8) == (2, 6)
    assert TraceConfig(root_share=0.01).stages(4) == (1, 3)  # at least one group each stage
    assert TraceConfig(root_share=0.99).stages(4) == (3, 1)
    with pytest.raises(ValueError, match="at least 2 groups"):
        TraceConfig().stages(1)
    for bad in ({"root_share": 1.0}, {"min_depth": 0}, {"warmup": -1}, {"lr": -1.0},
                {"threshold": float("nan")}):
        with pytest.raises(ValueError, match="TraceConfig"):
            TraceConfig(**bad)


def test_allocation_picks_the_predictions_closest_to_one_half():
    """With the head's weights set by hand, p̂ of each candidate is known; M_N(p) falls
    with |p - 1/2|, so the chosen are the k closest to 1/2 (an independent rule)."""
    alloc = TraceAllocator(TraceConfig(warmup=0), 3)
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(12, 3))
    is_root = [i < 5 for i in range(12)]
    # not ready (no examples of both classes yet): the first k roots, in order
    assert alloc.choose(feats, is_root, 3, N)[0] == [0, 1, 2]
    alloc.head.seen, alloc.head.positives = 10, 5
    alloc.head.w, alloc.head.b = np.array([2.0, -1.0, 0.5]), 0.3
    z = feats / np.linalg.norm(feats, axis=1, keepdims=True)
    p = 1 / (1 + np.exp(-(z @ alloc.head.w + alloc.head.b)))
    chosen, p_hat = alloc.choose(feats, is_root, 4, N)
    np.testing.assert_allclose(p_hat, p, atol=1e-12)
    assert chosen == sorted(range(12), key=lambda i: abs(p[i] - 0.5))[:4]
    restored = TraceAllocator(TraceConfig(warmup=0), 3)
    restored.restore(json.loads(json.dumps(alloc.state())))
    assert restored.choose(feats, is_root, 4, N)[0] == chosen
    with pytest.raises(ValueError, match="no TRACE predictor state"):
        restored.restore(None)


def test_episode_anchors_of_a_hand_built_record():
    pr = Prompt(ids=(1, 3), answer=5)
    rec = EpisodeRecord(group_id=0, sample=0, prompt=pr, turns=3, end_reason=EndReason.DONE,
                        turn_texts=["3", "6", "5"], observations=["higher", "lower"],
                        spans=[("model", 0, 1), ("env", 1, 2), ("model", 2, 3), ("env", 3, 4),
                               ("model", 4, 5)])
    resp = [11, 4, 14, 5, 13, 0, 0]
    got = episode_anchors(rec, resp)
    assert [(a.depth, a.prefix_ids, a.turn_texts, a.observations, k) for a, k in got] == [
        (1, (11, 4), ("3",), ("higher",), 2),
        (2, (11, 4, 14, 5), ("3", "6"), ("higher", "lower"), 4)]
    assert [a.depth for a, _ in episode_anchors(rec, resp, min_depth=2)] == [2]
    assert episode_anchors(dataclasses.replace(rec, end_reason=EndReason.TIMEOUT), resp) == []


def test_replay_retraces_and_refuses_a_different_observation():
    env = GuessNumberEnv(k=8, max_turns=4)
    pr = env.train_prompts(0, 1)[0]
    x = pr.answer
    g1 = 0 if x > 0 else 7
    obs1 = env.reset(pr).step(str(g1)).observation
    anchor = Anchor(pr, 1, (8 + g1, 4 if obs1 == "higher" else 5), (str(g1),), (obs1,))
    ep = replay(env, anchor)
    assert ep.step(str(x)).done  # the replayed episode is at turn 2 and finds x
    wrong = dataclasses.replace(anchor, observations=("invalid",))
    with pytest.raises(ReplayMismatch, match="deterministic"):
        replay(env, wrong)


@pytest.fixture(scope="module")
def guess():
    env = GuessNumberEnv(k=8, max_turns=4)
    cfg = get_config("tiny", vocab_size=env.vocab_size)
    params = init_params(cfg, 0)
    spec = RolloutSpec(task=EnvTask(env), model_config=cfg, group_size=N, segment_len=1)
    return env, cfg, params, spec


def test_continued_episodes_against_independent_references(guess):
    """Continue N episodes from a depth-2 anchor of a sampled episode: each row's
    behaviour log-probs equal a full forward pass over prompt + prefix + continuation, its
    outcome equals a fresh replay of the whole transcript, and its turns count the
    prefix's (at most max_turns in all)."""
    env, cfg, params, spec = guess
    prompts = env.train_prompts(0, 4)
    traj, recs = sample_episode_groups(params, 0, spec, prompts, seed=3)
    _, anchors = anchor_examples(traj, recs, 2)
    assert anchors, "a random policy makes some episodes of >= 3 turns"
    anchor = anchors[0][0]
    start = EpisodeStart(turns=anchor.depth, reset=lambda: replay(env, anchor))
    traj2, recs2 = sample_episode_groups(params, 0, spec, [anchor.continued_prompt()],
                                         seed=5, starts=[start])
    plen = np.asarray(traj2.prompt_lengths)
    assert (plen == len(anchor.ids)).all()
    for i, rec in enumerate(recs2):
        ids = row_tokens(traj2)[i]
        assert ids[:len(anchor.ids)] == list(anchor.ids)
        logits = np.asarray(forward(params, cfg, np.asarray([ids])), np.float64)[0]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                       keepdims=True)) \
            - logits.max(-1, keepdims=True)
        p = int(plen[i])
        model = np.asarray(traj2.model_mask)[i]
        for r in np.nonzero(model)[0]:
            want = logp[p + r - 1, ids[p + r]]
            assert np.asarray(traj2.behaviour_logprobs)[i, r] == pytest.approx(want, abs=2e-5)
        assert rec.turns <= env.max_turns and rec.turns == anchor.depth + len(rec.turn_texts)
        whole = env.reset(anchor.prompt)
        for text in list(anchor.turn_texts) + rec.turn_texts:
            last = whole.step(text)
        assert rec.outcome == whole.outcome()
        assert rec.end_reason == (EndReason.DONE if last.done else EndReason.MAX_TURNS)


def test_hidden_states_are_what_the_head_reads(guess):
    env, cfg, params, _ = guess
    tokens = np.asarray([[1, 3, 9, 4, 12, 5, 10], [1, 3, 15, 5, 0, 0, 0]])
    h = np.asarray(hidden_states(params, cfg, tokens), np.float64)
    logits = np.asarray(forward(params, cfg, tokens), np.float64)
    np.testing.assert_allclose(h @ np.asarray(head_matrix(params, cfg), np.float64), logits,
                               atol=1e-4)
    got = hidden_at(params, cfg, [[1, 3, 9, 4, 12, 5, 10], [1, 3, 15, 5]],
                    [(0, 6), (1, 3), (0, 1)], 9)
    np.testing.assert_allclose(got, h[[0, 1, 0], [6, 3, 1]], atol=1e-5)


def test_trace_groups_continue_anchors_once_the_predictor_is_ready(guess):
    env, cfg, params, spec = guess
    # stage 1 gives at most 8 rows x (root + 3 anchors) = 32 examples: not ready at first
    alloc = TraceAllocator(TraceConfig(warmup=33, threshold=0.0), cfg.hidden_size)
    seen = []
    for step in range(3):
        traj, c = trace_groups(params, 0, spec, env.train_prompts(4 * step, 4), seed=step,
                               first_group_id=4 * step,
                               trace=TraceRound(alloc, lambda r: r["score"]))
        assert traj.batch_size == 4 * N and traj.prompt_ids.shape[1] == env.max_episode_tokens - 1
        assert np.asarray(traj.group_ids).tolist() == np.repeat(np.arange(4), N).tolist()
        assert c["root_groups"] + c["anchor_groups"] == 2 and c["replay_failures"] == 0
        seen.append(c)
    assert seen[0]["head_ready"] == 0  # GRPO until ready
    assert all(c["anchor_groups"] == 0 for c in seen if not c["head_ready"])
    assert seen[1]["head_ready"] == 1  # stage 1 + 2 of the first batch: >= 33 examples


class FlakyEpisode:
    calls = 0

    def __init__(self):
        FlakyEpisode.calls += 1
        self.turns, self.offset = 0, FlakyEpisode.calls

    def step(self, text):
        self.turns += 1
        return StepResult(f"obs{self.offset}", 0.0, False)  # differs between episodes

    def outcome(self):
        return {"score": 0.0}


def test_a_replay_that_differs_ends_the_continuation_and_is_counted(guess):
    env, cfg, params, _ = guess

    @dataclasses.dataclass(frozen=True)
    class Flaky(type(env)):
        def reset(self, prompt):
            return FlakyEpisode()

        def encode_observation(self, text):
            return [4]

    class LastAnchor(TraceAllocator):  # always continue the last anchor offered
        def choose(self, hidden, is_root, k, group_size):
            return [len(is_root) - 1] * k, np.full((len(is_root),), 0.5)

    flaky = Flaky(k=8, max_turns=4)
    spec = RolloutSpec(task=EnvTask(flaky), model_config=cfg, group_size=N, segment_len=1)
    alloc = LastAnchor(TraceConfig(), cfg.hidden_size)
    traj, c = trace_groups(params, 0, spec, flaky.train_prompts(0, 2), seed=0,
                           first_group_id=0, trace=TraceRound(alloc, lambda r: r["score"]))
    assert c["anchor_groups"] == 1 and c["replay_failures"] == N
    assert (np.asarray(traj.rewards["score"])[N:] == 0).all()


# ----------------------------------------------------------------------------- the loop
PRESET = PRESETS["tiny-guess"]


def trace_cfg(run_dir, steps=3, **trace):
    loop = dataclasses.replace(PRESET.loop, steps=steps, prompts_per_step=4, group_size=N,
                               eval_prompts=8, eval_every=0, save_every=0, eval_greedy=False)
    return dataclasses.replace(PRESET, loop=loop, trace=TraceConfig(warmup=8, threshold=0.0,
                                                                    **trace),
                               run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False))


def train_records(d):
    def measured(k):  # wall-clock measurements (the slot clock's shares among them)
        return k.endswith(("_s", "_mb")) or k in (
            "tokens_per_s", "slot_held", "tool_calls_in_flight", "slot_occupancy",
            "tool_wait_share", "tokens_per_s_tools_running")
    return [{k: v for k, v in json.loads(x).items() if not measured(k)}
            for x in (d / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "train"]


def test_loop_with_trace_trains_continuations_only_and_resumes_bit_exactly(tmp_path):
    config, params, task = load_policy(PRESET, 0)
    full = run(config, params, task, trace_cfg(tmp_path / "full"))
    recs = train_records(tmp_path / "full")
    assert len(recs) == 3 and any(r["trace_anchor_groups"] > 0 for r in recs)
    for r in recs:  # one token per turn; an episode's turns count its prefix's, which the
        # loss never sees (it was trained on in the episode it came from)
        prefix_turns = r["trace_anchor_depth"] * r["trace_anchor_groups"] * N
        assert r["tokens"] == pytest.approx(r["episode_turns"] * 4 * N - prefix_turns)
    run(config, params, task, trace_cfg(tmp_path / "split", steps=1))
    resumed = run(config, params, task, trace_cfg(tmp_path / "split"), resume=True)
    assert train_records(tmp_path / "split") == recs
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_trace_config_round_trips_and_refusals(tmp_path):
    cfg = trace_cfg(tmp_path)
    assert RunConfig.from_json(cfg.to_json()) == cfg
    cfg.validate()
    for change, match in (
            ({"task": "synthetic"}, "single-turn task"),
            ({"loop": dataclasses.replace(cfg.loop, prompts_per_step=1)}, ">= 2"),
            ({"loop": dataclasses.replace(cfg.loop, dynamic_sampling=True)}, "dynamic sampling")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(cfg, **change).validate()
    with pytest.raises(ValueError, match="turn-level credit"):
        cfg.override("task.options", {"k": 8, "max_turns": 4, "turn_credit": "turn"}).validate()
    with pytest.raises(ValueError, match="goes with --trace"):
        config_from_args(build_train_parser().parse_args(["--env", "guess_number",
                                                          "--trace-warmup", "4"]))
    got = config_from_args(build_train_parser().parse_args(
        ["--env", "guess_number", "--trace", "--trace-root-share", "0.25"]))
    assert got.trace == TraceConfig(root_share=0.25)
