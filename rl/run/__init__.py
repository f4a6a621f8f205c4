"""The run layer: a whole experiment from one config, as the command line and a notebook
both run it.

    config      RunConfig and its sections live in rl.loops.config (the loops take it);
                re-exported here with Resume and RunHooks
    presets     PRESETS: named RunConfig values (tiny-synthetic, smollm2-rg, tiny-guess,
                smollm2-calc), get_preset, register
    policy      load_policy(cfg) -> (model_config, params, task), after the model, prompt
                file and reward checks; make_task (a task or an "env:NAME" environment);
                check_context
    plan        format_plan / estimate_memory: what a run will do and the memory it needs
    launch      train(cfg, resume=False, hooks=None) -> RunResult (sync or async by the
                config): validate, run-dir checks, the run record, the loop, summary.json
    record      the run record (model.json, run_config.json) and load_run(run_dir) ->
                RunPolicy (a checkpoint's params, LoRA adapters merged, the tokenizer)
    evaluation  evaluate(run dir | RunConfig | model) -> the eval report; format_report
    summary     summarize / format_summary: a finished run's headline, curves, profile

    from rl.run import PRESETS, RunConfig, train, evaluate
    cfg = PRESETS["tiny-synthetic"].override("loop.steps", 50)
    result = train(cfg)
    evaluate(result.run_dir)

The top of the import direction inside rl: may import every rl subpackage, models and
kernels; nothing in rl imports rl.run (experiments/ does).
"""
from rl.loops.config import (  # noqa: I001
    AsyncConfig, LoggingConfig, LoopConfig, ModelSpec, Resume, RewardConfig, RolloutOptions,
    RunConfig, RunHooks,
    TaskSpec)
from rl.loops.harness import RunResult
from rl.run.presets import DEFAULT_PRESET, PRESETS, get_preset, register
from rl.run.policy import check_context, load_policy, make_task
from rl.run.record import RunDirError, RunPolicy, load_run, write_record
from rl.run.launch import PreparedRun, prepare, train
from rl.run.evaluation import EvalOptions, evaluate, format_report
from rl.run.summary import format_summary, summarize

__all__ = [
    "AsyncConfig", "LoggingConfig", "LoopConfig", "ModelSpec", "Resume", "RewardConfig",
    "RolloutOptions",
    "RunConfig", "RunHooks",
    "TaskSpec", "RunResult", "DEFAULT_PRESET", "PRESETS", "get_preset", "register",
    "check_context", "load_policy", "make_task", "RunDirError", "RunPolicy", "load_run",
    "write_record", "PreparedRun", "prepare", "train", "EvalOptions", "evaluate", "format_report", "format_summary", "summarize",
]
