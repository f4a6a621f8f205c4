"""Rollout workers on Ray (AsyncConfig.backend = "ray"): the deterministic schedule with
the sampling done by N worker processes, each its own JAX runtime on its own devices,
while the learner trains.

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

The streaming mode (workers sampling with the newest version under the buffer's admission
rule, the threaded producer's counterpart) is rl.loops.ray_stream's RayStreamSource, on
this module's workers and weight sync. Not on Ray yet: continuous rollouts, APRIL rounds,
prompt schedulers, online pruning and dynamic sampling (their side state lives with the
sampler); `RunConfig.validate` refuses them with the reason.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
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
from rl.loops.rollouts import rollout_seed
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


def worker_name(run_dir: Any, index: int) -> str:
    """The Ray actor name of a run's worker `index` (ray.get_actor(name) finds it)."""
    return f"tandem-rollout-{index}@{Path(run_dir).resolve()}"


class RolloutWorker:
    """One worker's body (a Ray actor: ray.remote(RolloutWorker)): the deterministic
    source's sampling of one step's groups, in its own process. spec / train / loop: the
    run's RolloutSpec, TrainConfig and LoopConfig (the uniform prompt stream)."""

    def __init__(self, spec: Any, train: Any, loop: Any, affinity: tuple[int, ...] = ()):
        if affinity:  # before JAX starts its thread pool in this process
            import os
            os.sched_setaffinity(0, set(affinity))
        self.sampler = StreamSampler(spec=spec, config=train, loop=loop)

    def sample(self, params: Any, version: int, rng: np.ndarray, position: int,
               lora: Any = None) -> tuple[list, np.ndarray, int, dict, float, Any]:
        """(scored groups as host arrays, rng after, position after, rollout stats,
        seconds, an environment's (episode records, engine stats) or None) of one step's
        sampling with `params` = (host params, each leaf's dtype
        before the transfer) stamped `version`; a LoRA run sends its adapters as `params`
        and its LoraRun (the frozen base, sent once) as `lora`: the sampler runs
        lora.policy(adapters), as the learner's process would."""
        t0 = time.perf_counter()
        sampler = self.sampler
        episodic = is_episodic(sampler.spec.task)
        if episodic:  # this request's episode records apart from a concurrent request's
            sampler = dataclasses.replace(sampler, spec=sampler.spec.replace(
                task=own_records(sampler.spec.task)))
        params, dtypes = params  # the dtypes they had before the transfer
        leaves, tree = jax.tree.flatten(params)
        params = jax.tree.unflatten(tree, [x if str(x.dtype) == d else x.astype(d)
                                           for x, d in zip(leaves, dtypes)])
        if lora is not None:
            params = lora.policy(params)
        state = TrainState(params=params, opt_state=None, step=np.zeros((), np.int32),
                           version=np.asarray(version, np.int32), rng=np.asarray(rng, np.uint32))
        groups, state, pos, stats = sample_batch_groups(state, int(position), sampler)
        groups = [dataclasses.replace(g, traj=jax.tree.map(np.asarray, g.traj),
                                      rewards={k: np.asarray(x) for k, x in g.rewards.items()})
                  for g in groups]
        task = sampler.spec.task
        episodes = (task.take_records(), task.take_engine_stats()) if episodic else None
        return groups, np.asarray(state.rng), int(pos), stats, time.perf_counter() - t0, \
            episodes

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
                "max_concurrency": self.acfg.worker_requests}
        self.workers = [actor.options(name=worker_name(run.config.output_dir, i), **opts)
                        .remote(run.spec, run.train, run.loop, self.acfg.worker_affinity)
                        for i in range(self.acfg.rollout_workers)]
        v = int(run.state.version)
        self.chain = {v: (np.asarray(jax.device_get(run.state.rng), np.uint32),
                          int(run.data_position))}
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
                fut = self.workers[worker].sample.remote(self._params_ref(run, bv), bv, rng,
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
        state = run.state.replace(rng=jax.device_put(rng, run.state.rng.sharding))
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
