"""Tree attention for training: packed rollout trees (models.tree) attended without a
[T, T] mask.

A tree is packed depth-first (models.tree.pack_tree): every segment after its ancestors,
and the segments of a subtree contiguous. So query i may attend to key j (seg(j) an
ancestor of seg(i), or the same segment with j <= i) exactly when

    j <= i < kend[j],   kend[j] = the end of the packed range of seg(j)'s subtree

(models.tree.visible_until computes it; 0 for padding): one int per key instead of a mask
per pair, which a flash kernel applies tile by tile.

    reference   the dense mask from kend (kend_mask) and a masked softmax
    pallas      a Triton flash attention, forward and backward (dq; dk, dv per key tile
                over the query tiles up to its largest kend), interpreted off a GPU

impl=None takes the reference path: the kernel is tested in interpret mode against it
(tests/kernels/test_tree_attention.py) and lowers for cuda, but has not run on a GPU. No
Mosaic (TPU) twin yet. Imports jax and kernels.* only.
"""
from kernels.tree_attention.api import IMPLS, tree_attention
from kernels.tree_attention.reference import kend_mask, tree_attention_reference

__all__ = ["IMPLS", "kend_mask", "tree_attention", "tree_attention_reference"]
