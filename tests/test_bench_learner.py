"""experiments.bench.learner's structural half and its page: the jaxpr matmul counter
against hand counts; the library's step computes the plain-JAX floor's matmuls (no extra
forward) on a tiny model, checked against the benchmark's FLOP formula; the head's remat
adds exactly one head forward; the preset side packs; the paired ratios; the committed
page and rows are the committed JSON rendered."""
from __future__ import annotations

import dataclasses
import json
import math
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from experiments.bench import learner as bench
from experiments.common import learner_floor_page as learner_docs
from experiments.common.benchmarking import paired_ratios
from experiments.common.jaxpr_flops import matmul_count, matmul_flops
from experiments.common.learner_sides import JaxSides, make_batch
from models.config import get_config
from models.decoder import init_params

ROOT = Path(__file__).resolve().parents[1]
TINY = get_config("tiny")


def test_counter_hand_counts():
    a, w = jnp.ones((3, 4)), jnp.ones((4, 5))
    assert matmul_flops(jnp.dot, a, w) == 2 * 3 * 4 * 5
    x, y = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 6))  # a batch dim of 2
    assert matmul_flops(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), x, y) == 2 * 2 * 3 * 4 * 6

    def scanned(a, w):  # a scan body counts `length` times, inside a jit
        return jax.lax.scan(lambda c, _: (c, jnp.dot(a, w)), 0.0, None, length=7)[1]
    assert matmul_flops(jax.jit(scanned), a, w) == 7 * 120

    def branch(p, a, w):  # a cond counts its most expensive branch
        return jax.lax.cond(p, lambda: jnp.dot(a, w).sum(), lambda: jnp.dot(a, w @ w.T @ w).sum())
    assert matmul_flops(branch, True, a, w) == 120 + 2 * 4 * 5 * 4 + 2 * 4 * 4 * 5

    def looped(a, w):  # a while loop has no static trip count
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ w @ w.T, c[1] + 1), (a, 0))
    assert matmul_count(looped, a, w).while_loops == 1
    with pytest.raises(ValueError, match="while loop"):
        matmul_flops(looped, a, w)
    # forward and the weight's gradient (the input's is not asked for, so never computed)
    assert matmul_flops(jax.grad(lambda w: jnp.dot(a, w).sum()), w) == 2 * 120


@pytest.fixture(scope="module")
def sides():
    params = init_params(TINY, jax.random.PRNGKey(0))
    batch = make_batch(16, 32, TINY.vocab_size, seed=1)
    return JaxSides(TINY, params, batch, None, 1, preset="smollm2-rg")


def test_library_step_computes_the_floors_matmuls(sides):
    b, t = sides.tandem_batch.tokens.shape
    e, v = TINY.hidden_size, TINY.vocab_size
    counts = sides.matmul_flops()
    # the floor = the benchmark's hand formula (layers, attention's full square, head)
    assert counts["jax"] == bench.flop_count(TINY, b, t)["total"]
    # the library: the same, less the head at each row's last position (forward + backward);
    # what is left over is per-row arithmetic (the reward weights' [B, K] x [K] dots), no
    # matmul over tokens or parameters
    extra = counts["tandem"] - (counts["jax"] - 6 * e * v * b)
    assert 0 <= extra <= 16 * b
    # recomputing the head's logits in the backward adds one head forward, nothing else
    from rl.learner.step import train_step
    remat = dataclasses.replace(sides.train_config, head_remat=True)
    fl = matmul_flops(partial(train_step, config=remat, model_config=TINY),
                      sides.tandem_state, sides.tandem_batch)
    assert fl == counts["tandem"] + 2 * e * v * b * (t - 1)
    # packed groups run each prompt once: fewer matmuls than the rows
    assert counts["tandem[preset]"] < counts["tandem"]


def test_preset_side_trains(sides):
    cfg, state, batch, _ = sides.preset
    assert cfg.packed and batch.packed is not None
    before = jax.tree.leaves(state.params)[0].copy()
    sides.run_preset()
    after = jax.tree.leaves(sides.preset[1].params)[0]
    assert not jnp.array_equal(before, after)


def test_paired_ratios_and_headline():
    times = {"tandem": [2.0, 3.0, 4.0], "jax": [2.0, 2.0, 2.0], "torch": [1.0, 1.0, 1.0]}
    r = paired_ratios(times, "jax")
    assert set(r) == {"tandem", "torch"}
    assert r["tandem"] == {"median": 1.5, "min": 1.0, "max": 2.0, "all": [1.0, 1.5, 2.0]}
    rows = [{"shape": "8x32", "tokens": 256, "paired_time_vs_floor": {"tandem": r["tandem"]}},
            {"shape": "4x32", "tokens": 128, "paired_time_vs_floor": {"tandem": r["torch"]}}]
    h = bench.floor_headline(rows, "m", {})
    assert h["value"] == 1.5 and h["range"] == [1.0, 2.0] and "8x32" in h["metric"]
    assert h["target"] == 1.1
    missing = bench.floor_headline([{"shape": "8x32", "tokens": 1}], "m", {})
    assert math.isnan(missing["value"]) and "not measured" in missing["metric"]


def test_committed_page_is_the_json_rendered():
    result = json.loads((ROOT / "experiments/results/bench_learner.json").read_text())
    assert "paired_time_vs_floor" in result["rows"][-1], "the committed result has no floor side"
    assert learner_docs.PAGE.read_text() == learner_docs.render_page(result)
    for path, link, index in ((ROOT / "README.md", "docs/results/learner-floor.md", False),
                              (ROOT / "docs/results/index.md", "learner-floor.md", True)):
        assert learner_docs.summary_row(result, link, index=index) in path.read_text()


def test_readme_prose_numbers_come_from_the_jsons():
    results = ROOT / "experiments/results"
    now = json.loads((results / "bench_learner.json").read_text())
    earlier = json.loads((results / "bench_learner_vs_torch_earlier.json").read_text())
    rows = {r["shape"]: r for r in now["rows"]}
    old = next(r for r in earlier["rows"] if r["shape"] == "32x256")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"the learner runs at {rows['32x256']['ratio_vs_torch']['tandem']:.2f}× torch's "
            f"speed on this CPU (ratio of medians at 32×256, "
            f"{rows['16x128']['ratio_vs_torch']['tandem']:.2f}× at 16×128; "
            f"{old['ratio_vs_torch']['tandem']:.2f}× at 32×256 on the machine of the earlier")\
        in readme
    assert "32x256" in now["headline"]["metric"]
    assert f"at {now['headline']['value']:.3f}× its plain-JAX floor's time" in readme
