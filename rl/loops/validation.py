"""Checks of a run's configuration that need more than one config, made before anything
compiles, with errors that say what to change; and the record of a run's configuration
that a resume is compared against.

    validate_config(cfg)          every check of a RunConfig (RunConfig.validate): validate_run,
                                  the host allocator, what the batch source cannot run (each
                                  refusal says why), the reward against the task
    validate_run(train, loop)     ConfigError for a configuration that cannot learn or
                                  cannot run: group_size 1 with a group-relative
                                  advantage (every advantage is 0), a train temperature
                                  so low that sampling is greedy, a batch that does not
                                  split into the micro-batches (packed: whole groups)
    config_record(train, loop)    {"train.loss.name": ..., "loop.group_size": ...}: the
                                  flat, JSON-safe record every checkpoint carries
    check_resume_config(saved, current, allow=())
                                  ConfigError listing every field that differs between
                                  the checkpoint's record and this run's, unless it is
                                  free (steps, time limit) or allowed (`allow`, only for
                                  the fields in CHANGEABLE_ON_RESUME)
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from rl.learner import TrainConfig
from rl.runtime.host_memory import check_malloc_policy

# Estimators whose advantage is relative to the group (all built-ins): a group of one
# response has advantage 0, so group_size 1 trains on nothing.
GROUP_RELATIVE = frozenset({"grpo", "dr_grpo", "rloo", "mc_grpo", "gdpo"})

# Below this train temperature sampling is greedy in effect (logits / T overflow the
# float32 log-softmax's resolution at T ~ 1e-3 already) and the learner's log-probs at T
# lose their meaning; GRPO needs samples that differ within a group.
MIN_TRAIN_TEMPERATURE = 0.05

# How far a resumed run goes, and how it meets faults (time-based saves, environment time
# limits): the resume itself says it may change.
FREE_ON_RESUME = frozenset({"loop.steps", "loop.time_limit_s", "loop.save_every_minutes",
                            "loop.env_step_timeout_s", "loop.episode_timeout_s",
                            # how many tool calls overlap, and an emulated tool latency:
                            # when a call returns, never which tokens are drawn
                            "loop.max_concurrent_tool_calls", "loop.tool_latency",
                            "loop.park_after_s",
                            "loop.host_malloc", "loop.eval_max_rows", "loop.eval_clear_programs",
                            # how VCPO's exact gradient norms are computed (ghost or vmap,
                            # rows per pass): the same values, so free as well
                            "train.vcpo.grad_norms", "train.vcpo.chunk",
                            # the head's logits kept or recomputed: the same values
                            "train.head_remat",
                            # how long one call of a reward function may take
                            "reward.timeout_s"})
# Sections the record gained after runs had been checkpointed without them: a saved record
# with no field of such a section cannot say what that run used, so the section is not
# compared (rather than taken to have held its defaults, as a single field added later is).
LATE_SECTIONS = frozenset({"reward"})
# Fields that change what is measured or saved, not what is learned: allowed on resume
# when named explicitly (rl.loops.run(..., resume=Resume(allow_changes=...)),
# --allow-config-change).
CHANGEABLE_ON_RESUME = frozenset({"eval_every", "eval_prompts", "eval_greedy",
                                  "eval_sampled_prompts", "save_every", "keep_checkpoints",
                                  "segment_len", "checked"})
# their record paths (segment_len is the rollout section's; the rest are loop fields)
CHANGEABLE_PATHS = {name: "rollout.segment_len" if name == "segment_len" else f"loop.{name}"
                    for name in CHANGEABLE_ON_RESUME}
CHANGEABLE_NAMES = {path: name for name, path in CHANGEABLE_PATHS.items()}
# the paths of options that moved to RunConfig's rollout section: still accepted in dotted
# overrides, run_config.json files and the records of checkpoints written before the move
LEGACY_PATHS = {"loop.segment_len": "rollout.segment_len", "loop.layer_loop": "rollout.layer_loop",
                "loop.bucket_slots": "rollout.bucket_slots", "loop.rollout_dtype": "rollout.dtype"}


class ConfigError(ValueError):
    """A run's configuration cannot learn, cannot run, or does not match its checkpoint."""


def validate_config(cfg: Any) -> None:
    """Every check of a RunConfig `cfg` (module doc), before anything loads or compiles."""
    validate_run(cfg.train, cfg.loop)
    check_malloc_policy(cfg.loop.host_malloc)  # this platform's C library can apply it
    check_sources(cfg)
    if cfg.scheduler.replay_fraction > 0:
        from rl.loops.replay import check_replay_correction

        check_replay_correction(cfg.train)
    check_reward(cfg)


def check_sources(cfg: Any) -> None:
    """ValueError for what the config's batch source cannot run, saying why (the list is on
    docs/concepts/architecture.md)."""
    a, s, p = cfg.asynchronous, cfg.scheduler, cfg.prune
    if p is not None and not s.is_default:
        raise ValueError("online pruning (--prune) samples the stream uniformly; drop it or "
                         "the prompt scheduler / rollout replay (--prompt-scheduler / "
                         "--replay-fraction)")
    producer = a is not None and (a.mode == "threaded" or a.rollout == "april")
    if producer and (p is not None or not s.is_default):
        raise ValueError(
            "the prompt scheduler, rollout replay and online pruning choose and cut each "
            "step's groups as one batch, which the threaded producer and APRIL rounds do "
            "not sample (they stream prompts continuously); use them in the synchronous "
            "loop or with --async-mode deterministic (static rollouts), or drop them")
    if a is not None and a.backend == "ray":
        refused = [name for name, on in (
            ("a prompt scheduler or rollout replay", not s.is_default),
            ("online pruning", p is not None),
            ("dynamic sampling", cfg.loop.dynamic_sampling)) if on]
        if refused:
            raise ValueError(f"Ray rollout workers (async.backend='ray') do not run "
                             f"{', '.join(refused)} yet: their records and side state live "
                             "with the sampler, in the worker; use the local backend")
    if a is not None and cfg.distributed.enabled:
        check_learner_group(a)
    if cfg.loop.park_after_s >= 0 and (not cfg.task.is_env or cfg.task.kwargs.get(
            "kv_layout", "segmented") != "replicated" or cfg.loop.max_concurrent_tool_calls < 1):
        raise ValueError("loop.park_after_s (parking the slot of an episode that waits on a "
                         "tool) is for environments with the episode option kv_layout=replicated "
                         "(--env-option, or --task-option with a preset) and "
                         "--max-concurrent-tool-calls >= 1; set those or drop it")
    if cfg.task.is_env and p is not None:
        raise ValueError(f"{cfg.task.spec}: --prune (online rollout pruning) is for "
                         "single-turn tasks; drop it for an environment")
    check_latr(cfg)
    check_trace(cfg)
    check_tree_learner(cfg)


def check_latr(cfg: Any) -> None:
    """ValueError where LATR tree rollouts (cfg.latr, rl.rollout.latr) cannot run: they
    grow whole groups, with host decisions between device calls, in the synchronous and
    deterministic sources."""
    if cfg.latr is None:
        return
    a = cfg.asynchronous
    refused = [name for name, on in (
        ("an environment (its turn-level trees are TRACE's: --trace)",
         cfg.task.is_env),
        ("online pruning (--prune)", cfg.prune is not None),
        ("the threaded producer or APRIL rounds", a is not None and (
            a.mode == "threaded" or a.rollout == "april")),
        ("Ray rollout workers", a is not None and a.backend == "ray")) if on]
    if refused:
        raise ValueError(f"LATR tree rollouts (latr) do not run with {'; '.join(refused)}: "
                         "use a single-turn task in the synchronous loop or with "
                         "--async-mode deterministic, or drop latr")
    if cfg.latr.tree_size(cfg.loop.group_size) < 2 and cfg.latr.mix_ratio > 0:
        raise ValueError(f"latr.mix_ratio = {cfg.latr.mix_ratio} of group_size "
                         f"{cfg.loop.group_size} leaves a tree of under 2 leaves, which cannot "
                         "branch; raise one of them (or set mix_ratio 0: independent samples)")


def check_learner_group(a: Any) -> None:
    """Asynchronous training across processes (a jax.distributed learner group): only with
    Ray rollout workers on the deterministic schedule (each process's workers sample its
    share of every step), with proximal "current" or "versions" (computed in the step)."""
    if a.backend != "ray":
        raise ValueError("in-process asynchronous training runs its producer, buffer and "
                         "param ring in one process; a learner group of several processes "
                         "trains asynchronously with Ray rollout workers (--async-backend "
                         "ray), or drop the async settings or the multi-process ones")
    if a.mode != "deterministic":
        raise ValueError(f"a learner group of several processes runs Ray workers on the "
                         f"deterministic schedule (--async-mode deterministic), not "
                         f"{a.mode!r}: streaming admits each process's groups by its own "
                         "timing, so the processes' batches would differ in shape and version")
    if a.proximal in ("exact", "ewma"):
        raise ValueError(f"AsyncConfig.proximal={a.proximal!r} computes log-probs of each "
                         "process's rows before the global batch is assembled, which a "
                         "learner group of several processes does not do yet; use "
                         "--proximal current or versions")


def check_trace(cfg: Any) -> None:
    """ValueError where TRACE turn-level trees (cfg.trace, rl.rollout.trace) cannot run:
    they grow an environment's whole batch in two stages, one process's, in the synchronous
    and deterministic sources, with the uniform prompt stream."""
    if cfg.trace is None:
        return
    if not cfg.task.is_env:
        raise ValueError(f"trace (TRACE turn-level trees) branches an environment's episodes "
                         f"at turn boundaries; {cfg.task.spec!r} is a single-turn task: use an "
                         "environment (--env NAME), or --latr for token-level trees")
    a, loop = cfg.asynchronous, cfg.loop
    credit = dict(cfg.task.options).get("turn_credit", "outcome")
    refused = [name for name, on in (
        ("LATR (latr)", cfg.latr is not None),
        ("a prompt scheduler other than uniform", not cfg.scheduler.is_default),
        ("dynamic sampling", loop.dynamic_sampling),
        ("turn-level credit (a continuation's turns start at its prefix's depth)",
         credit not in (None, "outcome")),
        ("the threaded producer or APRIL rounds", a is not None and (
            a.mode == "threaded" or a.rollout == "april")),
        ("Ray rollout workers", a is not None and a.backend == "ray"),
        ("several processes", cfg.distributed.enabled)) if on]
    if refused:
        raise ValueError(f"TRACE turn-level trees (trace) do not run with {'; '.join(refused)}: "
                         "use the synchronous loop or --async-mode deterministic, or drop trace")
    if loop.prompts_per_step < 2:
        raise ValueError(f"trace splits each batch into root groups and allocated groups: "
                         f"loop.prompts_per_step = {loop.prompts_per_step}, needs >= 2")


def check_tree_learner(cfg: Any) -> None:
    """ValueError where the learner's tree layout (train.tree, models.tree.TreeGroups)
    cannot run: it packs single-turn groups that share their prompt, one process's."""
    if not cfg.train.tree:
        return
    if cfg.task.is_env:
        raise ValueError(f"{cfg.task.spec}: train.tree packs single-turn groups as prefix "
                         "trees; an environment's episodes interleave observations: drop "
                         "--tree-batches")
    if cfg.distributed.enabled:
        raise ValueError("train.tree builds each process's trees on its own shapes; run it in "
                         "one process, or drop --tree-batches")


def check_reward(cfg: Any) -> None:
    """ValueError when the reward section and the task disagree (a verifier set twice, a
    reward function for an environment, which scores its own episodes)."""
    r = cfg.reward
    if r.task_options:
        clash = {k: v for k, v in r.task_options.items()
                 if k in cfg.task.kwargs and cfg.task.kwargs[k] != v}
        if clash:
            key = next(iter(clash))
            raise ValueError(f"reward.{key}={clash[key]!r} and task option {key}="
                             f"{cfg.task.kwargs[key]!r} disagree; set it in one place "
                             f"(--verifier / reward.{key})")
    if cfg.task.is_env and (r.function is not None or r.task_options):
        raise ValueError(f"{cfg.task.spec}: an environment scores its own episodes; "
                         "reward.function / reward.verifier are for single-turn tasks")


def validate_run(train: TrainConfig, loop: Any) -> None:
    """ConfigError (what to change) if `train` with `loop` (a LoopConfig) cannot learn or run."""
    n, groups = loop.group_size, loop.prompts_per_step
    adv = train.advantage.name
    if n == 1 and (adv in GROUP_RELATIVE or train.vcpo.enabled):
        which = "VCPO's advantage" if train.vcpo.enabled else f"the {adv!r} advantage"
        raise ConfigError(f"group_size 1 with {which}: an advantage relative to the group is 0 "
                         "for a group of one response, so every step would train on nothing; "
                         "use --group-size >= 2 (4 to 16 is usual)")
    if train.temperature < MIN_TRAIN_TEMPERATURE:
        raise ConfigError(f"temperature {train.temperature:g} is so low that sampling is greedy: "
                         "the responses of a group would be identical (zero advantage) and the "
                         "log-probs at that temperature are not meaningful; train at a "
                         f"temperature in [{MIN_TRAIN_TEMPERATURE}, 2] (0.6 to 1.0 is usual) and "
                         "evaluate greedily with eval_greedy (experiments.evaluate --greedy)")
    m = train.micro_batches
    rows = n * groups
    if rows % m:
        raise ConfigError(f"micro_batches {m} does not divide the batch of {rows} rows "
                         f"(prompts_per_step {groups} x group_size {n}); choose micro_batches "
                         f"among {_divisors(rows)}")
    if (train.packed or train.tree) and groups % m:
        raise ConfigError(f"with packed=True or tree=True the micro-batches hold whole groups: micro_batches "
                         f"{m} must divide prompts_per_step {groups}; choose among "
                         f"{_divisors(groups)}")


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def _flatten(prefix: str, value: Any, out: dict) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _flatten(f"{prefix}.{f.name}", getattr(value, f.name), out)
    elif isinstance(value, Mapping):
        for k in sorted(value):
            _flatten(f"{prefix}.{k}", value[k], out)
    else:  # JSON round trip: tuples become lists, anything else its repr
        out[prefix] = json.loads(json.dumps(value, default=repr))


def config_record(train: TrainConfig, loop: Any, extra: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """Flat {dotted field: JSON value} of the train and loop configs (and `extra`, e.g.
    {"async": AsyncConfig}) — what a checkpoint records and a resume compares."""
    out: dict[str, Any] = {}
    _flatten("train", train, out)
    _flatten("loop", loop, out)
    for key, value in (extra or {}).items():
        _flatten(key, value, out)
    return out


def record_defaults(train: TrainConfig, loop: Any, extra: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """config_record of the same config classes at their default values (extra entries
    that are not dataclasses are left out): what a field added to the configs after a
    checkpoint was written is taken to have been, when that checkpoint's record lacks it."""
    dflt = {k: type(v)() for k, v in (extra or {}).items()
            if dataclasses.is_dataclass(v) and not isinstance(v, type)}
    return config_record(type(train)(), type(loop)(), dflt)


def check_allowed_changes(allow: Iterable[str]) -> set[str]:
    """The names allowed to change on resume (Resume.allow_changes) as a set; ConfigError
    for a name outside CHANGEABLE_ON_RESUME."""
    allow = set(allow)
    unknown = allow - CHANGEABLE_ON_RESUME
    if unknown:
        raise ConfigError(f"allow_config_changes {sorted(unknown)}: only "
                          f"{sorted(CHANGEABLE_ON_RESUME)} may change on resume")
    return allow


def check_resume_config(saved: Mapping[str, Any] | None, current: Mapping[str, Any],
                        allow: Iterable[str] = (), defaults: Mapping[str, Any] | None = None
                        ) -> None:
    """ConfigError listing the fields where `current` differs from the checkpoint's
    `saved` record, except FREE_ON_RESUME and the `allow`ed names (loop field names from
    CHANGEABLE_ON_RESUME, e.g. "eval_every"). A checkpoint without a record (written
    before records existed) is not checked. defaults (record_defaults): a field the saved
    record lacks (added to the configs later) matches when `current` holds its default;
    a LATE_SECTIONS section the saved record has no field of is not compared."""
    allow = check_allowed_changes(allow)
    if saved is None:
        return
    saved = {LEGACY_PATHS.get(k, k): v for k, v in saved.items()}  # a record from before
    free = FREE_ON_RESUME | {CHANGEABLE_PATHS[name] for name in allow}
    saved_sections = {k.split(".", 1)[0] for k in saved}
    unrecorded = {k for k in current if k.split(".", 1)[0] in LATE_SECTIONS - saved_sections}
    added = {k for k in set(current) - set(saved)
             if defaults is not None and k in defaults and defaults[k] == current[k]} | unrecorded
    keys = sorted((set(saved) | set(current)) - added)
    diffs = [(k, saved.get(k, "<absent>"), current.get(k, "<absent>")) for k in keys
             if k not in free and saved.get(k, "<absent>") != current.get(k, "<absent>")]
    if not diffs:
        return
    lines = "\n".join(f"  {k}: checkpoint {a!r} -> now {b!r}" for k, a, b in diffs)
    changeable = sorted(CHANGEABLE_NAMES[k] for k, _, _ in diffs if k in CHANGEABLE_NAMES)
    fixed = [k for k, _, _ in diffs if k not in CHANGEABLE_NAMES]
    hint = []
    if changeable:
        hint.append(f"to change {', '.join(changeable)} on purpose, pass "
                    f"--allow-config-change {' '.join(changeable)} "
                    "(rl.loops.run(..., resume=Resume(allow_changes=...)))")
    if fixed:
        hint.append("the others define what is learned: resume with the checkpoint's values "
                    "or start a new run dir")
    raise ConfigError(f"the resumed run's config differs from the checkpoint's in "
                     f"{len(diffs)} field(s):\n{lines}\n" + "; ".join(hint))
