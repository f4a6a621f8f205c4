"""The tuning sweep (`--parts tune`): per-launch tiles / warps / stages of the Pallas-Triton
shared-prefix kernel and the split design's knobs, and the tuned table written from it.

One launch is tuned at a time, the other five keeping their defaults, so the configs to
time add over the launches instead of multiplying. Candidates that the shared-memory
model says do not fit (or that the dispatcher would shrink) are never compiled. Each
candidate is compiled and timed (fwd+bwd) in the task's process, checked against the
default config's output, and written as a row at once; a failing candidate is a row with
its error. `best_table` turns the rows into the table `kernels/shared_prefix_attention/
tuned/<device>.json` that the dispatcher reads: for each launch the fastest correct
candidate if it beats the default by more than `MIN_GAIN`, and the faster split option.
"""
from __future__ import annotations

import datetime
import itertools
import json
from pathlib import Path

MIN_GAIN = 0.02          # a tuned config must be 2% faster than the default to be kept
TILES = (64, 128, 32)    # tried in this order: the likely winners first
WARPS = (4, 8)
STAGES = (2, 3, 4)


def candidates(launch: str, head_dim: int, dtype: str, smoke: bool = False) -> list[dict]:
    """LaunchConfig fields to try for `launch`, pruned by the shared-memory model; the
    default config first."""
    import jax.numpy as jnp

    from kernels.shared_prefix_attention.config import LaunchConfig
    from kernels.shared_prefix_attention.smem import fit_launch
    from kernels.shared_prefix_attention.tuned import default_block_sizes
    default = default_block_sizes(jnp.dtype(dtype), head_dim).launch(launch)
    default = fit_launch(launch, default, head_dim, dtype)
    default = LaunchConfig(default.block_q, default.block_k, default.warps, default.num_stages)
    grid = ((8, 16), (16,), (4,), (2,)) if smoke else (TILES, TILES, WARPS, STAGES)
    out = [default]
    for bq, bk, w, s in itertools.product(*grid):
        cfg = LaunchConfig(bq, bk, w, s)
        if cfg not in out and fit_launch(launch, cfg, head_dim, dtype) == cfg:
            out.append(cfg)
    return [{"block_q": c.block_q, "block_k": c.block_k, "num_warps": c.warps,
             "num_stages": c.num_stages} for c in out]


def _inputs(n, p, r, heads, kv_heads, head_dim, dtype):
    from experiments.bench.accelerator.kernel_parts import _spa_inputs
    return _spa_inputs(1, n, p, r, heads, kv_heads, head_dim, dtype, seed=3)


def tune_triton(emit, *, launch: str, n: int, p: int, r: int, heads: int, kv_heads: int,
                head_dim: int, dtype: str, seconds: float, interpret, tol: float,
                smoke: bool = False) -> None:
    """Time every candidate of one launch (the others at their defaults)."""
    import jax

    from experiments.bench.accelerator.kernel_parts import compile_and_time, max_rel_err
    from kernels.shared_prefix_attention import BlockSizes, LaunchConfig, shared_prefix_attention
    from kernels.shared_prefix_attention.tuned import default_block_sizes
    qkv, cts = _inputs(n, p, r, heads, kv_heads, head_dim, dtype)
    base = default_block_sizes(jax.numpy.dtype(dtype), head_dim)
    want = None
    for i, fields in enumerate(candidates(launch, head_dim, dtype, smoke)):
        bs = BlockSizes(base.block_q, base.block_k, base.block_q_bwd, base.block_k_bwd
                        ).with_launches({launch: LaunchConfig(**fields)})

        def fwd_bwd(*a, bs=bs):
            out, vjp = jax.vjp(lambda *x: shared_prefix_attention(
                *x, impl="pallas_triton", block_sizes=bs, interpret=interpret), *a)
            return out, vjp(cts)

        row = {"kind": "triton", "launch": launch, "dtype": dtype, "head_dim": head_dim,
               "N": n, "P": p, "R": r, "config": fields, "is_default": i == 0}
        try:
            timing = compile_and_time(fwd_bwd, tuple(qkv), seconds)
            got = jax.jit(fwd_bwd)(*qkv)
            want = got if want is None else want
            err = max_rel_err(got, want)
            emit({**row, "status": "ok", **timing, "max_rel_err_vs_default": err,
                  "ok": err <= tol})
        except Exception as e:  # noqa: BLE001 - a config that fails is a row
            emit({**row, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}"})


def tune_split(emit, *, impl: str, n: int, p: int, r: int, heads: int, kv_heads: int,
               head_dim: int, dtype: str, seconds: float, tol: float = 6e-2) -> None:
    """Time the split design's options (joint prompt call or two calls), each checked
    against the default option's output."""
    import jax

    from experiments.bench.accelerator.kernel_parts import compile_and_time, max_rel_err
    from kernels.shared_prefix_attention import SplitOptions, shared_prefix_attention
    qkv, cts = _inputs(n, p, r, heads, kv_heads, head_dim, dtype)
    want = None
    for joint in (False, True):
        opts = SplitOptions(joint_prompt=joint)

        def fwd_bwd(*a, opts=opts):
            out, vjp = jax.vjp(lambda *x: shared_prefix_attention(
                *x, impl=impl, split_options=opts), *a)
            return out, vjp(cts)

        row = {"kind": "split", "impl": impl, "dtype": dtype, "head_dim": head_dim,
               "N": n, "P": p, "R": r, "config": {"joint_prompt": joint},
               "is_default": not joint}
        try:
            timing = compile_and_time(fwd_bwd, tuple(qkv), seconds)
            got = jax.jit(fwd_bwd)(*qkv)
            want = got if want is None else want
            err = max_rel_err(got, want)
            emit({**row, "status": "ok", **timing, "max_rel_err_vs_default": err,
                  "ok": err <= tol})
        except Exception as e:  # noqa: BLE001
            emit({**row, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}"})


def best_table(rows: list[dict], device_kind: str, jax_version: str) -> dict | None:
    """The tuned table from the sweep's rows (None when no launch or knob improved)."""
    entries: dict[tuple, dict] = {}
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("status") == "ok" and row.get("kind") in ("triton", "split"):
            key = (row["dtype"], row["head_dim"], row["kind"], row.get("launch"))
            groups.setdefault(key, []).append(row)
    for (dtype, head_dim, kind, launch), group in sorted(groups.items(), key=str):
        default = next((x for x in group if x["is_default"]), None)
        good = [x for x in group if x.get("ok", True)]
        if default is None or not good:
            continue
        best = min(good, key=lambda x: x["ms"])
        if best["is_default"] or best["ms"] > (1 - MIN_GAIN) * default["ms"]:
            continue
        entry = entries.setdefault((dtype, head_dim), {"dtype": dtype, "head_dim": head_dim})
        if kind == "triton":
            entry.setdefault("triton", {})[launch] = best["config"]
        else:
            entry["split"] = best["config"]
        entry.setdefault("measured", {})[launch or "split"] = {
            "ms": best["ms"], "default_ms": default["ms"], "N": best["N"], "P": best["P"],
            "R": best["R"], "candidates_timed": len(group)}
    if not entries:
        return None
    return {"device_kind": device_kind, "jax_version": jax_version,
            "date": datetime.date.today().isoformat(),
            "written_by": "python -m experiments.bench.accelerator --parts tune",
            "entries": list(entries.values())}


def write_table(table: dict, directory: Path) -> Path:
    from kernels.shared_prefix_attention.tuned import device_file_name
    path = Path(directory) / device_file_name(table["device_kind"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2) + "\n")
    return path
