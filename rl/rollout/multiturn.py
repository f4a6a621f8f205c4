"""`MultiTurnEngine`: multi-turn episodes over the sampler's fixed slots, with continuous
batching across turns and observations appended to each sample's KV cache.

A *group* is N episodes of one task prompt (`Environment.reset(prompt)` once per sample);
it enters the slots whole (one prefill of the prompt; segmented layout: the prompt's KV
stored once for the N samples) and leaves whole (`harvest`). Every `step(params,
version)`:
  1. free slots take new groups (prefill; each sample's first-turn budget is set);
  2. every live slot decodes at most `segment_len` tokens (`decode_segment`, stamped
     `version`); a slot's turn ends on one of `env.stop_ids` or after
     `env.max_turn_tokens` tokens of this turn (its budget), which makes it `done`;
  3. each slot whose turn ended is handed to the tool pool: the turn is decoded
     (`env.decode_turn`) and the episode stepped (`Episode.step`, where a tool call
     blocks); unless the episode ends (done, max_turns, the budget, or a misbehaving
     environment: rl.rollout.episodes), the observation's ids (`env.encode_observation`)
     are appended to the slot, at the first step after the call returns, and it goes live
     again for the next turn, while every other slot just keeps decoding.
Concurrent tool calls (`max_concurrent_tool_calls`), parked slots (`park_after_s`) and
the slot / tool statistics (`stats()`) are rl.rollout.tool_calls' (its module doc).
An episode's tokens: prompt + turn_1 + obs_1 + turn_2 + ... ; the "response" of its
Trajectory row is everything after the prompt, with env_mask True on observation tokens
(behaviour log-prob 0, version = that of the turn they answer).

Two ways to add an observation (`MultiTurnConfig.mode`), the same tokens for the same seed:

  * "append" (default): `rl.rollout.append.append_tokens` runs just the k new tokens at the
    slot's position (the pending last turn token + obs[:-1]; obs[-1] becomes pending);
    earlier tokens are never recomputed, so an episode of L tokens costs L - 1 token
    passes in all.
  * "reprefill" (the exact slow twin): the slot's KV is rebuilt by prefilling the whole
    history, prompt + every turn and observation so far (`load_samples`); segmented
    layout: the whole block of the group (the prompt once + each sample's response).
`token_counts` counts the token passes the model made (valid tokens only, padding not
counted): "prefill" (new groups; replicated: the prompt, once per group; segmented: the
prompt but its last token, which the first decode step feeds), "decode" (one per token
sampled), "append" (append mode) and "reprefill" (reprefill mode's rebuilds). `timings`:
"prefill_s", "decode_s", "append_s" (appends or rebuilds, waited for), "env_s" (host
time at turn boundaries on the calling thread: with M = 0 the environment's code too),
"tool_s" (seconds inside turn boundaries, summed over calls, wherever they ran),
"tool_wait_s" (blocked on tool calls with no slot left to decode).

Time limits (`MultiTurnConfig.time_limits`, a `TimeLimits`; 0 = none): `step_s` bounds
every call into the environment (reset, decode_turn, step, encode_observation, outcome;
default: the environment's own `step_timeout_s`, if it has one; rl.rollout.episodes runs
the call in a daemon thread), `episode_s` the wall time of an episode from its reset
(decoding included: checked after every engine step and at every turn boundary; the
episodes decoding together share that time, and with max_concurrent_tool_calls = 0 the
calls are made one after another, so a slow episode also ages its batch mates; an
episode waiting on a call is bounded by the call's limit and checked when it returns). An
episode past either ends with EndReason.TIMEOUT: its slot stops decoding, its group
leaves when its other episodes end, the rest of the batch is untouched, and its rewards
are its outcome() (0 when a call into it is still running).

Token budget per episode: prompt + every turn + every observation <= max_episode_tokens.
A turn's budget is min(max_turn_tokens, what is left); an observation that would leave no
room for one more model token ends the episode with EndReason.TOKEN_BUDGET (it is checked
before anything is appended). finished = ended DONE, truncated = ended TOKEN_BUDGET.
Unlike `RolloutEngine` there is no extract / resume of unfinished episodes.
"""
from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Any, Iterable, Iterator, Sequence

import jax
import numpy as np

from models.config import ModelConfig
from rl.envs.base import (
    EndReason,
    Environment,
    Episode,
    Prompt,  # rl.tasks.base.Prompt, as the protocol uses it
)
from rl.rollout.append import append_tokens
from rl.rollout.episodes import (
    EnvCallError,
    EpisodeBatch,
    EpisodeRecord,
    check_ids,
    end_episode,
    episodes_to_trajectory,
    guarded,
    step_episode,
)
from rl.rollout.sampler import (
    PartialSample,
    check_prompt,
    decode_segment,
    load_samples,
    prefill,
    read_slots,
)
from rl.rollout.sampler_state import (
    as_key_data,
    check_stop_ids,
    init_state,
    sample_keys,
)
from rl.rollout.multiturn_config import (  # noqa: F401 - re-exported: the config lives there
    MODES,
    EpisodeStart,
    MultiTurnConfig,
    MultiTurnStepInfo,
    TimeLimits,
)
from rl.rollout.slots import GroupSlots
from rl.rollout.tool_calls import (
    InlinePool,
    ParkedEpisode,
    SlotClock,
    TurnResult,
    grown_sample,
)



def _check_env(env: Any, config: ModelConfig) -> None:
    for name in ("max_turns", "max_turn_tokens", "max_prompt_len", "max_episode_tokens"):
        v = getattr(env, name, None)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"environment {getattr(env, 'name', env)!r}: {name} must be an int "
                             f">= 1, got {v!r}")
    if env.max_episode_tokens <= env.max_prompt_len:
        raise ValueError(f"environment {env.name!r}: max_episode_tokens="
                         f"{env.max_episode_tokens} leaves no room after max_prompt_len="
                         f"{env.max_prompt_len}; raise max_episode_tokens")
    check_stop_ids(env.stop_ids, config)


class MultiTurnEngine(GroupSlots):
    """Continuous-batching multi-turn rollout of `env` over `rollout.num_slots` slots.

    engine = MultiTurnEngine(config, env, MultiTurnConfig(...))
    engine.submit(env.train_prompts(0, 8))
    while not engine.idle:
        engine.step(params, version)
        if (batch := engine.harvest()) is not None:
            batch.trajectory, batch.episodes  # Trajectory (multi-turn fields), records
    """

    def __init__(self, config: ModelConfig, env: Environment, rollout: MultiTurnConfig,
                 prompts: Iterable[Prompt] | None = None):
        if not isinstance(rollout, MultiTurnConfig):
            raise ValueError(f"rollout must be a MultiTurnConfig, got {type(rollout).__name__}")
        _check_env(env, config)
        self.config, self.env, self.rollout = config, env, rollout
        n = rollout.group_size
        num_slots = rollout.num_slots // n * n
        # A response holds everything after the prompt (>= 1 token), turns and observations.
        self.max_response_len = env.max_episode_tokens - 1
        self.max_prompt_len = int(rollout.max_prompt_len or env.max_prompt_len)
        self.state = init_state(config, num_slots=num_slots, max_prompt_len=self.max_prompt_len,
                                max_new_tokens=self.max_response_len, sampling=rollout.sampling,
                                stop_ids=env.stop_ids, attn_impl=rollout.attn_impl,
                                group_size=n, kv_layout=rollout.kv_layout)
        self._key = as_key_data(rollout.seed)
        self._free = list(range(num_slots))
        self._active: dict[int, list[int]] = {}  # group id -> its N slots
        self._new: collections.deque[tuple[int, Prompt]] = collections.deque()
        self._starts: dict[int, EpisodeStart] = {}  # group id -> where its episodes begin
        self._source: Iterator[Prompt] | None = None if prompts is None else iter(prompts)
        self._next_group_id = rollout.first_group_id
        self._records: dict[int, EpisodeRecord] = {}  # slot -> its episode's record
        self._episodes: dict[int, Episode | None] = {}  # slot -> its live episode
        self._turn_start: dict[int, int] = {}  # slot -> response index where its turn began
        self._began: dict[int, float] = {}  # slot -> time.monotonic() at its episode's reset
        limits = rollout.time_limits
        self.step_timeout_s = float(limits.step_s or getattr(env, "step_timeout_s", 0) or 0)
        self.episode_timeout_s = float(limits.episode_s)
        self.timings = {"prefill_s": 0.0, "decode_s": 0.0, "append_s": 0.0, "env_s": 0.0,
                        "tool_s": 0.0, "tool_wait_s": 0.0}
        self.token_counts = {"prefill": 0, "decode": 0, "append": 0, "reprefill": 0}
        workers = rollout.max_concurrent_tool_calls
        self._pool: Any = (InlinePool() if workers == 0 else concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="tandem-tool"))
        self._pending: dict[int, concurrent.futures.Future] = {}  # slot -> its turn's job
        self._submitted: dict[int, float] = {}  # slot -> when its job was handed over
        self._parked: dict[tuple[int, int], ParkedEpisode] = {}  # (group, sample) -> a parked episode
        self.parked_count = 0  # episodes parked so far
        self.tool_calls = 0  # turn boundaries handed to the pool
        self.clock = SlotClock()

    # ------------------------------------------------------------------ queue
    def _new_group(self, prompt: Prompt, start: EpisodeStart | None = None) -> int:
        if not isinstance(prompt, Prompt):
            raise ValueError(f"submit takes rl.tasks.base.Prompt objects, got "
                             f"{type(prompt).__name__}")
        if start is not None and not isinstance(start, EpisodeStart):
            raise ValueError(f"starts must hold EpisodeStart objects or None, got "
                             f"{type(start).__name__}")
        limit = self.max_prompt_len if start is not None else self.env.max_prompt_len
        arr = check_prompt(prompt.ids, limit, self.config)
        if arr.size + 1 > self.env.max_episode_tokens:
            raise ValueError(f"prompt of {arr.size} tokens leaves no room for a model token in "
                             f"max_episode_tokens={self.env.max_episode_tokens}")
        gid = self._next_group_id
        self._next_group_id += 1
        self._new.append((gid, prompt))
        if start is not None:
            self._starts[gid] = start
        return gid

    def submit(self, prompts: Iterable[Prompt],
               starts: Sequence[EpisodeStart | None] | None = None) -> list[int]:
        """Queue task prompts (one group of N episodes each); returns their group ids.
        Prompts are validated now (ValueError: not a Prompt, empty, too long, out of vocab).
        starts[g] (optional): group g continues an earlier episode instead of resetting
        (EpisodeStart; its prompt holds that episode's prefix, up to the config's
        max_prompt_len)."""
        prompts = list(prompts)
        starts = [None] * len(prompts) if starts is None else list(starts)
        if len(starts) != len(prompts):
            raise ValueError(f"submit: {len(starts)} starts for {len(prompts)} prompts")
        return [self._new_group(p, st) for p, st in zip(prompts, starts)]

    # ------------------------------------------------------------------ stepping
    def _fill(self, params) -> int:
        n = self.rollout.group_size
        gids, prompts, blocks = [], [], []
        while len(self._free) >= n:
            item = self._pull_new()
            if item is None:
                break
            gid, prompt = item
            # free slots are kept sorted and taken N at a time: one aligned block
            slots, self._free = self._free[:n], self._free[n:]
            self._active[gid] = slots
            gids.append(gid)
            prompts.append(prompt)
            blocks.append(slots)
        if not gids:
            return 0
        keys = sample_keys(self._key, gids, n)
        self.state = prefill(params, self.state, [p.ids for p in prompts], np.asarray(blocks),
                             keys)
        self.token_counts["prefill"] += sum(
            len(p.ids) - (self.rollout.kv_layout == "segmented") for p in prompts)
        all_slots, budgets, failed = [], [], []
        for gid, prompt, slots in zip(gids, prompts, blocks):
            budget = min(self.env.max_turn_tokens, self.env.max_episode_tokens - len(prompt.ids))
            start = self._starts.pop(gid, None)
            reset, args = (self.env.reset, (prompt,)) if start is None else (start.reset, ())
            for i, s in enumerate(slots):
                rec = EpisodeRecord(group_id=gid, sample=i, prompt=prompt,
                                    turns=0 if start is None else start.turns)
                self._records[s], self._turn_start[s] = rec, 0
                self._began[s] = time.monotonic()
                all_slots.append(s)
                budgets.append(budget)
                try:
                    self._episodes[s] = guarded("reset", reset, *args,
                                                timeout_s=self.step_timeout_s)
                except EnvCallError as e:
                    self._episodes[s] = None
                    end_episode(rec, e.reason, e.message, None, self.env.reward_names)
                    failed.append(s)
        st = self.state
        idx = np.asarray(all_slots)
        self.state = st.replace(budget=st.budget.at[idx].set(np.asarray(budgets, np.int32)),
                                done=st.done.at[np.asarray(failed, np.int32)].set(True))
        return len(gids)

    def step(self, params: Any, version: int) -> MultiTurnStepInfo:
        """Refill free slots with new groups, resume the episodes whose tool calls have
        returned (appending their observations; waiting for the first one when no slot is
        left to decode), decode one segment of at most segment_len tokens per live slot
        with `params` (stamping `version`), then hand the episodes whose turn ended to the
        tool pool (see the module docstring)."""
        t0 = time.perf_counter()
        counts0 = dict(self.token_counts)
        turns = ended = 0
        ended += self._unpark(params)  # returned calls take free slots before new groups
        started = self._fill(params)
        done = np.asarray(jax.device_get(self.state.done))
        if self._pending or self._parked:
            ended += self._resume(params, block=bool(done.all()))
            ended += self._unpark(params)
            done = np.asarray(jax.device_get(self.state.done))
        before = int(np.asarray(self.state.num_generated).sum())  # waits for the fill
        t1 = time.perf_counter()
        in_flight = (any(not f.done() for f in self._pending.values())
                     or any(not p.future.done() for p in self._parked.values()))
        live = int((~done).sum())
        if live:
            self.state = decode_segment(params, self.state, self.rollout.segment_len, version)
            n_gen, done = jax.device_get((self.state.num_generated, self.state.done))
            done = np.asarray(done)
            self.token_counts["decode"] += int(n_gen.sum()) - before
        t2 = time.perf_counter()
        self.timings["prefill_s"] += t1 - t0
        self.timings["decode_s"] += t2 - t1
        turns = self._submit_turns(done)
        ended += self._resume(params, block=False)
        self._park_waiting()
        ended += self._expire(time.monotonic())
        self.clock.step(time.perf_counter() - t0, self.state.done.shape[0], (t2 - t1) * live,
                        sum(not rec.ended for rec in self._records.values()), in_flight,
                        self.token_counts["decode"] - counts0["decode"])
        done = np.asarray(jax.device_get(self.state.done))
        c = self.token_counts
        return MultiTurnStepInfo(
            decoded_tokens=c["decode"] - counts0["decode"],
            appended_tokens=c["append"] - counts0["append"],
            prefill_tokens=c["prefill"] + c["reprefill"] - counts0["prefill"] - counts0["reprefill"],
            started_groups=started, turns_ended=turns, episodes_ended=ended,
            live_slots=int((~done).sum()))

    def _submit_turns(self, done: np.ndarray) -> int:
        """Hand every episode whose turn has just ended to the tool pool (run inline when
        max_concurrent_tool_calls = 0). Returns how many turns ended."""
        slots = sorted(s for s, rec in self._records.items()
                       if done[s] and not rec.ended and s not in self._pending)
        if not slots:
            return 0
        for s, smp in zip(slots, read_slots(self.state, slots)):
            rec, ep = self._records[s], self._episodes[s]
            start, n = self._turn_start[s], smp.num_generated
            rec.spans.append(("model", start, n))
            self._pending[s] = self._pool.submit(self._turn_job, rec, ep,
                                                 smp.response_ids[start:].tolist(), smp,
                                                 self._began[s])
            self._submitted[s] = time.monotonic()
            self.tool_calls += 1
            self.clock.add("tool_calls", 1)
        return len(slots)

    def _turn_job(self, rec: EpisodeRecord, ep: Episode | None, turn_ids: list[int],
                  smp: PartialSample, began: float) -> "TurnResult":
        """A turn boundary, run in the tool pool: step the episode, decide whether it goes
        on, encode the observation, or end it (outcome included). Touches this episode's
        record only; never raises (the environment is guarded)."""
        t0 = time.perf_counter()
        env, limit = self.env, self.step_timeout_s
        reason, message, obs = None, None, None
        try:
            obs_text, env_done = step_episode(env, ep, rec, turn_ids, limit)
            if env_done:
                reason = EndReason.DONE
            elif rec.turns >= env.max_turns:
                reason = EndReason.MAX_TURNS
            elif 0 < self.episode_timeout_s <= time.monotonic() - began:
                reason, message = EndReason.TIMEOUT, (
                    f"the episode ran {time.monotonic() - began:.1f} s, past its wall time "
                    f"limit of {self.episode_timeout_s:g} s")
            else:
                obs = check_ids("encode_observation",
                                guarded("encode_observation", env.encode_observation,
                                        obs_text, timeout_s=limit), self.config.vocab_size)
                left = env.max_episode_tokens - smp.prompt_ids.size - smp.num_generated
                if len(obs) + 1 > left:
                    message = (f"observation of {len(obs)} tokens after turn {rec.turns} "
                               f"leaves no room for a model token: {left} of "
                               f"max_episode_tokens={env.max_episode_tokens} left")
                    reason, obs = EndReason.TOKEN_BUDGET, None
                else:
                    rec.observations.append(obs_text)
        except EnvCallError as e:
            reason, message = e.reason, e.message
            ep = None if e.hung else ep  # never call into an episode still running
        if reason is not None:
            end_episode(rec, reason, message, ep, env.reward_names, limit)
        return TurnResult(smp=smp, obs=obs, seconds=time.perf_counter() - t0)

    def _resume(self, params, block: bool) -> int:
        """Take the tool calls that have returned (with block: wait for at least one
        first); append (or re-prefill) the observations of the episodes that go on.
        Returns how many episodes ended."""
        if not self._pending and not self._parked:
            return 0
        waiting = [p.future for p in self._parked.values() if p.result is None]
        if block and (self._pending or waiting):
            t0 = time.perf_counter()
            concurrent.futures.wait(list(self._pending.values()) + waiting,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            self.timings["tool_wait_s"] += time.perf_counter() - t0
            self.clock.add("tool_wait_s", time.perf_counter() - t0)
        t1 = time.perf_counter()
        ready = sorted(s for s, f in self._pending.items() if f.done())
        go_on: list[tuple[int, PartialSample, list[int]]] = []
        ended = 0
        for p in self._parked.values():  # parked episodes whose call returned
            if p.result is None and p.future.done():
                p.result = p.future.result()
                self.timings["tool_s"] += p.result.seconds
                self.clock.add("tool_s", p.result.seconds)
                ended += p.result.obs is None
        for s in ready:
            self._submitted.pop(s, None)
            got = self._pending.pop(s).result()
            self.timings["tool_s"] += got.seconds
            self.clock.add("tool_s", got.seconds)
            if got.obs is None:
                self._episodes[s] = None
                ended += 1
            else:
                go_on.append((s, got.smp, got.obs))
        t2 = time.perf_counter()
        self.timings["env_s"] += t2 - t1
        if go_on:
            self._append(params, go_on)
        self.timings["append_s"] += time.perf_counter() - t2
        return ended

    def _park_waiting(self) -> None:
        """Free the slots whose episode's tool call has run park_after_s seconds or more:
        the episode's bookkeeping moves to the parked store, the slot takes other work."""
        pk = self.rollout.park_after_s
        if pk is None or not self._pending:
            return
        now = time.monotonic()
        slots = sorted(s for s, f in self._pending.items()
                       if not f.done() and now - self._submitted[s] >= pk)
        for s in slots:
            rec = self._records.pop(s)
            self._parked[(rec.group_id, rec.sample)] = ParkedEpisode(
                record=rec, episode=self._episodes.pop(s), turn_start=self._turn_start.pop(s),
                began=self._began.pop(s), future=self._pending.pop(s))
            self._submitted.pop(s)
            self._active[rec.group_id].remove(s)
        self.parked_count += len(slots)
        self._free = sorted(self._free + slots)

    def _unpark(self, params) -> int:
        """Put parked episodes whose call returned with an observation back into free slots
        (their history re-prefilled with `params`, rl.rollout.sampler.load_samples; the
        rng stream goes on where it was). Returns 0 (episodes end in _resume)."""
        back = sorted(k for k, p in self._parked.items()
                      if p.result is not None and p.result.obs is not None)[:len(self._free)]
        if not back:
            return 0
        t0 = time.perf_counter()
        slots, samples = [], []
        for key in back:
            p = self._parked.pop(key)
            smp, obs, rec = p.result.smp, p.result.obs, p.record
            s = self._free.pop(0)
            n = smp.num_generated + len(obs)
            left = self.env.max_episode_tokens - smp.prompt_ids.size - n
            ver = int(smp.versions[-1]) if smp.num_generated else 0
            samples.append(grown_sample(smp, obs, ver, n + min(self.env.max_turn_tokens, left)))
            rec.spans.append(("env", smp.num_generated, n))
            self._records[s], self._episodes[s], self._began[s] = rec, p.episode, p.began
            self._turn_start[s] = n
            self._active[rec.group_id].append(s)
            slots.append(s)
            self.token_counts["reprefill"] += smp.prompt_ids.size + n
        self.state = load_samples(params, self.state, samples, slots)
        jax.block_until_ready(self.state.done)
        self.timings["append_s"] += time.perf_counter() - t0
        return 0

    def _append(self, params, go_on: list[tuple[int, PartialSample, list[int]]]) -> None:
        budgets, versions = [], []
        for s, smp, obs in go_on:
            n = smp.num_generated + len(obs)
            rec = self._records[s]
            rec.spans.append(("env", smp.num_generated, n))
            self._turn_start[s] = n
            left = self.env.max_episode_tokens - smp.prompt_ids.size - n
            budgets.append(n + min(self.env.max_turn_tokens, left))
            versions.append(int(smp.versions[-1]) if smp.num_generated else 0)
        if self.rollout.mode == "append":
            self.state = append_tokens(params, self.state, [g[0] for g in go_on],
                                       [g[2] for g in go_on], versions, budgets)
            self.token_counts["append"] += sum(len(g[2]) for g in go_on)
        else:
            self._reprefill(params, go_on, versions, budgets)
        jax.block_until_ready(self.state.done)

    def stats(self, reset: bool = False) -> dict[str, float]:
        """The slot / tool statistics since the engine was made or the last
        stats(reset=True) (rl.rollout.tool_calls.SlotClock.stats)."""
        return self.clock.stats(reset)

    @property
    def tokens_in_flight(self) -> int:
        """Model and observation tokens of the episodes not yet harvested (in their slots,
        or parked at the start of their pending turn)."""
        slots = [s for group in self._active.values() for s in group]
        n = np.asarray(jax.device_get(self.state.num_generated))
        return int(n[slots].sum()) + sum(p.turn_start for p in self._parked.values())

    @property
    def num_parked(self) -> int:
        """Episodes out of their slot while a tool call runs (or waiting for a slot)."""
        return len(self._parked)

    def close(self) -> None:
        """Stop the tool pool (calls still running finish on their threads, unread)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _past_limit(self, slot: int, now: float) -> bool:
        return 0 < self.episode_timeout_s <= now - self._began[slot]

    def _limit_message(self, slot: int) -> str:
        return (f"the episode ran {time.monotonic() - self._began[slot]:.1f} s, past its wall "
                f"time limit of {self.episode_timeout_s:g} s")

    def _expire(self, now: float) -> int:
        """End (EndReason.TIMEOUT) the episodes still decoding a turn past the episode
        time limit: their slots stop, the tokens of the cut turn stay in their row.
        Returns how many ended."""
        if self.episode_timeout_s <= 0:
            return 0
        slots = sorted(s for s, rec in self._records.items()  # waiting on a tool: its call's
                       if s not in self._pending  # limit, then this one when it returns
                       and not rec.ended and self._past_limit(s, now))
        if not slots:
            return 0
        for s, smp in zip(slots, read_slots(self.state, slots)):
            rec = self._records[s]
            if smp.num_generated > self._turn_start[s]:  # the cut turn's tokens
                rec.spans.append(("model", self._turn_start[s], smp.num_generated))
            end_episode(rec, EndReason.TIMEOUT, self._limit_message(s), self._episodes[s],
                        self.env.reward_names, self.step_timeout_s)
            self._episodes[s] = None
        self.state = self.state.replace(
            done=self.state.done.at[np.asarray(slots, np.int32)].set(True))
        return len(slots)

    def _reprefill(self, params, go_on, versions, budgets) -> None:
        """The slow twin of append_tokens: rebuild the slots' KV from their whole history."""
        grown = {}
        for (s, smp, obs), ver, bud in zip(go_on, versions, budgets):
            grown[s] = grown_sample(smp, obs, ver, bud)
        if self.rollout.kv_layout == "segmented":
            n = self.rollout.group_size
            blocks = sorted({s // n for s in grown})
            slots = [b * n + j for b in blocks for j in range(n)]
            others = [s for s in slots if s not in grown]
            current = dict(zip(others, read_slots(self.state, others))) if others else {}
            samples = [grown[s] if s in grown else current[s] for s in slots]
            count = sum(smp.prompt_ids.size - 1 for smp in samples[::n])
            count += sum(smp.num_generated for smp in samples)
        else:
            slots = sorted(grown)
            samples = [grown[s] for s in slots]
            count = sum(smp.prompt_ids.size + smp.num_generated for smp in samples)
        self.state = load_samples(params, self.state, samples, slots)
        self.token_counts["reprefill"] += count

    # ------------------------------------------------------------------ leaving
    def harvest(self) -> EpisodeBatch | None:
        """Groups whose N episodes have all ended, as an EpisodeBatch (a Trajectory with
        env_mask / turn_ids / turn_rewards and rewards = the outcomes, rows grouped in group
        id order, samples in order, plus the episode records); their slots are freed. None
        if none has."""
        parked: dict[int, list] = collections.defaultdict(list)
        for (g, _), p in self._parked.items():
            parked[g].append(p)
        ready = sorted(g for g, slots in self._active.items()
                       if all(s not in self._pending and self._records[s].ended for s in slots)
                       and all(p.result is not None and p.result.obs is None
                               for p in parked.get(g, ())))
        if not ready:
            return None
        slots = [s for g in ready for s in self._active[g]]
        in_slots = dict(zip(slots, read_slots(self.state, slots)))
        rows = []  # (group, sample, record, PartialSample)
        for g in ready:
            rows += [(g, self._records[s].sample, self._records[s], in_slots[s])
                     for s in self._active[g]]
            rows += [(g, p.record.sample, p.record, p.result.smp) for p in parked.get(g, ())]
        rows.sort(key=lambda r: (r[0], r[1]))
        records = [r[2] for r in rows]
        traj = episodes_to_trajectory(records, [r[3] for r in rows], self.max_prompt_len,
                                      self.max_response_len, self.env.max_turns,
                                      self.env.reward_names)
        for g in ready:
            for s in self._active.pop(g):
                for d in (self._records, self._episodes, self._turn_start, self._began):
                    d.pop(s, None)
            for p in parked.get(g, ()):
                self._parked.pop((g, p.record.sample))
        self._free = sorted(self._free + slots)
        return EpisodeBatch(trajectory=traj, episodes=tuple(records))
