"""The decode fast path (issue 33): layers unrolled into straight-line code
(layer_loop="unrolled") and bucketed slot counts (bucket_slots=True), against the exact
slow twin -- the masked decode over every allocated cache slot with the layer scan.

Same tokens, log-probs within 1e-5, same versions / done / stop flags, on the tiny config
(both cache layouts, several bound chunks) and on a SmolLM2-135M-sized random config
(30 layers, vocabulary 49,152); the unrolled program holds no layer loop; the bucket sizes
and the reuse of one compiled decode program across batch sizes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import check_layer_loop, decode_step, init_params, prefill
from models.kv_cache import init_cache
from rl.rollout import (
    SamplingConfig,
    decode_segment,
    generate,
    init_state,
    read_slots,
    sample_keys,
    slot_bucket,
)
from rl.rollout import prefill as sampler_prefill
from rl.rollout.sampler_core import decode_segment_impl, decode_segment_jit

TINY = get_config("tiny")
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 200, 201, 4], [60], [7, 7, 8, 9]]


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(TINY, 0)


def test_unrolled_decode_step_equals_masked_scan(tiny_params):
    """decode_step with unrolled layers (masked and bounded) gives the masked scan's
    logits and cache, step after step."""
    toks = np.random.default_rng(0).integers(0, TINY.vocab_size, (4, 6)).astype(np.int32)
    _, cache = prefill(tiny_params, TINY, toks, jnp.array([3, 6, 1, 4]), init_cache(TINY, 4, 32))
    slow = fast = bounded = cache
    nxt = jnp.array([1, 2, 3, 4])
    for _ in range(8):
        ls, slow = decode_step(tiny_params, TINY, nxt, slow)
        lf, fast = decode_step(tiny_params, TINY, nxt, fast, layer_loop="unrolled")
        lb, bounded = decode_step(tiny_params, TINY, nxt, bounded, kv_bound=16,
                                  layer_loop="unrolled")
        np.testing.assert_allclose(np.asarray(lf), np.asarray(ls), atol=1e-5)
        np.testing.assert_allclose(np.asarray(lb), np.asarray(ls), atol=1e-5)
        nxt = ls.argmax(-1)
    np.testing.assert_allclose(np.asarray(fast.k), np.asarray(slow.k), atol=1e-6)
    np.testing.assert_allclose(np.asarray(bounded.v), np.asarray(slow.v), atol=1e-6)
    with pytest.raises(ValueError, match="layer_loop must be one of"):
        decode_step(tiny_params, TINY, nxt, slow, layer_loop="python")


def _run(params, cfg, layout, n, *, layer_loop, bucket, bounded, segments, slots=6):
    g = slots // n
    st = init_state(cfg, num_slots=slots, max_prompt_len=8, max_new_tokens=40,
                    sampling=SamplingConfig(temperature=0.9), stop_ids=(3, 77), group_size=n,
                    kv_layout=layout, layer_loop=layer_loop, bucket_slots=bucket)
    st = sampler_prefill(params, st, (PROMPTS * 2)[:g], np.arange(slots).reshape(g, n),
                         sample_keys(0, range(g), n), max_new_tokens=33)
    for v, steps in enumerate(segments):
        st = decode_segment(params, st, steps, v, bounded=bounded)
    return st, read_slots(st, range(slots))


def _assert_same_samples(fast, slow):
    for x, y in zip(fast, slow):
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        np.testing.assert_array_equal(x.versions, y.versions)
        assert (x.done, x.stopped, x.budget) == (y.done, y.stopped, y.budget)


@pytest.mark.parametrize("layout,n", [("segmented", 2), ("replicated", 3)])
def test_sampler_unrolled_and_bucketed_equals_the_slow_twin(tiny_params, layout, n):
    """6 samples in a bucketed state (8 or 9 slots: the extra ones stay empty) with
    unrolled layers and the bounded decode == the masked scan over exactly 6 slots."""
    segments = (5, 20, 15)  # several bound chunks per call
    st, fast = _run(tiny_params, TINY, layout, n, layer_loop="unrolled", bucket=True,
                    bounded=True, segments=segments)
    assert st.num_slots == slot_bucket(6, n) > 6
    assert bool(np.asarray(st.done)[6:].all())  # the extra slots never decoded a token
    assert int(np.asarray(st.num_generated)[6:].sum()) == 0
    _, slow = _run(tiny_params, TINY, layout, n, layer_loop="scan", bucket=False,
                   bounded=False, segments=segments)
    assert sum(s.num_generated for s in slow) > 6 * 10
    _assert_same_samples(fast, slow)


def test_smollm2_sized_unrolled_equals_the_slow_twin():
    """The SmolLM2-135M geometry (9/3 heads, d=64, hidden 576, vocabulary 49,152; 6 of its
    30 layers: depth only repeats the layer), random weights: unrolled + bounded +
    bucketed == the masked scan."""
    cfg = get_config("smollm2-135m", num_layers=6)
    params = init_params(cfg, 0)
    st, fast = _run(params, cfg, "segmented", 2, layer_loop="unrolled", bucket=True,
                    bounded=True, segments=(6, 6), slots=4)
    assert st.num_slots == 8
    _, slow = _run(params, cfg, "segmented", 2, layer_loop="scan", bucket=False,
                   bounded=False, segments=(6, 6), slots=4)
    assert sum(s.num_generated for s in slow) == 4 * 12
    _assert_same_samples(fast, slow)


def test_unrolled_program_has_no_layer_loop():
    """Lowered for cuda (bf16, abstract weights), the decode segment is one on-device loop
    over tokens; with unrolled layers that is the only loop in the program, the scan adds
    one over layers inside it. (The CPU lowering adds rolled loops of the threefry rng.)"""
    cfg = get_config("tiny", dtype="bfloat16")
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)

    def loops(layer_loop):
        st = jax.eval_shape(lambda: init_state(cfg, num_slots=4, max_prompt_len=8,
                                               max_new_tokens=16, group_size=2,
                                               layer_loop=layer_loop))
        traced = jax.jit(decode_segment_impl, static_argnames="kv_bound").trace(
            params, st, scalar, scalar, kv_bound=16)
        return traced.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.while")
    assert loops("scan") == 2
    assert loops("unrolled") == 1


def test_slot_bucket_sizes_and_one_program_for_several_batch_sizes(tiny_params):
    assert [slot_bucket(n) for n in (1, 5, 8, 9, 40, 64, 65, 200, 256, 257, 600)] == \
        [8, 8, 8, 16, 64, 64, 128, 256, 256, 512, 768]
    assert slot_bucket(40, 3) == 66 and slot_bucket(5, 8) == 8 and slot_bucket(9, 6) == 18
    assert check_layer_loop("unrolled") == "unrolled"
    with pytest.raises(ValueError, match="num_slots"):
        slot_bucket(0)
    # 3 and 5 prompts x 1 sample: both in the 8-slot bucket, so the second batch size
    # compiles no new decode program
    kw = dict(max_new_tokens=5, stop_ids=(), rng=1, bucket_slots=True, segment_len=5)
    generate(tiny_params, TINY, PROMPTS[:3], **kw)
    size = decode_segment_jit._cache_size()
    five = generate(tiny_params, TINY, (PROMPTS * 2)[:5], **kw)
    assert decode_segment_jit._cache_size() == size
    # and the tokens are those of the unbucketed state
    plain = generate(tiny_params, TINY, (PROMPTS * 2)[:5], **{**kw, "bucket_slots": False})
    assert five.tokens == plain.tokens
    for a, b in zip(five.logprobs, plain.logprobs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_the_loops_rollouts_take_the_decode_options(tiny_params, monkeypatch):
    """RolloutOptions.layer_loop / bucket_slots reach the train rollouts (rl.loops.rollouts
    sample_groups -> RolloutConfig): 3 groups x 2 samples (6 rows in an 8-slot state) with
    unrolled layers give the default rollout's trajectory."""
    import rl.loops.rollouts as rollouts
    from rl.loops.config import RolloutOptions
    from rl.loops.rollouts import RolloutSpec, sample_groups
    from rl.rollout import RolloutEngine
    from rl.tasks.synthetic import SyntheticTask

    states = []

    class Spy(RolloutEngine):  # records the state each rollout decodes in
        def harvest(self):
            states.append(self.state)
            return super().harvest()

    monkeypatch.setattr(rollouts, "RolloutEngine", Spy)

    task = SyntheticTask(kind="reverse", length=6, alphabet=4)
    prompts = task.train_prompts(0, 3)
    spec = RolloutSpec(task, TINY, group_size=2, segment_len=4,
                       sampling=SamplingConfig(temperature=1.0))
    slow = sample_groups(tiny_params, 0, spec, prompts, seed=5)
    fast = sample_groups(tiny_params, 0, spec.replace(layer_loop="unrolled", bucket_slots=True),
                         prompts, seed=5)
    np.testing.assert_array_equal(np.asarray(fast.response_ids), np.asarray(slow.response_ids))
    np.testing.assert_allclose(np.asarray(fast.behaviour_logprobs),
                               np.asarray(slow.behaviour_logprobs), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(fast.group_ids), np.asarray(slow.group_ids))
    assert {(s.layer_loop, s.num_slots) for s in states} == {("scan", 6), ("unrolled", 8)}
    with pytest.raises(ValueError, match="RolloutOptions.layer_loop"):
        RolloutOptions(layer_loop="fori")
    with pytest.raises(ValueError, match="RolloutOptions.bucket_slots"):
        RolloutOptions(bucket_slots=1)
