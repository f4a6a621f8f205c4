"""DOTS: difficulty-targeted online data selection (Sun et al., "Improving Data Efficiency
for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and
Rollout Replay", 2025). Rollout replay, the paper's second half, is not here.

Adaptive difficulty of a question q under the current policy π_t, from its G rollouts
with rewards r_i in [0, 1] (1 = correct):

    d_q = 1 - (1/G) Σ_i r_i                 (the share of failed rollouts)

Only a small reference set R = {q_1 .. q_K} is rolled out to measure d_i; every other
question's difficulty is predicted by attention over R with the question embeddings z
(a frozen encoder, dimension h; the caller supplies them):

    a_i(q) = exp(z_q · z_i / √h) / Σ_j exp(z_q · z_j / √h)
    d̂_q   = Σ_i a_i(q) d_i

Questions whose rollouts all get the same reward teach GRPO nothing, and that is least
likely at d = 1/2, so the B questions of a batch are drawn without replacement with

    p(q) ∝ exp(-|d̂_q - α| / τ),    α = 0.5 (target difficulty), τ: sampling temperature.

Hyper-parameters (DotsConfig): K = len(reference_ids) (the paper uses a few hundred
reference questions), α = `target` (0.5 as in the paper), τ = `temperature`, B =
prompts_per_step, G = group_size. Reference difficulties start at `initial_difficulty`
(0.5: before any measurement every prediction is 0.5 and the draw is uniform).

How this implementation spends the reference rollouts: each step the
`reference_per_step` reference questions measured longest ago (round robin) are part of
the batch itself (so their rollouts are also trained on), and the other
B - reference_per_step are drawn by p(q) from the candidates outside the refreshed ones.
The paper measures the whole reference set every step; reference_per_step = K does that
(needs K <= B).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.schedulers.base import (
    Plan,
    check_float,
    check_int,
    check_updates,
    sample_without_replacement,
)


def adaptive_difficulty(rewards: np.ndarray) -> float:
    """d_q = 1 - mean reward of one group (rewards clipped to [0, 1])."""
    r = np.clip(np.asarray(rewards, np.float64), 0.0, 1.0)
    return float(1.0 - r.mean())


def predict_difficulty(query_emb: np.ndarray, ref_emb: np.ndarray,
                       ref_difficulty: np.ndarray) -> np.ndarray:
    """d̂ [Q] for query embeddings [Q, h] from the reference embeddings [K, h] and their
    measured difficulties [K]: softmax(z_q · z_i / √h) over i, then the weighted mean."""
    q = np.asarray(query_emb, np.float64)
    k = np.asarray(ref_emb, np.float64)
    d = np.asarray(ref_difficulty, np.float64)
    if q.ndim != 2 or k.ndim != 2 or q.shape[1] != k.shape[1] or d.shape != (k.shape[0],):
        raise ValueError(f"predict_difficulty: need query [Q, h], reference [K, h] and "
                         f"difficulties [K]; got {q.shape}, {k.shape}, {d.shape}")
    logits = q @ k.T / np.sqrt(q.shape[1])
    logits -= logits.max(axis=1, keepdims=True)
    a = np.exp(logits)
    a /= a.sum(axis=1, keepdims=True)
    return a @ d


def selection_weights(difficulty: np.ndarray, target: float, temperature: float) -> np.ndarray:
    """exp(-|d̂ - α| / τ), unnormalised: scaled so the largest is 1 (no underflow of all
    weights at a small τ)."""
    dist = np.abs(np.asarray(difficulty, np.float64) - target)
    return np.exp(-(dist - dist.min()) / temperature)


@dataclasses.dataclass(frozen=True)
class DotsConfig:
    """See the module docstring for the symbols. reference_ids: the prompt ids of R;
    seed: the selection draws' seed (rng([seed, step]))."""

    reference_ids: tuple[int, ...]
    prompts_per_step: int = 8
    group_size: int = 8
    reference_per_step: int = 1
    target: float = 0.5
    temperature: float = 0.1
    initial_difficulty: float = 0.5
    seed: int = 0

    def __post_init__(self):
        b = check_int("DotsConfig", "prompts_per_step", self.prompts_per_step, 1)
        check_int("DotsConfig", "group_size", self.group_size, 1)
        check_int("DotsConfig", "seed", self.seed, 0)
        ids = tuple(int(i) for i in self.reference_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError("DotsConfig.reference_ids must be a non-empty tuple of distinct "
                             f"prompt ids, got {self.reference_ids!r}")
        object.__setattr__(self, "reference_ids", ids)
        m = check_int("DotsConfig", "reference_per_step", self.reference_per_step, 0)
        if m > min(b, len(ids)):
            raise ValueError(f"DotsConfig.reference_per_step={m} must be <= prompts_per_step "
                             f"({b}) and <= the reference set size ({len(ids)})")
        check_float("DotsConfig", "target", self.target, 0.0, 1.0)
        check_float("DotsConfig", "temperature", self.temperature, 0.0, float("inf"),
                    low_open=True)
        check_float("DotsConfig", "initial_difficulty", self.initial_difficulty, 0.0, 1.0)


class DotsScheduler:
    """DOTS over prompt ids 0 .. P-1 with embeddings [P, h] (row = prompt id)."""

    name = "dots"

    def __init__(self, config: DotsConfig, embeddings: np.ndarray):
        emb = np.asarray(embeddings, np.float64)
        if emb.ndim != 2 or not np.isfinite(emb).all():
            raise ValueError(f"dots: embeddings must be a finite [P, h] array, got shape "
                             f"{emb.shape}")
        bad = [i for i in config.reference_ids if not 0 <= i < emb.shape[0]]
        if bad:
            raise ValueError(f"dots: reference ids {bad} have no embedding row (P = "
                             f"{emb.shape[0]})")
        self.config, self.embeddings = config, emb
        k = len(config.reference_ids)
        self._ref_pos = {pid: j for j, pid in enumerate(config.reference_ids)}
        self.ref_difficulty = np.full((k,), config.initial_difficulty, np.float64)
        self.ref_measured_at = np.full((k,), -1, np.int64)  # step of the last measurement
        self._updates = 0

    def predicted(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """d̂ of the given prompts (a reference prompt gets its own attention estimate too,
        as in the paper's formula; its measured value is ref_difficulty)."""
        ids = np.asarray(prompt_ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.embeddings.shape[0]):
            raise ValueError(f"dots: prompt ids must lie in [0, {self.embeddings.shape[0]}) "
                             "(one embedding row each)")
        ref = self.embeddings[np.asarray(self.config.reference_ids)]
        return predict_difficulty(self.embeddings[ids], ref, self.ref_difficulty)

    def select(self, step: int, candidates: Sequence[int]) -> Plan:
        c = self.config
        order = np.lexsort((np.arange(len(c.reference_ids)), self.ref_measured_at))
        refresh = [c.reference_ids[j] for j in order[:c.reference_per_step]]
        taken = set(refresh)
        pool = [int(q) for q in candidates if int(q) not in taken]
        need = c.prompts_per_step - len(refresh)
        if len(pool) < need:
            raise ValueError(f"dots: {len(pool)} candidates outside this step's reference "
                             f"refresh, the batch needs {need} more; offer more candidates")
        w = selection_weights(self.predicted(pool), c.target, c.temperature)
        rng = np.random.default_rng([c.seed, int(step)])
        picked = sample_without_replacement(w, need, rng) if need else np.zeros(0, np.int64)
        return [(q, c.group_size) for q in refresh] + [(pool[i], c.group_size) for i in picked]

    def update(self, prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]) -> None:
        """Measured d of every reference prompt among the sampled ones; others are ignored
        (the paper estimates them from the reference set only)."""
        for pid, r in check_updates(prompt_ids, rewards):
            j = self._ref_pos.get(pid)
            if j is not None:
                self.ref_difficulty[j] = adaptive_difficulty(r)
                self.ref_measured_at[j] = self._updates
        self._updates += 1

    def follow_up(self, step: int) -> Plan:
        return []

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "ref_difficulty": self.ref_difficulty.tolist(),
                "ref_measured_at": self.ref_measured_at.tolist(), "updates": self._updates}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"dots: cannot restore the state of scheduler {state.get('name')!r}")
        k = len(self.config.reference_ids)
        d = np.asarray(state["ref_difficulty"], np.float64)
        t = np.asarray(state["ref_measured_at"], np.int64)
        if d.shape != (k,) or t.shape != (k,):
            raise ValueError(f"dots: the saved state is for {d.shape[0]} reference prompts, "
                             f"this scheduler has {k}; use the same reference_ids")
        self.ref_difficulty, self.ref_measured_at = d, t
        self._updates = int(state["updates"])
