"""The run harness and the batch sources it asks for each step's groups.

    runner        run(model_config, params, task, config, *, resume, hooks): the harness
                  over the source the config picks; run_async (the same, async set);
                  make_source
    harness       run_loop: open the run, the step-0 eval, the step loop and its profile,
                  the step boundary (stop signal, eval and save cadence, time-based saves,
                  time limit, on_step), faults and teardown, the RunResult
    source        the BatchSource protocol (and its defaults) and Taken, a step's groups
    sync          SyncSource: every step sampled at the learner's params (schedulers,
                  replay, pruning, dynamic sampling, environments)
    deterministic DeterministicSource: step v sampled with the param ring's version
                  max(v − η, 0) (static: what the sync source samples; or APRIL rounds)
    threaded      ThreadedSource: a producer thread and the buffer (static, continuous,
                  APRIL rollouts), in-flight weight updates
    ray_workers   RaySource: the deterministic schedule sampled by Ray rollout-worker
                  processes while the learner trains (async.backend = "ray"; optional);
                  RayStreamSource: the same workers streaming with the newest version
                  under the buffer's admission rule (mode "threaded")
    asynchronous  what the async sources share: ring, buffer, publishing, proximal
                  log-probs (exact / EWMA), APRIL's source, side files; train_config_for
    producer      the producer thread's work (RolloutProducer), APRIL rounds over the
                  stream (AprilSource), APRIL's off-policy prefix mask
    shared_engine SharedEngine: a Ray worker's concurrent continuous requests in one
                  engine (a slot a finished group frees takes any request's next prompt)
    buffer        TrajectoryBuffer: scored groups between producer and learner (AReaL's
                  admission rule, staleness policies)
    batches       StreamSampler and sample_batch_groups (a step's groups from the train
                  stream), build_batch (groups -> TrainBatch), collect_batch
    rollouts      RolloutSpec (what a run's rollouts share, built once), sample_groups
                  (N samples per prompt through the engine, or an environment's episodes),
                  take_rows, rollout_seed, rollout_model_config
    trace_rollouts TRACE's two-stage batch of episodes (roots, then the roots / turn
                  prefixes the predictor scores most mixed), its counts and metrics
    evaluation    the evaluation pass (eval_report, eval_metrics, make_evaluator) and its
                  statistics (accuracy ± stderr, pass@k, lengths, truncation)
    scoring       score (a task's rewards of sampled rows, validated), total_reward, the
                  reward-spread metrics
    context       open_run / RunContext: the run dir's lock, state fresh or restored,
                  logger, the checked jitted step; resolve_mesh, run_clock
    scheduling    the prompt scheduler (rl.schedulers) over the train stream: SchedulerOptions,
                  make_prompt_source (DARS's extra groups, the replayed groups)
    replay        rollout replay: the FIFO of recent informative scored groups
    episodes      environments in the loops: EnvTask, multi-turn sampling, outcome rewards,
                  turn credit, episode metrics
    config        RunConfig: the whole run as one tree of frozen dataclasses; Resume, RunHooks
    async_config  AsyncConfig: the asynchronous section (η, mode, rollouts, proximal, backend)
    validation    configs that cannot learn or run, the config record every checkpoint
                  carries and the resume check against it
    side_files    the files beside each async checkpoint: the param ring, APRIL's state
    adapters      LoRA runs: the frozen base, the sampler's composed params

May import anything in `rl` but rl.run; only rl.run and experiments import `rl.loops`.

    from rl.loops import RunConfig, run
    run(model_config, params, task, RunConfig(loop=LoopConfig(steps=10), run_dir="runs/a"))
"""
from rl.loops.buffer import STALE_POLICIES, ScoredGroup, TrajectoryBuffer  # noqa: I001
from rl.loops.config import AsyncConfig, LoopConfig, Resume, RolloutOptions, RunConfig, RunHooks
from rl.loops.evaluation import ReportOptions, eval_metrics, eval_report
from rl.loops.rollouts import RolloutSpec, rollout_model_config, rollout_spec, sample_groups
from rl.loops.scoring import score
from rl.loops.batches import StreamSampler, build_batch, collect_batch, sample_batch_groups
from rl.loops.source import BatchSource, Taken
from rl.loops.harness import RunResult, run_loop
from rl.loops.asynchronous import train_config_for
from rl.loops.runner import make_source, run, run_async
from rl.loops.scheduling import SchedulerOptions

__all__ = [
    "STALE_POLICIES", "ScoredGroup", "TrajectoryBuffer", "AsyncConfig", "LoopConfig", "Resume",
    "RolloutOptions",
    "RunConfig", "RunHooks", "ReportOptions", "eval_metrics", "eval_report", "RolloutSpec",
    "rollout_model_config", "rollout_spec", "sample_groups", "score", "StreamSampler",
    "build_batch", "collect_batch", "sample_batch_groups", "BatchSource", "Taken", "RunResult",
    "run_loop", "train_config_for", "make_source", "run", "run_async", "SchedulerOptions",
]
