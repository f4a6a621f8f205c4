"""Tree attention for training (kernels/tree_attention, models.tree.visible_until): one int
per key (kend) gives exactly the tree mask of a depth-first packing; the Triton kernel
(interpret mode) equals a float64 walk over each query's visible keys, forward, and the
reference's gradients in q, k, v (GQA, head_dim padded, T not a multiple of the tile,
padding rows); the decoder's tree mode on the kernel gives the rows' log-probs and the
dense path's parameter gradients; it lowers for cuda; bad input is refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.tree_attention import kend_mask, tree_attention, tree_attention_reference
from models.tree import pack_tree, stack_trees, tree_mask, visible_until


def random_leaves(rng, vocab=4):
    """Leaves that fork off each other: each one a random prefix of an earlier leaf (or
    nothing) and fresh tokens."""
    leaves = []
    for _ in range(int(rng.integers(1, 7))):
        head = []
        if leaves and rng.random() < 0.8:
            parent = leaves[int(rng.integers(len(leaves)))]
            head = parent[:int(rng.integers(0, len(parent) + 1))]
        tail = list(rng.integers(0, vocab, int(rng.integers(0 if head else 1, 6))))
        leaves.append(head + tail)
    return leaves


def random_trees(seed, batch=2, length=40):
    rng = np.random.default_rng(seed)
    trees = [pack_tree(random_leaves(rng)) for _ in range(batch)]
    st = stack_trees(trees, length=length)
    return jnp.asarray(st["segment_ids"]), jnp.asarray(st["parents"])


def test_kend_is_the_tree_mask_of_a_depth_first_packing():
    # by hand: leaves [1 2 3], [1 2 4], [1 5] pack as segments [1] | [2] | [3] | [4] | [5]
    # (1 forks into 2 and 5, 2 into 3 and 4): [2]'s subtree is [2 3 4], ends at 4
    tree = pack_tree([[1, 2, 3], [1, 2, 4], [1, 5]])
    np.testing.assert_array_equal(tree.tokens, [1, 2, 3, 4, 5])
    st = stack_trees([tree], length=8)
    kend = visible_until(jnp.asarray(st["segment_ids"]), jnp.asarray(st["parents"]))
    np.testing.assert_array_equal(kend, [[5, 4, 3, 4, 5, 0, 0, 0]])
    for seed in range(40):  # random forests, padded, against models.tree.tree_mask
        seg, par = random_trees(seed)
        np.testing.assert_array_equal(kend_mask(visible_until(seg, par)),
                                      tree_mask(seg, par), err_msg=str(seed))


def walk64(q, k, v, seg, par, scale):
    """float64 attention of every query over the keys tree_mask lets it see (zeros for a
    query that sees none)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mask = np.asarray(tree_mask(seg, par))
    rep = q.shape[2] // k.shape[2]
    out = np.zeros_like(q)
    for b, i, h in np.ndindex(q.shape[:3]):
        keys = np.flatnonzero(mask[b, i])
        if keys.size:
            s = k[b, keys, h // rep] @ q[b, i, h] * scale
            p = np.exp(s - s.max())
            out[b, i, h] = (p / p.sum()) @ v[b, keys, h // rep]
    return out


def qkv(seed, t=40, heads=4, kv_heads=2, d=8):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (2, t, heads, d)),
            jax.random.normal(ks[1], (2, t, kv_heads, d)),
            jax.random.normal(ks[2], (2, t, kv_heads, d)))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_equals_a_float64_walk(seed):
    seg, par = random_trees(seed + 100)
    q, k, v = qkv(seed)
    kend = visible_until(seg, par)
    want = walk64(q, k, v, seg, par, 8 ** -0.5)
    for impl in ("pallas", "reference"):
        got = tree_attention(q, k, v, kend, impl=impl, block=16)
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=impl)
    assert not np.asarray(got)[np.asarray(seg) == 0].any()  # padding rows: zeros


def test_the_kernel_gradients_equal_the_references():
    seg, par = random_trees(7)
    q, k, v = qkv(3)
    kend = visible_until(seg, par)
    w = jax.random.normal(jax.random.key(9), q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    kernel = jax.grad(loss(lambda *a: tree_attention(*a, kend, impl="pallas", block=16)),
                      argnums=(0, 1, 2))(q, k, v)
    dense = jax.grad(loss(lambda *a: tree_attention_reference(*a, kend, 8 ** -0.5)),
                     argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", kernel, dense):
        assert float(jnp.abs(b).max()) > 0.1
        np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"d{name}")


def test_tree_rows_on_the_kernel_equal_the_rows_and_the_dense_gradient():
    from models.decoder import init_params
    from models.logprobs import token_logprobs
    from models.tree import tree_row_logprobs
    from rl.learner import batch_from_trajectory
    from tests.rl.test_tree_learner import CFG, N, branching_trajectory

    batch = batch_from_trajectory(branching_trajectory(0), group_size=N, model_config=CFG,
                                  tree=True)
    params = init_params(CFG, 1)
    mask = np.asarray(batch.loss_mask[:, 1:])
    ref, _ = token_logprobs(params, CFG, batch.tokens, batch.positions, 0.7)
    got, _ = tree_row_logprobs(params, CFG, batch.tree, temperature=0.7, attn_impl="pallas")
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(ref)[mask], atol=2e-5)

    def total(p, impl):
        return jnp.sum(tree_row_logprobs(p, CFG, batch.tree, temperature=0.7,
                                         attn_impl=impl)[0])

    g_kernel = jax.grad(total)(params, "pallas")
    g_dense = jax.grad(total)(params, None)
    for a, b in zip(jax.tree.leaves(g_kernel), jax.tree.leaves(g_dense)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_the_kernel_lowers_for_cuda():
    from jax import export

    from kernels.dispatch import TRITON_CUSTOM_CALL

    seg, par = random_trees(2, length=128)
    q, k, v = qkv(0, t=128, d=64)
    kend = visible_until(seg, par)

    def fwd_bwd(q, k, v, kend):
        return jax.grad(lambda q, k, v: jnp.sum(tree_attention(q, k, v, kend, impl="pallas")),
                        argnums=(0, 1, 2))(q, k, v)

    exp = export.export(jax.jit(fwd_bwd), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(q, k, v, kend)
    text = exp.mlir_module()
    for name in ("tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv"):
        assert name in text, name
    assert text.count(TRITON_CUSTOM_CALL) >= 3


@pytest.mark.parametrize("kwargs, match", [
    ({"impl": "pallas_mosaic"}, "no Mosaic"),
    ({"impl": "pallas", "block": 24}, "power of two"),
])
def test_bad_input_is_refused(kwargs, match):
    q, k, v = qkv(0, t=16)
    with pytest.raises(ValueError, match=match):
        tree_attention(q, k, v, jnp.zeros((2, 16), jnp.int32), **kwargs)
    with pytest.raises(ValueError, match="kend must be"):
        tree_attention(q, k, v, jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="multiple of KVH"):
        tree_attention(q[:, :, :3], k, v, jnp.zeros((2, 16), jnp.int32))
