"""Tenants in the core: a session is its opener's, Status shows a tenant only its own work, quotas refuse at
once. Driven through the fake-clock harness, with the `who` the adapter sets from each caller's API key."""

from __future__ import annotations

import pytest

from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello

ALICE = ev.Principal("alice")
BOB = ev.Principal("bob")
ADMIN = ev.Principal("ops", admin=True)


def as_(who, cls):
    """An event class that carries `who` (the harness builds events as cls(request_id, msg))."""
    return lambda rid, msg: cls(rid, msg, who)


@pytest.fixture
def two(make_harness):
    h = make_harness(session_timeout_s=5.0)
    for i in range(4):
        h.register(f"10.0.0.{i}:7000")
    a = h.call(as_(ALICE, ev.OpenSession), m.OpenSession(hello=hello("client"), name="alice-job")).session
    b = h.call(as_(BOB, ev.OpenSession), m.OpenSession(hello=hello("client"), name="bob-job")).session
    assert h.call(as_(ALICE, ev.OpenMesh), m.OpenMesh(session=a, mesh=1, devices=[0, 1], shape=[2])).placed
    assert h.call(as_(BOB, ev.OpenMesh), m.OpenMesh(session=b, mesh=1, devices=[0], shape=[1])).placed
    return h, a, b


def test_another_tenants_session_reads_as_unknown(two):
    h, a, b = two
    for cls, msg in [(ev.OpenMesh, m.OpenMesh(session=b, mesh=2, devices=[5], shape=[1])),
                     (ev.Submit, m.Submit(session=b, seq=1, instrs=[m.InstrDelete(tids=[1])])),
                     (ev.Sync, m.Sync(session=b, upto=0))]:
        reply = h.call(as_(ALICE, cls), msg)
        assert reply.kind == "refused" and f"unknown session {b[:16]!r}" in reply.message
    assert h.call(as_(ALICE, ev.CloseSession), m.CloseSession(session=b)).ok is False
    assert h.call(as_(ALICE, ev.KeepAlive), m.KeepAlive(session=b)).ok is False
    assert b in h.core.sessions and h.core.sessions[b].seq == 0  # untouched
    assert h.call(as_(BOB, ev.Submit), m.Submit(session=b, seq=1, instrs=[])).accepted == 1


def test_another_tenants_requests_keep_nothing_alive(two):
    h, a, b = two
    for _ in range(8):  # alice keeps talking about bob's session, bob is silent
        h.advance(1.0)
        h.call(as_(ALICE, ev.KeepAlive), m.KeepAlive(session=b))
        h.call(as_(ALICE, ev.KeepAlive), m.KeepAlive(session=a))
    assert b not in h.core.sessions and a in h.core.sessions


def test_a_tenant_sees_its_own_work_and_counts_of_the_rest(two):
    h, a, b = two
    h.call(ev.Report, m.WorkerReport(worker="w0", completed=h.core.workers["w0"].sent, received_bytes=1 << 30,
                                     sessions={a: m.ShardStats(2, 64), b: m.ShardStats(5, 1000)}))
    mine = h.call(as_(ALICE, ev.Status), m.StatusRequest())
    assert [s.session for s in mine.sessions] == [a] and mine.sessions[0].tenant == "alice"
    used = set(h.core.sessions[a].devices.values())
    assert {w.worker for w in mine.workers} == used
    for w in mine.workers:
        assert all(d.startswith(a) for d in w.devices) and set(w.leases) <= {a}
        assert w.utilization == -1.0 and w.backup_bytes == 0
        assert w.received_bytes == 0  # every session's traffic through that worker: bob's volume, over time
    assert sum(w.bytes for w in mine.workers) == 64  # its own shards only
    assert mine.events == []  # event lines name everyone's sessions
    assert (mine.other_sessions, mine.other_devices, mine.other_workers) == (1, 1, 4 - len(used))
    every = h.call(as_(ADMIN, ev.Status), m.StatusRequest())
    assert {s.session for s in every.sessions} == {a, b} and len(every.workers) == 4 and every.events
    assert {w.worker: w.received_bytes for w in every.workers}["w0"] == 1 << 30


def test_quotas_refuse_at_once_naming_the_quota(make_harness):
    h = make_harness()
    for i in range(4):
        h.register(f"10.0.0.{i}:7000")
    capped = ev.Principal("carol", quota=ev.Quota(devices=3, sessions=2))
    s1 = h.call(as_(capped, ev.OpenSession), m.OpenSession(hello=hello("client"))).session
    h.call(as_(capped, ev.OpenSession), m.OpenSession(hello=hello("client")))
    third = h.call(as_(capped, ev.OpenSession), m.OpenSession(hello=hello("client")))
    assert third.kind == "quota" and "has 2 sessions open, its quota (sessions) is 2" in third.message
    assert h.call(as_(capped, ev.OpenMesh), m.OpenMesh(session=s1, mesh=1, devices=[0, 1], shape=[2])).placed
    over = h.call(as_(capped, ev.OpenMesh), m.OpenMesh(session=s1, mesh=2, devices=[2, 3], shape=[2]))
    assert over.kind == "quota" and "may hold 3 logical devices (quota devices)" in over.message
    assert h.core.sched.position(s1) == 0 and not h.core.sched.queued  # refused, not queued

    memory = ev.Principal("dave", quota=ev.Quota(memory_bytes=1000))
    whole = h.call(as_(memory, ev.OpenSession), m.OpenSession(hello=hello("client")))
    assert whole.kind == "quota" and "open sessions with memory_cap" in whole.message
    s = h.call(as_(memory, ev.OpenSession), m.OpenSession(hello=hello("client"), memory_cap=400)).session
    assert h.call(as_(memory, ev.OpenMesh), m.OpenMesh(session=s, mesh=1, devices=[0, 1], shape=[2])).placed
    over = h.call(as_(memory, ev.OpenMesh), m.OpenMesh(session=s, mesh=2, devices=[2], shape=[1]))
    assert over.kind == "quota" and "may lease 1000 bytes" in over.message and "leases 800" in over.message


def test_a_worker_cannot_speak_for_a_session_it_never_ran(make_harness):
    """A worker's errors and shard stats count only for sessions bound to it or sent work there: a worker (buggy or
    compromised) named alice's session and her Sync failed with its error, her bill and Status took its bytes."""
    from _core_helpers import create

    h = make_harness()
    for i in range(2):
        h.register(f"10.0.0.{i}:7000")
    a = h.call(as_(ALICE, ev.OpenSession), m.OpenSession(hello=hello("client"))).session
    placed = h.call(as_(ALICE, ev.OpenMesh), m.OpenMesh(session=a, mesh=1, devices=[0], shape=[1]))
    mine = h.core.sessions[a].devices[0]
    other = next(w for w in h.core.workers if w != mine)
    assert placed.placed
    h.call(as_(ALICE, ev.Submit), m.Submit(session=a, seq=1, instrs=[create(1)]))
    h.report_all()
    forged = m.ErrorReport(op="aten.mm", src="", message="poison from a stranger", seq=1)
    h.call(ev.Report, m.WorkerReport(worker=other, completed=h.core.workers[other].sent, errors={a: [forged]},
                                     sessions={a: m.ShardStats(1, 10**9)}))
    reply = h.call(as_(ALICE, ev.Sync), m.Sync(session=a, upto=1))
    assert reply.done and reply.errors == []
    assert h.core.workers[other].bytes == 0
