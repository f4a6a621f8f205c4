"""Multi-turn rollout engine tests (rl/rollout/multiturn.py, append.py, episodes.py) on the
tiny model in fp32 with a scripted, deterministic environment defined here: observations
are a function of the turn's ids (variable length), turns end on stop ids or the turn
budget (ragged), episodes end after different numbers of turns.

References are independent of the engine: a teacher-forced models.decoder.forward over the
whole episode (prompt + turns + observations) and a float64 log-softmax; observation ids
recomputed from the turn ids by the script's own rule; token counts by hand."""
import logging
import math

import numpy as np
import pytest

from models.config import get_config
from models.decoder import forward, init_params
from rl.envs.base import EndReason, StepResult
from rl.rollout.multiturn import MultiTurnConfig, MultiTurnEngine
from rl.rollout.sampler_state import SamplingConfig
from rl.tasks.base import Prompt
from tests.rl.scripted_env import IdTextEnv

CFG = get_config("tiny")  # fp32
STOPS = tuple(range(3, 256, 23))  # ~1/23 of the vocabulary ends a turn: ragged turns
T = 0.7
WIDTH = 96  # teacher-forced forward width (>= max_episode_tokens)


def observation_ids(turn_ids):
    """The script's rule: 1..6 ids, a function of the turn's ids."""
    s = int(sum(turn_ids))
    return [(s * 7 + 11 * j) % 200 + 40 for j in range(1 + s % 6)]


class ScriptedEpisode:
    def __init__(self, prompt, behaviour):
        self.prompt, self.behaviour, self.turn = prompt, behaviour, 0
        # episodes end after 2..4 turns (a function of the prompt), unless max_turns first
        self.last = 2 + prompt.ids[0] % 3
        self.total = 0.0

    def step(self, text):
        self.turn += 1
        ids = [int(t) for t in text.split()]
        b = self.behaviour
        if b == "raise" and self.turn == 2:
            raise RuntimeError("scripted failure")
        if b == "nonstr" and self.turn == 1:
            return StepResult(observation=5, reward=0.0)
        if b == "nan" and self.turn == 1:
            return StepResult(observation="1", reward=float("nan"))
        if b == "tuple":
            return ("not", "a", "StepResult")
        reward = 0.1 * len(ids)
        self.total += reward
        obs = " ".join(map(str, observation_ids(ids)))
        if b == "huge" and self.turn == 1:
            obs = " ".join(["50"] * 60)
        return StepResult(observation=obs, reward=reward, done=self.turn >= self.last,
                          info={"turn": self.turn})

    def outcome(self):
        if self.behaviour == "outcome":
            raise ValueError("no outcome")
        return {"total": self.total, "turns": float(self.turn)}


class ScriptedEnv(IdTextEnv):
    name = "scripted"
    reward_names = ("total", "turns")
    stop_ids = STOPS
    PROMPTS = ((5, 17, 33), (9, 10, 11, 12, 13, 200), (7, 7, 8), (100, 101, 102, 103), (60,),
               (31, 32))

    def __init__(self, behaviours=None):
        self.behaviours = behaviours or {}

    def reset(self, prompt):
        if self.behaviours.get(prompt.index) == "reset":
            raise KeyError("cannot reset")
        return ScriptedEpisode(prompt, self.behaviours.get(prompt.index))


def prompts():
    return ScriptedEnv().prompts()


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


@pytest.fixture(scope="module")
def rollout(params):
    """rollout(layout, mode) -> (engine, rows) of the plain scripted env at temperature T,
    run once per (layout, mode) and shared by the tests that read that same rollout (each
    test only reads it; the engine is seeded, so a rerun would give the same rows)."""
    done = {}

    def get(layout, mode="append"):
        if (layout, mode) not in done:
            done[layout, mode] = run(params, ScriptedEnv(), layout=layout, mode=mode)
        return done[layout, mode]
    return get


def run(params, env, *, layout="segmented", mode="append", sampling=SamplingConfig(temperature=T),
        n=2, slots=4, ps=None):
    eng = MultiTurnEngine(CFG, env, MultiTurnConfig(num_slots=slots, group_size=n, segment_len=5,
                                                    sampling=sampling, kv_layout=layout,
                                                    mode=mode))
    eng.submit(prompts() if ps is None else ps)
    batches, v = [], 0
    while not eng.idle:
        eng.step(params, v)
        v += 1
        if (b := eng.harvest()) is not None:
            batches.append(b)
    rows = [(b.trajectory, i, b.episodes[i]) for b in batches for i in range(len(b.episodes))]
    return eng, sorted(rows, key=lambda r: (r[2].group_id, r[2].sample))


def row_arrays(traj, i):
    p = int(traj.prompt_lengths[i])
    k = int(traj.response_lengths[i])
    g = lambda x: np.asarray(x[i, :k])  # noqa: E731
    return (np.asarray(traj.prompt_ids[i, :p]), g(traj.response_ids), g(traj.behaviour_logprobs),
            g(traj.env_mask), g(traj.turn_ids), g(traj.versions))


def assert_rows_equal(xa, xb):
    """Same ids, masks and versions; log-probs to float rounding (the batch around a
    slot changes the shapes its numbers are computed in)."""
    for u, w in zip(xa, xb):
        if u.dtype == np.float32:
            np.testing.assert_allclose(u, w, atol=1e-5)
        else:
            np.testing.assert_array_equal(u, w)


def teacher_forced(params, rows):
    """float64 log-softmax rows [len - 1, V] of logits / T and argmax, from one padded
    forward over every episode (prompt + response)."""
    toks = np.zeros((-(-len(rows) // 8) * 8, WIDTH), np.int32)
    for j, (traj, i, _) in enumerate(rows):
        p, r = row_arrays(traj, i)[:2]
        toks[j, :p.size + r.size] = np.concatenate([p, r])
    logits = np.concatenate([np.asarray(forward(params, CFG, toks[k:k + 8]))
                             for k in range(0, len(toks), 8)]).astype(np.float64)
    return toks, logits


def check_against_forward(params, rows, greedy=False):
    toks, logits = teacher_forced(params, rows)
    for j, (traj, i, rec) in enumerate(rows):
        p, r, lp, env, turn_ids, _ = row_arrays(traj, i)
        assert r.size > 0
        for t in range(r.size):
            if env[t]:
                assert lp[t] == 0.0
                continue
            z = logits[j, p.size - 1 + t] / (1.0 if greedy else T)
            ref = z[r[t]] - (z.max() + math.log(np.exp(z - z.max()).sum()))
            assert abs(lp[t] - ref) <= 1e-5, (j, t, lp[t], ref)
            if greedy:
                assert r[t] == int(np.argmax(logits[j, p.size - 1 + t]))


def check_structure(rows, env):
    """env_mask covers exactly the observations, which follow the script's rule; turns
    end on a stop id or the turn budget; turn ids; records agree."""
    for traj, i, rec in rows:
        p, r, lp, envm, turn_ids, _ = row_arrays(traj, i)
        pos, turn = 0, 0
        expect_env = np.zeros(r.size, bool)
        while pos < r.size:
            start = pos
            while pos < r.size and pos - start < env.max_turn_tokens and r[pos] not in STOPS:
                pos += 1
            if pos < r.size and r[pos] in STOPS and pos - start < env.max_turn_tokens:
                pos += 1  # the stop id belongs to the turn
            assert (turn_ids[start:pos] == turn).all()
            turn += 1
            if pos == r.size:
                break
            obs = observation_ids(r[start:pos].tolist())
            assert r[pos:pos + len(obs)].tolist() == obs
            assert (turn_ids[pos:pos + len(obs)] == turn - 1).all()
            expect_env[pos:pos + len(obs)] = True
            pos += len(obs)
        assert (envm == expect_env).all()
        assert rec.turns == turn and len(rec.turn_texts) == turn
        assert [s[0] for s in rec.spans] == ["model", "env"] * (turn - 1) + ["model"]


@pytest.mark.parametrize("layout", ["segmented", "replicated"])
def test_rollout_matches_teacher_forced_forward(params, rollout, layout):
    env = ScriptedEnv()
    eng, rows = rollout(layout)
    assert len(rows) == 2 * len(prompts())
    assert sorted({int(t.group_ids[i]) for t, i, _ in rows}) == list(range(len(prompts())))
    check_against_forward(params, rows)
    check_structure(rows, env)
    reasons = {rec.end_reason for _, _, rec in rows}
    assert EndReason.DONE in reasons and EndReason.MAX_TURNS in reasons
    assert len({rec.turns for _, _, rec in rows}) >= 2  # episodes end at different turns
    lengths = [len(t.split()) for _, _, rec in rows for t in rec.turn_texts]
    assert len(set(lengths)) >= 3  # ragged turns
    for traj, i, rec in rows:
        assert rec.outcome == {"total": pytest.approx(0.1 * sum(lengths_of(rec))),
                               "turns": float(rec.turns)}
        assert float(traj.rewards["turns"][i]) == rec.turns
        tr = np.asarray(traj.turn_rewards[i])
        np.testing.assert_allclose(tr[:rec.turns], [0.1 * n for n in lengths_of(rec)], rtol=1e-6)
        assert (tr[rec.turns:] == 0).all()
        assert bool(traj.finished[i]) == (rec.end_reason == EndReason.DONE)


def lengths_of(rec):
    return [len(t.split()) for t in rec.turn_texts]


def test_greedy_eval_and_versions(params):
    env = ScriptedEnv()
    _, rows = run(params, env, sampling=SamplingConfig(greedy=True), layout="replicated")
    check_against_forward(params, rows, greedy=True)
    check_structure(rows, env)
    for traj, i, rec in rows:
        _, r, _, envm, _, ver = row_arrays(traj, i)
        assert (np.diff(ver) >= 0).all()  # steps are stamped 0, 1, 2, ...
        for kind, lo, hi in rec.spans:
            if kind == "env":  # observation tokens: the version of the turn they answer
                assert (ver[lo:hi] == ver[lo - 1]).all()


@pytest.mark.parametrize("layout", ["segmented", "replicated"])
def test_reprefill_twin_gives_the_same_tokens(rollout, layout):
    _, a = rollout(layout, "append")
    _, b = rollout(layout, "reprefill")
    assert len(a) == len(b)
    for (ta, i, ra), (tb, j, rb) in zip(a, b):
        assert_rows_equal(row_arrays(ta, i), row_arrays(tb, j))
        assert ra.turn_texts == rb.turn_texts and ra.end_reason == rb.end_reason


def test_observation_tokens_processed_once(rollout):
    """Append mode: the model passes over an episode's tokens once each, but the last:
    segmented prefill P - 1 per group, decode = model tokens, append = observation tokens."""
    for layout in ("segmented", "replicated"):
        eng, rows = rollout(layout)
        model = sum(int(np.asarray(t.model_mask[i]).sum()) for t, i, _ in rows)
        obs = sum(int(np.asarray(t.env_mask[i]).sum()) for t, i, _ in rows)
        prompt = sum(len(p.ids) - (layout == "segmented") for p in prompts())
        assert eng.token_counts == {"prefill": prompt, "decode": model, "append": obs,
                                    "reprefill": 0}
    eng_r, rows_r = rollout("replicated", "reprefill")
    # reprefill: at each boundary the slot's whole context (prompt + response so far + obs)
    hand = 0
    for traj, i, rec in rows_r:
        p = int(traj.prompt_lengths[i])
        hand += sum(p + hi for kind, _, hi in rec.spans if kind == "env")
    assert eng_r.token_counts["reprefill"] == hand and eng_r.token_counts["append"] == 0
    assert eng_r.token_counts["decode"] == eng.token_counts["decode"]


@pytest.fixture(scope="module")
def clean(rollout):
    return rollout("replicated")[1]


@pytest.mark.parametrize("behaviour,reason", [
    ("raise", EndReason.ENV_ERROR), ("nonstr", EndReason.BAD_RESULT),
    ("nan", EndReason.BAD_RESULT), ("tuple", EndReason.BAD_RESULT),
    ("huge", EndReason.TOKEN_BUDGET), ("reset", EndReason.ENV_ERROR),
    ("outcome", EndReason.ENV_ERROR)])
def test_misbehaving_env_ends_only_its_episodes(params, clean, behaviour, reason, caplog):
    bad = 2  # prompt index 2 (group 2) misbehaves
    with caplog.at_level(logging.WARNING, logger="rl.rollout.episodes"):
        _, rows = run(params, ScriptedEnv({bad: behaviour}), layout="replicated")
    assert len(rows) == len(clean)
    for (tc, i, rc), (tb, j, rb) in zip(clean, rows):
        assert int(tc.group_ids[i]) == int(tb.group_ids[j])
        if int(tb.group_ids[j]) != bad:  # everything else intact
            # (versions = step numbers differ: the failed group frees its slots earlier)
            assert_rows_equal(row_arrays(tc, i)[:-1], row_arrays(tb, j)[:-1])
            assert rc.outcome == rb.outcome and rc.end_reason == rb.end_reason
            continue
        assert rb.end_reason == reason and rb.message
        assert rb.message in caplog.text or rb.message.split(" (")[0] in caplog.text
        if behaviour in ("reset", "outcome"):  # no episode / a failed outcome: zeros
            assert rb.outcome == {"total": 0.0, "turns": 0.0}
        else:  # the episode's own outcome, called once after it ended
            assert rb.outcome["turns"] == (2.0 if behaviour == "raise" else 1.0)
        assert float(tb.rewards["total"][j]) == pytest.approx(rb.outcome["total"], rel=1e-6)
        assert bool(tb.truncated[j]) == (reason == EndReason.TOKEN_BUDGET)
        n = int(tb.response_lengths[j])
        if behaviour == "reset":
            assert n == 0 and rb.turns == 0
        elif behaviour in ("nonstr", "nan", "tuple", "huge"):
            # ended after its first turn: the response is that turn, no observation
            assert rb.turns == 1 and not np.asarray(tb.env_mask[j]).any()
            assert n == len(rb.turn_texts[0].split())
    if behaviour in ("reset", "outcome", "raise"):
        assert "raised" in caplog.text


def test_invalid_inputs(params):
    env = ScriptedEnv()
    with pytest.raises(ValueError, match="mode"):
        MultiTurnConfig(num_slots=4, group_size=2, segment_len=4, mode="fast")
    with pytest.raises(ValueError, match="num_slots"):
        MultiTurnConfig(num_slots=1, group_size=2, segment_len=4)
    eng = MultiTurnEngine(CFG, env, MultiTurnConfig(num_slots=4, group_size=2, segment_len=4))
    with pytest.raises(ValueError, match="Prompt"):
        eng.submit([[1, 2, 3]])
    with pytest.raises(ValueError, match="max_prompt_len"):
        eng.submit([Prompt(ids=tuple(range(1, 20)), answer=None)])

    class Broken(ScriptedEnv):
        max_episode_tokens = 8
    with pytest.raises(ValueError, match="max_episode_tokens"):
        MultiTurnEngine(CFG, Broken(), MultiTurnConfig(num_slots=4, group_size=2, segment_len=4))


@pytest.mark.parametrize("layout", ["segmented", "replicated"])
def test_append_tokens_against_a_reprefill_of_the_whole_context(params, layout):
    """The primitive: appending observations to two slots of a block leaves every earlier
    cache entry (and every other slot) bitwise untouched, and its new entries, pending
    token and bookkeeping equal load_samples' rebuild of prompt + response + observation."""
    from rl.rollout.append import append_tokens
    from rl.rollout.sampler import decode_segment, load_samples, prefill, read_slots
    from rl.rollout.sampler_state import init_state, sample_keys

    st = init_state(CFG, num_slots=4, max_prompt_len=8, max_new_tokens=40,
                    sampling=SamplingConfig(temperature=T), group_size=2, kv_layout=layout)
    st = prefill(params, st, [[5, 17, 33], [9, 10, 11, 12, 13]], np.arange(4).reshape(2, 2),
                 sample_keys(0, [0, 1], 2), max_new_tokens=7)
    st = decode_segment(params, st, 7, 3)
    before = read_slots(st, range(4))
    obs = {1: [44, 45, 46], 2: [60], 3: [70, 71, 72, 73, 74, 75, 76, 77, 78]}  # ragged
    slots = sorted(obs)
    app = append_tokens(params, st, slots, [obs[s] for s in slots], [3, 3, 3], [30, 25, 39])
    grown = [before[0]] + [
        grow_sample(before[s], obs[s], 3, b) for s, b in zip(slots, [30, 25, 39])]
    ref = load_samples(params, st, grown, range(4))
    a, r = read_slots(app, range(4)), read_slots(ref, range(4))
    for x, y in zip(a, r):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_array_equal(x.versions, y.versions)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)
        assert (x.budget, x.done, x.stopped) == (y.budget, y.done, y.stopped)
    np.testing.assert_array_equal(np.asarray(app.pending), np.asarray(ref.pending))
    old, new, rb = st.cache, app.cache, ref.cache
    if layout == "segmented":
        np.testing.assert_array_equal(np.asarray(new.k_prompt), np.asarray(old.k_prompt))
        np.testing.assert_array_equal(np.asarray(new.resp_lengths), np.asarray(rb.resp_lengths))
        lens_old = np.asarray(old.resp_lengths).reshape(-1)
        lens_new = np.asarray(new.resp_lengths).reshape(-1)
        seg = lambda c, s: np.asarray(c.k_resp)[:, s // 2, s % 2]  # noqa: E731
        segv = lambda c, s: np.asarray(c.v_resp)[:, s // 2, s % 2]  # noqa: E731
    else:
        np.testing.assert_array_equal(np.asarray(new.lengths), np.asarray(rb.lengths))
        lens_old, lens_new = np.asarray(old.lengths), np.asarray(new.lengths)
        seg = lambda c, s: np.asarray(c.k)[:, s]  # noqa: E731
        segv = lambda c, s: np.asarray(c.v)[:, s]  # noqa: E731
    for s in range(4):
        lo, hi = lens_old[s], lens_new[s]
        assert hi - lo == len(obs.get(s, []))
        # earlier entries never recomputed: bitwise the same as before the append
        np.testing.assert_array_equal(seg(new, s)[:, :lo], seg(old, s)[:, :lo])
        # new entries: the same keys/values as the whole-context rebuild
        np.testing.assert_allclose(seg(new, s)[:, lo:hi], seg(rb, s)[:, lo:hi], atol=1e-5)
        np.testing.assert_allclose(segv(new, s)[:, lo:hi], segv(rb, s)[:, lo:hi], atol=1e-5)


def grow_sample(smp, obs, version, budget):
    import dataclasses
    k = len(obs)
    return dataclasses.replace(
        smp, response_ids=np.concatenate([smp.response_ids, np.asarray(obs, np.int32)]),
        logprobs=np.concatenate([smp.logprobs, np.zeros(k, np.float32)]),
        versions=np.concatenate([smp.versions, np.full(k, version, np.int32)]),
        budget=budget, done=False, stopped=False)
