"""DPS: dynamics-predictive sampling (Mao et al., "Dynamics-Predictive Sampling for Active
RL Finetuning of Large Reasoning Models", ICLR 2026).

Each prompt τ has a hidden solving state s_t^τ in S = {U, P, F}: unsolved (all k rollouts
wrong), partially solved, fully solved (all right). Only partially solved prompts give
GRPO a non-zero advantage. The state evolves as a Markov chain with a transition matrix A
shared by all prompts, A[s, s'] = p(s_{t+1} = s' | s_t = s), and a sampled group is an
observation o of the state with emission E[s, o] = p(o | s) (the paper reads the state
off the group's rewards exactly: E = I, the default; a noisy E is allowed).

Per prompt, a forward (Bayes) filter over the belief b_t^τ(s) = p(s_t^τ = s | rewards so far):

    predict, Δ steps with no observation:  b⁻ = b A^Δ
    update on an observation o:            b(s') ∝ b⁻(s') E[s', o]

A unseen prompt's belief is the prior π_0. A is learned online: the expected count of the
last transition of a prompt observed at step t after a previous belief b at step t - Δ,

    ξ(s, s') ∝ (b A^(Δ-1))(s) A[s, s'] E[s', o],      N ← λ N + ξ,
    A[s, :] = (α_0[s, :] + N[s, :]) / Σ_s' (α_0[s, s'] + N[s, s'])

(a Dirichlet prior α_0, a forgetting factor λ ≤ 1 for a policy that keeps moving).
Selection, before any rollout: the predicted informativeness of τ at step t is
p(s_t^τ = P) = (b^τ A^Δ)(P), and the B prompts with the largest value are sampled (ties
broken by a seeded shuffle).

Hyper-parameters (DpsConfig): k = group_size, B = prompts_per_step, π_0 = `prior`,
α_0 = `transition_prior` (default: 1 everywhere plus `stay_bonus` on the diagonal),
λ = `forgetting`, E = `emission`, the solved threshold (a rollout is correct if its
reward >= `correct_threshold`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.schedulers.base import Plan, check_float, check_int, check_updates

STATES = ("unsolved", "partial", "solved")
U, P, F = 0, 1, 2


def observe_state(rewards: np.ndarray, correct_threshold: float = 1.0) -> int:
    """The observed state of one group: U if no rollout is correct, F if all are, else P."""
    c = np.asarray(rewards, np.float64) >= correct_threshold
    return U if not c.any() else F if c.all() else P


def predict_belief(belief: np.ndarray, transition: np.ndarray, steps: int) -> np.ndarray:
    """b A^steps."""
    b = np.asarray(belief, np.float64)
    for _ in range(int(steps)):
        b = b @ transition
    return b


def filter_update(belief: np.ndarray, transition: np.ndarray, emission: np.ndarray,
                  steps: int, obs: int) -> tuple[np.ndarray, np.ndarray]:
    """One forward-filter step for a prompt last filtered `steps` >= 1 steps ago and now
    observed as `obs`: (posterior belief [S], expected last transition ξ [S, S])."""
    if steps < 1:
        raise ValueError(f"filter_update: steps since the last belief must be >= 1, got {steps}")
    before = predict_belief(belief, transition, steps - 1)
    xi = before[:, None] * transition * emission[:, obs][None, :]
    z = xi.sum()
    if not z > 0:
        raise ValueError(f"filter_update: observation {STATES[obs]!r} has probability 0 under "
                         "the model; the emission matrix must allow every observation")
    xi /= z
    return xi.sum(axis=0), xi


def transition_from_counts(prior: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row-normalised α_0 + N."""
    a = np.asarray(prior, np.float64) + np.asarray(counts, np.float64)
    return a / a.sum(axis=1, keepdims=True)


def _stochastic(owner: str, name: str, m: Any, shape: tuple[int, ...]) -> tuple:
    a = np.asarray(m, np.float64)
    if a.shape != shape or not np.isfinite(a).all() or (a < 0).any() or \
            not np.allclose(a.sum(axis=-1), 1.0):
        raise ValueError(f"{owner}.{name} must be a {shape} array of probabilities whose "
                         f"last axis sums to 1, got {m!r}")
    return tuple(map(tuple, a)) if a.ndim == 2 else tuple(a)


@dataclasses.dataclass(frozen=True)
class DpsConfig:
    """See the module docstring for the symbols. emission / prior / transition_prior as
    nested tuples (None: E = I, π_0 uniform, α_0 = 1 + stay_bonus·I)."""

    prompts_per_step: int = 8
    group_size: int = 8
    correct_threshold: float = 1.0
    prior: tuple[float, ...] | None = None
    emission: tuple[tuple[float, ...], ...] | None = None
    transition_prior: tuple[tuple[float, ...], ...] | None = None
    stay_bonus: float = 4.0
    forgetting: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_int("DpsConfig", "prompts_per_step", self.prompts_per_step, 1)
        check_int("DpsConfig", "group_size", self.group_size, 1)
        check_int("DpsConfig", "seed", self.seed, 0)
        check_float("DpsConfig", "correct_threshold", self.correct_threshold, -1e30, 1e30)
        check_float("DpsConfig", "stay_bonus", self.stay_bonus, 0.0, 1e30)
        check_float("DpsConfig", "forgetting", self.forgetting, 0.0, 1.0, low_open=True)
        s = len(STATES)
        set_ = object.__setattr__
        set_(self, "prior", _stochastic("DpsConfig", "prior",
                                        self.prior if self.prior is not None
                                        else np.full(s, 1.0 / s), (s,)))
        set_(self, "emission", _stochastic("DpsConfig", "emission",
                                           self.emission if self.emission is not None
                                           else np.eye(s), (s, s)))
        tp = self.transition_prior
        if tp is None:
            tp = np.ones((s, s)) + self.stay_bonus * np.eye(s)
        tp = np.asarray(tp, np.float64)
        if tp.shape != (s, s) or not np.isfinite(tp).all() or (tp <= 0).any():
            raise ValueError(f"DpsConfig.transition_prior must be a ({s}, {s}) array of "
                             f"positive pseudo-counts, got {self.transition_prior!r}")
        set_(self, "transition_prior", tuple(map(tuple, tp)))


class DpsScheduler:
    """DPS over any int prompt ids: one belief per prompt seen, a shared learned A."""

    name = "dps"

    def __init__(self, config: DpsConfig = DpsConfig()):
        self.config = config
        self.emission = np.asarray(config.emission, np.float64)
        self.alpha0 = np.asarray(config.transition_prior, np.float64)
        self.counts = np.zeros_like(self.alpha0)
        self.beliefs: dict[int, np.ndarray] = {}
        self.last_step: dict[int, int] = {}
        self.step = 0  # updates seen (the filter's clock)

    @property
    def transition(self) -> np.ndarray:
        return transition_from_counts(self.alpha0, self.counts)

    def predicted(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """p(s = P) at the next update for each prompt [n]: b A^Δ with Δ = steps from the
        prompt's last observation to the next update (π_0 A for a prompt never observed)."""
        a = self.transition
        prior = np.asarray(self.config.prior, np.float64)
        out = np.empty(len(prompt_ids), np.float64)
        for i, pid in enumerate(prompt_ids):
            pid = int(pid)
            if pid in self.beliefs:
                b = predict_belief(self.beliefs[pid], a, self.step + 1 - self.last_step[pid])
            else:
                b = predict_belief(prior, a, 1)
            out[i] = b[P]
        return out

    def select(self, step: int, candidates: Sequence[int]) -> Plan:
        c = self.config
        ids = [int(q) for q in candidates]
        if len(set(ids)) < c.prompts_per_step:
            raise ValueError(f"dps: {len(set(ids))} distinct candidates offered, the batch "
                             f"needs prompts_per_step={c.prompts_per_step}")
        ids = list(dict.fromkeys(ids))
        score = self.predicted(ids)
        shuffle = np.random.default_rng([c.seed, int(step)]).permutation(len(ids))
        order = np.lexsort((shuffle, -score))
        return [(ids[i], c.group_size) for i in order[:c.prompts_per_step]]

    def update(self, prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]) -> None:
        """One step of the filter: every sampled prompt's belief takes its observation,
        the transition counts take the expected last transitions, the clock advances."""
        a = self.transition
        prior = np.asarray(self.config.prior, np.float64)
        self.step += 1
        xi_sum = np.zeros_like(self.counts)
        for pid, r in check_updates(prompt_ids, rewards):
            obs = observe_state(r, self.config.correct_threshold)
            if pid in self.beliefs:
                b, steps = self.beliefs[pid], self.step - self.last_step[pid]
                post, xi = filter_update(b, a, self.emission, steps, obs)
                xi_sum += xi
            else:  # first observation: the prior's one-step prediction, no transition seen
                post, _ = filter_update(prior, a, self.emission, 1, obs)
            self.beliefs[pid], self.last_step[pid] = post, self.step
        self.counts = self.config.forgetting * self.counts + xi_sum

    def follow_up(self, step: int) -> Plan:
        return []

    def state(self) -> dict[str, Any]:
        ids = sorted(self.beliefs)
        return {"name": self.name, "step": self.step, "counts": self.counts.tolist(),
                "ids": ids, "beliefs": [self.beliefs[i].tolist() for i in ids],
                "last_step": [self.last_step[i] for i in ids]}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"dps: cannot restore the state of scheduler {state.get('name')!r}")
        counts = np.asarray(state["counts"], np.float64)
        if counts.shape != self.counts.shape:
            raise ValueError(f"dps: saved transition counts have shape {counts.shape}, "
                             f"expected {self.counts.shape}")
        self.step, self.counts = int(state["step"]), counts
        self.beliefs = {int(i): np.asarray(b, np.float64)
                        for i, b in zip(state["ids"], state["beliefs"])}
        self.last_step = {int(i): int(t) for i, t in zip(state["ids"], state["last_step"])}
