"""The loops that wire rollout and learner together.

    sync          the synchronous GRPO loop: run(...) (sample -> score -> batch -> step,
                  eval, checkpoints, metrics) and its reusable pieces
    asynchronous  run_async(...): producer and learner under a staleness bound η, threaded
                  or deterministic, with APRIL rollouts and exact proximal log-probs
    producer      the asynchronous loop's rollout thread and APRIL source
    buffer        TrajectoryBuffer: scored groups between producer and learner (AReaL's
                  admission rule, staleness policies)
    evaluation    the statistics of an evaluation report (accuracy ± stderr, pass@k,
                  lengths, truncation) and the train batch's zero-spread fraction;
                  sync.eval_report samples and builds the report
    context       open_run / RunContext: what both loops set up (validated configs, the
                  run dir's lock, state fresh or from the last good checkpoint, logger,
                  the checked jitted step) and release
    scheduling    the prompt scheduler (rl.schedulers) between the train stream and the
                  sync loop's sampling: SchedulerOptions, make_prompt_source
    scoring       score (a task's rewards of sampled rows, validated; an environment's
                  outcomes) and total_reward, re-exported by sync
    episodes      environments in the loops: EnvTask (an rl.envs environment as a task),
                  multi-turn sampling, outcome rewards, turn credit, episode metrics
    validation    configs that cannot learn or run (validate_run), the config record every
                  checkpoint carries and the resume check against it

May import anything in `rl` (the top of the import direction); nothing imports `rl.loops`
except `experiments`.

    from rl.loops import LoopConfig, run, AsyncConfig, run_async
"""
from rl.loops.buffer import STALE_POLICIES, ScoredGroup, TrajectoryBuffer  # noqa: I001
from rl.loops.sync import (LoopConfig, RunResult, build_batch, collect_batch, eval_report,
                           evaluate, run, sample_batch_groups, sample_groups, score)
from rl.loops.asynchronous import AsyncConfig, run_async, train_config_for
from rl.loops.scheduling import SchedulerOptions

__all__ = [
    "STALE_POLICIES", "ScoredGroup", "TrajectoryBuffer", "LoopConfig", "RunResult", "build_batch",
    "collect_batch", "eval_report", "evaluate", "run", "sample_batch_groups", "sample_groups",
    "score",
    "AsyncConfig", "run_async", "train_config_for", "SchedulerOptions",
]
