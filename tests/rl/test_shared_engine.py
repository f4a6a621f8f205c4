"""One engine shared by a worker's concurrent requests (rl.loops.shared_engine): a request
alone samples what its own round (rl.loops.producer.sample_round) samples; two requests
queued together get exactly the groups of one round over all their prompts (each its own,
in the order it queued them), also when the engine has room for one request only and the
second's groups take the slots the first's free; a segment that raises fails every request
in the engine and the next request starts fresh.

Same geometry as tests/rl/test_sync_loop.py (tiny-synthetic preset, groups of 4)."""
import threading

import numpy as np
import pytest
from test_sync_loop import policy, sampler_of  # noqa: F401  (same geometry)

from rl.loops.producer import sample_round
from rl.loops.shared_engine import SharedEngine


def same_groups(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("prompt_ids", "response_ids", "response_mask", "behaviour_logprobs",
                     "versions", "group_ids", "finished"):
            np.testing.assert_array_equal(np.asarray(getattr(x.traj, name)),
                                          np.asarray(getattr(y.traj, name)), err_msg=name)
        assert x.rewards.keys() == y.rewards.keys()
        for k in x.rewards:
            np.testing.assert_array_equal(x.rewards[k], y.rewards[k])


def counting(params):
    """latest() that counts its calls (one per segment stepped, plus one per request)."""
    calls = []

    def latest():
        calls.append(1)
        return params, 0
    return latest, calls


def run_threads(engine, tickets, latest):
    out, errors = {}, []

    def body(name, ticket):
        try:
            out[name] = engine.wait(ticket, latest)
        except BaseException as err:  # noqa: BLE001  (asserted below)
            errors.append(err)
    threads = [threading.Thread(target=body, args=(n, t)) for n, t in tickets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out, errors


def test_one_request_is_its_own_round(policy):  # noqa: F811
    config, params, task = policy
    spec = sampler_of(config, task).spec
    prompts = task.train_prompts(0, 2)
    want, tokens = sample_round(spec, 2 * spec.group_size, 7, prompts, lambda: (params, 0))
    engine = SharedEngine(spec, 2 * spec.group_size)
    got, got_tokens = engine.sample(7, prompts, lambda: (params, 0))
    same_groups(got, want)
    assert got_tokens == tokens > 0
    # the next request finds the engine idle: a fresh engine, seeded by its own seed
    again, _ = engine.sample(7, prompts, lambda: (params, 0))
    same_groups(again, want)
    # in an engine with room for more requests it samples the same groups
    bigger, _ = SharedEngine(spec, 4 * spec.group_size).sample(7, prompts, lambda: (params, 0))
    same_groups(bigger, want)
    engine.close()


@pytest.mark.parametrize("requests_room", [2, 1])
def test_two_requests_share_one_round(policy, requests_room):  # noqa: F811
    """Queued together, A's and B's groups are those of one round over A's prompts then
    B's; with room for one request only, B's groups start in the slots A's free."""
    config, params, task = policy
    spec = sampler_of(config, task).spec
    a, b = task.train_prompts(0, 2), task.train_prompts(2, 2)
    slots = requests_room * 2 * spec.group_size
    want, tokens = sample_round(spec, slots, 11, a + b, lambda: (params, 0))
    engine = SharedEngine(spec, slots)
    tickets = {"a": engine.queue(11, a), "b": engine.queue(99, b)}  # B's seed goes unused
    latest, calls = counting(params)
    out, errors = run_threads(engine, tickets, latest)
    assert not errors, errors
    same_groups(out["a"][0], want[:2])
    same_groups(out["b"][0], want[2:])
    assert out["a"][1] + out["b"][1] == tokens  # every segment stepped once, by one thread
    one_round, one_calls = counting(params)
    sample_round(spec, slots, 11, a + b, one_round)
    assert len(calls) == len(one_calls)  # as many segments as the one round
    assert requests_room == 2 or len(calls) >= 2  # room for one: B's groups waited for slots
    engine.close()


def test_a_failing_segment_fails_every_request_and_the_next_starts_fresh(policy):  # noqa: F811
    config, params, task = policy
    spec = sampler_of(config, task).spec
    engine = SharedEngine(spec, 4 * spec.group_size)
    tickets = {"a": engine.queue(3, task.train_prompts(0, 2)),
               "b": engine.queue(4, task.train_prompts(2, 2))}
    def broken():
        raise ValueError("no params")
    out, errors = run_threads(engine, tickets, broken)
    assert not out and len(errors) == 2
    assert any(isinstance(e, ValueError) for e in errors)
    assert any(isinstance(e, RuntimeError) and "another request" in str(e) for e in errors)
    prompts = task.train_prompts(0, 2)
    got, _ = engine.sample(5, prompts, lambda: (params, 0))
    want, _ = sample_round(spec, 4 * spec.group_size, 5, prompts, lambda: (params, 0))
    same_groups(got, want)
