"""Loop parity: every training mode's numbers, captured so that a change to the loops can be
checked to change none of them (bit for bit on one machine).

    python -m experiments.repro.loop_parity capture --out experiments/results/loop_parity/before.json
    python -m experiments.repro.loop_parity capture --out /tmp/after.json [--only sync,vcpo]
    python -m experiments.repro.loop_parity compare experiments/results/loop_parity/before.json /tmp/after.json

`capture` trains each mode of MODES with rl.run.train (the same path as the CLI, in a fresh
run dir) and records, per mode: every train and eval record without its timing fields
(seconds, rates, memory, and the threaded buffer's timing-dependent counters), and every
checkpoint's meta as it is on disk (the data position, the scheduler / pruner / async
state and the xxh3 checksums of every state leaf: params, optimizer state, step, rng).
`compare` prints each mode's first difference and exits 1 when any mode differs (the
checkpoint records compared under today's paths: a capture from before the rollout section
existed records loop.segment_len where today's has rollout.segment_len; a field added to the
configs since, at its default None, is left out, as a resume accepts it).

The numbers are exact only on one machine with one jax build (XLA CPU is deterministic,
but another CPU or jax version rounds differently): compare captures made side by side.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from rl.run import PRESETS, RunConfig, train
from rl.loops.validation import LEGACY_PATHS
from rl.runtime.checkpoint import record_checksum

TIMING_SUFFIXES = ("_s", "_mb")
TIMING_KEYS = {"tokens_per_s", "peak_rss_per_step"}
# the threaded producer runs beside the learner: how far ahead it got is timing, not math
THREADED_TIMING = ("buffer_", "data_position", "april_")


def tiny(**paths) -> RunConfig:
    """The tiny-synthetic preset at the tests' geometry (2 groups of 4, 8 eval prompts)."""
    base = {"loop.steps": 4, "loop.prompts_per_step": 2, "loop.group_size": 4,
            "loop.eval_prompts": 8, "loop.eval_every": 2, "loop.save_every": 2,
            "loop.eval_greedy": True, "logging.wandb": "disabled", "logging.progress": False}
    return PRESETS["tiny-synthetic"].overrides({**base, **paths})


def det(k: int, **paths) -> dict:
    return {"asynchronous.mode": "deterministic", "asynchronous.max_staleness": k, **paths}


MODES: dict[str, RunConfig] = {
    "sync": tiny(),
    "sync-dynamic": tiny(**{"loop.dynamic_sampling": True}),
    "sync-packed-micro": tiny(**{"train.packed": True, "train.micro_batches": 2}),
    "det-eta2-exact": tiny(**det(2, **{"asynchronous.proximal": "exact"}), **{"loop.steps": 5}),
    "det-eta2-exact-disk": tiny(**det(2, **{"asynchronous.proximal": "exact",
                                            "asynchronous.snapshot_store": "disk"})),
    "det-eta1-versions": tiny(**det(1, **{"asynchronous.proximal": "versions"})),
    "det-eta1-ewma": tiny(**det(1, **{"asynchronous.proximal": "ewma"})),
    "det-eta1-dynamic": tiny(**det(1), **{"loop.dynamic_sampling": True}),
    "det-april": tiny(**det(1, **{"asynchronous.rollout": "april"})),
    "det-april-mask": tiny(**det(1, **{"asynchronous.rollout": "april",
                                       "asynchronous.mask_offpolicy_prefix": True})),
    "threaded-eta0": tiny(**{"asynchronous.mode": "threaded", "asynchronous.max_staleness": 0}),
    "threaded-eta0-continuous": tiny(**{"asynchronous.mode": "threaded",
                                        "asynchronous.max_staleness": 0,
                                        "asynchronous.rollout": "continuous"}),
    "threaded-eta0-april": tiny(**{"asynchronous.mode": "threaded",
                                   "asynchronous.max_staleness": 0,
                                   "asynchronous.rollout": "april"}),
    "lora": tiny(**{"train.lora.rank": 4, "train.lora.alpha": 8.0}),
    "lora-det-exact": tiny(**det(1, **{"asynchronous.proximal": "exact"}),
                           **{"train.lora.rank": 4, "train.lora.alpha": 8.0}),
    "dars": tiny(**{"scheduler.name": "dars"}),
    "dps": tiny(**{"scheduler.name": "dps", "scheduler.pool_size": 16}),
    "dots": tiny(**{"scheduler.name": "dots", "scheduler.pool_size": 16}),
    "replay": tiny(**{"scheduler.replay_fraction": 0.5, "train.old_logp": "behaviour"}),
    "prune": tiny(**{"prune.prune_at": 2, "prune.warmup": 1}),
    "vcpo": tiny(**{"train.vcpo.enabled": True}),
    "vcpo-det": tiny(**det(2, **{"asynchronous.proximal": "exact"}),
                     **{"train.vcpo.enabled": True}),
    "truncated-is": tiny(**det(1), **{"train.offpolicy.correction": "truncated_is",
                                      "train.old_logp": "current"}),
    "m2po": tiny(**det(2), **{"train.offpolicy.correction": "m2po"}),
    "kl": tiny(**{"train.loss.kl_coef": 0.05}),
    "tiny-guess": PRESETS["tiny-guess"].overrides({
        "loop.steps": 3, "loop.prompts_per_step": 4, "loop.eval_prompts": 8,
        "loop.eval_every": 0, "loop.save_every": 0, "logging.wandb": "disabled",
        "logging.progress": False}),
    "tiny-guess-det": PRESETS["tiny-guess"].overrides({
        "loop.steps": 3, "loop.prompts_per_step": 4, "loop.eval_prompts": 8,
        "loop.eval_every": 0, "loop.save_every": 0, "logging.wandb": "disabled",
        "logging.progress": False, **det(1)}),
}
# the real model: minutes each on 2 cores (--only smollm2-rg,smollm2-calc)
SLOW_MODES: dict[str, RunConfig] = {
    "smollm2-rg": PRESETS["smollm2-rg"].overrides({
        "loop.steps": 2, "loop.eval_prompts": 8, "loop.eval_sampled_prompts": 4,
        "loop.eval_every": 0, "loop.save_every": 0, "loop.time_limit_s": 0.0,
        "logging.wandb": "disabled", "logging.progress": False}),
    "smollm2-calc": PRESETS["smollm2-calc"].overrides({
        "loop.steps": 1, "loop.eval_prompts": 4, "loop.eval_sampled_prompts": 2,
        "loop.eval_every": 0, "loop.save_every": 0, "loop.time_limit_s": 0.0,
        "logging.wandb": "disabled", "logging.progress": False}),
}


def numbers(record: dict, threaded: bool) -> dict:
    """A record without its timing fields (module doc)."""
    out = {}
    for k, v in record.items():
        if k in TIMING_KEYS or k.endswith(TIMING_SUFFIXES):
            continue
        if threaded and k.startswith(THREADED_TIMING):
            continue
        out[k] = None if isinstance(v, float) and math.isnan(v) else v
    return out


def checkpoint_metas(run_dir: Path) -> dict[str, dict]:
    """{step: the checkpoint's meta as saved} for every checkpoint on disk, its per-leaf
    checksums folded into one digest of them all ("state_digest", with the leaf count)."""
    out = {}
    for d in sorted((run_dir / "checkpoints").iterdir(), key=lambda p: p.name):
        meta = d / "meta" / "metadata"
        if d.name.isdigit() and meta.is_file():
            m = json.loads(meta.read_text())
            sums = m.pop("_checksums", {})
            arrays = sums.get("arrays", {})
            m["state_digest"] = record_checksum(arrays)
            m["state_leaves"] = len(arrays)
            out[d.name] = m
    return out


def capture_mode(name: str, cfg: RunConfig, root: Path) -> dict:
    run_dir = root / name
    t0 = time.perf_counter()
    result = train(cfg.override("run_dir", str(run_dir)))
    threaded = cfg.asynchronous is not None and cfg.asynchronous.mode == "threaded"
    return {"train": [numbers(r, threaded) for r in result.train],
            "eval": [numbers(r, threaded) for r in result.eval],
            "checkpoints": checkpoint_metas(run_dir),
            "wall_s": round(time.perf_counter() - t0, 1)}


def capture(out: Path, only: list[str] | None) -> None:
    modes = {**MODES, **SLOW_MODES}
    names = only or list(MODES)
    unknown = [n for n in names if n not in modes]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; known: {sorted(modes)}")
    got = json.loads(out.read_text()) if out.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="loop_parity_") as tmp:
        for name in names:
            print(f"{name} ...", file=sys.stderr, flush=True)
            got[name] = capture_mode(name, modes[name], Path(tmp))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(got, indent=1, sort_keys=True))  # each mode as it ends
            print(f"{name}: {got[name]['wall_s']} s", file=sys.stderr, flush=True)


def first_difference(a, b, path="") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k == "wall_s":
                continue
            if k not in a or k not in b:
                return f"{path}/{k}: only in {'after' if k in b else 'before'}"
            d = first_difference(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def renamed_records(capture: dict) -> dict:
    """The capture with its checkpoints' config records under today's paths (the options
    that moved to the rollout section: rl.loops.validation.LEGACY_PATHS), as a resume reads
    them."""
    for mode in capture.values():
        for meta in mode["checkpoints"].values():
            if isinstance(meta.get("config"), dict):
                meta["config"] = {LEGACY_PATHS.get(k, k): v for k, v in meta["config"].items()}
    return capture


def without_new_defaults(before: dict, after: dict) -> dict:
    """`after` without the config-record fields `before` lacks that hold None (a field added
    to the configs since, at its default: what a resume accepts, rl.loops.validation)."""
    for name, mode in after.items():
        old = before.get(name, {}).get("checkpoints", {})
        for step, meta in mode["checkpoints"].items():
            had = old.get(step, {}).get("config")
            if isinstance(had, dict) and isinstance(meta.get("config"), dict):
                meta["config"] = {k: v for k, v in meta["config"].items()
                                  if k in had or v is not None}
    return after


def compare(before: Path, after: Path) -> int:
    a = renamed_records(json.loads(before.read_text()))
    b = without_new_defaults(a, renamed_records(json.loads(after.read_text())))
    bad = 0
    for name in sorted(set(a) & set(b)):
        d = first_difference(a[name], b[name])
        print(f"{name:28s} {'same' if d is None else 'DIFFERS ' + d}")
        bad += d is not None
    for name in sorted(set(a) ^ set(b)):
        print(f"{name:28s} only in {'before' if name in a else 'after'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.repro.loop_parity")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--only", help="comma-separated mode names (default: every fast mode)")
    d = sub.add_parser("compare")
    d.add_argument("before", type=Path)
    d.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "capture":
        capture(args.out, args.only.split(",") if args.only else None)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
