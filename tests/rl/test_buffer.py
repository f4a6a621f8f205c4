"""TrajectoryBuffer: AReaL's admission rule and the staleness policies, worked by hand.

Hand-worked example (b = 2 groups per step, η = 1): the producer may have at most
(η + v + 1)·b groups accepted + running, where accepted = put so far (since version 0)
minus groups dropped as stale.
  v=0: limit 4. reserve 3 -> capacity 1 (a 4th fits, a 2-group reserve does not);
       put 3 + reserve/put 1 -> 4 queued, capacity 0.
  learner takes 2 at v=0 -> consumed 2; still capacity 0 (version unchanged).
  v=1: limit 6 - 4 accepted = 2. reserve 2, put A (all tokens v1) and M (a group whose
       first tokens are v0, the rest v1: an in-flight weight swap) -> capacity 0.
  learner at v=1 takes the two remaining v0 groups (0 >= v - η = 0: fresh).
  learner at v=3: v - η = 2, so A and M are stale -> "drop" removes both (their tokens
       counted), nothing is left (None), and capacity = (1+3+1)·2 - (6 - 2) = 6.
  "downweight" at v=2 instead: v - η = 1; A is fresh, M keeps its group with weight w on
       its version-0 tokens only."""
import threading
import time

import numpy as np
import pytest

from rl.loops import ScoredGroup, TrajectoryBuffer
from rl.loops.buffer import BufferBatch
from rl.trajectory import Trajectory

N, R = 2, 4


def group(versions, lengths=(3, 4), reward=(0.0, 1.0)):
    """A group of N rows; versions: one int, or [N][R] per-token versions."""
    mask = np.arange(R)[None, :] < np.asarray(lengths)[:, None]
    ver = np.broadcast_to(np.asarray(versions, np.int32), (N, R)).copy()
    traj = Trajectory(prompt_ids=np.ones((N, 2), np.int32), prompt_lengths=np.full((N,), 2, np.int32),
                      response_ids=np.where(mask, 3, 0).astype(np.int32), response_mask=mask,
                      behaviour_logprobs=np.where(mask, -0.5, 0).astype(np.float32),
                      versions=np.where(mask, ver, 0), group_ids=np.zeros((N,), np.int32),
                      finished=np.ones((N,), bool), truncated=np.zeros((N,), bool))
    return ScoredGroup(traj=traj, rewards={"r": np.asarray(reward, np.float64)})


MIXED = [[0, 0, 1, 1], [0, 1, 1, 1]]  # 3 + 4 tokens: v0 tokens = 2 (row 0) + 1 (row 1)


def fill_to_version_one(buf):
    assert buf.capacity() == 4
    assert buf.reserve(3) and buf.capacity() == 1
    assert buf.can_admit(1) and not buf.can_admit(2) and not buf.reserve(2)
    olds = [group(0, reward=(i, 0.0)) for i in range(4)]
    for g in olds[:3]:
        buf.put(g)
    assert buf.capacity() == 1
    assert buf.reserve(1)
    buf.put(olds[3])
    assert buf.capacity() == 0 and buf.stats()["queued_groups"] == 4
    first = buf.get_batch(2, 0)
    assert [g.rewards["r"][0] for g in first.groups] == [0, 1]  # FIFO
    assert buf.capacity() == 0
    buf.set_version(1)
    assert buf.capacity() == 2
    assert buf.reserve(2)
    a, m = group(1), group(MIXED)
    buf.put(a)
    buf.put(m)
    assert buf.capacity() == 0 and not buf.can_admit(1)
    return a, m


def test_admission_and_drop_hand_worked():
    buf = TrajectoryBuffer(batch_groups=2, max_staleness=1, stale_policy="drop")
    fill_to_version_one(buf)
    second = buf.get_batch(2, 1)
    assert [g.rewards["r"][0] for g in second.groups] == [2, 3] and second.token_weights is None
    assert buf.get_batch(2, 3, timeout=0) is None
    s = buf.stats()
    assert s["dropped_stale_groups"] == 2 and s["dropped_stale_tokens"] == 7 + 7
    assert s["consumed_groups"] == 4 and s["consumed_tokens"] == 4 * 7
    assert s["admitted_groups"] == 6 and s["admitted_tokens"] == 6 * 7
    assert s["queued_groups"] == 0 and s["running_groups"] == 0
    assert buf.capacity() == 6 and s["version"] == 3
    # Nothing is lost silently.
    assert s["admitted_groups"] == s["consumed_groups"] + s["dropped_stale_groups"] + s["queued_groups"]


def test_downweight_marks_only_the_stale_tokens():
    buf = TrajectoryBuffer(batch_groups=2, max_staleness=1, stale_policy="downweight",
                           stale_weight=0.25)
    a, m = fill_to_version_one(buf)
    buf.get_batch(2, 1)
    out = buf.get_batch(2, 2, timeout=0)
    assert isinstance(out, BufferBatch) and out.groups == [a, m]
    np.testing.assert_array_equal(out.token_weights[0], np.ones((N, R)))
    want = np.ones((N, R), np.float32)
    want[0, :2] = 0.25  # row 0: tokens 0, 1 are version 0 < 2 - 1
    want[1, 0] = 0.25   # row 1: token 0
    np.testing.assert_array_equal(out.token_weights[1], want)
    s = buf.stats()
    assert (s["downweighted_groups"], s["downweighted_tokens"], s["dropped_stale_groups"]) == (1, 3, 0)
    assert s["consumed_groups"] == 6


def test_eta_zero_admits_one_batch_per_version_and_release():
    buf = TrajectoryBuffer(batch_groups=3, max_staleness=0, start_version=5)
    assert buf.capacity() == 3  # (0 + 5 + 1)·3 - 5·3 accepted before the resume
    assert buf.reserve(3) and not buf.reserve(1)
    buf.release(1, "filtered")  # dynamic sampling threw one away: its place is free again
    assert buf.capacity() == 1
    buf.release(2, "cancelled")
    s = buf.stats()
    assert (s["filtered_groups"], s["cancelled_groups"], s["running_groups"]) == (1, 2, 0)
    with pytest.raises(ValueError, match="only 0 groups are reserved"):
        buf.release(1)
    with pytest.raises(ValueError, match="put without a reservation"):
        buf.put(group(5))


def test_get_batch_blocks_until_a_producer_puts_and_close_wakes_it():
    buf = TrajectoryBuffer(batch_groups=1, max_staleness=0)
    got = []
    t = threading.Thread(target=lambda: got.append(buf.get_batch(1, 0, timeout=5.0)))
    t.start()
    time.sleep(0.05)
    assert buf.reserve(1)
    buf.put(group(0))
    t.join(5.0)
    assert not t.is_alive() and len(got[0].groups) == 1
    t = threading.Thread(target=lambda: got.append(buf.get_batch(1, 0)))
    t.start()
    time.sleep(0.05)
    buf.close()
    t.join(5.0)
    assert not t.is_alive() and got[1] is None
    assert not buf.reserve(1) and not buf.wait_for_capacity(1, timeout=0.01)


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_groups": 0, "max_staleness": 1}, "batch_groups"),
    ({"batch_groups": 2, "max_staleness": -1}, "max_staleness"),
    ({"batch_groups": 2, "max_staleness": 1, "stale_policy": "keep"}, "stale_policy"),
    ({"batch_groups": 2, "max_staleness": 1, "stale_weight": 1.5}, "stale_weight"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrajectoryBuffer(**kwargs)
