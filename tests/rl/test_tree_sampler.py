"""Tree rollouts (rl.rollout.tree_sampler, rl.rollout.latr) on the tiny model.

- no branching (mix_ratio 0): the tree path is `generate` token for token;
- forks: every row's behaviour log-probs equal a full forward of that row alone
  (float64 reference), every forked row shares its parent's tokens up to its fork and
  differs at it, and the leaves pack into fewer tokens than they hold;
- the branching rule and the pruning rule against hand-worked cases, and the edit
  distance against a naive recursion.
"""
import dataclasses
import functools
import math

import numpy as np
import pytest

from models.config import get_config
from models.decoder import forward, init_params
from rl.rollout import SamplingConfig, generate
from rl.rollout.latr import (
    Branch,
    LatrConfig,
    TreeRequest,
    _choose,
    _GroupTree,
    _prune,
    edit_distance,
    sample_latr,
)

CFG = get_config("tiny")
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 200]]
TEMP = SamplingConfig(temperature=0.7)
N, R = 4, 12


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def test_without_a_tree_the_rows_are_generates_token_for_token(params):
    ref = generate(params, CFG, PROMPTS, max_new_tokens=R, sampling=TEMP, stop_ids=(),
                   rng=3, num_samples=N)
    out = sample_latr(params, CFG, PROMPTS, TreeRequest(N, R, sampling=TEMP, stop_ids=()),
                      rng=3, latr=LatrConfig(mix_ratio=0.0))
    assert out.tokens == ref.tokens
    for a, b in zip(out.logprobs, ref.logprobs):
        np.testing.assert_allclose(np.stack(a), np.stack(b), atol=1e-6)
    assert out.stats.decoded_tokens == len(PROMPTS) * N * R and out.stats.branches == 0


def ref_logprobs(params, prompt, response, temperature):
    """log softmax(logits / T) of each response token, from one full forward (float64)."""
    toks = np.asarray([list(prompt) + list(response)], np.int32)
    lg = np.asarray(forward(params, CFG, toks), np.float64)[0]
    out = []
    for t, tok in enumerate(response):
        z = lg[len(prompt) - 1 + t] / temperature
        out.append(z[tok] - (z.max() + math.log(np.exp(z - z.max()).sum())))
    return np.array(out)


def test_forked_rows_are_exact_continuations_of_their_parents(params):
    # every candidate passes (τ_abs = 0, no τ_rel): the tree fills at its first steps;
    # no pruning (no lookahead reached)
    cfg = LatrConfig(prob_abs=0.0, prob_rel=None, lookahead=(R + 1,), max_branch_per_token=3)
    out = sample_latr(params, CFG, PROMPTS, TreeRequest(N, R, sampling=TEMP, stop_ids=()),
                      rng=1, latr=cfg)
    assert out.stats.branches == len(PROMPTS) * (N - 1)
    for g, prompt in enumerate(PROMPTS):
        rows = out.tokens[g]
        assert len(rows) == N and len({tuple(r) for r in rows}) == N  # N distinct leaves
        for i, row in enumerate(rows):
            assert len(row) == R
            np.testing.assert_allclose(out.logprobs[g][i], ref_logprobs(params, prompt, row, 0.7),
                                       atol=1e-4)
            p, f = out.parent[g][i], out.fork_at[g][i]
            if p >= 0:
                assert rows[p][:f] == row[:f] and rows[p][f] != row[f]
        # before the tree is full a branch takes its most likely token (c_1), so the root's
        # first token is the argmax of the prompt's next-token distribution
        lg = np.asarray(forward(params, CFG, np.asarray([prompt], np.int32)))[0, -1]
        assert rows[0][0] == int(np.argmax(lg))
    assert out.stats.tree_tokens < out.stats.leaf_tokens
    assert out.stats.decoded_tokens < out.stats.leaf_tokens  # prefixes decoded once


def test_pruned_branches_leave_and_the_first_leaf_fills_their_place(params):
    # δ = 1 prunes every branch at lookahead 2 (edit distance / 2 <= 1 always): what is
    # left at the end is the root and whatever forked in the last two steps
    cfg = LatrConfig(prob_abs=0.0, prob_rel=None, lookahead=(2,), edit_threshold=1.01)
    out = sample_latr(params, CFG, PROMPTS[:1], TreeRequest(N, R, sampling=TEMP, stop_ids=()),
                      rng=2, latr=cfg)
    assert out.stats.pruned > 0
    rows, parent, fork = out.tokens[0], out.parent[0], out.fork_at[0]
    assert len(rows) == N
    for i in range(1, N):
        # a surviving branch forked at R - 1 (age 1 at the end); a filler repeats row 0
        assert (parent[i] >= 0 and fork[i] == R - 1) or rows[i] == rows[0]


def test_shared_and_copied_forks_give_the_same_rows(params):
    # every candidate passes and δ > 1 prunes every branch at age 2, so freed slots are
    # forked again and again: a reused slot holds stale keys below its new fork, which the
    # tree of segments must not read
    cfg = LatrConfig(prob_abs=0.0, prob_rel=None, lookahead=(2,), edit_threshold=1.01)
    req = TreeRequest(N, R, sampling=TEMP, stop_ids=())
    shared = sample_latr(params, CFG, PROMPTS, req, rng=2, latr=cfg)
    copied = sample_latr(params, CFG, PROMPTS, dataclasses.replace(req, share_kv=False), rng=2,
                         latr=cfg)
    assert shared.stats.branches > 2 * len(PROMPTS) * N and shared.stats.pruned > 0
    assert shared.tokens == copied.tokens
    assert (shared.parent, shared.fork_at) == (copied.parent, copied.fork_at)
    for g, prompt in enumerate(PROMPTS):
        for i, row in enumerate(shared.tokens[g]):
            np.testing.assert_allclose(shared.logprobs[g][i], copied.logprobs[g][i], atol=1e-5)
            np.testing.assert_allclose(shared.logprobs[g][i],
                                       ref_logprobs(params, prompt, row, 0.7), atol=1e-4)


@pytest.mark.parametrize("latr", [
    LatrConfig(prob_abs=0.02, prob_rel=None, lookahead=(2, 5), edit_threshold=0.9),
    LatrConfig(prob_abs=0.02, prob_rel=0.3, lookahead=(4,), edit_threshold=1.01,
               max_branch_per_token=3),
    LatrConfig(prob_abs=0.02, prob_rel=None, lookahead=(3, 6), edit_threshold=0.5,
               sample_when="always", mix_ratio=0.5)], ids=["prune-some", "prune-all", "mix"])
def test_steps_on_device_give_the_rows_of_one_token_per_call(params, latr):
    # a sharper policy (final norm x 7: top-2 probabilities around 0.9 / 0.01-0.04) so that
    # some steps branch and most do not; stop ids end some branches early
    sharp = {**params, "final_norm": {"scale": params["final_norm"]["scale"] * 7}}
    prompts = PROMPTS + [[7, 7]]
    req = TreeRequest(N, 24, sampling=TEMP, stop_ids=(3, 11))
    one, chunked = (sample_latr(sharp, CFG, prompts, dataclasses.replace(req, decode_chunk=c),
                                rng=5, latr=latr) for c in (1, 16))
    assert one.stats.branches > 0 and one.stats.decode_calls == 24
    assert chunked.stats.decode_calls < 12  # most steps had nothing to decide
    assert (chunked.tokens, chunked.parent, chunked.fork_at, chunked.finished) == \
        (one.tokens, one.parent, one.fork_at, one.finished)
    assert dataclasses.replace(chunked.stats, decode_calls=0) == \
        dataclasses.replace(one.stats, decode_calls=0)
    for a, b in zip(chunked.logprobs, one.logprobs):  # two programs: float rounding apart
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-5)


def test_the_tree_kernel_grows_the_rows_of_the_xla_path(params):
    # attn_impl "pallas": every attention of the sampler through the Pallas kernels
    # (interpret mode on CPU), the tree's decode through tree_decode_attention's kernel
    sharp = {**params, "final_norm": {"scale": params["final_norm"]["scale"] * 7}}
    latr = LatrConfig(prob_abs=0.02, prob_rel=None, lookahead=(2, 5), edit_threshold=0.9)
    req = TreeRequest(N, R, sampling=TEMP, stop_ids=(3, 11))
    xla, kernel = (sample_latr(sharp, CFG, PROMPTS, dataclasses.replace(req, attn_impl=impl),
                               rng=5, latr=latr) for impl in (None, "pallas"))
    assert xla.stats.branches > 0 and kernel.tokens == xla.tokens
    for a, b in zip(kernel.logprobs, xla.logprobs):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-5)


def test_a_shared_fork_copies_no_keys(params):
    import jax

    from rl.rollout.sampler import prefill
    from rl.rollout.sampler_state import new_state, sample_keys
    from rl.rollout.tree_sampler import (
        fork_slots,
        retire_slots,
        share_prefixes,
        tree_decode_step,
    )

    def grow(share):
        state = new_state(CFG, num_slots=N, max_prompt_len=3, max_new_tokens=R, sampling=TEMP,
                          stop_ids=(), attn_impl=None, cache_dtype=None, group_size=N)
        state = prefill(params, state, [np.asarray(PROMPTS[0], np.int32)], np.arange(N)[None],
                        sample_keys(0, np.arange(1), N))
        state = retire_slots(share_prefixes(state) if share else state, [1, 2, 3])
        for _ in range(3):
            state, _ = tree_decode_step(params, state, 0)
        state = fork_slots(state, [0], [2], [7], [-1.0])  # slot 2 continues slot 0's 3 keys
        for _ in range(2):
            state, _ = tree_decode_step(params, state, 0)
        return jax.device_get(fork_slots(state, [2], [3], [9], [-1.0]).cache)  # 3 + 2 keys

    cache = grow(share=True)
    # retired slots make throw-away writes at their length (0 here), never read
    assert not cache.k_resp[:, 0, 2, 1:3].any() and not cache.k_resp[:, 0, 3, 1:5].any()
    assert cache.k_resp[:, 0, 2, 3:5].all(axis=-1).all()  # slot 2's own keys, from its fork
    np.testing.assert_array_equal(cache.resp_lengths[0], [5, 0, 5, 5])
    # rows of the tree: slot 3 reads slot 0 in [0, 3), slot 2 in [3, 5), itself from 5
    np.testing.assert_array_equal(cache.tree.lo[0, 3], [0, 0, 3, 5])
    np.testing.assert_array_equal(cache.tree.hi[0, 3, :3], [3, 0, 5])
    np.testing.assert_array_equal(cache.tree.lo[0, 2, [0, 2]], [0, 3])
    copied = grow(share=False)  # the slow twin copies the prefix's keys into the child
    np.testing.assert_array_equal(copied.k_resp[:, 0, 3, :5], copied.k_resp[:, 0, 2, :5])
    np.testing.assert_array_equal(copied.k_resp[:, 0, 3, :3], copied.k_resp[:, 0, 0, :3])
    np.testing.assert_allclose(copied.k_resp[:, 0, 3, :5],
                               np.concatenate([cache.k_resp[:, 0, 0, :3],
                                               cache.k_resp[:, 0, 2, 3:5]], axis=1), atol=1e-5)
    with pytest.raises(ValueError, match="no tree-of-segments kernel"):
        share_prefixes(_mosaic_state())


def _mosaic_state():
    from rl.rollout.sampler_state import new_state

    return new_state(CFG, num_slots=N, max_prompt_len=3, max_new_tokens=R, sampling=TEMP,
                     stop_ids=(), attn_impl="pallas_mosaic", cache_dtype=None, group_size=N)


def probs_of(rows):
    """Candidates for slots 0..len(rows)-1: ids k * 10 + slot, the given probabilities."""
    p = np.asarray(rows, np.float32)
    ids = (np.arange(p.shape[1])[None, :] * 10 + np.arange(p.shape[0])[:, None]).astype(np.int32)
    return ids, p, np.log(np.maximum(p, 1e-9))


def test_branching_rule_admits_candidates_by_rank_then_branch():
    tree = _GroupTree(0, 4, 4)
    tree.branches.append(Branch(slot=1, parent=0, fork_at=0))
    tree.free.remove(1)
    cfg = LatrConfig(max_branch_per_token=3)  # τ_abs = τ_rel = 0.2
    # slot 0: c2 passes (0.25 > 0.2, 0.5 - 0.25 > 0.2), c3 fails τ_abs; slot 1: c2 and c3 pass
    cand = probs_of([[0.5, 0.25, 0.1], [0.6, 0.21, 0.21]])
    rewrites, forks, new = _choose(tree, cfg, cand, None, {0: 7, 1: 1})
    # room for 2: both 2nd candidates first (slot 0's, slot 1's), slot 1's 3rd left out
    assert [(p, t) for p, _, t, _ in forks] == [(0, 10), (1, 11)]
    assert [b for b, _ in new] == [0, 1]
    # both branching slots take their top token c_1: slot 0 drew 7, so it is rewritten
    assert [(s, t) for s, t, _ in rewrites] == [(0, 0)]


def test_a_full_tree_samples_and_a_growing_one_takes_the_top_token():
    cfg = LatrConfig()
    cand = probs_of([[0.9, 0.05], [0.9, 0.05]])  # nobody branches (0.05 < τ_abs)
    growing = _GroupTree(0, 4, 4)
    rewrites, forks, _ = _choose(growing, cfg, cand, None, {0: 3})
    assert forks == [] and [(s, t) for s, t, _ in rewrites] == [(0, 0)]
    full = _GroupTree(0, 2, 1)  # K = 1: the root alone is a full tree
    rewrites, forks, _ = _choose(full, cfg, cand, None, {0: 3})
    assert forks == [] and rewrites == []  # keeps its sampled token
    always = _GroupTree(0, 4, 4)
    assert _choose(always, LatrConfig(sample_when="always"), cand, None, {0: 3})[0] == []
    # τ_rel: p1 - p2 = 0.1 is not > 0.2, so no branch; dropping τ_rel lets it branch
    close = probs_of([[0.45, 0.35]])
    assert _choose(_GroupTree(0, 4, 4), cfg, close, None, {0: 0})[1] == []
    assert len(_choose(_GroupTree(0, 4, 4), LatrConfig(prob_rel=None), close, None,
                       {0: 0})[1]) == 1


def test_pruning_at_the_lookahead_by_edit_distance_with_descendants():
    tree = _GroupTree(0, 4, 4)
    tree.branches += [Branch(slot=1, parent=0, fork_at=2), Branch(slot=2, parent=1, fork_at=3),
                      Branch(slot=3, parent=0, fork_at=1)]
    tree.free = []
    mirror = {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 9, 4, 5], 2: [1, 2, 9, 8], 3: [1, 7, 7, 7]}
    # branch 1: age 3, window [9, 4, 5] vs the root's [3, 4, 5]: distance 1/3 < 0.4 -> pruned,
    # and branch 2 (forked from it) with it; branch 3: age 3, [7, 7, 7] vs [2, 3, 4]: 3/3, kept
    cfg = LatrConfig(lookahead=(3,), edit_threshold=0.4)
    assert _prune(tree, cfg, mirror, stop=set()) == [1, 2]
    assert tree.alive() == [0, 3] and sorted(tree.free) == [1, 2]
    # a stop token in a window skips the comparison
    tree2 = _GroupTree(0, 4, 4)
    tree2.branches.append(Branch(slot=1, parent=0, fork_at=2))
    assert _prune(tree2, cfg, mirror, stop={5}) == []


@functools.cache
def naive_distance(a: tuple, b: tuple) -> int:
    if not a or not b:
        return len(a) + len(b)
    return min(naive_distance(a[1:], b) + 1, naive_distance(a, b[1:]) + 1,
               naive_distance(a[1:], b[1:]) + (a[0] != b[0]))


def test_edit_distance_matches_the_naive_recursion():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = tuple(rng.integers(0, 4, rng.integers(0, 8)).tolist())
        b = tuple(rng.integers(0, 4, rng.integers(0, 8)).tolist())
        assert edit_distance(a, b) == naive_distance(a, b)


def test_invalid_settings_are_refused(params):
    with pytest.raises(ValueError, match="plain temperature"):
        TreeRequest(N, R, sampling=SamplingConfig(greedy=True))
    with pytest.raises(ValueError, match="mix_ratio"):
        LatrConfig(mix_ratio=1.5)
    with pytest.raises(ValueError, match="sample_when"):
        LatrConfig(sample_when="sometimes")


def test_train_with_latr_logs_its_tree_and_round_trips(tmp_path):
    import json

    from experiments.common.flags import build_train_parser, config_from_args
    from experiments.common.train_cli import main
    from rl.loops.config import RunConfig

    flags = ["--steps", "3", "--segment-len", "2", "--latr", "--latr-abs", "0.0", "--latr-rel", "-1",
             "--latr-lookahead", "2", "4", "--eval-prompts", "8", "--eval-every", "3",
             "--save-every", "0", "--run-dir", str(tmp_path / "run"), "--wandb", "disabled",
             "--no-progress", "--tree-batches"]
    cfg = config_from_args(build_train_parser().parse_args(flags))
    assert cfg.latr == LatrConfig(prob_abs=0.0, prob_rel=-1.0, lookahead=(2, 4))
    assert cfg.train.tree and not cfg.train.packed
    assert RunConfig.from_json(cfg.to_json()) == cfg
    main(flags)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert len(train) == 3
    for r in train:
        assert r["tree_branches"] > 0 and r["tree_packing_ratio"] > 1.0
        assert r["tree_decoded_per_leaf_token"] < 1.0
        # the learner trained on the trees: fewer tokens than its rows hold
        assert r["learner_tree_tokens"] < r["learner_leaf_tokens"]
        assert np.isfinite(r["loss"])
    with pytest.raises(ValueError, match="two learner layouts"):
        config_from_args(build_train_parser().parse_args(["--tree-batches", "--packed"]))
    with pytest.raises(ValueError, match="goes with --latr"):
        config_from_args(build_train_parser().parse_args(["--latr-abs", "0.1"]))
    with pytest.raises(ValueError, match="LATR tree rollouts"):
        cfg.override("prune.warmup", 4).validate()


def test_top_candidates_are_lax_top_k():
    import jax

    from rl.rollout.tree_sampler import top_candidates

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(50), 16).astype(np.float32)
    probs[3, [7, 9, 20]] = 0.5  # ties go to the lower id
    for m in (1, 2, 3):
        want = jax.lax.top_k(probs, m)
        got = top_candidates(probs, m)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
