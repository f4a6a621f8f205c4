"""Ray rollout workers (rl/loops/ray_workers.py): the deterministic schedule sampled by
worker processes equals the in-process deterministic run bit for bit (parameters, rewards,
tokens trained) at η = 0 and η = 2 with one worker, and with two workers one of which is
killed mid-run (restarted, its request sent again: still the same run); a resumed run is
the straight one; bf16 weight sync; the refusals.

The reference is the in-process DeterministicSource on the same config (tests/rl/
test_async_loop.py checks that one against the synchronous loop)."""
import dataclasses
import time

import jax
import numpy as np
import pytest
from test_sync_loop import LOOP, cfg, policy  # noqa: F401  (same geometry)

from rl.loops import AsyncConfig, run_async
from rl.loops.ray_workers import worker_name
from rl.run import RunHooks

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


SIGTERM_SELF = """
import os, signal, time
import ray
from rl.loops.ray_workers import init_ray
hit = []
signal.signal(signal.SIGTERM, lambda *a: hit.append(1))  # as rl.runtime.preemption does
init_ray(ray, num_cpus=1)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("handled", len(hit))
ray.shutdown()
"""


def test_a_driver_keeps_its_sigterm_handler_through_ray_init():
    """Ray's core worker replaces the process's SIGTERM handler with one that aborts: a
    preempted learner could not checkpoint (it exited -6). init_ray, which RaySource
    uses, puts the process's own handler back (with plain ray.init in its place this
    process dies of the signal: rc 15, nothing printed)."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", SIGTERM_SELF], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0 and "handled 1" in got.stdout, got.stderr[-2000:]


def leaves(result):
    return [np.asarray(x) for x in jax.tree.leaves(result.state.params)]


def assert_same_run(a, b):
    for x, y in zip(leaves(a), leaves(b)):
        np.testing.assert_array_equal(x, y)
    for ra, rb in zip(a.train, b.train):
        for key in ("reward_mean", "loss", "tokens", "behaviour_version_min", "grad_norm"):
            assert ra[key] == rb[key], (key, ra["step"])
    assert a.data_position == b.data_position


LOOP4 = dataclasses.replace(LOOP, steps=4)


@pytest.fixture(scope="module")
def in_process(policy, tmp_path_factory):
    """in_process(η) -> the in-process deterministic run of LOOP4 (each η run once)."""
    done = {}

    def get(eta):
        if eta not in done:
            config, params, task = policy
            acfg = AsyncConfig(max_staleness=eta, mode="deterministic")
            done[eta] = run_async(config, params, task, cfg(
                tmp_path_factory.mktemp(f"local{eta}"), LOOP4, asynchronous=acfg))
        return done[eta]
    return get


@pytest.mark.parametrize("eta, workers", [(0, 1), (2, 1)])
def test_ray_workers_equal_the_in_process_run(policy, in_process, tmp_path, local_ray, eta,
                                              workers):
    config, params, task = policy
    remote = AsyncConfig(max_staleness=eta, mode="deterministic", backend="ray",
                         rollout_workers=workers)
    got = run_async(config, params, task, cfg(tmp_path / "ray", LOOP4, asynchronous=remote))
    assert_same_run(in_process(eta), got)
    last = got.train[-1]
    assert last["ray_workers"] == workers and last["ray_worker_restarts"] == 0
    assert last["ray_request_lag"] == min(eta, 3)
    n_params = sum(x.size for x in leaves(got))
    # one put per version sampled (versions 0..3 - η), each the params' fp32 bytes
    assert last["ray_sync_bytes"] == 4 * n_params * (4 - eta if eta < 4 else 1)


def test_ray_workers_run_episodes(tmp_path, local_ray, monkeypatch):
    """An environment's episodes on one Ray worker that samples two requests at once
    (worker_requests=2, η = 2, the scripted guessing game of test_episode_loop, its tool
    calls concurrent in the worker): the in-process deterministic run bit for bit, and the
    episode metrics (turns, tokens, end reasons, tool calls), metered by the learner from
    the records the worker sends back, equal the in-process ones."""
    import sys

    import test_episode_loop
    from test_episode_loop import run_scripted, scripted_config

    import rl.envs

    ray.cloudpickle.register_pickle_by_value(sys.modules["test_episode_loop"])
    monkeypatch.setitem(rl.envs.ENVS, "scripted", test_episode_loop.ScriptedEnv)

    def run(name, acfg):
        return run_scripted(scripted_config(tmp_path / name, acfg, steps=4,
                                            max_concurrent_tool_calls=4))[1]

    local = AsyncConfig(max_staleness=2, mode="deterministic")
    want = run("local", local)
    got = run("ray", dataclasses.replace(local, backend="ray", worker_requests=2))
    assert_same_run(want, got)
    keys = [k for k in want.train[0] if k.startswith("episode_")]
    assert "episode_tool_calls" in keys and "episode_turns" in keys
    for a, b in zip(want.train, got.train):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}, a["step"]
        assert b["tool_calls_in_flight"] >= 0 and "slot_occupancy" in b  # engine stats too


def test_streaming_at_eta0_is_the_synchronous_run(policy, in_process, tmp_path, local_ray):
    """Streaming Ray workers (mode threaded) at η = 0: the buffer admits one batch per
    version, so every request samples with the learner's current version: the in-process
    η = 0 run (itself the synchronous one, tests/rl/test_async_loop.py) bit for bit."""
    config, params, task = policy
    remote = AsyncConfig(max_staleness=0, mode="threaded", backend="ray")
    got = run_async(config, params, task, cfg(tmp_path / "s0", LOOP4, asynchronous=remote))
    assert_same_run(in_process(0), got)
    assert got.train[-1]["buffer_consumed_groups"] == 4 * LOOP4.prompts_per_step


def test_streaming_workers_keep_the_staleness_bound(policy, tmp_path, local_ray):
    """Two streaming workers at η = 2 over 6 steps, worker 0 killed after step 2: every
    batch trains on tokens at most 2 versions old, no prompt is sampled twice (the data
    position advances b per request), every admitted group is consumed, queued or dropped
    as stale, and the killed worker's request is sent again (counted)."""
    config, params, task = policy
    loop = dataclasses.replace(LOOP, steps=6)
    remote = AsyncConfig(max_staleness=2, mode="threaded", backend="ray", rollout_workers=2)

    def kill_once(rec):
        if rec["step"] == 2:
            ray.kill(ray.get_actor(worker_name(tmp_path / "st", 0)), no_restart=False)

    got = run_async(config, params, task, cfg(tmp_path / "st", loop, asynchronous=remote),
                    hooks=RunHooks(on_step=kill_once))
    b = loop.prompts_per_step
    assert [r["step"] for r in got.train] == list(range(1, 7))
    for r in got.train:
        v = r["step"] - 1  # the learner's version at that step
        assert v - 2 <= r["behaviour_version_min"] <= r["behaviour_version_max"] <= v
        assert r["ray_request_lag"] <= 2
    last = got.train[-1]
    assert last["buffer_consumed_groups"] == 6 * b
    assert last["buffer_admitted_groups"] == last["buffer_consumed_groups"] + \
        last["buffer_dropped_stale_groups"] + last["buffer_queued_groups"]
    assert got.data_position % b == 0 and got.data_position >= 6 * b
    assert max(r["behaviour_version_max"] for r in got.train) >= 3  # it did move on
    assert last["ray_workers"] == 2


def test_a_killed_worker_is_restarted_and_the_run_is_unchanged(policy, in_process, tmp_path,
                                                               local_ray):
    """Two workers at η = 2 (requests v and v + 1 in flight together); worker 0 is killed
    after step 2 (ray.kill, restart allowed): Ray restarts it, the later requests go to the
    new process (its pid differs), and the run is still the in-process one bit for bit."""
    config, params, task = policy
    remote = AsyncConfig(max_staleness=2, mode="deterministic", backend="ray",
                         rollout_workers=2)
    pids = []

    def pid_of(worker):
        for _ in range(100):  # while Ray restarts it
            try:
                return ray.get(worker.pid.remote())
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.1)
        raise AssertionError("the worker did not come back")

    def kill_once(rec):
        worker = ray.get_actor(worker_name(tmp_path / "ray", 0))
        pids.append(pid_of(worker))
        if rec["step"] == 2:
            ray.kill(worker, no_restart=False)

    got = run_async(config, params, task, cfg(tmp_path / "ray", LOOP4, asynchronous=remote),
                    hooks=RunHooks(on_step=kill_once))
    assert_same_run(in_process(2), got)
    assert pids[0] == pids[1] != pids[2]  # a new process after the kill


def test_a_request_whose_worker_died_is_sent_again(policy, local_ray):
    """RaySource.answer on a request whose future failed because its worker process
    exited: the request goes again to the restarted worker and its answer is what the
    in-process sampling gives for the same inputs."""
    import os
    import types

    from rl.learner import init_train_state
    from rl.loops import StreamSampler, rollout_spec, sample_batch_groups
    from rl.loops.ray_workers import RaySource, RolloutWorker
    config, params, task = policy
    run_cfg = cfg("unused", LOOP)
    spec = rollout_spec(config, task, run_cfg)
    actor = ray.remote(max_restarts=-1, max_task_retries=0)(RolloutWorker).remote(
        spec, run_cfg.train, LOOP)
    state = init_train_state(params, run_cfg.train, 7)
    rng = np.asarray(state.rng)
    src = RaySource.__new__(RaySource)
    src.ray, src.workers, src.k, src.lora_ref = ray, [actor], 0, None
    src.inflight_updates = False  # static rollouts (sample, not sample_inflight)
    src.counters = {"ray_worker_restarts": 0, "ray_request_resends": 0}
    host = jax.device_get(params)
    src.refs = {0: ray.put((host, [str(x.dtype) for x in jax.tree.leaves(host)]))}
    dead = actor.__ray_call__.remote(lambda self: os._exit(1))
    src.inflight = {0: (0, dead, (0, rng, 5))}
    groups, rng_after, pos, _, _, episodes = src.answer(types.SimpleNamespace(), 0)
    assert episodes is None  # a task, not an environment
    assert src.counters["ray_worker_restarts"] == 1  # one death
    assert src.counters["ray_request_resends"] >= 1  # (and once per retry while it restarts)
    want, want_state, want_pos, _ = sample_batch_groups(
        state, 5, StreamSampler(spec=spec, config=run_cfg.train, loop=LOOP))
    assert pos == want_pos and np.array_equal(rng_after, np.asarray(want_state.rng))
    for g, w in zip(groups, want):
        np.testing.assert_array_equal(np.asarray(g.traj.response_ids),
                                      np.asarray(w.traj.response_ids))
    ray.kill(actor)


def log_softmax(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def swapped_logprobs(config, before, after, prompt, response, fed_before):
    """Reference log μ of `response` when the weights change from `before` to `after`
    once `fed_before` response tokens have been fed (their keys / values stay before's,
    as in any in-flight update): models.decoder's dense-cache path, prefill then one
    decode step per token (temperature 1), float64 log-softmax."""
    import jax.numpy as jnp

    from models.decoder import decode_step, prefill
    from models.kv_cache import init_cache

    seq = np.concatenate([prompt, response[:fed_before]])[None].astype(np.int32)
    logits, cache = prefill(before, config, seq, jnp.array([seq.shape[1]]),
                            init_cache(config, 1, 32))
    k = min(fed_before + 1, response.size)
    out = list(log_softmax(logits[0, prompt.size - 1:])[np.arange(k), response[:k]])
    for i in range(fed_before, response.size - 1):
        logits, cache = decode_step(after, config, jnp.array([response[i]]), cache)
        out.append(log_softmax(logits[0])[response[i + 1]])
    return np.array(out)


def test_a_request_picks_up_a_version_published_mid_flight(policy, local_ray):
    """Continuous rollouts on a worker (RolloutWorker.sample_inflight, called here in this
    process): version 1 is published after the request's first segment (of 2 tokens), so
    its first 2 tokens per row are version 0's (the very tokens of a request that sees no
    publish, which itself equals the deterministic path's sample()) and the rest are
    stamped 1; each token's behaviour log-prob is that of models.decoder's dense-cache
    path with the weights swapped after the first segment's tokens were fed."""
    from models.decoder import init_params
    from rl.loops import rollout_spec
    from rl.loops.ray_workers import RolloutWorker

    config, params, task = policy
    run_cfg = cfg("unused", LOOP, rollout=dataclasses.replace(cfg("unused").rollout,
                                                              segment_len=2))
    assert run_cfg.train.temperature == 1.0  # (the reference's)
    spec = rollout_spec(config, task, run_cfg)
    versions = (params, init_params(config, 1))
    boxed = []
    for p in versions:
        host = jax.device_get(p)
        boxed.append((host, [str(x.dtype) for x in jax.tree.leaves(host)]))
    rng = np.asarray(jax.random.key_data(jax.random.PRNGKey(3)), np.uint32)
    plain = RolloutWorker(spec, run_cfg.train, LOOP).sample_inflight(boxed[0], 0, rng, 5)
    reference = RolloutWorker(spec, run_cfg.train, LOOP).sample(boxed[0], 0, rng, 5)
    worker = RolloutWorker(spec, run_cfg.train, LOOP)
    seen, newest, ref_b = [], worker.newest, ray.put(boxed[1])

    def hooked(*args):  # publish v1 once the first segment has been drawn
        if len(seen) == 1:
            worker.publish(1, [ref_b])
        got = newest(*args)
        seen.append(got[1])
        return got

    worker.newest = hooked
    groups, rng_after, pos, stats, _, _ = worker.sample_inflight(boxed[0], 0, rng, 5)
    assert seen[0] == 0 and set(seen[1:]) == {1} and len(seen) >= 2
    assert pos == plain[2] == reference[2] == 5 + LOOP.prompts_per_step
    np.testing.assert_array_equal(rng_after, plain[1])
    np.testing.assert_array_equal(rng_after, reference[1])
    seg = run_cfg.rollout.segment_len
    for g, p0, r0 in zip(groups, plain[0], reference[0]):
        t, t0 = g.traj, p0.traj
        np.testing.assert_array_equal(t0.response_ids, r0.traj.response_ids)
        np.testing.assert_array_equal(t.response_ids[:, :seg], t0.response_ids[:, :seg])
        mask, vers = np.asarray(t.response_mask), np.asarray(t.versions)
        assert mask[:, seg:].any()  # responses outlive the first segment
        np.testing.assert_array_equal(vers[mask], np.where(np.nonzero(mask)[1] < seg, 0, 1))
        for row in range(t.response_ids.shape[0]):
            n, plen = int(mask[row].sum()), int(t.prompt_lengths[row])
            want = swapped_logprobs(config, *versions, np.asarray(t.prompt_ids[row, :plen]),
                                    np.asarray(t.response_ids[row, :n]), seg - 1)
            np.testing.assert_allclose(t.behaviour_logprobs[row, :n], want, atol=2e-5)


def test_continuous_streaming_at_eta0_is_the_synchronous_run(policy, in_process, tmp_path,
                                                             local_ray):
    """rollout='continuous' on streaming Ray workers at η = 0: no newer version exists while
    a request samples, so no token is drawn under two versions and the run is the
    in-process η = 0 (synchronous) run bit for bit."""
    config, params, task = policy
    remote = AsyncConfig(max_staleness=0, mode="threaded", backend="ray",
                         rollout="continuous")
    got = run_async(config, params, task, cfg(tmp_path / "c0", LOOP4, asynchronous=remote))
    assert_same_run(in_process(0), got)
    assert [r["mixed_version_rows"] for r in got.train] == [0.0] * 4


@pytest.mark.parametrize("workers, requests", [(2, 1), (1, 2)])
def test_continuous_streaming_keeps_the_staleness_bound(policy, tmp_path, local_ray, workers,
                                                        requests):
    """Continuous rollouts at η = 2 over 6 steps, on two streaming workers or on one whose
    two requests share its engine: every token trained is at most 2 versions old, the
    buffer's books balance, and the rows drawn under two versions (mixed_version_rows) are
    a share in [0, 1]."""
    config, params, task = policy
    loop = dataclasses.replace(LOOP, steps=6)
    remote = AsyncConfig(max_staleness=2, mode="threaded", backend="ray",
                         rollout_workers=workers, worker_requests=requests,
                         rollout="continuous")
    got = run_async(config, params, task, cfg(tmp_path / "c2", loop, asynchronous=remote))
    assert [r["step"] for r in got.train] == list(range(1, 7))
    for r in got.train:
        v = r["step"] - 1
        assert v - 2 <= r["behaviour_version_min"] <= r["behaviour_version_max"] <= v
        assert 0.0 <= r["mixed_version_rows"] <= 1.0
    last = got.train[-1]
    assert last["buffer_consumed_groups"] == 6 * loop.prompts_per_step
    assert last["buffer_admitted_groups"] == last["buffer_consumed_groups"] + \
        last["buffer_dropped_stale_groups"] + last["buffer_queued_groups"]
    assert max(r["behaviour_version_max"] for r in got.train) >= 3


def test_a_resumed_ray_run_is_the_straight_run(policy, in_process, tmp_path, local_ray):
    """Stopped after 2 steps (the learner's process gone), resumed to 4 with fresh workers:
    the in-process straight run, bit for bit (the ring, rng and position from the
    checkpoint)."""
    config, params, task = policy
    remote = AsyncConfig(max_staleness=2, mode="deterministic", backend="ray")
    run_async(config, params, task, cfg(tmp_path / "r", dataclasses.replace(LOOP4, steps=2),
                                        asynchronous=remote))
    resumed = run_async(config, params, task, cfg(tmp_path / "r", LOOP4, asynchronous=remote),
                        resume=True)
    assert_same_run(in_process(2), resumed)


def test_a_lora_run_sends_the_base_once_and_then_adapters(policy, tmp_path, local_ray):
    """LoRA at η = 1: the workers compose the adapters with the base sent once, the run
    equals the in-process LoRA run bit for bit, and each version's transfer is the
    adapters' bytes only."""
    from test_lora_loop import lora_cfg

    config, params, task = policy
    local = AsyncConfig(max_staleness=1, mode="deterministic")
    ref = run_async(config, params, task, lora_cfg(tmp_path / "l", LOOP4, asynchronous=local))
    got = run_async(config, params, task, lora_cfg(
        tmp_path / "r", LOOP4, asynchronous=dataclasses.replace(local, backend="ray")))
    assert_same_run(ref, got)
    adapter_bytes = sum(x.nbytes for x in leaves(got))  # state.params: the adapters
    assert adapter_bytes < sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)) / 4
    assert got.train[-1]["ray_sync_bytes"] == 3 * adapter_bytes  # versions 0, 1, 2


def test_bf16_weight_sync_halves_the_bytes(policy, in_process, tmp_path, local_ray):
    """sync_dtype bfloat16 at η = 0: half the bytes per version, and the workers sample
    with bf16-rounded weights, so the behaviour log-probs move away from the learner's:
    the train/inference gap (mismatch_log_ratio_abs_mean) is far above the fp32 run's,
    which is rounding only."""
    config, params, task = policy
    remote = AsyncConfig(max_staleness=0, mode="deterministic", backend="ray",
                         sync_dtype="bfloat16")
    got = run_async(config, params, task, cfg(tmp_path / "b", LOOP4, asynchronous=remote))
    n_params = sum(x.size for x in leaves(got))
    assert got.train[-1]["ray_sync_bytes"] == 4 * n_params * 2  # versions 0-3, 2 bytes each
    fp32 = [r["mismatch_log_ratio_abs_mean"] for r in in_process(0).train]
    bf16 = [r["mismatch_log_ratio_abs_mean"] for r in got.train]
    assert max(fp32) < 1e-4 and min(bf16) > 10 * max(fp32), (fp32, bf16)


@pytest.mark.parametrize("sets, match", [
    ({"mode": "threaded", "rollout": "april"}, "APRIL rounds on Ray are not built"),
    ({"mode": "deterministic", "rollout": "april"}, "APRIL rounds on Ray are not built"),
    ({"mode": "deterministic", "rollout": "continuous"}, "needs mode='threaded'"),
    ({"rollout_workers": 0, "mode": "deterministic"}, "rollout_workers must be an int >= 1"),
    ({"worker_requests": 0, "mode": "deterministic"}, "worker_requests must be an int >= 1"),
])
def test_ray_config_refusals(sets, match):
    with pytest.raises(ValueError, match=match):
        AsyncConfig(backend="ray", **sets)
    for local in ({"rollout_workers": 2}, {"worker_requests": 2}):
        with pytest.raises(ValueError, match="for backend='ray'"):
            AsyncConfig(**local)


def test_ray_refuses_what_lives_with_the_sampler():
    from rl.run import PRESETS

    base = PRESETS["tiny-synthetic"].overrides(["async.mode=deterministic", "async.backend=ray"])
    base.validate()
    for sets, match in ((["loop.dynamic_sampling=true"], "dynamic sampling"),
                        (["scheduler.name=dars"], "prompt scheduler")):
        with pytest.raises(ValueError, match=match):
            base.overrides(sets).validate()
    # environments run on Ray workers (test_ray_workers_run_episodes)
    PRESETS["tiny-guess"].overrides(["async.mode=deterministic", "async.backend=ray"]).validate()
