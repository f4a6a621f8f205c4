"""The learner on a tree per group (TrainConfig.tree, models.tree.TreeGroups) against the
naive rows: on groups whose rows share prefixes past the prompt (as a LATR tree's do),
the tree's log-probs and entropies equal models.logprobs.token_logprobs on the rows, and a
train step (PPO-clip, micro-batches of whole groups, the chunked head) gives the naive
step's loss, metrics and updated params."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from models.decoder import init_params
from models.logprobs import token_logprobs
from models.tree import tree_groups, tree_groups_stats, tree_row_logprobs
from rl.learner import TrainConfig, batch_from_trajectory, init_train_state, make_train_step
from rl.trajectory import Trajectory

CFG = get_config("tiny")
N, P, R = 4, 5, 9


def branching_trajectory(seed: int, groups: int = 2) -> Trajectory:
    """groups x N rows: a prompt per group, then responses that fork off each other (every
    row after the first copies a random prefix of an earlier row), lengths 3..R."""
    rng = np.random.default_rng(seed)
    b = groups * N
    prompt_ids = np.zeros((b, P), np.int32)
    resp = np.zeros((b, R), np.int32)
    mask = np.zeros((b, R), bool)
    plen = np.zeros(b, np.int32)
    for g in range(groups):
        p = int(rng.integers(2, P + 1))
        prompt = rng.integers(3, CFG.vocab_size, p)
        rows = []
        for n in range(N):
            length = int(rng.integers(3, R + 1))
            fresh = list(rng.integers(3, CFG.vocab_size, length))
            if rows:
                parent = rows[int(rng.integers(len(rows)))]
                cut = int(rng.integers(0, len(parent)))
                fresh = (parent[:cut] + fresh)[:length] if cut < length else parent[:cut]
            rows.append(fresh)
            i = g * N + n
            prompt_ids[i, :p], plen[i] = prompt, p
            resp[i, :len(fresh)], mask[i, :len(fresh)] = fresh, True
    blp = np.where(mask, -rng.uniform(1.0, 6.0, (b, R)), 0.0).astype(np.float32)
    return Trajectory(prompt_ids=prompt_ids, prompt_lengths=plen, response_ids=resp,
                      response_mask=mask, behaviour_logprobs=blp,
                      versions=np.zeros((b, R), np.int32),
                      group_ids=np.repeat(np.arange(groups), N).astype(np.int32),
                      finished=np.ones(b, bool), truncated=np.zeros(b, bool),
                      rewards={"reward": rng.uniform(0, 1, b)})


def entropy64(z) -> np.ndarray:
    """-sum p log p of softmax(z) in float64."""
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


def test_tree_rows_share_prefixes_and_equal_the_rows_logprobs():
    traj = branching_trajectory(0)
    batch = batch_from_trajectory(traj, group_size=N, model_config=CFG, tree=True)
    stats = tree_groups_stats(batch.tree)
    prompt_once = np.asarray(traj.prompt_lengths)[::N].sum() + np.asarray(traj.response_mask).sum()
    assert stats["tree_tokens"] < 0.85 * prompt_once  # response prefixes are shared too
    params = init_params(CFG, 1)
    mask = np.asarray(batch.loss_mask[:, 1:])
    ref_logp, z = token_logprobs(params, CFG, batch.tokens, batch.positions, 0.7)
    ref_ent = entropy64(z)
    for chunk in (0, 7):
        logp, ent = tree_row_logprobs(params, CFG, batch.tree, temperature=0.7, chunk=chunk)
        np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(ref_logp)[mask],
                                   atol=2e-5)
        np.testing.assert_allclose(np.asarray(ent)[mask], np.asarray(ref_ent)[mask], atol=2e-5)
        assert not np.asarray(logp)[~mask].any()  # off the mask: exactly zero


def test_tree_targets_point_at_each_rows_tokens():
    traj = branching_trajectory(3)
    batch = batch_from_trajectory(traj, group_size=N, model_config=CFG, tree=True)
    trees, tok = batch.tree, np.asarray(batch.tokens)
    length = trees.tokens.shape[1]
    for b in range(tok.shape[0]):
        cols = np.flatnonzero(trees.target[b] >= 0)
        got = np.asarray(trees.tokens).reshape(-1)[(b // N) * length + trees.target[b, cols]]
        np.testing.assert_array_equal(got, tok[b, cols + 1])


@pytest.mark.parametrize("micro_batches,chunk", [(1, 0), (2, 16)])
def test_train_step_on_trees_equals_the_rows_step(micro_batches, chunk):
    traj = branching_trajectory(1, groups=4)
    rows_cfg = TrainConfig(micro_batches=micro_batches, logprob_chunk=chunk, temperature=0.9)
    tree_cfg = TrainConfig(micro_batches=micro_batches, logprob_chunk=chunk, temperature=0.9,
                           tree=True)
    batch_rows = batch_from_trajectory(traj, group_size=N, model_config=CFG)
    batch_tree = batch_from_trajectory(traj, group_size=N, model_config=CFG, tree=True)
    out = {}
    for name, cfg, batch in (("rows", rows_cfg, batch_rows), ("tree", tree_cfg, batch_tree)):
        state = init_train_state(init_params(CFG, 2), cfg)
        new, metrics = make_train_step(cfg, CFG)(state, batch)
        out[name] = (jax.device_get(new.params), jax.device_get(metrics))
    (p_rows, m_rows), (p_tree, m_tree) = out["rows"], out["tree"]
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "clip_frac", "ratio_mean"):
        np.testing.assert_allclose(m_tree[key], m_rows[key], rtol=2e-4, atol=1e-6, err_msg=key)
    assert abs(float(m_rows["grad_norm"])) > 0
    for a, b in zip(jax.tree.leaves(p_tree), jax.tree.leaves(p_rows)):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_tree_layout_refusals():
    with pytest.raises(ValueError, match="two layouts"):
        TrainConfig(tree=True, packed=True)
    traj = branching_trajectory(2)
    with pytest.raises(ValueError, match="two layouts"):
        batch_from_trajectory(traj, group_size=N, model_config=CFG, tree=True, packed=True)
    batch = batch_from_trajectory(traj, group_size=N, model_config=CFG, tree=True)
    step = make_train_step(TrainConfig(micro_batches=4, tree=True), CFG)
    state = init_train_state(init_params(CFG, 0), TrainConfig(micro_batches=4, tree=True))
    with pytest.raises(ValueError, match="whole groups"):
        step(state, batch)


def test_tree_groups_bucket_their_length():
    tokens = jnp.asarray([[5, 6, 7, 0], [5, 6, 8, 9]], jnp.int32)
    trees = tree_groups(np.asarray(tokens), np.array([2, 2]), np.array([1, 2]), 2,
                        length_step=8)
    stats = tree_groups_stats(trees)
    assert trees.tokens.shape == (1, 8) and stats["tree_tokens"] == 5.0
    assert stats["tree_leaf_tokens"] == 7.0


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_tree_train_step_lowers_for_accelerators(platform):
    """The tree step (bf16, chunked head) traced on abstract inputs lowers for the
    platform: XLA attention under the tree mask, no kernel."""
    import functools

    from kernels.dispatch import lowered_kernels
    from rl.learner.jitted import abstract_train_state
    from rl.learner.step import train_step

    cfg = get_config("tiny", dtype="bfloat16")
    config = TrainConfig(tree=True, logprob_chunk=32, micro_batches=2)
    batch = batch_from_trajectory(branching_trajectory(4, groups=2), group_size=N,
                                  model_config=cfg, tree=True)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    fn = functools.partial(train_step, config=config, model_config=cfg)
    text = jax.jit(fn).trace(abstract_train_state(cfg, config), abstract).lower(
        lowering_platforms=(platform,)).as_text()
    found = lowered_kernels(text)
    assert "stablehlo.dot_general" in text and found["triton"] == found["mosaic"] == []


def test_batches_of_other_trees_reuse_the_compiled_step():
    """Two batches whose trees differ (other forks, other counts) but pad to the same
    shapes run on one compiled step: nothing about a tree's contents is static."""
    a = batch_from_trajectory(branching_trajectory(5), group_size=N, model_config=CFG,
                              tree=True)
    b = batch_from_trajectory(branching_trajectory(6), group_size=N, model_config=CFG,
                              tree=True)
    assert jax.tree.map(np.shape, a.tree) == jax.tree.map(np.shape, b.tree)
    assert tree_groups_stats(a.tree) != tree_groups_stats(b.tree)
    config = TrainConfig(tree=True)
    step = make_train_step(config, CFG)
    state = init_train_state(init_params(CFG, 0), config)
    compiles = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    state, _ = step(state, a)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state, _ = step(state, b)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
