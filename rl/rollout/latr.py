"""LATR: Lookahead Tree-Based Rollouts (Xing et al., arXiv 2510.24302, ICLR 2026).

A group's N samples are grown as a tree instead of N independent chains, to make them
differ at the trajectory level. Three stages repeat at every decode step t:

1. **Branching at uncertain steps.** For a live branch with next-token distribution
   p = softmax(z_t) and its top-m tokens c_1 (most likely), c_2, ..., c_m, a candidate
   c_k (k >= 2) opens a new branch when

       p(c_k) > τ_abs    and    p(c_1) - p(c_k) > τ_rel,

   the two tests of the authors' code (starreeze/latr, `ProbFilter`; τ_rel = None drops
   the second). The branch that branched continues with c_1, each new branch with its
   c_k. The tree holds at most K = round(N · mix_ratio) branches: when more candidates
   pass than there is room for, they are admitted in (k, branch) order (every branch's
   2nd candidate before any 3rd). A branch that does not branch takes c_1 while the
   tree has fewer than K branches and samples from softmax(z_t / T) once it is full
   (`sample_when="full"`, the authors' default; "always": sample whenever not branching).
2. **Lookahead simulation.** A new branch born at step b decodes on beside its parent.
3. **Pruning.** At t = b + L for each lookahead length L in `lookahead`, the branch's L
   tokens since the fork a = y_{b:b+L} are compared with its parent's, p = ȳ_{b:b+L}:

       prune  if  EditDistance(a, p) / L < δ

   (skipped when either window holds a stop token, as in the authors' code). A pruned
   branch is removed with every branch forked from it, and its slot is free for new
   branches.
The tree's K leaves, then N - K independent samples, are the group whose rewards GRPO
(or DAPO) normalises: every leaf is one sample of the group, weighted like an independent
one (the paper trains on the leaves as ordinary rollouts). A tree that ends with fewer than
K leaves repeats its first leaf to K (the authors' `fill_return_sequences`). Each token's
behaviour log-prob is log softmax(z_t / T)[token], the sampling policy's probability of
it, whether it was drawn, taken as c_1 or opened a branch: the learner's ratio π/μ is
taken against the policy the tokens were scored under, not against the tree's selection
rule (the same as the authors' pipeline, where veRL recomputes the old log-probs).

Implementation: the host mirrors each slot's tokens and makes the decisions above at the
steps that need one; the steps in between (no candidate passes the branching test, no
branch at a lookahead) run on device, up to `TreeRequest.decode_chunk` per call, taking c_1
where the host would. Pruning happens at exactly t = b + L, as in the paper, and the rows
are those of one token per call (decode_chunk 1, the slow twin). A fork copies no keys:
the cache holds a tree of segments and a branch reads the prefix it shares from the
segments that wrote it (`rl.rollout.tree_sampler.share_prefixes`;
`TreeRequest.share_kv=False` copies the parent's response segment instead, the slow twin
with the same tokens). `TreeStats` counts what the
tree saves: tokens decoded vs the leaves' tokens (what independent sampling of the same
leaves would decode), and the leaves' distinct tokens (what a tree-packed learner
computes, `models.tree.pack_tree`).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig
from rl.rollout.sampler import check_prompt, plan_bounded_decode, prefill, read_slots
from rl.rollout.sampler_state import SamplingConfig, new_state, sample_keys
from rl.rollout.tree_sampler import (
    TreeCandidates,
    decode_candidates,
    fork_slots,
    retire_slots,
    rewrite_tokens,
    set_last_tokens,
    share_prefixes,
    tree_decode_step,
)

Params = Any
SAMPLE_WHEN = ("full", "always")


@dataclasses.dataclass(frozen=True)
class LatrConfig:
    """LATR's knobs (module doc), the authors' GRPO script's values by default: top-2
    candidates, τ_abs = τ_rel = 0.2, lookahead L in (20, 30, 50), δ = 0.4, the whole group
    as the tree (mix_ratio 1)."""

    max_branch_per_token: int = 2
    prob_abs: float = 0.2
    prob_rel: float | None = 0.2
    lookahead: tuple[int, ...] = (20, 30, 50)
    edit_threshold: float = 0.4
    mix_ratio: float = 1.0
    sample_when: str = "full"

    def __post_init__(self):
        object.__setattr__(self, "lookahead", tuple(int(x) for x in self.lookahead))
        m = self.max_branch_per_token
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"LatrConfig.max_branch_per_token must be an int >= 1 (1: never "
                             f"branch), got {m!r}")
        if not 0.0 <= self.prob_abs < 1.0:
            raise ValueError(f"LatrConfig.prob_abs (τ_abs) must be in [0, 1), got {self.prob_abs}")
        if self.prob_rel is not None and not -1.0 <= self.prob_rel < 1.0:
            raise ValueError(f"LatrConfig.prob_rel (τ_rel) must be in [-1, 1) or None, got "
                             f"{self.prob_rel}")
        if any(x < 1 for x in self.lookahead):
            raise ValueError(f"LatrConfig.lookahead lengths must be >= 1, got {self.lookahead}")
        if not self.edit_threshold >= 0.0:  # > 1: every branch reaching a lookahead goes
            raise ValueError(f"LatrConfig.edit_threshold (δ) must be >= 0 (0: never prune), "
                             f"got {self.edit_threshold}")
        if not 0.0 <= self.mix_ratio <= 1.0:
            raise ValueError(f"LatrConfig.mix_ratio must be in [0, 1], got {self.mix_ratio}")
        if self.sample_when not in SAMPLE_WHEN:
            raise ValueError(f"LatrConfig.sample_when must be one of {SAMPLE_WHEN}, got "
                             f"{self.sample_when!r}")

    def tree_size(self, group_size: int) -> int:
        """K: how many of a group's N samples are the tree's leaves."""
        return int(round(group_size * self.mix_ratio))


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance (unit insert / delete / substitute) of two token sequences."""
    prev = np.arange(len(b) + 1)
    for i, x in enumerate(a, 1):
        cur = np.empty_like(prev)
        cur[0] = i
        sub = prev[:-1] + (np.asarray(b) != x)
        for j in range(1, len(b) + 1):  # the insert chain is sequential
            cur[j] = min(sub[j - 1], prev[j] + 1, cur[j - 1] + 1)
        prev = cur
    return int(prev[-1])


@dataclasses.dataclass
class Branch:
    """One branch of a group's tree: its slot, the branch it forked from (None: the root),
    `fork_at` = the index of its first own response token (0 for the root)."""

    slot: int
    parent: int | None
    fork_at: int
    pruned: bool = False


@dataclasses.dataclass
class TreeStats:
    """Counts of one tree rollout (module doc)."""

    decoded_tokens: int = 0     # decode-step slots actually run (pruned branches included)
    leaf_tokens: int = 0        # tokens of the returned rows, as independent sequences
    tree_tokens: int = 0        # distinct tokens of the returned rows (shared prefixes once)
    branches: int = 0           # branches opened (forks)
    pruned: int = 0             # branches pruned (descendants included)
    filled: int = 0             # rows that repeat a tree's first leaf (fewer than K leaves)
    fork_fraction: list = dataclasses.field(default_factory=list)  # fork_at / leaf length
    decode_calls: int = 0       # device calls that decoded (one step each with decode_chunk 1)

    def metrics(self) -> dict[str, float]:
        """The numbers a run logs per batch."""
        leaf = max(self.leaf_tokens, 1)
        return {"tree_decoded_per_leaf_token": self.decoded_tokens / leaf,
                "tree_packing_ratio": leaf / max(self.tree_tokens, 1),
                "tree_branches": float(self.branches), "tree_pruned": float(self.pruned),
                "tree_filled": float(self.filled),
                "tree_decode_calls": float(self.decode_calls),
                "tree_fork_fraction_mean": float(np.mean(self.fork_fraction))
                if self.fork_fraction else 0.0}


@dataclasses.dataclass(frozen=True)
class TreeRollout:
    """tokens[g][i], logprobs[g][i] (float32 [len]), finished[g][i] as in
    rl.rollout.GenerationResult; parent[g][i]: the row of group g that row i forked from
    (-1: a root or an independent sample; a duplicated leaf points at its original) and
    fork_at[g][i] the index of its first own token; stats over all groups."""

    tokens: list[list[list[int]]]
    logprobs: list[list[np.ndarray]]
    finished: list[list[bool]]
    parent: list[list[int]]
    fork_at: list[list[int]]
    stats: TreeStats


class _GroupTree:
    """The host's view of one group's tree: branches, token mirror, free slots."""

    def __init__(self, block: int, n: int, k: int):
        self.k = k
        self.branches = [Branch(slot=block * n, parent=None, fork_at=0)]
        self.free = [block * n + i for i in range(1, k)]  # the tree's unused slots
        self.independent = [block * n + i for i in range(k, n)]

    def alive(self) -> list[int]:
        return [b for b, br in enumerate(self.branches) if not br.pruned]


def _choose(tree: _GroupTree, cfg: LatrConfig, cand, done, step_tokens):
    """Stage 1 for one group at one step: (rewrites [(slot, token, logp)], forks [(parent
    slot, child slot, token, logp)], new branches [(parent branch, child slot)])."""
    ids, probs, logps = cand
    alive = tree.alive()
    live = [b for b in alive if step_tokens.get(tree.branches[b].slot) is not None]
    room = min(tree.k - len(alive), len(tree.free))
    picks: dict[int, list[int]] = {b: [] for b in live}
    for k in range(1, cfg.max_branch_per_token):
        for b in live:
            if room == 0:
                break
            s = tree.branches[b].slot
            p1, pk = probs[s, 0], probs[s, k]
            if pk > cfg.prob_abs and (cfg.prob_rel is None or p1 - pk > cfg.prob_rel):
                picks[b].append(k)
                room -= 1
    full = len(alive) + sum(len(v) for v in picks.values()) >= tree.k
    rewrites, forks, new = [], [], []
    for b in live:
        s = tree.branches[b].slot
        sample = not picks[b] and (cfg.sample_when == "always" or full)
        if not sample and int(step_tokens[s]) != int(ids[s, 0]):
            rewrites.append((s, int(ids[s, 0]), float(logps[s, 0])))
        for k in picks[b]:
            child = tree.free.pop(0)
            forks.append((s, child, int(ids[s, k]), float(logps[s, k])))
            new.append((b, child))
    return rewrites, forks, new


def _prune(tree: _GroupTree, cfg: LatrConfig, mirror: dict[int, list[int]],
           stop: set[int]) -> list[int]:
    """Stage 3 for one group after a step: slots of the branches pruned now (with their
    descendants)."""
    doomed: set[int] = set()
    for b in tree.alive():
        br = tree.branches[b]
        if br.parent is None:
            continue
        age = len(mirror[br.slot]) - br.fork_at
        if age not in cfg.lookahead:
            continue
        mine = mirror[br.slot][br.fork_at:]
        theirs = mirror[tree.branches[br.parent].slot][br.fork_at:br.fork_at + age]
        if len(theirs) < age or stop & (set(mine) | set(theirs)):
            continue
        if edit_distance(mine, theirs) / age < cfg.edit_threshold:
            doomed.add(b)
    grew = True
    while grew:  # a pruned branch takes every branch forked from it along
        more = {b for b in tree.alive() if tree.branches[b].parent in doomed} - doomed
        grew = bool(more)
        doomed |= more
    slots = []
    for b in sorted(doomed):
        tree.branches[b].pruned = True
        tree.free.append(tree.branches[b].slot)
        slots.append(tree.branches[b].slot)
    return slots


@dataclasses.dataclass(frozen=True)
class TreeRequest:
    """What to sample per prompt: group_size rows (N), up to max_new_tokens each, with
    `sampling` (plain temperature), stopping at stop_ids (None: the model's EOS ids).
    share_kv: branches read their shared prefix's keys in place (a tree of segments, the
    XLA decode path); False copies them at each fork (any attn_impl; the same tokens).
    decode_chunk: at most this many decode steps per device call, which stops early at a
    step where the host has to decide (a candidate passes the branching test, a branch
    reaches a lookahead); 1: back to the host after every token (the same rows)."""

    group_size: int
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    stop_ids: tuple[int, ...] | None = None
    attn_impl: str | None = None
    share_kv: bool = True
    decode_chunk: int = 16

    def __post_init__(self):
        if int(self.group_size) < 1 or int(self.max_new_tokens) < 1 or int(self.decode_chunk) < 1:
            raise ValueError(f"TreeRequest: group_size ({self.group_size}), max_new_tokens "
                             f"({self.max_new_tokens}) and decode_chunk ({self.decode_chunk}) "
                             "must be >= 1")
        if self.sampling.greedy or self.sampling.truncated:
            raise ValueError("LATR samples from softmax(z / T) once a tree is full and "
                             "stamps every token with that distribution's log-prob: use "
                             "plain temperature sampling (no greedy, top_k or top_p)")


class _Control(struct.PyTreeNode):
    """What the device loop needs to know of the trees, per slot [S]: in_tree (an unpruned
    branch), grows (its tree has fewer than K branches: it takes c_1 and may branch),
    branch (a forked branch: pruning looks at it), fork_at, parent (its parent's slot;
    itself for a root or a slot outside the trees)."""

    in_tree: jax.Array
    grows: jax.Array
    branch: jax.Array
    fork_at: jax.Array
    parent: jax.Array


def _control(trees: list[_GroupTree], num_slots: int) -> _Control:
    in_tree, grows, branch = (np.zeros(num_slots, bool) for _ in range(3))
    fork_at, parent = np.zeros(num_slots, np.int32), np.arange(num_slots, dtype=np.int32)
    for tree in trees:
        alive = tree.alive()
        for b in alive:
            br = tree.branches[b]
            in_tree[br.slot], grows[br.slot] = True, len(alive) < tree.k
            if br.parent is not None:
                branch[br.slot], fork_at[br.slot] = True, br.fork_at
                parent[br.slot] = tree.branches[br.parent].slot
    return _Control(in_tree=in_tree, grows=grows, branch=branch, fork_at=fork_at,
                    parent=parent)


def _event(cfg: LatrConfig, ctl: _Control, live, after, probs):
    """Does this step need the host: a growing tree's live slot with a candidate that passes
    the branching test, or a branch at one of its lookaheads (live, or done with a live
    parent whose window may just have filled)?"""
    ok = probs[:, 1:] > cfg.prob_abs
    if cfg.prob_rel is not None:
        ok &= (probs[:, :1] - probs[:, 1:]) > cfg.prob_rel
    branching = live & ctl.in_tree & ctl.grows & ok.any(axis=-1)
    age = after.num_generated - ctl.fork_at
    at_lookahead = (age[:, None] == jnp.asarray(cfg.lookahead, jnp.int32)[None, :]).any(axis=-1)
    checked = ctl.in_tree & ctl.branch & at_lookahead & (live | live[ctl.parent])
    return branching.any() | checked.any()


@functools.partial(jax.jit, static_argnames=("kv_bound", "cfg"))
def _decode_until_event(params, state, version, ctl: _Control, num_steps, *, kv_bound,
                        cfg: LatrConfig):
    """Up to num_steps decode steps in one while_loop, doing on device what the host would
    at a step with nothing to decide (a growing tree's slot takes c_1), stopping after the
    first step that needs the host (`_event`), whose state is left as decoded. Returns
    (state, that step's candidates, event, the slots live at that step, slot-steps run)."""
    s, m = state.num_slots, cfg.max_branch_per_token
    top = cfg.sample_when == "full"

    def cond(c):
        i, st, _, event, _, _ = c
        return (i < num_steps) & ~event & jnp.any(~st.done)

    def body(c):
        i, st, _, _, _, ran = c
        live = ~st.done
        after, cand = decode_candidates(params, st, version, kv_bound=kv_bound, top_m=m)
        event = _event(cfg, ctl, live, after, cand.probs)
        take = live & ctl.in_tree & ctl.grows & (cand.ids[:, 0] != cand.token) & top & ~event
        after = set_last_tokens(after, jnp.where(take, jnp.arange(s), s), cand.ids[:, 0],
                                cand.logprobs[:, 0])
        return i + 1, after, cand, event, live, ran + live.sum()

    f32, i32 = jnp.zeros((s, m), jnp.float32), jnp.zeros((s, m), jnp.int32)
    empty = TreeCandidates(ids=i32, probs=f32, logprobs=f32, token=i32[:, 0],
                           logprob=f32[:, 0])
    init = (jnp.int32(0), state, empty, jnp.bool_(False), jnp.zeros(s, bool), jnp.int32(0))
    _, state, cand, event, live, ran = jax.lax.while_loop(cond, body, init)
    return state, cand, event, live, ran


def sample_latr(params: Params, config: ModelConfig, prompts: Sequence[Sequence[int]],
                request: TreeRequest, *, latr: LatrConfig = LatrConfig(), rng: Any = 0,
                first_group_id: int = 0, version: int = 0) -> TreeRollout:
    """Grow one LATR tree per prompt (module doc): request.group_size = N rows per
    prompt, the first round(N · mix_ratio) the tree's leaves, the rest independent
    samples. rng keys follow the engine's (sample_keys of the global group ids from
    first_group_id), so with mix_ratio 0 the rows are `rl.rollout.generate`'s token for
    token. request.decode_chunk > 1 runs the steps with nothing to decide on device
    (`_decode_until_event`); 1 returns to the host after every token (the slow twin: the
    same rows, tested)."""
    if not prompts:
        raise ValueError("sample_latr: no prompts")
    max_new_tokens, sampling = int(request.max_new_tokens), request.sampling
    n = int(request.group_size)
    k = latr.tree_size(n)
    stop_ids = tuple(config.eos_token_ids if request.stop_ids is None else request.stop_ids)
    g = len(prompts)
    ctx = [check_prompt(p, max(len(q) for q in prompts), config) for p in prompts]
    state = new_state(config, num_slots=g * n, max_prompt_len=max(c.size for c in ctx),
                      max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                      attn_impl=request.attn_impl, cache_dtype=None, group_size=n)
    keys = sample_keys(rng, first_group_id + np.arange(g), n)
    state = prefill(params, state, ctx, np.arange(g * n).reshape(g, n), keys)
    if request.share_kv:
        state = share_prefixes(state)
    trees = [_GroupTree(b, n, k) for b in range(g)] if k > 0 else []
    state = retire_slots(state, [s for t in trees for s in t.free])
    mirror: dict[int, list[int]] = {s: [] for s in range(g * n)}
    stats, stop = TreeStats(), set(stop_ids)
    done = np.asarray(jax.device_get(state.done))
    while not done.all():
        longest = max(len(mirror[s]) for s in np.flatnonzero(~done))
        steps, bound = plan_bounded_decode(longest, request.decode_chunk, max_new_tokens)[0]
        stats.decode_calls += 1
        if request.decode_chunk == 1:
            live = np.flatnonzero(~done)
            state, cand = tree_decode_step(params, state, version,
                                           top_m=latr.max_branch_per_token, kv_bound=bound)
            stats.decoded_tokens += live.size
        else:
            state, cand, event, live, ran = _decode_until_event(
                params, state, np.int32(version), _control(trees, g * n), np.int32(steps),
                kv_bound=bound, cfg=latr)
            ids, count, event, live, ran = jax.device_get(
                (state.response_ids, state.num_generated, event, live, ran))
            live = np.flatnonzero(live)
            stats.decoded_tokens += int(ran)
            mirror = {s: ids[s, :count[s]].tolist() for s in range(g * n)}
            if not event:  # every step ran on device, rewrites included
                done = np.asarray(jax.device_get(state.done))
                continue
            for s in live:  # the host decides the last step from the tokens before it
                mirror[s].pop()
        state = _host_step(state, trees, latr, cand, live, mirror, stats, stop)
        done = np.asarray(jax.device_get(state.done))
    return _collect(state, trees, n, k, g, stats)


def _host_step(state, trees: list[_GroupTree], latr: LatrConfig, cand: TreeCandidates,
               live: np.ndarray, mirror: dict[int, list[int]], stats: TreeStats,
               stop: set[int]):
    """Stages 1 and 3 of the module doc for one decoded step: its candidates `cand`, the
    slots `live` at it; mirror (updated here) holds every slot's tokens before it."""
    ids, probs, logps, token = jax.device_get((cand.ids, cand.probs, cand.logprobs, cand.token))
    drawn = {int(s): int(token[s]) for s in live}
    rewrites, forks = [], []
    for tree in trees:
        r, f, new = _choose(tree, latr, (ids, probs, logps), None, drawn)
        rewrites += r
        forks += f
        for b, child in new:
            tree.branches.append(Branch(slot=child, parent=b,
                                        fork_at=len(mirror[tree.branches[b].slot])))
    for s, tok in drawn.items():
        mirror[s].append(tok)
    for s, tok, _ in rewrites:
        mirror[s][-1] = tok
    for parent, child, tok, _ in forks:
        mirror[child] = mirror[parent][:-1] + [tok]
    if rewrites:
        state = rewrite_tokens(state, *map(list, zip(*rewrites)))
    if forks:
        # a forking parent's own last token is c_1 (rewritten above if it drew another)
        state = fork_slots(state, *map(list, zip(*forks)))
    stats.branches += len(forks)
    pruned = [s for tree in trees for s in _prune(tree, latr, mirror, stop)]
    stats.pruned += len(pruned)
    return retire_slots(state, pruned)


def _collect(state, trees: list[_GroupTree], n: int, k: int, g: int,
             stats: TreeStats) -> TreeRollout:
    """Each group's rows: the tree's unpruned branches (creation order), its first leaf
    repeated up to K, then the independent samples; stats completed."""
    from models.tree import pack_tree

    samples = read_slots(state, range(g * n))
    out = TreeRollout([], [], [], [], [], stats)
    for b in range(g):
        rows: list[tuple[int, int, int]] = []  # (slot, parent row, fork_at)
        if k > 0:
            tree = trees[b]
            alive = tree.alive()
            row_of = {br: i for i, br in enumerate(alive)}
            for br in alive:
                node = tree.branches[br]
                rows.append((node.slot, -1 if node.parent is None else row_of[node.parent],
                             node.fork_at))
            stats.filled += k - len(rows)
            rows += [(rows[0][0], 0, 0)] * (k - len(rows))
        rows += [(s, -1, 0) for s in range(b * n + k, (b + 1) * n)]
        toks = [samples[s].response_ids.tolist() for s, _, _ in rows]
        out.tokens.append(toks)
        out.logprobs.append([samples[s].logprobs for s, _, _ in rows])
        out.finished.append([samples[s].stopped for s, _, _ in rows])
        out.parent.append([p for _, p, _ in rows])
        out.fork_at.append([f for _, _, f in rows])
        stats.leaf_tokens += sum(len(t) for t in toks)
        nonempty = [t for t in toks if t]
        stats.tree_tokens += pack_tree(nonempty).num_tokens if nonempty else 0
        stats.fork_fraction += [f / max(len(toks[i]), 1) for i, (_, p, f) in enumerate(rows)
                                if p >= 0 and f > 0]
    return out
