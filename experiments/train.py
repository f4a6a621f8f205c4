"""The main job: train a policy with GRPO, synchronously or asynchronously.

    python -m experiments.train                          # preset "tiny-synthetic" on CPU
    python -m experiments.train --preset smollm2-rg      # SmolLM2-135M on reasoning-gym chain_sum
    python -m experiments.train --run-dir runs/a --steps 400 --resume
    python -m experiments.train --set train.optimizer.learning_rate=3e-4 --set loop.group_size=4
    python -m experiments.train --max-staleness 2 --rollout continuous   # async (rl.loops.asynchronous)
    python -m experiments.train --max-staleness 4 --async-mode deterministic --proximal exact
    python -m experiments.train --config runs/a/run_config.json --print-config

The command line is a view of rl.run's RunConfig (experiments.common.flags: a preset or a
saved config, short flags that are aliases of dotted paths, `--set PATH=VALUE`); the run
itself is rl.run.train. Any async flag (--max-staleness, --async-mode, --rollout, ...) sets
the config's asynchronous section and runs rl.loops.run_async (η defaults to 1 then);
without one the synchronous rl.loops.run runs.

Each iteration: task prompts -> sampler (rl.rollout) -> task rewards -> advantages ->
one train_step. Prints a tqdm bar (reward, tokens/s) and eval lines; writes into the
run dir: model.json and run_config.json (the run record: rl.run.record, what
experiments.evaluate / export read and `--config RUN_DIR` restarts from), metrics.jsonl,
checkpoints/ (orbax; --resume continues from the latest), wandb/ (offline unless --wandb
online), summary.json and reward_curve.png. At the end it prints the step profile (mean
seconds and share of the step per phase, steps/hour without the first, compiling step,
peak resident memory; rl.runtime.logging.profile_summary), also under "step_profile" in
summary.json. `--results-json PATH` also writes the summary there (and the PNG beside it).
"""
from experiments.common.train_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
