"""The off-policy testbed's setup, shared by the studies that train on it
(experiments.repro.staleness_testbed, experiments.repro.latr_tiny): a tiny policy trained
from scratch on rl.tasks.SyntheticTask with long responses and per-position credit, the
tiny-synthetic preset's learner with these changes."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every cell shares (recorded in each cell's record)."""

    task_options: tuple = (("kind", "shift"), ("length", 32), ("alphabet", 4))
    steps: int = 400
    prompts_per_step: int = 8
    group_size: int = 8
    learning_rate: float = 1e-3
    entropy_coef: float = 0.03
    segment_len: int = 8
    eval_every: int = 50
    eval_prompts: int = 512
    rollout_dtype: str | None = None  # "bfloat16": a bf16 sampler beside the fp32 learner

    def paths(self) -> dict:
        return {"task.options": dict(self.task_options), "loop.steps": self.steps,
                "rollout.dtype": self.rollout_dtype,
                "loop.prompts_per_step": self.prompts_per_step,
                "loop.group_size": self.group_size, "loop.eval_every": self.eval_every,
                "loop.eval_prompts": self.eval_prompts, "loop.eval_greedy": True,
                "loop.eval_sampled_prompts": 64, "loop.save_every": 0,
                "train.optimizer.learning_rate": self.learning_rate,
                "train.optimizer.decay_steps": max(self.steps - 10, 1),
                "train.loss.entropy_coef": self.entropy_coef,
                "rollout.segment_len": self.segment_len,
                "logging.wandb": "disabled", "logging.progress": False}
