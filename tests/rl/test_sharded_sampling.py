"""The sharded sampler (rl.rollout.sharded_sampler) on 8 forced CPU devices, in a subprocess:
on every mesh preset it draws the same tokens as the one-device sampler (rl.rollout.sampler)
with the same keys (also with the chunked prefill, on one mesh), its cache keeps its
shardings, the decode program gathers neither the KV cache nor (without fsdp) a whole
parameter; a mesh that does not divide the kv heads or the groups is a clear error before
compiling."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Every multi-device preset on 8 devices (each costs a few seconds of -O0 compilation).
PRESETS = ("dp", "fsdp", "tp", "dp+fsdp", "dp+tp", "fsdp+tp", "dp+fsdp+tp")

_SCRIPT = textwrap.dedent("""
    import json, sys, jax, numpy as np
    from models.config import get_config
    from models.decoder import init_params
    from rl.rollout import (init_state, prefill, decode_segment, sample_keys, read_slots,
                            SamplingConfig)
    from rl.rollout import ShardedSampler
    from rl.runtime.mesh import make_mesh_preset, full_array_gathers
    assert len(jax.devices()) == 8
    cfg = get_config("tiny", vocab_size=64, max_position_embeddings=64)  # 4 heads, 2 kv heads
    params = init_params(cfg, 1)
    G, N, P, R = 8, 2, 8, 8
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 64, int(rng.integers(2, P + 1))).tolist() for _ in range(G)]
    keys = sample_keys(5, np.arange(G), N)
    kw = dict(num_slots=G * N, max_prompt_len=P, max_new_tokens=R, group_size=N, stop_ids=(2,),
              sampling=SamplingConfig(temperature=1.3))

    def rows(state):
        return [(s.response_ids.tolist(), s.logprobs.tolist(), s.versions.tolist())
                for s in read_slots(state, range(G * N))]

    # One device: the plain sampler; two segments with different versions.
    st = prefill(params, init_state(cfg, **kw), prompts, np.arange(G * N).reshape(G, N), keys)
    st = decode_segment(params, decode_segment(params, st, 5, 0), 5, 1)
    out = {"single": rows(st), "presets": {}}
    for name in sys.argv[2].split(","):
        mesh = make_mesh_preset(name, tensor=2 if name == "tp" else None)
        s = ShardedSampler(cfg, mesh)
        p = s.place_params(params)
        state = s.prefill(p, s.init_state(**kw), prompts, range(G), keys)
        state = s.decode_segment(p, s.decode_segment(p, state, 5, 0), 5, 1)
        c = state.cache
        assert c.k_resp.sharding == s.state_shardings(state).cache.k_resp, name
        rec = {"rows": rows(state), "spec": list(c.k_resp.sharding.spec)}
        if name == "dp+fsdp+tp":
            hlo = s.decode_hlo(p, state)
            shapes = {"k_prompt": c.k_prompt.shape, "k_resp": c.k_resp.shape,
                      "k_resp layer": c.k_resp.shape[1:], "k_prompt layer": c.k_prompt.shape[1:]}
            rec["cache_gathers"] = full_array_gathers(hlo, shapes)
        out["presets"][name] = rec
    # Chunked prefill (prompts wider than 3 tokens prefill 3 at a time) on a mesh.
    s = ShardedSampler(cfg, make_mesh_preset("dp+tp", tensor=2))
    p = s.place_params(params)
    state = s.prefill(p, s.init_state(**kw, prefill_chunk=3), prompts, range(G), keys)
    out["chunked"] = rows(s.decode_segment(p, s.decode_segment(p, state, 5, 0), 5, 1))
    # Bad meshes: clear errors before anything compiles.
    errors = {}
    try:
        ShardedSampler(cfg.replace(num_kv_heads=1, num_heads=3), make_mesh_preset("tp", tensor=2))
    except ValueError as err:
        errors["kv_heads"] = str(err)
    try:
        ShardedSampler(cfg, make_mesh_preset("dp")).init_state(**{**kw, "num_slots": 4 * N})
    except ValueError as err:
        errors["groups"] = str(err)
    out["errors"] = errors
    json.dump(out, open(sys.argv[1], "w"))
""")


def test_sharded_sampler_matches_one_device_on_every_preset(tmp_path):
    # The suite's compile flags (tests/conftest.py), for the reference and the meshes alike;
    # the plain XLA:CPU schedule avoids a collective-ordering deadlock on data x fsdp meshes.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=8"
               " --xla_cpu_enable_concurrency_optimized_scheduler=false")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "out.json"),
                           ",".join(PRESETS)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    single = out["single"]
    lengths = [len(toks) for toks, _, _ in single]
    assert max(lengths) == 8 and sum(lengths) > 8  # real decoding happened
    assert sorted({v for _, _, vs in single for v in vs}) == [0, 1]  # both segments ran
    for name in (*PRESETS, "chunked"):
        got = out["chunked"] if name == "chunked" else out["presets"][name]["rows"]
        for (t1, l1, v1), (t2, l2, v2) in zip(single, got):
            assert t1 == t2 and v1 == v2, name  # token for token
            assert max((abs(a - b) for a, b in zip(l1, l2)), default=0.0) <= 1e-5, name
    # Groups over (data, fsdp), kv heads over tensor.
    assert out["presets"]["dp+fsdp+tp"]["spec"] == [None, ["data", "fsdp"], None, None, "tensor",
                                                    None]
    assert out["presets"]["dp+fsdp+tp"]["cache_gathers"] == []
    assert "kv_heads = 1 (ModelConfig.num_kv_heads) is not divisible by mesh axis tensor = 2" \
        in out["errors"]["kv_heads"]
    assert "groups = 4 is not divisible by data*fsdp = 8" in out["errors"]["groups"]
