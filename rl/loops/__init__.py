"""The loops that wire rollout and learner together.

    config        RunConfig: the whole run's configuration as one tree of frozen
                  dataclasses (LoopConfig, AsyncConfig and the other sections), its JSON
                  round trip, dotted overrides and cross-section checks; Resume, RunHooks
    sync          the synchronous GRPO loop: run(model_config, params, task, config, *,
                  resume, hooks) (sample -> score -> batch -> step, eval, checkpoints,
                  metrics) and its reusable pieces
    asynchronous  run_async(...) with the same parameters: producer and learner under a staleness bound η, threaded
                  or deterministic, with APRIL rollouts and exact proximal log-probs
    async_stages  run_async's stages in order (split_devices, prepare, start, take_batch,
                  build_train_batch, update_learner, record_step, evaluate_and_save, the
                  fault and shutdown paths) and AsyncRun, the state they share
    side_files    the files beside each async checkpoint: the param ring, APRIL's state
    producer      the asynchronous loop's rollout thread and APRIL source
    buffer        TrajectoryBuffer: scored groups between producer and learner (AReaL's
                  admission rule, staleness policies)
    rollouts      sample_groups: N samples per prompt through the rollout engine (or an
                  environment's episodes), take_rows, an environment's time limits,
                  rollout_model_config (the sampler's compute dtype)
    evaluator     the evaluation pass: eval_report (samples and builds the report),
                  evaluate (its flat metrics), make_evaluator (the loops' periodic eval)
    evaluation    the statistics of an evaluation report (accuracy ± stderr, pass@k,
                  lengths, truncation) and the train batch's zero-spread fraction
    context       open_run / RunContext: what both loops set up (validated configs, the
                  run dir's lock, state fresh or from the last good checkpoint, logger,
                  the checked jitted step) and release
    scheduling    the prompt scheduler (rl.schedulers) between the train stream and the
                  sync loop's sampling: SchedulerOptions, make_prompt_source (DARS's
                  extra groups, the replayed groups)
    replay        rollout replay: the FIFO of recent informative scored groups mixed into
                  each batch at a fraction, with the behaviour-policy clipped ratio
    scoring       score (a task's rewards of sampled rows, validated; an environment's
                  outcomes) and total_reward
    episodes      environments in the loops: EnvTask (an rl.envs environment as a task),
                  multi-turn sampling, outcome rewards, turn credit, episode metrics
    validation    configs that cannot learn or run (validate_run), the config record every
                  checkpoint carries and the resume check against it

May import anything in `rl` but rl.run; only rl.run and experiments import `rl.loops`.

    from rl.loops import RunConfig, run, run_async
    run(model_config, params, task, RunConfig(loop=LoopConfig(steps=10), run_dir="runs/a"))
"""
from rl.loops.buffer import STALE_POLICIES, ScoredGroup, TrajectoryBuffer  # noqa: I001
from rl.loops.config import AsyncConfig, LoopConfig, Resume, RunConfig, RunHooks
from rl.loops.evaluator import eval_report, evaluate
from rl.loops.rollouts import rollout_model_config, sample_groups
from rl.loops.scoring import score
from rl.loops.sync import RunResult, build_batch, collect_batch, run, sample_batch_groups
from rl.loops.asynchronous import run_async, train_config_for
from rl.loops.scheduling import SchedulerOptions

__all__ = [
    "STALE_POLICIES", "ScoredGroup", "TrajectoryBuffer", "LoopConfig", "Resume", "RunConfig",
    "RunHooks", "RunResult", "build_batch",
    "collect_batch", "eval_report", "evaluate", "run", "rollout_model_config",
    "sample_batch_groups", "sample_groups", "score",
    "AsyncConfig", "run_async", "train_config_for", "SchedulerOptions",
]
