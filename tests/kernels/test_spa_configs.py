"""Launch configs of the Pallas-Triton shared-prefix kernel: per-launch BlockSizes, the
shared-memory model against what an H200 reported, the fit every config the dispatcher
can pick passes, tuned tables (reading and fallback), and per-launch tiles in interpret
mode against the reference."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.shared_prefix_attention import (
    BlockSizes,
    LaunchConfig,
    SplitOptions,
    shared_prefix_attention,
)
from kernels.shared_prefix_attention.config import LAUNCHES, default_num_warps
from kernels.shared_prefix_attention.smem import (
    HOPPER_SMEM_BYTES,
    fit_block_sizes,
    launch_fits,
    launch_shared_memory,
)
from kernels.shared_prefix_attention.tuned import (
    choose_block_sizes,
    choose_split_options,
    device_file_name,
    tuned_entry,
)

DTYPES = (jnp.bfloat16, jnp.float32)
HEAD_DIMS = (64, 128, 256)


def test_block_sizes_derive_one_config_per_launch():
    bs = BlockSizes()
    assert bs.launch("fwd_prompt") == bs.launch("fwd_resp") == LaunchConfig(128, 128, None, 2)
    for name in LAUNCHES[2:]:
        assert bs.launch(name) == LaunchConfig(64, 64, None, 2)
    tuned = bs.with_launches({"dq_resp": LaunchConfig(32, 128, 4, 3)})
    assert tuned.launch("dq_resp") == LaunchConfig(32, 128, 4, 3)
    assert tuned.launch("dq_prompt") == bs.launch("dq_prompt")
    with pytest.raises(ValueError, match="unknown launch"):
        bs.launch("fwd")
    with pytest.raises(ValueError, match="overrides must be"):
        BlockSizes(overrides=(("nope", LaunchConfig(16, 16)),))
    with pytest.raises(ValueError, match="num_stages must be a positive"):
        LaunchConfig(16, 16, num_stages=0)


def test_four_warps_below_128x128_tiles():
    assert default_num_warps(128, 128) == 8 and default_num_warps(256, 64) == 8
    assert default_num_warps(64, 64) == 4 and default_num_warps(128, 64) == 4
    assert LaunchConfig(64, 64).warps == 4 and LaunchConfig(64, 64, num_warps=8).warps == 8


def test_shared_memory_reproduces_the_h200_failure_and_the_configs_that_ran():
    """H200, jax 0.11.2: fp32 at head_dim 128 with the old defaults requested 262,144 bytes
    (232,448 available); bf16 at 64 / 128 and fp32 at 64 ran."""
    old_forward = BlockSizes().launch("fwd_resp")          # 128x128, 2 stages
    assert launch_shared_memory("fwd_resp", old_forward, 128, jnp.float32) == 262_144
    assert not launch_fits("fwd_resp", old_forward, 128, jnp.float32)
    for dtype, head_dim in ((jnp.bfloat16, 64), (jnp.bfloat16, 128), (jnp.float32, 64)):
        for name in LAUNCHES:
            assert launch_fits(name, BlockSizes().launch(name), head_dim, dtype), (
                name, dtype, head_dim)
    # the dk/dv launches stream Q and dO tiles plus two fp32 rows per stage
    assert launch_shared_memory("dkdv_prompt", LaunchConfig(64, 64, num_stages=3), 128,
                                jnp.bfloat16) == 3 * (2 * 64 * 128 * 2 + 2 * 64 * 4)
    # head dims are padded to a power of two, as the kernel does
    assert launch_shared_memory("fwd_prompt", LaunchConfig(128, 64), 80, jnp.bfloat16) == \
        launch_shared_memory("fwd_prompt", LaunchConfig(128, 64), 128, jnp.bfloat16)


def _user_configs():
    return [None, BlockSizes(), BlockSizes(256, 256, 128, 128, num_stages=4),
            BlockSizes(16, 16, 16, 16, num_stages=1),
            BlockSizes().with_launches({"dkdv_prompt": LaunchConfig(256, 128, 8, 5)})]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_config_the_dispatcher_can_pick_fits_hopper(dtype, head_dim):
    for user in _user_configs():
        chosen = choose_block_sizes(dtype, head_dim, user)
        for name in LAUNCHES:
            cfg = chosen.launch(name)
            assert launch_fits(name, cfg, head_dim, dtype), (name, cfg, user)
            assert launch_shared_memory(name, cfg, head_dim, dtype) <= HOPPER_SMEM_BYTES
            assert cfg.block_q >= 16 and cfg.block_k >= 16 and cfg.num_stages >= 1


def test_fit_keeps_configs_that_fit_and_shrinks_the_loop_tile_first():
    assert fit_block_sizes(BlockSizes(), 64, jnp.bfloat16) == BlockSizes()
    fitted = fit_block_sizes(BlockSizes(), 128, jnp.float32).launch("fwd_prompt")
    assert fitted == LaunchConfig(128, 64, None, 2)      # the streamed K/V tile halves
    deep = fit_block_sizes(BlockSizes(num_stages=6), 256, jnp.float32).launch("fwd_resp")
    assert deep == LaunchConfig(128, 16, None, 6)        # 6 * 2 * 16 * 256 * 4 + scratch
    with pytest.raises(ValueError, match="no config of launch"):
        fit_block_sizes(BlockSizes(), 1 << 14, jnp.float32)


def _write_table(directory, kind, entries):
    path = directory / device_file_name(kind)
    path.write_text(json.dumps({"device_kind": kind, "jax_version": "test",
                                "entries": entries}))
    return path


def test_tuned_table_is_read_for_its_device_and_defaults_are_the_fallback(tmp_path):
    kind = "NVIDIA H100 80GB HBM3"
    assert device_file_name(kind) == "nvidia_h100_80gb_hbm3.json"
    _write_table(tmp_path, kind, [
        {"dtype": "bfloat16", "head_dim": 128,
         "triton": {"fwd_resp": {"block_q": 64, "block_k": 64, "num_warps": 4,
                                 "num_stages": 3}},
         "split": {"joint_prompt": True}},
        # an entry too big for the chip: used, then shrunk to fit
        {"dtype": "float32", "head_dim": 128,
         "triton": {"fwd_prompt": {"block_q": 128, "block_k": 256, "num_stages": 4}}}])
    chosen = choose_block_sizes(jnp.bfloat16, 128, device_kind=kind, directory=tmp_path)
    assert chosen.launch("fwd_resp") == LaunchConfig(64, 64, 4, 3)
    assert chosen.launch("fwd_prompt") == BlockSizes().launch("fwd_prompt")
    assert choose_split_options(jnp.bfloat16, 128, device_kind=kind,
                                directory=tmp_path) == SplitOptions(joint_prompt=True)
    big = choose_block_sizes(jnp.float32, 128, device_kind=kind, directory=tmp_path)
    assert big.launch("fwd_prompt").num_stages == 4
    assert launch_fits("fwd_prompt", big.launch("fwd_prompt"), 128, jnp.float32)
    # no entry for this dtype / head dim, another device, no GPU: the defaults
    for args in ((jnp.bfloat16, 64, kind), (jnp.bfloat16, 128, "NVIDIA H200"),
                 (jnp.bfloat16, 128, None)):
        dtype, head_dim, device = args
        assert choose_block_sizes(dtype, head_dim, device_kind=device,
                                  directory=tmp_path) == BlockSizes()
        assert choose_split_options(dtype, head_dim, device_kind=device,
                                    directory=tmp_path) == SplitOptions()
    # the caller's block sizes win over the table
    mine = BlockSizes(32, 32, 32, 32)
    assert choose_block_sizes(jnp.bfloat16, 128, mine, device_kind=kind,
                              directory=tmp_path) == mine


def test_malformed_tuned_table_raises_with_its_path(tmp_path):
    kind = "Bad GPU"
    _write_table(tmp_path, kind, [{"dtype": "bfloat16", "head_dim": 64,
                                   "triton": {"fwd_everything": {"block_q": 64,
                                                                 "block_k": 64}}}])
    with pytest.raises(ValueError, match="malformed tuned table .*bad_gpu.json"):
        tuned_entry(kind, jnp.bfloat16, 64, tmp_path)


def test_committed_tuned_tables_name_their_device_and_measurement():
    """Tables come from `--parts tune` on the GPU they describe; each names its device. The
    folder is committed (its README says which tables exist), so a moved or deleted folder
    fails here instead of leaving the loop below with nothing to check."""
    from kernels.shared_prefix_attention.tuned import TUNED_DIR
    assert TUNED_DIR.is_dir() and (TUNED_DIR / "README.md").is_file(), TUNED_DIR
    for path in TUNED_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        assert device_file_name(table["device_kind"]) == path.name
        assert table["jax_version"] and table["date"] and table["entries"]


def test_per_launch_tiles_match_the_reference_in_interpret_mode():
    """Every launch with its own tiles (so the padded lengths are set by several of them)
    and warps / stages set: the Triton kernel in interpret mode equals the reference."""
    rng = np.random.default_rng(7)
    g, n, p, r, kvh, rep, d = 2, 3, 21, 10, 2, 2, 8
    h = kvh * rep
    shapes = [(g, p, h, d), (g, p, kvh, d), (g, p, kvh, d),
              (g, n, r, h, d), (g, n, r, kvh, d), (g, n, r, kvh, d)]
    qkv = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    cts = (jnp.asarray(rng.standard_normal(shapes[0]), jnp.float32),
           jnp.asarray(rng.standard_normal(shapes[3]), jnp.float32))
    plen, rlen = jnp.asarray([21, 6]), jnp.asarray([[10, 0, 3], [1, 9, 10]])
    bs = BlockSizes(8, 8, 8, 8).with_launches({
        "fwd_prompt": LaunchConfig(16, 4), "fwd_resp": LaunchConfig(4, 16, 4, 3),
        "dq_prompt": LaunchConfig(4, 8), "dq_resp": LaunchConfig(8, 4),
        "dkdv_resp": LaunchConfig(4, 8, num_stages=1), "dkdv_prompt": LaunchConfig(8, 16)})

    def run(qkv, cts):
        res = []
        for impl in ("reference", "pallas_triton"):
            fn = lambda *a, impl=impl: shared_prefix_attention(  # noqa: E731
                *a, prompt_lengths=plen, resp_lengths=rlen, impl=impl, block_sizes=bs,
                interpret=True if impl != "reference" else None)
            out, vjp = jax.vjp(fn, *qkv)
            res.append(tuple(out) + tuple(vjp(cts)))
        return res

    want, got = jax.jit(run).lower(qkv, cts).compile(
        {"xla_backend_optimization_level": 0})(qkv, cts)
    for w, x in zip(want, got):
        np.testing.assert_allclose(np.asarray(x), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_head_dim_up_to_256_gets_configs_that_fit(dtype):
    """fp32 (and bf16) at every head dim <= 256: the Triton fallback has a config for each
    launch within Hopper's shared memory, so no call is refused for its head dim."""
    for head_dim in range(1, 257):
        chosen = choose_block_sizes(dtype, head_dim)
        for name in LAUNCHES:
            assert launch_fits(name, chosen.launch(name), head_dim, dtype), (head_dim, name)
