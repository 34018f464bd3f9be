"""The core from outside: lifecycle tables closed under their events, the notices an observer gets, the read-only
view, and the settle pass taking one event as far as it goes (all on the fake clock, through `handle()`)."""

from __future__ import annotations

import pytest

from _core_helpers import add_, cmds_of, create
from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_controller.core.policies import PriorityPolicy
from dtorch_protocol import messages as m


def notices(h, kind):
    return [n for n in h.notices if isinstance(n, kind)]


# ---------------------------------------------------------------- tables


@pytest.mark.parametrize("table", [st.WORKER_TABLE, st.SESSION_TABLE, st.REBUILD_TABLE, st.DRAIN_TABLE,
                                   st.MOVE_TABLE])
def test_every_table_is_closed_under_its_events_and_refuses_what_it_does_not_list(table):
    for state, moves in table.items():
        assert set(moves.values()) <= set(table), state
    terminal = next(state for state, moves in table.items() if not moves)
    with pytest.raises(st.IllegalTransition, match="no transition"):
        st.step(table, terminal, "anything")


def test_every_hold_has_its_rules():
    assert set(st.HOLDS) == set(st.Hold)
    assert not st.HOLDS[st.Hold.FROZEN].sync_waits and st.HOLDS[st.Hold.FROZEN].snapshots
    assert all(st.HOLDS[h].sync_waits and not st.HOLDS[h].snapshots for h in (st.Hold.RECOVERING, st.Hold.MIGRATING))


# ---------------------------------------------------------------- notices and the view


def test_an_observer_sees_placements_queueing_preemption_and_resumption_as_notices(make_harness):
    h = make_harness(policy=PriorityPolicy())
    w0, w1 = h.register("10.0.0.0:7000"), h.register("10.0.0.1:7000")
    low = h.open_session("low", priority="low")
    assert h.open_mesh(low, 1, [0, 1]).placed
    assert notices(h, fx.Placed) == [fx.Placed(low, {0: w0, 1: w1})]
    other = h.open_session("other", priority="low")
    assert not h.open_mesh(other, 1, [0]).placed
    assert notices(h, fx.Queued) == [fx.Queued(other, 1)]
    assert h.core.view.queued == 1 and h.core.view.schedule(other) == "waiting"
    h.submit(low, 1, [create(1)])
    high = h.open_session("high", priority="high")
    assert h.open_mesh(high, 1, [0, 1]).placed
    assert notices(h, fx.Frozen) == [fx.Frozen(low)] and h.core.view.schedule(low) == "frozen"
    sent = len(h.sent)
    h.submit(low, 2, [add_(1)])
    assert len(h.sent) == sent  # held while frozen
    h.call(ev.CloseSession, m.CloseSession(session=high))
    assert notices(h, fx.Resumed) == [fx.Resumed(low)] and h.core.view.schedule(low) == "running"
    assert [c.op for c in cmds_of(h.sent[sent:], kind=m.CmdRun)]  # let go


def test_the_view_answers_what_a_simulator_samples(make_harness):
    h = make_harness()
    w0, w1, w2 = (h.register(f"10.0.0.{i}:7000", memory=1000) for i in range(3))
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1, 2, 3]).placed  # 4 logical devices on 3 workers
    view = h.core.view
    assert view.bound_devices() == 4 and view.sessions_on(w0) == {sid} and view.leased(w2)
    assert sorted((memory, dict(leases)) for memory, leases in view.leases()) == [(1000, {sid: 0})] * 3
    assert view.worker_state(w1) == "alive" and view.worker_state("w99") is None
    h.handle(ev.WorkerUnreachable(w1, "", "gone"))
    assert view.worker_state(w1) == "lost" and fx.Fenced(w1, "unreachable: gone", "unreachable", 0.0) in h.notices


def test_a_loss_is_told_as_fenced_then_recovered(make_harness):
    h = make_harness(snapshot_every_batches=2)
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(3)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # the snapshot after batch 2 is complete
    victim = h.core.sessions[sid].devices[1]
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    assert notices(h, fx.Fenced) == [fx.Fenced(victim, "unreachable: killed", "unreachable", 0.0)]
    assert not notices(h, fx.Recovered)
    for _ in range(4):
        h.report_all()
    (recovered,) = notices(h, fx.Recovered)
    assert recovered.session == sid and recovered.replayed == 0
    assert set(h.core.sessions[sid].devices.values()) <= set(ids) - {victim}


def test_a_drain_is_told_as_a_move_then_drained(make_harness):
    h = make_harness(snapshot_every_batches=1)
    w0, w1, w2 = (h.register(f"10.0.0.{i}:7000") for i in range(3))
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0]).placed
    h.submit(sid, 1, [create(1, shape=(4,))])
    h.report_all()
    src = h.core.sessions[sid].devices[0]
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=src))
    for _ in range(4):
        h.report_all()
    assert h.replies[rid].ok
    (moved,) = notices(h, fx.Moved)
    assert (moved.session, moved.devices, moved.src) == (sid, (0,), src) and moved.dst != src
    assert notices(h, fx.Drained) == [fx.Drained(src, 1)] and h.core.view.worker_state(src) == "lost"


# ---------------------------------------------------------------- the settle pass


def test_one_report_takes_a_move_through_its_commit_the_freed_worker_and_a_queued_placement(make_harness):
    """The settle pass runs the consequences to a fixed point in the event that causes them: the report that
    completes a migration commits it, the scheduler takes the source back, and the queue places a waiting mesh
    on it, all before the report is answered."""
    h = make_harness()
    w0, w1 = h.register("10.0.0.0:7000"), h.register("10.0.0.1:7000")
    a = h.open_session("a")
    assert h.open_mesh(a, 1, [0, 1]).placed  # one device on each worker
    h.report_all()
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=a, device=0, to_worker=w1))
    b = h.open_session("b")
    assert not h.open_mesh(b, 1, [0]).placed  # both workers are a's
    h.report(w0)  # the copy is done
    assert h.replies[rid].ok and h.core.sessions[a].devices == {0: w1, 1: w1}
    assert h.core.sessions[b].devices == {0: w0} and fx.Placed(b, {0: w0}) in h.notices
