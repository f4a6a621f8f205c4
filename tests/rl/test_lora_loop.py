"""LoRA in the loops (rl.loops.adapters), checkpoints, export and mesh.

A LoRA run starts as the base (its step-0 eval equals an eval of the plain base params);
its checkpoints hold adapters + optimizer state only plus the base hash; 2 steps + resume
+ 1 == 3 steps bit for bit; resuming on another base or with other LoRA settings is
refused; the sampler's merged params equal W + (alpha/r) A B in float64 and sample the
tokens the composed (on the fly) params sample; the async loop (η = 0) equals the sync
loop, its exact proximal log-probs (adapter snapshots composed with the one base) equal
the merged sampler's; the CLI trains, and experiments.export writes merged HF weights whose
logits are the adapted model's, and PEFT adapters that rebuild those weights; the
8-device mesh step equals the one-device step (float32 base and int4 base).

Same geometry as tests/rl/test_sync_loop.py (tiny-synthetic, 2 groups of 4)."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from test_sync_loop import LOOP, PRESET, cfg, policy  # noqa: F401  (shared compilations)

from models.lora import PROJECTIONS, LoraConfig, compose, init_lora
from rl.learner.snapshots import load_params_file
from rl.loops import AsyncConfig, RolloutSpec, eval_metrics, run, run_async, sample_groups
from rl.loops.adapters import BASE_KEY, base_hash, lora_run, merged_params
from rl.loops.validation import ConfigError
from rl.rollout import SamplingConfig

REPO = Path(__file__).resolve().parents[2]
LCFG = LoraConfig(rank=4, alpha=8.0)
TRAIN = dataclasses.replace(
    PRESET.train, lora=LCFG,
    loss=dataclasses.replace(PRESET.train.loss, kl_coef=0.05),  # the base is the reference
    optimizer=dataclasses.replace(PRESET.train.optimizer, learning_rate=3e-2))


def lora_cfg(run_dir, loop=LOOP, train=TRAIN, **sections):
    """test_sync_loop's run config with the LoRA learner TRAIN."""
    return cfg(run_dir, loop, train=train, **sections)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def ckpt_meta(run_dir, step):
    return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def noisy_adapters(base, seed, scale=0.3):
    ad = init_lora(base, LCFG, seed)
    ks = jax.random.split(jax.random.PRNGKey(seed + 100), len(jax.tree.leaves(ad)))
    flat, tree = jax.tree.flatten(ad)
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape)
                                     for x, k in zip(flat, ks)])


@pytest.fixture(scope="module")
def straight(policy, tmp_path_factory):  # noqa: F811
    config, params, task = policy
    d = tmp_path_factory.mktemp("lora") / "straight"
    return run(config, params, task, lora_cfg(d))


def test_run_starts_as_the_base_checkpoints_adapters_and_resumes_bit_exact(
        policy, straight, tmp_path):  # noqa: F811
    config, params, task = policy
    # B = 0: the step-0 eval is an eval of the plain base params, sample for sample
    spec = RolloutSpec(task, config, group_size=1, segment_len=PRESET.rollout.segment_len,
                       sampling=SamplingConfig(temperature=TRAIN.temperature))
    want = eval_metrics(params, 0, spec, task.eval_prompts(LOOP.eval_prompts),
                        seed=(LOOP.seed * 7919) % (2 ** 31),
                        reward_weights=dict(TRAIN.reward_weights))
    assert straight.eval[0]["reward"] == want["reward"]
    assert jax.tree.structure(straight.state.params) == jax.tree.structure(
        init_lora(params, LCFG, 0))
    assert straight.train[-1]["kl"] > 0  # adapters moved away from the base reference
    meta = ckpt_meta(straight.run_dir, 3)
    arrays = meta["_checksums"]["arrays"]
    assert arrays and all("lora_a" in k or "lora_b" in k for k in arrays
                          if k.startswith("params/") or "/mu/" in k or "/nu/" in k)
    assert not [k for k in arrays if k.endswith("kernel") or "embed" in k]  # no base leaf
    assert meta["config"][BASE_KEY] == base_hash(params)
    assert meta["config"]["train.lora.rank"] == 4
    # 2 steps + resume + 1 step == 3 steps, bit for bit (adapters and optimizer state)
    two = dataclasses.replace(LOOP, steps=2)
    run(config, params, task, lora_cfg(tmp_path / "b", two))
    resumed = run(config, params, task, lora_cfg(tmp_path / "b"), resume=True)
    for a, b in zip(leaves((straight.state.params, straight.state.opt_state)),
                    leaves((resumed.state.params, resumed.state.opt_state))):
        np.testing.assert_array_equal(a, b)
    assert [r["loss"] for r in resumed.train] == [r["loss"] for r in straight.train]
    # another base: refused, naming both hashes; other LoRA settings: refused
    other = jax.tree.map(lambda x: x, params)
    other["final_norm"] = {"scale": params["final_norm"]["scale"] * 1.001}
    four = dataclasses.replace(LOOP, steps=4)
    with pytest.raises(ConfigError) as err:
        run(config, other, task, lora_cfg(tmp_path / "b", four), resume=True)
    assert base_hash(params) in str(err.value) and base_hash(other) in str(err.value)
    rank8 = dataclasses.replace(TRAIN, lora=LoraConfig(rank=8, alpha=8.0))
    with pytest.raises(ConfigError, match="train.lora.rank"):
        run(config, params, task, lora_cfg(tmp_path / "b", four, rank8), resume=True)


def test_merged_sampler_params_and_composed_sample_alike(policy):  # noqa: F811
    config, params, task = policy
    adapters = noisy_adapters(params, 1)
    merged = merged_params(params, adapters, LCFG)
    for name, (parent, n_in) in PROJECTIONS.items():
        w = np.asarray(params["layers"][parent][name]["kernel"], np.float64)
        a = np.asarray(adapters["layers"][parent][name]["lora_a"], np.float64)
        b = np.asarray(adapters["layers"][parent][name]["lora_b"], np.float64)
        want = w + (LCFG.alpha / LCFG.rank) * np.einsum("lir,lro->lio", a, b).reshape(w.shape)
        np.testing.assert_allclose(np.asarray(merged["layers"][parent][name]["kernel"]), want,
                                   atol=1e-5, rtol=1e-5)
    prompts = task.eval_prompts(LOOP.prompts_per_step)  # the loop's sampler geometry
    spec = RolloutSpec(task, config, group_size=LOOP.group_size, segment_len=PRESET.rollout.segment_len,
                       sampling=SamplingConfig(temperature=1.0))
    kw = dict(seed=3)
    got = sample_groups(merged, 1, spec, prompts, **kw)
    on_the_fly = sample_groups(compose(params, adapters, LCFG), 1, spec, prompts, **kw)
    np.testing.assert_array_equal(got.response_ids, on_the_fly.response_ids)
    np.testing.assert_allclose(got.behaviour_logprobs, on_the_fly.behaviour_logprobs, atol=1e-5)
    # quantized base: merged = dequantised W + delta, the same tokens as on the fly
    lora, _ = lora_run(params, dataclasses.replace(TRAIN, lora=dataclasses.replace(
        LCFG, qlora="int8")), 0)
    q_merged = sample_groups(lora.policy(adapters), 1, spec, prompts, **kw)
    q_fly = sample_groups(lora.composed(adapters), 1, spec, prompts, **kw)
    np.testing.assert_array_equal(q_merged.response_ids, q_fly.response_ids)


def test_async_eta_zero_equals_sync_and_exact_proximal(policy, straight, tmp_path):  # noqa: F811
    config, params, task = policy
    res = run_async(config, params, task, lora_cfg(tmp_path / "a0", asynchronous=AsyncConfig(
        max_staleness=0, mode="deterministic")))
    for a, b in zip(leaves(straight.state.params), leaves(res.state.params)):
        np.testing.assert_array_equal(a, b)
    acfg = AsyncConfig(max_staleness=1, mode="deterministic", proximal="exact")
    res = run_async(config, params, task, lora_cfg(tmp_path / "a1", asynchronous=acfg))
    for r in res.train:  # π_prox from composed adapter snapshots == the merged sampler's μ
        assert r["mismatch_log_ratio_abs_mean"] < 1e-4
    folder = tmp_path / "a1" / "snapshots" / "3"
    assert sorted(f.name for f in folder.iterdir()) == ["v2.npz", "v3.npz"]
    n_adapter = len(jax.tree.leaves(init_lora(params, LCFG, 0)))
    for f in folder.iterdir():  # adapters only (the base is not in the ring)
        assert len(load_params_file(f)) == n_adapter


def test_cli_trains_and_exports_merged_weights_and_adapters(tmp_path):
    from experiments.common.train_cli import main as train_main
    from experiments.export import main as export_main
    from models.convert import hf_from_params
    from models.decoder import forward
    from models.hf_loader import load_hf_checkpoint
    from rl.run import load_policy, load_run

    run_dir = tmp_path / "run"
    train_main(["--steps", "2", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets",
                "q,v,gate,down", "--lr", "0.05", "--group-size", "4", "--prompts-per-step", "2",
                "--eval-prompts", "8", "--run-dir", str(run_dir), "--no-progress",
                "--wandb", "disabled"])
    pol = load_run(run_dir)
    ad = pol.adapters
    assert sorted(n for p in ad["layers"].values() for n in p) == [
        "down_proj", "gate_proj", "q_proj", "v_proj"]
    assert float(np.abs(np.asarray(ad["layers"]["attn"]["q_proj"]["lora_b"])).max()) > 0
    export_main(["--run-dir", str(run_dir), "--out", str(tmp_path / "hf")])
    config, base, _ = load_policy(PRESET, 0)
    lcfg = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    _, loaded = load_hf_checkpoint(tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    want = forward(compose(base, ad, lcfg), config, tokens)
    np.testing.assert_allclose(np.asarray(forward(loaded, config, tokens)), np.asarray(want),
                               atol=1e-5, rtol=1e-5)
    export_main(["--run-dir", str(run_dir), "--out", str(tmp_path / "ad"), "--adapters-only"])
    from safetensors.numpy import load_file

    peft = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (4, 8.0, "LORA")
    hf_base, hf_merged = hf_from_params(base, config), hf_from_params(loaded, config)
    for i in range(config.num_layers):  # W_hf + (alpha/r) lora_B @ lora_A == merged export
        for part, name in (("self_attn", "q_proj"), ("mlp", "down_proj")):
            key = f"model.layers.{i}.{part}.{name}"
            pa = peft[f"base_model.model.{key}.lora_A.weight"].astype(np.float64)
            pb = peft[f"base_model.model.{key}.lora_B.weight"].astype(np.float64)
            np.testing.assert_allclose(hf_base[f"{key}.weight"] + 2.0 * pb @ pa,
                                       hf_merged[f"{key}.weight"], atol=1e-5)
    with pytest.raises(SystemExit):  # full fine-tune runs have no adapters
        train_main(["--steps", "1", "--lora-alpha", "8", "--run-dir", str(tmp_path / "x")])


def test_cli_flags_to_lora_config():
    import argparse

    from experiments.common.flags import lora_from_args

    args = argparse.Namespace(lora_rank=8, lora_alpha=None, lora_targets="q, v,*_proj",
                              qlora="int4")
    got = lora_from_args(args)
    assert got == LoraConfig(rank=8, alpha=16.0, targets=("q_proj", "v_proj", "*_proj"),
                             qlora="int4")
    none = argparse.Namespace(lora_rank=None, lora_alpha=None, lora_targets=None, qlora=None)
    assert lora_from_args(none) is None  # full fine-tuning: the config's train.lora stays None
    with pytest.raises(ValueError, match="--qlora needs --lora-rank"):
        lora_from_args(argparse.Namespace(**{**vars(none), "qlora": "int8"}))
    with pytest.raises(ValueError, match="matches no projection"):
        lora_from_args(argparse.Namespace(**{**vars(args), "lora_targets": "qq"}))


_MESH = textwrap.dedent("""
    import sys, jax, numpy as np
    from models.decoder import init_params
    from models.lora import LoraConfig, init_lora, quantize_base
    from models.sharding import make_mesh
    from rl.learner import TrainConfig, OptimizerConfig, batch_from_trajectory, init_train_state
    from rl.learner import make_train_step
    from rl.learner.jitted import ref_shardings
    from rl.objectives import LossConfig
    from tests.rl.test_trainer import CFG as cfg, make_traj, GROUP
    out = {}
    for q in (None, "int4"):
        lc = LoraConfig(rank=4, alpha=8.0, qlora=q)
        tc = TrainConfig(loss=LossConfig(name="ppo_clip", kl_coef=0.1),
                         optimizer=OptimizerConfig(name="sgd", learning_rate=1.0,
                                                   max_grad_norm=None), lora=lc)
        base = init_params(cfg, 3)
        base = quantize_base(base, q) if q else base
        ad = init_lora(base, lc, 4)
        flat, tree = jax.tree.flatten(ad)  # trained-like adapters: A and B both nonzero
        rng = np.random.default_rng(5)
        ad = jax.tree.unflatten(tree, [x + 0.05 * rng.standard_normal(x.shape, np.float32)
                                       for x in flat])
        out.update({f"{q}_init_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(ad))})
        batch = batch_from_trajectory(make_traj(0), group_size=GROUP, model_config=cfg)
        for name, mesh in (("one", None), ("mesh", make_mesh(data=2, fsdp=2, tensor=2))):
            step = make_train_step(tc, cfg, mesh)
            b = base if mesh is None else jax.device_put(base, ref_shardings(cfg, tc, mesh))
            st = step.place_state(init_train_state(jax.tree.map(np.array, ad), tc, 0))
            new, m = step(st, batch, b)
            out.update({f"{q}_{name}_{i}": np.asarray(x)
                        for i, x in enumerate(jax.tree.leaves(new.params))})
            out[f"{q}_{name}_loss"] = np.asarray(m["loss"])
            if mesh is not None:
                specs = {str(x.sharding.spec) for x in jax.tree.leaves(new.params)}
                out[f"{q}_sharded"] = np.asarray(any("tensor" in s for s in specs))
    np.savez(sys.argv[1], **out)
""")


def test_mesh_step_equals_one_device(tmp_path):
    # The suite's compile flags (tests/conftest.py), for the one-device reference
    # and the mesh alike (as in test_sharded_sampling).
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _MESH, str(tmp_path / "o.npz")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp_path / "o.npz")
    for q in ("None", "int4"):
        assert bool(out[f"{q}_sharded"])  # adapters really are split over the tensor axis
        np.testing.assert_allclose(out[f"{q}_mesh_loss"], out[f"{q}_one_loss"], rtol=1e-5)
        n = len([k for k in out.files if k.startswith(f"{q}_init_")])
        assert n == 2 * len(PROJECTIONS)
        for i in range(n):  # SGD, lr 1: new - init is minus the gradient
            one = out[f"{q}_one_{i}"] - out[f"{q}_init_{i}"]
            mesh = out[f"{q}_mesh_{i}"] - out[f"{q}_init_{i}"]
            assert np.abs(one).max() > 1e-4
            np.testing.assert_allclose(mesh, one, rtol=1e-4, atol=1e-4 * np.abs(one).max())
