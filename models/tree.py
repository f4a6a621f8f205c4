"""Training on a rollout tree: every shared prefix packed and computed once.

A tree of rollouts is a set of leaves (token sequences) that share prefixes: the prompt,
and past each fork the tokens the branches had in common. `pack_tree` cuts the prefix
tree of the leaves into *segments* (maximal runs of tokens without a fork) and packs them
into one row, every segment after its ancestors:

    tokens       [T] int32   the segments back to back (T = tree tokens; padding after)
    segment_ids  [T] int32   1..S (0 = padding)
    parents      [S + 1]     parents[s] = the segment s continues (0: s is a root)
    positions    [T] int32   the token's position in its own root-to-leaf path: the tokens
                             of the strict ancestors + its index inside its segment
    pred         [T] int32   the packed index of the token before it on its path
                             (-1 for the first token of a root): logits at pred[i]
                             predict tokens[i]
    paths        one int array per leaf: the packed indices of its tokens, in order

The attention of a tree (`tree_mask`): query i may attend to key j when seg(j) is a strict
ancestor of seg(i), or seg(j) = seg(i) and j <= i. So each token sees exactly the tokens
before it on its own path, and a leaf's log-probs equal those of the leaf run alone as an
independent sequence (tests/models/test_tree.py: attention against a float64 loop over
each leaf's own sequence; the decoder's log-probs and gradients against the leaves run
one by one). The packing is depth-first, so each segment's subtree is a contiguous range
of the row and the mask is one int per key (`visible_until`): query i sees key j exactly
when j <= i < kend[j]. The decoder's "tree" mode takes kend: the dense [T, T] mask through
XLA attention by default (the exact twin), or kernels.tree_attention's Triton flash kernel
(forward and backward) with attn_impl "pallas" (tests/kernels/test_tree_attention.py).

The packing ratio of a tree is (tokens of the leaves as independent sequences) / T: the
compute the tree saves on everything but attention.

The learner's layout (`TreeGroups`, `tree_groups`, `tree_row_logprobs`): each group of a
batch's naive rows [B, W] (prompt + response, as rl.learner.batch builds them) packed as
one tree of its rows, so a prefix that several rows share (the prompt; past it, the
tokens before a LATR fork) runs through the decoder once; the vocabulary head runs once
per tree token, and the log-probs come back in the naive rows' [B, W-1] layout, so every
loss runs unchanged (TrainConfig.tree; tests/rl/test_tree_learner.py: the step's loss,
metrics and gradients equal the naive rows').
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig
from models.decoder import Decoder, Params
from models.inputs import validate_tokens
from models.logprobs import chunked_logprobs, head_matrix


@dataclasses.dataclass(frozen=True)
class PackedTree:
    """One packed tree (module doc), host numpy arrays, unpadded (T = tree tokens)."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    parents: np.ndarray
    positions: np.ndarray
    pred: np.ndarray
    paths: tuple[np.ndarray, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def packing_ratio(self) -> float:
        """Leaf tokens as independent sequences / tree tokens."""
        return sum(len(p) for p in self.paths) / self.num_tokens


def pack_tree(leaves: Sequence[Sequence[int]]) -> PackedTree:
    """The prefix tree of `leaves` (each a non-empty token sequence; leaves that share a
    first token share a root) packed as the module doc says: segments in depth-first order
    (a leaf's children in first-appearance order), each after its ancestors; a segment ends
    at a fork and where a leaf ends inside another leaf's path."""
    if not leaves or any(len(x) == 0 for x in leaves):
        raise ValueError("pack_tree needs at least one leaf, and no empty leaf")
    # the trie: node = (children: token -> node id), one node per distinct prefix
    children: list[dict[int, int]] = [{}]  # node 0: the empty prefix
    token_of, ends = [0], set()
    leaf_nodes = []
    for leaf in leaves:
        node = 0
        for t in leaf:
            nxt = children[node].get(int(t))
            if nxt is None:
                nxt = len(children)
                children[node][int(t)] = nxt
                children.append({})
                token_of.append(int(t))
            node = nxt
        ends.add(node)
        leaf_nodes.append(node)
    tokens, seg_ids, parents, positions, pred = [], [], [0], [], []
    index_of: dict[int, int] = {}  # trie node -> packed index

    def walk(start: int, parent_seg: int, before: int, depth: int) -> None:
        seg = len(parents)
        parents.append(parent_seg)
        node, prev = start, before
        while True:  # a segment: a chain of nodes with one child, not ending a leaf
            index_of[node] = len(tokens)
            tokens.append(token_of[node])
            seg_ids.append(seg)
            positions.append(depth)
            pred.append(prev)
            prev, depth = index_of[node], depth + 1
            kids = list(children[node].values())
            if len(kids) != 1 or node in ends:
                break
            node = kids[0]
        for kid in children[node].values():
            walk(kid, seg, prev, depth)

    for root in children[0].values():
        walk(root, 0, -1, 0)
    paths = []
    for leaf in leaves:
        node, path = 0, []
        for t in leaf:
            node = children[node][int(t)]
            path.append(index_of[node])
        paths.append(np.asarray(path, np.int32))
    as32 = partial(np.asarray, dtype=np.int32)
    return PackedTree(tokens=as32(tokens), segment_ids=as32(seg_ids), parents=as32(parents),
                      positions=as32(positions), pred=as32(pred), paths=tuple(paths))


def ancestors(parents: jax.Array) -> jax.Array:
    """bool [S + 1, S + 1]: out[a, s] = a is s or an ancestor of s (segment 0: nobody's),
    from parents [S + 1] by following each chain S steps."""
    n = parents.shape[-1]
    chain = jnp.arange(n, dtype=jnp.int32)

    def step(node, _):
        return parents[node], node

    _, seen = jax.lax.scan(step, chain, None, length=n)  # [n steps, n]: s, p(s), p(p(s)), ...
    seg = jnp.arange(n, dtype=jnp.int32)
    out = (seen[:, None, :] == seg[None, :, None]).any(0)  # [a, s]
    return out & (seg != 0)[:, None]


def tree_mask(segment_ids: jax.Array, parents: jax.Array) -> jax.Array:
    """bool [batch, T, T] (module doc) for segment_ids [batch, T] and parents
    [batch, S + 1] (one tree per row; padding has segment id 0 and sees nothing)."""
    def one(seg, par):
        anc = ancestors(par)                                  # [a, s]
        sees = anc[seg[None, :], seg[:, None]]                # [i, j]: seg_j on seg_i's path
        idx = jnp.arange(seg.shape[0])
        same = seg[:, None] == seg[None, :]
        causal = idx[:, None] >= idx[None, :]
        ok = (seg != 0)[:, None] & (seg != 0)[None, :]
        return ok & sees & (~same | causal)
    return jax.vmap(one)(segment_ids, parents)


def visible_until(segment_ids: jax.Array, parents: jax.Array) -> jax.Array:
    """int32 [batch, T]: for key j, the end of the packed range of seg(j)'s subtree (0 for
    padding), so that query i sees key j exactly when j <= i < kend[j]: the tree_mask of a
    depth-first packing (pack_tree's; kernels.tree_attention) as one int per key."""
    def one(seg, par):
        n = par.shape[0]
        idx = jnp.arange(seg.shape[0], dtype=jnp.int32)
        seg_end = jax.ops.segment_max(idx + 1, seg, num_segments=n)  # [S + 1] (−big: empty)
        sub_end = jnp.max(jnp.where(ancestors(par), seg_end[None, :], 0), axis=1)  # [a]
        return jnp.where(seg != 0, sub_end[seg], 0).astype(jnp.int32)
    return jax.vmap(one)(segment_ids, parents)


@partial(jax.jit, static_argnames=("config", "attn_impl"))
def _tree_forward_jit(params, tokens, positions, segment_ids, parents, *, config, attn_impl):
    logits, _ = Decoder(config, "tree", attn_impl).apply(
        {"params": params}, tokens, positions, visible_until(segment_ids, parents))
    return logits


def tree_forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array, parents: jax.Array, *,
                 attn_impl: str | None = None) -> jax.Array:
    """Logits [batch, T, vocab] (float32) of packed trees: tokens / positions /
    segment_ids [batch, T], parents [batch, S + 1] (`stack_trees` pads several)."""
    validate_tokens(tokens, config)
    return _tree_forward_jit(params, jnp.asarray(tokens, jnp.int32),
                             jnp.asarray(positions, jnp.int32),
                             jnp.asarray(segment_ids, jnp.int32), jnp.asarray(parents, jnp.int32),
                             config=config, attn_impl=attn_impl)


def tree_token_logprobs(logits: jax.Array, tokens: jax.Array, pred: jax.Array) -> jax.Array:
    """logp [batch, T]: log p(tokens[i] | its path before it) = log_softmax(logits[pred[i]])
    [tokens[i]]; 0 where pred is -1 (a root's first token) or padding."""
    logz = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    safe = jnp.maximum(pred, 0)
    at_pred = jnp.take_along_axis(logz, safe[:, :, None], axis=1)  # [batch, T, vocab]
    picked = jnp.take_along_axis(at_pred, tokens[:, :, None], axis=-1)[..., 0]
    return jnp.where(pred >= 0, picked, 0.0)


def stack_trees(trees: Sequence[PackedTree], length: int | None = None,
                segments: int | None = None) -> dict[str, np.ndarray]:
    """Several packed trees as one padded batch: tokens / positions / segment_ids / pred
    [batch, length] (padding: token 0, segment 0, pred -1) and parents [batch, segments +
    1]; length / segments default to the largest tree's."""
    length = length or max(t.num_tokens for t in trees)
    segments = segments or max(len(t.parents) - 1 for t in trees)
    out = {k: np.zeros((len(trees), length), np.int32)
           for k in ("tokens", "positions", "segment_ids")}
    out["pred"] = np.full((len(trees), length), -1, np.int32)
    out["parents"] = np.zeros((len(trees), segments + 1), np.int32)
    for b, t in enumerate(trees):
        if t.num_tokens > length or len(t.parents) > segments + 1:
            raise ValueError(f"tree {b} has {t.num_tokens} tokens and {len(t.parents) - 1} "
                             f"segments; the batch holds {length} and {segments}")
        n = t.num_tokens
        for k in ("tokens", "positions", "segment_ids", "pred"):
            out[k][b, :n] = getattr(t, k)
        out["parents"][b, :len(t.parents)] = t.parents
    return out


def leaf_index(trees: Sequence[PackedTree], length: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Where each leaf's tokens sit in a `stack_trees` batch of `trees` ([batch, length]):
    index [L, n] int32 into the flattened batch (row * length + packed index) and valid
    [L, n] bool, for the L leaves (tree by tree, in each tree's path order) padded to the
    longest (n). `gather_leaves` turns any per-token tree value into its per-leaf view, so
    a loss written for independent sequences runs unchanged on a tree, and its gradient
    flows into each shared token once per leaf through it."""
    length = length or max(t.num_tokens for t in trees)
    paths = [(row, p) for row, t in enumerate(trees) for p in t.paths]
    n = max(len(p) for _, p in paths)
    index = np.zeros((len(paths), n), np.int32)
    valid = np.zeros((len(paths), n), bool)
    for leaf, (row, p) in enumerate(paths):
        index[leaf, :len(p)] = row * length + p
        valid[leaf, :len(p)] = True
    return index, valid


def gather_leaves(values: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
    """The per-leaf view [L, n] of per-token tree values [batch, T] (e.g.
    `tree_token_logprobs`: then out[l, j] = log p(leaf_l[j] | leaf_l[:j]), 0 at j = 0 and
    at padding); index / valid from `leaf_index`."""
    flat = values.reshape(-1, *values.shape[2:])
    return jnp.where(valid, flat[index], jnp.zeros((), values.dtype))


def tree_batch_stats(trees: Sequence[PackedTree]) -> dict[str, float]:
    """What a batch of trees saves: leaf tokens (as independent sequences), tree tokens
    (each shared prefix once) and their ratio, the batch's packing ratio."""
    leaf = sum(len(p) for t in trees for p in t.paths)
    tree = sum(t.num_tokens for t in trees)
    return {"tree_leaf_tokens": float(leaf), "tree_tokens": float(tree),
            "tree_packing_ratio": leaf / tree}


# ----------------------------------------------------------------------------- the learner
@struct.dataclass
class TreeGroups:
    """A batch's G groups of N rows, each packed as one tree (a pytree; host or device).

    tokens / positions / segment_ids / pred [G, L] int32 and parents [G, S + 1] as
    `stack_trees` pads them; target [B, W-1] int32: for row b (of group b // N) and naive
    column c, the packed index in its group's tree of the row's token c + 1 when that token
    is a response token, else -1 (the loss masks those columns); leaf_tokens [G] int32: the
    tokens of each group's rows as independent sequences (for the packing ratio). All
    arrays, nothing static: batches of other counts reuse the compiled step."""

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    pred: jax.Array
    parents: jax.Array
    target: jax.Array
    leaf_tokens: jax.Array

    @property
    def num_tokens(self) -> int:
        """Tree tokens (padding included): what the learner's decoder runs on."""
        return int(np.prod(self.tokens.shape))


def bucket(n: int, step: int) -> int:
    """n rounded up to a multiple of step (a few compiled shapes, not one per batch)."""
    return -(-int(n) // step) * step


def tree_groups(tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray,
                group_size: int, *, length_step: int = 64) -> TreeGroups:
    """The naive rows tokens [B, W] (row b = tokens[b, :P_b + R_b], groups contiguous blocks
    of group_size rows) as one tree per group, every tree padded to the largest rounded up
    to a multiple of length_step (segments to a power of two)."""
    tokens = np.asarray(tokens)
    b, width = tokens.shape
    if b % group_size:
        raise ValueError(f"{b} rows are not whole groups of {group_size}")
    plen, rlen = np.asarray(prompt_lengths), np.asarray(response_lengths)
    trees = [pack_tree([tokens[r, :plen[r] + rlen[r]].tolist()
                        for r in range(g, g + group_size)]) for g in range(0, b, group_size)]
    length = bucket(max(t.num_tokens for t in trees), length_step)
    segments = 1 << int(np.ceil(np.log2(max(len(t.parents) - 1 for t in trees))))
    packed = stack_trees(trees, length=length, segments=max(segments, 1))
    target = np.full((b, width - 1), -1, np.int32)
    for r in range(b):
        path, p = trees[r // group_size].paths[r % group_size], int(plen[r])
        target[r, p - 1:p - 1 + int(rlen[r])] = path[p:p + int(rlen[r])]
    return TreeGroups(tokens=packed["tokens"], positions=packed["positions"],
                      segment_ids=packed["segment_ids"], pred=packed["pred"],
                      parents=packed["parents"], target=target,
                      leaf_tokens=np.asarray([sum(len(p) for p in t.paths) for t in trees],
                                             np.int32))


def tree_groups_stats(trees: TreeGroups) -> dict[str, float]:
    """tree_batch_stats of a TreeGroups (host or device arrays): the rows' tokens as
    independent sequences, the trees' tokens (padding not counted) and their ratio."""
    leaf = float(np.asarray(trees.leaf_tokens).sum())
    tree = float((np.asarray(trees.segment_ids) > 0).sum())
    return {"tree_leaf_tokens": leaf, "tree_tokens": tree, "tree_packing_ratio": leaf / tree}


@partial(jax.jit, static_argnames=("config", "attn_impl", "chunk", "entropy", "keep_logits"))
def _tree_rows_jit(params, trees, temperature, *, config, attn_impl, chunk, entropy,
                   keep_logits):
    hidden, _ = Decoder(config, "tree", attn_impl, return_hidden=True).apply(
        {"params": params}, trees.tokens, trees.positions,
        visible_until(trees.segment_ids, trees.parents))
    # token i is predicted by the hidden state at pred[i] (its path's previous token)
    at_pred = jnp.take_along_axis(hidden, jnp.maximum(trees.pred, 0)[:, :, None], axis=1)
    g, length = trees.tokens.shape
    logp, ent = chunked_logprobs(at_pred, head_matrix(params, config), trees.tokens,
                                 temperature, chunk=chunk or g * length, entropy=entropy,
                                 keep_logits=keep_logits)
    b = trees.target.shape[0]
    flat = (jnp.arange(b) // (b // g))[:, None] * length + jnp.maximum(trees.target, 0)
    on = trees.target >= 0
    return (jnp.where(on, logp.reshape(-1)[flat], 0.0),
            jnp.where(on, ent.reshape(-1)[flat], 0.0))


def tree_row_logprobs(params: Params, config: ModelConfig, trees: TreeGroups, *,
                      temperature: float = 1.0, attn_impl: str | None = None, chunk: int = 0,
                      entropy: bool = True, keep_logits: bool = False
                      ) -> tuple[jax.Array, jax.Array]:
    """(logp [B, W-1], entropy [B, W-1]) of the naive rows `trees` was built from: at every
    column whose next token is a response token they equal models.logprobs.token_logprobs'
    on the rows (and its entropy of softmax(z / temperature)); 0 elsewhere. The decoder
    runs on the trees (each shared prefix once) and the vocabulary head on each tree token
    once, `chunk` tokens at a time (0: all at once; models.logprobs.chunked_logprobs)."""
    validate_tokens(trees.tokens, config)
    return _tree_rows_jit(params, trees, jnp.asarray(temperature, jnp.float32), config=config,
                          attn_impl=attn_impl, chunk=int(chunk), entropy=bool(entropy),
                          keep_logits=bool(keep_logits))
