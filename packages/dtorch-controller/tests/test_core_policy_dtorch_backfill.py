"""The DTorch policy's backfill (policies/dtorch.py rule 8), through the core on a fake clock: a wide request that
cannot be placed no longer holds the requests of its level behind it once it has waited `backfill_after`."""

from __future__ import annotations

from dtorch_controller.core import events as ev
from dtorch_controller.core.policies import DTorchPolicy
from dtorch_protocol import messages as m

QUIET = dict(heartbeat_interval_s=1e5, heartbeat_timeout_s=1e6, session_timeout_s=0)


def state(h, sid):
    return h.core.sched.state(sid)


def blocked_wide_request(make_harness, **params):
    """3 devices: a high-class session on one, a normal one (`small`, level 0) on another, one free. A 3-device
    request of class normal cannot be placed: it may not preempt the high class, nor `small` (its own level).
    A 1-device request arrives behind it."""
    h = make_harness(policy=DTorchPolicy({"thresholds": [1000], "fairness": 0, **params}), **QUIET)
    for i in range(3):
        h.register(f"10.0.0.{i}:7000")
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed
    small = h.open_session()
    assert h.open_mesh(small, 1, [0]).placed
    h.advance(1)
    wide = h.open_session()
    assert not h.open_mesh(wide, 1, [0, 1, 2]).placed
    h.advance(1)
    late = h.open_session()
    assert not h.open_mesh(late, 1, [0]).placed  # a device is free, but it may not overtake the wide request
    return h, high, small, wide, late


def test_a_request_behind_a_blocked_wide_one_goes_ahead_once_that_one_waited_backfill_after(make_harness):
    h, high, small, wide, late = blocked_wide_request(make_harness, backfill_after=30)
    h.advance(28)  # the wide request has waited 29 s
    assert state(h, late) == "waiting" and state(h, wide) == "waiting"
    h.advance(2)  # 31 s: the wide request moves to slot 0, the late one goes ahead onto the free device
    assert state(h, late) == "running" and state(h, wide) == "waiting"
    assert h.core.sched.tenants[wide].key[0] == 1 * 3 + 0  # class normal, slot 0
    h.call(ev.CloseSession, m.CloseSession(session=high))  # now it fits: it preempts both sessions of its level
    assert state(h, wide) == "running"
    assert state(h, small) == "frozen" and state(h, late) == "frozen"
    h.advance(100)  # they ran before: no slot 0 for them, however long they wait
    assert h.core.sched.tenants[small].rank == h.core.sched.tenants[late].rank == 1 * 3 + 1 + 0
    assert state(h, wide) == "running"


def test_without_backfill_the_request_behind_a_blocked_wide_one_waits_while_a_device_is_free(make_harness):
    h, high, small, wide, late = blocked_wide_request(make_harness, backfill_after=0)
    h.advance(1000)
    assert state(h, late) == "waiting" and state(h, wide) == "waiting" and state(h, small) == "running"
    assert h.core.sched.pool.free_total == 1
    assert DTorchPolicy().backfill_after == 30  # the default is on
