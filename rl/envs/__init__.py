"""Multi-turn environments and tools (a leaf: may import `rl.tasks` for `Prompt` and the
split helpers, nothing else from `rl`).

`base` holds the protocol every environment follows (`Environment`, `Episode`,
`StepResult`) and the checks the rollout side applies to what an environment returns.
Environments are plain Python objects that step on the host between decode segments.
"""
from rl.envs.base import EndReason, Environment, Episode, StepResult, check_step_result

__all__ = ["EndReason", "Environment", "Episode", "StepResult", "check_step_result"]
