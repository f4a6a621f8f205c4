"""The sampler's segmented KV cache (prompt KV stored once per group) against the
replicated cache and a full-forward recomputation: same tokens for the same rng and
log-probs within 1e-5 (tiny model: ragged prompts incl. a 1-token prompt, 4 groups of N=2,
stop ids, budgets, 3 segments; extract/resume through the rollout engine; SmolLM2-135M
for 12 tokens), the prompt segment's size and contents, and the layout's input errors.

Geometry: 8 slots = 4 groups x 2, prompts <= 8, 24 new tokens, T = 0.7: the replicated
states have the shapes of tests/rl/test_sampling.py and test_rollout.py (compiled
functions are shared within a pytest run) and each segmented function compiles once."""
import math

import jax
import numpy as np
import pytest

from models.config import get_config
from models.decoder import forward, init_params
from models.kv_cache import SegmentedKVCache, cache_bytes
from rl.rollout import (
    RolloutConfig,
    RolloutEngine,
    SamplingConfig,
    decode_segment,
    generate,
    init_state,
    load_samples,
    prefill,
    read_slots,
    sample_keys,
    state_logical_axes,
)

CFG = get_config("tiny")
G, N, P_MAX, R_MAX = 4, 2, 8, 24
SLOTS = G * N
TEMP = SamplingConfig(temperature=0.7)
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 200, 201, 4], [60], [7, 7, 8, 9]]  # incl. 1 token


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def new_state(layout, stop_ids=()):
    return init_state(CFG, num_slots=SLOTS, max_prompt_len=P_MAX, max_new_tokens=R_MAX,
                      sampling=TEMP, stop_ids=stop_ids, group_size=N, kv_layout=layout)


def started(params, layout, stop_ids=(), max_new_tokens=None):
    return prefill(params, new_state(layout, stop_ids), PROMPTS,
                   np.arange(SLOTS).reshape(G, N), sample_keys(0, range(G), N),
                   max_new_tokens=max_new_tokens)


def three_segments(params, state):
    for v in range(3):
        state = decode_segment(params, state, 8, v)
    return state


def full_forward_logprobs(params, samples, temperature):
    """float64 log softmax(logits / T) of each response token from one padded forward."""
    toks = np.zeros((len(samples), P_MAX + R_MAX), np.int32)
    for i, s in enumerate(samples):
        seq = np.concatenate([s.prompt_ids, s.response_ids])
        toks[i, :seq.size] = seq
    logits = np.asarray(forward(params, CFG, toks)).astype(np.float64)
    out = []
    for lg, s in zip(logits, samples):
        p, lps = s.prompt_ids.size, []
        for t, tok in enumerate(s.response_ids):
            z = lg[p - 1 + t] / temperature
            lps.append(z[tok] - (z.max() + math.log(np.exp(z - z.max()).sum())))
        out.append(np.array(lps))
    return out


def assert_same_samples(got, want, atol=1e-5):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol)
        np.testing.assert_array_equal(a.versions, b.versions)
        assert (a.done, a.stopped) == (b.done, b.stopped)


def test_segmented_equals_replicated_with_stops_budgets_three_segments(params):
    # Stop ids taken from an unconstrained run so that they end samples at known places.
    free = read_slots(three_segments(params, started(params, "replicated")), range(SLOTS))
    stops = (int(free[1].response_ids[4]), int(free[5].response_ids[11]))
    runs = {layout: three_segments(params, started(params, layout, stops, max_new_tokens=20))
            for layout in ("segmented", "replicated")}
    seg = read_slots(runs["segmented"], range(SLOTS))
    rep = read_slots(runs["replicated"], range(SLOTS))
    assert_same_samples(seg, rep)
    for s, ref in zip(seg, full_forward_logprobs(params, seg, 0.7)):
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-4)
    lengths = [s.num_generated for s in seg]
    assert any(s.stopped for s in seg) and max(lengths) == 20 and min(lengths) < 20
    assert len({tuple(s.response_ids) for s in seg[:N]}) > 1  # samples of a group differ
    versions = np.concatenate([s.versions for s in seg])
    assert set(versions.tolist()) == {0, 1, 2}
    # Each sample's response segment holds [last prompt token, r_0 .. r_{n-2}].
    cache = runs["segmented"].cache
    np.testing.assert_array_equal(np.asarray(cache.resp_lengths).reshape(-1), lengths)
    np.testing.assert_array_equal(np.asarray(cache.prompt_lengths), [len(p) - 1 for p in PROMPTS])


def test_prompt_kv_stored_once(params):
    seg, rep = started(params, "segmented"), started(params, "replicated")
    c = CFG
    assert isinstance(seg.cache, SegmentedKVCache)
    assert seg.cache.k_prompt.shape == (c.num_layers, G, P_MAX, c.num_kv_heads, c.head_dim)
    assert seg.cache.k_resp.shape == (c.num_layers, G, N, R_MAX, c.num_kv_heads, c.head_dim)
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # k and v, float32
    nbytes = cache_bytes(seg.cache)
    assert nbytes["prompt"] == G * P_MAX * per_token  # once per group ...
    assert cache_bytes(rep.cache)["total"] == SLOTS * (P_MAX + R_MAX) * per_token  # ... not N times
    assert nbytes["response"] == SLOTS * R_MAX * per_token
    # The single prompt copy holds what every replicated slot of the group holds.
    kp, kr = np.asarray(seg.cache.k_prompt), np.asarray(rep.cache.k)
    vp, vr = np.asarray(seg.cache.v_prompt), np.asarray(rep.cache.v)
    for g, prompt in enumerate(PROMPTS):
        p = len(prompt) - 1  # the last prompt token is pending
        for s in range(g * N, (g + 1) * N):
            np.testing.assert_allclose(kp[:, g, :p], kr[:, s, :p], atol=1e-5)
            np.testing.assert_allclose(vp[:, g, :p], vr[:, s, :p], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(seg.pending), np.repeat([p[-1] for p in PROMPTS], N))
    axes = state_logical_axes(seg)
    assert axes.cache.k_prompt[1] == "batch" and axes.pending == ("batch",)


def test_load_samples_teacher_forces_partial_responses(params):
    # Extract after 8 tokens, reload into other blocks (blocks and members permuted),
    # continue: the uninterrupted replicated run's tokens, log-probs within 1e-5.
    full = read_slots(decode_segment(params, started(params, "replicated"), 24, 0), range(SLOTS))
    part = read_slots(decode_segment(params, started(params, "segmented"), 8, 0), range(SLOTS))
    order = [5, 4, 0, 1, 7, 6, 3, 2]  # slot i gets sample order[i]
    state = load_samples(params, new_state("segmented"), [part[i] for i in order], range(SLOTS))
    np.testing.assert_array_equal(np.asarray(state.cache.resp_lengths), 8)
    state = decode_segment(params, state, 16, 0)
    assert_same_samples(read_slots(state, range(SLOTS)), [full[i] for i in order])


def test_engine_extract_resume_segmented_equals_replicated(params):
    stops = tuple(range(100, 130))  # frequent: groups finish at different steps
    prompts = PROMPTS + [[100, 101, 102, 103]]

    def config(layout):
        return RolloutConfig(num_slots=8, group_size=N, segment_len=8, max_prompt_len=P_MAX,
                             max_new_tokens=R_MAX, sampling=TEMP, stop_ids=stops,
                             kv_layout=layout)

    def rows(trajs):
        out = {}
        for t in trajs:
            for i, g in enumerate(np.asarray(t.group_ids)):
                out.setdefault(int(g), []).append(
                    (np.asarray(t.response_ids[i]), np.asarray(t.behaviour_logprobs[i]),
                     np.asarray(t.versions[i]), np.asarray(t.response_mask[i])))
        return out

    def run(layout, interrupt):
        engine, trajs, v = RolloutEngine(CFG, config(layout), prompts=iter(prompts)), [], 0
        while not engine.idle:
            engine.step(params, v)
            if (t := engine.harvest()) is not None:
                trajs.append(t)
            if interrupt and v == 0:
                parts = engine.extract_unfinished()
                assert parts and min(min(p.num_generated) for p in parts) < 8
                engine.resume(parts)
            v += 1
        return rows(trajs)

    seg, rep = run("segmented", True), run("replicated", False)
    assert sorted(seg) == sorted(rep) == list(range(len(prompts)))
    for g in rep:
        for (a_ids, a_lp, a_v, a_m), (b_ids, b_lp, b_v, b_m) in zip(seg[g], rep[g]):
            np.testing.assert_array_equal(a_m, b_m)
            np.testing.assert_array_equal(a_ids * a_m, b_ids * b_m)
            np.testing.assert_allclose(a_lp * a_m, b_lp * b_m, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda p: init_state(CFG, num_slots=SLOTS, max_prompt_len=8, max_new_tokens=4,
                          kv_layout="segmented"), "needs group_size"),
    (lambda p: init_state(CFG, num_slots=10, max_prompt_len=8, max_new_tokens=4, group_size=4),
     "multiple of group_size"),
    (lambda p: init_state(CFG, num_slots=8, max_prompt_len=8, max_new_tokens=4, group_size=4,
                          kv_layout="paged"), "kv_layout must be one of"),
    (lambda p: RolloutConfig(num_slots=8, group_size=4, segment_len=4, max_prompt_len=8,
                             max_new_tokens=4, kv_layout="dense"), "kv_layout must be one of"),
    (lambda p: prefill(p, new_state("segmented"), [[3, 4]], [[1, 2]],
                       sample_keys(0, [0], N)), "aligned block"),
    (lambda p: prefill(p, new_state("segmented"), [[3, 4]], [[0, 1, 2, 3]],
                       sample_keys(0, [0], 4)), "group_size=2"),
])
def test_segmented_layout_errors(params, call, match):
    with pytest.raises(ValueError, match=match):
        call(params)


def test_load_samples_errors(params):
    part = read_slots(started(params, "segmented"), range(SLOTS))
    with pytest.raises(ValueError, match="partly covered"):
        load_samples(params, new_state("segmented"), part[:3], [0, 1, 2])
    with pytest.raises(ValueError, match="must share their prompt"):
        load_samples(params, new_state("segmented"), part[1:3], [0, 1])


def test_smollm2_segmented_equals_replicated():
    from models.assets import load_model
    config, params, tok = load_model("smollm2-135m")
    prompts = [tok.encode("The capital of France is"), tok.encode("1, 2, 3, 4,")]
    out = {layout: generate(params, config, prompts, max_new_tokens=12, num_samples=4,
                            sampling=SamplingConfig(temperature=1.0), stop_ids=(), rng=3,
                            segment_len=12, kv_layout=layout)
           for layout in ("segmented", "replicated")}
    seg, rep = out["segmented"], out["replicated"]
    assert seg.tokens == rep.tokens and seg.num_tokens == 2 * 4 * 12
    # 30 fp32 layers: the two attention orders differ by rounding only (measured max
    # 1.7e-5 absolute on a log-prob of -2.87; the replicated sampler itself is 2e-5 away
    # from the full forward), hence 1e-5 absolute plus 1e-5 relative.
    for a, b in zip(jax.tree.leaves(seg.logprobs), jax.tree.leaves(rep.logprobs)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert len({tuple(t) for t in seg.tokens[0]}) > 1
