"""Round-based rollout strategies over `rl.rollout.RolloutEngine`: APRIL (active partial
rollouts) and the two baselines it is compared with, all with one interface:

    ro = AprilRollout(model_config, RolloutConfig(...), prompts=iter(prompt_lists), april=AprilConfig())
    traj = ro.collect(params, version, num_groups, accept=None)   # one round -> Trajectory
    ro.counts        # submitted, harvested, rejected, dropped, in_fifo, in_engine, resumed, wasted_tokens
    ro.last_round    # this round's steps, generated / trained / off-policy tokens, seconds, ...
    ro.state_dict(); ro.load_state_dict(d)                         # FIFO + counters, numpy

A round returns exactly `num_groups` complete groups (fewer only when the prompt source
runs dry), each passing `accept(one_group_trajectory) -> bool` if given (e.g. DAPO's
dynamic sampling); rejected groups are counted, kept in `last_rejected` and replaced by
one more start each (at most `max_rejected` per round, then a ValueError).

* StaticRollout: starts exactly num_groups groups and waits until ALL have finished;
  nothing is refilled (pure static batching when num_slots >= num_groups × group_size).
* ContinuousRollout: refills free slots with new prompts at every segment boundary and
  ends the round as soon as num_groups groups are complete; the groups still running
  are DROPPED: counted in `dropped` and their tokens in `wasted_tokens`, never trained.
* AprilRollout: starts at most ⌈over_provision × num_groups⌉ groups per round (refilling
  free slots as they open), the FIFO of groups carried over from earlier rounds FIRST and
  new prompts only for the rest; ends the round when num_groups groups are complete and
  moves the unfinished ones, whole (partial responses, behaviour log-probs, versions, rng
  positions), to the back of the FIFO. No rollout is discarded. A resumed group's KV is
  rebuilt by the engine under the round's params and its samples keep their total
  budget (RolloutConfig.max_new_tokens), so max_new_tokens − len(partial) tokens remain.

Every strategy carries complete groups beyond num_groups (several can finish in the same
segment) to the next round through the same FIFO: they are put back into the engine,
which returns them finished at its next step. Invariant, between calls and inside
`accept` (complete groups taken out this round and not yet returned count as in_engine):
    submitted == harvested + rejected + dropped + in_fifo + in_engine
(dropped is 0 for APRIL and static). Group ids in the returned trajectories are global
and unique over the object's life (also across `load_state_dict`).

Off-policy prefix (AprilConfig.mask_offpolicy_prefix): `apply_mask(batch)` returns the
TrainBatch with loss_mask False at response tokens drawn under a version older than the
last round's (a loss MASK, so token / sequence normalisers exclude them too).
"""
from __future__ import annotations

import abc
import collections
import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from models.config import ModelConfig
from rl.rollout.engine import PartialGroup, RolloutConfig, RolloutEngine
from rl.rollout.sampler import PartialSample
from rl.trajectory import Trajectory, concat_trajectories

Accept = Callable[[Trajectory], bool]
_COUNTERS = ("submitted", "harvested", "rejected", "dropped", "resumed", "wasted_tokens")


@dataclasses.dataclass(frozen=True)
class AprilConfig:
    """over_provision: groups started per round / groups returned (>= 1);
    mask_offpolicy_prefix: `apply_mask` drops tokens older than the round's version from
    the loss; max_rejected: rejected groups allowed per round before a ValueError
    (None = 4 × num_groups, like DAPO's bounded resampling)."""

    over_provision: float = 1.5
    mask_offpolicy_prefix: bool = False
    max_rejected: int | None = None

    def __post_init__(self):
        op = self.over_provision
        if isinstance(op, bool) or not isinstance(op, (int, float)) or not (math.isfinite(op) and op >= 1.0):
            raise ValueError(f"AprilConfig.over_provision must be a finite number >= 1 (groups "
                             f"started per group returned), got {op!r}")
        if not isinstance(self.mask_offpolicy_prefix, bool):
            raise ValueError(f"AprilConfig.mask_offpolicy_prefix must be True or False, got "
                             f"{self.mask_offpolicy_prefix!r}")
        _check_max_rejected(self.max_rejected)


def _check_max_rejected(v):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ValueError(f"max_rejected must be an int >= 0 or None, got {v!r}")


def offpolicy_prefix_mask(versions: Any, mask: Any, version: int) -> np.ndarray:
    """mask & (versions >= version): drop tokens drawn under a version older than
    `version`. versions / mask: any matching shapes, e.g. a TrainBatch's [B, T]."""
    versions, mask = np.asarray(versions), np.asarray(mask, bool)
    if versions.shape != mask.shape:
        raise ValueError(f"versions {versions.shape} and mask {mask.shape} must have the same shape")
    return mask & (versions >= int(version))


def _split_groups(traj: Trajectory, n: int) -> list[Trajectory]:
    """A harvested Trajectory (groups as contiguous blocks of n rows) -> one per group."""
    host = jax.tree.map(np.asarray, traj)
    return [jax.tree.map(lambda x, i=i: x[i * n:(i + 1) * n], host) for i in range(traj.batch_size // n)]


def _as_partial(group: Trajectory, budget: int) -> PartialGroup:
    """A complete one-group Trajectory as a PartialGroup whose samples are all done (the
    engine harvests it at its next step; a done sample never draws, so its key is unused)."""
    plen, rlen = np.asarray(group.prompt_lengths), np.asarray(group.response_mask).sum(1)
    prompt = np.asarray(group.prompt_ids)[0, :plen[0]].astype(np.int32)
    samples = tuple(PartialSample(
        prompt_ids=prompt, response_ids=np.asarray(group.response_ids)[i, :rlen[i]].astype(np.int32),
        logprobs=np.asarray(group.behaviour_logprobs)[i, :rlen[i]].astype(np.float32),
        versions=np.asarray(group.versions)[i, :rlen[i]].astype(np.int32),
        key=np.zeros((2,), np.uint32), budget=budget, done=True,
        stopped=bool(np.asarray(group.finished)[i])) for i in range(rlen.size))
    return PartialGroup(group_id=int(np.asarray(group.group_ids)[0]), prompt_ids=prompt, samples=samples)


class _RoundRollout(abc.ABC):
    """The shared round loop; subclasses set the start budget, when a round may end early,
    and what happens to groups still running at its end."""

    strategy = ""
    stops_early = True  # end the round as soon as num_groups groups are complete
    keeps_unfinished = True  # unfinished groups go to the FIFO (else they are dropped)

    def __init__(self, model_config: ModelConfig, rollout: RolloutConfig,
                 prompts: Iterable[Sequence[int]], max_rejected: int | None = None):
        if not isinstance(rollout, RolloutConfig):
            raise ValueError(f"rollout must be a RolloutConfig, got {type(rollout).__name__}")
        _check_max_rejected(max_rejected)
        self.model_config, self.rollout, self.max_rejected = model_config, rollout, max_rejected
        self._prompts = iter(prompts)
        self.engine = RolloutEngine(model_config, rollout)
        self._fifo: collections.deque[PartialGroup] = collections.deque()
        self._ids: dict[int, int] = {}  # engine group id -> global group id, while in the engine
        self._next_id = 0
        self._restores = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._in_hand = 0  # complete groups out of the engine, not yet returned / rejected / carried
        self.round_version: int | None = None
        self.last_round: dict[str, float] = {}
        self.last_rejected: list[Trajectory] = []

    # ------------------------------------------------------------------ policy
    @abc.abstractmethod
    def _start_budget(self, num_groups: int) -> int | None:
        """Groups this round may start (FIFO resumes included); None = unlimited."""

    # ------------------------------------------------------------------ counts
    @property
    def counts(self) -> dict[str, int]:
        """submitted (new prompts started), harvested (returned for training), rejected,
        dropped, in_fifo, in_engine (groups in the slots or queued for them, plus complete
        ones taken out this round and not yet returned), resumed (FIFO groups put back),
        wasted_tokens (tokens of dropped groups). Between calls and inside `accept`:
        submitted == harvested + rejected + dropped + in_fifo + in_engine."""
        return {**self._counts, "in_fifo": len(self._fifo),
                "in_engine": self.engine.num_active_groups + self.engine.num_queued + self._in_hand}

    @property
    def fifo(self) -> tuple[PartialGroup, ...]:
        """Groups carried to the next round, oldest first (global group ids)."""
        return tuple(self._fifo)

    # ------------------------------------------------------------------ the round
    def _feed(self, limit: int | None) -> tuple[int, int]:
        """Start groups while a whole group fits in the free slots (FIFO first), at most
        `limit`. Returns (started, resumed)."""
        n = self.rollout.group_size
        room = self.engine.num_free_slots // n - self.engine.num_queued
        started = resumed = 0
        while room > 0 and (limit is None or started < limit):
            if self._fifo:
                g = self._fifo.popleft()
                self.engine.resume([g])
                self._ids[g.group_id] = g.group_id  # the engine keeps a resumed group's id
                self._counts["resumed"] += 1
                resumed += 1
            else:
                try:
                    prompt = next(self._prompts)
                except StopIteration:
                    break
                (eid,) = self.engine.submit([prompt])
                self._ids[eid] = self._next_id
                self._next_id += 1
                self._counts["submitted"] += 1
            room -= 1
            started += 1
        return started, resumed

    def _global(self, group_id: int) -> int:
        return self._ids.pop(int(group_id))

    def collect(self, params: Any, version: int, num_groups: int,
                accept: Accept | None = None) -> Trajectory:
        """Run one round under `params` (stamped `version`) and return `num_groups`
        complete groups as one Trajectory (rows grouped, group by group). accept, if
        given, sees each complete group (a one-group Trajectory) and returns whether to
        keep it. Fewer groups come back only if the prompt source is exhausted (a
        ValueError if none)."""
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if accept is not None and not callable(accept):
            raise ValueError("accept must be a callable (one-group Trajectory -> bool) or None, "
                             f"got {accept!r}")
        num_groups, version = int(num_groups), int(version)
        max_rej = 4 * num_groups if self.max_rejected is None else self.max_rejected
        t0 = time.perf_counter()
        budget = self._start_budget(num_groups)
        self.round_version = version
        self.last_rejected = []
        kept: list[Trajectory] = []
        steps = generated = starts = resumed = 0
        while not (self.stops_early and len(kept) >= num_groups):
            s, r = self._feed(None if budget is None else budget - starts)
            starts, resumed = starts + s, resumed + r
            if self.engine.num_active_groups + self.engine.num_queued == 0:
                break  # all started groups are done and nothing more may / can start
            generated += self.engine.step(params, version).new_tokens
            steps += 1
            traj = self.engine.harvest()
            done = [] if traj is None else [
                g.replace(group_ids=np.full_like(g.group_ids, self._global(g.group_ids[0])))
                for g in _split_groups(traj, self.rollout.group_size)]
            self._in_hand += len(done)
            for i, g in enumerate(done):
                try:
                    ok = accept is None or bool(accept(g))
                except BaseException:
                    self._end_round(kept + done[i:], 0)  # nothing is lost if accept fails
                    raise
                if ok:
                    kept.append(g)
                    continue
                self.last_rejected.append(g)
                self._in_hand -= 1
                self._counts["rejected"] += 1
                if budget is not None:
                    budget += 1  # replace it
                if len(self.last_rejected) > max_rej:
                    self._end_round(kept + done[i + 1:], 0)
                    raise ValueError(
                        f"accept rejected {len(self.last_rejected)} groups in one round (more than "
                        f"max_rejected={max_rej}); the accepted ones were carried to the FIFO. "
                        "Raise max_rejected or loosen the filter")
        out_groups = kept[:num_groups]
        dropped, wasted = self._end_round(kept, num_groups)
        if not out_groups:
            raise ValueError("the prompt source is exhausted: no complete group to return")
        self._in_hand -= len(out_groups)
        self._counts["harvested"] += len(out_groups)
        out = concat_trajectories(out_groups)
        mask, ver = np.asarray(out.response_mask), np.asarray(out.versions)
        self.last_round = {
            "seconds": time.perf_counter() - t0, "steps": steps, "generated_tokens": generated,
            "trained_tokens": int(mask.sum()), "offpolicy_tokens": int((mask & (ver < version)).sum()),
            "started": starts, "resumed": resumed, "rejected": len(self.last_rejected),
            "carried": len(self._fifo), "dropped": dropped, "wasted_tokens": wasted,
        }
        return out

    def _end_round(self, kept: list[Trajectory], num_groups: int) -> tuple[int, int]:
        """Carry complete groups past num_groups and (APRIL) the unfinished ones to the
        FIFO, oldest group first; drop the unfinished ones otherwise. Returns (dropped
        groups, their tokens)."""
        carry = [_as_partial(g, self.rollout.max_new_tokens) for g in kept[num_groups:]]
        self._in_hand -= len(carry)
        unfinished = [dataclasses.replace(g, group_id=self._global(g.group_id))
                      for g in self.engine.extract_unfinished()]
        dropped = wasted = 0
        if self.keeps_unfinished:
            carry += unfinished
        else:
            dropped, wasted = len(unfinished), sum(sum(g.num_generated) for g in unfinished)
            self._counts["dropped"] += dropped
            self._counts["wasted_tokens"] += wasted
        self._fifo.extend(sorted(carry, key=lambda g: g.group_id))
        return dropped, wasted

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The FIFO and counters as numpy arrays (between rounds: the engine is empty then).
        The prompt iterator is not part of it: resume with one positioned after the
        counts["submitted"] prompts already taken."""
        if self.engine.num_active_groups or self.engine.num_queued:
            raise ValueError("state_dict: groups are still in the engine; call it between rounds")
        n, p_max, r_max = self.rollout.group_size, self.rollout.max_prompt_len, self.rollout.max_new_tokens
        f = len(self._fifo)
        fifo = {"group_ids": np.zeros((f,), np.int64), "prompt_ids": np.zeros((f, p_max), np.int32),
                "prompt_lengths": np.zeros((f,), np.int32),
                "response_ids": np.zeros((f, n, r_max), np.int32),
                "num_generated": np.zeros((f, n), np.int32),
                "logprobs": np.zeros((f, n, r_max), np.float32),
                "versions": np.full((f, n, r_max), -1, np.int32),
                "keys": np.zeros((f, n, 2), np.uint32), "budget": np.zeros((f, n), np.int32),
                "done": np.zeros((f, n), bool), "stopped": np.zeros((f, n), bool)}
        for i, g in enumerate(self._fifo):
            p = g.prompt_ids.size
            fifo["group_ids"][i], fifo["prompt_lengths"][i] = g.group_id, p
            fifo["prompt_ids"][i, :p] = g.prompt_ids
            for j, s in enumerate(g.samples):
                k = s.num_generated
                fifo["num_generated"][i, j] = k
                fifo["response_ids"][i, j, :k], fifo["logprobs"][i, j, :k] = s.response_ids, s.logprobs
                fifo["versions"][i, j, :k], fifo["keys"][i, j] = s.versions, s.key
                fifo["budget"][i, j], fifo["done"][i, j], fifo["stopped"][i, j] = s.budget, s.done, s.stopped
        return {"strategy": np.asarray(self.strategy),
                "counts": {k: np.asarray(v, np.int64) for k, v in self._counts.items()},
                "next_group_id": np.asarray(self._next_id, np.int64),
                "restores": np.asarray(self._restores, np.int64), "fifo": fifo}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore the FIFO and counters from `state_dict()` (engine must be empty). New
        groups keep getting fresh global ids; the engine is rebuilt with a seed derived from
        the rollout seed and the restore count, so new groups get new sampling streams
        (resumed FIFO samples keep their own)."""
        if self.engine.num_active_groups or self.engine.num_queued:
            raise ValueError("load_state_dict: groups are still in the engine; load between rounds")
        try:
            strategy = str(np.asarray(d["strategy"]))
            counts = {k: int(np.asarray(d["counts"][k])) for k in _COUNTERS}
            fifo = {k: np.asarray(v) for k, v in d["fifo"].items()}
            next_id, restores = int(np.asarray(d["next_group_id"])), int(np.asarray(d["restores"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"load_state_dict: not a {type(self).__name__} state dict ({e!r})") from None
        if strategy != self.strategy:
            raise ValueError(f"load_state_dict: state of a {strategy!r} rollout, this is {self.strategy!r}")
        n, r_max = self.rollout.group_size, self.rollout.max_new_tokens
        if fifo["response_ids"].ndim != 3 or fifo["response_ids"].shape[1:] != (n, r_max) \
                or fifo["prompt_ids"].shape[1] > self.rollout.max_prompt_len:
            raise ValueError(f"load_state_dict: FIFO arrays {fifo['response_ids'].shape} / prompts "
                             f"{fifo['prompt_ids'].shape} do not fit group_size={n}, max_new_tokens="
                             f"{r_max}, max_prompt_len={self.rollout.max_prompt_len}")
        groups = []
        for i in range(fifo["group_ids"].shape[0]):
            prompt = fifo["prompt_ids"][i, :fifo["prompt_lengths"][i]].astype(np.int32)
            samples = []
            for j in range(n):
                k = int(fifo["num_generated"][i, j])
                samples.append(PartialSample(
                    prompt_ids=prompt, response_ids=fifo["response_ids"][i, j, :k].copy(),
                    logprobs=fifo["logprobs"][i, j, :k].copy(), versions=fifo["versions"][i, j, :k].copy(),
                    key=fifo["keys"][i, j].copy(), budget=int(fifo["budget"][i, j]),
                    done=bool(fifo["done"][i, j]), stopped=bool(fifo["stopped"][i, j])))
            groups.append(PartialGroup(group_id=int(fifo["group_ids"][i]), prompt_ids=prompt,
                                       samples=tuple(samples)))
        self._restores = restores + 1
        seed = int(np.random.SeedSequence([self.rollout.seed, self._restores]).generate_state(1)[0] >> 1)
        self.engine = RolloutEngine(self.model_config, dataclasses.replace(self.rollout, seed=seed))
        self._fifo = collections.deque(groups)
        self._ids, self._next_id, self._counts = {}, next_id, counts


class AprilRollout(_RoundRollout):
    """APRIL: over-provisioned rounds, unfinished groups kept whole in a FIFO (module doc)."""

    strategy = "april"

    def __init__(self, model_config: ModelConfig, rollout: RolloutConfig,
                 prompts: Iterable[Sequence[int]], april: AprilConfig = AprilConfig()):
        if not isinstance(april, AprilConfig):
            raise ValueError(f"april must be an AprilConfig, got {type(april).__name__}")
        super().__init__(model_config, rollout, prompts, april.max_rejected)
        self.april = april

    def _start_budget(self, num_groups: int) -> int:
        return math.ceil(self.april.over_provision * num_groups - 1e-9)

    def apply_mask(self, batch: Any) -> Any:
        """With mask_offpolicy_prefix: `batch` (a rl.learner.TrainBatch built from the last
        round's trajectory) with loss_mask False where a token's version is older than the
        round's; otherwise `batch` unchanged."""
        if not self.april.mask_offpolicy_prefix:
            return batch
        if self.round_version is None:
            raise ValueError("apply_mask: no round has run yet (call collect first)")
        return batch.replace(loss_mask=offpolicy_prefix_mask(batch.versions, batch.loss_mask,
                                                             self.round_version))


class StaticRollout(_RoundRollout):
    """Static batching: start num_groups groups, wait for all of them (module doc)."""

    strategy = "static"
    stops_early = False

    def _start_budget(self, num_groups: int) -> int:
        return num_groups


class ContinuousRollout(_RoundRollout):
    """Continuous batching: refill free slots, stop at num_groups complete groups, drop
    (and count) the unfinished ones (module doc)."""

    strategy = "continuous"
    keeps_unfinished = False

    def _start_budget(self, num_groups: int) -> None:
        return None
