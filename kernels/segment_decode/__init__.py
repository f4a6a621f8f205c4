"""Segment decode attention for sampling many responses of one prompt.

The KV cache holds one prompt segment per group ([groups, P, kv_heads, d], stored once)
and one response segment per sample ([groups, N, R_max, kv_heads, d], ragged lengths).
Each segment yields a partial softmax state (o, m, l); the states merge in float32.
  reference.py  replicate + concatenate + masked softmax (obviously correct, slow)
  xla.py        per-segment states, the group's N queries folded into one matrix (Hydragen)
  pallas.py     the same as two Pallas kernels (prompt: folded queries; response: split-K),
                written for Triton (GPU)
  mosaic.py     the two kernels for Mosaic (TPU): whole (kv_heads, d) trailing blocks
  merge.py      merge_attention_states / reduce_attention_states
  tree.py       tree_decode_attention: samples that forked read their shared response
                prefix from the segment that wrote it (reference and XLA paths)
"""
from kernels.segment_decode.api import segment_decode_attention
from kernels.segment_decode.merge import merge_attention_states, reduce_attention_states
from kernels.segment_decode.tree import tree_decode_attention

__all__ = ["segment_decode_attention", "merge_attention_states", "reduce_attention_states",
           "tree_decode_attention"]
