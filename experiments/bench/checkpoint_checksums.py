"""What the checkpoint checksums cost on a SmolLM2-135M TrainState (params + AdamW
moments, float32, ~1.6 GB), on this machine.

    python -m experiments.bench.checkpoint_checksums [--repeats 3] [--dir /tmp/...]

Sides, alternating within each repeat, the two saves' order swapped every other repeat
(so load from other processes hits both alike):
  checksums   rl.runtime.checkpoint.state_checksums alone (xxh3-128 of every leaf's
              host bytes: what Checkpointer.save adds before it hands the state to orbax)
  save        Checkpointer.save (checksums + orbax's async save): the time save() blocks
              the step loop, then the time until the write is complete (wait())
  save_plain  the same orbax CheckpointManager save without checksums (the old save)
  restore / restore_plain  Checkpointer.restore (orbax read + verification of every
              leaf and the record) vs the plain orbax read
Each save goes to a fresh directory that is deleted afterwards. Writes
experiments/results/bench_checkpoint_checksums.json (headline: extra milliseconds that
save() blocks for with checksums = median(save) - median(save_plain), target <= 1000).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from experiments.common.benchmarking import load_average, machine, results_path, write_results
from models.config import get_config
from models.decoder import init_params
from rl.learner import OptimizerConfig, TrainConfig, init_train_state
from rl.runtime.checkpoint import Checkpointer, state_checksums

RESULT = results_path(__file__)


def plain_manager(directory: Path) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))


def one_repeat(state, template, root: Path, plain_first: bool) -> dict[str, float]:
    """Seconds of each side once; plain_first swaps the order of the two saves."""
    out: dict[str, float] = {}
    t = time.perf_counter()
    state_checksums(state)
    out["checksums_s"] = time.perf_counter() - t
    for side in ("save_plain", "save") if plain_first else ("save", "save_plain"):
        d = root / side
        shutil.rmtree(d, ignore_errors=True)
        if side == "save":
            ck = Checkpointer(d)
            t = time.perf_counter()
            ck.save(1, state, {"data_position": 0})
            out["save_block_s"] = time.perf_counter() - t
            ck.wait()
            out["save_total_s"] = time.perf_counter() - t
            t = time.perf_counter()
            ck.restore(template)
            out["restore_s"] = time.perf_counter() - t
            ck.close()
        else:
            m = plain_manager(d)
            args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      meta=ocp.args.JsonSave({"data_position": 0, "step": 1}))
            t = time.perf_counter()
            m.save(1, args=args, force=True)
            out["save_plain_block_s"] = time.perf_counter() - t
            m.wait_until_finished()
            out["save_plain_total_s"] = time.perf_counter() - t
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
            t = time.perf_counter()
            m.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                 meta=ocp.args.JsonRestore()))
            out["restore_plain_s"] = time.perf_counter() - t
            m.close()
        shutil.rmtree(d, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="scratch directory for the checkpoints (default: a temp dir)")
    p.add_argument("--out", default=str(RESULT))
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    load_before = load_average()
    cfg = get_config("smollm2-135m")
    state = init_train_state(init_params(cfg, 0), TrainConfig(optimizer=OptimizerConfig()), 0)
    rng = np.random.default_rng(0)  # moments as noise: realistic bytes, not zeros
    state = state.replace(opt_state=jax.tree.map(
        lambda x: rng.random(x.shape, dtype=np.float32) if x.dtype == np.float32 else x,
        state.opt_state))
    state = jax.block_until_ready(jax.device_put(state, jax.devices()[0]))
    leaves = jax.tree.leaves(state)
    gb = sum(x.size * x.dtype.itemsize for x in leaves) / 1e9
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    runs = []
    try:
        for i in tqdm(range(args.repeats), desc="repeats"):
            runs.append(one_repeat(state, state, root, plain_first=i % 2 == 1))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    extra_ms = 1e3 * (med["save_block_s"] - med["save_plain_block_s"])
    print(f"SmolLM2-135M TrainState: {n_params / 1e6:.1f}M params, {len(leaves)} leaves, "
          f"{gb:.2f} GB; median of {args.repeats} repeats (s)")
    print(f"{'side':<22}{'with checksums':>16}{'plain orbax':>14}")
    print(f"{'checksums alone':<22}{med['checksums_s']:>16.3f}")
    for name, key in (("save() blocks", "save_block_s"), ("save until on disk", "save_total_s"),
                      ("restore", "restore_s")):
        plain = key.replace("save_", "save_plain_") if "save" in key else "restore_plain_s"
        print(f"{name:<22}{med[key]:>16.3f}{med[plain]:>14.3f}")
    print(f"checksum throughput {gb / med['checksums_s']:.1f} GB/s; save() blocks "
          f"{extra_ms:+.0f} ms longer with checksums")
    result = {
        "headline": {"metric": "extra ms save() blocks with checksums (SmolLM2-135M TrainState)",
                     "value": round(extra_ms, 1), "target": 1000.0, "machine": machine()},
        "state": {"params": n_params, "leaves": len(leaves), "gigabytes": round(gb, 3)},
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "repeats": runs,
        "load_average_before": load_before, "load_average_after": load_average(),
    }
    write_results(Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
