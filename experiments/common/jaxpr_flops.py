"""Matmul FLOPs a jitted function computes, counted from its jaxpr (no compile, no run).

    matmul_flops(fn, *args) -> int

Every `dot_general` counts 2 x (batch dims) x (contracting dims) x (lhs free dims) x
(rhs free dims) FLOPs; a `scan` body counts `length` times (the decoder's layer scan,
the head's chunk loop, the learner's micro-batch loop), a `cond` counts its most
expensive branch, and every other primitive that holds jaxprs (jit, custom_vjp /
custom_jvp calls, checkpoint / remat) counts what they hold once. A `while` loop has no
static trip count: `MatmulCount.while_loops` says how many were met (their bodies
counted once), so a caller can refuse a count it cannot trust.

It is the structural half of "what does the learner compute beyond its floor": two
functions with equal counts run the same matmuls (no extra forward, no recomputed head),
whatever the timer says on a noisy machine (experiments.bench.learner prints both).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend.core import jaxprs_in_params


@dataclass
class MatmulCount:
    """FLOPs of the dot_generals met, per shape signature, and the while loops met."""

    flops: int = 0
    by_shape: dict[str, int] = field(default_factory=dict)
    while_loops: int = 0

    def add(self, key: str, flops: int) -> None:
        self.flops += flops
        self.by_shape[key] = self.by_shape.get(key, 0) + flops


def dot_flops(eqn) -> tuple[str, int]:
    """(shape signature, FLOPs) of one dot_general equation."""
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    batch = math.prod(lhs[i] for i in lb)
    contract = math.prod(lhs[i] for i in lc)
    lfree = math.prod(d for i, d in enumerate(lhs) if i not in lc and i not in lb)
    rfree = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
    return f"{tuple(lhs)}x{tuple(rhs)}", 2 * batch * contract * lfree * rfree


def count_jaxpr(jaxpr, count: MatmulCount, times: int = 1) -> None:
    """Add the matmul FLOPs of `jaxpr` (a Jaxpr or ClosedJaxpr), run `times` times."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            key, flops = dot_flops(eqn)
            count.add(key, flops * times)
        elif name == "scan":
            count_jaxpr(eqn.params["jaxpr"], count, times * int(eqn.params["length"]))
        elif name == "cond":
            best = None
            for branch in eqn.params["branches"]:
                sub = MatmulCount()
                count_jaxpr(branch, sub, times)
                if best is None or sub.flops > best.flops:
                    best = sub
            if best is not None:
                count.while_loops += best.while_loops
                for key, flops in best.by_shape.items():
                    count.add(key, flops)
        else:
            if name == "while":
                count.while_loops += 1
            for sub in jaxprs_in_params(eqn.params):
                count_jaxpr(sub, count, times)


def matmul_count(fn, *args: Any, **kwargs: Any) -> MatmulCount:
    """The MatmulCount of fn(*args, **kwargs) (args may be jax.ShapeDtypeStruct)."""
    count = MatmulCount()
    count_jaxpr(jax.make_jaxpr(fn)(*args, **kwargs), count)
    return count


def matmul_flops(fn, *args: Any, **kwargs: Any) -> int:
    """Matmul FLOPs of fn(*args, **kwargs); ValueError when a while loop makes it unknown."""
    count = matmul_count(fn, *args, **kwargs)
    if count.while_loops:
        raise ValueError(f"{count.while_loops} while loop(s) in the jaxpr: their trip counts "
                         "are not static, so the matmul count is a lower bound")
    return count.flops
