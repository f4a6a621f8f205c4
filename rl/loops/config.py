"""The configuration of a whole run: one tree of frozen dataclasses.

    RunConfig
      name, description, headline_target   what the run is (a preset's name by default)
      model      ModelSpec     which policy: "tiny" (random init) or a model name / file / dir
      task       TaskSpec      rl.tasks.make_task spec (or "env:NAME": an environment), its
                               options and split seed
      reward     RewardConfig  the verifier of "correct" and a reward function of your own
      train      TrainConfig   the learner: loss, advantage, optimizer, LoRA, VCPO, packing
                               (rl.learner.config)
      loop       LoopConfig    steps, batch geometry, eval / save cadence, seed, time limit
      rollout    RolloutOptions  the train rollouts' segment length, decode options, dtype
      asynchronous AsyncConfig | None   None: the synchronous source; set: an asynchronous
                               one (deterministic, threaded or on Ray; dotted paths may spell it
                               "async"; rl.loops.async_config)
      scheduler  SchedulerOptions  prompt scheduler and rollout replay (rl.loops.scheduling)
      prune      PruneConfig | None    online rollout pruning (rl.rollout.pruning)
      latr       LatrConfig | None     tree rollouts: each group grown as a LATR tree
                               (rl.rollout.latr; None: N independent samples)
      trace      TraceConfig | None    an environment's turn-level trees: half the groups
                               from prompt roots, the rest from the roots or turn prefixes
                               predicted most mixed (rl.rollout.trace; None: roots only)
      mesh       str | None    learner mesh: a preset of rl.runtime.mesh or "data=N,fsdp=N,tensor=N"
      distributed DistributedConfig   multi-process coordinates (rl.runtime.distributed)
      logging    LoggingConfig wandb mode, progress bar
      run_dir    str | None    where the run writes (default runs/<name>)

It round-trips through JSON exactly (`RunConfig.from_json(cfg.to_json()) == cfg`,
rl.runtime.config_tree), and any leaf can be replaced by its dotted path:

    cfg = RunConfig().override("loop.group_size", 4).override("async.max_staleness", 2)

Each section validates itself when built; `validate()` checks what spans sections (the
checks of rl.loops.validation: configs that cannot learn, and what a batch source cannot
run), once, before anything loads or compiles. The options that moved into the rollout
section keep their old paths as aliases (LEGACY_PATHS: "loop.segment_len" is
"rollout.segment_len"), in overrides and in saved run_config.json files. Presets (named RunConfig values), train(cfg)
and the run record live in rl.run.

Beside the config, a run takes two things that are not configuration: `Resume` (continue
the run dir's latest checkpoint, with what may differ) and `RunHooks` (an explicit device
mesh, XLA compiler options, callbacks).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from models.config import DTYPES
from models.decoder import LAYER_LOOPS
from rl.envs.latency import parse_latency
from rl.learner.config import TrainConfig
from rl.rollout.latr import LatrConfig
from rl.rollout.trace import TraceConfig
from rl.loops.async_config import (  # noqa: F401 - re-exported: the async section
    BACKENDS,
    MODES,
    PROXIMAL,
    ROLLOUTS,
    SNAPSHOT_STORES,
    AsyncConfig,
)
from rl.loops.episodes import ENV_PREFIX
from rl.loops.scheduling import SchedulerOptions
from rl.loops.validation import LEGACY_PATHS
from rl.rollout.pruning import PruneConfig
from rl.runtime import config_tree
from rl.runtime.distributed import DistributedConfig
from rl.runtime.host_memory import MALLOC_POLICIES
from rl.runtime.logging import WANDB_MODES

ALIASES = {"async": "asynchronous"}  # dotted-path spellings of sections


# ----------------------------------------------------------------------------- loop
@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """steps: total optimizer steps of the run (a resumed run continues up to it);
    prompts_per_step: groups per batch; group_size: samples per prompt; eval_every / eval_prompts: eval cadence and size
    (0 = no periodic eval; there is always one at the start and one at the end);
    eval_greedy: also run a greedy eval; save_every / keep_checkpoints: checkpoint cadence
    and how many to keep (0 = only at the end); dynamic_sampling: DAPO's filter (drop
    groups whose rewards are all equal, resample up to max_resample_rounds extra
    batches); seed: the run's seed (rollout rng, eval sampling); eval_sampled_prompts:
    how many of the eval prompts the sampled (train-temperature) eval pass uses (0 = all;
    the greedy pass always uses all); time_limit_s: wall-time budget of the run in
    seconds (0 = none): the step that crosses it is the last (eval and save as usual);
    checked: run the checked train step (rl.learner.checked: a non-finite reward,
    log-prob, loss or gradient stops the run naming the step and group);
    save_every_minutes: also checkpoint after the first step that ends this many minutes
    after the last save (0 = off), so a killed run loses little (both loops; all processes
    agree on the step, rl.runtime.preemption); env_step_timeout_s: an environment's time
    limit per call (a turn's step, reset, outcome; 0 = the environment's own
    `step_timeout_s`, if any) and episode_timeout_s: the wall-time limit of one episode (0
    = none): an episode past either ends with EndReason.TIMEOUT (rl.rollout.multiturn).
    max_concurrent_tool_calls: how many environment calls (tool calls) of different
    episodes run at once, on a pool of threads, while the other slots decode (0 = one
    after another on the rollout thread); tool_latency: a latency model added to every
    environment step ("", "fixed:S" or "lognormal:P50,P99", seconds; rl.envs.latency),
    to emulate a slow tool in benchmarks. park_after_s: free the slot of an episode whose
    tool call has run this many seconds for other episodes (it comes back, its history
    re-prefilled, when the call returns; needs the environment's kv_layout=replicated);
    -1 = never.
    host_malloc: how the host's C allocator returns
    freed memory (rl.runtime.host_memory: "default", or "lean" for a lower resident peak on
    CPU at some system time); it changes no computed value. eval_max_rows: rows an eval
    samples at once (0 = all its prompts in one batch); fewer bound the eval's KV cache
    (the same samples, rl.loops.evaluation). eval_clear_programs: drop every compiled program
    (jax.clear_caches) when an eval starts and when it ends, so the eval's sampler programs
    and the train step's are never resident together (a lower resident peak on CPU; the
    train step and its sampler compile again after each eval; no computed value changes).
    The rollouts' own options (segment length, decode loop, slots, dtype) are RunConfig's
    `rollout` section (RolloutOptions)."""

    steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 8
    eval_every: int = 25
    eval_prompts: int = 64
    eval_greedy: bool = False
    save_every: int = 0
    keep_checkpoints: int = 2
    dynamic_sampling: bool = False
    max_resample_rounds: int = 4
    seed: int = 0
    eval_sampled_prompts: int = 0
    time_limit_s: float = 0.0
    checked: bool = True
    save_every_minutes: float = 0.0
    env_step_timeout_s: float = 0.0
    episode_timeout_s: float = 0.0
    max_concurrent_tool_calls: int = 32
    tool_latency: str = ""
    park_after_s: float = -1.0
    host_malloc: str = "default"
    eval_max_rows: int = 0
    eval_clear_programs: bool = False

    def __post_init__(self):
        if self.host_malloc not in MALLOC_POLICIES:
            raise ValueError(f"LoopConfig.host_malloc must be one of {MALLOC_POLICIES}, got "
                             f"{self.host_malloc!r}")
        if not (isinstance(self.time_limit_s, (int, float)) and self.time_limit_s >= 0):
            raise ValueError(f"LoopConfig.time_limit_s must be >= 0 seconds (0 = no limit), "
                             f"got {self.time_limit_s!r}")
        for name in ("save_every_minutes", "env_step_timeout_s", "episode_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 \
                    or v == float("inf"):
                raise ValueError(f"LoopConfig.{name} must be a finite number >= 0 (0 = off), "
                                 f"got {v!r}")
        parse_latency(self.tool_latency)
        pk = self.park_after_s
        if isinstance(pk, bool) or not isinstance(pk, (int, float)) or not (pk == -1 or 0 <= pk < float("inf")):
            raise ValueError(f"LoopConfig.park_after_s must be -1 (never park) or seconds >= 0, "
                             f"got {pk!r}")
        for name, low in (("max_concurrent_tool_calls", 0), ("eval_sampled_prompts", 0), ("steps", 0), ("prompts_per_step", 1), ("group_size", 1),
                          ("eval_every", 0), ("eval_prompts", 1),
                          ("save_every", 0), ("keep_checkpoints", 1), ("max_resample_rounds", 0),
                          ("seed", 0), ("eval_max_rows", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"LoopConfig.{name} must be an int >= {low}, got {v!r}")
        for name in ("checked", "eval_clear_programs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoopConfig.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")


# ----------------------------------------------------------------------------- rollout
@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """The train rollouts' engine options; rl.loops.rollouts.rollout_spec builds the run's
    RolloutSpec from them once and hands it to every source, the producer and the evals.

    segment_len: decode tokens per sampler call (the granularity of weight swaps, APRIL's
    rounds and an environment's turns); layer_loop: "scan" or "unrolled" decode layers;
    bucket_slots: slot counts bucketed to powers of two up to 256 (fewer compiled programs
    across batch sizes); both give the same tokens, off by default. dtype: the rollouts'
    compute dtype (None: the model's, ModelConfig.dtype; "bfloat16" with a float32 model
    samples like a bf16 inference engine beside an fp32 learner: the params stay float32
    and are cast as each layer uses them, activations and the KV cache are bf16). The
    recorded behaviour log-probs μ are then the bf16 engine's, so π_prox/μ carries a real
    train/inference discrepancy (logged as mismatch_* when π_prox is the learner's: old_logp
    "current" / "proximal"; corrected by train.offpolicy). Evals sample at the model's dtype
    (they measure the learner's policy) and with the default decode options. The sampling
    temperature is train.temperature: the learner's log-probs are of softmax(logits / T) at
    the same T, so it has one home. The shapes (group size, prompt and response budgets)
    come from loop.group_size and the task."""

    segment_len: int = 32
    layer_loop: str = "scan"
    bucket_slots: bool = False
    dtype: str | None = None

    def __post_init__(self):
        s = self.segment_len
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"RolloutOptions.segment_len must be an int >= 1, got {s!r}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"RolloutOptions.layer_loop must be one of {LAYER_LOOPS}, got "
                             f"{self.layer_loop!r}")
        if not isinstance(self.bucket_slots, bool):
            raise ValueError(f"RolloutOptions.bucket_slots must be True or False, got "
                             f"{self.bucket_slots!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"RolloutOptions.dtype must be None (the model's dtype) or one of "
                             f"{DTYPES}, got {self.dtype!r}")


def migrate_dict(data: Mapping[str, Any]) -> dict:
    """A RunConfig dict with its LEGACY_PATHS fields moved to where they live now."""
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for old, new in LEGACY_PATHS.items():
        (sec, name), (new_sec, new_name) = old.split("."), new.split(".")
        if isinstance(data.get(sec), dict) and name in data[sec]:
            data.setdefault(new_sec, {})
            data[new_sec].setdefault(new_name, data[sec].pop(name))
    return data



# ----------------------------------------------------------------------------- run
def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """name: "tiny" (random init of models.config's "tiny" preset, vocabulary sized to the
    task: token-level tasks only) or what models.assets.load_model reads (a registered
    name such as "smollm2-135m", a .gguf file, a Hugging Face directory); init_seed: added
    to the run's seed for the random init."""

    name: str = "tiny"
    init_seed: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name must be a non-empty string, got {self.name!r}")
        _check_int("ModelSpec.init_seed", self.init_seed, 0)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """spec: an rl.tasks.make_task spec ("synthetic", "reasoning_gym:chain_sum", a mixture
    "reasoning_gym:chain_sum=1,leg_counting=1") or "env:NAME" for an rl.envs environment;
    options: the task's (or environment's) keyword options, a mapping frozen to sorted
    pairs (an environment's also carry the episode options turn_credit, turn_credit_coef,
    turn_credit_gamma, kv_layout, episode_mode); seed: the train / eval split seed (None:
    the run's loop.seed, so each seed sees its own split)."""

    spec: str = "synthetic"
    options: Any = ()
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"TaskSpec.spec must be a non-empty string, got {self.spec!r}")
        items = self.options.items() if isinstance(self.options, Mapping) else self.options
        try:
            frozen = tuple(sorted((str(k), config_tree.deep_tuple(v)) for k, v in items))
        except (TypeError, ValueError) as err:
            raise ValueError(f"TaskSpec.options must be a mapping of option name to value, got "
                             f"{self.options!r}") from err
        object.__setattr__(self, "options", frozen)
        if self.seed is not None:
            _check_int("TaskSpec.seed", self.seed, 0)

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def is_env(self) -> bool:
        return self.spec.startswith(ENV_PREFIX)


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """verifier: what the task's "correct" reward is, passed to the task as its `verifier`
    option (None: the task's default: "strict" for reasoning-gym, "math" for a file task):
    "exact", "numeric", "math", "regex" (rl.tasks.verifiers) or, for reasoning-gym,
    "strict" / "dataset"; tolerance: the numeric verifier's (None: the task's default);
    function: a reward function of your own (rl.tasks.rewards): "module:function",
    "path/to/file.py:function" or a name given to rl.tasks.rewards.register_reward (a
    callable passed as RunConfig(reward=fn) is registered and stored by that name);
    timeout_s: the time limit of one call of the function."""

    verifier: str | None = None
    function: str | None = None
    timeout_s: float = 10.0
    tolerance: float | None = None

    def __post_init__(self):
        for name in ("verifier", "function"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"RewardConfig.{name} must be None or a non-empty string, got "
                                 f"{value!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"RewardConfig.timeout_s must be a number of seconds > 0, got {t!r}")
        tol = self.tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                or not tol >= 0):
            raise ValueError(f"RewardConfig.tolerance must be None or a number >= 0, got {tol!r}")

    @property
    def task_options(self) -> dict[str, Any]:
        """The options it sets on the task (verifier, tolerance)."""
        return {k: v for k, v in (("verifier", self.verifier), ("tolerance", self.tolerance))
                if v is not None}


def as_reward_config(reward: Any) -> RewardConfig:
    """A RewardConfig from a RewardConfig, None (the default), a spec string (the
    function) or a callable (registered: rl.tasks.rewards.reward_spec)."""
    if isinstance(reward, RewardConfig):
        return reward
    if reward is None:
        return RewardConfig()
    if isinstance(reward, str):
        return RewardConfig(function=reward)
    if callable(reward):
        from rl.tasks.rewards import reward_spec

        return RewardConfig(function=reward_spec(reward))
    raise ValueError(f"RunConfig.reward must be a RewardConfig, a reward function or its spec "
                     f"'module:function', got {type(reward).__name__}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """wandb: "offline" (files in the run dir), "online" or "disabled"; progress: a tqdm bar."""

    wandb: str = "disabled"
    progress: bool = True

    def __post_init__(self):
        if self.wandb not in WANDB_MODES:
            raise ValueError(f"LoggingConfig.wandb must be one of {WANDB_MODES}, got {self.wandb!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"LoggingConfig.progress must be True or False, got {self.progress!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run (module docstring). Build it from a preset (rl.run.PRESETS) and
    override by dotted path, or field by field; `validate()` before running. Shorthands:
    model="NAME|FILE.gguf|HF_DIR" (a ModelSpec), task="SPEC" (a TaskSpec), reward=fn or
    "module:function" (a RewardConfig with that function)."""

    name: str = "custom"
    description: str = ""
    model: ModelSpec = ModelSpec()
    task: TaskSpec = TaskSpec()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    loop: LoopConfig = LoopConfig()
    rollout: RolloutOptions = RolloutOptions()
    asynchronous: AsyncConfig | None = None
    scheduler: SchedulerOptions = SchedulerOptions()
    prune: PruneConfig | None = None
    latr: LatrConfig | None = None
    trace: TraceConfig | None = None
    mesh: str | None = None
    distributed: DistributedConfig = DistributedConfig()
    logging: LoggingConfig = LoggingConfig()
    run_dir: str | None = None
    headline_target: float | None = None

    def __post_init__(self):
        if isinstance(self.run_dir, Path):
            object.__setattr__(self, "run_dir", str(self.run_dir))
        if isinstance(self.model, (str, Path)):
            object.__setattr__(self, "model", ModelSpec(str(self.model)))
        if isinstance(self.task, str):
            object.__setattr__(self, "task", TaskSpec(self.task))
        object.__setattr__(self, "reward", as_reward_config(self.reward))
        for name, cls in (("model", ModelSpec), ("task", TaskSpec), ("train", TrainConfig),
                          ("loop", LoopConfig), ("rollout", RolloutOptions),
                          ("scheduler", SchedulerOptions),
                          ("distributed", DistributedConfig), ("logging", LoggingConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"RunConfig.{name} must be a {cls.__name__}, got "
                                 f"{type(getattr(self, name)).__name__}")
        for name, cls in (("asynchronous", AsyncConfig), ("prune", PruneConfig),
                          ("latr", LatrConfig), ("trace", TraceConfig)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"RunConfig.{name} must be a {cls.__name__} or None, got "
                                 f"{type(value).__name__}")
        for name in ("name", "description"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"RunConfig.{name} must be a string, got {getattr(self, name)!r}")
        if self.mesh is not None and not isinstance(self.mesh, str):
            raise ValueError(f"RunConfig.mesh must be a mesh preset name or 'data=N,fsdp=N,"
                             f"tensor=N', got {self.mesh!r}")

    # ------------------------------------------------------------------ data
    def to_dict(self) -> dict:
        return config_tree.to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        return config_tree.from_dict(cls, migrate_dict(data))

    def to_json(self) -> str:
        return config_tree.to_json(self)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> Path:
        """Write the JSON to `path` (a file, or a run dir: its run_config.json), atomically."""
        from rl.runtime.logging import atomic_write_bytes

        path = Path(path)
        if path.is_dir():
            path = path / RUN_CONFIG_FILE
        atomic_write_bytes(path, self.to_json().encode())
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """The RunConfig in a JSON file, or a run dir's run_config.json (then run_dir is
        that directory, wherever the run was made)."""
        path = Path(path)
        is_dir = path.is_dir()
        file = path / RUN_CONFIG_FILE if is_dir else path
        if not file.is_file():
            raise FileNotFoundError(f"{str(file)!r} not found: a run dir made by rl.run.train "
                                    "(or python -m experiments.train) holds run_config.json")
        cfg = cls.from_json(file.read_text())
        return dataclasses.replace(cfg, run_dir=str(path)) if is_dir else cfg

    def override(self, path: str, value: Any) -> RunConfig:
        """A copy with the leaf at dotted `path` set to `value` (config_tree.override;
        "async." is accepted for "asynchronous.", and setting a field of an absent
        section such as asynchronous or prune turns it on with its defaults)."""
        return config_tree.override(self, LEGACY_PATHS.get(path, path), value, ALIASES)

    def overrides(self, assignments: Mapping[str, Any] | Sequence[str]) -> RunConfig:
        """override() for every {path: value} item or "path=value" string at once (each
        section rebuilt once with all its new fields: config_tree.override_many)."""
        items = (list(assignments.items()) if isinstance(assignments, Mapping)
                 else [config_tree.parse_assignment(a) for a in assignments])
        items = [(LEGACY_PATHS.get(p, p), v) for p, v in items]
        return config_tree.override_many(self, items, ALIASES)

    # ------------------------------------------------------------------ checks
    @property
    def output_dir(self) -> Path:
        """run_dir, or runs/<name> when none is set."""
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    def validate(self) -> RunConfig:
        """ConfigError / ValueError (saying what to change) for a run that cannot learn or
        that its batch source cannot run (rl.loops.validation.validate_config); returns self.
        Made once, before any model loads (rl.run.prepare, rl.loops.run)."""
        from rl.loops.validation import validate_config

        validate_config(self)
        return self


RUN_CONFIG_FILE = "run_config.json"


@dataclasses.dataclass(frozen=True)
class Resume:
    """Continue the run dir's latest checkpoint: from_last_good skips a checkpoint that
    fails verification for the one before; allow_changes names the loop fields
    (rl.loops.validation.CHANGEABLE_ON_RESUME) that may differ from the checkpoint's
    record (steps and the time limit always may)."""

    from_last_good: bool = False
    allow_changes: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "allow_changes", tuple(self.allow_changes))


def as_resume(resume: bool | Resume | None) -> Resume | None:
    """Resume() for True, None for False / None, a Resume as given."""
    if isinstance(resume, Resume):
        return resume
    if resume is None or resume is False:
        return None
    if resume is True:
        return Resume()
    raise ValueError(f"resume must be True, False or a Resume, got {resume!r}")


@dataclasses.dataclass
class RunHooks:
    """What a run is handed that is not configuration: mesh (a jax Mesh used instead of
    RunConfig.mesh), compiler_options (XLA options of the train step), on_eval(record)
    after each eval, on_step(record) after each train record (raise KeyboardInterrupt
    there to stop the run as Ctrl-C does)."""

    mesh: jax.sharding.Mesh | None = None
    compiler_options: dict | None = None
    on_eval: Callable[[dict], Any] | None = None
    on_step: Callable[[dict], Any] | None = None
