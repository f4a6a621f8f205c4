"""The run's config tree (rl.loops.config.RunConfig over rl.runtime.config_tree): exact JSON
round trips, dotted-path overrides, the cross-section checks, and the command line as a
view of it (experiments.common.flags). No model is loaded and nothing compiles here."""
import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments.common.flags import SIMPLE_FLAGS, SWITCHES, config_from_argv
from rl.learner import OptimizerConfig, TrainConfig
from rl.loops.config import AsyncConfig, LoopConfig, RunConfig, TaskSpec
from rl.objectives import AdvantageConfig, LossConfig
from rl.rollout.pruning import PruneConfig
from rl.run import PRESETS
from rl.runtime.config_tree import ConfigPathError, parse_value


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_json_exactly(name, tmp_path):
    cfg = PRESETS[name]
    assert RunConfig.from_json(cfg.to_json()) == cfg
    assert RunConfig.load(cfg.save(tmp_path / "c.json")) == cfg
    # the text is plain JSON: loads with the stdlib and dumps back to the same object
    data = json.loads(cfg.to_json())
    assert json.loads(json.dumps(data)) == data == cfg.to_dict()


def test_json_form_against_a_hand_written_dict():
    cfg = RunConfig(name="x", task=TaskSpec("synthetic", {"length": 3, "ops": ("+", "-")}),
                    train=TrainConfig(loss=LossConfig(params={"clip_high": 0.28}),
                                      advantage=AdvantageConfig("gdpo", {"weights":
                                                                         {"a": 2.0}}),
                                      reward_weights={"correct": 1, "format": 0}),
                    asynchronous=AsyncConfig(max_staleness=3))
    d = cfg.to_dict()
    assert d["task"] == {"spec": "synthetic", "options": {"length": 3, "ops": ["+", "-"]},
                         "seed": None}
    assert d["train"]["loss"]["params"] == {"clip_high": 0.28}
    assert d["train"]["advantage"] == {"name": "gdpo", "params": {"weights": {"a": 2.0}}}
    assert d["train"]["reward_weights"] == {"correct": 1.0, "format": 0.0}
    assert d["asynchronous"]["max_staleness"] == 3 and d["prune"] is None
    back = RunConfig.from_dict(d)
    assert back == cfg
    assert back.task.kwargs["ops"] == ("+", "-")  # lists come back as the tuples they were


LEAVES = {  # path -> strategy of valid values
    "loop.steps": st.integers(0, 10_000),
    "loop.group_size": st.integers(2, 64),
    "loop.eval_greedy": st.booleans(),
    "loop.time_limit_s": st.floats(0, 1e6, allow_nan=False),
    "train.optimizer.learning_rate": st.floats(1e-9, 1.0, allow_nan=False),
    "train.temperature": st.floats(0.05, 2.0),
    "train.loss.params.clip_high": st.floats(0.0, 1.0),
    "task.options.chain_sum.max_digits": st.integers(1, 5),
    "task.options.operators": st.lists(st.sampled_from("+-*"), max_size=3),
    "scheduler.replay_capacity": st.integers(0, 99),
    "model.init_seed": st.integers(0, 2 ** 31),
    "run_dir": st.text(min_size=1, max_size=8),
}


@given(st.dictionaries(st.sampled_from(sorted(LEAVES)), st.none(), min_size=1), st.data())
def test_overridden_configs_round_trip_and_hold_the_values(paths, data):
    values = {p: data.draw(LEAVES[p]) for p in paths}
    cfg = PRESETS["smollm2-rg"].overrides(values)
    assert RunConfig.from_json(cfg.to_json()) == cfg
    for path, value in values.items():  # read back by walking the tree by hand
        if ".options." in path or ".params." in path:
            head, key = path.split(".options." if ".options." in path else ".params.", 1)
            node = cfg.task.kwargs if head == "task" else dict(cfg.train.loss.params)
            assert node[key] == (tuple(value) if isinstance(value, list) else value)
            continue
        node = cfg
        for part in path.split("."):
            node = getattr(node, part)
        assert node == value


def test_override_equals_replace_by_hand_and_names_what_is_wrong():
    cfg = PRESETS["tiny-synthetic"]
    assert cfg.override("loop.group_size", 4) == dataclasses.replace(
        cfg, loop=dataclasses.replace(cfg.loop, group_size=4))
    want_opt = dataclasses.replace(cfg.train.optimizer, learning_rate=1e-5)
    assert cfg.override("train.optimizer.learning_rate", 1e-5).train.optimizer == want_opt
    # an int into a float field is a float (JSON keeps 1 and 1.0 apart)
    assert isinstance(cfg.override("train.temperature", 1).train.temperature, float)
    # "async." is the asynchronous section; setting a field of an absent section builds it
    on = cfg.override("async.max_staleness", 2)
    assert on.asynchronous == AsyncConfig(max_staleness=2)
    assert cfg.override("prune.prune_at", 4).prune == PruneConfig(prune_at=4)
    assert on.override("asynchronous", None).asynchronous is None
    assert cfg.override("prune", {"warmup": 3}).prune == PruneConfig(warmup=3)
    with pytest.raises(ConfigPathError, match=r"LoopConfig has no field 'gruop_size'.*group_size"):
        cfg.override("loop.gruop_size", 4)
    with pytest.raises(ConfigPathError, match="not a section"):
        cfg.override("loop.steps.x", 4)
    with pytest.raises(ValueError, match=r"LoopConfig.group_size must be an int >= 1"):
        cfg.override("loop.group_size", 0)
    with pytest.raises(ValueError, match="learning_rate"):
        cfg.override("train.optimizer.learning_rate", -1.0)


def test_fields_that_must_change_together_are_set_together():
    cfg = PRESETS["tiny-synthetic"]
    for order in (["async.mask_offpolicy_prefix=True", "async.rollout=april"],
                  ["async.rollout=april", "async.mask_offpolicy_prefix=True"]):
        got = cfg.overrides(order).asynchronous
        assert (got.rollout, got.mask_offpolicy_prefix) == ("april", True)
    with pytest.raises(ValueError, match="mask_offpolicy_prefix needs rollout='april'"):
        cfg.override("async.mask_offpolicy_prefix", True)  # alone it cannot hold


def test_parse_value():
    assert parse_value("1e-5") == 1e-5 and parse_value("4") == 4
    assert parse_value("True") is True and parse_value("true") is True
    assert parse_value("None") is None and parse_value("null") is None
    assert parse_value("none") == "none"  # a mode name (VCPO's lr_scale), not None
    assert parse_value("(1, 2)") == (1, 2) and parse_value("reverse") == "reverse"
    assert parse_value("{'a': 1}") == {"a": 1}


def test_validate_refuses_what_the_loops_cannot_run():
    base = PRESETS["tiny-synthetic"]
    cases = {
        "prune.prune_at=2 async.max_staleness=1": "online pruning .* threaded producer",
        "prune.prune_at=2 scheduler.name=dps": "pruning .* uniformly",
        "scheduler.name=dars async.max_staleness=1": "prompt scheduler.* threaded producer",
        "scheduler.name=dps async.mode=deterministic async.rollout=april": "APRIL rounds",
        "scheduler.replay_fraction=0.5": "old_logp",
        "loop.group_size=1": "group_size 1",
    }
    for sets, match in cases.items():
        with pytest.raises(ValueError, match=match):
            base.overrides(sets.split()).validate()
    env = PRESETS["tiny-guess"]
    env.overrides(["async.max_staleness=1", "async.rollout=april"]).validate()  # APRIL episodes
    env.override("async.max_staleness", 1).validate()  # threaded: episodes in the producer
    env.overrides(["async.max_staleness=1", "async.rollout=continuous"]).validate()
    # what a source can do, it may: the deterministic source samples what the sync one does
    for sets in ("scheduler.name=dars async.mode=deterministic",
                 "prune.prune_at=2 async.mode=deterministic",
                 "loop.time_limit_s=60 async.max_staleness=1"):
        base.overrides(sets.split()).validate()
    env.overrides(["async.max_staleness=1", "async.mode=deterministic"]).validate()
    assert base.validate() is base


# ----------------------------------------------------------------------------- the CLI
FLAG_VALUES = {"steps": "7", "group_size": "4", "prompts_per_step": "2", "segment_len": "3",
               "eval_every": "5", "save_every": "6", "eval_prompts": "9", "seed": "11",
               "lr": "0.0003", "temperature": "0.7", "micro_batches": "2", "mesh": "dp",
               "run_dir": "runs/x", "wandb": "disabled", "model": "smollm2-135m",
               "reward": "my_rewards:score", "verifier": "exact", "reward_timeout": "3.5",
               "save_every_minutes": "10", "env_step_timeout": "5", "episode_timeout": "60",
               "remat": "full", "host_malloc": "lean", "rollout_dtype": "bfloat16",
               "max_concurrent_tool_calls": "8", "tool_latency": "lognormal:0.5,3",
               "park_after": "0.5"}


@pytest.mark.parametrize("dest", sorted(SIMPLE_FLAGS))
def test_each_short_flag_is_its_dotted_path(dest):
    flag = "--" + dest.replace("_", "-")
    value = FLAG_VALUES[dest]
    short, _ = config_from_argv([flag, value])
    long, _ = config_from_argv(["--set", f"{SIMPLE_FLAGS[dest]}={value}"])
    assert short == long != PRESETS["tiny-synthetic"]


@pytest.mark.parametrize("dest", sorted(SWITCHES))
def test_each_switch_is_its_dotted_path(dest):
    path, value = SWITCHES[dest]
    short, _ = config_from_argv(["--" + dest.replace("_", "-")])
    assert short == config_from_argv(["--set", f"{path}={value}"])[0] != PRESETS["tiny-synthetic"]


def test_composite_flags_set_what_they_say():
    cfg, resume = config_from_argv(["--preset", "smollm2-rg", "--time-limit", "2",
                                    "--task-option", "max_terms=3", "--lora-rank", "4",
                                    "--lora-targets", "q,v", "--resume",
                                    "--allow-config-change", "eval_every"])
    assert cfg.loop.time_limit_s == 120.0 and cfg.task.kwargs["max_terms"] == 3
    assert cfg.train.lora.rank == 4 and cfg.train.lora.alpha == 8.0
    assert cfg.train.lora.targets == ("q_proj", "v_proj")
    assert resume.allow_changes == ("eval_every",) and not resume.from_last_good
    cfg, resume = config_from_argv(["--max-staleness", "2", "--async-mode", "deterministic",
                                    "--proximal", "exact", "--vcpo"])
    assert cfg.asynchronous == AsyncConfig(max_staleness=2, mode="deterministic",
                                           proximal="exact")
    assert cfg.train.vcpo.enabled and cfg.train.vcpo.lr_scale == "sqrt" and resume is None
    cfg, _ = config_from_argv(["--task", "reasoning_gym:leg_counting", "--preset", "smollm2-rg"])
    # a new task keeps only the preset's sampling budget
    assert cfg.task.kwargs == {"max_new_tokens": 48, "max_prompt_len": 128}
    # a flag sets its own path only: replay without a correction is refused (as from Python)
    cfg, _ = config_from_argv(["--replay-fraction", "0.5"])
    assert cfg.scheduler.replay_fraction == 0.5 and cfg.train.old_logp == "current"
    with pytest.raises(ValueError, match="train.old_logp=behaviour"):
        cfg.validate()
    cfg, _ = config_from_argv(["--replay-fraction", "0.5", "--set", "train.old_logp=behaviour"])
    assert cfg.validate().train.old_logp == "behaviour"
    cfg, _ = config_from_argv(["--loss", "dapo", "--advantage", "rloo"])
    assert cfg.train.loss == LossConfig.preset("dapo") and cfg.train.advantage.name == "rloo"
    # --vcpo on a preset whose advantage is not grpo: --set fixes it in the same pass
    with pytest.raises(ValueError, match="leave TrainConfig.advantage at 'grpo'"):
        config_from_argv(["--preset", "tiny-guess", "--vcpo"])
    cfg, _ = config_from_argv(["--preset", "tiny-guess", "--vcpo", "--set",
                               "train.advantage.name=grpo"])
    assert cfg.train.vcpo.enabled and cfg.train.advantage.name == "grpo"
    cfg, _ = config_from_argv(["--log-ess", "--set", "train.vcpo.monitor=false"])
    assert not cfg.train.vcpo.monitor   # --set still wins over the short flag


def test_set_wins_over_short_flags_and_config_files_round_trip(tmp_path, capsys):
    cfg, _ = config_from_argv(["--lr", "1e-4", "--set", "train.optimizer.learning_rate=2e-4"])
    assert cfg.train.optimizer == dataclasses.replace(PRESETS["tiny-synthetic"].train.optimizer,
                                                      learning_rate=2e-4)
    from experiments.common.train_cli import main

    main(["--preset", "tiny-guess", "--steps", "3", "--print-config"])
    printed = RunConfig.from_json(capsys.readouterr().out)
    assert printed == PRESETS["tiny-guess"].override("loop.steps", 3)
    path = printed.save(tmp_path / "cfg.json")
    again, _ = config_from_argv(["--config", str(path)])
    assert again == printed
    with pytest.raises(SystemExit):
        main(["--config", str(path), "--preset", "tiny-guess", "--print-config"])
    with pytest.raises(SystemExit):
        main(["--set", "loop.nope=1", "--print-config"])


def test_loop_and_train_configs_are_the_learners_own():
    cfg = PRESETS["tiny-synthetic"]
    assert isinstance(cfg.loop, LoopConfig) and isinstance(cfg.train, TrainConfig)
    assert isinstance(cfg.train.optimizer, OptimizerConfig)
    hash(cfg.train)  # still a jit static


def test_snapshot_store_round_trips_and_sizes_the_ring_estimate():
    from types import SimpleNamespace

    from models.config import get_config
    from rl.run.plan import estimate_memory

    disk = RunConfig(asynchronous=AsyncConfig(max_staleness=4, mode="deterministic",
                                              snapshot_store="disk"))
    assert json.loads(disk.to_json())["asynchronous"]["snapshot_store"] == "disk"
    assert RunConfig.from_json(disk.to_json()) == disk
    assert disk.override("async.snapshot_store", "memory").asynchronous.snapshot_store == "memory"
    memory = disk.override("async.snapshot_store", "memory")
    task = SimpleNamespace(max_prompt_len=8, max_new_tokens=8)
    one = estimate_memory(get_config("tiny"), RunConfig(), task).params  # fp32 params' bytes
    assert estimate_memory(get_config("tiny"), memory, task).snapshots == 6 * one  # k + 2
    assert estimate_memory(get_config("tiny"), disk, task).snapshots == 2 * one


def test_memory_estimate_follows_remat_and_the_eval_rows():
    """estimate_memory's activations by remat policy and its eval KV cache, against the
    counts written out by hand for the tiny config (module docstring's formulas)."""
    from types import SimpleNamespace

    from models.config import get_config
    from rl.run.plan import estimate_memory

    c = get_config("tiny")
    task = SimpleNamespace(max_prompt_len=8, max_new_tokens=8)
    base = RunConfig().overrides({"loop.prompts_per_step": 2, "loop.group_size": 4,
                                  "loop.eval_prompts": 10})
    rows, length, b = 8, 16, 4  # fp32 compute
    q, k = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = rows * length * (4 * c.hidden_size + 2 * q + 2 * k + 2 * c.intermediate_size) \
        + rows * c.num_heads * length * length
    kept = {"none": None, "full": c.hidden_size,
            "dots": q + 2 * k + 2 * c.hidden_size + 2 * c.intermediate_size}
    for policy, keep in kept.items():
        e = estimate_memory(c, base.override("train.remat", policy), task)
        want = layer * c.num_layers if keep is None else \
            rows * length * keep * c.num_layers + layer
        assert e.activations == want * b, policy
    assert kept["full"] < kept["dots"]
    kv_row = length * c.num_layers * 2 * k * b
    e = estimate_memory(c, base, task)
    assert (e.kv_cache, e.eval_kv_cache) == (rows * kv_row, 10 * kv_row)
    assert e.eval_total == e.params + e.optimizer + e.runtime + 10 * kv_row
    assert e.peak == max(e.total, e.eval_total)
    bf16 = estimate_memory(c, base.override("rollout.dtype", "bfloat16"), task)
    assert (bf16.kv_cache, bf16.eval_kv_cache) == (rows * kv_row // 2, 10 * kv_row)
    capped = estimate_memory(c, base.override("loop.eval_max_rows", 4), task)
    assert capped.eval_kv_cache == 4 * kv_row and capped.total == e.total
    assert "a step" in e.format() and "evals ~" in e.format()
    # the head: 3 chunks' logits, plus the other chunks' kept for the backward by default,
    # over the scored positions only: rows x (length - 1) unpacked, the responses packed
    for packed, head_tokens in ((False, rows * (length - 1)), (True, rows * 8)):
        chunk = 32
        cfg = base.overrides({"train.logprob_chunk": chunk, "train.packed": packed})
        kept = estimate_memory(c, cfg, task)
        remat = estimate_memory(c, cfg.override("train.head_remat", True), task)
        assert remat.head == 3 * chunk * c.vocab_size * 4
        assert kept.head == remat.head + (head_tokens - chunk) * c.vocab_size * 4, packed
        whole = estimate_memory(c, cfg.override("train.logprob_chunk", 0), task)
        assert whole.head == 3 * head_tokens * c.vocab_size * 4, packed
