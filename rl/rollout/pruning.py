"""Online rollout pruning ("Prune as You Generate: Online Rollout Pruning for Faster and
Better RLVR", Xu et al. 2026, ARRoL): a light quality head predicts each partial
rollout's success, and the rollout engine stops some rollouts early so that the
survivors of a group are correctness-balanced.

Quality head (a linear probe on the policy's final hidden state). At a segment boundary
the engine reads h_i [E], the final-normed hidden state at sample i's last position
(`rl.rollout.sampler_core.pending_hidden`), and the head predicts

    z_i = h_i / ||h_i||_2                      (unit-norm features: one step size for any E)
    p_i = σ(w · z_i + b)                        the predicted P(reward_i > τ)

It is trained online on the rollouts that finish: once a group's rewards r_i are known,
each surviving sample gives one example (z_i at the group's pruning point, y_i = [r_i > τ])
and the head takes `epochs` full-batch gradient steps on the L2-regularised logistic loss
of the m new examples (float64, host-side numpy; deterministic):

    L(w, b) = (1/m) Σ_i [-y_i log p_i - (1 - y_i) log(1 - p_i)] + (λ/2) ||w||²
    w <- w - η ((1/m) Σ_i (p_i - y_i) z_i + λ w),   b <- b - η (1/m) Σ_i (p_i - y_i)

Pruning rule (decided once per group, at the first segment boundary where the group's
live samples have made >= `prune_at` tokens, and only once the head has seen `warmup`
examples of both classes). With p_i for all N samples of the group (finished ones count
with their prediction too) and S the survivors (initially all N), the predicted positive
ratio of the survivors is q(S) = mean_{i in S} p_i. Greedily, up to M = min(floor(
max_prune_frac * N), N - min_keep) times: remove the live sample whose removal brings
q(S) closest to the target ratio ρ, if that is strictly closer than q(S) is now; ties go
to the lowest index. So a group predicted mostly correct loses its most confident
rollouts, a group predicted mostly wrong its least promising ones, and a balanced group
loses none (the paper's target positive-reward ratio, ρ = 0.5 by default).

A pruned sample is marked done at once (it stops decoding and drawing tokens); its
group's block of N slots returns to the free list as soon as the survivors finish (at
once when no survivor is live), and a new group starts there: the segmented cache
stores a group's prompt once per aligned block, so the unit of slot reuse is the group.
In the harvested Trajectory a pruned row has finished = truncated = False (it ended
neither on a stop id nor on its budget: `pruned_rows`). `settle` (called by the sync
loop after scoring) hands the group to the learner with the pruned rows kept in place
(the batch keeps its [G, N] shape) but with an empty response (zero loss weight: no
token of theirs reaches the loss) and every reward set to the mean of the group's
survivors, so the group mean -- the GRPO / Dr. GRPO baseline -- is exactly the
survivors' mean. (A std-normalised estimator sees the survivors' spread scaled by
sqrt(K/N) for K survivors, sqrt((K-1)/(N-1)) with the unbiased std: their advantages keep
sign and order but grow by the inverse factor, a per-group step size.)

Nothing below could be checked against code: the official repository (Hsu1023/ARRoL)
holds, as stored, only a README announcing the code "soon". Secondary summaries of the
paper confirm only the target positive ratio ρ = 0.5 and a quality head trained online.
What was assumed (the paper's text was not at hand beyond its abstract and summary): the
head's input (the last position's final hidden state, L2-normalised), its training
(online logistic regression by full-batch gradient steps, η = 1, 4 steps per batch,
λ = 1e-4, τ = 0.5), one pruning point per group at `prune_at` tokens, the greedy
balancing rule above with ρ = 0.5, at most half of a group pruned, >= 2 survivors.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """prune_at: tokens a group's live samples must have made before it is scored;
    target_ratio ρ: the survivors' predicted positive ratio the rule steers to;
    max_prune_frac: at most floor(frac * N) samples of a group pruned; min_keep: survivors
    kept at least; threshold τ: a reward > τ is a success; lr η, l2 λ, epochs: the head's
    update; warmup: examples (of both classes) the head sees before it prunes."""

    prune_at: int = 2
    target_ratio: float = 0.5
    max_prune_frac: float = 0.5
    min_keep: int = 2
    threshold: float = 0.5
    lr: float = 1.0
    l2: float = 1e-4
    epochs: int = 4
    warmup: int = 64

    def __post_init__(self):
        for name, low in (("prune_at", 1), ("min_keep", 1), ("epochs", 1), ("warmup", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"PruneConfig.{name} must be an int >= {low}, got {v!r}")
        for name, low, high in (("target_ratio", 0.0, 1.0), ("max_prune_frac", 0.0, 1.0),
                                ("lr", 0.0, math.inf), ("l2", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
                raise ValueError(f"PruneConfig.{name} must be a number in [{low}, {high}], "
                                 f"got {v!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold):
            raise ValueError(f"PruneConfig.threshold must be a finite number, got "
                             f"{self.threshold!r}")


def unit_features(hidden: Any) -> np.ndarray:
    """hidden [M, E] -> z [M, E] float64, each row divided by its L2 norm (0 stays 0)."""
    h = np.asarray(hidden, np.float64)
    norm = np.linalg.norm(h, axis=-1, keepdims=True)
    return h / np.where(norm > 0, norm, 1.0)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1 / (1 + e^-x), without overflow


class QualityHead:
    """The linear probe p = σ(w · z + b) over unit-norm hidden states z [E] (float64),
    with its online logistic-regression update. state()/restore() give plain JSON."""

    def __init__(self, config: PruneConfig, dim: int):
        self.config, self.dim = config, int(dim)
        self.w = np.zeros((self.dim,), np.float64)
        self.b = 0.0
        self.seen = 0  # examples learned from
        self.positives = 0

    @property
    def ready(self) -> bool:
        """Whether the head may prune: warmup examples seen, both classes among them."""
        return (self.seen >= self.config.warmup and 0 < self.positives < self.seen)

    def predict(self, hidden: Any) -> np.ndarray:
        """hidden [M, E] -> p [M] float64 in (0, 1)."""
        return _sigmoid(unit_features(hidden) @ self.w + self.b)

    def update(self, hidden: Any, labels: Any) -> None:
        """`epochs` full-batch gradient steps on the examples hidden [M, E], labels [M]
        (bool or 0/1; see the module doc for the formula)."""
        z = unit_features(hidden)
        y = np.asarray(labels, np.float64).reshape(-1)
        if z.shape != (y.size, self.dim):
            raise ValueError(f"QualityHead.update: hidden must be [M, {self.dim}] with M = "
                             f"{y.size} labels, got {z.shape}")
        if y.size == 0:
            return
        c = self.config
        for _ in range(c.epochs):
            err = _sigmoid(z @ self.w + self.b) - y
            gw = z.T @ err / y.size + c.l2 * self.w
            gb = float(err.mean())
            self.w = self.w - c.lr * gw
            self.b = self.b - c.lr * gb
        self.seen += int(y.size)
        self.positives += int((y > 0.5).sum())

    def state(self) -> dict[str, Any]:
        return {"w": [float(x) for x in self.w], "b": float(self.b), "seen": self.seen,
                "positives": self.positives}

    def restore(self, state: dict[str, Any]) -> None:
        w = np.asarray(state["w"], np.float64)
        if w.shape != (self.dim,):
            raise ValueError(f"QualityHead.restore: w has shape {w.shape}, the head has "
                             f"dim {self.dim} (the policy's hidden size)")
        self.w, self.b = w, float(state["b"])
        self.seen, self.positives = int(state["seen"]), int(state["positives"])


def balanced_prune(p: Any, live: Any, target: float, max_prune: int) -> list[int]:
    """The greedy balancing rule (module doc): indices (ascending) of the live samples to
    prune from a group with predicted success p [N] and live [N] bool, pruning at most
    max_prune."""
    p = np.asarray(p, np.float64)
    live = np.asarray(live, bool)
    keep = np.ones(p.shape, bool)
    out: list[int] = []
    for _ in range(max(0, int(max_prune))):
        k = int(keep.sum())
        if k <= 1:
            break
        now = abs(p[keep].mean() - target)
        total = p[keep].sum()
        best, best_gap = -1, now
        for i in np.nonzero(keep & live)[0]:
            gap = abs((total - p[i]) / (k - 1) - target)
            if gap < best_gap:
                best, best_gap = int(i), gap
        if best < 0:
            break
        keep[best] = False
        out.append(best)
    return sorted(out)


class Pruner:
    """The quality head plus the pruning rule, shared by every engine of a run (its
    state is checkpointed). The engine calls `due` and `decide`; the loop calls `settle`
    (through `settle_rollouts`) once the rewards are known."""

    def __init__(self, config: PruneConfig, hidden_size: int):
        if not isinstance(config, PruneConfig):
            raise ValueError(f"config must be a PruneConfig, got {type(config).__name__}")
        self.config = config
        self.head = QualityHead(config, hidden_size)
        self.pending: dict[int, np.ndarray] = {}  # group id -> features [N, E] at its point
        self.counts = {"pruned": 0, "pruned_tokens": 0, "tokens_saved": 0}

    def due(self, n_gen: np.ndarray, done: np.ndarray) -> bool:
        """Whether a group (n_gen, done [N]) reached its pruning point: some sample live,
        every live one >= prune_at tokens."""
        live = ~np.asarray(done, bool)
        return bool(live.any()) and int(np.asarray(n_gen)[live].min()) >= self.config.prune_at

    def decide(self, group_id: int, hidden: np.ndarray, live: np.ndarray) -> list[int]:
        """Record the group's features hidden [N, E] (its training examples later) and
        return the sample indices to prune now (none before the head is ready)."""
        self.pending[int(group_id)] = np.asarray(hidden, np.float32)
        if not self.head.ready:
            return []
        n = len(live)
        max_prune = min(int(math.floor(self.config.max_prune_frac * n)),
                        n - self.config.min_keep)
        return balanced_prune(self.head.predict(hidden), live, self.config.target_ratio,
                              max_prune)

    def state(self) -> dict[str, Any]:
        return {"head": self.head.state()}

    def restore(self, state: dict[str, Any] | None) -> None:
        if not isinstance(state, dict) or "head" not in state:
            raise ValueError("the checkpoint holds no pruner state (was it saved without "
                             "--prune?); resume without --prune or start a new run")
        self.head.restore(state["head"])


def pruned_rows(traj: Trajectory) -> np.ndarray:
    """[B] bool: rows the engine pruned (ended neither on a stop id nor on the budget)."""
    return ~np.asarray(traj.finished, bool) & ~np.asarray(traj.truncated, bool)


def settle_rollouts(pruner: Pruner, traj: Trajectory, rewards: dict[str, np.ndarray],
                    success: np.ndarray, group_size: int
                    ) -> tuple[Trajectory, dict[str, np.ndarray], dict[str, float]]:
    """After scoring a batch (rows grouped by group_ids, group g = rows g*N .. g*N+N-1,
    engine group id g): train the head on the survivors of every group that reached its
    pruning point (label success[i] > τ), then hand the pruned rows to the learner as in
    the module doc: empty response, every reward = the mean of the group's survivors.
    Returns (traj, rewards, stats: pruned rows, pruned_tokens they had made, tokens_saved
    = the budget they had left, head_examples)."""
    n = group_size
    cut = pruned_rows(traj)
    gids = np.asarray(traj.group_ids)
    feats, labels = [], []
    for g in range(traj.batch_size // n):
        rows = slice(g * n, (g + 1) * n)
        h = pruner.pending.pop(int(gids[g * n]), None)
        if h is not None:
            keep = ~cut[rows]
            feats.append(h[keep])
            labels.append(np.asarray(success, np.float64)[rows][keep] > pruner.config.threshold)
    pruner.pending.clear()
    if feats:
        pruner.head.update(np.concatenate(feats), np.concatenate(labels))
    stats = {"pruned": float(cut.sum()), "pruned_tokens": float(pruner.counts["pruned_tokens"]),
             "tokens_saved": float(pruner.counts["tokens_saved"]),
             "head_examples": float(pruner.head.seen)}
    pruner.counts = dict.fromkeys(pruner.counts, 0)
    if not cut.any():
        return traj, rewards, stats
    out = {}
    for name, v in rewards.items():
        v = np.asarray(v, np.float64).copy().reshape(-1, n)
        c = cut.reshape(-1, n)
        for g in np.nonzero(c.any(axis=1))[0]:
            v[g, c[g]] = v[g, ~c[g]].mean()
        out[name] = v.reshape(-1)
    m = cut[:, None]
    traj = traj.replace(
        response_ids=jnp.where(m, 0, traj.response_ids),
        response_mask=jnp.asarray(traj.response_mask) & ~m,
        behaviour_logprobs=jnp.where(m, 0.0, traj.behaviour_logprobs),
        versions=jnp.where(m, 0, traj.versions))
    return traj, out, stats


def make_pruner(config: PruneConfig | None, hidden_size: int) -> Pruner | None:
    """A Pruner for a model of this hidden size, or None when pruning is off."""
    if config is None:
        return None
    if jax.process_count() > 1:
        raise ValueError("online pruning (--prune) runs in one process; drop it or the "
                         "multi-process flags")
    return Pruner(config, hidden_size)
