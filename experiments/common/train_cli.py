"""`python -m experiments.train`'s command line as a function the scripts share:
main(argv) parses the flags into a RunConfig (experiments.common.flags), runs it with
rl.run (prepare, then run), writes the reward-curve PNG (and --results-json), prints the
summary and returns it.

Faults end with one line on stderr and a documented exit status
(rl.runtime.preemption): usage errors exit 2 (argparse); a run that cannot go on
(checkpoint, config, lock, non-finite values) exits 1 with "error: ..." (any other
exception, e.g. a task's reward function or the rollout thread failing, exits 1 with its
traceback and the step it happened in); a failed write (disk full, permission, read-only file system, quota) exits
74 with "storage error: ..." naming the file, the cause and the last good checkpoint;
SIGTERM or Ctrl-C (recorded from the start, model loading included) stop the run after
checkpointing its last completed step and exit with --preempted-exit-code (default 0)
after "preempted: ..."; a KeyboardInterrupt (a second Ctrl-C, or one raised by a hook)
exits 130 after its checkpoint.
"""
from __future__ import annotations

import sys
from pathlib import Path

from experiments.common.flags import build_train_parser, config_from_args, resume_from_args
from experiments.common.plots import plot_reward_curve
from rl.learner import NonFiniteError
from rl.loops.validation import ConfigError
from rl.run import format_summary, prepare
from rl.runtime import preemption
from rl.runtime.checkpoint import CheckpointError
from rl.runtime.distributed import is_main_process
from rl.runtime.logging import atomic_write_json, format_profile
from rl.runtime.preemption import EXIT_INTERRUPTED, EXIT_STORAGE, Preempted
from rl.runtime.runlock import RunLockError
from rl.runtime.storage import StorageError


def last_good(run_dir: Path) -> tuple[int, Path] | None:
    """(step, dir) of the newest finished checkpoint in run_dir/checkpoints, or None."""
    steps = [int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
    return None if not steps else (max(steps), run_dir / "checkpoints" / str(max(steps)))


def main(argv: list[str] | None = None) -> dict:
    parser = build_train_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        resume = resume_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    if args.print_config:
        try:
            cfg.validate()
        except ValueError as err:
            parser.error(str(err))
        print(cfg.to_json(), end="")
        return {"config": cfg.to_dict()}
    with preemption.stop_signals():  # a signal while the model loads stops the run cleanly
        try:
            return _train(argv, args, parser, cfg, resume)
        except StorageError as err:
            sys.stderr.write(f"storage error: {err}\n")
            sys.exit(EXIT_STORAGE)
        except OSError as err:  # the run record, summary, plots
            failure = StorageError.of(err, what="a run file", path=err.filename or cfg.run_dir,
                                      last_good=last_good(Path(cfg.output_dir)))
            if failure is None:
                raise
            sys.stderr.write(f"storage error: {failure}\n")
            sys.exit(EXIT_STORAGE)


def _train(argv, args, parser, cfg, resume) -> dict:
    command = "python -m experiments.train " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        prepared = prepare(cfg, resume)
    except (CheckpointError, RunLockError) as err:
        sys.exit(f"error: {err}")
    except ValueError as err:  # the run dir (checkpoints but no --resume), model, task or mesh
        parser.error(str(err))
    try:
        result = prepared.run(command=command.strip())
    except Preempted as err:
        sys.stderr.write(f"preempted: {err}\n")
        sys.exit(args.preempted_exit_code)
    except (CheckpointError, ConfigError, NonFiniteError, RunLockError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        print(f"interrupted: the last completed step is checkpointed in "
              f"{prepared.cfg.run_dir}/checkpoints; continue with --resume", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    if not is_main_process():  # process 0 writes the results files
        return {}
    summary, run_dir = result.summary, Path(prepared.cfg.run_dir)
    title = f"{cfg.name}: GRPO reward" + ("" if cfg.asynchronous is None else
                                          f" (async {cfg.asynchronous.mode}, "
                                          f"η={cfg.asynchronous.max_staleness})")
    plot = {"baseline": result.eval[0]["reward"], "title": title,
            "pretrained": cfg.model.name != "tiny",
            "reward_names": getattr(prepared.task, "reward_names", None), "minutes": True}
    plot_reward_curve(result.train, result.eval, run_dir / "reward_curve.png", **plot)
    if args.results_json:
        path = Path(args.results_json)
        atomic_write_json(path, summary)
        plot_reward_curve(result.train, result.eval, path.with_suffix(".png"), **plot)
    print(format_summary(summary))
    if summary["step_profile"] is not None:
        print(format_profile(summary["step_profile"]))
    print(f"run dir {run_dir}")
    return summary

