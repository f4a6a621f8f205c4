"""Scaling check on forced CPU devices: train-step and decode tokens/s of the tiny model on
1, 2, 4 and 8 devices over the mesh presets, and the collectives of each compiled program.

    python -m experiments.bench.scaling [--devices 1,2,4,8] [--reps-seconds 1.0] [--hlo-dir DIR]

CAVEAT: forced host devices (XLA_FLAGS=--xla_force_host_platform_device_count=N) all share
the same CPU cores (2 here), so more devices cannot run faster: these numbers measure the
overhead of partitioning (collectives, smaller per-device matmuls), not speed-up. What the
script checks is the compiled HLO: every collective of the train step and of the sampler's
decode segment is counted per preset, and an all-gather whose result is a whole parameter
(without fsdp, where gathering weights is FSDP's design) or the whole KV cache (never
wanted: each device decodes its own groups) is flagged as unexpected. Matching is by
result shape, on the full (stacked over layers) and per-layer shapes.

Each device count runs in its own subprocess (the device count is fixed when JAX starts),
with XLA:CPU's concurrency-optimized scheduler off (it deadlocks data x fsdp meshes on
forced CPU devices; see main()).
Writes experiments/results/bench_scaling.json (headline: unexpected full-array all-gathers
over all presets, target 0) and the HLO text of every program under --hlo-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.common.benchmarking import load_average, machine, results_path, write_results

RESULT = results_path(__file__)
PRESETS = {1: ("single",), 2: ("dp", "fsdp", "tp"),
           4: ("dp", "fsdp", "tp", "dp+fsdp", "fsdp+tp"),
           8: ("dp", "fsdp", "tp", "dp+fsdp", "fsdp+tp", "dp+fsdp+tp")}
# Train batch: B rows of T tokens; sampler: G groups of N samples, prompts of P tokens,
# S tokens per decode-segment call, budgets of R tokens.
B, T, G, N, P, S, R = 16, 32, 8, 4, 16, 16, 64


# ----------------------------------------------------------------------------- worker
def _timed(call, reps_seconds: float, min_reps: int = 3) -> float:
    """Median seconds of call() (which blocks until its result is ready)."""
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < reps_seconds:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _param_shapes(cfg, mesh) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every parameter this mesh actually shards, stacked and per layer."""
    import jax

    from models.decoder import init_params
    from rl.runtime.mesh import param_shardings

    shapes = jax.eval_shape(lambda: init_params(cfg, 0))
    out = {}
    for (path, leaf), sh in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                jax.tree.leaves(param_shardings(cfg, mesh))):
        if sh.is_fully_replicated:
            continue  # nothing to gather
        name = jax.tree_util.keystr(path)
        out[name] = tuple(leaf.shape)
        if name.startswith("['layers']"):
            out[name + " (one layer)"] = tuple(leaf.shape[1:])
    return out


def _train(cfg, mesh, reps_seconds: float) -> dict:
    import jax
    import numpy as np

    from models.decoder import init_params
    from models.sharding import mesh_context
    from rl import learner
    from rl.runtime.mesh import batch_sharding
    from rl.trajectory import Trajectory

    config = learner.TrainConfig(optimizer=learner.OptimizerConfig(learning_rate=1e-4))
    step = learner.make_train_step(config, cfg, mesh)
    state = step.place_state(learner.init_train_state(init_params(cfg, 0), config, 0))
    rng = np.random.default_rng(0)
    half = T // 2
    traj = Trajectory.create(
        prompt_ids=rng.integers(3, cfg.vocab_size, (B, half)), prompt_lengths=np.full(B, half),
        response_ids=rng.integers(3, cfg.vocab_size, (B, half)), response_mask=np.ones((B, half), bool),
        behaviour_logprobs=-rng.random((B, half)), versions=np.zeros((B, half)),
        group_ids=np.repeat(np.arange(B // 4), 4), finished=np.ones(B, bool),
        truncated=np.zeros(B, bool), rewards={"r": rng.normal(size=B)})
    batch = learner.batch_from_trajectory(traj, group_size=4, model_config=cfg, seq_len=T)
    batch = jax.device_put(batch, batch_sharding(mesh))
    # The step's own jit object (what JittedTrainStep calls), lowered once: its compiled
    # executable is both what is timed and whose HLO is counted.
    t0 = time.perf_counter()
    with mesh_context(mesh):
        compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    box = [state]

    def call():
        box[0], metrics = compiled(box[0], batch)
        jax.block_until_ready(metrics)

    sec = _timed(call, reps_seconds)
    return {"train_tokens_per_s": B * T / sec, "train_ms": 1e3 * sec,
            "train_compile_s": compile_s, "train_hlo": compiled.as_text()}


def _decode(cfg, mesh, reps_seconds: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.decoder import init_params
    from rl.rollout import ShardedSampler, sample_keys

    sampler = ShardedSampler(cfg, mesh)
    params = sampler.place_params(init_params(cfg, 0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, P).tolist() for _ in range(G)]
    keys = sample_keys(0, np.arange(G), N)

    def fresh():
        st = sampler.init_state(num_slots=G * N, max_prompt_len=P, max_new_tokens=R, group_size=N)
        return sampler.prefill(params, st, prompts, range(G), keys)

    state = fresh()
    t0 = time.perf_counter()
    compiled = sampler.lower_decode(params, state).compile()
    compile_s = time.perf_counter() - t0
    box = [state]

    def call():
        if bool(jax.device_get(box[0].done).all()):  # budgets used up: refill (untimed)
            box[0] = fresh()
        t = time.perf_counter()
        box[0] = compiled(params, box[0], jnp.int32(S), jnp.int32(0))
        jax.block_until_ready(box[0].pending)
        return time.perf_counter() - t

    call()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < reps_seconds:
        times.append(call())
    sec = statistics.median(times)
    cache = state.cache
    cache_shapes = {"k_prompt": cache.k_prompt.shape, "k_resp": cache.k_resp.shape,
                    "k_prompt (one layer)": cache.k_prompt.shape[1:],
                    "k_resp (one layer)": cache.k_resp.shape[1:]}
    return {"decode_tokens_per_s": G * N * S / sec, "decode_ms": 1e3 * sec,
            "decode_compile_s": compile_s, "decode_hlo": compiled.as_text(),
            "cache_shapes": cache_shapes}


def worker(devices: int, reps_seconds: float, hlo_dir: Path, out: Path) -> None:
    import jax

    from models.config import get_config
    from rl.runtime.mesh import (
        count_collectives,
        describe_mesh,
        full_array_gathers,
        make_mesh_preset,
        mesh_axes,
        validate_mesh,
    )

    assert len(jax.devices()) == devices, jax.devices()
    cfg = get_config("tiny")
    rows = []
    for name in PRESETS[devices]:
        row = {"devices": devices, "preset": name}
        try:
            mesh = make_mesh_preset(name)
            validate_mesh(mesh, cfg, batch=B, num_slots=G * N, groups=G)
        except ValueError as err:  # e.g. tensor=4 over 2 kv heads
            row["skipped"] = str(err)
            rows.append(row)
            continue
        row["mesh"] = describe_mesh(mesh)
        fsdp = mesh_axes(mesh)["fsdp"] > 1
        params = _param_shapes(cfg, mesh)
        tr, de = _train(cfg, mesh, reps_seconds), _decode(cfg, mesh, reps_seconds)
        for kind, res, watched in (("train", tr, {}), ("decode", de, de["cache_shapes"])):
            hlo = res.pop(f"{kind}_hlo")
            (hlo_dir / f"{devices}dev_{name.replace('+', '_')}_{kind}.txt").write_text(hlo)
            row[f"{kind}_collectives"] = count_collectives(hlo)
            param_gathers = full_array_gathers(hlo, params)
            row[f"{kind}_fsdp_param_gathers" if fsdp else f"{kind}_unexpected_param_gathers"] = \
                param_gathers
            row[f"{kind}_unexpected_cache_gathers"] = full_array_gathers(hlo, watched)
        de.pop("cache_shapes")
        row.update({k: round(v, 3) for k, v in {**tr, **de}.items()})
        row["unexpected"] = sum(len(row.get(f"{k}_unexpected_{w}_gathers", []))
                                for k in ("train", "decode") for w in ("param", "cache"))
        rows.append(row)
    out.write_text(json.dumps(rows))


# ----------------------------------------------------------------------------- driver
def _fmt_counts(c: dict) -> str:
    short = {"all-gather": "ag", "all-reduce": "ar", "reduce-scatter": "rs", "all-to-all": "a2a",
             "collective-permute": "cp"}
    return " ".join(f"{short[k]}{v}" for k, v in c.items() if v) or "-"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.bench.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,2,4,8", help="forced CPU device counts (from 1,2,4,8)")
    ap.add_argument("--reps-seconds", type=float, default=1.0, help="timing budget per measurement")
    ap.add_argument("--hlo-dir", default="runs/bench_scaling_hlo", help="where the HLO texts go")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    hlo_dir = Path(args.hlo_dir)
    hlo_dir.mkdir(parents=True, exist_ok=True)
    if args.worker is not None:
        worker(args.worker, args.reps_seconds, hlo_dir, Path(args.out))
        return {}
    from tqdm.auto import tqdm

    counts = [int(x) for x in args.devices.split(",")]
    bad = [c for c in counts if c not in PRESETS]
    if bad:
        ap.error(f"--devices must be among {sorted(PRESETS)}, got {bad}")
    load_before = load_average()
    rows = []
    for n in tqdm(counts, desc="device counts"):
        # XLA:CPU's concurrency-optimized scheduler can order two independent collectives
        # on overlapping device groups differently per device: with data and fsdp both > 1
        # the train step deadlocks (the rendezvous aborts after 40 s). The plain schedule
        # is deterministic.
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={n} "
                             "--xla_cpu_enable_concurrency_optimized_scheduler=false")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            proc = subprocess.run([sys.executable, "-m", "experiments.bench.scaling", "--worker",
                                   str(n), "--out", str(out), "--reps-seconds",
                                   str(args.reps_seconds), "--hlo-dir", str(hlo_dir)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:  # keep the other device counts' results
                err = [ln for ln in proc.stderr.splitlines() if not ln.startswith("    @")]
                print(f"worker for {n} devices failed:\n" + "\n".join(err[-12:]), file=sys.stderr)
                rows.append({"devices": n, "failed": "\n".join(err[-12:])})
                continue
            rows += json.loads(out.read_text())
    head = f"{'dev':>3} {'preset':<11} {'train tok/s':>11} {'decode tok/s':>12} " \
           f"{'train collectives':<22} {'decode collectives':<22} unexpected"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "failed" in r:
            print(f"{r['devices']:>3} worker failed (see the JSON)")
            continue
        if "skipped" in r:
            print(f"{r['devices']:>3} {r['preset']:<11} skipped: {r['skipped'][:90]}")
            continue
        print(f"{r['devices']:>3} {r['preset']:<11} {r['train_tokens_per_s']:>11.0f} "
              f"{r['decode_tokens_per_s']:>12.0f} {_fmt_counts(r['train_collectives']):<22} "
              f"{_fmt_counts(r['decode_collectives']):<22} {r['unexpected']}")
    unexpected = sum(r.get("unexpected", 0) for r in rows)
    failed = [r["devices"] for r in rows if "failed" in r]
    result = {
        "headline": {"metric": "unexpected full-array all-gathers (whole parameter without fsdp, "
                               "or whole KV cache) across presets",
                     "value": unexpected, "target": 0, "machine": machine()},
        "caveat": "forced CPU devices share the machine's cores: tokens/s show partitioning "
                  "overhead, not speed-up",
        "command": "python -m experiments.bench.scaling " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "model": "tiny (2 layers, hidden 64, 4 heads, 2 kv heads, vocab 256)",
        "train_batch": {"rows": B, "tokens": T},
        "decode": {"groups": G, "samples_per_group": N, "prompt_tokens": P,
                   "tokens_per_call": S, "budget": R},
        "load_average_1_5_15min": {"before": load_before, "after": load_average()},
        "failed_device_counts": failed,
        "rows": rows,
    }
    write_results(RESULT, result)
    print(f"unexpected full-array all-gathers: {unexpected} (target 0); wrote {RESULT}")
    return result


if __name__ == "__main__":
    main()
