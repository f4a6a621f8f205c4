"""Rollout trees packed for the learner (models/tree.py), against independent references:
the packing against the set of distinct prefixes, attention under tree_mask against a
float64 loop over each leaf's own sequence, and the decoder's logits, log-probs and
gradients on a packed tree against the same leaves run one by one as independent
sequences (models.decoder.forward)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attention
from models.config import get_config
from models.decoder import forward, init_params
from models.tree import (
    ancestors,
    pack_tree,
    stack_trees,
    tree_forward,
    tree_mask,
    tree_token_logprobs,
)


def random_leaves(rng, n_leaves=6, vocab=16, prompt=4, length=7):
    """Leaves of a rollout tree: a shared prompt, then branches forked off random points
    of earlier leaves (and one leaf that is a prefix of another)."""
    base = list(rng.integers(1, vocab, prompt + length))
    leaves = [base]
    while len(leaves) < n_leaves:
        parent = leaves[rng.integers(len(leaves))]
        cut = int(rng.integers(prompt, len(parent)))
        leaves.append(parent[:cut] + list(rng.integers(1, vocab, int(rng.integers(1, length)))))
    leaves.append(base[:prompt + 2])  # ends inside the first leaf's path
    return leaves


@pytest.mark.parametrize("seed", range(4))
def test_packing_holds_each_distinct_prefix_once(seed):
    leaves = random_leaves(np.random.default_rng(seed))
    t = pack_tree(leaves)
    prefixes = {tuple(x[:i + 1]) for x in leaves for i in range(len(x))}
    assert t.num_tokens == len(prefixes)
    for leaf, path in zip(leaves, t.paths):
        assert t.tokens[path].tolist() == [int(x) for x in leaf]
        assert t.positions[path].tolist() == list(range(len(leaf)))
        assert t.pred[path].tolist() == [-1] + path[:-1].tolist()
    # every segment after its parent, and its tokens contiguous
    first = {s: int(np.argmax(t.segment_ids == s)) for s in range(1, len(t.parents))}
    for s, p in enumerate(t.parents[1:], start=1):
        assert p == 0 or first[p] < first[s]
    assert t.packing_ratio == sum(len(x) for x in leaves) / t.num_tokens > 1


def test_ancestors_follow_the_parent_chains():
    parents = np.array([0, 0, 1, 2, 1, 0, 5])
    got = np.asarray(ancestors(jnp.asarray(parents)))
    for s in range(len(parents)):
        chain, node = set(), s
        while node != 0:
            chain.add(node)
            node = parents[node]
        assert {a for a in range(len(parents)) if got[a, s]} == chain


def naive_attention_f64(q, k, v):
    """Causal softmax attention of one sequence, float64: q, k, v [L, H, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[1:], bool))[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", w, v)


@pytest.mark.parametrize("seed", range(3))
def test_tree_attention_is_each_leaf_attended_alone(seed):
    rng = np.random.default_rng(seed)
    t = pack_tree(random_leaves(rng))
    b = stack_trees([t], length=t.num_tokens + 3)  # with padding after the tree
    n, h, d = b["tokens"].shape[1], 2, 8
    q, k, v = (rng.standard_normal((1, n, h, d)).astype(np.float32) for _ in range(3))
    mask = tree_mask(jnp.asarray(b["segment_ids"]), jnp.asarray(b["parents"]))
    out = np.asarray(attention(q, k, v, mask=mask, impl="xla"))[0]
    for path in t.paths:
        want = naive_attention_f64(q[0, path], k[0, path], v[0, path])
        np.testing.assert_allclose(out[path], want, rtol=2e-5, atol=2e-6)
    assert not np.asarray(mask)[0, t.num_tokens:].any()  # padding sees nothing


def test_decoder_on_a_tree_equals_the_leaves_run_alone():
    """Logits, token log-probs and the gradient of the summed leaf log-likelihood."""
    rng = np.random.default_rng(7)
    config = get_config("tiny", vocab_size=16)
    params = init_params(config, 0)
    # few leaves: each leaf length run alone compiles once
    trees = [pack_tree(random_leaves(rng, n_leaves=4)), pack_tree(random_leaves(rng, n_leaves=2))]
    b = {k: jnp.asarray(x) for k, x in stack_trees(trees).items()}
    logits = tree_forward(params, config, b["tokens"], b["positions"], b["segment_ids"],
                          b["parents"])
    logp = np.asarray(tree_token_logprobs(logits, b["tokens"], b["pred"]))
    # each packed token counted once per leaf through it: the sum of the leaves' losses
    weight = np.zeros(b["tokens"].shape, np.float32)
    for row, t in enumerate(trees):
        for path in t.paths:
            ids = jnp.asarray(t.tokens[path])[None]
            alone = forward(params, config, ids)
            np.testing.assert_allclose(np.asarray(logits[row, path]), np.asarray(alone[0]),
                                       rtol=1e-5, atol=1e-5)
            lp = jax.nn.log_softmax(alone[0, :-1], -1)[jnp.arange(len(path) - 1), ids[0, 1:]]
            np.testing.assert_allclose(logp[row, path[1:]], np.asarray(lp), rtol=1e-5,
                                       atol=1e-6)
            weight[row, path[1:]] += 1

    def tree_loss(p):
        lg = tree_forward(p, config, b["tokens"], b["positions"], b["segment_ids"],
                          b["parents"])
        return (tree_token_logprobs(lg, b["tokens"], b["pred"]) * weight).sum()

    def leaves_loss(p):
        total = 0.0
        for t in trees:
            for path in t.paths:
                ids = jnp.asarray(t.tokens[path])[None]
                lz = jax.nn.log_softmax(forward(p, config, ids)[0, :-1], -1)
                total = total + lz[jnp.arange(len(path) - 1), ids[0, 1:]].sum()
        return total

    g_tree, g_leaves = jax.grad(tree_loss)(params), jax.grad(leaves_loss)(params)
    for a, c in zip(jax.tree.leaves(g_tree), jax.tree.leaves(g_leaves)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-4, atol=2e-6)
    assert sum(len(p) for t in trees for p in t.paths) > 1.3 * sum(t.num_tokens for t in trees)


def test_pack_tree_refuses_empty_input():
    with pytest.raises(ValueError, match="no empty leaf"):
        pack_tree([[1, 2], []])
    with pytest.raises(ValueError, match="at least one leaf"):
        pack_tree([])


def test_ppo_on_a_tree_equals_ppo_on_its_leaves_alone():
    """The learner's PPO-clip loss (rl.objectives) on the tree's per-leaf view (leaf_index /
    gather_leaves) against the same loss on the leaves run alone as a padded batch of
    independent sequences: the loss, its metrics and the parameter gradient."""
    from rl.objectives.losses import ppo_clip_loss

    from models.tree import gather_leaves, leaf_index, tree_batch_stats

    rng = np.random.default_rng(11)
    config = get_config("tiny", vocab_size=16)
    params = init_params(config, 1)
    trees = [pack_tree(random_leaves(rng, n_leaves=3)), pack_tree(random_leaves(rng, n_leaves=2))]
    b = {k: jnp.asarray(x) for k, x in stack_trees(trees).items()}
    index, valid = leaf_index(trees)
    leaves = [t.tokens[p] for t in trees for p in t.paths]
    n = index.shape[1]
    mask = np.zeros((len(leaves), n), np.float32)  # the response: past the 4 prompt tokens
    for i, leaf in enumerate(leaves):
        mask[i, 4:len(leaf)] = 1.0
    adv = rng.normal(size=len(leaves)).astype(np.float32)
    old = rng.normal(scale=0.1, size=(len(leaves), n)).astype(np.float32) - 2.5

    def loss(logp):
        return ppo_clip_loss(logp, jnp.asarray(old), jnp.asarray(adv)[:, None] * mask,
                             jnp.asarray(mask), clip_low=0.2, clip_high=0.28)

    def tree_loss(p):
        lg = tree_forward(p, config, b["tokens"], b["positions"], b["segment_ids"], b["parents"])
        return loss(gather_leaves(tree_token_logprobs(lg, b["tokens"], b["pred"]),
                                  jnp.asarray(index), jnp.asarray(valid)))

    def leaves_loss(p):  # each leaf alone (no padding inside a forward), then padded to n
        rows = []
        for leaf in leaves:
            ids = jnp.asarray(leaf)[None]
            lz = jax.nn.log_softmax(forward(p, config, ids)[0, :-1], -1)
            lp = jnp.concatenate([jnp.zeros(1), lz[jnp.arange(len(leaf) - 1), ids[0, 1:]]])
            rows.append(jnp.pad(lp, (0, n - len(leaf))))
        return loss(jnp.stack(rows))

    (l_tree, m_tree), g_tree = jax.value_and_grad(tree_loss, has_aux=True)(params)
    (l_alone, m_alone), g_alone = jax.value_and_grad(leaves_loss, has_aux=True)(params)
    np.testing.assert_allclose(float(l_tree), float(l_alone), rtol=1e-5, atol=1e-6)
    for k in m_alone:
        np.testing.assert_allclose(np.asarray(m_tree[k]), np.asarray(m_alone[k]), rtol=1e-4,
                                   atol=1e-6, err_msg=k)
    for a, c in zip(jax.tree.leaves(g_tree), jax.tree.leaves(g_alone)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-4, atol=2e-6)
    stats = tree_batch_stats(trees)
    assert stats["tree_leaf_tokens"] == sum(len(x) for x in leaves)
    assert stats["tree_tokens"] == sum(t.num_tokens for t in trees)
    assert stats["tree_packing_ratio"] == stats["tree_leaf_tokens"] / stats["tree_tokens"] > 1
