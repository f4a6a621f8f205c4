"""Configs that cannot learn or cannot run are rejected before anything compiles, with
errors that say what to change; a resume must match the checkpoint's recorded config.

Uses the tiny-synthetic geometry of tests/rl/test_sync_loop.py (2 groups of 4, 8 eval
prompts) so the compiled sampler and step are shared with it."""
import dataclasses
import time

import pytest

from experiments.common.train_cli import main
from rl.learner import TrainConfig
from rl.loops import LoopConfig, run
from rl.loops.validation import (
    CHANGEABLE_ON_RESUME,
    ConfigError,
    check_resume_config,
    config_record,
    validate_run,
)
from rl.objectives import AdvantageConfig
from rl.objectives.vcpo import VCPOConfig
from rl.run import PRESETS, LoggingConfig, Resume, load_policy

PRESET = PRESETS["tiny-synthetic"]
LOOP = dataclasses.replace(PRESET.loop, steps=2, prompts_per_step=2, group_size=4, eval_prompts=8,
                           eval_every=0, save_every=0, eval_greedy=False)


def cfg(run_dir, loop=LOOP):
    """The preset with this loop, writing into run_dir, no wandb, no progress bar."""
    return dataclasses.replace(PRESET, loop=loop, run_dir=str(run_dir),
                               logging=LoggingConfig(wandb="disabled", progress=False))


@pytest.mark.parametrize("adv", ["grpo", "dr_grpo", "rloo", "mc_grpo", "gdpo"])
def test_group_size_one_with_a_group_relative_advantage(adv):
    train = dataclasses.replace(PRESET.train, advantage=AdvantageConfig(adv))
    with pytest.raises(ConfigError, match=r"group_size 1 .*--group-size >= 2"):
        validate_run(train, dataclasses.replace(LOOP, group_size=1))
    validate_run(train, dataclasses.replace(LOOP, group_size=2))  # two responses: fine


def test_group_size_one_with_vcpo():
    train = dataclasses.replace(PRESET.train, vcpo=VCPOConfig(enabled=True))
    with pytest.raises(ConfigError, match="VCPO"):
        validate_run(train, dataclasses.replace(LOOP, group_size=1))


@pytest.mark.parametrize("temperature, ok", [(1e-6, False), (0.01, False), (0.05, True),
                                             (0.7, True), (1.5, True)])
def test_greedy_temperature_is_rejected(temperature, ok):
    train = dataclasses.replace(PRESET.train, temperature=temperature)
    if ok:
        validate_run(train, LOOP)
    else:
        with pytest.raises(ConfigError, match=r"greedy.*\[0.05, 2\].*eval_greedy"):
            validate_run(train, LOOP)


def test_micro_batches_must_divide_the_batch():
    loop = dataclasses.replace(LOOP, prompts_per_step=8, group_size=8)
    with pytest.raises(ConfigError, match=r"micro_batches 3 does not divide the batch of 64 rows.*"
                                          r"\[1, 2, 4, 8, 16, 32, 64\]"):
        validate_run(dataclasses.replace(PRESET.train, micro_batches=3), loop)
    validate_run(dataclasses.replace(PRESET.train, micro_batches=16), loop)
    packed = dataclasses.replace(PRESET.train, micro_batches=16, packed=True)
    with pytest.raises(ConfigError, match=r"whole groups.*must divide prompts_per_step 8"):
        validate_run(packed, loop)  # 16 divides 64 rows but not 8 groups


def test_cli_rejects_before_loading_or_compiling(capsys):
    for argv, match in ((["--group-size", "1"], "group_size 1"),
                        (["--temperature", "1e-6"], "sampling is greedy"),
                        (["--micro-batches", "3"], "does not divide the batch of 64")):
        t0 = time.perf_counter()
        with pytest.raises(SystemExit) as exc:
            main(argv + ["--run-dir", "/nonexistent/never-created", "--no-progress"])
        assert exc.value.code == 2 and time.perf_counter() - t0 < 5.0
        assert match in capsys.readouterr().err


def test_resume_config_diff_lists_fields_and_allows_only_what_may_change():
    train, loop = PRESET.train, LOOP
    saved = config_record(train, loop, {"task": "synthetic"})
    check_resume_config(saved, saved)
    # steps and the time limit are what a resume sets: always free
    check_resume_config(saved, config_record(train, dataclasses.replace(
        loop, steps=99, time_limit_s=60.0), {"task": "synthetic"}))
    changed = config_record(
        dataclasses.replace(train, optimizer=dataclasses.replace(train.optimizer,
                                                                 learning_rate=3e-3)),
        dataclasses.replace(loop, group_size=8, seed=1, eval_every=5), {"task": "other"})
    with pytest.raises(ConfigError) as err:
        check_resume_config(saved, changed)
    msg = str(err.value)
    for line in ("loop.group_size: checkpoint 4 -> now 8", "loop.seed: checkpoint 0 -> now 1",
                 "train.optimizer.learning_rate: checkpoint 0.001 -> now 0.003",
                 "loop.eval_every: checkpoint 0 -> now 5", "task: checkpoint 'synthetic'",
                 "--allow-config-change eval_every"):
        assert line in msg
    assert "5 field(s)" in msg
    # allowing eval_every leaves the four that define what is learned
    with pytest.raises(ConfigError, match="4 field"):
        check_resume_config(saved, changed, allow=["eval_every"])
    only_eval = config_record(train, dataclasses.replace(loop, eval_every=5, save_every=3),
                              {"task": "synthetic"})
    check_resume_config(saved, only_eval, allow=["eval_every", "save_every"])
    with pytest.raises(ConfigError, match="only .* may change"):
        check_resume_config(saved, saved, allow=["group_size"])
    check_resume_config(None, changed)  # a checkpoint from before records: not checked
    assert CHANGEABLE_ON_RESUME <= {f.name for f in dataclasses.fields(LoopConfig)} | {
        "segment_len"}  # the rollout section's


def test_a_checkpoint_from_before_the_rollout_section_resumes():
    """The rollout options were loop fields: a record (and a run_config.json) written then
    names them loop.*; they are read under their new paths, and a change is still caught."""
    from rl.loops import RolloutOptions, RunConfig

    rollout = RolloutOptions(segment_len=4, dtype="bfloat16")
    now = config_record(PRESET.train, LOOP, {"rollout": rollout, "task": "synthetic"})
    old = {k: v for k, v in now.items() if not k.startswith("rollout.")}
    old.update({"loop.segment_len": 4, "loop.layer_loop": "scan", "loop.bucket_slots": False,
                "loop.rollout_dtype": "bfloat16"})
    check_resume_config(old, now)
    moved = config_record(PRESET.train, LOOP, {"rollout": dataclasses.replace(
        rollout, segment_len=8), "task": "synthetic"})
    with pytest.raises(ConfigError, match="rollout.segment_len: checkpoint 4 -> now 8") as err:
        check_resume_config(old, moved)
    assert "--allow-config-change segment_len" in str(err.value)
    check_resume_config(old, moved, allow=["segment_len"])
    data = PRESET.to_dict()
    data["loop"].update(segment_len=2, rollout_dtype="bfloat16")
    del data["rollout"]
    cfg = RunConfig.from_dict(data)  # an old run_config.json
    assert cfg.rollout == RolloutOptions(segment_len=2, dtype="bfloat16")
    assert PRESET.override("loop.segment_len", 2).rollout.segment_len == 2


def test_a_field_added_after_the_checkpoint_matches_at_its_default_only():
    from rl.loops import AsyncConfig
    from rl.loops.validation import record_defaults

    train, loop = PRESET.train, LOOP
    extra = {"async": AsyncConfig(mode="deterministic", max_staleness=2), "task": "synthetic"}
    now = config_record(train, loop, extra)
    old = {k: v for k, v in now.items() if k != "async.snapshot_store"}  # an older record
    defaults = record_defaults(train, loop, extra)
    assert defaults["async.snapshot_store"] == "memory" and "task" not in defaults
    check_resume_config(old, now, defaults=defaults)  # the new field at its default
    with pytest.raises(ConfigError, match="async.snapshot_store: checkpoint '<absent>'"):
        check_resume_config(old, now)  # without the defaults it is a change
    disk = config_record(train, loop, {**extra, "async": dataclasses.replace(
        extra["async"], snapshot_store="disk")})
    with pytest.raises(ConfigError, match="-> now 'disk'"):
        check_resume_config(old, disk, defaults=defaults)  # not its default: a change
    # a field the checkpoint has is compared as before, default or not
    with pytest.raises(ConfigError, match="loop.seed"):
        check_resume_config(now, config_record(train, dataclasses.replace(loop, seed=5), extra),
                            defaults=defaults)


def test_config_record_is_flat_json_of_every_field():
    rec = config_record(TrainConfig(), LoopConfig())
    assert rec["train.loss.name"] == "ppo_clip" and rec["loop.group_size"] == 8
    assert rec["train.reward_weights"] == [] and rec["train.optimizer.b2"] == 0.999
    n_fields = sum(1 for k in rec if k.startswith("loop."))
    assert n_fields == len(dataclasses.fields(LoopConfig))


def test_run_resume_checks_the_checkpoint_config(tmp_path):
    config, params, task = load_policy(PRESET, 0)
    run(config, params, task, cfg(tmp_path))
    other = dataclasses.replace(LOOP, steps=4, group_size=2)
    with pytest.raises(ConfigError, match=r"loop.group_size: checkpoint 4 -> now 2"):
        run(config, params, task, cfg(tmp_path, other), resume=True)
    # a finished run resumed without more steps would silently do nothing
    with pytest.raises(ConfigError, match="nothing to resume: the checkpoint is at step 2"):
        run(config, params, task, cfg(tmp_path), resume=True)
    more = dataclasses.replace(LOOP, steps=3, eval_every=1)
    with pytest.raises(ConfigError, match="--allow-config-change eval_every"):
        run(config, params, task, cfg(tmp_path, more), resume=True)
    res = run(config, params, task, cfg(tmp_path, more),
              resume=Resume(allow_changes=("eval_every",)))
    assert int(res.state.step) == 3


def test_the_reward_is_part_of_the_record_and_older_records_leave_it_unchecked():
    from rl.loops.config import RewardConfig
    from rl.loops.validation import record_defaults

    train, loop = PRESET.train, LOOP
    strict = {"task": "rg", "reward": RewardConfig(verifier="strict", function="m:f")}
    saved = config_record(train, loop, strict)
    assert saved["reward.function"] == "m:f" and saved["reward.verifier"] == "strict"
    defaults = record_defaults(train, loop, strict)
    check_resume_config(saved, saved, defaults=defaults)
    # another function or verifier changes what is learned; a call's time limit does not
    for change, line in (({"function": "m:g"}, "reward.function: checkpoint 'm:f' -> now 'm:g'"),
                         ({"verifier": "dataset"}, "reward.verifier: checkpoint 'strict'")):
        now = config_record(train, loop, {**strict, "reward": dataclasses.replace(
            strict["reward"], **change)})
        with pytest.raises(ConfigError, match="1 field") as err:
            check_resume_config(saved, now, defaults=defaults)
        assert line in str(err.value)
    check_resume_config(saved, config_record(train, loop, {**strict, "reward": dataclasses.replace(
        strict["reward"], timeout_s=60.0)}), defaults=defaults)
    # a record written before it held the reward cannot say which one that run used: not
    # compared, even where the run's reward is not the default (unlike a single new field)
    old = {k: v for k, v in saved.items() if not k.startswith("reward.")}
    check_resume_config(old, saved, defaults=defaults)
    with pytest.raises(ConfigError, match="loop.seed"):  # the rest is compared as before
        check_resume_config(old, config_record(train, dataclasses.replace(loop, seed=3), strict),
                            defaults=defaults)
    # a record that has the section compares all of it (a field absent there is a change)
    partial = {k: v for k, v in saved.items() if k != "reward.function"}
    with pytest.raises(ConfigError, match="reward.function: checkpoint '<absent>'"):
        check_resume_config(partial, saved)
