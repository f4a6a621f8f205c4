"""Sampler tests on the tiny model: behaviour log-probs and greedy tokens against a
full-forward recomputation, sampling distribution (chi-square), segment invariance,
stop ids / budgets, shared prompt KV, version stamps, and input validation.

All sampler states share one geometry (8 slots, prompts <= 8, 24 new tokens) so each
jitted function compiles once or twice for the whole file."""
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rl.rollout.sampler_state as sampling_mod
from models.config import get_config
from models.decoder import forward, init_params
from rl.rollout import (
    SamplingConfig,
    decode_segment,
    generate,
    init_state,
    load_samples,
    prefill,
    read_slots,
    sample_keys,
    sample_tokens,
)

CFG = get_config("tiny")
SLOTS, P_MAX, R_MAX, N = 8, 8, 24, 4
TEMP = SamplingConfig(temperature=0.7)
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 200]]


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


@pytest.fixture(scope="module")
def params_b():
    return init_params(CFG, 1)


def new_state(sampling=TEMP, stop_ids=()):
    return init_state(CFG, num_slots=SLOTS, max_prompt_len=P_MAX, max_new_tokens=R_MAX,
                      sampling=sampling, stop_ids=stop_ids)


def started(params, sampling=TEMP, stop_ids=(), seed=0, max_new_tokens=None):
    """Two groups of N=4 (slots 0-3: PROMPTS[0], 4-7: PROMPTS[1])."""
    keys = sample_keys(seed, [0, 1], N)
    return prefill(params, new_state(sampling, stop_ids), PROMPTS,
                   np.arange(SLOTS).reshape(2, N), keys, max_new_tokens=max_new_tokens)


def ref_logits(params, seqs):
    """Full-forward logits (float64) for each token list, via one padded [8k, 32] call."""
    rows = -(-len(seqs) // 8) * 8
    toks = np.zeros((rows, P_MAX + R_MAX), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    # Chunks of 8 rows: one compiled shape for the whole file.
    out = np.concatenate([np.asarray(forward(params, CFG, toks[i:i + 8])) for i in range(0, rows, 8)])
    return out.astype(np.float64)[:len(seqs)]


def ref_logprobs(params, samples, temperature):
    """Per sample: log softmax(logits / T) at each response token, from the full forward."""
    logits = ref_logits(params, [np.concatenate([s.prompt_ids, s.response_ids]) for s in samples])
    out = []
    for lg, s in zip(logits, samples):
        p = s.prompt_ids.size
        lps = []
        for t, tok in enumerate(s.response_ids):
            z = lg[p - 1 + t] / temperature
            lps.append(z[tok] - (z.max() + math.log(np.exp(z - z.max()).sum())))
        out.append(np.array(lps))
    return out


def test_logprobs_match_full_forward(params):
    state = decode_segment(params, started(params), 24, 5)
    samples = read_slots(state, range(SLOTS))
    for s, ref in zip(samples, ref_logprobs(params, samples, 0.7)):
        assert s.num_generated == R_MAX and s.done and not s.stopped
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-4)
        assert (s.versions == 5).all()
    # The N samples of a group draw different tokens (independent streams).
    assert len({tuple(s.response_ids) for s in samples[:N]}) == N


def test_three_segments_equal_one_call(params):
    state = started(params)
    one = decode_segment(params, state, 24, 0)
    three = state
    for v in (1, 2, 3):
        three = decode_segment(params, three, 8, v)
    np.testing.assert_array_equal(np.asarray(three.response_ids), np.asarray(one.response_ids))
    np.testing.assert_array_equal(np.asarray(three.logprobs), np.asarray(one.logprobs))
    np.testing.assert_array_equal(np.asarray(three.cache.lengths), np.asarray(one.cache.lengths))
    expected = np.repeat(np.array([1, 2, 3]), 8)
    np.testing.assert_array_equal(np.asarray(three.versions), np.tile(expected, (SLOTS, 1)))


def test_group_slots_share_identical_prompt_kv(params):
    state = started(params)
    k, v = np.asarray(state.cache.k), np.asarray(state.cache.v)
    for g, prompt in enumerate(PROMPTS):
        slots = range(g * N, (g + 1) * N)
        p = len(prompt)
        for s in slots:
            np.testing.assert_array_equal(k[:, s, :p], k[:, g * N, :p])
            np.testing.assert_array_equal(v[:, s, :p], v[:, g * N, :p])
        assert np.abs(k[:, g * N, :p]).sum() > 0
    # The last prompt token is pending (fed by the first decode step).
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [2] * N + [5] * N)
    np.testing.assert_array_equal(np.asarray(state.pending), [33] * N + [200] * N)


def test_greedy_equals_argmax_of_full_forward(params):
    state = decode_segment(params, started(params, SamplingConfig(greedy=True)), 12, 0)
    samples = read_slots(state, range(SLOTS))
    logits = ref_logits(params, [np.concatenate([s.prompt_ids, s.response_ids]) for s in samples])
    for s, lg in zip(samples, logits):
        p = s.prompt_ids.size
        assert s.num_generated == 12
        for t, tok in enumerate(s.response_ids):
            row = lg[p - 1 + t]
            assert tok == int(np.argmax(row))
            logz = row.max() + math.log(np.exp(row - row.max()).sum())
            assert abs(s.logprobs[t] - (row[tok] - logz)) < 1e-4
    # Greedy samples of one group are identical.
    assert len({tuple(s.response_ids) for s in samples[:N]}) == 1


def test_stop_ids_and_budgets(params):
    base = read_slots(decode_segment(params, started(params), 24, 0), range(SLOTS))
    # Stop ids taken from the unconstrained run so they are hit at known places.
    stops = (int(base[0].response_ids[3]), int(base[5].response_ids[10]))
    state = decode_segment(params, started(params, stop_ids=stops, max_new_tokens=20), 24, 0)
    again = decode_segment(params, state, 8, 1)  # every slot is done: nothing may change
    for st in (state, again):
        samples = read_slots(st, range(SLOTS))
        for ref, s in zip(base, samples):
            hits = [t for t, tok in enumerate(ref.response_ids[:20]) if tok in stops]
            n = hits[0] + 1 if hits else 20
            np.testing.assert_array_equal(s.response_ids, ref.response_ids[:n])
            assert s.done and s.stopped == bool(hits) and s.num_generated == n
        np.testing.assert_array_equal(
            np.asarray(st.cache.lengths),
            [s.prompt_ids.size + s.num_generated - 1 for s in samples])
    assert read_slots(state, [0])[0].num_generated <= 4
    assert (np.asarray(again.versions) != 1).all()


def test_chi_square_first_token_follows_softmax(params):
    # Spread the logits (x5 via the final norm's scale) so T = 0.7 and T = 1 differ clearly.
    sharp = dict(params, final_norm={"scale": params["final_norm"]["scale"] * 5.0})
    state = started(sharp)
    logits = ref_logits(sharp, [PROMPTS[0], PROMPTS[1]])
    draws, rounds = {0: [], 1: []}, 150
    for r in range(rounds):
        keys = sample_keys(1000 + r, [0, 1], N).reshape(SLOTS, 2)
        out = decode_segment(sharp, state.replace(keys=jnp.asarray(keys)), 1, 0)
        toks = np.asarray(out.response_ids[:, 0])
        draws[0].extend(toks[:N])
        draws[1].extend(toks[N:])

    def p_value(counts, probs):
        # Pool categories with expected count < 5; chi-square tail by Wilson-Hilferty.
        expected = probs * counts.sum()
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] < 5:
            obs, exp = obs[:-1], exp[:-1]
        stat = ((obs - exp) ** 2 / exp).sum()
        k = obs.size - 1
        z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
        return 0.5 * math.erfc(z / math.sqrt(2))

    for g, prompt in enumerate(PROMPTS):
        row = logits[g, len(prompt) - 1]
        counts = np.bincount(np.asarray(draws[g]), minlength=CFG.vocab_size).astype(np.float64)

        def softmax(z):
            e = np.exp(z - z.max())
            return e / e.sum()

        assert p_value(counts, softmax(row / 0.7)) > 1e-3
        assert p_value(counts, softmax(row / 1.0)) < 1e-3  # the test can tell T apart


def test_param_swap_stamps_new_version(params, params_b):
    state = decode_segment(params, started(params), 8, 0)
    same = decode_segment(params, state, 8, 0)
    swapped = decode_segment(params_b, state, 8, 1)
    v = np.asarray(swapped.versions)
    np.testing.assert_array_equal(v[:, :8], 0)
    np.testing.assert_array_equal(v[:, 8:16], 1)
    np.testing.assert_array_equal(v[:, 16:], -1)
    np.testing.assert_array_equal(np.asarray(swapped.response_ids[:, :8]),
                                  np.asarray(same.response_ids[:, :8]))
    assert (np.asarray(swapped.response_ids[:, 8:16]) != np.asarray(same.response_ids[:, 8:16])).any()


def test_read_and_load_round_trip_continues_stream(params):
    # Extract after 8 tokens, load into other slots (reversed order), continue: same
    # tokens as the uninterrupted run (same params), prefix data preserved.
    full = read_slots(decode_segment(params, started(params), 24, 0), range(SLOTS))
    part = read_slots(decode_segment(params, started(params), 8, 0), range(SLOTS))
    state = load_samples(params, new_state(), part[::-1], range(SLOTS))
    state = decode_segment(params, state, 16, 1)
    resumed = read_slots(state, range(SLOTS))[::-1]
    for f, p, r in zip(full, part, resumed):
        np.testing.assert_array_equal(r.response_ids, f.response_ids)
        np.testing.assert_array_equal(r.logprobs[:8], p.logprobs)
        np.testing.assert_allclose(r.logprobs, f.logprobs, atol=1e-4)
        np.testing.assert_array_equal(r.versions, [0] * 8 + [1] * 16)


def test_generate_convenience(params):
    # Same geometry as the other tests (2 prompts x 4 samples, widest prompt 8, 24 new).
    ticks = []
    prompts = [[3, 4, 5], list(range(40, 48))]
    res = generate(params, CFG, prompts, max_new_tokens=R_MAX, sampling=SamplingConfig(greedy=True),
                   stop_ids=(), num_samples=N, segment_len=10, progress=ticks.append)
    assert res.num_tokens == 2 * N * R_MAX and sum(ticks) == res.num_tokens and len(ticks) == 3
    lg = ref_logits(params, [p + res.tokens[i][0][:-1] for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert all(t == res.tokens[i][0] for t in res.tokens[i])  # greedy: samples agree
        assert res.tokens[i][0] == [int(np.argmax(lg[i][len(p) - 1 + t])) for t in range(R_MAX)]
        assert not any(res.finished[i])


def test_sample_tokens_truncation_and_temperature_limit():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2.0, (6, 300)).astype(np.float32)  # 3 vocab blocks
    keys = jnp.asarray(sample_keys(7, range(400), 6))  # [400, 6, 2]

    def draw(cfg):  # rows = (draw, batch row) flattened: one compile per config
        fn = jax.jit(lambda k: sample_tokens(jnp.tile(jnp.asarray(logits), (400, 1)), k, cfg))
        tok, lp = fn(keys.reshape(-1, 2))
        return np.asarray(tok).reshape(400, 6), np.asarray(lp).reshape(400, 6)

    def log_softmax64(z):
        z = z.astype(np.float64)
        return z - (z.max() + np.log(np.exp(z - z.max()).sum()))

    for cfg in (SamplingConfig(temperature=0.8, top_k=5), SamplingConfig(temperature=1.3, top_p=0.6)):
        tok, lp = draw(cfg)
        for b in range(6):
            z = logits[b].astype(np.float64) / cfg.temperature
            order = np.argsort(-z)
            if cfg.top_k:
                allowed = set(order[:cfg.top_k].tolist())
            else:
                p = np.exp(log_softmax64(z))[order]
                allowed, mass = set(), 0.0
                for i, idx in enumerate(order):
                    if mass >= cfg.top_p:
                        break
                    allowed.add(int(idx))
                    mass += p[i]
            mask = np.array([i in allowed for i in range(300)])
            trunc = np.where(mask, z, -np.inf)
            ref = log_softmax64(trunc)
            assert set(tok[:, b].tolist()) <= allowed
            assert len(set(tok[:, b].tolist())) > 1
            np.testing.assert_allclose(lp[:, b], ref[tok[:, b]], atol=1e-5)
    tok, _ = draw(SamplingConfig(temperature=1e-4))
    assert (tok == np.argmax(logits, axis=-1)[None]).all()


def test_truncated_sampling_warns_once(monkeypatch):
    monkeypatch.setattr(sampling_mod, "_warned_truncated", False)
    with pytest.warns(UserWarning, match="truncated"):
        new_state(SamplingConfig(top_k=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_state(SamplingConfig(top_p=0.9))  # second time: silent
        new_state(TEMP)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "greedy=True"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(top_k=0), "top_k must be"),
    (dict(greedy=True, top_k=3), "no effect with greedy"),
])
def test_bad_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_bad_sampler_inputs(params):
    state = new_state()
    keys = sample_keys(0, [0], N)
    slots = np.arange(N).reshape(1, N)
    with pytest.raises(ValueError, match="empty"):
        prefill(params, state, [[]], slots, keys)
    with pytest.raises(ValueError, match=r"9 tokens, longer than .*max_prompt_len=8"):
        prefill(params, state, [list(range(3, 12))], slots, keys)
    with pytest.raises(ValueError, match="group size N"):
        prefill(params, state, [[3, 4]], np.zeros((1, 0), int), np.zeros((1, 0, 2), np.uint32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prefill(params, state, [[3, 256]], slots, keys)
    with pytest.raises(ValueError, match="distinct"):
        prefill(params, state, [[3, 4]], np.zeros((1, N), int), keys)
    with pytest.raises(ValueError, match=r"stop_ids \[300\]"):
        new_state(stop_ids=(2, 300))
    with pytest.raises(ValueError, match="num_tokens"):
        decode_segment(params, state, 0, 0)
    with pytest.raises(ValueError, match="version"):
        decode_segment(params, state, 4, -1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        init_state(CFG, num_slots=1, max_prompt_len=500, max_new_tokens=100)


def test_kth_largest_by_bisection_is_lax_top_k():
    # the CPU path of top-k sampling against lax.top_k (the other platforms' path):
    # ties, signed zeros, -inf entries, negative rows, k = 1 and k = V
    from rl.rollout.sampler_core import kth_largest_bisect, kth_largest_top_k

    rng = np.random.default_rng(0)
    z = (rng.standard_normal((12, 300)) * 5).astype(np.float32)
    z[1] = 0.0
    z[2, ::2] = -np.inf
    z[3, :5] = 3.0
    z[4] = -np.abs(z[4])
    z[5, :150] = -0.0
    z[6] = np.round(z[6])  # many ties
    z = jnp.asarray(z)
    for k in (1, 2, 5, 50, 299, 300):
        np.testing.assert_array_equal(np.asarray(kth_largest_bisect(z, k)),
                                      np.asarray(kth_largest_top_k(z, k)))
    # top-k sampling lowers for cuda (where it takes lax.top_k)
    from jax import export

    from rl.rollout.sampler_core import sample_tokens

    cfg = SamplingConfig(temperature=0.8, top_k=5)

    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 12))
    export.export(jax.jit(lambda z, k: sample_tokens(z, k, cfg)), platforms=["cuda"])(z, keys)
