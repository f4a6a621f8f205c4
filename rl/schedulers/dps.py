"""DPS: dynamics-predictive sampling (Mao et al., "Dynamics-Predictive Sampling for Active
RL Finetuning of Large Reasoning Models", ICLR 2026; official code maoyixiu/DPS,
recipe/dps/task_sampler.py `BayesianHMMSampler`, whose README states the procedure below).

Each prompt τ has a hidden solving state z_t^τ in {1, 2, 3} = {U, P, F} (here 0, 1, 2):
unsolved (no rollout of the group correct), partially solved, fully solved. Only State 2
gives GRPO a non-zero advantage. The observation y_t is the state read off the sampled
group's success rate (0 -> U, 1 -> F, else P; the official code's deterministic
observation model, E = I here; a noisy emission E[s, o] = p(o | s) is our extension).

Every prompt has its OWN transition model: a Dirichlet α^τ [S, S] over the rows of its
transition matrix, A^τ[s, s'] = p(z_{t+1} = s' | z_t = s) = α^τ[s, s'] / Σ_s'' α^τ[s, s''].
At each training step t, for every prompt the sampler knows (README "train", steps i-iii):

  (i)   posterior:   μ_t^post = μ_t^prior                      if τ was not sampled,
                     μ_t^post(s) ∝ μ_t^prior(s) E[s, y_t]       if it was (one-hot for E = I)
  (ii)  transition:  ξ[s, s'] ∝ μ_{t-1}^post(s) A^τ[s, s'] E[s', y_t]   (sampled τ only)
                     α^τ ← λ α^τ + (1 − λ) α_0 + ξ             (sampled; ξ = 0 otherwise)
  (iii) prediction:  μ_{t+1}^prior = μ_t^post A^τ(α^τ updated)

A new prompt starts at α^τ = α_0, μ^prior = μ^post = π_0 (uniform). λ < 1 forgets old
transition counts towards the prior (non-stationary dynamics). Selection, before any
rollout (README "sample_batch"): the B candidates with the largest μ_t^{τ,prior}(2),

    𝓑_t = Top_B({τ ∈ candidates : μ_t^{τ,prior}(2)}),

ties broken by a seeded shuffle (the official np.argsort leaves tie order unspecified).
A prompt is "known" from the first time it is offered as a candidate (as in the official
sample_batch), so an offered but unsampled prompt's belief also propagates each step.

Hyper-parameters (DpsConfig; the official scripts' values): B = prompts_per_step, k =
group_size (8), π_0 = `prior` (uniform, hmm_prior_pi="uniform"), α_0 = `transition_prior`
(all ones, hmm_prior_alpha=1.0; `stay_bonus` adds b·I, 0 by default), λ = `forgetting`
(hmm_transition_decay_ratio: 0.7 in the MATH scripts, 0.5 in Countdown, 1.0 the config
default; we default to 0.7), a rollout is correct if its reward >= `correct_threshold`
(the official acc >= 1). Candidates: the official sampler draws candidate_ratio · B
prompts (8x-32x) per step from the shuffled dataset; the synchronous loop offers its whole
fixed pool (rl.loops.scheduling), an adaptation.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.schedulers.base import Plan, check_float, check_int, check_updates, distinct_ids

STATES = ("unsolved", "partial", "solved")
U, P, F = 0, 1, 2


def observe_state(rewards: np.ndarray, correct_threshold: float = 1.0) -> int:
    """The observed state y of one group: U if no rollout is correct, F if all are, else P."""
    c = np.asarray(rewards, np.float64) >= correct_threshold
    return U if not c.any() else F if c.all() else P


def expected_transition(alpha: np.ndarray) -> np.ndarray:
    """A [.., S, S]: the Dirichlet mean, each row of α normalised."""
    a = np.asarray(alpha, np.float64)
    return a / a.sum(axis=-1, keepdims=True)


def hmm_step(alpha: np.ndarray, prior: np.ndarray, prev_post: np.ndarray, alpha0: np.ndarray,
             emission: np.ndarray, forgetting: float, obs: int | None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One training step of one prompt's filter (steps i-iii of the module docstring):
    α [S, S], μ_t^prior [S], μ_{t-1}^post [S] and the observation y_t (None: not sampled)
    -> (α updated, μ_{t+1}^prior, μ_t^post)."""
    a = expected_transition(alpha)
    decayed = forgetting * alpha + (1.0 - forgetting) * alpha0
    if obs is None:
        post, new_alpha = prior, decayed
    else:
        lik = emission[:, obs]
        post = prior * lik
        if not post.sum() > 0:
            raise ValueError(f"dps: observation {STATES[obs]!r} has probability 0 under the "
                             "prompt's prediction; the emission matrix must allow it")
        post = post / post.sum()
        xi = prev_post[:, None] * a * lik[None, :]
        xi = xi / xi.sum()
        new_alpha = decayed + xi
    return new_alpha, post @ expected_transition(new_alpha), post


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
    stay_bonus: float = 0.0
    forgetting: float = 0.7
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
    """DPS over any int prompt ids: per known prompt its Dirichlet α^τ [S, S], its
    prediction μ^prior [S] for the next step and its last posterior μ^post [S]."""

    name = "dps"

    def __init__(self, config: DpsConfig = DpsConfig()):
        self.config = config
        self.emission = np.asarray(config.emission, np.float64)
        self.alpha0 = np.asarray(config.transition_prior, np.float64)
        self.pi0 = np.asarray(config.prior, np.float64)
        self.alpha: dict[int, np.ndarray] = {}
        self.prior: dict[int, np.ndarray] = {}
        self.post: dict[int, np.ndarray] = {}
        self.step = 0  # updates seen

    def _register(self, ids: Sequence[int]) -> None:
        for pid in ids:
            if pid not in self.alpha:
                self.alpha[pid] = self.alpha0.copy()
                self.prior[pid], self.post[pid] = self.pi0.copy(), self.pi0.copy()

    def transition(self, prompt_id: int) -> np.ndarray:
        """A^τ [S, S] of a known prompt (the prior's mean for an unknown one)."""
        return expected_transition(self.alpha.get(int(prompt_id), self.alpha0))

    def predicted(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """μ_t^prior(2) [n] for the coming step (π_0(2) for a prompt never offered)."""
        return np.asarray([self.prior.get(int(p), self.pi0)[P] for p in prompt_ids],
                          np.float64)

    def measure(self, step: int, candidates: Sequence[int]) -> list[int]:
        return []

    def select(self, step: int, candidates: Sequence[int]) -> Plan:
        c = self.config
        ids = distinct_ids(candidates)
        if len(ids) < c.prompts_per_step:
            raise ValueError(f"dps: {len(ids)} distinct candidates offered, the batch "
                             f"needs prompts_per_step={c.prompts_per_step}")
        self._register(ids)
        score = self.predicted(ids)
        shuffle = np.random.default_rng([c.seed, int(step)]).permutation(len(ids))
        order = np.lexsort((shuffle, -score))
        return [(ids[i], c.group_size) for i in order[:c.prompts_per_step]]

    def update(self, prompt_ids: Sequence[int], rewards: Sequence[np.ndarray]) -> None:
        """One training step for every known prompt: the sampled ones take their
        observation (and a transition count), the others only propagate."""
        c = self.config
        obs = {pid: observe_state(r, c.correct_threshold)
               for pid, r in check_updates(prompt_ids, rewards)}
        self._register(list(obs))
        for pid in self.alpha:
            self.alpha[pid], self.prior[pid], self.post[pid] = hmm_step(
                self.alpha[pid], self.prior[pid], self.post[pid], self.alpha0, self.emission,
                c.forgetting, obs.get(pid))
        self.step += 1

    def follow_up(self, step: int) -> Plan:
        return []

    def state(self) -> dict[str, Any]:
        ids = list(self.alpha)  # registration order (the update order)
        return {"name": self.name, "step": self.step, "ids": ids,
                "alpha": [self.alpha[i].tolist() for i in ids],
                "prior": [self.prior[i].tolist() for i in ids],
                "post": [self.post[i].tolist() for i in ids]}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"dps: cannot restore the state of scheduler {state.get('name')!r}")
        if "alpha" not in state:
            raise ValueError("dps: the saved state is from the earlier shared-transition DPS "
                             "(no per-prompt 'alpha'); start the run afresh")
        ids = [int(i) for i in state["ids"]]
        self.step = int(state["step"])
        self.alpha = {i: np.asarray(a, np.float64) for i, a in zip(ids, state["alpha"])}
        self.prior = {i: np.asarray(a, np.float64) for i, a in zip(ids, state["prior"])}
        self.post = {i: np.asarray(a, np.float64) for i, a in zip(ids, state["post"])}
