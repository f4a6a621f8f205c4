"""TRACE's two-stage batch in the loops (rl.rollout.trace has the method, its formulas and
assumptions): stage 1 rolls out root groups, the predictor learns from them and picks the
roots or intermediate turn prefixes stage 2 rolls out, then learns from stage 2.

    TraceRound        what a round needs beside the model: the allocator and the outcome
                      signal its predictor learns
    trace_groups      one batch of G groups of an environment's episodes (G1 roots, then
                      G2 allocated groups), rows grouped, every prompt buffer widened to
                      max_episode_tokens - 1 (one compiled learner shape), with its counts
    anchor_examples   a batch's predictor examples: every root and intermediate anchor of
                      every row, with the row it came from
    hidden_at         final-normed hidden states at (row, position) pairs of a batch

Counts of one batch (summed over a step's rounds; batch metrics trace_*): head_ready (1
when the allocation used the predictor), root_groups / anchor_groups (stage 2's groups
from fresh prompts / from intermediate prefixes), anchor_depth (turns in the chosen
prefixes, summed), candidates (distinct anchors offered), predicted_mixed (M_N(p̂) summed
over the chosen), mixed_stage1 / mixed_stage2 (groups whose outcomes differ), groups_stage1
/ groups_stage2, replay_failures (continuations whose environment did not retrace its
prefix).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.decoder import hidden_states
from rl.envs.base import EndReason
from rl.loops.episodes import episode_rewards, sample_episode_groups
from rl.rollout.multiturn import EpisodeStart
from rl.rollout.trace import (
    Anchor,
    TraceAllocator,
    episode_anchors,
    mixed_probability,
    replay,
    unique_anchors,
)
from rl.runtime.logging import NULL_PROFILE
from rl.tasks.base import Prompt
from rl.trajectory import Trajectory, concat_trajectories


def anchor_examples(traj: Trajectory, records: Sequence[Any], min_depth: int
                    ) -> tuple[list[tuple[int, int]], list[tuple[Anchor, int, int]]]:
    """(examples, anchors) of a batch of episodes: examples = [(row, position)], one at
    each row's root (its prompt's last token, position P - 1) and one per intermediate
    anchor (the prefix's last token, position P + k - 1); anchors = [(Anchor, row,
    position)] of the intermediate ones (rl.rollout.trace.episode_anchors)."""
    plen = np.asarray(traj.prompt_lengths)
    resp = np.asarray(traj.response_ids)
    examples, anchors = [], []
    for row, rec in enumerate(records):
        p = int(plen[row])
        examples.append((row, p - 1))
        for anchor, k in episode_anchors(rec, resp[row], min_depth):
            examples.append((row, p + k - 1))
            anchors.append((anchor, row, p + k - 1))
    return examples, anchors


@jax.jit
def _gather(h, rows, pos):
    return h[rows, pos].astype(jnp.float32)


def hidden_at(params: Any, config: ModelConfig, rows_tokens: Sequence[Sequence[int]],
              at: Sequence[tuple[int, int]], width: int) -> np.ndarray:
    """[M, E] float32: the final-normed hidden state at each (row, position) of `at`, the
    rows_tokens right-padded to `width` (a fixed width: one compile)."""
    if not at:
        return np.zeros((0, config.hidden_size), np.float32)
    tokens = np.zeros((len(rows_tokens), width), np.int32)
    for i, ids in enumerate(rows_tokens):
        tokens[i, :len(ids)] = ids
    m = len(at)
    bucket = 1 << (m - 1).bit_length()  # gathers of a few sizes: few compiles
    rows = np.zeros((bucket,), np.int32)
    pos = np.zeros((bucket,), np.int32)
    rows[:m], pos[:m] = zip(*at)
    h = hidden_states(params, config, tokens)
    return np.asarray(_gather(h, rows, pos))[:m]


def row_tokens(traj: Trajectory) -> list[list[int]]:
    """Each row's prompt + response ids."""
    plen, pids = np.asarray(traj.prompt_lengths), np.asarray(traj.prompt_ids)
    rmask, rids = np.asarray(traj.response_mask), np.asarray(traj.response_ids)
    return [pids[i, :plen[i]].tolist() + rids[i, :int(rmask[i].sum())].tolist()
            for i in range(traj.batch_size)]


def mixed_groups(signal: np.ndarray, group_size: int) -> int:
    """Groups whose outcomes are not all equal."""
    s = np.asarray(signal, np.float64).reshape(-1, group_size)
    return int((s.max(axis=1) > s.min(axis=1)).sum())


class TraceRound(NamedTuple):
    """allocator: the stateful TraceAllocator (its predictor learns in place);
    signal(rewards) -> [B]: the outcome the predictor learns (the loop's scheduler
    signal)."""

    allocator: TraceAllocator
    signal: Callable[[dict], np.ndarray]


def trace_groups(params: Any, version: int, spec: Any, prompts: Sequence[Prompt], *,
                 seed: int, first_group_id: int, trace: TraceRound, profile=NULL_PROFILE
                 ) -> tuple[Trajectory, dict[str, float]]:
    """One TRACE batch of len(prompts) = G groups of spec.group_size episodes of spec.task
    (an EnvTask): the first G1 prompts are stage 1's roots, the other G2 stage 2's root
    candidates (module doc, rl.rollout.trace), allocated by trace.allocator. Rows: stage
    1's groups, then stage 2's, group ids 0..G-1; the records go to task.record. Returns
    (traj, counts)."""
    allocator, signal = trace
    task, n, cfg = spec.task, spec.group_size, allocator.config
    env = task.env
    g1, g2 = cfg.stages(len(prompts))
    width = int(env.max_episode_tokens) - 1  # the prompt buffer of a continued episode
    roots, fresh = list(prompts[:g1]), list(prompts[g1:])
    traj1, recs1 = sample_episode_groups(params, version, spec, roots, seed=seed,
                                         first_group_id=first_group_id, profile=profile)
    y1 = signal(episode_rewards(task, traj1))
    with profile.phase("host_s"):
        ex1, anchors = anchor_examples(traj1, recs1, cfg.min_depth)
        rows = row_tokens(traj1) + [list(p.ids) for p in fresh]
        at = ex1 + [(traj1.batch_size + i, len(p.ids) - 1) for i, p in enumerate(fresh)]
        feats = hidden_at(params, spec.sampler_config, rows, at, width + 1)
        allocator.learn(feats[:len(ex1)], y1[[r for r, _ in ex1]])
        unique = unique_anchors([a for a, _, _ in anchors])
        pos = {q: i for i, q in enumerate(ex1)}
        cand = np.concatenate([feats[len(ex1):],
                               feats[[pos[(anchors[u][1], anchors[u][2])] for u in unique]]])
        kinds = [True] * len(fresh) + [False] * len(unique)
        ready = allocator.ready
        chosen, p_hat = allocator.choose(cand, kinds, g2, n)
        stage2, starts, depths = [], [], []
        for c in chosen:
            if kinds[c]:
                stage2.append(fresh[c])
                starts.append(None)
            else:
                anchor = anchors[unique[c - len(fresh)]][0]
                stage2.append(anchor.continued_prompt())
                starts.append(EpisodeStart(turns=anchor.depth,
                                           reset=functools.partial(replay, env, anchor)))
                depths.append(anchor.depth)
    traj2, recs2 = sample_episode_groups(params, version, spec, stage2, seed=seed,
                                         first_group_id=first_group_id + g1, profile=profile,
                                         starts=starts)
    y2 = signal(episode_rewards(task, traj2))
    with profile.phase("host_s"):
        ex2, _ = anchor_examples(traj2, recs2, cfg.min_depth)
        allocator.learn(hidden_at(params, spec.sampler_config, row_tokens(traj2), ex2,
                                  width + 1), y2[[r for r, _ in ex2]])
        traj = concat_trajectories([traj1, traj2.replace(
            group_ids=np.asarray(traj2.group_ids) + g1)])
        task.record(recs1 + recs2, traj)
    failures = sum(rec.end_reason == EndReason.ENV_ERROR and "replaying turn" in
                   (rec.message or "") for rec in recs2)
    counts = {"head_ready": float(ready), "root_groups": float(len(chosen) - len(depths)),
              "anchor_groups": float(len(depths)), "anchor_depth": float(sum(depths)),
              "candidates": float(len(unique)),
              "predicted_mixed": float(mixed_probability(p_hat[chosen], n).sum()),
              "mixed_stage1": float(mixed_groups(y1, n)), "groups_stage1": float(g1),
              "mixed_stage2": float(mixed_groups(y2, n)), "groups_stage2": float(g2),
              "replay_failures": float(failures)}
    return traj, counts


def trace_metrics(counts: dict[str, float]) -> dict[str, float]:
    """A step's TRACE counts as batch metrics: trace_<count>, plus the shares
    trace_mixed_share_stage1 / _stage2 (mixed groups per group) and trace_anchor_depth as
    a mean over the anchor groups; {} without TRACE."""
    if not counts:
        return {}
    out = {f"trace_{k}": v for k, v in counts.items()}
    for s in ("stage1", "stage2"):
        out[f"trace_mixed_share_{s}"] = counts[f"mixed_{s}"] / max(counts[f"groups_{s}"], 1.0)
    out["trace_anchor_depth"] = counts["anchor_depth"] / max(counts["anchor_groups"], 1.0)
    return out
