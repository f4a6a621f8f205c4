"""`python -m experiments.train`'s command line as a function the scripts share:
main(argv) parses the flags into a RunConfig (experiments.common.flags), runs it with
rl.run (prepare, then run), writes the reward-curve PNG (and --results-json), prints the
summary and returns it. Usage errors exit with argparse's status 2; a run that cannot go
on (checkpoint, config, lock, non-finite values) exits with "error: ..." (status 1); an
interrupted asynchronous run exits 130 after its checkpoint.
"""
from __future__ import annotations

import sys
from pathlib import Path

from experiments.common.flags import build_train_parser, config_from_args, resume_from_args
from experiments.common.plots import plot_reward_curve
from rl.learner import NonFiniteError
from rl.loops.validation import ConfigError
from rl.run import format_summary, prepare
from rl.runtime.checkpoint import CheckpointError
from rl.runtime.distributed import is_main_process
from rl.runtime.logging import atomic_write_json, format_profile
from rl.runtime.runlock import RunLockError


def main(argv: list[str] | None = None) -> dict:
    parser = build_train_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        resume = resume_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    if args.print_config:
        print(cfg.to_json(), end="")
        return {"config": cfg.to_dict()}
    command = "python -m experiments.train " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        prepared = prepare(cfg, resume)
    except (CheckpointError, RunLockError) as err:
        sys.exit(f"error: {err}")
    except ValueError as err:  # the run dir (checkpoints but no --resume), model, task or mesh
        parser.error(str(err))
    try:
        result = prepared.run(command=command.strip())
    except (CheckpointError, ConfigError, NonFiniteError, RunLockError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        if cfg.asynchronous is None:
            raise
        print(f"interrupted: a checkpoint was written in {prepared.cfg.run_dir}/checkpoints; "
              "continue with --resume", file=sys.stderr)
        sys.exit(130)
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

