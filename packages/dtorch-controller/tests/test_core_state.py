"""The lifecycle tables of `core/state.py`, each row that no other test reaches on its own, through the core's
behaviour on a fake clock: a drained suspect worker, closing an open or a recovering session, a migrating session
that loses data, a loss while a rebuild replays, a drain whose copy fails."""

from __future__ import annotations

from _core_helpers import add_, create
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_protocol import messages as m


def setup(make_harness, workers=3, every=2, devices=(0, 1), **config):
    h = make_harness(snapshot_every_batches=every, **config)
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(workers)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, list(devices)).placed
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # a snapshot after batch 2 where snapshots are on
    return h, ids, sid, h.core.sessions[sid]


def test_a_suspect_worker_that_is_drained_drains_and_is_released(make_harness):
    """WORKER_TABLE: suspect --drain--> draining (not back to alive: it takes no new devices), then released."""
    h, ids, sid, s = setup(make_harness, every=1)
    victim = s.devices[1]
    h.advance(0.5)  # past suspect_after_s, before the timeout
    for w in ids:
        if w != victim:
            h.report(w)
    assert h.core.workers[victim].state == "suspect"
    rid, reply = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    assert reply is None and h.core.workers[victim].state == "draining"
    h.report(victim)  # a report does not make a draining worker alive again
    assert h.core.workers[victim].state == "draining"
    for _ in range(6):
        h.report_all()
    assert h.replies[rid].ok and victim not in s.devices.values()
    assert h.core.workers[victim].state == "lost" and not h.report(victim).ok  # released: fenced


def test_closing_an_open_session_closes_it(make_harness):
    """SESSION_TABLE: open --close--> closed."""
    h, ids, sid, s = setup(make_harness)
    assert s.state == "open"
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
    assert s.state == "closed" and sid not in h.core.sessions and h.status().sessions == []


def test_closing_a_recovering_session_closes_it_and_ends_its_rebuild(make_harness):
    """SESSION_TABLE: recovering --close--> closed; the rebuild stops (no command for the session goes out)."""
    h, ids, sid, s = setup(make_harness)
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    assert s.state == "recovering" and h.core.recovery.rebuilding(sid)
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
    assert s.state == "closed" and sid not in h.core.sessions and not h.core.recovery.rebuilding(sid)
    h.take_sent()
    for _ in range(3):
        h.report_all()
    assert not h.take_sent()


def test_a_migrating_session_that_loses_data_for_good_is_degraded(make_harness):
    """SESSION_TABLE: migrating --worker_lost--> degraded (no copies: the loss cannot be rebuilt); the move is
    called off and the next Sync names the lost tensor."""
    h, ids, sid, s = setup(make_harness, every=0)
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    rid, reply = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    assert reply is None and s.state == "migrating"
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))  # not the move's source: the move may go on
    assert s.state == "degraded"
    h.report_all()
    h.report_all()
    assert s.state == "degraded"  # the end of the move does not make it open again
    rid, reply = h.sync(sid, 2)
    assert reply.done and any("tensor 1" in e.message for e in reply.errors)
    assert src in h.core.workers


def test_a_loss_while_a_rebuild_replays_starts_it_over_and_it_ends_open(make_harness):
    """REBUILD_TABLE: replaying --loss--> placing (rule 7: every phase can be done again), not done."""
    h, ids, sid, s = setup(make_harness, workers=5, devices=(0, 1, 2))  # each device: copies on 2 workers
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))
    rebuild = h.core.recovery.rebuilds[sid]
    for _ in range(4):
        if rebuild.phase == st.RebuildPhase.REPLAYING:
            break
        h.report_all()
    assert rebuild.phase == st.RebuildPhase.REPLAYING
    holders = h.core.pipeline.recs[sid].snapshot.holders
    # a worker of the session whose loss leaves a copy of every device: the rebuild can start over
    victim = next(w for w in sorted(set(s.devices.values()))
                  if all(set(hs) - {w} for hs in holders.values()))
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    # started over: placed again at once (a free worker is left), then reset, which the reports finish
    assert rebuild.phase in (st.RebuildPhase.PLACING, st.RebuildPhase.RESETTING) and s.state == "recovering"
    for _ in range(6):
        h.report_all()
    assert s.state == "open" and not h.core.recovery.rebuilding(sid)
    assert victim not in s.devices.values() and all(h.core.workers[w].state == "alive" for w in s.devices.values())
    rid, reply = h.sync(sid, 2)
    h.report_all()
    assert h.replies[rid].done and not h.replies[rid].errors


def test_a_drain_whose_copy_fails_is_answered_failed_and_the_worker_keeps_its_device(make_harness):
    """MOVE_TABLE: copying --fail--> called off, which the drain waits for (drain.py reads the move's phase)."""
    h, ids, sid, s = setup(make_harness, every=0)
    victim = s.devices[1]
    h.take_sent()
    rid, reply = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    assert reply is None
    (e,) = [e for e in h.take_sent() if e.worker_id == victim]
    h.report(victim, errors={sid: [m.ErrorReport(op="copy shards", src="", message="refused", seq=e.execute.seq,
                                                 kind=m.ErrorKind.COPY)]})
    h.report_all()
    reply = h.replies[rid]
    assert not reply.ok and "the copy to" in reply.message and "refused" in reply.message
    assert s.devices[1] == victim and s.state == "open"


def test_a_failed_drain_puts_its_worker_back_into_service(make_harness):
    """WORKER_TABLE: draining --drain_failed--> alive. A drain that fails leaves the worker where it was, taking new
    devices again (a worker left draining would take none until it restarts), and the operator is told so."""
    h, ids, sid, s = setup(make_harness, workers=2, every=0)
    victim = s.devices[1]
    h.take_sent()
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    assert h.core.workers[victim].state == "draining"
    (e,) = [e for e in h.take_sent() if e.worker_id == victim]
    h.report(victim, errors={sid: [m.ErrorReport(op="copy shards", src="", message="refused", seq=e.execute.seq,
                                                 kind=m.ErrorKind.COPY)]})
    h.report_all()
    assert not h.replies[rid].ok and h.replies[rid].message.endswith(f"; {victim} takes new devices again")
    assert h.core.workers[victim].state == "alive"
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
    h.report_all()
    other = h.open_session("next")
    placed = h.open_mesh(other, 1, [0, 1])  # both workers: the drained one too
    assert placed.placed and h.core.workers[victim].address in placed.locations.values()
