"""Advantage estimators against loop-based float64 numpy references."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl.objectives import (
    AdvantageConfig,
    AdvantageResult,
    available_advantages,
    compute_advantages,
    get_advantage,
    register_advantage,
)
from rl.objectives.advantages import (
    ADVANTAGE_PRESETS,
    dr_grpo_advantages,
    gdpo_advantages,
    grpo_advantages,
    mc_grpo_advantages,
    rloo_advantages,
    token_advantages,
)

TOL = dict(rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- references


def ref_group_lists(batch, group_size=None, ids=None):
    if ids is None:
        return [list(range(s, s + group_size)) for s in range(0, batch, group_size)]
    groups = {}
    for i, g in enumerate(ids):
        groups.setdefault(int(g), []).append(i)
    return list(groups.values())


def ref_mean(vals):
    total = 0.0
    for v in vals:
        total += v
    return total / len(vals)


def ref_std(vals, unbiased):
    mu = ref_mean(vals)
    ss = 0.0
    for v in vals:
        ss += (v - mu) ** 2
    dof = len(vals) - (1 if unbiased else 0)
    return (ss / max(dof, 1)) ** 0.5


def ref_grpo(r, groups, eps=1e-6, unbiased=True, scale="group"):
    out = np.zeros(len(r))
    batch_std = ref_std(list(r), unbiased)
    for g in groups:
        vals = [float(r[i]) for i in g]
        mu = ref_mean(vals)
        std = {"group": ref_std(vals, unbiased), "batch": batch_std, "none": None}[scale]
        for i in g:
            out[i] = (r[i] - mu) if std is None else (r[i] - mu) / (std + eps)
    return out


def ref_rloo(r, groups):
    out = np.zeros(len(r))
    for g in groups:
        for i in g:
            others = [float(r[j]) for j in g if j != i]
            out[i] = r[i] - ref_mean(others) if others else 0.0
    return out


def ref_lower_median(vals):
    s = sorted(vals)
    return s[(len(s) - 1) // 2]


def ref_mc_grpo(r, groups, scale="std", eps=1e-6, mad_eps=1e-3, rescale=True):
    adv = np.zeros(len(r))
    keep = np.ones(len(r))
    for g in groups:
        vals = [float(r[i]) for i in g]
        med = ref_lower_median(vals)
        # stable: among ties the earliest batch index sorts first
        order = sorted(g, key=lambda i: (float(r[i]), i))
        keep[order[(len(g) - 1) // 2]] = 0.0
        if scale == "mad":
            denom = ref_lower_median([abs(v - med) for v in vals]) + mad_eps
        else:
            denom = ref_std(vals, True) + eps
        nonzero = sum(1 for v in vals if v != med)
        factor = len(g) / nonzero if (rescale and nonzero) else 1.0
        for i in g:
            adv[i] = (r[i] - med) / denom * factor
    return adv, keep


def ref_gdpo(cols, weights, groups, eps=1e-4):
    batch = len(cols[0])
    pre = np.zeros(batch)
    for col, w in zip(cols, weights):
        for g in groups:
            vals = [float(col[i]) for i in g]
            mu, sd = ref_mean(vals), ref_std(vals, True)
            for i in g:
                pre[i] += w * (col[i] - mu) / (sd + eps)
    mu, sd = ref_mean(list(pre)), ref_std(list(pre), True)
    return np.array([(p - mu) / (sd + eps) for p in pre])


def make_rewards(rng, batch, kind):
    if kind == "binary":
        return rng.integers(0, 2, batch).astype(np.float32)
    if kind == "ties":
        return rng.choice(np.array([0.1, 0.7, 1.3], np.float32), batch)
    return rng.normal(size=batch).astype(np.float32)


# One batch size and one jitted function running every estimator: each group layout
# compiles once for the whole file.
BATCH = 15
GRPO_VARIANTS = [(1e-6, True, "group"), (1e-4, False, "group"), (1e-4, False, "batch"),
                 (1e-4, True, "none")]


def all_estimators(r, r2, group_size=None, group_ids=None):
    g = dict(group_size=group_size, group_ids=group_ids)
    out = {f"grpo{k}": grpo_advantages(r, eps=e, unbiased_std=u, scale_rewards=sc, **g)
           for k, (e, u, sc) in enumerate(GRPO_VARIANTS)}
    out["dr_grpo"] = dr_grpo_advantages(r, **g)
    out["rloo"] = rloo_advantages(r, **g)
    for scale in ("std", "mad"):
        out[f"mc_{scale}"] = tuple(mc_grpo_advantages(r, scale=scale, **g))
    out["gdpo"] = gdpo_advantages({"acc": r, "fmt": r2}, weights={"fmt": 0.5, "acc": 1.0}, **g)
    return out


@functools.lru_cache(maxsize=None)
def run_all(group_size):
    return jax.jit(functools.partial(all_estimators, group_size=group_size))


run_all_ids = jax.jit(lambda r, r2, ids: all_estimators(r, r2, group_ids=ids))


def check_all(out, r, r2, groups):
    for k, (eps, unbiased, scale) in enumerate(GRPO_VARIANTS):
        np.testing.assert_allclose(out[f"grpo{k}"], ref_grpo(r, groups, eps, unbiased, scale),
                                   **TOL, err_msg=f"grpo {scale}")
    np.testing.assert_allclose(out["dr_grpo"], ref_grpo(r, groups, scale="none"), **TOL)
    np.testing.assert_allclose(out["rloo"], ref_rloo(r, groups), **TOL)
    for scale in ("std", "mad"):
        adv, keep = ref_mc_grpo(r, groups, scale=scale)
        got_adv, got_keep = out[f"mc_{scale}"]
        # MAD advantages reach 1/mad_eps = 1e3: float32 needs a larger absolute tolerance.
        np.testing.assert_allclose(got_adv, adv, rtol=2e-5, atol=2e-3 if scale == "mad" else 2e-5)
        np.testing.assert_array_equal(got_keep, keep)
        for grp in groups:  # exactly one pivot per group
            assert sum(1 - keep[i] for i in grp) == 1
    np.testing.assert_allclose(out["gdpo"], ref_gdpo([r, r2], [1.0, 0.5], groups),
                               rtol=1e-4, atol=1e-4)


@given(
    seed=st.integers(0, 2**31 - 1),
    group_size=st.sampled_from([1, 3, 5, 15]),
    kind=st.sampled_from(["normal", "binary", "ties"]),
)
def test_estimators_match_reference(seed, group_size, kind):
    rng = np.random.default_rng(seed)
    r = make_rewards(rng, BATCH, kind)
    r2 = make_rewards(rng, BATCH, "normal")
    check_all(run_all(group_size)(r, r2), r, r2, ref_group_lists(BATCH, group_size))


@pytest.mark.parametrize("seed", [0, 1])
def test_group_ids_uneven_and_shuffled_groups(seed):
    rng = np.random.default_rng(seed)
    r = make_rewards(rng, BATCH, "ties" if seed else "normal")
    r2 = make_rewards(rng, BATCH, "normal")
    # groups of sizes 1, 2, 3, 4 and 5 with arbitrary labels, interleaved
    ids = rng.permutation(np.repeat(np.array([40, 7, -3, 12, 5]), [1, 2, 3, 4, 5]))
    check_all(run_all_ids(r, r2, ids), r, r2, ref_group_lists(BATCH, ids=ids))


def test_gdpo_with_one_reward_is_whitened_grpo():
    rng = np.random.default_rng(1)
    r = rng.normal(size=BATCH).astype(np.float32)
    grpo = ref_grpo(r, ref_group_lists(BATCH, 5), eps=1e-4)
    whitened = (grpo - grpo.mean()) / (grpo.std(ddof=1) + 1e-4)
    got = jax.jit(lambda x: gdpo_advantages(x[:, None], 5))(r)
    np.testing.assert_allclose(got, whitened, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("group_size", [1, 5])
def test_size_one_and_all_equal_groups_give_exact_zero(group_size):
    r = np.repeat(np.array([0.1, 0.7, 1.3], np.float32), 5)
    out = run_all(group_size)(r, r)
    for name, value in out.items():
        adv = value[0] if isinstance(value, tuple) else value
        assert np.array_equal(np.asarray(adv), np.zeros(BATCH)), name


def test_mc_grpo_binary_rewards_default_is_bounded_mad_is_source_behaviour():
    r = np.array([1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0], np.float32)  # 3 groups of 5
    out = run_all(5)(r, r)
    default, mad = np.asarray(out["mc_std"][0]), np.asarray(out["mc_mad"][0])
    assert np.all(np.abs(default) < 10)
    # MAD is 0 for binary rewards: |A| = 1/1e-3, times the nonzero rescale 5/#nonzero = 5/2.
    np.testing.assert_allclose(np.abs(mad[mad != 0]), 2500.0, rtol=1e-4)


def test_token_advantages_broadcast_and_mask():
    rng = np.random.default_rng(4)
    a = rng.normal(size=3).astype(np.float32)
    mask = rng.random((3, 5)) > 0.4
    got = np.asarray(token_advantages(a, mask))
    for i in range(3):
        for t in range(5):
            assert got[i, t] == (a[i] if mask[i, t] else 0.0)


# ----------------------------------------------------------------------------- jit / vmap


def test_jit_and_vmap_agree_with_eager():
    rng = np.random.default_rng(5)
    r = rng.normal(size=(2, BATCH)).astype(np.float32)
    eager = grpo_advantages(r[0], 5)
    eager_mc = mc_grpo_advantages(r[0], 5)
    jitted = run_all(5)(r[0], r[1])
    np.testing.assert_allclose(jitted["grpo0"], eager, **TOL)
    np.testing.assert_allclose(jitted["mc_std"][0], eager_mc.advantages, **TOL)
    np.testing.assert_array_equal(jitted["mc_std"][1], eager_mc.sample_mask)
    batched = jax.jit(jax.vmap(functools.partial(all_estimators, group_size=5)))(r, r[::-1])
    for k in range(2):
        single = run_all(5)(r[k], r[1 - k])
        for name in single:
            np.testing.assert_allclose(jax.tree.leaves(batched[name])[0][k],
                                       jax.tree.leaves(single[name])[0], **TOL, err_msg=name)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    r = np.random.default_rng(6).normal(size=6).astype(np.float32)
    with pytest.raises(ValueError, match=r"group_size 4 does not divide the batch of 6"):
        grpo_advantages(r, 4)
    with pytest.raises(ValueError, match="group_ids has shape"):
        grpo_advantages(r, group_ids=np.arange(5))
    with pytest.raises(ValueError, match="rewards must be a \\[batch\\] vector"):
        grpo_advantages(r.reshape(2, 3), 3)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(r)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_advantages(r, 3, scale_rewards="global")
    for bad in (np.nan, np.inf):
        rb = r.copy()
        rb[2] = bad
        with pytest.raises(ValueError, match=r"rewards has 1 non-finite value.*index \(2,\)"):
            grpo_advantages(rb, 3)
        with pytest.raises(ValueError, match=r"rewards\['acc'\]"):
            gdpo_advantages({"acc": rb, "fmt": r}, 3)
    with pytest.raises(ValueError, match="weights names"):
        gdpo_advantages({"acc": r, "fmt": r}, 3, weights={"acc": 1.0})
    with pytest.raises(ValueError, match="static Python int"):
        jax.jit(grpo_advantages)(r, 3)


# ----------------------------------------------------------------------------- registry / config


def test_registry_config_and_presets():
    assert {"grpo", "dr_grpo", "rloo", "mc_grpo", "gdpo"} <= set(available_advantages())
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'; known: .*grpo"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        AdvantageConfig("nope")
    with pytest.raises(ValueError, match="takes no hyper-parameter 'eps'"):
        AdvantageConfig("dr_grpo", {"eps": 1e-3})
    with pytest.raises(ValueError, match="unknown preset"):
        AdvantageConfig.preset("ppo2")

    rng = np.random.default_rng(7)
    r = rng.normal(size=BATCH).astype(np.float32)
    groups = ref_group_lists(BATCH, 5)
    trl = AdvantageConfig.preset("grpo_trl")
    assert hash(trl) == hash(AdvantageConfig("grpo", {"scale_rewards": "group", "eps": 1e-4,
                                                      "unbiased_std": True}))
    out = compute_advantages(trl, r, 5)
    np.testing.assert_allclose(out.advantages, ref_grpo(r, groups, eps=1e-4), **TOL)
    np.testing.assert_array_equal(out.sample_mask, np.ones(BATCH))
    assert set(ADVANTAGE_PRESETS) >= {"grpo", "dr_grpo", "dapo", "gspo", "cispo"}
    dr = jax.jit(compute_advantages, static_argnums=(0, 2))(AdvantageConfig.preset("dr_grpo"), r, 5)
    np.testing.assert_allclose(dr.advantages, ref_grpo(r, groups, scale="none"), **TOL)
    mc = compute_advantages(AdvantageConfig("mc_grpo"), r, 5)
    assert isinstance(mc, AdvantageResult) and float(mc.sample_mask.sum()) == 12.0

    @register_advantage("test_max_centered", overwrite=True)
    def max_centered(rewards, group_size=None, *, group_ids=None, shift=0.0):
        x = jnp.asarray(rewards).reshape(-1, group_size)
        return (x - x.max(axis=1, keepdims=True) + shift).reshape(-1)

    got = compute_advantages(AdvantageConfig("test_max_centered", {"shift": 1.0}), r, 5)
    want = [r[i] - max(r[5 * (i // 5): 5 * (i // 5) + 5]) + 1.0 for i in range(BATCH)]
    np.testing.assert_allclose(got.advantages, want, **TOL)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(max_centered)
