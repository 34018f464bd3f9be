"""Workers: registration, heartbeats on a fake clock, loss, fencing, status."""

from __future__ import annotations

from _core_helpers import cmds_of, spec
from dtorch_controller.core import Config, ControllerCore, Refusal
from dtorch_controller.core import events as ev
from dtorch_controller.core.effects import AliveReply, Fenced
from dtorch_controller.core.timers import Heartbeat
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello


def test_register_assigns_sequential_ids_and_the_heartbeat_interval(make_harness):
    h = make_harness(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0)
    reply = h.call(ev.Register, m.RegisterWorker(hello=hello("worker"), address="10.0.0.1:7000", device_type="cuda",
                                                 memory_bytes=80 << 30, labels={"rack": "a"}))
    assert reply == m.Registered(worker="w0", heartbeat_interval_s=0.25)
    assert h.register("10.0.0.2:7000") == "w1"
    assert h.core.workers["w0"].labels == {"rack": "a"}
    assert Heartbeat("w0") in h.timers


def test_register_with_another_protocol_major_is_refused_naming_both_versions(h):
    bad = m.Hello(protocol_version="2.0", package_version="9.9.9", role="worker")
    reply = h.call(ev.Register, m.RegisterWorker(hello=bad, address="a:1", device_type="cpu", memory_bytes=0))
    assert isinstance(reply, Refusal) and reply.kind == "protocol"
    assert "2.0" in reply.message and m.PROTOCOL_VERSION in reply.message
    assert not h.core.workers


def test_newer_minor_is_accepted(h):
    major, minor = m.PROTOCOL_VERSION.split(".")
    newer = m.Hello(protocol_version=f"{major}.{int(minor) + 1}", package_version="0.9.0", role="worker")
    reply = h.call(ev.Register, m.RegisterWorker(hello=newer, address="a:1", device_type="cpu", memory_bytes=0))
    assert isinstance(reply, m.Registered)


def test_an_older_minor_worker_is_refused_but_an_older_client_is_not(h, refused):
    older = m.Hello(protocol_version="1.2", package_version="0.1.0", role="worker")
    reply = h.call(ev.Register, m.RegisterWorker(hello=older, address="a:1", device_type="cpu", memory_bytes=0))
    assert refused(reply, "protocol") and "upgrade dtorch-worker" in reply.message and "1.2" in reply.message
    assert not h.core.workers
    client = m.Hello(protocol_version="1.0", package_version="0.1.0", role="client")
    assert isinstance(h.call(ev.OpenSession, m.OpenSession(hello=client, name="old")), m.SessionOpened)


def test_a_newer_minor_client_is_refused(h, refused):
    """Its new fields would be dropped unread (a memory cap, say): refused, naming what to upgrade."""
    major, minor = m.PROTOCOL_VERSION.split(".")
    newer = m.Hello(protocol_version=f"{major}.{int(minor) + 1}", package_version="9.0.0", role="client")
    reply = h.call(ev.OpenSession, m.OpenSession(hello=newer, name="new"))
    assert refused(reply, "protocol") and "upgrade dtorch-controller" in reply.message
    assert newer.protocol_version in reply.message and not h.core.sessions


def test_wrong_role_and_empty_address_are_refused(h, refused):
    reply = h.call(ev.Register, m.RegisterWorker(hello=hello("client"), address="a:1", device_type="cpu",
                                                 memory_bytes=0))
    assert refused(reply, "protocol") and "worker" in reply.message
    reply = h.call(ev.Register, m.RegisterWorker(hello=hello("worker"), address="", device_type="cpu", memory_bytes=0))
    assert refused(reply)


def test_silent_worker_becomes_suspect_then_lost_within_the_timeout(h):
    w = h.register("a:1")
    h.advance(0.3)
    assert h.core.workers[w].state == "alive"
    h.advance(0.15)  # 0.45 s > 2 intervals
    assert h.core.workers[w].state == "suspect"
    h.advance(0.5)  # 0.95 s
    assert h.core.workers[w].state == "suspect"
    h.advance(0.05)  # exactly the timeout
    assert h.core.workers[w].state == "lost"
    assert any("w0" in line and "lost" in line for line in h.status().events)


def test_reports_keep_a_worker_alive_and_bring_a_suspect_back(h):
    w = h.register("a:1")
    for _ in range(20):
        h.advance(0.2)
        assert h.report(w).ok
    assert h.core.workers[w].state == "alive"
    h.advance(0.5)
    assert h.core.workers[w].state == "suspect"
    assert h.report(w).ok
    assert h.core.workers[w].state == "alive"
    h.advance(0.9)
    assert h.core.workers[w].state == "suspect"
    h.advance(0.2)
    assert h.core.workers[w].state == "lost"


def alive(h, *workers, utilization=-1.0):
    return h.call(ev.WorkersAlive, {w: utilization for w in workers})


def test_workers_alive_is_an_empty_report_of_each_worker_and_names_the_fenced_ones(h):
    """One `WorkersAlive` keeps its workers alive as their reports would, brings a suspect one back (a waiting mesh
    is placed on it at once), and is answered once, naming the lost and unknown workers among them."""
    w0, w1, w2 = (h.register(f"a:{i}") for i in range(3))
    for _ in range(10):
        h.advance(0.2)
        assert h.core.workers[w0].state == h.core.workers[w1].state == "alive"  # never suspect in between
        assert alive(h, w0, w1) == AliveReply()
    assert [h.core.workers[w].state for w in (w0, w1, w2)] == ["alive", "alive", "lost"]
    assert h.core.workers[w0].last_seen == h.now
    h.advance(0.39)
    assert h.core.workers[w0].state == "alive"
    h.advance(0.01)  # two intervals after the last one: detection runs from it, as from a report
    assert h.core.workers[w0].state == h.core.workers[w1].state == "suspect"
    s = h.open_session()
    assert not h.open_mesh(s, 1, [0]).placed  # no placeable worker
    lost_seen = h.core.workers[w2].last_seen
    assert alive(h, w2, w0, "w99", utilization=0.25) == AliveReply(fenced=(w2, "w99"))
    assert h.core.sched.state(s) == "running" and h.core.view.sessions_on(w0) == {s}
    assert h.core.workers[w0].state == "alive" and h.core.workers[w0].utilization == 0.25
    assert h.core.workers[w1].state == "suspect" and h.core.workers[w2].last_seen == lost_seen
    assert any(f"worker {w0} reported again" in line for line in h.status().events)
    h.advance(0.6)  # w1's timeout: lost; w0, heard 0.6 s ago, is suspect again
    assert [h.core.workers[w].state for w in (w0, w1)] == ["suspect", "lost"]


def test_workers_alive_does_what_one_empty_report_per_worker_does(make_harness):
    """Twin cores, one fed `Report`s with nothing new and the other the same workers' `WorkersAlive`: the same
    effects (but the replies), worker records, session errors and event log, through suspect workers coming back
    (placing a waiting mesh), a memory cap found over at a heartbeat, a lost worker's late heartbeat."""
    twins = [make_harness(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, session_timeout_s=0) for _ in "ab"]
    fenced: list[list] = [[], []]  # per round, the workers answered "fenced"
    for h, out in zip(twins, fenced):
        ws = [h.register(f"a:{i}", memory=1000) for i in range(4)]
        capped = h.open_session(memory_cap=100)
        assert h.open_mesh(capped, 1, [0]).placed
        h.report(ws[0], sessions={capped: m.ShardStats(tensors=1, bytes=50)})
        whole = h.open_session()
        assert h.open_mesh(whole, 1, [0, 1]).placed
        for round_ in range(8):
            h.advance(0.45 if round_ in (2, 5) else 0.2)  # 2 and 5: everyone goes suspect
            if round_ == 4:  # the capped session grows past its cap: the next report (any) says so
                h.core.workers[ws[0]].stats = {capped: m.ShardStats(tensors=2, bytes=150)}
            if round_ == 5:  # every worker is suspect: it waits, and is placed when w0 is back
                waiting = h.open_session(memory_cap=100)
                assert not h.open_mesh(waiting, 1, [0]).placed
            beating = [w for i, w in enumerate(ws) if i != 3 or round_ not in (3, 4, 5, 6)]  # w3 lost in round 6
            if h is twins[0]:
                out.append([w for w in beating if not h.report(w, completed=h.core.workers[w].completed,
                                                               sessions=h.core.workers[w].stats).ok])
            else:
                out.append(list(alive(h, *beating).fenced))
        h.advance(0.5)
    a, b = twins
    assert fenced[0] == fenced[1] and fenced[0][-1] == ["w3"]
    assert a.notices == b.notices and a.sent == b.sent and a.timers == b.timers
    assert any(isinstance(n, Fenced) for n in a.notices) and a.core.sched.state(waiting) == "running"
    fields = ("state", "last_seen", "completed", "stats", "sessions")
    assert [[getattr(w, f) for f in fields] for w in a.core.workers.values()] == \
        [[getattr(w, f) for f in fields] for w in b.core.workers.values()]
    assert [s.errors for s in a.core.sessions.values()] == [s.errors for s in b.core.sessions.values()]
    assert any(e.op == "memory cap" for s in a.core.sessions.values() for e in s.errors)
    assert a.status().events == b.status().events


def test_lost_and_unknown_workers_are_fenced_and_their_data_ignored(h):
    w = h.register("a:1")
    sid = h.open_session()
    h.open_mesh(sid, 1, [0])
    h.advance(1.5)
    assert h.core.workers[w].state == "lost"
    errors_before = list(h.core.sessions[sid].errors)
    late = m.ErrorReport(op="aten.add.Tensor", src="x.py:1", message="boom")
    reply = h.report(w, completed=5, errors={sid: [late]}, sessions={sid: m.ShardStats(3, 300)})
    assert reply == m.ReportReply(ok=False, message="fenced")
    assert h.core.workers[w].state == "lost" and h.core.workers[w].completed == 0
    assert h.core.sessions[sid].errors == errors_before
    assert h.report("w99") == m.ReportReply(ok=False, message="fenced")


def test_a_registration_at_a_live_workers_address_is_refused_not_obeyed(h):
    """It used to fence the live worker (which then exited): anyone able to register could take a worker down."""
    old = h.register("a:1")
    refused = h.call(ev.Register, m.RegisterWorker(hello=hello("worker"), address="a:1", device_type="cpu",
                                                   memory_bytes=1 << 30))
    assert refused.kind == "conflict" and "belongs to live worker w0" in refused.message
    assert h.core.workers[old].state == "alive" and h.report(old).ok
    h.advance(h.core.config.heartbeat_timeout_s + 0.1)  # the old process is gone: silent until declared lost
    assert h.core.workers[old].state == "lost"
    new = h.register("a:1")  # a restart at the same address is then accepted
    assert new == "w1" and not h.report(old).ok and h.report(new).ok


def test_unreachable_worker_is_lost_at_once_and_syncs_report_it(make_harness):
    h = make_harness(snapshot_every_batches=0)  # recovery off: the loss is reported (test_core_recovery.py)
    w0, w1 = h.register("a:1"), h.register("b:1")
    sid = h.open_session()
    h.open_mesh(sid, 1, [0, 1])
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([4]), init="zeros")])
    h.report(w0)
    rid, reply = h.sync(sid, 1)
    assert reply is None  # w1 has not reported yet
    h.handle(ev.WorkerUnreachable(w1, "b:1", "connection refused"))
    assert h.core.workers[w1].state == "lost"
    reply = h.replies[rid]
    assert reply.done
    [error] = reply.errors
    assert "w1" in error.message and "[1]" in error.message and "connection refused" in error.message
    assert error.tid == 1
    assert h.core.sessions[sid].state == "degraded"


def test_lost_worker_error_names_the_logical_devices_whose_tensors_are_gone(make_harness):
    h = make_harness(snapshot_every_batches=0)  # recovery off: the loss is reported (test_core_recovery.py)
    w0, w1 = h.register("a:1"), h.register("b:1")
    sid = h.open_session()
    h.open_mesh(sid, 1, [0, 1, 2, 3])  # w0: 0, 2; w1: 1, 3
    h.submit(sid, 1, [m.InstrCreate(tid=7, spec=spec([8]), init="rand")])
    for _ in range(6):
        h.advance(0.2)
        h.report(w0)
    assert h.core.workers[w1].state == "lost"
    rid, reply = h.sync(sid, 1)
    assert reply.done
    [error] = reply.errors
    assert error.op == "worker lost"
    assert "w1" in error.message and "[1, 3]" in error.message and "7" in error.message
    # later instructions on the lost devices are skipped with one error per batch, the rest still run
    h.take_sent()
    h.submit(sid, 2, [m.InstrCreate(tid=8, spec=spec([8]), init="rand"),
                      m.InstrCreate(tid=9, spec=spec([8]), init="rand")])
    assert [s.worker_id for s in h.take_sent()] == [w0]
    h.report(w0)
    rid, reply = h.sync(sid, 2)
    assert reply.done and len(reply.errors) == 1 and "w1" in reply.errors[0].message
    # deleting tensors that lived partly on the lost worker is quiet: the loss was reported already
    h.submit(sid, 3, [m.InstrDelete(tids=[7, 8, 9])])
    assert cmds_of(h.take_sent()) == [m.CmdDelete(tids=[7, 8, 9], devices=[0, 2])]
    h.report(w0)
    assert h.sync(sid, 3)[1].errors == []


def test_status_lists_workers_sessions_devices_and_events(h):
    w0 = h.register("a:1", labels={"zone": "z1"})
    w1 = h.register("b:1")
    sid = h.open_session("trainer")
    h.open_mesh(sid, 1, [0, 1, 2])
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([6]), init="ones")])
    h.report(w0, sessions={sid: m.ShardStats(tensors=2, bytes=16)})
    status = h.status()
    by_id = {w.worker: w for w in status.workers}
    assert by_id[w0].state == "alive" and by_id[w0].address == "a:1" and by_id[w0].labels == {"zone": "z1"}
    assert (by_id[w0].tensors, by_id[w0].bytes) == (2, 16)
    assert by_id[w0].devices == [f"{sid}:0", f"{sid}:2"] and by_id[w1].devices == [f"{sid}:1"]
    [session] = status.sessions
    assert (session.session, session.name, session.state, session.tensors) == (sid, "trainer", "open", 1)
    assert session.devices == {0: w0, 1: w1, 2: w0}
    assert any("registered" in line for line in status.events)
    assert all(line.split(" ", 1)[0].replace(".", "").isdigit() for line in status.events)  # time stamp first


def test_event_log_is_bounded(make_harness):
    h = make_harness(event_log_size=5)
    for i in range(20):
        h.register(f"a:{i}")
    events = h.status().events
    assert len(events) == 5 and "w19" in events[-1]


def test_old_lost_workers_are_forgotten(make_harness):
    h = make_harness()
    h.core = ControllerCore(Config(lost_workers_kept=2))
    for i in range(5):
        h.register(f"a:{i}")
    h.advance(2.0)
    assert sorted(h.core.workers) == ["w3", "w4"]


def test_config_rejects_nonsense():
    import pytest

    with pytest.raises(ValueError):
        Config(heartbeat_interval_s=0)
    with pytest.raises(ValueError):
        Config(heartbeat_interval_s=1.0, heartbeat_timeout_s=0.5)
