"""The prompt scheduler (rl.schedulers) inside the synchronous loop: which train prompts
a step samples, how many groups each gets (DARS), the replayed groups mixed in (rollout
replay, rl.loops.replay), and the rewards the scheduler learns from.

    options = SchedulerOptions("dps", pool_size=256, replay_fraction=0.5)
    source = make_prompt_source(options, task, loop, params, config=train_config)
    prompts, data_position = source.next(step, data_position)   # the step's prompts
    source.record(prompts, group_rewards)   # their "correct" rewards (else weighted totals)
    groups, state, data_position, stats = source.sample_batch(step, state, data_position,
                                                              draw)   # DARS / replay

"uniform" takes the next prompts_per_step prompts of the train stream from the data
position, exactly as the loop always did (same prompts, same order: bit-identical runs).
"dps" and "dots" choose among a fixed pool, the first `pool_size` prompts of the train
stream (prompt id = stream position), so a prompt's history accumulates; the data
position still advances by the prompts consumed per step. DOTS's frozen encoder here is
the mean of the initial policy's input-embedding rows over the prompt's tokens. At the
start of each DOTS selection round (every μ = `selection_interval` steps) `measure`
rolls out its random reference set of K = `reference_size` pool prompts (default μ·B/4,
the official script's ratio K / (μ·B) = 256 / (2·512)) with the current policy; those
groups only measure difficulty (never trained on) and their tokens count in the step's
sampled tokens (`reference_groups` in the stats).

"dars" in the loop: the learner's batch holds contiguous groups of one fixed group_size
N, so DARS's stage-2 rollouts come in whole groups: the extra budget E = T − B·N (T =
`dars_budget` rollouts per step, default 2·B·N, a multiple of N) is apportioned in E/N
blocks of N (DarsConfig.unit = N), and each block is one more group of N rollouts of the
same hard prompt, normalised on its own (Â within the block). Every batch then has the
fixed shape T/N groups (one compiled step); the stage-1 groups come first, in stream
order, then the extra groups in prompt order. (Pooling a prompt's n + Δn rollouts into
one variable-size group, as the official trainer does, would need variable group sizes in
the learner.)

Rollout replay (`replay_fraction` α > 0, any scheduler but dars): k = min(round(α·B),
|buffer|, B − 1) of the B groups come from the replay buffer, B − k are sampled fresh
(the scheduler's first B − k prompts; the data position advances by B − k); see
rl.loops.replay for the buffer and the off-policy correction the TrainConfig must carry.

Everything a run needs to decide the same way after a resume (the scheduler's state and
the replay buffer's groups) is `PromptSource.state()`, which the loop saves with every
checkpoint; randomness comes from default_rng([seed, step]).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rl.loops.buffer import ScoredGroup
from rl.loops.scoring import accuracy_name, zero_spread_fraction
from rl.loops.replay import (
    ReplayBuffer,
    check_replay_correction,
    replay_count,
)
from rl.schedulers import SCHEDULERS, PromptScheduler, make_scheduler
from rl.schedulers.dars import SCHEDULES, DarsConfig
from rl.tasks.base import Prompt, Task

LOOP_SCHEDULERS = SCHEDULERS

# draw(state, prompts) -> (one ScoredGroup per prompt, their scheduler rewards [N] each,
# sampled response tokens, state with advanced rng): the loop's sample-and-score
Draw = Callable[[Any, Sequence[Prompt]], tuple[list[ScoredGroup], list[np.ndarray], int, Any]]


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
    """name: "uniform" | "dots" | "dps" | "dars"; pool_size: the candidate pool (dots, dps);
    reference_size: DOTS's K (0 = max(1, μ·B/4)); selection_interval: DOTS's μ;
    temperature: DOTS's τ; forgetting: DPS's λ; dars_budget: DARS's T, rollouts
    per step in both stages (0 = 2 · prompts_per_step · group_size; a multiple of
    group_size); dars_schedule: "et" | "hw"; replay_fraction: rollout replay's α (0 =
    off); replay_capacity: the replay FIFO's C groups (0 = 4 · prompts_per_step)."""

    name: str = "uniform"
    pool_size: int = 256
    reference_size: int = 0
    selection_interval: int = 2
    temperature: float = 1e-3
    forgetting: float = 0.7
    dars_budget: int = 0
    dars_schedule: str = "et"
    replay_fraction: float = 0.0
    replay_capacity: int = 0

    def __post_init__(self):
        if self.name not in SCHEDULERS:
            raise ValueError(f"unknown prompt scheduler {self.name!r}; available: "
                             f"{list(SCHEDULERS)}")
        for field, low in (("pool_size", 1), ("reference_size", 0), ("selection_interval", 1),
                           ("dars_budget", 0), ("replay_capacity", 0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"SchedulerOptions.{field} must be an int >= {low}, got {v!r}")
        if self.name == "dots" and self.reference_size > self.pool_size:
            raise ValueError(f"SchedulerOptions.reference_size {self.reference_size} exceeds "
                             f"pool_size {self.pool_size}")
        if self.dars_schedule not in SCHEDULES:
            raise ValueError(f"SchedulerOptions.dars_schedule must be one of {SCHEDULES}, got "
                             f"{self.dars_schedule!r}")
        f = self.replay_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise ValueError(f"SchedulerOptions.replay_fraction (--replay-fraction) must be in "
                             f"[0, 1): at least one group of every batch is fresh; got {f!r}")
        if self.name == "dars" and f > 0:
            raise ValueError("rollout replay with the dars scheduler is not supported (DARS's "
                             "budget counts fresh rollouts); drop --replay-fraction or dars")

    def batch_rows(self, prompts_per_step: int, group_size: int) -> int:
        """Rows of the learner's batch per step: B·N, or DARS's budget T (both stages)."""
        if self.name == "dars":
            return DarsConfig(prompts_per_step=prompts_per_step, group_size=group_size,
                              budget=self.dars_budget, unit=group_size).budget
        return prompts_per_step * group_size

    @property
    def is_default(self) -> bool:
        """uniform without replay: today's loop, which keeps no scheduler state."""
        return self.name == "uniform" and self.replay_fraction == 0


def prompt_embeddings(params: Any, prompts: Sequence[Prompt]) -> np.ndarray:
    """[P, h] float64: the mean input-embedding row over each prompt's token ids."""
    try:
        table = np.asarray(params["embed"]["embedding"], np.float64)
    except (KeyError, TypeError):
        raise ValueError("dots in the loop embeds prompts with the policy's input embedding "
                         "params['embed']['embedding'], which these params lack") from None
    return np.stack([table[np.asarray(p.ids, np.int64)].mean(axis=0) for p in prompts])


class PromptSource:
    """A scheduler bound to a task's train stream, with the optional replay buffer (see
    the module docstring)."""

    def __init__(self, scheduler: PromptScheduler, task: Task, prompts_per_step: int,
                 pool: list[Prompt] | None, replay: ReplayBuffer | None = None,
                 replay_fraction: float = 0.0, seed: int = 0):
        self.scheduler, self.task, self.pool = scheduler, task, pool
        self.prompts_per_step = prompts_per_step
        self.replay, self.replay_fraction, self.seed = replay, float(replay_fraction), seed

    def measure(self, step: int, state: Any, draw: Draw) -> tuple[Any, int, dict]:
        """Roll out the prompts the scheduler asks to measure this step (DOTS's reference
        set; not trained on) and give it their rewards: (state, sampled tokens, stats;
        stats = {"reference_groups": groups rolled out} for DOTS, else {})."""
        ids = [] if self.pool is None else self.scheduler.measure(step, range(len(self.pool)))
        tokens = 0
        if ids:
            _, signal, tokens, state = draw(state, [self.pool[i] for i in ids])
            self.scheduler.update(ids, signal)
        return state, tokens, ({"reference_groups": len(ids)}
                               if self.scheduler.name == "dots" else {})

    @property
    def mixes_batches(self) -> bool:
        """True when a batch is more than the step's B fresh groups (DARS, replay)."""
        return self.scheduler.name == "dars" or self.replay is not None

    def groups_per_step(self, group_size: int) -> int:
        """Groups in every learner batch: T / N for dars, else prompts_per_step."""
        if self.scheduler.name == "dars":
            return self.scheduler.config.budget // group_size
        return self.prompts_per_step

    def next(self, step: int, data_position: int, count: int | None = None
             ) -> tuple[list[Prompt], int]:
        """The step's prompts (in the scheduler's order; its first `count`, default all
        prompts_per_step) and the data position advanced by that many."""
        b = self.prompts_per_step
        count = b if count is None else int(count)
        if self.pool is None:
            stream = self.task.train_prompts(data_position, b)
            plan = self.scheduler.select(step, [p.index for p in stream])
            by_id = {p.index: p for p in stream}
        else:
            plan = self.scheduler.select(step, list(range(len(self.pool))))
            by_id = dict(enumerate(self.pool))
        group_size = self.scheduler.config.group_size
        if len(plan) != b or any(n != group_size for _, n in plan):
            raise ValueError(f"scheduler {self.scheduler.name!r} planned {plan}; the loop "
                             f"needs {b} prompts of {group_size} rollouts each")
        return [by_id[pid] for pid, _ in plan[:count]], data_position + count

    def record(self, prompts: Sequence[Prompt], rewards: Sequence[np.ndarray]) -> None:
        self.scheduler.update([p.index for p in prompts], rewards)

    def sample_batch(self, step: int, state: Any, data_position: int, draw: Draw
                     ) -> tuple[list[ScoredGroup], Any, int, dict]:
        """One learner batch of groups_per_step groups: the fresh groups (scheduler's
        prompts, sampled by `draw`, rewards recorded), then DARS's extra groups or the
        replayed ones; the fresh groups then enter the replay buffer. Returns (groups,
        state, data position, stats) like rl.loops.sync.sample_batch_groups."""
        n, b = self.scheduler.config.group_size, self.prompts_per_step
        k = 0 if self.replay is None else replay_count(self.replay_fraction, b, len(self.replay))
        state, ref_tokens, ref_stats = self.measure(step, state, draw)
        prompts, data_position = self.next(step, data_position, b - k)
        groups, signal, tokens, state = draw(state, prompts)
        tokens += ref_tokens
        self.record(prompts, signal)
        fresh_zero = zero_spread_fraction(np.concatenate(signal), n)
        stats = {"fresh_groups": len(groups), "fresh_zero_spread_frac": fresh_zero,
                 **ref_stats}
        if self.scheduler.name == "dars":
            by_id = {p.index: p for p in prompts}
            extra = [by_id[pid] for pid, m in self.scheduler.follow_up(step)
                     for _ in range(m // n)]
            if extra:
                more, _, more_tokens, state = draw(state, extra)
                groups, tokens = groups + more, tokens + more_tokens
            stats["dars_extra_groups"] = len(extra)
        if self.replay is not None:
            replayed = self.replay.sample(k, np.random.default_rng([self.seed, step]))
            self.replay.push(groups, step)
            groups = groups + replayed
            stats.update(replayed_groups=k, **self.replay.stats())
        expected = self.groups_per_step(n)
        if len(groups) != expected:
            raise ValueError(f"scheduler {self.scheduler.name!r} gave {len(groups)} groups; "
                             f"the batch needs {expected}")
        stats.update(sampled_tokens=tokens, resample_rounds=0, kept_groups=len(groups))
        return groups, state, data_position, stats

    def state(self) -> dict[str, Any]:
        """The scheduler's state, plus the replay buffer's under "replay" (JSON)."""
        out = dict(self.scheduler.state())
        if self.replay is not None:
            out["replay"] = self.replay.state()
        return out

    def restore(self, state: dict[str, Any]) -> None:
        state = dict(state)
        replay = state.pop("replay", None)
        if (replay is None) != (self.replay is None):
            raise ValueError("the checkpoint's scheduler state and this run disagree on rollout "
                             "replay (--replay-fraction); resume with the run's own settings")
        self.scheduler.restore(state)
        if replay is not None:
            self.replay.restore(replay)


def make_prompt_source(options: SchedulerOptions, task: Task, loop: Any, params: Any,
                       seed: int = 0, config: Any = None) -> PromptSource:
    """The PromptSource of `options` for a LoopConfig-like `loop` (prompts_per_step,
    group_size); `params`: the initial policy (DOTS's embeddings); `config`: the
    TrainConfig (checked: replay needs an off-policy correction, DARS's batch must split
    into its micro-batches)."""
    b, n = loop.prompts_per_step, loop.group_size
    if not options.is_default and (loop.dynamic_sampling or jax.process_count() > 1):
        what = options.name if options.name != "uniform" else "replay"
        raise ValueError(f"the {what!r} prompt scheduler runs without dynamic "
                         "sampling, in one process; drop one of them")
    replay = None
    if options.replay_fraction > 0:
        if config is not None:
            check_replay_correction(config)
        replay = ReplayBuffer(options.replay_capacity or 4 * b,
                              accuracy_name=accuracy_name(task.reward_names))
    extra = {"replay": replay, "replay_fraction": options.replay_fraction, "seed": seed}
    if options.name == "uniform":
        return PromptSource(make_scheduler("uniform", prompts_per_step=b, group_size=n),
                            task, b, None, **extra)
    if options.name == "dars":
        sched = make_scheduler("dars", prompts_per_step=b, group_size=n,
                               budget=options.dars_budget, schedule=options.dars_schedule,
                               unit=n)
        groups = sched.config.budget // n
        if config is not None and groups % config.micro_batches:
            raise ValueError(f"dars: the batch of {groups} groups (dars_budget / group_size) "
                             f"does not split into micro_batches={config.micro_batches}")
        return PromptSource(sched, task, b, None, **extra)
    if options.pool_size < b:
        raise ValueError(f"SchedulerOptions.pool_size {options.pool_size} is below "
                         f"prompts_per_step {b}")
    pool = task.train_prompts(0, options.pool_size)
    if options.name == "dps":
        sched = make_scheduler("dps", prompts_per_step=b, group_size=n,
                               forgetting=options.forgetting, seed=seed)
    else:
        mu = options.selection_interval
        if mu * b > options.pool_size:
            raise ValueError(f"dots: a selection round takes selection_interval * "
                             f"prompts_per_step = {mu * b} distinct prompts, the pool has "
                             f"{options.pool_size}; raise pool_size or lower the interval")
        sched = make_scheduler("dots", embeddings=prompt_embeddings(params, pool),
                               reference_size=options.reference_size or max(1, mu * b // 4),
                               selection_interval=mu, prompts_per_step=b, group_size=n,
                               temperature=options.temperature, seed=seed)
    return PromptSource(sched, task, b, pool, **extra)
