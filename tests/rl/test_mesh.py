"""rl.runtime.mesh: preset sizes, validate_mesh's clear errors (checked on abstract meshes, so
no devices and no compilation are needed), target-sharding trees and the HLO collective
parser on hand-written HLO lines."""
import jax
import numpy as np
import pytest

from models.config import get_config
from rl.runtime.mesh import (
    count_collectives,
    describe_mesh,
    full_array_gathers,
    make_mesh_preset,
    preset_axes,
    validate_mesh,
    with_shardings,
)

TINY = get_config("tiny")  # 4 heads, 2 kv heads, mlp 128, vocab 256, hidden 64
SMOL = get_config("smollm2-135m")  # 9 heads, 3 kv heads


def abstract(data=1, fsdp=1, tensor=1):
    return jax.sharding.AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))


@pytest.mark.parametrize("name, sizes", [
    ("single", (1, 1, 1)), ("dp", (8, 1, 1)), ("fsdp", (1, 8, 1)), ("tp", (1, 1, 8)),
    ("dp+fsdp", (2, 4, 1)), ("dp+tp", (4, 1, 2)), ("fsdp+tp", (1, 4, 2)),
    ("dp+fsdp+tp", (2, 2, 2)), ("data=2,fsdp=1,tensor=4", (2, 1, 4)), ("dp=4,tp=2", (4, 1, 2)),
])
def test_preset_sizes_on_8_devices(name, sizes):
    got = preset_axes(name, 8)
    assert (got["data"], got["fsdp"], got["tensor"]) == sizes


def test_preset_arguments_and_errors():
    assert preset_axes("fsdp+tp", 8, tensor=4) == {"data": 1, "fsdp": 2, "tensor": 4}
    assert preset_axes("dp+fsdp", 8, data=4) == {"data": 4, "fsdp": 2, "tensor": 1}
    with pytest.raises(ValueError, match="tensor=3 does not divide the 8 devices"):
        preset_axes("fsdp+tp", 8, tensor=3)
    with pytest.raises(ValueError, match="unknown mesh preset 'zp'"):
        preset_axes("zp", 8)
    with pytest.raises(ValueError, match="expected comma-separated"):
        preset_axes("data=2,pipeline=2", 8)
    mesh = make_mesh_preset("single")  # the one device this process has
    assert describe_mesh(mesh) == "data=1 fsdp=1 tensor=1 (1 devices, 1 process)"
    with pytest.raises(ValueError, match="2 devices needed but only 1 available"):
        make_mesh_preset("data=2", jax.devices()[:1])


def test_validate_mesh_accepts_fitting_meshes():
    validate_mesh(abstract(2, 2, 2), TINY, batch=8, num_slots=16, groups=4)
    validate_mesh(abstract(1, 8, 1), SMOL, batch=64)  # hidden 576, mlp 1536 divide by 8
    validate_mesh(abstract(1, 1, 3), SMOL)  # 9 heads, 3 kv heads, vocab 49152 = 3 * 16384


def test_validate_mesh_names_what_does_not_divide():
    # SmolLM2 has 3 kv heads: tensor=2 must be a clear error, not a device_put failure.
    with pytest.raises(ValueError) as err:
        validate_mesh(abstract(1, 2, 2), SMOL)
    msg = str(err.value)
    assert "kv_heads = 3 (ModelConfig.num_kv_heads) is not divisible by mesh axis tensor = 2" in msg
    assert "heads = 9 (ModelConfig.num_heads)" in msg
    assert "mlp" not in msg and "vocab" not in msg  # 1536 and 49152 divide by 2
    with pytest.raises(ValueError, match=r"embed = 64 \(ModelConfig.hidden_size\) is not divisible "
                                         r"by mesh axis fsdp = 3"):
        validate_mesh(abstract(1, 3, 1), TINY)
    with pytest.raises(ValueError, match="mlp = 100 .* tensor = 8"):
        validate_mesh(abstract(1, 1, 8), TINY.replace(num_heads=8, num_kv_heads=8, head_dim=8,
                                                      intermediate_size=100))
    with pytest.raises(ValueError, match="batch = 6 is not divisible by data\\*fsdp = 4"):
        validate_mesh(abstract(2, 2, 1), TINY, batch=6)
    with pytest.raises(ValueError, match="num_slots = 10 is not divisible by data\\*fsdp = 4"):
        validate_mesh(abstract(1, 4, 1), TINY, num_slots=10)
    with pytest.raises(ValueError, match="groups = 2 is not divisible"):
        validate_mesh(abstract(4, 1, 1), TINY, groups=2)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        validate_mesh(abstract(), TINY, batch=0)
    bad = jax.sharding.AbstractMesh((2,), ("x",))
    with pytest.raises(ValueError, match="lack \\['data', 'fsdp', 'tensor'\\]"):
        validate_mesh(bad, TINY)


def test_with_shardings_builds_restore_targets():
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = {"a": np.zeros((2, 3), np.float32), "b": jax.ShapeDtypeStruct((4,), np.int32)}
    out = with_shardings(tree, dev)
    assert out["a"] == jax.ShapeDtypeStruct((2, 3), np.float32, sharding=dev)
    assert out["b"].shape == (4,) and out["b"].sharding == dev
    per_leaf = with_shardings(tree, {"a": dev, "b": dev})
    assert per_leaf["b"].dtype == np.int32
    with pytest.raises(ValueError):
        with_shardings(tree, {"a": dev})


HLO = """
ENTRY %main {
  %p = f32[2,64,2,16]{3,2,1,0} parameter(0)
  %all-gather.1 = f32[2,64,4,16]{3,2,1,0} all-gather(f32[2,64,2,16]{3,2,1,0} %p), channel_id=1, replica_groups={{0,1}}, dimensions={2}
  %all-gather-start.2 = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(f32[8,4]{1,0} %x), dimensions={0}
  %all-gather-done.2 = f32[16,4]{1,0} all-gather-done((f32[8,4]{1,0}, f32[16,4]{1,0}) %all-gather-start.2)
  %all-reduce.3 = f32[]{:T(128)} all-reduce(f32[] %y), to_apply=%add
  ROOT %collective-permute.4 = s32[3]{0} collective-permute(s32[3]{0} %z), source_target_pairs={{0,1}}
  %reduce-scatter.5 = f32[4]{0} reduce-scatter(f32[8]{0} %w), dimensions={0}
}
"""


def test_collective_parser_on_hand_written_hlo():
    assert count_collectives(HLO) == {"all-gather": 2, "all-reduce": 1, "reduce-scatter": 1,
                                      "all-to-all": 0, "collective-permute": 1}
    shapes = {"k_proj": (2, 64, 4, 16), "cache": (16, 4), "other": (2, 64, 2, 16), "shard": (8, 4)}
    # Inputs of a gather ((2, 64, 2, 16); (8, 4) inside the async start's tuple) do not count.
    assert full_array_gathers(HLO, shapes) == ["cache", "k_proj"]
