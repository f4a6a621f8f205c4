"""Rollout workers on Ray (AsyncConfig.backend = "ray"): the deterministic schedule (or
streaming, below) with the sampling done by N worker processes, each its own JAX runtime
on its own devices, while the learner trains.

The schedule is the deterministic source's (rl.loops.deterministic): the groups of the
step at learner version v are sampled with the params of version b(v) = max(v − η, 0).
What moves is where: request v goes to worker v mod N, and it may start as soon as
version b(v) exists, so with η >= 1 the sampling of the next steps overlaps the update of
this one (with η = 0 there is nothing to overlap: every request waits for the update
before it). At most N × worker_requests requests are in flight (one per worker by default).

    request v   (params ref of version b(v), b(v), rng_v, position_v)
    worker      sample_batch_groups: the sync / deterministic source's sampling, the same
                rng split and prompts -> the scored groups, rng_{v+1}, position_{v+1}
    learner     the groups into the buffer, the batch out, exactly as in-process

The rng chain (rng_{v+1} = the kept half of rollout_seed(rng_v)) and the data positions
(position_v + prompts_per_step) do not depend on what is sampled, so the learner knows
every request's inputs in advance; a worker's answer is checked against them. Hence a Ray
run equals the in-process deterministic run bit for bit on CPU (the same tokens, metrics
and parameters; tested at η = 0 and 2, with 1 and 2 workers).

Weight sync. Each version a request needs is put once into Ray's object store (host
arrays; in bf16 with AsyncConfig.sync_dtype, cast back by the worker) and the ObjectRef
is sent with the requests; versions older than b(v) are released. A LoRA run puts its
frozen base once and then only the adapters of each version; the worker composes them
with the run's own LoraRun.policy (merged or composed, as in-process). Ray moves an object between
processes on one node through shared memory and between nodes by its object manager, so
there is no faster path to write for host arrays; the bytes and seconds of every put are
logged (ray_sync_bytes, ray_sync_s) with the workers' version lag (ray_request_lag: v −
b(v) of the batch trained).

Faults. A worker that dies (killed, out of memory, an exception in sampling) is restarted
by Ray (max_restarts); its in-flight request is sent again to the new process: the inputs
are the same, so the groups are the same, nothing is lost and nothing is trained twice
(counted: ray_worker_restarts, one per request whose worker died, and ray_request_resends,
every request sent again, also while Ray was still restarting it; one line logged per
event). A learner that dies ends the
job; `--resume` continues from its checkpoint (the workers start fresh from the saved rng
and position).

Environments. A worker samples whole episodes (sample_batch_groups -> sample_episodes in
its process: concurrent tool calls, emulated tool latency) into a copy of the task with
record sinks of its own (EnvTask.with_own_records: per request, so concurrent requests
keep theirs apart) and sends the records and engine stats back with the groups; the
learner adds them to its task (EnvTask.add_records), so the episode metrics are metered
where the in-process run meters them. AsyncConfig.worker_requests = R makes each actor
sample R requests at once (Ray's threaded actor, max_concurrency = R): N × R requests in
flight, which pays where sampling waits on tools rather than on the cores.

A learner group. The learner may be a jax.distributed group of K processes (each
launched as any multi-process run, with the Ray settings): each learner process owns its
own N workers (named with its process index), which sample its contiguous share of every
request's prompts (StreamSampler.shard = (process index, K); rng keys by global group id),
so the group trains on the one-process run's global batch (tested: 2 processes x 1 device
equal 1 process x 2 devices, stopped after 2 steps and resumed too). The buffer holds a
process's share of each step; the rng chain is the same on every process (the state's
rng, gathered); each process puts each version once into its node's object store (a
gather from the mesh first: a collective every process takes part in, at the same
requests, since the schedule is fixed); process 0 writes the ring's versions beside a
checkpoint. Deterministic schedule only, with proximal "current" or "versions"
(rl.loops.validation.check_learner_group says why).

Streaming (RayStreamSource, AsyncConfig.mode = "threaded"): the threaded producer's
counterpart on the same workers and weight sync. Where RaySource follows the deterministic
schedule (step v trains on version max(v − η, 0), fixed in advance), here the workers
sample with the newest published version whenever the buffer's admission rule lets them,
as the producer thread does:

    submit      while fewer than N × worker_requests requests are in flight and the
                buffer reserves one step's b groups (AReaL's rule: at most (η + v + 1)·b
                groups accepted + running at learner version v), request r goes to the
                least busy worker with (the newest version's params ref, that version,
                rng_r, position_r): the learner keeps the data stream's rng chain and
                positions, so no two requests sample the same prompts
    answer      the scored groups into the buffer (its reservation filled); an
                environment's episode records to the learner's task
    take        the b oldest groups admissible at v (every token within η versions;
                older ones dropped or down-weighted by AsyncConfig.stale_policy, counted in
                buffer_*), waiting on the first answers to come back while there are
                fewer

So η means what it means in-process: with η = 0 one batch is admitted per version and the
run is the synchronous one (bit for bit, tested); with η >= 1 up to η + 1 steps' groups
are sampled or queued ahead of the learner. Weight sync is RaySource's (a put per version
a request is sent with, bf16 and LoRA adapters as there); a version's ref is
released when no request in flight holds it and a newer one exists. A worker that dies is
restarted by Ray and its request sent again with the same inputs (counted:
ray_worker_restarts). A checkpoint keeps the chain's next rng and position; the groups
then queued or in flight are not restored and count as dropped on resume
(`dropped_on_resume_groups`), as in threaded mode.

In-flight weight updates (AsyncConfig.rollout = "continuous", streaming only): after each
update the learner puts the new version once and sends its ref to every worker
(RolloutWorker.publish, on a thread of the actor beside the requests'); a request samples
its b groups segment by segment (rl.loops.producer.sample_round, the threaded producer's
round) and takes the newest version its worker knows at each segment boundary
(RolloutWorker.newest: read from the object store and cast once per version), so a token
carries the version it was drawn under; the keys and values written before a swap stay
the older version's, as in-process. mixed_version_rows in the record counts the rows of a
batch drawn under more than one version. A restarted worker knows only its request's
version until the next publish. A worker's concurrent requests share one engine
(rl.loops.shared_engine): a slot a finished group frees takes the next queued prompt of
any request, as the in-process continuous producer refills its engine.

Not on Ray yet: APRIL rounds, prompt schedulers, online pruning and dynamic sampling
(their side state lives with the sampler); `RunConfig.validate` refuses them with the
reason.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.learner.batch import TrainState
from rl.loops.asynchronous import AsyncSource
from rl.loops.batches import StreamSampler, sample_batch_groups
from rl.loops.episodes import is_episodic, own_records
from rl.loops.producer import sample_round
from rl.loops.rollouts import rollout_seed
from rl.loops.shared_engine import SharedEngine
from rl.loops.source import Taken
from rl.runtime.distributed import process_local

log = logging.getLogger(__name__)


def import_ray():
    """The ray module, or a ValueError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError("AsyncConfig.backend='ray' needs Ray: pip install -e '.[ray]' (or "
                         "pip install 'ray[default]')") from None
    return ray


def init_ray(ray: Any, address: str = "", **options: Any) -> None:
    """ray.init (the cluster at `address`, or a local one), keeping this process's SIGTERM
    and SIGINT handlers: Ray's core worker installs a failure handler for SIGTERM that
    dumps a stack trace and aborts, which would skip rl.runtime.preemption's checkpoint and
    clean stop (a driver stopped with SIGTERM exited -6 before this). options: more
    ray.init arguments (e.g. num_cpus)."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    ray.init(address=address or None, **{"include_dashboard": False, "log_to_driver": False,
                                         "configure_logging": False, **options})
    for sig, handler in kept.items():
        if handler is not None:
            signal.signal(sig, handler)


def worker_name(run_dir: Any, index: int, process: int = 0) -> str:
    """The Ray actor name of a run's worker `index` (of learner process `process`, in a
    learner group; ray.get_actor(name) finds it)."""
    tag = f"{index}" if process == 0 else f"p{process}-{index}"
    return f"tandem-rollout-{tag}@{Path(run_dir).resolve()}"


def learner_shard() -> tuple[int, int] | None:
    """(process index, process count) of this learner process in a jax.distributed
    learner group, whose share of each step's prompts its workers sample; None alone."""
    return (jax.process_index(), jax.process_count()) if jax.process_count() > 1 else None


def as_state_rng(rng: np.ndarray, like: jax.Array) -> jax.Array:
    """Host rng words as the learner state's rng array (its sharding; across a learner
    group every process holds the same words, so each builds its replica from them)."""
    if getattr(like, "is_fully_addressable", True):
        return jax.device_put(rng, like.sharding)
    return jax.make_array_from_callback(rng.shape, like.sharding, lambda index: rng[index])


class RolloutWorker:
    """One worker's body (a Ray actor: ray.remote(RolloutWorker)): the deterministic
    source's sampling of one step's groups, in its own process. spec / train / loop: the
    run's RolloutSpec, TrainConfig and LoopConfig (the uniform prompt stream); shard: the
    learner process's (index, count) in a learner group (its share of each step's
    prompts; None: all of them)."""

    def __init__(self, spec: Any, train: Any, loop: Any, affinity: tuple[int, ...] = (),
                 shard: tuple[int, int] | None = None, requests: int = 1):
        if affinity:  # before JAX starts its thread pool in this process
            import os
            os.sched_setaffinity(0, set(affinity))
        self.sampler = StreamSampler(spec=spec, config=train, loop=loop, shard=shard)
        # continuous: the requests' one engine (rl.loops.shared_engine; not for episodes)
        self.shared = None if is_episodic(spec.task) else SharedEngine(
            spec, requests * self.sampler.loop.prompts_per_step * spec.group_size)
        self._lock = threading.Lock()
        self._published: tuple[int, Any] = (-1, None)  # (newest version, its ObjectRef)
        self._decoded: tuple[int, Any] = (-1, None)  # (version, sampler params) last read

    @staticmethod
    def sampler_params(params: Any, lora: Any) -> Any:
        """The sampler's params from a request's (host params, each leaf's dtype before the
        transfer): cast back, and a LoRA run's adapters composed with lora.policy."""
        params, dtypes = params
        leaves, tree = jax.tree.flatten(params)
        params = jax.tree.unflatten(tree, [x if str(x.dtype) == d else x.astype(d)
                                           for x, d in zip(leaves, dtypes)])
        return params if lora is None else lora.policy(params)

    def own_sampler(self) -> StreamSampler:
        """The sampler, an environment's task with record sinks of this request's own (so
        concurrent requests keep their episode records apart)."""
        sampler = self.sampler
        if is_episodic(sampler.spec.task):
            sampler = dataclasses.replace(sampler, spec=sampler.spec.replace(
                task=own_records(sampler.spec.task)))
        return sampler

    @staticmethod
    def host_groups(groups: list) -> list:
        return [dataclasses.replace(g, traj=jax.tree.map(np.asarray, g.traj),
                                    rewards={k: np.asarray(x) for k, x in g.rewards.items()})
                for g in groups]

    def sample(self, params: Any, version: int, rng: np.ndarray, position: int,
               lora: Any = None) -> tuple[list, np.ndarray, int, dict, float, Any]:
        """(scored groups as host arrays, rng after, position after, rollout stats,
        seconds, an environment's (episode records, engine stats) or None) of one step's
        sampling with `params` = (host params, each leaf's dtype
        before the transfer) stamped `version`; a LoRA run sends its adapters as `params`
        and its LoraRun (the frozen base, sent once) as `lora`: the sampler runs
        lora.policy(adapters), as the learner's process would."""
        t0 = time.perf_counter()
        sampler = self.own_sampler()
        state = TrainState(params=self.sampler_params(params, lora), opt_state=None,
                           step=np.zeros((), np.int32), version=np.asarray(version, np.int32),
                           rng=np.asarray(rng, np.uint32))
        groups, state, pos, stats = sample_batch_groups(state, int(position), sampler)
        task = sampler.spec.task
        episodes = (task.take_records(), task.take_engine_stats()) if is_episodic(task) \
            else None
        return self.host_groups(groups), np.asarray(state.rng), int(pos), stats, \
            time.perf_counter() - t0, episodes

    # ------------------------------------------------------ in-flight weight updates
    def publish(self, version: int, box: list) -> None:
        """The learner's newest version: box = [its ObjectRef] (in a list, so Ray hands
        the ref over unread; a request reads it at its next segment boundary)."""
        with self._lock:
            if version > self._published[0]:
                self._published = (int(version), box[0])

    def newest(self, params: Any, version: int, lora: Any) -> tuple[Any, int]:
        """(sampler params, version): the newest of a request's own, the last published
        and the last read, each version read and cast once (concurrent requests share
        it)."""
        import ray

        with self._lock:
            (pv, ref), (dv, decoded) = self._published, self._decoded
        best = max(pv, dv, int(version))
        if best == dv:
            return decoded, dv
        out = self.sampler_params(ray.get(ref) if best == pv else params, lora)
        with self._lock:
            if best > self._decoded[0]:
                self._decoded = (best, out)
        return out, best

    def sample_inflight(self, params: Any, version: int, rng: np.ndarray, position: int,
                        lora: Any = None) -> tuple[list, np.ndarray, int, dict, float, Any]:
        """sample()'s answer, for AsyncConfig.rollout = "continuous": one request's b
        groups sampled segment by segment in the worker's engine that its concurrent
        requests share (rl.loops.shared_engine; an environment's: the request's own round,
        rl.loops.producer.sample_round), each segment with the newest version published
        to this worker by then (in-flight weight updates: a token carries the version it
        was drawn under)."""
        t0 = time.perf_counter()
        sampler = self.own_sampler()
        spec, b = sampler.spec, sampler.loop.prompts_per_step
        seed, key = rollout_seed(jnp.asarray(rng, jnp.uint32))
        prompts = spec.task.train_prompts(int(position), b)
        latest = lambda: self.newest(params, version, lora)  # noqa: E731
        groups, tokens = sample_round(spec, b * spec.group_size, seed, prompts, latest) \
            if self.shared is None else self.shared.sample(seed, prompts, latest)
        task = spec.task
        episodes = (task.take_records(), task.take_engine_stats()) if is_episodic(task) \
            else None
        return self.host_groups(groups), np.asarray(key, np.uint32), int(position) + b, \
            {"sampled_tokens": tokens}, time.perf_counter() - t0, episodes

    def pid(self) -> int:
        import os
        return os.getpid()


class RaySource(AsyncSource):
    """The deterministic schedule, sampled by Ray rollout workers (module doc); beside
    rl.loops.deterministic's source: the same ring, buffer and side files."""

    can_abandon = False  # a request in flight finishes on its worker

    def __init__(self, config: Any):
        super().__init__(config)
        self.label = f"async η={self.k}, {self.acfg.rollout_workers} ray worker(s)"
        self.ray = None
        self.workers: list = []
        self.refs: dict[int, Any] = {}  # version -> ObjectRef of its params (host arrays)
        self.inflight: collections.OrderedDict[int, tuple[int, Any, tuple]] = \
            collections.OrderedDict()  # learner version v -> (worker, future, request)
        self.chain: dict[int, tuple[np.ndarray, int]] = {}  # v -> (rng_v, position_v)
        self.counters = {"ray_worker_restarts": 0, "ray_request_resends": 0,
                         "ray_sync_bytes": 0.0, "ray_sync_s": 0.0}
        self.last_lag = 0
        self.lora_ref = None  # a LoRA run's LoraRun in the object store
        self.prompts_per_step = config.loop.prompts_per_step
        self.max_inflight = self.acfg.rollout_workers * self.acfg.worker_requests
        self.inflight_updates = self.acfg.rollout == "continuous"  # (streaming only)

    # -------------------------------------------------------------- setup
    def open(self, run: Any, params: Any) -> None:
        super().open(run, params)
        ray = self.ray = import_ray()
        if not ray.is_initialized():
            init_ray(ray, self.acfg.ray_address)
        lora = run.ctx.lora  # its frozen base goes to the object store once
        self.lora_ref = None if lora is None else ray.put(dataclasses.replace(
            lora, base=jax.device_get(process_local(lora.base))))
        actor = ray.remote(max_restarts=-1, max_task_retries=0)(RolloutWorker)
        opts = {"num_cpus": self.acfg.worker_cpus, "num_gpus": self.acfg.worker_gpus,
                # continuous: one more thread takes the learner's publish calls
                "max_concurrency": self.acfg.worker_requests + self.inflight_updates}
        shard = learner_shard()
        process = 0 if shard is None else shard[0]
        self.workers = [actor.options(name=worker_name(run.config.output_dir, i, process),
                                      **opts)
                        .remote(run.spec, run.train, run.loop, self.acfg.worker_affinity, shard,
                                self.acfg.worker_requests)
                        for i in range(self.acfg.rollout_workers)]
        v = int(run.state.version)
        rng = jax.device_get(process_local(run.state.rng))  # a learner group: every process's
        self.chain = {v: (np.asarray(rng, np.uint32), int(run.data_position))}
        self.next_request = v
        # the version the last step trains at is loop.steps - 1 (one version per update)
        self.last = v + run.loop.steps - run.ctx.start

    # -------------------------------------------------------------- requests
    def _params_ref(self, run: Any, version: int) -> Any:
        """The object-store ref of version `version`'s sampler params (put once)."""
        if version not in self.refs:
            t0 = time.perf_counter()
            params = self.snaps[version]  # a LoRA run's adapters: the workers compose
            host = jax.device_get(process_local(params if self.lora_ref is not None
                                                else run.ctx.policy(params)))
            dtypes = [str(x.dtype) for x in jax.tree.leaves(host)]
            if self.acfg.sync_dtype == "bfloat16":  # half the bytes; cast back by the worker
                host = jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                                    if x.dtype == np.float32 else x, host)
            self.refs[version] = self.ray.put((host, dtypes))
            self.counters["ray_sync_s"] += time.perf_counter() - t0
            self.counters["ray_sync_bytes"] += float(sum(np.asarray(x).nbytes
                                                         for x in jax.tree.leaves(host)))
        return self.refs[version]

    def _chain_at(self, v: int) -> tuple[np.ndarray, int]:
        """(rng_v, position_v), extending the chain from the last known link."""
        last = max(self.chain)
        while last < v:
            rng, pos = self.chain[last]
            _, key = rollout_seed(jnp.asarray(rng))
            self.chain[last + 1] = (np.asarray(key, np.uint32), pos + self.prompts_per_step)
            last += 1
        return self.chain[v]

    def _submit(self, run: Any, v: int) -> None:
        bv = max(v - self.k, 0)
        rng, pos = self._chain_at(v)
        request = (bv, rng, pos)
        worker = v % len(self.workers)
        fut = self.workers[worker].sample.remote(self._params_ref(run, bv), bv, rng, pos,
                                                 self.lora_ref)
        self.inflight[v] = (worker, fut, request)

    def sample_method(self, worker: int) -> Any:
        """The worker's remote method a request is sent to (continuous: in-flight
        updates)."""
        w = self.workers[worker]
        return w.sample_inflight if self.inflight_updates else w.sample

    def _fill(self, run: Any, v: int) -> None:
        """Submit requests v, v + 1, ... while their params exist (b(w) <= v, the learner's
        version), fewer than N × worker_requests are in flight and a step will train on
        them."""
        while len(self.inflight) < self.max_inflight and self.next_request < self.last and \
                max(self.next_request - self.k, 0) <= v:
            self._submit(run, self.next_request)
            self.next_request += 1

    def answer(self, run: Any, v: int, retries: int = 5) -> tuple:
        """Request v's answer; sent again (after 0.5, 1, 2, ... s) when its worker died or
        was restarting, at most `retries` times, then a RuntimeError."""
        ray = self.ray
        for attempt in range(retries + 1):
            worker, fut, request = self.inflight[v]
            try:
                return ray.get(fut)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if attempt == retries:
                    raise RuntimeError(f"rollout worker {worker} failed the request of version "
                                       f"{v} {retries + 1} times ({type(e).__name__}: {e}); "
                                       "see the Ray logs (/tmp/ray/session_latest/logs)") from e
                # one death per failed request; resends while Ray restarts it add up apart
                self.counters["ray_worker_restarts"] += attempt == 0
                self.counters["ray_request_resends"] += 1
                log.warning("rollout worker %d %s during request %d (%s); sending it again",
                            worker, "died" if attempt == 0 else "was still restarting", v,
                            type(e).__name__)
                time.sleep(0.5 * 2 ** attempt)
                bv, rng, pos = request
                fut = self.sample_method(worker).remote(self._params_ref(run, bv), bv, rng,
                                                        pos, self.lora_ref)
                self.inflight[v] = (worker, fut, request)
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- the step
    def take(self, run: Any, step: int) -> Taken:
        """Request v's groups (submitted earlier when its params existed), into the buffer,
        a batch out; the next requests submitted before returning (module doc)."""
        v = int(run.state.version)
        self._fill(run, v)
        with run.prof.phase("wait_s"):
            groups, rng, pos, stats, seconds, episodes = self.answer(run, v)
        del self.inflight[v]
        if episodes is not None:  # metered here, as if sampled in this process
            run.task.add_records(*episodes)
        want = self._chain_at(v + 1)
        if not (np.array_equal(rng, want[0]) and pos == want[1]):
            raise RuntimeError(f"rollout worker answered version {v} with rng / position "
                               f"{rng.tolist()} / {pos}, expected {want[0].tolist()} / "
                               f"{want[1]}: the sampling consumed other draws than one "
                               "batch's (dynamic sampling is not supported with Ray workers)")
        self._fill(run, v)  # the workers go on while the learner trains
        got = self.buffered(run, groups, v)
        if got is None:
            raise RuntimeError(f"step {step + 1}: the buffer dropped every group as older than "
                               f"max_staleness={self.k} versions ({self.buffer.stats()})")
        self.last_lag = v - max(v - self.k, 0)
        stats = dict(stats, ray_sample_s=seconds)
        state = run.state.replace(rng=as_state_rng(rng, run.state.rng))
        return Taken(got.groups, state, pos, stats, got.token_weights)

    def after_update(self, run: Any, step: int) -> None:
        super().after_update(run, step)
        v = int(run.state.version)
        for old in [u for u in self.refs if u < max(v - self.k, 0)]:
            del self.refs[old]  # released: no request needs it any more
        for old in [u for u in self.chain if u < v]:
            del self.chain[old]
        self._fill(run, v)

    def record_fields(self, run: Any, step: int) -> dict:
        return {**super().record_fields(run, step), **self.counters,
                "ray_workers": float(len(self.workers)), "ray_request_lag": float(self.last_lag)}

    def restore_ring(self, run: Any) -> None:
        self.restore_saved_ring(run)

    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        state, meta = super().checkpoint(run, step, state)
        self.save_ring(run, step, state)
        meta["async"]["ray_workers"] = len(self.workers)
        return state, meta

    def close(self, run: Any) -> None:
        super().close(run)
        for w in self.workers:
            try:
                self.ray.kill(w)
            except Exception:  # already gone
                pass
        self.workers, self.refs, self.inflight = [], {}, collections.OrderedDict()


class RayStreamSource(RaySource):
    """Ray workers sampling with the newest version under the buffer's admission rule
    (module doc)."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.label = (f"async η={self.k}, streaming, {self.acfg.rollout_workers} ray "
                      "worker(s)")
        self.request_id = 0
        self.next_rng: np.ndarray | None = None
        self.next_position = 0
        self.steps_left = 0  # steps still to train, this one included

    def devices(self, mesh: Any) -> Any:
        return mesh  # the sampler is in the workers: every local device trains

    def open(self, run: Any, params: Any) -> None:
        super().open(run, params)
        self.next_rng, self.next_position = self.chain[int(run.state.version)]
        self.chain = {}

    def restore_ring(self, run: Any) -> None:
        """Nothing: a streaming run's resume restarts sampling from the saved chain."""

    # -------------------------------------------------------------- requests
    def _busy(self, worker: int) -> int:
        return sum(1 for w, _, _ in self.inflight.values() if w == worker)

    def _fill(self, run: Any, v: int) -> None:
        """Submit requests with the newest version while workers have room and the buffer
        admits one more step's groups (no request past what the run can train)."""
        b = self.prompts_per_step
        while len(self.inflight) < self.max_inflight and self._wanted(run) > 0 and \
                self.buffer.reserve(b):
            worker = min(range(len(self.workers)), key=self._busy)
            rng, pos = self.next_rng, self.next_position
            request = (v, rng, pos)
            fut = self.sample_method(worker).remote(self._params_ref(run, v), v, rng, pos,
                                                    self.lora_ref)
            self.inflight[self.request_id] = (worker, fut, request)
            self.request_id += 1
            _, key = rollout_seed(jnp.asarray(rng))
            self.next_rng, self.next_position = np.asarray(key, np.uint32), pos + b

    def _wanted(self, run: Any) -> int:
        """Groups the remaining steps still need beyond those queued and in flight."""
        stats = self.buffer.stats()
        return self.steps_left * self.prompts_per_step - stats["queued_groups"] - \
            stats["running_groups"]

    def _collect(self, run: Any) -> None:
        """Wait for the first request in flight to answer; its groups into the buffer."""
        futs = {fut: rid for rid, (_, fut, _) in self.inflight.items()}
        ready, _ = self.ray.wait(list(futs), num_returns=1)
        rid = futs[ready[0]]
        groups, rng, pos, stats, seconds, episodes = self.answer(run, rid)
        _, _, (_, rng_in, pos_in) = self.inflight.pop(rid)
        want_rng = np.asarray(rollout_seed(jnp.asarray(rng_in))[1], np.uint32)
        if not (np.array_equal(rng, want_rng) and pos == pos_in + self.prompts_per_step):
            raise RuntimeError(f"rollout worker answered request {rid} with rng / position "
                               f"{rng.tolist()} / {pos}, expected {want_rng.tolist()} / "
                               f"{pos_in + self.prompts_per_step}")
        if episodes is not None:
            run.task.add_records(*episodes)
        for g in groups:
            self.buffer.put(g)
        self.sample_s += seconds
        self.sampled_tokens += int(stats.get("sampled_tokens", 0))

    # -------------------------------------------------------------- the step
    def take(self, run: Any, step: int) -> Taken:
        v = int(run.state.version)
        self.sample_s, self.sampled_tokens = 0.0, 0
        self.steps_left = run.loop.steps - step
        self._fill(run, v)
        t0 = time.perf_counter()
        while True:
            with run.prof.phase("host_s"):
                got = self.buffer.get_batch(run.loop.prompts_per_step, v, timeout=0)
            if got is not None:
                break
            if not self.inflight:
                raise RuntimeError(f"step {step + 1}: no batch admissible at version {v} "
                                   f"and nothing in flight ({self.buffer.stats()})")
            self._collect(run)
            self._fill(run, v)
        run.prof.add("wait_s", time.perf_counter() - t0)
        self._fill(run, v)  # the workers go on while the learner trains
        versions = np.concatenate([g.token_versions() for g in got.groups])
        self.last_lag = v - int(versions.min()) if versions.size else 0
        stats = {"sampled_tokens": self.sampled_tokens, "ray_sample_s": self.sample_s}
        return Taken(got.groups, run.state, self.next_position, stats, got.token_weights)

    def after_update(self, run: Any, step: int) -> None:
        super(RaySource, self).after_update(run, step)  # publish, the buffer's version
        v = int(run.state.version)
        self.steps_left = run.loop.steps - step - 1
        if self.inflight_updates and self.inflight:  # to every worker, read mid-request
            box = [self._params_ref(run, v)]
            for w in self.workers:
                w.publish.remote(v, box)
        held = {req[0] for _, _, req in self.inflight.values()}
        for old in [u for u in self.refs if u < v and u not in held]:
            del self.refs[old]
        self._fill(run, v)

    def record_fields(self, run: Any, step: int) -> dict:
        run.data_position = self.next_position
        return {**super().record_fields(run, step), "data_position": self.next_position}

    def checkpoint(self, run: Any, step: int, state: Any) -> tuple[Any, dict]:
        state, meta = super(RaySource, self).checkpoint(run, step, state)
        state = state.replace(rng=jax.device_put(self.next_rng, state.rng.sharding))
        stats = self.buffer.stats()
        meta["async"]["in_flight_groups"] = stats["queued_groups"] + stats["running_groups"]
        meta["async"]["ray_workers"] = len(self.workers)
        meta["data_position"] = int(self.next_position)
        return state, meta
