"""Rollout replay (Sun et al., "Improving Data Efficiency for LLM Reinforcement Fine-tuning
Through Difficulty-targeted Online Data Selection and Rollout Replay", 2025, §"Rollout
Replay"): reuse recent scored groups so that a step samples fewer fresh rollouts.

Each step of B groups (B = LoopConfig.prompts_per_step, N rollouts each) is

    k = min(round(α · B), |𝓑|, B − 1)   groups drawn from the buffer 𝓑 (uniformly, without
                                         replacement, rng = default_rng([seed, step]))
    B − k                                fresh groups sampled with the current policy π_θ_v

so rollout cost per step falls by the replay fraction α (`--replay-fraction`) once the
buffer holds k groups; at least one group is always fresh (α < 1). After the update the
step's fresh groups are pushed into 𝓑, a FIFO of capacity C groups (the oldest leave
first); with `informative_only` (the paper's choice) only groups whose N rewards are not
all equal enter it, since a zero-advantage group carries no gradient (Â_i = 0).

Off-policy correction. A replayed token y_t was drawn by the behaviour policy μ = π_θ_u of
an older version u < v. Its group keeps what the sampler recorded: the token's behaviour
log-prob log μ(y_t) (Trajectory.behaviour_logprobs) and its version u
(Trajectory.versions); advantages are recomputed in the step from the group's stored
rewards, Â_i = (r_i − mean(r)) / std(r). The paper replaces GRPO's π_θ_old by the
behaviour policy in the clipped surrogate,

    ρ_t = π_θ(y_t) / μ(y_t),   L = −Σ_t min(ρ_t Â_i, clip(ρ_t, 1 − ε, 1 + ε) Â_i) / |y|,

i.e. TrainConfig.old_logp = "behaviour" (what `check_replay_correction` asks for, and what
`replay_train_config` sets when nothing else corrects). The library's other corrections
also see the recorded μ and versions and are accepted: old_logp "versions" (AReaL's
interpolated proximal policy from the per-token versions) or "proximal", an
OffPolicyConfig correction (truncated IS weights min(π_prox/μ, c)), or VCPO.

Checked against the official code (ASTRAL-Group/data-efficient-llm-rl): its replay run
script (rl_training/run_bash/final_ds_teacher_replay.sh) sets sigma = 0.5,
buffer_size = 512 with train_batch_size = 512 and replay_strategy = "random" (uniform
draws, as here), but the replay trainer itself is published only as compiled bytecode
(ray_trainer_final.cpython-310.pyc), so the buffer's unit (groups or rollouts), which of
σ / 1 − σ is the replayed share, the informative-only filter and the correction above
could not be read from source; they follow the paper's description as issue 22 records it.
Our default capacity 4·B is our choice (the script's 512 = one batch of B = 512 prompts).

The buffer's contents are part of the run's state: `state()` encodes every stored array
exactly (npz, base64) as JSON for the checkpoint record and `restore` gives them back, so
a resumed run replays the same groups (bit-exact resume).
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.loops.buffer import ScoredGroup
from rl.trajectory import Trajectory

TRAJ_FIELDS = ("prompt_ids", "prompt_lengths", "response_ids", "response_mask",
               "behaviour_logprobs", "versions", "group_ids", "finished", "truncated")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """fraction: α, the share of each batch's groups taken from the buffer (0 = off, < 1);
    capacity: C, groups the FIFO holds (0 = 4 · prompts_per_step when the loop builds it);
    informative_only: store only groups whose rewards are not all equal."""

    fraction: float = 0.0
    capacity: int = 0
    informative_only: bool = True

    def __post_init__(self):
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise ValueError(f"ReplayConfig.fraction (--replay-fraction) must be in [0, 1): at "
                             f"least one group of every batch is fresh; got {f!r}")
        c = self.capacity
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"ReplayConfig.capacity must be an int >= 0 (0 = 4 · "
                             f"prompts_per_step), got {c!r}")
        if not isinstance(self.informative_only, bool):
            raise ValueError(f"ReplayConfig.informative_only must be True or False, got "
                             f"{self.informative_only!r}")

    @property
    def enabled(self) -> bool:
        return self.fraction > 0.0


def replay_count(fraction: float, groups: int, available: int) -> int:
    """k = min(round(α · B), available, B − 1): the step's replayed groups."""
    return int(max(0, min(int(round(fraction * groups)), available, groups - 1)))


def check_replay_correction(config: Any) -> None:
    """ValueError unless the TrainConfig corrects for replayed (older-policy) tokens."""
    if (config.old_logp != "current" or config.offpolicy.correction != "none"
            or config.vcpo.enabled):
        return
    raise ValueError("rollout replay trains on groups sampled by older policies, but "
                     'TrainConfig.old_logp="current" ignores their behaviour log-probs; set '
                     'train.old_logp="behaviour" (the paper\'s clipped ratio π_θ/μ; on the '
                     "command line --set train.old_logp=behaviour), \"versions\" or "
                     '"proximal", or an OffPolicyConfig correction (train.offpolicy)')


def replay_train_config(config: Any, replay: ReplayConfig) -> Any:
    """The TrainConfig with the paper's correction (old_logp="behaviour") when replay is on
    and the config corrects nothing; otherwise unchanged."""
    if not replay.enabled:
        return config
    try:
        check_replay_correction(config)
        return config
    except ValueError:
        return dataclasses.replace(config, old_logp="behaviour")


def informative(group: ScoredGroup, accuracy_name: str | None = None) -> bool:
    """True if the group's rewards are not all equal (under every named reward when
    accuracy_name is None, else under that one)."""
    names = [accuracy_name] if accuracy_name in group.rewards else list(group.rewards)
    return any(np.ptp(np.asarray(group.rewards[n], np.float64)) > 0 for n in names)


def _encode(arrays: dict[str, np.ndarray]) -> str:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return base64.b64encode(out.getvalue()).decode("ascii")


def _decode(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def group_record(group: ScoredGroup, step: int) -> dict[str, Any]:
    """A ScoredGroup as JSON: its arrays bit for bit (npz, base64), live, the step."""
    arrays = {f"t.{f}": np.asarray(getattr(group.traj, f)) for f in TRAJ_FIELDS}
    if group.traj.rewards is not None:
        arrays.update({f"tr.{k}": np.asarray(v) for k, v in group.traj.rewards.items()})
    arrays.update({f"r.{k}": np.asarray(v) for k, v in group.rewards.items()})
    return {"step": int(step), "live": bool(group.live), "arrays": _encode(arrays)}


def group_from_record(record: dict[str, Any]) -> tuple[ScoredGroup, int]:
    a = _decode(record["arrays"])
    traj_rewards = {k[3:]: v for k, v in a.items() if k.startswith("tr.")}
    traj = Trajectory(**{f: a[f"t.{f}"] for f in TRAJ_FIELDS},
                      rewards=traj_rewards or None)
    rewards = {k[2:]: v for k, v in a.items() if k.startswith("r.")}
    return ScoredGroup(traj=traj, rewards=rewards, live=bool(record["live"])), int(record["step"])


class ReplayBuffer:
    """The FIFO 𝓑 of recent scored groups (see the module docstring).

    buf = ReplayBuffer(capacity=32)
    groups = buf.sample(k, rng)          # k distinct stored groups, oldest-first order kept
    buf.push(fresh_groups, step)         # after the update; evicts the oldest beyond C
    """

    def __init__(self, capacity: int, informative_only: bool = True,
                 accuracy_name: str | None = None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ReplayBuffer.capacity must be an int >= 1, got {capacity!r}")
        self.capacity, self.informative_only = capacity, informative_only
        self.accuracy_name = accuracy_name
        self.items: collections.deque[tuple[ScoredGroup, int]] = collections.deque()
        self.pushed = self.evicted = self.skipped = 0

    def __len__(self) -> int:
        return len(self.items)

    def push(self, groups: Sequence[ScoredGroup], step: int) -> None:
        """Store the live (and, with informative_only, informative) groups of `step`."""
        for g in groups:
            if not g.live or (self.informative_only and not informative(g, self.accuracy_name)):
                self.skipped += 1
                continue
            self.items.append((g, int(step)))
            self.pushed += 1
            while len(self.items) > self.capacity:
                self.items.popleft()
                self.evicted += 1

    def sample(self, count: int, rng: np.random.Generator) -> list[ScoredGroup]:
        """`count` distinct groups drawn uniformly (in buffer order); [] for count 0."""
        if count > len(self.items):
            raise ValueError(f"ReplayBuffer.sample: {count} groups asked, {len(self.items)} held")
        if count <= 0:
            return []
        idx = np.sort(rng.choice(len(self.items), size=count, replace=False))
        return [self.items[int(i)][0] for i in idx]

    def stats(self) -> dict[str, int]:
        return {"replay_buffer_groups": len(self.items), "replay_pushed": self.pushed,
                "replay_evicted": self.evicted, "replay_skipped": self.skipped}

    def state(self) -> dict[str, Any]:
        """The buffer as JSON (checkpoint record): every stored group, bit for bit."""
        return {"capacity": self.capacity, "pushed": self.pushed, "evicted": self.evicted,
                "skipped": self.skipped,
                "groups": [group_record(g, s) for g, s in self.items]}

    def restore(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"replay buffer: the checkpoint's capacity {state['capacity']} "
                             f"differs from this run's {self.capacity}")
        self.items = collections.deque(group_from_record(r) for r in state["groups"])
        self.pushed, self.evicted = int(state["pushed"]), int(state["evicted"])
        self.skipped = int(state["skipped"])
