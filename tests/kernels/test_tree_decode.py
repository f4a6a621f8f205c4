"""Tree-of-segments decode attention against a float64 numpy loop that walks each sample's
root-to-leaf path and attends to the keys it meets (an independent reference), and against
`segment_decode_attention` where the tree has no fork."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.segment_decode import segment_decode_attention, tree_decode_attention


def _random_tree(rng, n, r_max):
    """parent[i] (-1: a root), fork[i] (where i's own entries begin), length[i]: each child
    forks from an earlier sample at an index <= that parent's length."""
    parent, fork, length = [-1], [0], [int(rng.integers(0, r_max + 1))]
    for i in range(1, n):
        if rng.random() < 0.3:
            parent.append(-1), fork.append(0)
        else:
            p = int(rng.integers(0, i))
            parent.append(p)
            fork.append(int(rng.integers(fork[p], length[p] + 1)))
        length.append(int(rng.integers(fork[i], r_max + 1)))
    return parent, fork, length


def _spans(parent, fork, length):
    """resp_lo / resp_hi [N, N] of the module's convention: i's path, segment by segment."""
    n = len(parent)
    lo, hi = np.zeros((n, n), np.int32), np.zeros((n, n), np.int32)
    for i in range(n):
        lo[i, i], hi[i, i] = fork[i], length[i]
        end, node = fork[i], parent[i]
        while node >= 0:
            lo[i, node], hi[i, node] = fork[node], end
            end, node = fork[node], parent[node]
    return lo, hi


def _path_keys(i, parent, fork, length):
    """(segment, index) of every key sample i sees, walking up its path (independent of the
    span tables)."""
    keys, end, node = [(i, r) for r in range(fork[i], length[i])], fork[i], parent[i]
    while node >= 0:
        keys += [(node, r) for r in range(fork[node], end)]
        end, node = fork[node], parent[node]
    return keys


def _naive(q, kp, vp, kr, vr, plen, trees, k_new, v_new, scale):
    g, n, h, d = q.shape
    hpk = h // kp.shape[2]
    out = np.zeros((g, n, h, d))
    for a in range(g):
        parent, fork, length = trees[a]
        for i in range(n):
            ks = [kp[a, t] for t in range(plen[a])] + [kr[a, j, r] for j, r in
                                                      _path_keys(i, parent, fork, length)]
            vs = [vp[a, t] for t in range(plen[a])] + [vr[a, j, r] for j, r in
                                                      _path_keys(i, parent, fork, length)]
            ks.append(k_new[a, i])
            vs.append(v_new[a, i])
            K, V = np.stack(ks), np.stack(vs)  # [L, kv_heads, d]
            for hh in range(h):
                s = K[:, hh // hpk] @ q[a, i, hh] * scale
                w = np.exp(s - s.max())
                out[a, i, hh] = (w / w.sum()) @ V[:, hh // hpk]
    return out


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_tree_attention_is_attention_over_each_path(impl):
    rng = np.random.default_rng(0)
    g, n, p, r_max, h, kvh, d = 3, 5, 6, 7, 4, 2, 8
    f = lambda *s: rng.standard_normal(s)
    q, kp, vp = f(g, n, h, d), f(g, p, kvh, d), f(g, p, kvh, d)
    kr, vr, k_new, v_new = f(g, n, r_max, kvh, d), f(g, n, r_max, kvh, d), f(g, n, kvh, d), \
        f(g, n, kvh, d)
    plen = rng.integers(0, p + 1, g)
    trees = [_random_tree(rng, n, r_max) for _ in range(g)]
    assert any(x >= 0 for t in trees for x in t[0])  # some sample forked
    lo, hi = map(np.stack, zip(*[_spans(*t) for t in trees]))
    want = _naive(q, kp, vp, kr, vr, plen, trees, k_new, v_new, 1 / np.sqrt(d))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = tree_decode_attention(f32(q), f32(kp), f32(vp), f32(kr), f32(vr),
                                prompt_lengths=plen, resp_lo=lo, resp_hi=hi, k_new=f32(k_new),
                                v_new=f32(v_new), impl=impl)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    # under jit (traced spans) the same
    jitted = jax.jit(lambda lo, hi: tree_decode_attention(
        f32(q), f32(kp), f32(vp), f32(kr), f32(vr), prompt_lengths=plen, resp_lo=lo,
        resp_hi=hi, k_new=f32(k_new), v_new=f32(v_new), impl=impl))
    np.testing.assert_allclose(np.asarray(jitted(lo, hi)), want, atol=2e-5, rtol=2e-5)


def test_without_forks_it_is_segment_decode():
    rng = np.random.default_rng(1)
    g, n, p, r_max, h, kvh, d = 2, 4, 5, 6, 6, 3, 16
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, kp, vp, kr, vr = f(g, n, h, d), f(g, p, kvh, d), f(g, p, kvh, d), \
        f(g, n, r_max, kvh, d), f(g, n, r_max, kvh, d)
    plen, rlen = rng.integers(0, p + 1, g), rng.integers(0, r_max + 1, (g, n))
    hi = np.zeros((g, n, n), np.int32)
    hi[:, np.arange(n), np.arange(n)] = rlen
    got = tree_decode_attention(q, kp, vp, kr, vr, prompt_lengths=plen,
                                resp_lo=np.zeros_like(hi), resp_hi=hi)
    want = segment_decode_attention(q, kp, vp, kr, vr, prompt_lengths=plen,
                                    resp_lengths=rlen, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_refuses_what_it_cannot_do():
    z = jnp.zeros
    args = (z((1, 2, 2, 4)), z((1, 3, 1, 4)), z((1, 3, 1, 4)), z((1, 2, 5, 1, 4)),
            z((1, 2, 5, 1, 4)))
    ok = dict(prompt_lengths=np.array([3]), resp_lo=np.zeros((1, 2, 2), int),
              resp_hi=np.zeros((1, 2, 2), int))
    with pytest.raises(ValueError, match="no Mosaic kernel"):
        tree_decode_attention(*args, **ok, impl="pallas_mosaic")
    with pytest.raises(ValueError, match="block_k"):
        tree_decode_attention(*args, **ok, impl="pallas", block_k=24)
    with pytest.raises(ValueError, match="resp_hi must have shape"):
        tree_decode_attention(*args, **{**ok, "resp_hi": np.zeros((1, 2), int)})
    with pytest.raises(ValueError, match="resp_lo must lie in"):
        tree_decode_attention(*args, **{**ok, "resp_lo": np.full((1, 2, 2), 6)})


def _inputs(seed, g=2, n=4, p=20, r_max=40, h=4, kvh=2, d=16, dtype=jnp.float32):
    rng = np.random.default_rng(seed)

    def f(*s):
        return jnp.asarray(rng.standard_normal(s), dtype)

    trees = [_random_tree(rng, n, r_max) for _ in range(g)]
    lo, hi = map(np.stack, zip(*[_spans(*t) for t in trees]))
    return (f(g, n, h, d), f(g, p, kvh, d), f(g, p, kvh, d), f(g, n, r_max, kvh, d),
            f(g, n, r_max, kvh, d)), dict(prompt_lengths=rng.integers(0, p + 1, g), resp_lo=lo,
                                          resp_hi=hi, k_new=f(g, n, kvh, d), v_new=f(g, n, kvh, d))


@pytest.mark.parametrize("d, block_k", [(16, 16), (8, 32)])
def test_pallas_kernel_matches_the_xla_path_in_interpret_mode(d, block_k):
    # spans that start and end inside tiles, a tile straddling two spans, head_dim 8
    # (zero-padded to 16 for Triton), R not a multiple of block_k (zero-padded)
    args, kw = _inputs(3, d=d, r_max=40)
    want = tree_decode_attention(*args, **kw, impl="xla")
    got = tree_decode_attention(*args, **kw, impl="pallas", block_k=block_k, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_pallas_kernel_lowers_for_cuda():
    from jax import export

    from kernels.dispatch import lowered_kernels

    args, kw = _inputs(4, dtype=jnp.bfloat16)
    fn = jax.jit(lambda *a: tree_decode_attention(*a, **kw, impl="pallas_triton"))
    exp = export.export(fn, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "tree_decode_response" in lowered_kernels(exp.mlir_module())["triton"]
