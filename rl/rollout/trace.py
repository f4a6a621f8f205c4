"""TRACE: Tree Rollout Allocation for Contrastive Exploration (Zou et al., "TRACE: A Unified
Rollout Budget Allocation Framework for Efficient Agentic Reinforcement Learning", arXiv
2606.11119, 2026): spend a fixed budget of episodes on the prompt roots *and* the
intermediate turn prefixes most likely to give mixed outcomes.

Each thought-action-observation turn of a multi-turn episode is a node: an *anchor* of
depth t is a prefix h_t = (x, a_1, o_1, ..., a_t, o_t) of an episode (the prompt x, t model
turns and the observations after them; depth 0 is the prompt root). Continuing K episodes
from h_t gives K outcomes y_1..y_K ~ Bernoulli(p(h_t)), where p(h) is the policy's
conditional success probability from h; a group holds a learning signal only when its
outcomes are mixed, which happens with probability

    M_K(p) = 1 - p^K - (1 - p)^K                                     (mixed outcomes)

A shared predictor estimates p̂(h) for every candidate anchor from its prefix history, and
the budget goes to the anchors with the largest M_K(p̂(h)) (largest expected contrast; M_K
rises with p(1 - p) and is largest at p = 1/2).

Per batch of G groups of N episodes (the same G·N episodes as GRPO's G groups):
  1. stage 1: G1 = round(root_share · G) prompts of the stream are rolled out as ordinary
     groups (roots);
  2. every episode of stage 1 gives anchors, one after each observation that did not end
     it (depths min_depth .. turns - 1); anchors with the same tokens (prompt + prefix)
     are one candidate; the stream's next G2 = G - G1 prompts are the root candidates;
  3. the predictor learns from stage 1 (each root and anchor of an episode labelled with
     that episode's success), then the G2 candidates with the largest M_N(p̂) are rolled
     out, N episodes each: a root candidate as a fresh group, an anchor as N continuations
     of its prefix (its environment replayed through the prefix's turns, the prefix's KV
     prefilled once for the group and shared by its N episodes: the segmented layout);
  4. the predictor learns from stage 2's episodes. Until it has seen `warmup` examples of
     both classes, stage 2 takes the G2 root candidates in stream order: plain GRPO.
A continuation group trains like a group of the prefix as its prompt: the prefix is
context (it was trained on in the episode it came from), the advantage is taken over the
N continuations of the same prefix, so a turn-level decision is credited against its
siblings (the paper's enriched outcome-only feedback). Root candidates left unchosen are
consumed from the stream like the chosen ones: the data position moves G prompts per
batch, as GRPO's does.

The predictor is the online quality head of rl.rollout.pruning (ARRoL's): p̂(h) = σ(w · z
+ b) over z, the L2-normalised final hidden state at the anchor's last token (the state the
next turn is decoded from), trained by full-batch logistic-regression steps on the batch's
examples (y = [outcome > τ]).

Nothing here could be checked against code: as stored, the paper has no public repository,
and only its abstract and secondary summaries were at hand. What was assumed: the
mixed-outcome probability M_K as the allocation score, the two-stage schedule with a
root_share of the budget spent on roots first, a whole group of N continuations per chosen
anchor (the learner's batch holds groups of N, so the unit of allocation is a group), the
ARRoL head as the shared predictor, and replay (reset, then the prefix's turns stepped
again, each observation checked) to put an environment back at an anchor: an environment
whose replay differs ends that continuation with EndReason.ENV_ERROR (logged, counted).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl.envs.base import EndReason, Environment, Episode, Prompt, check_step_result
from rl.rollout.pruning import PruneConfig, QualityHead

CLEAN_ENDS = (EndReason.DONE, EndReason.MAX_TURNS, EndReason.TOKEN_BUDGET)


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """root_share: the share of a batch's groups rolled out from prompt roots first (stage
    1; at least one group each stage); min_depth: the shallowest intermediate anchor (model
    turns before it); threshold τ: an outcome > τ is a success; lr η, l2 λ, epochs, warmup:
    the predictor's update and the examples (of both classes) it sees before it allocates
    (rl.rollout.pruning.QualityHead)."""

    root_share: float = 0.5
    min_depth: int = 1
    threshold: float = 0.5
    lr: float = 1.0
    l2: float = 1e-4
    epochs: int = 4
    warmup: int = 64

    def __post_init__(self):
        r = self.root_share
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
            raise ValueError(f"TraceConfig.root_share must be a number in (0, 1), got {r!r}")
        for name, low in (("min_depth", 1), ("epochs", 1), ("warmup", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"TraceConfig.{name} must be an int >= {low}, got {v!r}")
        for name in ("threshold", "lr", "l2"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or (name != "threshold" and v < 0):
                raise ValueError(f"TraceConfig.{name} must be a finite number"
                                 f"{'' if name == 'threshold' else ' >= 0'}, got {v!r}")

    def stages(self, groups: int) -> tuple[int, int]:
        """(G1 root groups, G2 allocated groups) of a batch of `groups` (G >= 2)."""
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 2:
            raise ValueError(f"TRACE needs at least 2 groups per batch (one per stage), got "
                             f"{groups!r}; raise loop.prompts_per_step")
        g1 = min(max(int(round(self.root_share * groups)), 1), groups - 1)
        return g1, groups - g1

    def head_config(self) -> PruneConfig:
        """The predictor's settings as the quality head reads them."""
        return PruneConfig(threshold=self.threshold, lr=self.lr, l2=self.l2,
                           epochs=self.epochs, warmup=self.warmup)


def mixed_probability(p: Any, k: int) -> np.ndarray:
    """M_k(p) = 1 - p^k - (1 - p)^k [same shape as p], float64: the probability that k
    independent Bernoulli(p) outcomes are not all equal."""
    p = np.asarray(p, np.float64)
    return 1.0 - p ** k - (1.0 - p) ** k


@dataclasses.dataclass(frozen=True)
class Anchor:
    """A prefix to continue from: the task prompt and the first `depth` model turns of an
    episode with their observations (prefix_ids: those response tokens; turn_texts /
    observations: what the replay steps and checks)."""

    prompt: Prompt
    depth: int
    prefix_ids: tuple[int, ...]
    turn_texts: tuple[str, ...]
    observations: tuple[str, ...]

    @property
    def ids(self) -> tuple[int, ...]:
        """The continuation's prompt: task prompt + prefix."""
        return tuple(int(t) for t in self.prompt.ids) + self.prefix_ids

    def continued_prompt(self) -> Prompt:
        """The Prompt the continuations are submitted with (same answer, text and index)."""
        return dataclasses.replace(self.prompt, ids=self.ids)


def episode_anchors(record: Any, response_ids: Sequence[int], min_depth: int = 1
                    ) -> list[tuple[Anchor, int]]:
    """The intermediate anchors of one finished episode (an rl.rollout.episodes
    EpisodeRecord and its row's response ids): one after each observation that did not end
    it, at depths >= min_depth. Returns [(anchor, k)], k = the prefix's length in response
    tokens (the anchor's last token is response index k - 1). An episode that did not end
    cleanly (an error or a time limit: not a transcript to replay) gives none."""
    if record.end_reason not in CLEAN_ENDS:
        return []
    resp = [int(t) for t in response_ids]
    out, depth = [], 0
    for kind, _lo, hi in record.spans:
        if kind == "model":
            depth += 1
            continue
        if depth < min_depth or depth > len(record.observations):
            continue
        out.append((Anchor(prompt=record.prompt, depth=depth, prefix_ids=tuple(resp[:hi]),
                           turn_texts=tuple(record.turn_texts[:depth]),
                           observations=tuple(record.observations[:depth])), hi))
    return out


class ReplayMismatch(RuntimeError):
    """The environment did not retrace an anchor's prefix (it is not deterministic given
    the prompt and the turns)."""


def replay(env: Environment, anchor: Anchor) -> Episode:
    """A fresh episode of `env` put back at `anchor`: reset on its prompt, then each prefix
    turn stepped again; ReplayMismatch if a step ends the episode, is malformed or shows
    another observation than the one recorded."""
    episode = env.reset(anchor.prompt)
    for t, (text, obs) in enumerate(zip(anchor.turn_texts, anchor.observations), start=1):
        result = episode.step(text)
        why = check_step_result(result)
        if why is None and result.done:
            why = "the episode ended"
        if why is None and result.observation != obs:
            why = f"observation {result.observation!r:.60} instead of {obs!r:.60}"
        if why is not None:
            raise ReplayMismatch(f"replaying turn {t} of {anchor.depth}: {why} (TRACE "
                                 "continues anchors by replay: the environment must be "
                                 "deterministic given the prompt and the turns)")
    return episode


def unique_anchors(anchors: Sequence[Anchor]) -> list[int]:
    """Indices of the first anchor of each distinct token prefix (prompt + prefix), in
    order."""
    seen, out = set(), []
    for i, a in enumerate(anchors):
        if a.ids not in seen:
            seen.add(a.ids)
            out.append(i)
    return out


def top_scores(scores: Any, k: int) -> list[int]:
    """Indices of the k largest scores, best first; ties go to the lower index."""
    s = np.asarray(scores, np.float64)
    order = sorted(range(s.size), key=lambda i: (-s[i], i))
    return order[:max(0, int(k))]


class TraceAllocator:
    """The shared predictor and the allocation rule of one run (its state is
    checkpointed): `learn` from labelled anchors, `choose` the candidates of stage 2."""

    def __init__(self, config: TraceConfig, hidden_size: int):
        if not isinstance(config, TraceConfig):
            raise ValueError(f"config must be a TraceConfig, got {type(config).__name__}")
        self.config = config
        self.head = QualityHead(config.head_config(), hidden_size)

    @property
    def ready(self) -> bool:
        return self.head.ready

    def learn(self, hidden: Any, outcomes: Any) -> None:
        """One update on examples hidden [M, E] with their episodes' outcomes [M]."""
        y = np.asarray(outcomes, np.float64).reshape(-1) > self.config.threshold
        if y.size:
            self.head.update(hidden, y)

    def choose(self, hidden: Any, is_root: Sequence[bool], k: int, group_size: int
               ) -> tuple[list[int], np.ndarray]:
        """The k candidates (rows of hidden [C, E]; is_root[c]: a prompt root, else an
        anchor) stage 2 rolls out, best first, and their predicted p̂ [C]. Before the
        predictor is ready: the first k roots in order (plain GRPO; ValueError if there
        are fewer than k)."""
        c = len(is_root)
        p = self.head.predict(hidden) if c else np.zeros((0,), np.float64)
        if not self.ready:
            roots = [i for i in range(c) if is_root[i]]
            if len(roots) < k:
                raise ValueError(f"TRACE: {len(roots)} root candidates for {k} groups")
            return roots[:k], p
        return top_scores(mixed_probability(p, group_size), k), p

    def state(self) -> dict[str, Any]:
        return {"head": self.head.state()}

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state:
            raise ValueError("the checkpoint holds no TRACE predictor state")
        self.head.restore(state["head"])


def make_allocator(config: TraceConfig | None, hidden_size: int) -> TraceAllocator | None:
    return None if config is None else TraceAllocator(config, hidden_size)
