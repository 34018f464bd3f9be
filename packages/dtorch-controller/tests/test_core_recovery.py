"""Recovery, snapshots, migration and drain in the core, on a fake clock (no processes)."""

from __future__ import annotations

import pytest

from _core_helpers import add_, cmds_of, create, own, spec
from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m


def setup(make_harness, workers=3, **config):
    h = make_harness(snapshot_every_batches=config.pop("every", 2), **config)
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(workers)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    return h, ids, sid


def session(h, sid):
    return h.core.sessions[sid]


def test_snapshots_copy_every_device_locally_and_to_another_worker_then_truncate_the_log(make_harness):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    assert not cmds_of(h.take_sent(), kind=m.CmdSendShards)
    h.submit(sid, 2, [add_(1)])  # two batches since the (empty) first snapshot: copy
    sends = cmds_of(h.take_sent(), kind=m.CmdSendShards)
    assert len(sends) == 4  # per device: a local copy and one in another worker's host memory
    for d in (0, 1):
        local, remote = [c for c in sends if d in c.devices]
        assert local.to == "" and remote.to and remote.host and local.devices[d] == [1]
        assert remote.to != h.core.workers[s.devices[d]].address
        assert local.namespace == remote.namespace == f"{sid}#s1"
    rec = h.core.pipeline.recs[sid]
    assert rec.taking is not None and len(rec.log) == 2
    h.report_all()
    assert rec.taking is None and rec.snapshot.upto == 2 and rec.log == []
    status = h.status().sessions[0]
    assert (status.snapshot_batch, status.replay_batches) == (2, 0)
    h.submit(sid, 3, [add_(1)])
    h.submit(sid, 4, [add_(1)])
    h.take_sent()
    h.report_all()  # the next snapshot replaces the first: its copies are dropped
    drops = [e for e in h.take_sent() if e.execute.session == f"{sid}#s1"]
    assert drops and all(e.execute.cmds == [m.CmdCloseSession()] for e in drops)


def test_uploads_are_copied_at_the_adopt(make_harness):
    h, ids, sid = setup(make_harness, every=100)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    sent = h.take_sent()
    for e in sent:
        kinds = [type(c).__name__ for c in own(e.execute)]
        assert kinds[:2] == ["CmdSendShards", "CmdSendShards"] and kinds[2] == "CmdRun"  # before the op writes it
    rec = h.core.pipeline.recs[sid]
    assert rec.adopts[5].pending
    h.report_all()
    assert rec.adopts[5].complete


def lose_and_recover(h, sid, victim, while_recovering=lambda: None):
    """The victim dies; the rest report until the session is open again. Returns what was sent meanwhile."""
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    s = session(h, sid)
    assert s.state == "recovering"
    while_recovering()
    sent = []
    for _ in range(4):
        sent += h.take_sent()
        h.report_all()
    sent += h.take_sent()
    assert s.state == "open"
    return sent


def test_a_lost_worker_is_rebuilt_from_the_snapshot_and_the_log(make_harness):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # snapshot after batch 2
    h.submit(sid, 3, [add_(1)])
    h.take_sent()
    victim = s.devices[1]
    survivor = s.devices[0]
    rid, reply = h.sync(sid, 3)
    assert reply is None
    sent = lose_and_recover(h, sid, victim)
    assert victim not in s.devices.values()
    abandons = cmds_of(sent, kind=m.CmdAbandon)
    assert abandons and all(c.tids == [1] and c.lost == ["10.0.0." + victim[1:] + ":7000"] for c in abandons)
    fetches = cmds_of(sent, kind=m.CmdFetchShards)
    holders = h.core.pipeline.recs[sid].snapshot.holders[1]  # device 1: from a surviving copy, local if it is there
    assert {(tuple(c.devices), c.address == "") for c in fetches} == {((0,), True), ((1,), s.devices[1] in holders)}
    assert all(c.namespace == f"{sid}#s1" and list(c.devices.values()) == [[1]] for c in fetches)
    replayed = [c for c in cmds_of(sent, kind=m.CmdRun)]
    assert [c.devices for c in replayed] == [[0], [1]] or sorted(d for c in replayed for d in c.devices) == [0, 1]
    assert cmds_of(sent, survivor, m.CmdRebuilt)
    reply = h.replies[rid]
    assert reply.done and not reply.errors
    assert reply.locations[1] == h.core.workers[s.devices[1]].address
    assert any("recovered in" in line for line in h.status().events)
    assert h.status().sessions[0].recoveries == 1


def test_batches_arriving_during_recovery_are_held_then_sent_on_the_new_binding(make_harness):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    victim = s.devices[1]
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    h.take_sent()
    h.submit(sid, 2, [add_(1)])  # accepted, held
    assert not cmds_of(h.take_sent(), kind=m.CmdRun)
    rid, reply = h.sync(sid, 2)
    assert reply is None
    sent = []
    for _ in range(4):
        h.report_all()
        sent += h.take_sent()
    runs = cmds_of(sent, kind=m.CmdRun)
    assert len(runs) == 2 and {w for e in sent for c in e.execute.cmds if isinstance(c, m.CmdRun)
                               for w in [e.worker_id]} == set(s.devices.values())
    h.report_all()
    assert h.replies[rid].done


def test_errors_of_abandoned_work_are_dropped_and_replayed_errors_not_repeated(make_harness):
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    rid, reply = h.sync(sid, 1)
    assert reply.done
    h.submit(sid, 2, [add_(1)])
    sent = h.take_sent()
    survivor, victim = s.devices[0], s.devices[1]
    seq = next(e.execute.seq for e in sent if e.worker_id == survivor)
    bug = m.ErrorReport(op="aten.add_.Scalar", src="train.py:9", message="boom", tid=1, seq=seq)
    h.report(survivor, errors={sid: [bug]})  # a real error of batch 2, not seen by the client yet
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    late = m.ErrorReport(op="redistribute", src="", message="cannot reach the lost worker", seq=seq)
    h.report(survivor, completed=h.core.workers[survivor].completed, errors={sid: [late]})
    for _ in range(4):
        sent = h.take_sent()
        for e in sent:  # batch 2 fails again on replay: reported once, not twice (with a late abandoned one)
            if any(isinstance(c, m.CmdRun) for c in e.execute.cmds) and e.worker_id == survivor:
                h.report(survivor, completed=e.execute.seq,
                         errors={sid: [late, m.ErrorReport(op="aten.add_.Scalar", src="train.py:9", message="boom",
                                                           tid=1, seq=e.execute.seq)]})
        h.report_all()
    rid, reply = h.sync(sid, 2)
    assert reply.done and [e.message for e in reply.errors] == ["boom"]


def test_errors_the_client_saw_before_the_loss_are_not_repeated_by_the_replay(make_harness):
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [create(1), add_(1)])
    sent = h.take_sent()
    survivor = s.devices[0]
    seq = next(e.execute.seq for e in sent if e.worker_id == survivor)
    h.report(survivor, errors={sid: [m.ErrorReport(op="aten.add_.Scalar", src="t.py:1", message="boom", seq=seq)]})
    h.report_all()
    rid, reply = h.sync(sid, 1)
    assert [e.message for e in reply.errors] == ["boom"]
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    for _ in range(4):
        for e in h.take_sent():
            if e.worker_id == s.devices[0] and any(isinstance(c, m.CmdRun) for c in e.execute.cmds):
                h.report(e.worker_id, completed=e.execute.seq, errors={sid: [m.ErrorReport(
                    op="aten.add_.Scalar", src="t.py:1", message="boom", seq=e.execute.seq)]})
        h.report_all()
    rid, reply = h.sync(sid, 1)
    assert reply.done and reply.errors == []


def test_unrecoverable_loss_names_the_lost_tensors_and_their_ops_and_others_carry_on(make_harness):
    h, ids, sid = setup(make_harness, workers=2, every=100)
    other = h.open_session("other")
    s = session(h, sid)
    h.submit(sid, 1, [create(1, src="model.py:7")])
    h.report_all()
    # the snapshot before batch 1 is empty and the log replays from scratch; lose the only other worker
    # holding nothing... make it unrecoverable: both workers of the session die
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    h.take_sent()
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))
    rid, reply = h.sync(sid, 1)
    assert reply.done and reply.errors
    text = " ".join(e.message for e in reply.errors)
    assert "tensor 1" in text and "create:rand at model.py:7" in text
    assert s.state == "degraded"
    assert other in h.core.sessions and h.core.sessions[other].state == "open"


def test_single_worker_sessions_report_the_loss(make_harness):
    h = make_harness(snapshot_every_batches=2)
    w = h.register("a:1")
    sid = h.open_session()
    h.open_mesh(sid, 1, [0])
    h.submit(sid, 1, [create(1)])
    h.handle(ev.WorkerUnreachable(w, "", "killed"))
    rid, reply = h.sync(sid, 1)
    assert reply.done and "tensor 1" in reply.errors[0].message and "no live worker" in reply.errors[0].message


def test_a_worker_holding_only_copies_triggers_a_new_snapshot(make_harness):
    h, ids, sid = setup(make_harness, every=2)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    rec = h.core.pipeline.recs[sid]
    holders = {w for hs in rec.snapshot.holders.values() for w in hs}
    spare = next(w for w in holders if w not in s.devices.values())
    h.take_sent()
    h.handle(ev.WorkerUnreachable(spare, "", "killed"))
    assert s.state == "open" and rec.taking is not None  # re-protected at once
    assert all(spare not in hs for hs in rec.taking.holders.values())


def test_a_failed_copy_is_not_a_snapshot_and_is_not_shown_to_the_client(make_harness):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    sent = h.take_sent()
    rec = h.core.pipeline.recs[sid]
    w = s.devices[0]
    seq = rec.taking.pending[w]
    err = m.ErrorReport(op="copy shards to 10.0.0.9:1 (x#s1)", src="", message="unreachable", seq=seq,
                        kind=m.ErrorKind.COPY)
    h.report(w, errors={sid: [err]})
    assert rec.taking is not None and rec.taking.namespace == f"{sid}#s2"  # dropped and taken again
    assert any(e.execute.session == f"{sid}#s1" for e in h.take_sent())
    assert rec.snapshot.upto == 0
    h.report_all()
    assert rec.snapshot.namespace == f"{sid}#s2" and rec.snapshot.upto == 2
    rid, reply = h.sync(sid, 2)
    assert reply.done and reply.errors == []
    assert sent


# ---------------------------------------------------------------- migration and drain


def test_migrate_moves_one_device_holds_batches_and_reports_the_downtime(make_harness):
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.take_sent()
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    rid, reply = h.ask(ev.Migrate, m.MigrateRequest(session=sid[:6], device=1, to_worker=dst))
    assert reply is None and s.state == "migrating"
    (copy,) = cmds_of(h.take_sent(), src, m.CmdSendShards)
    assert copy.move == [1] and copy.devices == {1: [1]} and copy.to == h.core.workers[dst].address
    h.submit(sid, 2, [add_(1)])  # held
    assert not h.take_sent()
    h.advance(0.25)
    h.report_all()
    reply = h.replies[rid]
    assert reply.ok and reply.moves[0].downtime_s >= 0.25 and reply.moves[0].bytes == 16
    assert s.devices[1] == dst and s.state == "open"
    sent = h.take_sent()
    assert cmds_of(sent, src, m.CmdDelete) == [m.CmdDelete(tids=[1], devices=[1])]
    assert [c.devices for c in cmds_of(sent, dst, m.CmdRun)] == [[1]]
    assert any("moved" in line and "downtime" in line for line in h.status().events)
    assert h.status().sessions[0].migrations == 1


def test_the_scheduler_sees_a_session_moving_while_its_moves_are_in_flight(make_harness):
    """Scheduler.moving is the moves feature's answer (preemption, relocation and shrink leave such a session be)."""
    h, ids, sid = setup(make_harness, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    assert not h.core.sched.moving(sid)
    dst = next(w for w in ids if w not in s.devices.values())
    h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    assert h.core.sched.moving(sid)
    h.report_all()
    h.report_all()  # the copy, then the source's delete of the old shards
    assert s.devices[1] == dst and not h.core.sched.moving(sid)


def test_a_sync_does_not_wait_for_the_cleanup_on_a_worker_the_session_left(make_harness):
    """After a move, the source still runs the session's delete of the moved shards; a Sync does not wait for it
    (that delete may queue behind another session's work there, while the session's devices sit idle)."""
    h, ids, sid = setup(make_harness, every=0)  # no snapshots: nothing else to wait for
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    h.report_all()  # the copy is done: the device is on dst, src got the delete of the old shards
    assert s.devices[1] == dst and src not in s.devices.values()
    assert cmds_of(h.take_sent(), src, m.CmdDelete)
    rid, reply = h.sync(sid, 1)
    assert reply is not None and reply.done  # answered although src has not run the delete yet


def test_migrate_refuses_unknown_ids_in_one_line(make_harness, refused):
    h, ids, sid = setup(make_harness)
    for msg, text in [(m.MigrateRequest(session="nope", device=0, to_worker=ids[0]), "unknown session"),
                      (m.MigrateRequest(session=sid, device=9, to_worker=ids[0]), "no logical device 9"),
                      (m.MigrateRequest(session=sid, device=0, to_worker="w99"), "unknown worker 'w99'")]:
        reply = h.call(ev.Migrate, msg)
        assert refused(reply) and text in reply.message and "\n" not in reply.message


def test_a_failed_move_is_called_off_and_the_source_keeps_the_device(make_harness):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.take_sent()
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    (e,) = [e for e in h.take_sent() if e.worker_id == src]
    h.report(src, errors={sid: [m.ErrorReport(op="copy shards to x (s)", src="", message="refused",
                                              seq=e.execute.seq, kind=m.ErrorKind.COPY)]})
    assert not h.replies[rid].ok and "refused" in h.replies[rid].message
    assert s.devices[1] == src and s.state == "open"
    sent = h.take_sent()
    assert cmds_of(sent, src, m.CmdStay) == [m.CmdStay(devices=[1])]
    assert cmds_of(sent, dst, m.CmdDelete) == [m.CmdDelete(tids=[1], devices=[1])]  # what reached the target


def test_drain_moves_devices_and_copies_then_releases_the_worker(make_harness):
    h, ids, sid = setup(make_harness, every=1)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    victim = s.devices[1]
    rid, reply = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    assert reply is None and h.core.workers[victim].state == "draining"
    for _ in range(6):
        h.report_all()
    reply = h.replies[rid]
    assert reply.ok and reply.moves and reply.moves[0].from_worker == victim
    assert victim not in s.devices.values() and h.core.workers[victim].state == "lost"
    rec = h.core.pipeline.recs[sid]
    assert all(victim not in hs for hs in rec.snapshot.holders.values())
    assert h.report(victim).ok is False  # released: fenced, it exits
    assert any("released after draining" in line for line in h.status().events)


def test_a_batch_waiting_in_the_dispatch_window_for_a_drained_worker_goes_out_when_it_is_released(make_harness):
    # pipeline rule 7 with a drain: s's move off the victim is done, but the delete after it is not when s sends
    # batch 2, which waits for a completion there. The victim is released (once c's copies in its host memory are
    # taken elsewhere) without ever completing it: the release must let batch 2 go, as a loss does
    h = make_harness(snapshot_every_batches=1, dispatch_ahead=1)
    for i in range(2):
        h.register(f"10.0.0.{i}:7000")
    sid, cid = h.open_session(), h.open_session()
    assert h.open_mesh(sid, 1, [0]).placed and h.open_mesh(cid, 1, [0]).placed
    h.submit(sid, 1, [create(1)])
    h.submit(cid, 1, [create(1)])
    for _ in range(3):
        h.report_all()
    s = session(h, sid)
    victim = s.devices[0]
    h.register("10.0.0.9:7000")
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    h.report(victim)  # the move's push is done; the delete of what it left goes out and is never completed
    h.take_sent()
    h.submit(sid, 2, [add_(1)])
    assert not h.take_sent()  # it waits for the victim's completion
    for _ in range(2):
        for wid, w in list(h.core.workers.items()):
            if w.state != "lost" and wid != victim:
                h.report(wid)
    assert h.replies[rid].ok and h.core.workers[victim].state == "lost"
    assert any(m.CmdRun in map(type, x.execute.cmds) for x in h.take_sent() if x.worker_id == s.devices[0])


def test_drain_of_an_unknown_worker_is_refused(make_harness, refused):
    h, ids, sid = setup(make_harness)
    reply = h.call(ev.Drain, m.DrainRequest(worker="w42"))
    assert refused(reply) and "unknown worker 'w42'" in reply.message


def test_a_loss_while_a_snapshot_is_taken_rebuilds_from_the_previous_one(make_harness):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # snapshot 1 after batch 2
    h.submit(sid, 3, [add_(1)])
    h.submit(sid, 4, [add_(1)])  # snapshot 2 starts: not complete when the worker dies
    rec = h.core.pipeline.recs[sid]
    assert rec.taking is not None and rec.snapshot.upto == 2
    h.take_sent()
    sent = lose_and_recover(h, sid, s.devices[1])
    fetches = cmds_of(sent, kind=m.CmdFetchShards)
    assert fetches and all(c.namespace == f"{sid}#s1" for c in fetches)
    assert len(cmds_of(sent, kind=m.CmdRun)) == 4  # batches 3 and 4 replayed on both devices
    assert rec.recoveries == 1


def test_losing_the_source_of_a_move_mid_copy_rebuilds_the_session_and_fails_the_move(make_harness):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    h.take_sent()
    h.submit(sid, 2, [add_(1)])  # held by the move
    lose_and_recover(h, sid, src)
    assert not h.replies[rid].ok and "lost" in h.replies[rid].message
    assert src not in s.devices.values()
    rid, reply = h.sync(sid, 2)
    h.report_all()
    assert h.replies[rid].done and not h.replies[rid].errors


def test_a_worker_a_move_emptied_can_be_lost_and_forgotten_and_syncs_still_answer(make_harness):
    h, ids, sid = setup(make_harness, lost_workers_kept=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    for _ in range(3):
        h.report_all()
    assert h.replies[rid].ok and src in s.sent  # the source got the copy and the drop of its shards
    h.handle(ev.WorkerUnreachable(src, "", "killed"))  # it hosts nothing of the session: forgotten at once
    assert src not in h.core.workers and s.state == "open"
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    rid, reply = h.sync(sid, 2)
    assert reply.done and not reply.errors


def test_a_degraded_session_that_loses_another_worker_stays_degraded_and_says_so(make_harness):
    """SESSION_TABLE: degraded --worker_lost--> degraded (data already lost is not recovered, and nothing raises)."""
    h = make_harness(snapshot_every_batches=0)  # no copies: a loss cannot be rebuilt
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(3)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1, 2]).placed
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))
    assert s.state == "degraded"
    h.handle(ev.WorkerUnreachable(s.devices[2], "", "killed"))
    assert s.state == "degraded" and h.core.workers[ids[2]].state == "lost"
    rid, reply = h.sync(sid, 1)
    assert reply.done and reply.errors and "tensor 1" in " ".join(e.message for e in reply.errors)


def test_closing_a_session_while_its_device_moves_closes_it(make_harness):
    """SESSION_TABLE: migrating --close--> closed; the move's request is answered and the workers drop it."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.take_sent()
    dst = next(w for w in ids if w not in s.devices.values())
    rid, reply = h.ask(ev.Migrate, m.MigrateRequest(session=sid[:6], device=1, to_worker=dst))
    assert reply is None and s.state == "migrating"
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
    assert s.state == "closed" and sid not in h.core.sessions
    assert h.replies[rid].ok is False and h.replies[rid].message == "move failed: the session closed"
    h.report_all()
    assert h.status().sessions == []


def test_a_rebuild_is_noticed_with_its_duration_and_the_batches_it_replayed(make_harness):
    """fx.Recovered: the seconds from the loss to the session being open again, and the logged batches run again."""
    from dtorch_controller.core import effects as fx

    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # snapshot after batch 2
    h.submit(sid, 3, [add_(1)])
    h.report_all()
    lost_at = h.now
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    while s.state != "open":  # each round of reports takes the rebuild one phase further
        assert h.now - lost_at < 5
        h.advance(0.5)
        h.report_all()
    assert [n for n in h.notices if isinstance(n, fx.Recovered)] == [fx.Recovered(sid, h.now - lost_at, 1)]


def test_a_drain_past_its_timeout_is_answered_in_progress_once_and_goes_on(make_harness):
    """drain.py rule 4: exactly one reply per Drain request; at its timeout it says the drain goes on."""
    from dtorch_controller.core import effects as fx

    h, ids, sid = setup(make_harness, every=1, heartbeat_interval_s=10.0, heartbeat_timeout_s=60.0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    victim = s.devices[1]
    rid, reply = h.ask(ev.Drain, m.DrainRequest(worker=victim, timeout_s=2.0))
    assert reply is None
    h.advance(2.0)  # nobody reported: the move's copy is not done
    reply = h.replies[rid]
    assert reply.ok is False and reply.seconds == 2.0
    assert reply.message == f"still in progress (draining {victim}: moving); it goes on"
    for _ in range(6):
        h.report_all()  # the drain finishes; its request is not answered again (the harness checks)
    assert h.core.workers[victim].state == "lost" and victim not in s.devices.values()
    assert [n for n in h.notices if isinstance(n, fx.Drained)] == [fx.Drained(victim, 1)]


def test_migrate_to_a_worker_that_cannot_take_devices_or_already_has_it_says_so(make_harness, refused):
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    free = next(w for w in ids if w not in s.devices.values())
    h.handle(ev.Drain(99, m.DrainRequest(worker=free)))  # nothing to move: released at once
    reply = h.call(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=free))
    assert refused(reply) and reply.message == f"worker {free} is lost: it cannot take devices"
    reply = h.call(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=s.devices[0]))
    assert reply.ok and reply.message == f"logical device 0 of session {sid} is already on {s.devices[0]}"


def test_log_lines_name_a_session_by_its_first_eight_characters(make_harness):
    """Event-log lines and messages name a session by an 8-character prefix (what `--session` accepts)."""
    h = make_harness(snapshot_every_batches=2, session_ids=iter(["0123456789abcdef", "fedcba9876543210"]).__next__)
    for i in range(4):
        h.register(f"10.0.0.{i}:7000")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1, 2]).placed
    s = session(h, sid)
    h.submit(sid, 1, [create(1, shape=(9,))])
    h.submit(sid, 2, [create(2, shape=(9,))])
    h.report_all()
    victim = s.devices[1]
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    for _ in range(6):
        h.report_all()
    assert h.replies[rid].ok
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))
    for _ in range(4):
        h.report_all()
    events = [line.partition(" ")[2] for line in h.status().events]
    assert f"worker {victim} draining: 1 logical devices of 1 sessions to move" in events
    mentions = [line for line in events if "01234567" in line]
    assert len(mentions) >= 3 and not any("012345678" in line for line in mentions)
    assert any(line.startswith("session 01234567 logical device 1 moved") for line in mentions)
    assert any(line.startswith("session 01234567 recovered in") for line in mentions)


def test_an_unrecoverable_loss_is_noticed_with_why(make_harness):
    from dtorch_controller.core import effects as fx

    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # a snapshot: the loss of one worker is rebuilt ...
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))  # ... until the copies' holders go too
    for _ in range(3):
        h.report_all()
    (lost,) = [n for n in h.notices if isinstance(n, fx.DataLost)]
    assert lost.session == sid and lost.why.startswith("every copy of logical device")


def test_a_drain_forces_a_snapshot_that_takes_the_copies_off_the_worker(make_harness):
    """drain.py rule 2: copies on the drained worker are made again elsewhere before it is released, even when the
    next snapshot is far away."""
    h, ids, sid = setup(make_harness, every=2, snapshot_every_s=1e6)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    rec = h.core.pipeline.recs[sid]
    holder = next(w for w in ids if w not in s.devices.values())  # holds only copies (host memory)
    assert any(holder in hs for hs in rec.snapshot.holders.values())
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=holder))
    for _ in range(4):
        h.report_all()
    assert h.replies[rid].ok and h.core.workers[holder].state == "lost"
    assert rec.snapshot.upto == 2 and all(holder not in hs for hs in rec.snapshot.holders.values())


def test_an_upload_in_the_replayed_log_is_restored_from_a_surviving_copy_before_its_ops_run(make_harness):
    """recovery.py rule 1: uploads are restored from their copies at the adopt's point of the replay (lineage rule 3:
    each device's shard is copied on its worker and to another worker's host memory)."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    copies = cmds_of(h.take_sent(), kind=m.CmdSendShards)
    assert sorted((tuple(c.devices.items()), c.to == "") for c in copies) == [
        (((0, [5]),), False), (((0, [5]),), True), (((1, [5]),), False), (((1, [5]),), True)]
    h.report_all()
    upload = h.core.pipeline.recs[sid].adopts[5]
    assert upload.complete and upload.namespace == f"{sid}#a0"  # lineage rule 4
    assert {c.namespace for c in copies} == {upload.namespace}
    victim = s.devices[1]
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    sent = []
    while s.state != "open":
        sent += h.take_sent()
        h.report_all()
    alive = {w for w in ids if w != victim}
    for d in (0, 1):
        worker = s.devices[d]
        cmds = cmds_of(sent, worker)
        (fetch,) = [c for c in cmds if isinstance(c, m.CmdFetchShards) and c.namespace == upload.namespace]
        holders = [w for w in upload.holders[d] if w in alive]
        assert fetch.devices == {d: [5]} and holders
        assert fetch.address == ("" if worker in holders else h.core.workers[holders[0]].address)
        (run,) = [i for i, c in enumerate(cmds) if isinstance(c, m.CmdRun)]
        assert cmds.index(fetch) < run  # restored before the logged op that reads it runs again


def test_an_op_error_reported_with_a_failed_copy_still_reaches_the_client(make_harness):
    """A failed copy (kind COPY) is internal; an op error in the same report is the client's (rule 1)."""
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.take_sent()
    w = s.devices[0]
    seq = h.core.pipeline.recs[sid].taking.pending[w]
    copy = m.ErrorReport(op="copy shards", src="", message="unreachable", seq=seq, kind=m.ErrorKind.COPY)
    bug = m.ErrorReport(op="aten.add_.Scalar", src="train.py:9", message="boom", tid=1, seq=seq - 1)
    h.report(w, errors={sid: [copy, bug]})
    h.report_all()
    rid, reply = h.sync(sid, 2)
    assert reply.done and [(e.op, e.message) for e in reply.errors] == [("aten.add_.Scalar", "boom")]


def test_a_moved_devices_old_shards_are_dropped_only_after_the_reads_planned_before_the_move(make_harness):
    """moves.py rule 1: the source drops its shards when the readers planned before the move are done."""
    h, ids, sid = setup(make_harness, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    src, reader = s.devices[0], s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=2, src_spec=spec([8]), dst_spec=spec([8], placements=("R",)))])
    h.take_sent()  # the reader's batch reads the source's shard of tensor 1 remotely
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=dst))
    h.report(src)
    h.report(dst)
    assert h.replies[rid].ok and s.devices[0] == dst
    assert not cmds_of(h.take_sent(), src, m.CmdDelete)  # the reader has not read it yet
    h.report(reader)
    (drop,) = cmds_of(h.take_sent(), src, m.CmdDelete)
    assert drop.devices == [0] and 1 in drop.tids


def test_a_sessions_moves_go_one_at_a_time_in_order(make_harness):
    """moves.py rule 3: one move per session at a time; a later one queues and starts when the first is over."""
    h, ids, sid = setup(make_harness, workers=4, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.take_sent()
    free = [w for w in ids if w not in s.devices.values()]
    first, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=free[0]))
    second, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=free[1]))
    copies = cmds_of(h.take_sent(), kind=m.CmdSendShards)
    assert [c.move for c in copies] == [[0]]  # only the first copies
    h.report(s.devices[0])  # the first's copy is done
    assert h.replies[first].ok and second not in h.replies
    copies = cmds_of(h.take_sent(), kind=m.CmdSendShards)
    assert [(c.move, c.to) for c in copies] == [([1], h.core.workers[free[1]].address)]
    h.report_all()
    assert h.replies[second].ok and s.devices == {0: free[0], 1: free[1]}


_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
           "complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"]


@pytest.mark.parametrize("dtype", _DTYPES)
def test_a_moves_report_counts_the_bytes_torch_would_hold_for_the_shard(make_harness, dtype):
    """lineage.shard_bytes: a move reports its shards' bytes, numel times the dtype's size as torch has it (the
    controller itself never imports torch)."""
    torch = pytest.importorskip("torch")
    h, ids, sid = setup(make_harness, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8], dtype=dtype), init="zeros")])
    h.report_all()
    dst = next(w for w in ids if w not in s.devices.values())
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    h.report_all()
    [move] = h.replies[rid].moves
    assert move.bytes == 4 * getattr(torch, dtype).itemsize  # device 1 holds 4 of the 8 elements


def test_a_migrate_past_its_timeout_is_answered_in_progress_once_and_the_move_goes_on(make_harness):
    """moves.py rule 6: exactly one reply per Migrate; at its timeout it says the copy goes on, which then ends."""
    h, ids, sid = setup(make_harness, every=0, heartbeat_interval_s=10.0, heartbeat_timeout_s=60.0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    dst = next(w for w in ids if w not in s.devices.values())
    rid, reply = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst, timeout_s=2.0))
    assert reply is None
    h.advance(2.0)  # nobody reported: the copy is not done
    reply = h.replies[rid]
    assert not reply.ok and reply.seconds == 2.0
    assert reply.message == f"still in progress (moving logical device [1] of session {sid[:8]} to {dst}: copying); " \
                            "it goes on"
    h.report_all()  # the move ends; its request is not answered again (the harness checks)
    assert s.devices[1] == dst and s.state == "open"


@pytest.mark.parametrize("n, more", [(6, ""), (7, " and 1 more")])
def test_a_reported_loss_names_six_tensors_and_counts_the_rest(make_harness, n, more):
    """Recovery.lost_detail: the first six lost tensors by name, then "and N more" (none at exactly six)."""
    h, ids, sid = setup(make_harness, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(tid) for tid in range(1, n + 1)])
    h.report_all()
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    rid, reply = h.sync(sid, 1)
    [error] = reply.errors
    named = ", ".join(f"tensor {tid} (made by create:rand at train.py:3)" for tid in range(1, 7))
    assert f"{n} tensors lost: {named}{more}; not rebuilt: " in error.message


def test_a_queued_migrate_of_a_device_that_moved_meanwhile_fails_naming_it(make_harness):
    """moves.py rule 3: a session's moves go one at a time; a later Migrate of the device an earlier one moved
    finds it gone from its source and fails in one line (the device stays where the first move put it)."""
    h, ids, sid = setup(make_harness, workers=4, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    src = s.devices[1]
    first, second = [w for w in ids if w not in s.devices.values()]
    rid1, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=first))
    rid2, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=second))
    h.report_all()
    h.report_all()
    assert h.replies[rid1].ok and s.devices[1] == first
    assert not h.replies[rid2].ok
    assert h.replies[rid2].message == f"move failed: logical device 1 is no longer on {src}"


def test_a_rebuild_that_interrupts_a_copy_resets_the_copys_target_too(make_harness):
    """moves.abort: the target of a copy under way may hold shards of the session without hosting a device; the
    rebuild's reset (CmdAbandon) reaches it as well, so no stale shard stays there."""
    h, ids, sid = setup(make_harness, workers=5)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # snapshot after batch 2
    dst = [w for w in ids if w not in s.devices.values()][-1]  # the rebuild places the lost device on another
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    h.take_sent()
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))  # not the copy's source or target
    sent = []
    for _ in range(4):
        sent += h.take_sent()
        h.report_all()
    assert not h.replies[rid].ok and s.state == "open" and dst not in s.devices.values()
    assert cmds_of(sent, dst, m.CmdAbandon)


def test_migrates_asked_for_during_a_rebuild_go_one_at_a_time_once_it_is_open(make_harness):
    """moves.py rule 3: no move starts while the session is recovering; once it is open, its queued moves go one
    at a time in order (the second copies only when the first is over)."""
    h, ids, sid = setup(make_harness, workers=5)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # snapshot after batch 2
    h.take_sent()
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    assert s.state == "recovering" and set(s.devices) == {0, 1}
    free = [w for w in ids if w not in s.devices.values() and h.core.workers[w].state != "lost"]
    first, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=free[0]))
    second, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=free[1]))
    moving = []
    while s.state == "recovering":
        moving += [c.move for c in cmds_of(h.take_sent(), kind=m.CmdSendShards) if c.move]
        h.report_all()
    moving += [c.move for c in cmds_of(h.take_sent(), kind=m.CmdSendShards) if c.move]
    assert moving == [[0]] and first not in h.replies and second not in h.replies  # only the first copies
    h.report(h.core.sessions[sid].devices[0])
    assert h.replies[first].ok and second not in h.replies
    assert [c.move for c in cmds_of(h.take_sent(), kind=m.CmdSendShards) if c.move] == [[1]]
    h.report_all()
    assert h.replies[second].ok and s.devices == {0: free[0], 1: free[1]}


def test_a_migrate_writes_one_line_to_the_event_log_when_it_is_done(make_harness):
    """The event log tells the operator what moved, once, with its size and downtime (moves.py rule 1); a Migrate
    or a drain's move is not announced when it is queued (relocations and growth say so: they are not asked for)."""
    h, ids, sid = setup(make_harness, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    before = len(h.status().events)
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    h.report_all()
    assert h.replies[rid].ok
    events = [line.partition(" ")[2] for line in h.status().events[before:]]
    assert events == [f"session {sid[:8]} logical device 1 moved {src} -> {dst}: 1 shards, 16 bytes, downtime "
                      "0.000s"]


def test_a_rebuild_replays_a_logged_program_replay_as_the_instructions_it_stands_for(make_harness):
    """pipeline.py rule 4: a rebuild translates the instructions a logged replay stands for, for the new binding
    (the reset workers get plain commands: no CmdProgram, no CmdReplay); the next replay after it is compiled
    again for that binding."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    step = [m.InstrCreate(tid=1, spec=spec([8]), init="randn", seed=0, src="s.py:1"),
            m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 1}], kwargs={},
                        outs=[m.OutSpec(2, spec([8]))], src="s.py:2")]
    h.submit(sid, 1, [create(10), m.InstrDefine(program=7, instrs=step, ntids=3, nseeds=1),
                      m.InstrReplay(program=7, tids=[10, 11, 12], seeds=[5])])
    assert cmds_of(h.take_sent(), kind=m.CmdProgram)
    h.report_all()
    victim = s.devices[1]
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    sent = []
    while s.state != "open":
        sent += h.take_sent()
        h.report_all()
    sent += h.take_sent()
    assert not cmds_of(sent, kind=m.CmdProgram) and not cmds_of(sent, kind=m.CmdReplay)
    creates = [c for c in cmds_of(sent, kind=m.CmdCreate) if c.tid == 11]
    assert sorted(d for c in creates for d in c.boxes) == [0, 1] and all(c.seed == 5 for c in creates)
    runs = [c for c in cmds_of(sent, kind=m.CmdRun) if c.outs == [12]]
    assert sorted(d for c in runs for d in c.devices) == [0, 1]
    h.submit(sid, 2, [m.InstrReplay(program=7, tids=[10, 21, 22], seeds=[6])])
    sent = h.take_sent()
    assert {e.worker_id for e in sent if any(type(c) is m.CmdProgram for c in e.execute.cmds)} == \
        set(s.devices.values())


def test_a_loss_names_the_op_that_made_a_tensor_a_compiled_program_deleted_and_made_again(make_harness):
    """lineage.py: a tensor's origin is the op that made it last after a delete (a program's net origins: a delete
    then a new maker), also when a replay is only filled in from its compiled program."""
    h, ids, sid = setup(make_harness, every=0)
    s = session(h, sid)
    step = [m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 0}], kwargs={},
                        outs=[m.OutSpec(1, spec([8]))], src="s.py:1"),
            m.InstrDelete(tids=[1]),
            m.InstrCall(op="aten.mul.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 0}], kwargs={},
                        outs=[m.OutSpec(1, spec([8]))], src="s.py:3")]
    h.submit(sid, 1, [create(10), m.InstrDefine(program=7, instrs=step, ntids=2)])
    for seq, tid in ((2, 11), (3, 12)):  # the second replay is only filled in
        h.submit(sid, seq, [m.InstrReplay(program=7, tids=[10, tid])])
    assert [type(c) for c in cmds_of(h.take_sent()[-2:])] == [m.CmdReplay, m.CmdReplay]
    h.report_all()
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    rid, reply = h.sync(sid, 3)
    [error] = reply.errors
    assert "tensor 12 (made by aten.mul.Tensor at s.py:3)" in error.message
    assert "tensor 11 (made by aten.mul.Tensor at s.py:3)" in error.message


def test_a_drain_whose_worker_is_lost_fails_and_says_so(make_harness):
    """drain.py rule 3: a drain fails when its worker is lost meanwhile; its request is answered with why."""
    h, ids, sid = setup(make_harness, every=1)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    victim = s.devices[1]
    rid, reply = h.ask(ev.Drain, m.DrainRequest(worker=victim))
    assert reply is None
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    reply = h.replies[rid]
    assert reply.ok is False and reply.message == f"drain of {victim} failed: worker {victim} was lost while draining"
    assert h.core.drains.jobs == {}


def test_a_failed_snapshot_copy_on_a_moves_source_does_not_call_the_move_off(make_harness):
    """moves.py rule 4: only the move's own copy failing calls it off; another copy of the session failing on
    the same worker (a snapshot's, at another Execute) does not."""
    h, ids, sid = setup(make_harness, every=1)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    sent = h.take_sent()
    src = s.devices[1]
    snap_seq = h.core.pipeline.recs[sid].taking.pending[src]  # the snapshot's copy on src
    dst = next(w for w in ids if w not in s.devices.values())
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    (move,) = [e.execute.seq for e in h.take_sent() if e.worker_id == src]
    assert sent and move > snap_seq
    failed = m.ErrorReport(op="copy shards", src="", message="unreachable", seq=snap_seq, kind=m.ErrorKind.COPY)
    h.report(src, completed=snap_seq, errors={sid: [failed]})
    for _ in range(3):
        h.report_all()
    assert h.replies[rid].ok and s.devices[1] == dst


def test_a_queued_migrate_to_a_worker_no_rebuild_touched_goes_on_after_the_rebuild(make_harness):
    """moves.py rule 4: a rebuild stops the running move; a queued one to a live worker stays queued and runs
    once the session is open again."""
    h = make_harness(snapshot_every_batches=2)
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(6)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1, 2]).placed
    s = session(h, sid)
    h.submit(sid, 1, [create(1, shape=(9,))])
    h.submit(sid, 2, [create(2, shape=(9,))])
    h.report_all()
    h.take_sent()
    free = [w for w in ids if w not in s.devices.values()]
    first, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=free[0]))
    second, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=free[1]))
    h.handle(ev.WorkerUnreachable(s.devices[2], "", "killed"))  # neither move's source nor target
    assert h.replies[first].ok is False and second not in h.replies
    for _ in range(6):
        h.report_all()
    assert s.state == "open" and h.replies[second].ok and s.devices[1] == free[1]


def test_a_queued_migrate_whose_target_went_away_fails_naming_it(make_harness):
    """moves.py rules 3 and 4: a queued Migrate whose target can no longer take devices when its turn comes
    fails in one line (the device stays)."""
    h, ids, sid = setup(make_harness, workers=4, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    free = [w for w in ids if w not in s.devices.values()]
    src = s.devices[1]
    first, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=free[0]))
    second, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=free[1]))
    assert h.call(ev.Drain, m.DrainRequest(worker=free[1])).ok  # it hosts nothing: released at once
    for _ in range(3):
        h.report_all()
    assert h.replies[first].ok
    assert h.replies[second].ok is False
    assert h.replies[second].message == f"move failed: worker {free[1]} can no longer take devices"
    assert s.devices[1] == src


def _rebuild(h, s, rounds=4):
    sent = []
    for _ in range(rounds):
        h.report_all()
        sent += h.take_sent()
    return sent


@pytest.mark.parametrize("parked", [True, False], ids=["parked-sync", "next-sync"])
def test_an_upload_whose_copy_its_worker_did_not_finish_is_asked_of_the_client_again(make_harness, parked):
    """lineage.py rule 3, recovery.py rule 7: an upload's copies count once the adopt's batch completed on its
    worker; a worker lost before that leaves no copy of its shards. The client still keeps the upload: once the
    replay went out, the session's parked Sync (else its next one) is answered not done, naming the upload and
    the device to Put again, once; then the Sync is answered done as usual."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    h.take_sent()
    victim = s.devices[1]
    h.report(s.devices[0])  # device 0's copies are done; device 1's worker never finishes its batch
    rid = h.sync(sid, 1)[0] if parked else None
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    assert s.state == "recovering"
    _rebuild(h, s)
    if not parked:
        rid, reply = h.sync(sid, 1)
    reply = h.replies[rid]
    assert not reply.done and reply.reput == {5: [1]} and reply.locations[1] != h.core.workers[victim].address
    assert any("asks its client for 1 uploads" in line for line in h.status().events)
    h.report_all()
    assert s.state == "open" and victim not in s.devices.values()
    _, again = h.sync(sid, 1)
    assert again.done and again.reput == {} and again.errors == []


@pytest.mark.parametrize("request_", ["Submit", "KeepAlive"])
def test_a_client_without_a_sync_hears_of_the_uploads_to_put_again_in_its_next_submits_or_keepalives_answer(
        make_harness, request_):
    """recovery.py rule 7: a program may stream for long between sync points, or say nothing; the first request of
    the session after the replay went out, a Submit or a KeepAlive, answers the uploads to Put again, once."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    h.take_sent()
    victim = s.devices[1]
    h.report(s.devices[0])
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    _rebuild(h, s)
    if request_ == "KeepAlive":
        assert h.call(ev.KeepAlive, m.KeepAlive(session=sid)) == m.KeepAliveReply(reput={5: [1]})
        assert h.call(ev.KeepAlive, m.KeepAlive(session=sid)) == m.KeepAliveReply()
    assert h.submit(sid, 2, [add_(5)]).reput == ({5: [1]} if request_ == "Submit" else {})
    assert h.submit(sid, 3, [add_(5)]).reput == {}
    _rebuild(h, s)
    _, reply = h.sync(sid, 3)
    assert reply.done and reply.reput == {}


@pytest.mark.parametrize("request_", ["Submit", "KeepAlive"])
def test_an_upload_whose_copies_are_complete_is_told_safe_to_the_client_in_its_next_submits_or_keepalives_answer(
        make_harness, request_):
    """snapshots.py rule 7: once both copies of an upload are made (its batch completed on every worker of its mesh),
    the client need not keep it: the next Submit's or KeepAlive's answer says so, once. Not before: a batch that only
    one of the two workers completed leaves the other's copies in the making."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    h.take_sent()
    h.report(s.devices[0])
    assert h.submit(sid, 2, [add_(5)]).safe == []
    h.report_all()

    def told():
        if request_ == "Submit":
            return h.submit(sid, s.seq + 1, [add_(5)]).safe
        return h.call(ev.KeepAlive, m.KeepAlive(session=sid)).safe

    assert told() == [5]
    assert told() == []


def test_an_upload_arriving_after_the_rebuild_is_asked_again_on_the_rebound_devices_until_a_sync_tells_where(
        make_harness):
    """recovery.py rule 7, pipeline.py rule 3: the loss was found and the session rebuilt before the client's batch
    with an upload arrived (the client Put it to the lost worker): its Submit's answer asks for the rebound device;
    once a Sync answered done told the client the new locations, an upload is not asked for again."""
    h, ids, sid = setup(make_harness, every=1)
    s = session(h, sid)
    h.submit(sid, 1, [create(1, [8])])
    _rebuild(h, s, rounds=2)
    victim = s.devices[1]
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    _rebuild(h, s)
    assert s.state == "open" and victim not in s.devices.values()
    assert h.submit(sid, 2, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)]).reput == {5: [1]}
    _rebuild(h, s)
    _, reply = h.sync(sid, 2)
    assert reply.done and reply.reput == {}
    assert h.submit(sid, 3, [m.InstrAdopt(tid=6, spec=spec([8]))]).reput == {}


def _kept_after_a_loss(make_harness):
    """A session whose upload 5 went out on a device a loss rebound: asked for again, not safe when its copies are
    complete, and kept past the done Sync that follows (`keep == [5]`)."""
    h, ids, sid = setup(make_harness, workers=4, every=100, heartbeat_interval_s=1e5, heartbeat_timeout_s=1e6,
                        session_timeout_s=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1, [8])])
    _rebuild(h, s, rounds=2)
    h.handle(ev.WorkerUnreachable(s.devices[1], "", "killed"))
    _rebuild(h, s)
    assert h.submit(sid, 2, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)]).reput == {5: [1]}
    _rebuild(h, s)
    assert h.call(ev.KeepAlive, m.KeepAlive(session=sid)).safe == []
    _, reply = h.sync(sid, 2)
    assert reply.done and reply.keep == [5]
    return h, sid, s


def test_an_upload_asked_for_again_is_kept_past_syncs_until_a_snapshot_begun_after_it_holds_it(make_harness):
    """snapshots.py rule 7: an upload asked for again is not told safe when its copies are complete (the client may
    still be putting it), and a Sync answered done tells the client to keep it (before: it let go of it there, and a
    second loss before the next snapshot lost it); once a snapshot that began after it went out is committed, it is
    safe. An upload that was not asked for is safe as soon as its copies are made."""
    h, sid, s = _kept_after_a_loss(make_harness)
    h.advance(31.0)  # the next batch going out takes a routine snapshot (snapshot_every_s)
    assert h.submit(sid, 3, [m.InstrAdopt(tid=6, spec=spec([8]))]).safe == []
    _rebuild(h, s)
    assert sorted(h.call(ev.KeepAlive, m.KeepAlive(session=sid)).safe) == [5, 6]
    _, reply = h.sync(sid, 3)
    assert reply.done and reply.keep == []


def test_an_idle_clients_upload_asked_for_again_is_made_safe_by_a_snapshot_its_keep_alive_finds_due(make_harness):
    """snapshots.py rule 7, controller rule 9: a session that sends no batch after a done Sync (a notebook between
    cells) still takes its routine snapshot once one is due by time (`snapshot_every_s`), seen at a KeepAlive, so the
    client lets go of an upload asked for again. Before, only a batch going out took it: the client kept the upload
    for as long as the session stayed idle."""
    h, sid, s = _kept_after_a_loss(make_harness)
    h.advance(10.0)
    assert h.call(ev.KeepAlive, m.KeepAlive(session=sid)).safe == []
    assert not cmds_of(h.take_sent(), kind=m.CmdSendShards)  # not due yet: no snapshot for an idle session
    h.advance(21.0)  # past snapshot_every_s (30 s) since the last one
    assert h.call(ev.KeepAlive, m.KeepAlive(session=sid)).safe == []
    assert cmds_of(_rebuild(h, s), kind=m.CmdSendShards)  # the snapshot's copies went out
    assert h.call(ev.KeepAlive, m.KeepAlive(session=sid)).safe == [5]
    _, reply = h.sync(sid, 2)
    assert reply.done and reply.keep == []


def test_a_second_rebuild_keeps_asking_for_what_the_first_asked_and_the_client_was_not_told_yet(make_harness):
    """recovery.py rule 7: a rebuild's request for uploads is told to the client's next request; a second loss before
    that adds to it, and forgets nothing of it (the held batch's upload the first rebuild asked for, here)."""
    h, ids, sid = setup(make_harness, workers=4, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    h.take_sent()
    first, other = s.devices[1], s.devices[0]
    h.report(other)
    h.handle(ev.WorkerUnreachable(first, "", "killed"))
    h.submit(sid, 2, [m.InstrAdopt(tid=6, spec=spec([8]))])  # held by the rebuild; Put to the lost worker
    _rebuild(h, s)
    assert s.reput == {5: [1], 6: [1]} and s.state == "open"
    h.handle(ev.WorkerUnreachable(other, "", "killed"))  # before the client asked anything
    _rebuild(h, s)
    _, reply = h.sync(sid, 2)
    assert reply.reput == {5: [1], 6: [1]}


def test_an_upload_whose_batch_had_not_gone_out_is_asked_of_the_client_again_on_the_lost_workers_devices(
        make_harness):
    """recovery.py rule 7: the client Put an upload's shards, and its batch waits in the dispatch window behind the
    worker that is then lost: that worker's device is asked for again, the other device's shard is where the client
    Put it."""
    h, ids, sid = setup(make_harness, every=100, dispatch_ahead=1)
    s = session(h, sid)
    h.submit(sid, 1, [create(1, [8])])
    h.submit(sid, 2, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])  # waits for batch 1 on both workers
    assert not h.core.pipeline.recs[sid].log[-1].sent
    victim = s.devices[1]
    h.report(s.devices[0])
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    _rebuild(h, s)
    rid, reply = h.sync(sid, 2)
    assert not reply.done and reply.reput == {5: [1]}
    _rebuild(h, s)
    _, again = h.sync(sid, 2)
    assert again.done and again.errors == [] and s.state == "open"


def test_a_replicated_upload_whose_worker_did_not_finish_its_copy_is_restored_from_a_replicas(make_harness):
    """lineage.py rule 3: the lost worker's own copy may be partial, but a replicated upload's other devices hold the
    same value: the rebuild restores the lost device from a replica's copy (`CmdFetchShards.rename`)."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8], placements=("R",))), add_(5)])
    h.take_sent()
    victim = s.devices[1]
    h.report(s.devices[0])  # device 0's copies are done; device 1's worker never finishes its batch
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    assert s.state == "recovering"
    sent = []
    for _ in range(4):
        h.report_all()
        sent += h.take_sent()
    assert s.state == "open" and victim not in s.devices.values()
    restores = {(tuple(c.devices), tuple(c.rename.items())) for c in cmds_of(sent, kind=m.CmdFetchShards)
                if 5 in [t for tids in c.devices.values() for t in tids]}
    assert restores == {((0,), ()), ((0,), ((0, 1),))}  # device 1 from device 0's copy
    _, reply = h.sync(sid, 1)
    assert reply.done and reply.errors == []


def test_an_upload_whose_every_copy_was_lost_cannot_be_rebuilt(make_harness):
    """lineage.py rule 3, recovery.py rule 1: a session is rebuilt only when every upload in its log has a live
    copy of each device's shards."""
    h, ids, sid = setup(make_harness, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    h.report_all()
    upload = h.core.pipeline.recs[sid].adopts[5]
    victim = s.devices[1]
    [backup] = [w for w in upload.holders[1] if w != victim]
    assert upload.complete and backup not in s.devices.values()
    h.handle(ev.WorkerUnreachable(backup, "", "killed"))  # holds copies only: a new snapshot starts
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))  # before it completes
    assert s.state == "degraded"
    h.report_all()
    _, reply = h.sync(sid, 1)
    assert [e.message.rpartition("not rebuilt: ")[2] for e in reply.errors] == [
        "every copy of the upload of tensor 5 was on lost workers"]


@pytest.mark.parametrize("every", [2, 0], ids=["rebuilt", "not-rebuilt"])
def test_a_lost_workers_peers_are_fenced_at_once_whether_or_not_the_session_is_rebuilt(make_harness, every):
    """recovery.py rule 6: each other live worker of a session the lost worker served gets one CmdFence naming it
    (a stopped worker keeps its connections open: their copies and collectives would wait on it), outside the
    session's stream (its Sync does not wait for it); a worker that shared nothing with it gets none."""
    h, ids, sid = setup(make_harness, workers=4, every=every)
    s = session(h, sid)
    other = h.open_session()
    assert h.open_mesh(other, 1, [0, 1]).placed
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    h.take_sent()
    victim, survivor = s.devices[1], s.devices[0]
    bystanders = set(ids) - {victim, survivor} - set(h.core.pipeline.recs[sid].namespaces.get(f"{sid}#s1", ()))
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    fences = [(e.worker_id, e.execute) for e in h.take_sent() if any(type(c) is m.CmdFence for c in e.execute.cmds)]
    address = h.core.workers[victim].address
    assert (survivor, [m.CmdFence(addresses=[address])]) in [(w, x.cmds) for w, x in fences]
    assert len({w for w, _ in fences}) == len(fences)  # one each, though two sessions shared it
    assert all(x.session.endswith("#fence") for _, x in fences)
    assert victim not in {w for w, _ in fences} and not bystanders & {w for w, _ in fences}
    assert s.state == ("recovering" if every else "degraded")
    if not every:  # answered at once: the fences are not waited for
        assert h.sync(sid, 2)[1].done


def test_a_worker_restarting_at_a_fenced_address_has_it_lifted_where_it_was_fenced(make_harness):
    """recovery.py rule 6: the old worker was declared lost and fenced; a new one registering at its address (a
    restart) is reachable again: each live worker told to fence it gets CmdFence(lifted=[address]), once."""
    h, ids, sid = setup(make_harness, every=2)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    victim = session(h, sid).devices[1]
    address = h.core.workers[victim].address
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    fenced = {e.worker_id for e in h.take_sent() if m.CmdFence(addresses=[address]) in e.execute.cmds}
    assert fenced and victim not in fenced
    new = h.register(address)
    lifts = [(e.worker_id, e.execute.cmds) for e in h.take_sent() if any(type(c) is m.CmdFence for c in e.execute.cmds)]
    assert sorted(lifts) == sorted((w, [m.CmdFence(lifted=[address])]) for w in fenced)
    assert new not in {w for w, _ in lifts}
    h.register("10.0.0.9:7000")  # an address never fenced: nothing to lift
    assert not [e for e in h.take_sent() if any(type(c) is m.CmdFence for c in e.execute.cmds)]


def test_an_uploads_copy_to_a_lost_backup_leaves_its_primarys_and_the_rebuild_waits_for_it(make_harness):
    """recovery.py rule 1, snapshots.py rule 3: the survivor still copying an upload to the lost worker (its backup)
    is waited for, not given up on; its copy fails once fenced (ErrorReport.peer), its own copy stands, and the
    session is rebuilt from it."""
    h, ids, sid = setup(make_harness, workers=2, every=100)
    s = session(h, sid)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), add_(5)])
    primary, victim = s.devices[0], s.devices[1]
    address = h.core.workers[victim].address
    [seq] = [e.execute.seq for e in h.take_sent() if e.worker_id == primary
             and any(type(c) is m.CmdSendShards and c.to == address for c in e.execute.cmds)]
    h.report(victim)  # the victim's own copies are done; the primary's copy to it is not
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    assert s.state == "recovering"
    assert not cmds_of(h.take_sent(), kind=m.CmdAbandon)  # waits for the copy being made
    failed = m.ErrorReport(op="copy shards", src="", message="cancelled", seq=seq, kind=m.ErrorKind.COPY,
                           peer=address)
    h.report(primary, errors={sid: [failed]})
    assert cmds_of(h.take_sent(), kind=m.CmdAbandon)
    sent = []
    for _ in range(4):
        h.report_all()
        sent += h.take_sent()
    assert s.state == "open" and s.devices == {0: primary, 1: primary}
    restores = cmds_of(sent, kind=m.CmdFetchShards)
    assert {(d, c.address) for c in restores for d in c.devices} == {(0, ""), (1, "")}  # the primary's own copies
    _, reply = h.sync(sid, 1)
    assert reply.done and reply.errors == []


def test_a_loss_of_a_worker_with_unfinished_commands_and_no_tensors_says_so(make_harness):
    """recovery.py rule 2: a session that lost no tensor but unfinished commands on the lost worker is told."""
    h, ids, sid = setup(make_harness, every=0)
    s = session(h, sid)
    h.submit(sid, 1, [create(1), m.InstrDelete(tids=[1])])
    victim = s.devices[1]
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    h.report_all()
    _, reply = h.sync(sid, 1)
    [error] = reply.errors
    assert error.tid == -1 and error.kind == m.ErrorKind.WORKER_LOST
    assert error.message == (f"worker {victim} at {h.core.workers[victim].address} was lost (unreachable: killed); "
                             "logical devices [1] lost their data: unfinished commands lost")


def test_a_moves_old_shards_are_dropped_even_while_an_earlier_moves_drop_waits_for_its_readers(make_harness):
    """moves.py rule 1: each move's source drops its shards once the readers planned before that move are done;
    a drop that waits does not hold back another move's drop that is ready."""
    h = make_harness(snapshot_every_batches=0)
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(5)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed and h.open_mesh(sid, 2, [2]).placed
    s = session(h, sid)
    h.submit(sid, 1, [create(1), create(2, mesh=2)])
    h.report_all()
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=3, src_spec=spec([8]), dst_spec=spec([8], placements=("R",)))])
    h.take_sent()  # each worker of mesh 1 reads the other's shard of tensor 1
    w0, reader, w2 = s.devices[0], s.devices[1], s.devices[2]
    x, y = [w for w in ids if w not in s.devices.values()]
    first, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=x))
    second, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=2, to_worker=y))
    for w in (w0, x):
        h.report(w)
    assert h.replies[first].ok and not cmds_of(h.take_sent(), w0, m.CmdDelete)  # the reader has not read yet
    for w in (w2, y):
        h.report(w)
    assert h.replies[second].ok
    assert cmds_of(h.take_sent(), w2, m.CmdDelete) == [m.CmdDelete(tids=[2], devices=[2])]
    h.report(reader)
    assert cmds_of(h.take_sent(), w0, m.CmdDelete) == [m.CmdDelete(tids=[1, 3], devices=[0])]


def test_the_status_counts_every_sent_batch_as_to_replay_when_there_is_no_snapshot(make_harness):
    """Lineage.batches_since_snapshot: with no snapshot (recovery off) a status says so (-1) and counts every
    batch sent so far."""
    h, ids, sid = setup(make_harness, every=0)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    [status] = h.status().sessions
    assert (status.snapshot_batch, status.replay_batches) == (-1, 2)


def test_a_delete_waiting_for_a_reader_goes_out_when_the_reader_is_lost(make_harness):
    """pipeline.py rule 6, recovery.py rule 2: a delete of a tensor a peer still pulls waits for that reader; when
    the reader is lost (a loss that is reported, not rebuilt) it is not waited for, and the delete goes out."""
    h = make_harness(snapshot_every_batches=0)
    for i in range(3):
        h.register(f"10.0.0.{i}:7000")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed and h.open_mesh(sid, 2, [2]).placed
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=2, src_spec=spec([8]), dst_spec=spec([8], mesh=2,
                                                                                       placements=("R",))),
                      m.InstrDelete(tids=[1])])
    owners, reader = [s.devices[0], s.devices[1]], s.devices[2]
    assert not cmds_of(h.take_sent(), kind=m.CmdDelete)  # the reader on mesh 2 pulls tensor 1's shards
    for w in owners:
        h.report(w)
    assert not cmds_of(h.take_sent(), kind=m.CmdDelete)
    h.handle(ev.WorkerUnreachable(reader, "", "killed"))
    sent = h.take_sent()
    assert [(e.worker_id, c) for e in sent for c in e.execute.cmds if isinstance(c, m.CmdDelete)] == [
        (owners[0], m.CmdDelete(tids=[1], devices=[0])), (owners[1], m.CmdDelete(tids=[1], devices=[1]))]


def test_a_move_whose_source_is_lost_and_not_rebuilt_is_called_off_and_the_sync_answered(make_harness):
    """moves.py rule 4: a device's source worker lost mid-move in a session that cannot be rebuilt ends the move
    (its devices are lost with the worker); the batches go on and the next Sync reports the loss, instead of the
    move holding the session's batches forever (found by the simulator: a Sync never answered)."""
    h, ids, sid = setup(make_harness, every=0)  # no copies: the loss cannot be rebuilt
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.report_all()
    src = s.devices[1]
    dst = next(w for w in ids if w not in s.devices.values())
    rid, reply = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    assert reply is None and h.core.sched.moving(sid)  # copying: the source has not run its send yet
    h.submit(sid, 2, [add_(1)])  # held behind the move
    h.handle(ev.WorkerUnreachable(src, "", "killed"))
    assert s.state == "degraded" and not h.core.sched.moving(sid)
    assert not h.replies[rid].ok and f"worker {src}" in h.replies[rid].message  # the Migrate is answered
    h.report_all()
    sync_rid, sync = h.sync(sid, 2)
    assert sync is not None and sync.done
    assert any(e.kind == m.ErrorKind.WORKER_LOST and "tensor 1" in e.message for e in sync.errors)


def _foreach_add_(tids, src="train.py:12") -> m.InstrCall:
    """`torch._foreach_add_(tensors, 1)`: writes its arguments in place and returns nothing (`writes`)."""
    return m.InstrCall(op="aten._foreach_add_.Scalar", mesh=1, args=[[m.tensor_slot(t) for t in tids], 1.0],
                       kwargs={}, outs=[], src=src, writes=list(tids))


def _read(tid, out, src="train.py:15") -> m.InstrCall:
    """`out = tensor tid * 2`: reads tid, writes nothing of it."""
    return m.InstrCall(op="aten.mul.Scalar", mesh=1, args=[m.tensor_slot(tid), 2.0], kwargs={},
                       outs=[m.OutSpec(tid=out, spec=spec([8]))], src=src)


def test_a_routine_snapshot_keeps_the_copies_of_what_nothing_wrote_and_recovery_restores_them(make_harness):
    """lineage.py rule 5: tensor 1 (only read since snapshot 1) keeps its copies on both holders (no bytes move);
    2 (written in place through `writes`, returned by nothing) and 3 (new) are copied; a loss restores all three
    from snapshot 2; the snapshot forced after it copies everything again."""
    h, ids, sid = setup(make_harness)
    s = session(h, sid)
    h.submit(sid, 1, [create(1), create(2)])
    h.submit(sid, 2, [add_(2)])
    h.report_all()
    h.take_sent()
    rec = h.core.pipeline.recs[sid]
    first = rec.snapshot
    assert first.upto == 2 and first.copied == first.bytes == 2 * 2 * 4 * 4  # 2 tensors x 2 devices x 4 floats
    h.submit(sid, 3, [_read(1, 3)])
    h.submit(sid, 4, [_foreach_add_([2])])
    sent = h.take_sent()
    sends, keeps = cmds_of(sent, kind=m.CmdSendShards), cmds_of(sent, kind=m.CmdKeepCopies)
    assert sends and all(sorted(t for tids in c.devices.values() for t in tids) == [2, 3] for c in sends)
    for d in (0, 1):  # on the device's worker and on the one holding its other copy
        on = sorted(e.worker_id for e in sent for c in own(e.execute)
                    if isinstance(c, m.CmdKeepCopies) and d in c.devices)
        assert on == sorted(first.holders[d])
    assert all(c.devices in ({0: [1]}, {1: [1]}) and (c.source, c.namespace) == (f"{sid}#s1", f"{sid}#s2")
               for c in keeps)
    h.report_all()
    assert rec.snapshot.upto == 4 and (rec.snapshot.bytes, rec.snapshot.copied) == (3 * 32, 2 * 32)
    status = h.status().sessions[0]
    assert (status.snapshot_bytes, status.snapshot_copied_bytes) == (96, 64)
    assert [e for e in h.take_sent() if e.execute.session == f"{sid}#s1"]  # the old namespace goes after the commit

    h.submit(sid, 5, [_read(1, 4)])
    h.take_sent()
    sent = lose_and_recover(h, sid, s.devices[1])
    fetches = cmds_of(sent, kind=m.CmdFetchShards)
    assert fetches and all(c.namespace == f"{sid}#s2" and list(c.devices.values()) == [[1, 2, 3]] for c in fetches)
    h.report_all()
    sent += h.take_sent()  # the snapshot forced after a recovery copies everything (the copies' workers changed)
    assert not cmds_of(sent, kind=m.CmdKeepCopies) and rec.snapshot.namespace == f"{sid}#s3"
    assert sorted(t for c in cmds_of(sent, kind=m.CmdSendShards) for tids in c.devices.values() for t in tids
                  ) == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert rec.snapshot.copied == rec.snapshot.bytes == 4 * 32


def test_a_stale_keep_fails_the_snapshot_and_that_tensor_is_copied_from_then_on(make_harness):
    """snapshots.py rule 6: the worker holding tensor 1 found its copy stale (aliasing the core cannot see): the
    snapshot fails like a failed copy, unseen by the client, is retaken whole, and tensor 1 is never kept again
    (tensor 6, only read, still is)."""
    h, ids, sid = setup(make_harness)
    h.submit(sid, 1, [create(1), create(6)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    h.take_sent()
    h.submit(sid, 3, [_read(1, 2)])
    h.submit(sid, 4, [_read(1, 3)])
    sent = h.take_sent()
    checked = [(e.worker_id, e.execute.seq) for e in sent for c in own(e.execute)
               if isinstance(c, m.CmdKeepCopies) and c.check]
    assert checked and len(checked) == 2  # one per device, on the worker holding it
    worker, seq = checked[0]
    h.report(worker, errors={sid: [m.ErrorReport(op="keep copies", src="", message="tensor 1 changed", tid=1,
                                                 seq=seq, kind=m.ErrorKind.STALE_COPY)]})
    h.report_all()
    rec = h.core.pipeline.recs[sid]
    snap = rec.snapshot  # the failed one (#s2) did not count; the one retaken at once copied everything
    assert rec.unkeepable == {1} and (snap.namespace, snap.upto, snap.copied) == (f"{sid}#s3", 4, snap.bytes)
    sent = h.take_sent()
    assert [c for c in cmds_of(sent, kind=m.CmdSendShards) if c.namespace == f"{sid}#s3"]
    assert not cmds_of(sent, kind=m.CmdKeepCopies)
    h.submit(sid, 5, [_read(1, 4)])
    h.submit(sid, 6, [_read(1, 5)])  # a routine snapshot again: 1 copied, the unwritten rest kept
    sent = h.take_sent()
    assert {t for c in cmds_of(sent, kind=m.CmdSendShards) if c.namespace == f"{sid}#s4"
            for tids in c.devices.values() for t in tids} == {1, 4, 5}
    assert {t for c in cmds_of(sent, kind=m.CmdKeepCopies) for tids in c.devices.values() for t in tids} == {2, 3, 6}
    rid, reply = h.sync(sid, 4)
    h.report_all()
    assert not h.replies[rid].errors


def test_a_replayed_program_s_writes_are_copied_again_and_its_reads_kept(make_harness):
    """lineage.py rule 5 through a captured program: its slots' writes are found in its definition."""
    h, ids, sid = setup(make_harness)
    h.submit(sid, 1, [create(1), create(2)])
    h.submit(sid, 2, [add_(2)])
    h.report_all()
    h.take_sent()
    program = m.InstrDefine(program=7, instrs=[_read(0, 2), _foreach_add_([1])], ntids=3)
    h.submit(sid, 3, [program, m.InstrReplay(program=7, tids=[1, 2, 3])])  # 3 = 1 * 2; 2 += 1
    h.submit(sid, 4, [m.InstrReplay(program=7, tids=[1, 2, 4]), m.InstrDelete(tids=[3])])
    sent = h.take_sent()
    assert sorted({t for c in cmds_of(sent, kind=m.CmdSendShards) for tids in c.devices.values() for t in tids}
                  ) == [2, 4]
    assert {t for c in cmds_of(sent, kind=m.CmdKeepCopies) for tids in c.devices.values() for t in tids} == {1}


def test_a_snapshot_keeps_an_uploads_copies_unless_something_wrote_it_after_its_adopt(make_harness):
    """lineage.py rule 5: upload 5, only read, keeps the copies made at its adopt (`#a0`); upload 6, written in
    place in its adopt's batch after the adopt, is copied; a snapshot taken before an upload's copies are complete
    copies it."""
    h, ids, sid = setup(make_harness)
    h.submit(sid, 1, [m.InstrAdopt(tid=5, spec=spec([8])), m.InstrAdopt(tid=6, spec=spec([8])), add_(6)])
    h.report_all()  # the uploads' copies are complete
    h.take_sent()
    h.submit(sid, 2, [_read(5, 7)])
    sent = h.take_sent()
    keeps = cmds_of(sent, kind=m.CmdKeepCopies)
    assert keeps and all(c.source == f"{sid}#a0" and list(c.devices.values()) == [[5]] for c in keeps)
    assert sorted({t for c in cmds_of(sent, kind=m.CmdSendShards) for tids in c.devices.values() for t in tids}
                  ) == [6, 7]
    h.report_all()
    rec = h.core.pipeline.recs[sid]
    assert rec.snapshot.upto == 2 and rec.adopts == {}
    assert [e for e in h.take_sent() if e.execute.session == f"{sid}#a0"]  # dropped once the snapshot holds them

    h.submit(sid, 3, [m.InstrAdopt(tid=8, spec=spec([8]))])
    h.submit(sid, 4, [_read(8, 9)])  # the snapshot goes out before the upload's copies are known complete
    sent = h.take_sent()
    assert 8 in {t for c in cmds_of(sent, kind=m.CmdSendShards) if not c.background
                 for tids in c.devices.values() for t in tids}


def test_a_session_closed_while_a_rebuild_interrupts_a_copy_is_closed_on_the_copys_target_too(make_harness):
    """The interrupted copy's target may hold shards without hosting a device (`Rebuild.extra`); a close before the
    rebuild's reset reached it went only to the session's devices' workers, and the shards stayed there."""
    h, ids, sid = setup(make_harness, workers=5)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    dst = [w for w in ids if w not in s.devices.values()][-1]
    h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=1, to_worker=dst))
    h.take_sent()
    h.handle(ev.WorkerUnreachable(s.devices[0], "", "killed"))
    h.take_sent()
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
    assert cmds_of(h.take_sent(), dst, m.CmdCloseSession)


def test_a_session_being_rebuilt_is_not_looked_at_by_every_report_and_snapshots_once_open(make_harness):
    """The snapshot a rebuild forces cannot start before the session is open again: it put the session on every
    report's list, so each heartbeat round looked at it once per worker (0.9 s a round at 4,096 workers)."""
    h, ids, sid = setup(make_harness, workers=4)
    s = session(h, sid)
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()
    h.take_sent()

    def while_recovering():
        assert h.core.pipeline.recs[sid].force
        spare = next(w for w in h.core.workers.values() if w.state != "lost" and w.id not in s.devices.values())
        assert h.core.waits.idle_for(spare)  # a report of a worker the rebuild does not wait on looks at nothing

    sent = lose_and_recover(h, sid, s.devices[1], while_recovering)
    assert {c.namespace for c in cmds_of(sent, kind=m.CmdSendShards)} == {f"{sid}#s2"}  # the forced snapshot
