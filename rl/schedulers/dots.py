"""DOTS: difficulty-targeted online data selection (Sun et al., "Improving Data Efficiency
for LLM Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and
Rollout Replay", 2025; official code ASTRAL-Group/data-efficient-llm-rl,
rl_training/verl/verl/trainer/ppo/ray_trainer.py `fit`, teacher_utils.py, and the run
script rl_training/run_bash/final_ds_teacher_replay.sh). Rollout replay, the paper's
second half, is rl.loops.replay.

Adaptive difficulty of a question q under the current policy π_t, from its G rollouts
with rewards r_i in [0, 1] (1 = correct):

    d_q = 1 − (1/G) Σ_i r_i                 (the share of failed rollouts)

(the official code stores the success rate 1 − d_q; with α = 1/2 the selection below is
the same.) Every μ steps (a selection round) the official trainer:

  1. draws a reference set R of K questions uniformly at random from the training set and
     rolls each out G times with π_t (these rollouts only measure d_i; they are not
     trained on);
  2. predicts every question's difficulty by attention over R, with question embeddings z
     from a frozen encoder (dimension h):
         a_i(q) = exp(z_q · z_i / √h) / Σ_j exp(z_q · z_j / √h),    d̂_q = Σ_i a_i(q) d_i
     then calibrates linearly: the least-squares line d ≈ s·d̂ + c through the K
     reference points (d̂_i, d_i) maps every d̂_q to s·d̂_q + c;
  3. samples μ·B questions without replacement with
         p(q) = softmax_q(−|d̂_q − α| / τ),
     shuffles them, and trains on B of them per step for the next μ steps.

Hyper-parameters (DotsConfig; the official script's values): α = `target` (0.5), τ =
`temperature` (1e-3: nearly greedy on |d̂ − α|), μ = `selection_interval` (2), K =
`reference_size` (256 with B = 512), G = group_size (8), B = prompts_per_step.

Our adaptations: the official predictor is a trained few-shot regressor (query and
reference projections, 3-layer MLPs with LayerNorm, and a learned logit temperature
from the reference values' mean and std, trained offline on another model's rollouts);
we have no such model and use the attention formula above on the caller's embeddings
(identity projections; in the loop, the mean input-embedding row of each prompt). The
candidates are the caller's (the loop's fixed pool), not the whole training set.
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
    distinct_ids,
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


def calibration(predicted: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """(s, c) of the least-squares line measured ≈ s · predicted + c over the reference
    set [K]; a constant prediction gives s = 0, c = mean(measured)."""
    x = np.asarray(predicted, np.float64)
    y = np.asarray(measured, np.float64)
    dx = x - x.mean()
    var = float(dx @ dx)
    s = float(dx @ (y - y.mean())) / var if var > 0 else 0.0
    return s, float(y.mean() - s * x.mean())


def selection_weights(difficulty: np.ndarray, target: float, temperature: float) -> np.ndarray:
    """exp(-|d̂ - α| / τ), unnormalised: scaled so the largest is 1 (no underflow of all
    weights at a small τ); normalised, the softmax p(q)."""
    dist = np.abs(np.asarray(difficulty, np.float64) - target)
    return np.exp(-(dist - dist.min()) / temperature)


@dataclasses.dataclass(frozen=True)
class DotsConfig:
    """See the module docstring for the symbols. calibrate: the official linear
    calibration of d̂ on the reference set; seed: the draws' seed (rng([seed, step]))."""

    prompts_per_step: int = 8
    group_size: int = 8
    reference_size: int = 256
    selection_interval: int = 2
    target: float = 0.5
    temperature: float = 1e-3
    calibrate: bool = True
    seed: int = 0

    def __post_init__(self):
        check_int("DotsConfig", "prompts_per_step", self.prompts_per_step, 1)
        check_int("DotsConfig", "group_size", self.group_size, 1)
        check_int("DotsConfig", "reference_size", self.reference_size, 1)
        check_int("DotsConfig", "selection_interval", self.selection_interval, 1)
        check_int("DotsConfig", "seed", self.seed, 0)
        check_float("DotsConfig", "target", self.target, 0.0, 1.0)
        check_float("DotsConfig", "temperature", self.temperature, 0.0, float("inf"),
                    low_open=True)
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"DotsConfig.calibrate must be True or False, got "
                             f"{self.calibrate!r}")


class DotsScheduler:
    """DOTS over prompt ids 0 .. P-1 with embeddings [P, h] (row = prompt id).

    Per step: `measure(step, candidates)` names the reference prompts to roll out (not
    trained on) at the start of a selection round, else []; their rewards go to
    `update`; then `select` gives the step's B prompts from the round's μ·B."""

    name = "dots"

    def __init__(self, config: DotsConfig, embeddings: np.ndarray):
        emb = np.asarray(embeddings, np.float64)
        if emb.ndim != 2 or not np.isfinite(emb).all():
            raise ValueError(f"dots: embeddings must be a finite [P, h] array, got shape "
                             f"{emb.shape}")
        self.config, self.embeddings = config, emb
        self.queue: list[int] = []  # the round's selected prompts not yet trained on
        self.ref_ids: list[int] = []  # the round's reference set R
        self.ref_difficulty = np.zeros(0, np.float64)  # d_i [K] measured on R
        self.awaiting = False  # measure named R, update has not given its rewards yet
        self.measured = False  # R's difficulties are fresh for this round's selection

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        a = np.asarray(ids, np.int64)
        if a.size and (a.min() < 0 or a.max() >= self.embeddings.shape[0]):
            raise ValueError(f"dots: prompt ids must lie in [0, {self.embeddings.shape[0]}) "
                             "(one embedding row each)")
        return a

    def predicted(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """d̂ of the given prompts from the current reference set (calibrated when
        config.calibrate), [n]."""
        if not self.ref_ids:
            raise ValueError("dots: no reference set measured yet; call measure, roll the "
                             "named prompts out and pass their rewards to update first")
        ids = self._check_ids(prompt_ids)
        ref = self.embeddings[np.asarray(self.ref_ids)]
        d = predict_difficulty(self.embeddings[ids], ref, self.ref_difficulty)
        if self.config.calibrate:
            s, c = calibration(predict_difficulty(ref, ref, self.ref_difficulty),
                               self.ref_difficulty)
            d = s * d + c
        return d

    def measure(self, step: int, candidates: Sequence[int]) -> list[int]:
        """The reference prompts to roll out now (a new round starts), else []."""
        if self.queue:
            return []
        c = self.config
        cands = distinct_ids(candidates)
        self._check_ids(cands)
        if len(cands) < c.reference_size:
            raise ValueError(f"dots: {len(cands)} candidates, the reference set needs "
                             f"reference_size={c.reference_size}; lower it or offer more")
        rng = np.random.default_rng([c.seed, int(step), 1])
        pick = rng.choice(len(cands), size=c.reference_size, replace=False)
        self.ref_ids = [cands[i] for i in pick]
        self.ref_difficulty = np.zeros(len(self.ref_ids), np.float64)
        self.awaiting, self.measured = True, False
        return list(self.ref_ids)

    def select(self, step: int, candidates: Sequence[int]) -> Plan:
        c = self.config
        if not self.queue:
            if not self.measured:
                raise ValueError("dots: a selection round starts with a measured reference "
                                 "set; call measure, roll its prompts out and update first")
            cands = distinct_ids(candidates)
            need = c.selection_interval * c.prompts_per_step
            if len(cands) < need:
                raise ValueError(f"dots: {len(cands)} candidates, a round of "
                                 f"selection_interval * prompts_per_step = {need} needs "
                                 "that many distinct ones")
            w = selection_weights(self.predicted(cands), c.target, c.temperature)
            rng = np.random.default_rng([c.seed, int(step), 2])
            picked = sample_without_replacement(w, need, rng)
            self.queue = [cands[i] for i in picked[rng.permutation(need)]]
            self.measured = False
        batch, self.queue = self.queue[:c.prompts_per_step], self.queue[c.prompts_per_step:]
        return [(q, c.group_size) for q in batch]

    def update(self, prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]) -> None:
        """The reference set's rewards after `measure` (d_i of each); the training
        groups' rewards afterwards are accepted and not used (as in the official code)."""
        pairs = check_updates(prompt_ids, rewards)
        if not self.awaiting:
            return
        if sorted(p for p, _ in pairs) != sorted(self.ref_ids):
            raise ValueError(f"dots: measure asked for the reference prompts "
                             f"{self.ref_ids}; update got {[p for p, _ in pairs]}")
        pos = {pid: j for j, pid in enumerate(self.ref_ids)}
        for pid, r in pairs:
            self.ref_difficulty[pos[pid]] = adaptive_difficulty(r)
        self.awaiting, self.measured = False, True

    def follow_up(self, step: int) -> Plan:
        return []

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "queue": list(self.queue), "ref_ids": list(self.ref_ids),
                "ref_difficulty": self.ref_difficulty.tolist(), "awaiting": self.awaiting,
                "measured": self.measured}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"dots: cannot restore the state of scheduler {state.get('name')!r}")
        if "queue" not in state:
            raise ValueError("dots: the saved state is from the earlier fixed-reference DOTS "
                             "(no selection round); start the run afresh")
        self.queue = [int(i) for i in state["queue"]]
        self.ref_ids = [int(i) for i in state["ref_ids"]]
        self.ref_difficulty = np.asarray(state["ref_difficulty"], np.float64)
        self.awaiting, self.measured = bool(state["awaiting"]), bool(state["measured"])
