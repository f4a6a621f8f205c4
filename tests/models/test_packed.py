"""Packed shared-prefix forward vs the naive batch (N copies of [prompt, resp_n] through
models.decoder.forward): token log-probs, logits and parameter gradients of a GRPO-style
loss for impl reference / xla / pallas (interpret); the host-side packer and the
trainer-layout scatter; bad inputs.

Compilation dominates the cost on CPU, so each model config builds ONE program holding
every path under test, compiled at -O0 (LLVM's optimisation level changes compile time,
not the HLO being compared)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig, get_config
from models.decoder import forward, init_params
from models.packed import (
    PackedGroups,
    groups_share_prompts,
    pack_groups,
    packed_forward,
    packed_response_logprobs,
    packed_token_logprobs,
)

_FAST_COMPILE = {"xla_backend_optimization_level": 0,
                 "xla_llvm_disable_expensive_passes": True}
TINY = get_config("tiny")  # llama, 4 heads / 2 kv heads, tied embeddings
# GQA 3:1, Qwen2 q/k/v biases, Qwen3 q/k norm, untied head (every optional per-token
# layer), and rematerialised layers
VARIANT = ModelConfig(
    arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=2,
    num_heads=6, num_kv_heads=2, head_dim=8, max_position_embeddings=64, qk_norm=True,
    attention_bias=True, tie_word_embeddings=False, rope_theta=500.0, remat=True)


@dataclasses.dataclass(frozen=True)
class Group:
    """Packed inputs of one test batch, plus random per-response advantages."""

    prompt_tokens: np.ndarray     # [G, P]
    prompt_lengths: np.ndarray    # [G]
    response_tokens: np.ndarray   # [G, N, R]
    response_lengths: np.ndarray  # [G, N]
    advantages: np.ndarray        # [G, N]

    @property
    def packed_args(self):
        return (self.prompt_tokens, self.prompt_lengths, self.response_tokens,
                self.response_lengths)

    @property
    def shape(self):
        return self.response_tokens.shape  # G, N, R


def make_group(config, prompt_lengths, response_lengths, p, r, seed) -> Group:
    """Random tokens everywhere, padding included (it must not matter)."""
    rng = np.random.default_rng(seed)
    g, n = np.shape(response_lengths)
    v = config.vocab_size
    return Group(rng.integers(0, v, (g, p)).astype(np.int32),
                 np.asarray(prompt_lengths, np.int32),
                 rng.integers(0, v, (g, n, r)).astype(np.int32),
                 np.asarray(response_lengths, np.int32),
                 rng.standard_normal((g, n)).astype(np.float32))


def naive_rows(grp: Group):
    """The naive batch: row g*N + n = [prompt[:P_g], resp[:R_gn], padding], width P + R,
    with segment ids (1 = token, 0 = padding) and garbage padding tokens."""
    g, n, r = grp.shape
    width = grp.prompt_tokens.shape[1] + r
    tokens = np.random.default_rng(123).integers(0, 50, (g * n, width)).astype(np.int32)
    segment_ids = np.zeros((g * n, width), np.int32)
    for gi in range(g):
        pl = grp.prompt_lengths[gi]
        for ni in range(n):
            rl = grp.response_lengths[gi, ni]
            b = gi * n + ni
            tokens[b, :pl] = grp.prompt_tokens[gi, :pl]
            tokens[b, pl:pl + rl] = grp.response_tokens[gi, ni, :rl]
            segment_ids[b, :pl + rl] = 1
    return tokens, segment_ids


def naive_gather(grp: Group):
    """(rows, cols, targets, valid) [G, N, R], by explicit loops: response token t of
    (g, n) is predicted by the naive logit at row g*N + n, column prompt_length - 1 + t."""
    g, n, r = grp.shape
    width = grp.prompt_tokens.shape[1] + r
    idx = np.zeros((4, g, n, r), np.int32)
    for gi in range(g):
        for ni in range(n):
            for t in range(r):
                col = grp.prompt_lengths[gi] - 1 + t
                idx[:, gi, ni, t] = (gi * n + ni, min(col, width - 1),
                                     grp.response_tokens[gi, ni, t],
                                     t < grp.response_lengths[gi, ni])
    return tuple(idx)


def grpo_loss(logp, advantages):
    """-sum_i A_i * sum_t logp_it (logp is 0 past each response's length)."""
    return -jnp.sum(advantages * jnp.sum(logp, axis=-1))


def run_paths(params, config, grp: Group, temperature, impls, extras=False):
    """Compile one program with the naive GRPO loss + grads and the packed one for each
    impl in `impls`; with `extras`, also packed_forward, forward(logits_at=...) and
    packed_token_logprobs on a shuffled batch. Returns numpy results (a dict)."""
    tokens, segment_ids = naive_rows(grp)
    rows, cols, targets, valid = naive_gather(grp)
    rng = np.random.default_rng(7)
    logits_at = rng.integers(0, tokens.shape[1], (tokens.shape[0], 4))
    perm = rng.permutation(tokens.shape[0])
    g, n, _ = grp.shape
    gids = np.repeat(np.array([70, 30, 50][:g]), n)
    packed = pack_groups(tokens[perm], np.repeat(grp.prompt_lengths, n)[perm],
                         grp.response_lengths.reshape(-1)[perm], gids[perm],
                         prompt_width=grp.prompt_tokens.shape[1], response_width=grp.shape[2])

    def program(prm):
        def naive_loss(p):
            logits = forward(p, config, tokens, segment_ids=segment_ids)
            logp = jax.nn.log_softmax(logits / temperature, axis=-1)[rows, cols, targets]
            logp = jnp.where(valid > 0, logp, 0.0)
            return grpo_loss(logp, grp.advantages), (logp, logits)

        out = {"naive": jax.value_and_grad(naive_loss, has_aux=True)(prm)}
        for impl in impls:
            def packed_loss(p, impl=impl):
                logp = packed_response_logprobs(p, config, *grp.packed_args,
                                                temperature=temperature, attn_impl=impl)
                return grpo_loss(logp, grp.advantages), logp
            out[impl] = jax.value_and_grad(packed_loss, has_aux=True)(prm)
        if extras:
            out["packed_forward"] = packed_forward(prm, config, *grp.packed_args,
                                                   attn_impl="xla")
            out["logits_at"] = forward(prm, config, tokens, segment_ids=segment_ids,
                                       logits_at=logits_at)
            out["token_logprobs"] = packed_token_logprobs(
                prm, config, packed, width=tokens.shape[1], temperature=1.3, attn_impl="xla")
        return out

    compiled = jax.jit(program).lower(params).compile(_FAST_COMPILE)
    res = jax.tree.map(np.asarray, compiled(params))
    res.update(tokens=tokens, logits_at_idx=logits_at, perm=perm, packed=packed,
               gids=gids[perm])
    return res


def assert_grads_close(got, want, rel=1e-5, what=""):
    """Every parameter gradient within rel * (largest entry of that leaf's gradient)."""
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree_util.tree_leaves(want)):
        name = jax.tree_util.keystr(path)
        scale = np.abs(w).max()
        assert scale > 0, f"{what}{name}: zero reference gradient"
        err = np.abs(g - w).max()
        assert err <= rel * scale, f"{what}{name}: max |d grad| {err:.3g} vs scale {scale:.3g}"


def assert_matches_naive(res, impl, grp: Group):
    (loss_n, (logp_n, _)), grads_n = res["naive"]
    (loss_p, logp_p), grads_p = res[impl]
    np.testing.assert_allclose(logp_p, logp_n, atol=1e-5, rtol=0, err_msg=impl)
    for gi, ni in zip(*np.nonzero(grp.response_lengths == 0)):
        assert not logp_p[gi, ni].any(), "an empty response must give zero log-probs"
    np.testing.assert_allclose(loss_p, loss_n, rtol=1e-5, err_msg=impl)
    assert_grads_close(grads_p, grads_n, what=f"{impl}: ")


# Ragged: a prompt shorter than P, an empty, a full and a 1-token response.
@pytest.fixture(scope="module")
def tiny():
    params = init_params(TINY, 0)
    grp = make_group(TINY, [9, 4], [[6, 0, 3], [1, 6, 4]], p=9, r=6, seed=1)
    return params, grp, run_paths(params, TINY, grp, 1.0, ("reference", "xla", "pallas"),
                                  extras=True)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_packed_logprobs_and_grads_match_naive(tiny, impl):
    """pallas runs in interpret mode on CPU (slow), so only on this one tiny case."""
    _, grp, res = tiny
    assert_matches_naive(res, impl, grp)


def test_variant_config_gqa_bias_qk_norm_temperature():
    """GQA 3:1 + q/k/v bias + q/k norm + untied head + remat, temperature 0.7, 3 groups."""
    params = init_params(VARIANT, 3)
    # biases start at zero; make them random so that they matter and get tested
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (0.1 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape)
                         if jax.tree_util.keystr(path).endswith("['bias']") else x), params)
    grp = make_group(VARIANT, [3, 7, 5], [[4, 5], [5, 1], [2, 0]], p=7, r=5, seed=4)
    assert_matches_naive(run_paths(params, VARIANT, grp, 0.7, ("xla",)), "xla", grp)


def test_packed_forward_logits_match_naive_rows(tiny):
    _, grp, res = tiny
    prompt_logits, resp_logits = res["packed_forward"]
    naive = res["naive"][0][1][1]
    g, n, _ = grp.shape
    for gi in range(g):
        pl = grp.prompt_lengths[gi]
        for ni in range(n):
            b, rl = gi * n + ni, grp.response_lengths[gi, ni]
            np.testing.assert_allclose(prompt_logits[gi, :pl], naive[b, :pl], atol=2e-5, rtol=0)
            np.testing.assert_allclose(resp_logits[gi, ni, :rl], naive[b, pl:pl + rl],
                                       atol=2e-5, rtol=0)


def test_forward_logits_at_selects_positions(tiny):
    params, _, res = tiny
    naive, idx = res["naive"][0][1][1], res["logits_at_idx"]
    np.testing.assert_allclose(res["logits_at"], np.take_along_axis(naive, idx[:, :, None], 1),
                               atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="logits_at must index the sequence"):
        forward(params, TINY, res["tokens"], logits_at=idx + res["tokens"].shape[1])
    with pytest.raises(ValueError, match=r"logits_at must be \[batch=6, K\]"):
        forward(params, TINY, res["tokens"], logits_at=idx[0])


# ----------------------------------------------------------------------------- host packer
def test_pack_groups_on_shuffled_rows(tiny):
    """Groups in order of first appearance, responses by row, prompt stored once."""
    _, grp, res = tiny
    packed, tokens, perm, gids = res["packed"], res["tokens"][res["perm"]], res["perm"], res["gids"]
    plen = np.repeat(grp.prompt_lengths, grp.shape[1])[perm]
    rlen = grp.response_lengths.reshape(-1)[perm]
    order = list(dict.fromkeys(gids.tolist()))
    for k, gid in enumerate(order):
        members = [b for b in range(len(gids)) if gids[b] == gid]
        assert packed.rows[k].tolist() == members
        pl = plen[members[0]]
        assert packed.prompt_lengths[k] == pl
        assert packed.prompt_tokens[k, :pl].tolist() == tokens[members[0], :pl].tolist()
        assert not packed.prompt_tokens[k, pl:].any()
        for j, b in enumerate(members):
            assert packed.response_lengths[k, j] == rlen[b]
            assert packed.response_tokens[k, j, :rlen[b]].tolist() == \
                tokens[b, pl:pl + rlen[b]].tolist()


def test_packed_token_logprobs_in_trainer_layout(tiny):
    """On the shuffled batch, logp / z [B, T-1] equal the naive row's log-probs and
    logits / 1.3 at every column predicting a response token, and are 0 elsewhere."""
    _, grp, res = tiny
    logp, z = res["token_logprobs"]
    perm = res["perm"]
    tokens = res["tokens"][perm]
    logits = res["naive"][0][1][1][perm].astype(np.float64) / 1.3
    want = logits - logits.max(-1, keepdims=True)
    want = want - np.log(np.exp(want).sum(-1, keepdims=True))
    plen = np.repeat(grp.prompt_lengths, grp.shape[1])[perm]
    rlen = grp.response_lengths.reshape(-1)[perm]
    b_total, width = tokens.shape
    assert logp.shape == (b_total, width - 1) and z.shape == (b_total, width - 1, TINY.vocab_size)
    for b in range(b_total):
        for c in range(width - 1):
            if plen[b] - 1 <= c < plen[b] - 1 + rlen[b]:
                assert abs(logp[b, c] - want[b, c, tokens[b, c + 1]]) < 1e-5
                np.testing.assert_allclose(z[b, c], logits[b, c], atol=2e-5, rtol=0)
            else:
                assert logp[b, c] == 0 and not z[b, c].any(), (b, c)


def test_pack_groups_rejects_bad_batches():
    tokens = np.array([[5, 6, 7, 8], [5, 6, 9, 0], [5, 7, 9, 9], [5, 7, 1, 0]])
    plen, rlen, gids = np.array([2, 2, 2, 2]), np.array([2, 1, 2, 1]), np.array([0, 0, 1, 1])
    packed = pack_groups(tokens, plen, rlen, gids)
    assert packed.response_tokens.tolist() == [[[7, 8], [9, 0]], [[9, 9], [1, 0]]]
    other_prompt = tokens.copy()
    other_prompt[3, 1] = 8
    assert groups_share_prompts(tokens, plen, rlen, gids)
    with pytest.raises(ValueError, match=r"group 1: rows 2 and 3 have different prompts"):
        pack_groups(other_prompt, plen, rlen, gids)
    assert not groups_share_prompts(other_prompt, plen, rlen, gids)
    with pytest.raises(ValueError, match=r"group 0: rows 0 and 1 have different prompts"):
        pack_groups(tokens, np.array([2, 3, 2, 2]), rlen, gids)
    assert not groups_share_prompts(tokens, np.array([2, 3, 2, 2]), rlen, gids)
    with pytest.raises(ValueError, match=r"same number of responses.*\{0: 3, 1: 1\}"):
        pack_groups(tokens, plen, rlen, np.array([0, 0, 0, 1]))
    assert not groups_share_prompts(tokens, plen, rlen, np.array([0, 0, 0, 1]))
    with pytest.raises(ValueError, match=r"R = 0"):
        pack_groups(tokens, plen, np.zeros(4, int), gids)
    assert not groups_share_prompts(tokens, plen, np.zeros(4, int), gids)
    with pytest.raises(ValueError, match=r"empty \(N = 0"):
        pack_groups(np.zeros((0, 4), int), [], [], [])
    with pytest.raises(ValueError, match="prompt_lengths must be >= 1"):
        pack_groups(tokens, np.array([0, 0, 2, 2]), rlen, gids)
    with pytest.raises(ValueError, match=r"prompt \+ response <= T=4"):
        pack_groups(tokens, plen, np.array([3, 1, 2, 1]), gids)
    with pytest.raises(ValueError, match="smaller than the longest"):
        pack_groups(tokens, plen, rlen, gids, response_width=1)


# ----------------------------------------------------------------------------- bad inputs
def test_packed_entry_points_reject_bad_inputs(tiny):
    params, grp, _ = tiny
    pt, pl, rt, rl = grp.packed_args
    call = lambda *a, **k: packed_response_logprobs(params, TINY, *a, **k)
    with pytest.raises(ValueError, match="N = 0 responses"):
        call(pt, pl, rt[:, :0], rl[:, :0])
    with pytest.raises(ValueError, match="R = 0 tokens"):
        call(pt, pl, rt[:, :, :0], rl * 0)
    with pytest.raises(ValueError, match=r"response_tokens must be \[groups, N, R\]"):
        call(pt, pl, rt[:, 0], rl)
    with pytest.raises(ValueError, match="response_tokens has 1 groups but prompt_tokens has 2"):
        call(pt, pl, rt[:1], rl[:1])
    with pytest.raises(ValueError, match=r"prompt_lengths must lie in \[1, 9\]"):
        call(pt, np.array([0, 4]), rt, rl)
    with pytest.raises(ValueError, match=r"response_lengths must lie in \[0, 6\]"):
        call(pt, pl, rt, rl + 3)
    with pytest.raises(ValueError, match=r"response_lengths must have shape \(2, 3\)"):
        call(pt, pl, rt, rl[:, :2])
    with pytest.raises(ValueError, match="out-of-vocab"):
        call(pt, pl, rt + TINY.vocab_size, rl)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        call(pt, pl, rt, rl, temperature=0.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        call(pt, pl, rt, rl, attn_impl="cuda")
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        packed_response_logprobs(params, TINY.replace(max_position_embeddings=12),
                                 *grp.packed_args)
    # params of a model with other head counts: named, not a shape error deep in XLA
    other = jax.tree_util.tree_map_with_path(
        lambda path, x: (jnp.zeros(x.shape[:2] + (4,) + x.shape[3:])
                         if "k_proj" in jax.tree_util.keystr(path) else x), params)
    with pytest.raises(ValueError, match=r"k_proj'\]\['kernel'\] has shape \(2, 64, 4, 16\).*"
                                         r"num_kv_heads=2.*expects \(2, 64, 2, 16\)"):
        packed_response_logprobs(other, TINY, pt, pl, rt, rl)
    with pytest.raises(ValueError, match="width must be the naive row width"):
        packed_token_logprobs(params, TINY, PackedGroups(pt, pl, rt, rl, np.zeros((2, 3), int)),
                              width=1)
