"""experiments/bench/lora.py, bytes only (shapes, nothing allocated): the adapter and
optimizer-state bytes equal a hand count from the model configs, and the headline holds
the full / LoRA r=8 optimizer-state ratio."""
import json

from experiments.bench import lora as bench_lora
from models.config import get_config


def adapter_params(name: str, rank: int) -> int:
    """r (in + out) per projection and layer, counted from the config by hand."""
    c = get_config(name)
    e, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
        c.intermediate_size
    per_layer = (e + q) + 2 * (e + kv) + (q + e) + 2 * (e + f) + (f + e)
    return rank * per_layer * c.num_layers


def test_bytes_match_a_hand_count(tmp_path):
    out = tmp_path / "bench_lora.json"
    result = bench_lora.main(["--time-models", "", "--out", str(out)])
    for name in bench_lora.MODELS:
        rows = result["models"][name]["bytes"]
        for side, rank in (("lora-r8", 8), ("lora-r32", 32), ("qlora-int4", 8)):
            assert rows[side]["trainable_bytes"] == 4 * adapter_params(name, rank)
            assert rows[side]["optimizer_state_bytes"] == 2 * 4 * adapter_params(name, rank)
        assert rows["full"]["optimizer_state_bytes"] == 2 * rows["full"]["trainable_bytes"]
        # int4 < int8 < float32 base
        base = [rows[s]["frozen_base_bytes"] for s in ("lora-r8", "qlora-int8", "qlora-int4")]
        assert base[0] > base[1] > base[2]
    head = json.loads(out.read_text())["headline"]
    rows = result["models"]["smollm2-135m"]["bytes"]
    assert head["value"] == round(rows["full"]["optimizer_state_bytes"]
                                  / rows["lora-r8"]["optimizer_state_bytes"], 1)
    assert head["value"] >= head["target"] == 20.0
