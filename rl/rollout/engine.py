"""Host-side rollout engine: continuous batching of groups over the sampler's fixed slots,
segment decoding, harvesting finished groups, and extract/resume of unfinished groups.

Plain Python around the jitted sampler functions (rl/rollout/sampler.py). A *group* is the N
samples of one prompt; it enters the slots whole (one prefill, KV copied into N slots)
and leaves whole: `harvest()` returns only groups whose N samples are all done.
At each `step(params, version)` free slots are first refilled — resumed groups before
new prompts (APRIL's FIFO of unfinished groups) — then every live slot advances by at
most `segment_len` tokens under `params`, stamped `version` (UloRL segment rollouts).
`extract_unfinished()` pulls groups out with their partial responses; `resume()` puts
them back later: their KV is rebuilt by re-prefilling prompt + partial response with the
params of the step that loads them, and they keep their rng stream and token budget.

KV layout (`RolloutConfig.kv_layout`): "segmented" (default) stores each group's prompt KV
once in its aligned block of N slots (slots are [groups, N]; num_slots is rounded down to
a multiple of N); a resumed group's prompt runs once and its samples' partial responses
are teacher-forced into their response segments. "replicated" copies the prompt KV into
every slot. Both produce the same tokens for the same seed.

`RolloutEngine.timings` accumulates the wall seconds of its prefills ("prefill_s": the
refill of free slots, prefill and resumed-group loads, waited for when a step refilled
any slot) and of its decode segments ("decode_s": the segment and the read of its
progress counters); the loops' step profile reads them.

Online pruning (`pruner`, rl/rollout/pruning.py; None = off, the engine unchanged): after
each segment, every group whose live samples reached the pruner's pruning point is scored
once by its quality head on the last position's hidden state, and the samples it picks
are marked done at once (they draw no more tokens; the group leaves, and its slots take
new work, as soon as its survivors finish). Harvested pruned rows have finished =
truncated = False; `prune_counts` counts them ("pruned"), the tokens they had made
("pruned_tokens") and the budget they had left ("tokens_saved": exact for responses that
run to their budget, an upper bound where a stop id might have come first). The marks
live in this engine: an extracted group resumed here keeps them, one resumed elsewhere not.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Iterable, Iterator, Sequence

import jax
import numpy as np

from models.config import ModelConfig
from models.decoder import check_layer_loop
from rl.rollout.pruning import Pruner
from rl.rollout.sampler import (
    PartialSample,
    check_prompt,
    decode_segment,
    load_samples,
    prefill,
    read_slots,
)
from rl.rollout.sampler_core import pending_hidden
from rl.rollout.sampler_state import (
    KV_LAYOUTS,
    SamplingConfig,
    as_key_data,
    check_stop_ids,
    init_state,
    sample_keys,
    slot_bucket,
)
from rl.rollout.slots import GroupSlots
from rl.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """num_slots samples decode in parallel; group_size N samples per prompt;
    segment_len S tokens per step; prompts up to max_prompt_len tokens; responses up to
    max_new_tokens tokens (including tokens made before an extract/resume). kv_layout:
    "segmented" (prompt KV stored once per group) or "replicated" (see the module doc).
    layer_loop: how decode runs the layers, "scan" (default) or "unrolled" (straight-line
    layers: no per-layer loop iteration on an accelerator; same tokens). bucket_slots:
    allocate rl.rollout.sampler_state.slot_bucket(num_slots, group_size) slots (powers of
    two up to 256), so that other batch sizes reuse the compiled programs."""

    num_slots: int
    group_size: int
    segment_len: int
    max_prompt_len: int
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    attn_impl: str | None = None
    kv_layout: str = "segmented"
    first_group_id: int = 0  # id (and rng stream) of the first submitted group
    layer_loop: str = "scan"
    bucket_slots: bool = False

    def __post_init__(self):
        for name in ("num_slots", "group_size", "segment_len", "max_prompt_len", "max_new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RolloutConfig.{name} must be an int >= 1, got {v!r}")
        if self.num_slots < self.group_size:
            raise ValueError(
                f"RolloutConfig.num_slots={self.num_slots} cannot hold one group of "
                f"group_size={self.group_size}; use num_slots >= group_size")
        if isinstance(self.first_group_id, bool) or not isinstance(self.first_group_id, int) \
                or self.first_group_id < 0:
            raise ValueError(f"RolloutConfig.first_group_id must be an int >= 0, got "
                             f"{self.first_group_id!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"RolloutConfig.kv_layout must be one of {KV_LAYOUTS}, got "
                             f"{self.kv_layout!r}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        check_layer_loop(self.layer_loop)
        if not isinstance(self.bucket_slots, bool):
            raise ValueError(f"RolloutConfig.bucket_slots must be True or False, got "
                             f"{self.bucket_slots!r}")


@dataclasses.dataclass(frozen=True)
class PartialGroup:
    """An unfinished group taken out of the engine: its prompt and its N samples, each with
    the response so far, behaviour log-probs, versions, rng key (position = tokens made)
    and budget. Samples that had already finished are kept (done=True)."""

    group_id: int
    prompt_ids: np.ndarray
    samples: tuple[PartialSample, ...]

    @property
    def num_generated(self) -> list[int]:
        return [s.num_generated for s in self.samples]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one `step` did: tokens produced, groups started/resumed, slots still live,
    samples pruned."""

    new_tokens: int
    started_groups: int
    resumed_groups: int
    live_slots: int
    pruned: int = 0


class RolloutEngine(GroupSlots):
    """Continuous-batching rollout over `rollout.num_slots` sampler slots.

    engine = RolloutEngine(config, RolloutConfig(...), prompts=iter(prompt_lists))
    while not engine.idle:
        engine.step(params, version)
        if (batch := engine.harvest()) is not None: ...
    """

    def __init__(self, config: ModelConfig, rollout: RolloutConfig,
                 prompts: Iterable[Sequence[int]] | None = None, pruner: Pruner | None = None):
        if not isinstance(rollout, RolloutConfig):
            raise ValueError(f"rollout must be a RolloutConfig, got {type(rollout).__name__}")
        check_stop_ids(rollout.stop_ids, config)
        self.config, self.rollout = config, rollout
        n = rollout.group_size
        # Groups only ever take N slots at a time, so slots past the last multiple of N
        # could never be used; the segmented cache needs whole blocks of N.
        num_slots = rollout.num_slots // n * n
        if rollout.bucket_slots:  # empty extra slots: other batch sizes reuse the programs
            num_slots = slot_bucket(num_slots, n)
        self.state = init_state(config, num_slots=num_slots,
                                max_prompt_len=rollout.max_prompt_len,
                                max_new_tokens=rollout.max_new_tokens, sampling=rollout.sampling,
                                stop_ids=rollout.stop_ids, attn_impl=rollout.attn_impl,
                                group_size=n, kv_layout=rollout.kv_layout,
                                layer_loop=rollout.layer_loop)
        self._key = as_key_data(rollout.seed)
        self._free = list(range(num_slots))
        self._active: dict[int, list[int]] = {}  # group id -> its N slots
        self._prompts: dict[int, np.ndarray] = {}  # group id -> prompt, while in the engine
        self._new: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self._resumed: collections.deque[PartialGroup] = collections.deque()
        self._source: Iterator[Sequence[int]] | None = None if prompts is None else iter(prompts)
        self._next_group_id = rollout.first_group_id
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0}
        self.pruner = pruner
        self._decided: set[int] = set()  # groups the pruner has scored
        self._pruned: set[tuple[int, int]] = set()  # (group id, sample index) pruned
        self.prune_counts = {"pruned": 0, "pruned_tokens": 0, "tokens_saved": 0}

    # ------------------------------------------------------------------ queues
    def _new_group(self, prompt: Sequence[int]) -> int:
        arr = check_prompt(prompt, self.rollout.max_prompt_len, self.config)
        gid = self._next_group_id
        self._next_group_id += 1
        self._new.append((gid, arr))
        return gid

    def submit(self, prompts: Iterable[Sequence[int]]) -> list[int]:
        """Queue prompts (one group of N samples each); returns their group ids. Prompts
        are validated now (ValueError for empty / too long / out-of-vocab)."""
        return [self._new_group(p) for p in prompts]

    def resume(self, groups: Sequence[PartialGroup]) -> None:
        """Queue extracted groups; they are loaded before any new prompt, in order, with
        the params of the step that loads them."""
        n = self.rollout.group_size
        for g in groups:
            if not isinstance(g, PartialGroup) or len(g.samples) != n:
                raise ValueError(f"resume: expected PartialGroup with group_size={n} samples, got {g!r:.80}")
            if g.group_id in self._prompts:
                raise ValueError(f"resume: group {g.group_id} is already in the engine")
            for s in g.samples:
                if s.budget > self.rollout.max_new_tokens:
                    raise ValueError(f"resume: group {g.group_id} has budget {s.budget} > "
                                     f"max_new_tokens={self.rollout.max_new_tokens}")
            self._prompts[g.group_id] = np.asarray(g.prompt_ids, np.int32)
            self._resumed.append(g)
            # Groups from another engine keep their ids; never hand those out again here.
            self._next_group_id = max(self._next_group_id, g.group_id + 1)

    def _take_slots(self) -> list[int] | None:
        n = self.rollout.group_size
        if len(self._free) < n:
            return None
        # Slots are taken and released in whole aligned blocks of N and the free list is
        # kept sorted, so its first N entries are one block (what the segmented cache needs).
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def _fill(self, params) -> tuple[int, int]:
        samples, sample_slots, resumed = [], [], 0
        while self._resumed and len(self._free) >= self.rollout.group_size:
            g = self._resumed.popleft()
            slots = self._take_slots()
            self._active[g.group_id] = slots
            samples.extend(g.samples)
            sample_slots.extend(slots)
            resumed += 1
        if samples:
            self.state = load_samples(params, self.state, samples, sample_slots)
        gids, prompts, slots = [], [], []
        while len(self._free) >= self.rollout.group_size:
            item = self._pull_new()
            if item is None:
                break
            gid, prompt = item
            s = self._take_slots()
            self._active[gid], self._prompts[gid] = s, prompt
            gids.append(gid)
            prompts.append(prompt)
            slots.append(s)
        if gids:
            keys = sample_keys(self._key, gids, self.rollout.group_size)
            self.state = prefill(params, self.state, prompts, np.asarray(slots), keys)
        return len(gids), resumed

    def step(self, params: Any, version: int) -> StepInfo:
        """Refill free slots (resumed groups first), then decode one segment of at most
        segment_len tokens per live slot with `params`, stamping `version`."""
        t0 = time.perf_counter()
        started, resumed = self._fill(params)
        # reading the counters waits for the fill (a sync the step always had), so the
        # fill is not counted as decode time
        before = int(np.asarray(self.state.num_generated).sum())
        t1 = time.perf_counter()
        self.state = decode_segment(params, self.state, self.rollout.segment_len, version)
        n_gen, done = jax.device_get((self.state.num_generated, self.state.done))
        t2 = time.perf_counter()
        self.timings["prefill_s"] += t1 - t0
        self.timings["decode_s"] += t2 - t1
        cut = 0 if self.pruner is None else self._prune(params, n_gen, done)
        return StepInfo(new_tokens=int(n_gen.sum()) - before, started_groups=started,
                        resumed_groups=resumed, live_slots=int((~done).sum()) - cut, pruned=cut)

    def _prune(self, params, n_gen: np.ndarray, done: np.ndarray) -> int:
        """Score the groups that reached their pruning point; mark the picked samples done."""
        due = [g for g, s in self._active.items()
               if g not in self._decided and self.pruner.due(n_gen[s], done[s])]
        if not due:
            return 0
        hidden = np.asarray(jax.device_get(pending_hidden(params, self.state)))
        cut = []
        for g in due:
            slots = self._active[g]
            self._decided.add(g)
            for i in self.pruner.decide(g, hidden[slots], ~done[slots]):
                cut.append(slots[i])
                self._pruned.add((g, i))
        if cut:
            budget = np.asarray(jax.device_get(self.state.budget))[cut]
            made = int(n_gen[cut].sum())
            for counts in (self.prune_counts, self.pruner.counts):
                counts["pruned"] += len(cut)
                counts["pruned_tokens"] += made
                counts["tokens_saved"] += int(budget.sum()) - made
            self.state = self.state.replace(done=self.state.done.at[np.asarray(cut)].set(True))
        return len(cut)

    # ------------------------------------------------------------------ leaving
    def _release(self, gid: int) -> None:
        self._free = sorted(self._free + self._active.pop(gid))
        self._prompts.pop(gid, None)

    def harvest(self) -> Trajectory | None:
        """Finished groups (all N samples done) as one Trajectory (rows grouped, in group
        id order), their slots freed; None if no group has finished."""
        done = np.asarray(jax.device_get(self.state.done))
        ready = sorted(g for g, s in self._active.items() if done[s].all())
        if not ready:
            return None
        n, p_max, r_max = self.rollout.group_size, self.rollout.max_prompt_len, self.rollout.max_new_tokens
        samples = read_slots(self.state, [s for g in ready for s in self._active[g]])
        b = len(samples)
        pruned = np.array([(g, i) in self._pruned for g in ready for i in range(n)])
        out = {
            "prompt_ids": np.zeros((b, p_max), np.int32), "prompt_lengths": np.zeros((b,), np.int32),
            "response_ids": np.zeros((b, r_max), np.int32), "response_mask": np.zeros((b, r_max), bool),
            "behaviour_logprobs": np.zeros((b, r_max), np.float32),
            "versions": np.zeros((b, r_max), np.int32),
            "group_ids": np.repeat(np.asarray(ready, np.int32), n),
            "finished": np.array([s.stopped for s in samples]) & ~pruned,
            "truncated": np.array([not s.stopped for s in samples]) & ~pruned,
        }
        for i, s in enumerate(samples):
            k, p = s.num_generated, s.prompt_ids.size
            out["prompt_ids"][i, :p], out["prompt_lengths"][i] = s.prompt_ids, p
            out["response_ids"][i, :k], out["response_mask"][i, :k] = s.response_ids, True
            out["behaviour_logprobs"][i, :k], out["versions"][i, :k] = s.logprobs, s.versions
        for g in ready:
            self._release(g)
            self._decided.discard(g)
            self._pruned.difference_update((g, i) for i in range(n))
        return Trajectory.create(**out)

    def extract_unfinished(self) -> list[PartialGroup]:
        """Take every group that still has a live sample out of the slots (freeing them),
        with partial responses, log-probs, versions and rng positions. Pass the result to
        `resume` (here or in another engine with the same settings) to continue."""
        done = np.asarray(jax.device_get(self.state.done))
        gids = sorted(g for g, s in self._active.items() if not done[s].all())
        if not gids:
            return []
        n = self.rollout.group_size
        samples = read_slots(self.state, [s for g in gids for s in self._active[g]])
        out = [PartialGroup(group_id=g, prompt_ids=self._prompts[g],
                            samples=tuple(samples[i * n:(i + 1) * n])) for i, g in enumerate(gids)]
        for g in gids:
            self._release(g)
        return out

    # ------------------------------------------------------------------ status
    def _other_queued(self) -> int:
        return len(self._resumed)  # extracted groups waiting to be loaded
