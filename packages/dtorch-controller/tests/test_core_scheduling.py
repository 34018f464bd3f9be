"""The scheduler through the core, on a fake clock: one test (or a few) per rule of scheduler.py, pool.py and
the policies. Workers "report" by hand; heartbeats are made long where a test moves the clock a lot."""

from __future__ import annotations

import pytest

from _core_helpers import create
from dtorch_controller.core import elastic
from dtorch_controller.core import events as ev
from dtorch_controller.core.policies import FifoPolicy, LasPolicy, PolicyError, PriorityPolicy, make_policy
from dtorch_controller.core.pool import Pool
from dtorch_controller.core.scheduler import TENANT_TABLE, IllegalTenantTransition
from dtorch_controller.core.timers import PolicyTick
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello

QUIET = dict(heartbeat_interval_s=1e5, heartbeat_timeout_s=1e6)  # workers never go suspect on their own


def workers(h, n, node=None, start=0):
    return [h.register(f"10.0.0.{i}:7000", labels={"node": node} if node else None) for i in range(start, start + n)]


def close(h, sid):
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok


def sched_state(h, sid):
    return h.core.sched.state(sid)


def leases(h, wid):
    return dict(h.core.sched.pool.slots[wid].leases)


# ---------------------------------------------------------------- admission and the queue


def test_devices_are_exclusive_across_sessions_and_a_waiting_mesh_shows_its_position(h):
    w0, w1 = workers(h, 2)
    a, b, c = h.open_session("a"), h.open_session("b"), h.open_session("c")
    assert h.open_mesh(a, 1, [0, 1]).placed
    first = h.open_mesh(b, 1, [0])
    assert (first.placed, first.queue_position) == (False, 1)
    assert "needs 1 physical device, 0 of 2 free" in first.message
    assert h.open_mesh(c, 1, [0]).queue_position == 2
    assert h.open_mesh(b, 1, [0]).queue_position == 1  # polling keeps the place
    assert [sched_state(h, s) for s in (a, b, c)] == ["running", "waiting", "waiting"]
    close(h, a)  # both devices free up: both waiting sessions are placed by the core, before they poll again
    assert [sched_state(h, s) for s in (b, c)] == ["running", "running"]
    assert h.core.sessions[b].devices == {0: w0} and h.core.sessions[c].devices == {0: w1}
    reply = h.open_mesh(b, 1, [0])
    assert reply.placed and reply.locations == {0: "10.0.0.0:7000"}
    assert any("placed on 1 device" in line for line in h.core.log.lines())


def test_a_waiting_session_that_closes_leaves_the_queue_and_the_next_one_gets_the_device(h):
    """TENANT_TABLE: waiting --close--> closed; the session behind it moves up and is placed when a device frees."""
    (w0,) = workers(h, 1)
    a, b, c = h.open_session("a"), h.open_session("b"), h.open_session("c")
    assert h.open_mesh(a, 1, [0]).placed
    assert h.open_mesh(b, 1, [0]).queue_position == 1 and h.open_mesh(c, 1, [0]).queue_position == 2
    close(h, b)
    assert sched_state(h, b) == "closed" and h.open_mesh(c, 1, [0]).queue_position == 1
    close(h, a)
    assert sched_state(h, c) == "running" and h.core.sessions[c].devices == {0: w0}


def test_a_worker_that_registers_is_used_by_a_waiting_session_at_once(h):
    workers(h, 1)
    a, b = h.open_session(), h.open_session()
    assert h.open_mesh(a, 1, [0]).placed
    assert not h.open_mesh(b, 1, [0]).placed
    w1 = h.register("10.0.0.9:7000")
    assert h.core.sessions[b].devices == {0: w1}
    assert h.open_mesh(b, 1, [0]).locations == {0: "10.0.0.9:7000"}


def test_more_logical_devices_than_workers_run_as_virtual_devices_of_one_session(h):
    w0, w1 = workers(h, 2)
    s = h.open_session()
    assert h.open_mesh(s, 1, [0, 1, 2, 3], [2, 2]).placed  # needs min(4, 2 known workers) = 2
    assert leases(h, w0) == {s: 0} and leases(h, w1) == {s: 0}
    assert sorted(h.core.sessions[s].devices.values()) == [w0, w0, w1, w1]


def test_admission_is_all_or_nothing(h):
    w0, w1, w2 = workers(h, 3)
    a, b = h.open_session(), h.open_session()
    assert h.open_mesh(a, 1, [0, 1]).placed  # takes w0, w1
    assert not h.open_mesh(b, 1, [0, 1]).placed  # needs 2, one free: takes nothing
    assert h.core.sched.pool.is_free(w2) and h.core.sessions[b].devices == {}


def test_elastic_minimum_starts_on_fewer_devices(h):
    w0, w1, w2 = workers(h, 3)
    a, b = h.open_session(), h.open_session()
    assert h.open_mesh(a, 1, [0, 1]).placed
    assert h.open_mesh(b, 1, [0, 1, 2, 3], min_devices=1).placed  # wants 4, accepts 1
    assert set(h.core.sessions[b].devices.values()) == {w2}


def test_a_waiting_need_shrinks_with_the_cluster_when_workers_are_lost(h):
    w0, w1 = workers(h, 2)
    a, b = h.open_session(), h.open_session()
    assert h.open_mesh(a, 1, [0]).placed
    assert not h.open_mesh(b, 1, [0, 1]).placed  # needs both workers
    h.handle(ev.WorkerUnreachable(w0))  # a's worker dies: one worker left, so b needs only one
    assert sched_state(h, b) == "running" and set(h.core.sessions[b].devices.values()) == {w1}


def test_placement_prefers_the_fewest_nodes_best_fit_first(h):
    big = workers(h, 4, node="big")
    small = workers(h, 2, node="small", start=10)
    s1, s2, s3 = h.open_session(), h.open_session(), h.open_session()
    assert h.open_mesh(s1, 1, [0, 1]).placed
    assert set(h.core.sessions[s1].devices.values()) == set(small)  # the smallest node that fits
    assert h.open_mesh(s2, 1, [0, 1, 2]).placed
    assert set(h.core.sessions[s2].devices.values()) <= set(big)  # one node, not two
    close(h, s1)
    assert h.open_mesh(s3, 1, [0, 1, 2]).placed  # 1 free on big + 2 on small: two nodes, the fuller first
    rest = set(big) - set(h.core.sessions[s2].devices.values())
    assert set(h.core.sessions[s3].devices.values()) == set(small) | rest


def test_pool_picks_without_scanning_and_keeps_counts():
    pool = Pool()
    for i in range(10):
        pool.add(f"w{i}", f"n{i // 4}", 100, i)  # nodes n0: 4, n1: 4, n2: 2
    assert pool.free_total == 10
    assert pool.pick(2) == ["w8", "w9"]  # best fit: the node with 2
    assert pool.pick(4) == ["w0", "w1", "w2", "w3"]
    assert sorted(pool.pick(5)) == ["w0", "w1", "w2", "w3", "w8"]  # largest node, then best fit for the rest
    pool.lease("w0", "s", 0)
    assert pool.free_total == 9 and not pool.is_free("w0")
    assert pool.pick(4, exclude={"w5"}) == ["w1", "w2", "w3", "w8"]  # reserved workers are left out
    assert pool.pick(2, exclude={"w5"}) == ["w8", "w9"]  # still best fit: the node with exactly 2 free
    pool.set_placeable("w4", False)
    assert "w4" not in pool.pick(10) and pool.free_total == 8
    assert pool.remove("w0") == {"s": 0} and pool.free_total == 8 and len(pool) == 9


def test_a_running_session_never_waits_for_its_later_meshes(h):
    w0, w1, w2 = workers(h, 3)
    a, b = h.open_session(), h.open_session()
    assert h.open_mesh(a, 1, [0]).placed
    assert h.open_mesh(a, 2, [1]).placed  # nobody waits: a takes a free device
    assert len(set(h.core.sessions[a].devices.values())) == 2
    assert h.open_mesh(b, 1, [0, 1]).queue_position == 1  # needs 2, one free
    assert h.open_mesh(a, 3, [2, 3]).placed  # someone waits: a's new devices go on its own workers
    assert len(set(h.core.sessions[a].devices.values())) == 2 and h.core.sched.pool.free_total == 1


def test_fifo_is_strict_head_of_line(make_harness):
    h = make_harness(policy=FifoPolicy())
    workers(h, 2)
    a, b, c = h.open_session(), h.open_session(priority="high"), h.open_session()
    assert h.open_mesh(a, 1, [0]).placed
    assert not h.open_mesh(b, 1, [0, 1]).placed  # needs 2, waits
    assert not h.open_mesh(c, 1, [0]).placed  # would fit, but b came first
    assert (h.core.sched.position(b), h.core.sched.position(c)) == (1, 2)
    assert sched_state(h, a) == "running"  # fifo never preempts, whatever the priority


# ---------------------------------------------------------------- priorities and preemption


def test_priority_orders_the_queue_and_realtime_goes_first_within_a_class(h):
    workers(h, 1)
    a = h.open_session(priority="high")
    assert h.open_mesh(a, 1, [0]).placed
    low, normal, rt = h.open_session(priority="low"), h.open_session(), h.open_session(kind="realtime")
    for s in (low, normal, rt):
        assert not h.open_mesh(s, 1, [0]).placed
    assert [h.core.sched.position(s) for s in (rt, normal, low)] == [1, 2, 3]
    assert sched_state(h, a) == "running"  # nobody outranks a high session


def test_a_lower_class_may_overtake_a_blocked_higher_one_but_not_its_own_class(h):
    w0, w1 = workers(h, 2)
    busy = h.open_session(priority="high")
    assert h.open_mesh(busy, 1, [0]).placed
    big = h.open_session(priority="high")  # blocked: needs 2, and nothing it may preempt
    assert not h.open_mesh(big, 1, [0, 1]).placed
    same, lower = h.open_session(priority="high"), h.open_session(priority="low")
    assert not h.open_mesh(same, 1, [0]).placed  # same class: waits behind big
    assert h.open_mesh(lower, 1, [0]).placed  # big could preempt it later, so it may use the free device
    close(h, busy)  # big needs both: it freezes the low session to get them
    assert sched_state(h, big) == "running" and sched_state(h, lower) == "frozen"


def test_high_priority_freezes_low_which_holds_its_batches_and_resumes_in_order(h):
    w0, w1 = workers(h, 2)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0, 1]).placed
    h.submit(low, 1, [create(1)])
    h.report_all()
    h.take_sent()
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0, 1]).placed  # freezes low, takes both devices
    assert sched_state(h, low) == "frozen" and leases(h, w0) == {high: 0}
    assert h.core.sessions[low].devices == {0: w0, 1: w1}  # its shards stay where they are
    assert any("frozen on 2 devices: preempted by session" in line for line in h.core.log.lines())
    why = h.core.sched._why(h.core.sched.tenants[low])  # what its owner may be told: not whose session (another's)
    assert why.startswith("frozen (preempted") and high[:8] not in why
    # the frozen session's client goes on: batches are accepted and held, its sync waits
    assert h.submit(low, 2, [create(2)]) == m.SubmitReply(accepted=2)
    assert h.submit(low, 3, [create(3)]) == m.SubmitReply(accepted=3)
    assert h.take_sent() == []
    rid, reply = h.sync(low, 3, timeout_s=0.3)
    assert reply is None
    status = {s.session: s for s in h.status().sessions}
    assert (status[low].schedule, status[low].queue_position) == ("frozen", 0)  # it waits for its own devices
    h.advance(0.4)  # its Sync's time is up: answered not done, saying it waits for devices (a typed field)
    assert (h.replies[rid].done, h.replies[rid].frozen, h.replies[rid].queue_position) == (False, True, 0)
    rid, reply = h.sync(low, 3, timeout_s=30)  # the client asks again
    assert reply is None
    h.submit(high, 1, [create(1)])
    assert [s.execute.session for s in h.take_sent()] == [high, high]
    close(h, high)  # devices free: low resumes, its held batches go out in order after high's close
    assert sched_state(h, low) == "running"
    sent = [(s.worker_id, s.execute.session, [c.tid for c in s.execute.cmds if isinstance(c, m.CmdCreate)])
            for s in h.take_sent()]
    assert sent == [(w0, high, []), (w1, high, []), (w0, low, [2]), (w1, low, [2]), (w0, low, [3]), (w1, low, [3])]
    h.report_all()
    assert h.replies[rid].done


def test_a_frozen_session_with_nothing_held_syncs_at_once(h):
    workers(h, 1)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0]).placed
    h.submit(low, 1, [create(1)])
    h.report_all()
    assert h.open_mesh(h.open_session(priority="high"), 1, [0]).placed
    assert sched_state(h, low) == "frozen"
    _, reply = h.sync(low, 1)
    assert reply is not None and reply.done  # its work was finished before the freeze: results can be read


def test_preemption_happens_only_when_it_frees_enough(h):
    workers(h, 3)
    low, peer = h.open_session(priority="low"), h.open_session(priority="high")
    assert h.open_mesh(low, 1, [0, 1]).placed and h.open_mesh(peer, 1, [0]).placed
    high = h.open_session(priority="high")
    assert not h.open_mesh(high, 1, [0, 1, 2]).placed  # low's two devices are not enough, peer is not lower
    assert sched_state(h, low) == "running"
    close(h, peer)  # now freezing low is enough
    assert sched_state(h, low) == "frozen" and sched_state(h, high) == "running"


def test_preemption_victims_are_lowest_class_then_most_recent(h):
    workers(h, 3)
    n1, l1, l2 = h.open_session(), h.open_session(priority="low"), h.open_session(priority="low")
    for s in (n1, l1, l2):
        assert h.open_mesh(s, 1, [0]).placed
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed
    assert [sched_state(h, s) for s in (n1, l1, l2)] == ["running", "running", "frozen"]


def test_preemption_freezes_the_smallest_session_that_frees_enough_before_a_larger_more_recent_one(h):
    workers(h, 5)
    small, big = h.open_session(priority="low"), h.open_session(priority="low")
    assert h.open_mesh(small, 1, [0]).placed and h.open_mesh(big, 1, [0, 1, 2, 3]).placed
    assert h.open_mesh(h.open_session(priority="high"), 1, [0]).placed
    assert sched_state(h, small) == "frozen" and sched_state(h, big) == "running"  # big was the most recent


@pytest.mark.parametrize("pace", [True, False])
def test_preemption_freezes_first_the_session_whose_sent_batches_should_be_done_soonest(make_harness, pace):
    # A freeze takes effect once what was sent has run, and the preemptor waits idle until then: of two sessions
    # that would do, the one done soonest by the pace of its batches goes (pipeline.py rule 8), not the most recent
    h = make_harness(policy=make_policy("dtorch", {"pace": pace, "backfill_after": 0}), session_timeout_s=0, **QUIET)
    workers(h, 2)
    quick, slow = h.open_session(priority="low"), h.open_session(priority="low")
    assert h.open_mesh(quick, 1, [0]).placed and h.open_mesh(slow, 1, [0]).placed
    h.submit(slow, 1, [create(1)])
    h.advance(9)
    h.submit(quick, 1, [create(1)])
    h.advance(1)
    h.submit(slow, 2, [create(2)])  # a batch every 10 s: its last one should be done at t + 10
    h.submit(quick, 2, [create(2)])  # one a second: done at t + 1
    h.advance(0.5)
    assert h.core.pipeline.busy_for(quick, h.now) == pytest.approx(0.5)
    assert h.core.pipeline.busy_for(slow, h.now) == pytest.approx(9.5)
    assert h.open_mesh(h.open_session(priority="high"), 1, [0]).placed
    first, second = (quick, slow) if pace else (slow, quick)  # without `pace` (LAS too): the most recent, slow
    assert sched_state(h, first) == "frozen" and sched_state(h, second) == "running"


def test_same_class_never_preempts(h):
    workers(h, 1)
    a, b = h.open_session(), h.open_session(kind="realtime")
    assert h.open_mesh(a, 1, [0]).placed
    assert not h.open_mesh(b, 1, [0]).placed
    assert sched_state(h, a) == "running"


def test_a_frozen_session_reserves_its_free_devices(h):
    w0, w1 = workers(h, 2)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0, 1]).placed
    h1 = h.open_session(priority="high")
    assert h.open_mesh(h1, 1, [0]).placed  # freezes low (both devices come free), takes one
    assert sched_state(h, low) == "frozen"
    other = h.open_session(priority="low")
    assert not h.open_mesh(other, 1, [0]).placed  # the free device is low's, kept for its resume
    close(h, h1)
    assert sched_state(h, low) == "running" and sched_state(h, other) == "waiting"


def test_a_frozen_session_relocates_onto_a_free_device_and_resumes_after_the_move(make_harness):
    h = make_harness(policy=PriorityPolicy({"relocate_after": 0}))
    w0, w1, w2 = workers(h, 3)
    low, other = h.open_session(priority="low"), h.open_session()
    assert h.open_mesh(low, 1, [0, 1]).placed and h.open_mesh(other, 1, [0]).placed
    assert h.core.sessions[low].devices == {0: w0, 1: w1} and leases(h, w2) == {other: 0}
    h.submit(low, 1, [create(1)])
    h.report(w1)  # w0 has not run low's batch yet
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed  # freezes low; takes w0, w1 stays reserved for low
    assert sched_state(h, low) == "frozen" and leases(h, w0) == {high: 0} and leases(h, w1) == {low: 0}
    h.submit(low, 2, [create(2)])  # held while frozen
    rid, _ = h.sync(low, 2, timeout_s=30)
    h.take_sent()
    close(h, other)  # w2 comes free: low need not wait for w0, it takes w2 in its place
    assert sched_state(h, low) == "running" and leases(h, w2) == {low: 0} and leases(h, w0) == {high: 0}
    assert [x for x in h.take_sent() if x.execute.session == low] == []  # w0 must finish low's batch 1 first
    h.report(w0)
    sent = h.take_sent()
    # w2 pulls device 0 from w0's server (not behind high's work queued on w0); low's held batch waits
    assert [(x.worker_id, type(x.execute.cmds[0]).__name__) for x in sent] == [(w2, "CmdFetchShards")]
    fetch = sent[0].execute.cmds[0]
    assert (fetch.address, fetch.move, fetch.devices) == ("10.0.0.0:7000", [0], {0: [1]})
    assert rid not in h.replies
    h.report_all()  # the copy is done: device 0 is rebound to w2, the held batch goes out there
    assert h.core.sessions[low].devices == {0: w2, 1: w1}
    creates = [(x.worker_id, x.execute.cmds[0].tid) for x in h.take_sent()
               if isinstance(x.execute.cmds[0], m.CmdCreate)]
    assert creates == [(w2, 2), (w1, 2)]
    h.report_all()
    assert h.replies[rid].done
    assert h.core.sched.relocations == 1
    assert any("relocates 1 device off the devices it was preempted from: w0 -> w2" in line
               for line in h.core.log.lines())


def test_the_pulls_of_one_relocation_go_out_at_once_none_waits_behind_work_queued_on_another_target(make_harness):
    # moves.py rule 3: a substitute that just came free may still run another session's batches; the pull it runs
    # waits for them in its stream, but the relocation's other pulls do not wait for it (one at a time, they did:
    # the session's other devices sat idle for the whole queue of the slowest target, then the copy)
    h = make_harness(policy=PriorityPolicy({"relocate_after": 0}), **QUIET)
    w0, w1, w2, w3 = workers(h, 4)
    low, o2, o3 = h.open_session(priority="low"), h.open_session(), h.open_session()
    assert h.open_mesh(low, 1, [0, 1]).placed and h.open_mesh(o2, 1, [0]).placed and h.open_mesh(o3, 1, [0]).placed
    assert h.core.sessions[low].devices == {0: w0, 1: w1} and leases(h, w2) == {o2: 0} and leases(h, w3) == {o3: 0}
    h.submit(low, 1, [create(1)])
    h.report_all()
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0, 1]).placed and sched_state(h, low) == "frozen"  # high takes w0 and w1
    h.submit(high, 1, [create(1)])  # queued on w0 and w1 (the old devices): the pulls do not wait for it
    h.submit(low, 2, [create(2)])  # held while frozen
    close(h, o3)
    h.report(w3)  # w3 free and idle; one free device is not enough for low's two
    h.submit(o2, 1, [create(1)])
    close(h, o2)  # w2 free too, but it has o2's batch and close still to run: low relocates onto w2 and w3
    assert sched_state(h, low) == "running" and {leases(h, w)[low] for w in (w2, w3)} == {0}
    fetches = {x.worker_id: x.execute for x in h.take_sent() if isinstance(x.execute.cmds[0], m.CmdFetchShards)}
    assert sorted(fetches) == [w2, w3]  # both pulls at once, from the old devices' servers
    assert {fetches[w].cmds[0].address for w in (w2, w3)} == {"10.0.0.0:7000", "10.0.0.1:7000"}
    h.report(w3)  # w3's copy done; w2 still runs o2's work: the held batch waits for the whole relocation
    assert not [x for x in h.take_sent() if isinstance(x.execute.cmds[0], m.CmdCreate)]
    assert sorted(h.core.sessions[low].devices.values()) in ([w0, w3], [w1, w3])  # one device rebound already
    h.report(w2)
    assert sorted(h.core.sessions[low].devices.values()) == [w2, w3]
    creates = sorted(x.worker_id for x in h.take_sent() if x.execute.session == low
                     and isinstance(x.execute.cmds[0], m.CmdCreate))
    assert creates == [w2, w3]  # the held batch goes out on the new devices
    assert h.core.sched.relocations == 1


def test_a_relocation_whose_pull_fails_is_called_off_and_the_device_stays(make_harness):
    h = make_harness(policy=PriorityPolicy({"relocate_after": 0}))
    w0, w1 = workers(h, 2)
    low, other = h.open_session(priority="low"), h.open_session()
    assert h.open_mesh(low, 1, [0]).placed and h.open_mesh(other, 1, [0]).placed
    h.submit(low, 1, [create(1)])
    h.report_all()
    assert h.open_mesh(h.open_session(priority="high"), 1, [0]).placed  # freezes low, takes w0
    h.submit(low, 2, [create(2)])
    h.take_sent()
    close(h, other)  # w1 free: low relocates there
    fetch = h.take_sent()[-1]
    assert fetch.worker_id == w1 and isinstance(fetch.execute.cmds[0], m.CmdFetchShards)
    error = m.ErrorReport(op="copy shards from 10.0.0.0:7000 (moving devices [0])", src="", message="boom",
                          seq=fetch.execute.seq, kind=m.ErrorKind.COPY)
    h.report(w1, errors={low: [error]})
    assert h.core.sessions[low].devices == {0: w0}
    sent = [(x.worker_id, type(x.execute.cmds[0]).__name__) for x in h.take_sent() if x.execute.session == low]
    assert (w0, "CmdStay") in sent and (w0, "CmdCreate") in sent  # the held batch goes on where the device is
    assert any("called off" in line for line in h.core.log.lines())


def test_a_placed_mesh_uses_every_leased_device_despite_a_frozen_sessions_bindings(h):
    h.core.sched.relocation = False
    w0 = h.register("10.0.0.0:7000")
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0, 1]).placed  # two virtual devices on w0
    w1 = h.register("10.0.0.1:7000")
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0, 1]).placed  # w1 is free, w0 is low's: low is frozen, its devices stay bound
    assert sorted(h.core.sessions[high].devices.values()) == [w0, w1]  # one each, not both on w1


def test_a_waiting_request_of_a_better_rank_gets_a_free_device_before_a_frozen_session(make_harness):
    h = make_harness(policy=PriorityPolicy({"relocate_after": 0}))
    w0 = h.register("10.0.0.0:7000")
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0]).placed
    assert h.open_mesh(h.open_session(priority="high"), 1, [0]).placed  # freezes low
    normal = h.open_session()
    assert not h.open_mesh(normal, 1, [0]).placed
    w1 = h.register("10.0.0.1:7000")
    assert leases(h, w1) == {normal: 0} and sched_state(h, low) == "frozen"
    w2 = h.register("10.0.0.2:7000")
    assert leases(h, w2) == {low: 0} and sched_state(h, low) == "running"
    assert leases(h, w0) != {low: 0}


def test_a_frozen_session_waits_for_its_own_devices_when_the_policy_does_not_relocate(make_harness):
    h = make_harness(policy=PriorityPolicy({"relocate": False, "relocate_after": 0}))  # only the flag keeps it frozen
    workers(h, 1)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0]).placed
    assert h.open_mesh(h.open_session(priority="high"), 1, [0]).placed
    w9 = h.register("10.0.0.9:7000")
    assert sched_state(h, low) == "frozen" and h.core.sched.pool.is_free(w9)


def test_preemption_can_be_turned_off():
    policy = make_policy("priority", {"preempt": False})
    assert isinstance(policy, PriorityPolicy) and not policy.preempts
    with pytest.raises(PolicyError, match="takes no parameter 'bogus'"):
        make_policy("priority", {"bogus": 1})
    with pytest.raises(PolicyError, match="unknown policy 'srtf'"):
        make_policy("srtf")


# ---------------------------------------------------------------- packing with memory caps


def test_capped_batch_sessions_share_devices_while_their_caps_fit(h):
    w0, = [h.register("10.0.0.0:7000", memory=1000)]
    w1 = h.register("10.0.0.1:7000", memory=1000)
    a, b, c = (h.open_session(memory_cap=400) for _ in range(3))
    for s in (a, b):
        assert h.open_mesh(s, 1, [0]).placed
    assert leases(h, w0) == {a: 400, b: 400}  # b packs onto a's device (best fit keeps w1 whole)
    assert h.open_mesh(c, 1, [0]).placed and leases(h, w1) == {c: 400}  # 1200 > 1000: next device
    whole = h.open_session()
    assert not h.open_mesh(whole, 1, [0]).placed  # an uncapped session needs a device to itself
    rt = h.open_session(memory_cap=100, kind="realtime")
    assert not h.open_mesh(rt, 1, [0]).placed  # realtime sessions are never packed
    st = {w.worker: w for w in h.status().workers}
    assert st[w0].leases == {a: 400, b: 400}


def test_fifo_and_las_do_not_pack(make_harness):
    for policy in (FifoPolicy(), LasPolicy()):
        h = make_harness(policy=policy)
        w0 = h.register("10.0.0.0:7000", memory=1000)
        a, b = h.open_session(memory_cap=100), h.open_session(memory_cap=100)
        assert h.open_mesh(a, 1, [0]).placed and not h.open_mesh(b, 1, [0]).placed
        assert leases(h, w0) == {a: 0}


def test_going_over_the_memory_cap_is_reported_at_the_next_sync(h):
    w0 = h.register("10.0.0.0:7000", memory=1000)
    s = h.open_session(memory_cap=100)
    assert h.open_mesh(s, 1, [0]).placed
    h.report(w0, sessions={s: m.ShardStats(tensors=1, bytes=150)})
    h.report(w0, sessions={s: m.ShardStats(tensors=1, bytes=160)})  # said once, not at every report
    _, reply = h.sync(s, 0)
    assert [e.op for e in reply.errors] == ["memory cap"]
    assert "over its memory cap of 100 bytes" in reply.errors[0].message


def test_packed_sessions_tell_workers_their_cap_and_exclusive_ones_send_none(h):
    w0 = h.register("10.0.0.0:7000", memory=1000)
    w1 = h.register("10.0.0.1:7000", memory=1000)
    a, b = h.open_session(memory_cap=400), h.open_session(memory_cap=400)
    whole = h.open_session()
    rt = h.open_session(memory_cap=300, kind="realtime")  # never packed: whole devices, no cap
    for s in (a, b, whole):
        assert h.open_mesh(s, 1, [0]).placed
    assert leases(h, w0) == {a: 400, b: 400} and leases(h, w1) == {whole: 0}
    h.take_sent()
    for s in (a, b, whole):
        h.submit(s, 1, [create(1)])
    caps = {(x.worker_id, x.execute.session): x.execute.memory_cap for x in h.take_sent()}
    assert caps == {(w0, a): 400, (w0, b): 400, (w1, whole): 0}
    close(h, whole)
    assert h.open_mesh(rt, 1, [0]).placed
    h.submit(rt, 1, [create(1)])
    assert [(x.worker_id, x.execute.memory_cap) for x in h.take_sent() if x.execute.session == rt] == [(w1, 0)]


# ---------------------------------------------------------------- least attained service


def test_las_demotes_with_attained_service_and_lets_newcomers_preempt(make_harness):
    h = make_harness(policy=LasPolicy({"thresholds": [10]}), session_timeout_s=0, **QUIET)
    w0, w1 = workers(h, 2)
    old = h.open_session()
    assert h.open_mesh(old, 1, [0, 1]).placed
    assert h.timers[PolicyTick()] == pytest.approx(h.now + 5)  # 10 device-s on 2 devices
    new = h.open_session()
    assert not h.open_mesh(new, 1, [0]).placed  # same level: no preemption
    h.advance(6)
    assert sched_state(h, old) == "frozen" and sched_state(h, new) == "running"  # old crossed 10 device-s
    status = {s.session: s for s in h.status().sessions}
    assert status[old].attained_s == pytest.approx(10)
    close(h, new)
    assert sched_state(h, old) == "running"


def test_las_starvation_promotion_resets_counted_service(make_harness):
    h = make_harness(policy=LasPolicy({"thresholds": [10], "starve_factor": 1.0, "starve_min_s": 1}),
                     session_timeout_s=0, **QUIET)
    workers(h, 1)
    old = h.open_session()
    assert h.open_mesh(old, 1, [0]).placed
    h.advance(20)  # 20 device-s: level 1
    new = h.open_session()
    assert h.open_mesh(new, 1, [0]).placed and sched_state(h, old) == "frozen"
    h.advance(9)  # new reaches 9 device-s (level 0); old has waited 9 s of the 20 it needs
    assert sched_state(h, old) == "frozen"
    h.advance(2)  # new crosses 10: level 1, same as old, no preemption; old promoted at 20 s of waiting?
    h.advance(10)
    assert any("session sess1 promoted after waiting 20s" in line for line in h.core.log.lines())  # frozen at 120
    assert sched_state(h, old) == "running" and sched_state(h, new) == "frozen"


def test_las_policy_parameters_are_checked():
    with pytest.raises(PolicyError, match="ascending"):
        LasPolicy({"thresholds": [5, 1]})
    with pytest.raises(PolicyError, match="starve_factor"):
        LasPolicy({"starve_factor": -1})


# ---------------------------------------------------------------- session liveness


def test_a_silent_client_is_closed_and_its_shards_freed_everywhere(make_harness):
    h = make_harness(session_timeout_s=5.0, **QUIET)
    w0, w1 = workers(h, 2)
    dead, waiting = h.open_session(), h.open_session()
    opened = h.call(ev.OpenSession, m.OpenSession(hello=hello("client")))
    assert opened.keepalive_s == 1.0
    assert h.open_mesh(dead, 1, [0, 1]).placed
    h.submit(dead, 1, [create(1)])
    assert not h.open_mesh(waiting, 1, [0]).placed
    h.take_sent()
    for _ in range(8):  # the waiting client polls; the other one says nothing
        h.advance(1.0)
        h.open_mesh(waiting, 1, [0])
        h.call(ev.KeepAlive, m.KeepAlive(session=opened.session))
    assert dead not in h.core.sessions and opened.session in h.core.sessions
    closes = [(s.worker_id, s.execute.cmds) for s in h.take_sent()]
    assert closes == [(w0, [m.CmdCloseSession()]), (w1, [m.CmdCloseSession()])]
    assert sched_state(h, waiting) == "running"
    assert any("timed out: client silent for 5.0s" in line for line in h.core.log.lines())
    assert h.call(ev.KeepAlive, m.KeepAlive(session=dead)) == m.KeepAliveReply(ok=False,
                                                                             message="unknown session (timed out?)")


@pytest.mark.parametrize(("timeout", "snapshots", "keepalive"), [(0, 0, 0.0), (0, 32, 1.0), (2.0, 0, 0.5)])
def test_the_controller_asks_for_keepalives_when_it_closes_silent_sessions_or_may_ask_for_uploads(
        make_harness, timeout, snapshots, keepalive):
    """Rule 9: with recovery on, a keep-alive's answer is how a rebuild reaches a client between sync points
    (recovery.py rule 7), even where silent sessions are never closed; with it off, the client keeps no uploads."""
    h = make_harness(session_timeout_s=timeout, snapshot_every_batches=snapshots, **QUIET)
    opened = h.call(ev.OpenSession, m.OpenSession(hello=hello("client")))
    assert (opened.keepalive_s, opened.recovery) == (keepalive, snapshots > 0)


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_old_clients_sessions_expire_like_current_ones(make_harness, version):
    """A client that says it speaks 1.0 (no keep-alives) used to hold its session, and its devices, forever."""
    h = make_harness(session_timeout_s=5.0, **QUIET)
    old = m.Hello(protocol_version=version, package_version="0.1.0", role="client")
    opened = h.call(ev.OpenSession, m.OpenSession(hello=old))
    assert opened.keepalive_s == 1.0
    h.advance(4.0)
    assert opened.session in h.core.sessions
    h.advance(1.5)
    assert opened.session not in h.core.sessions


# ---------------------------------------------------------------- workers coming and going


def test_suspect_workers_take_no_new_devices_until_they_report(make_harness):
    h = make_harness(heartbeat_interval_s=0.2, heartbeat_timeout_s=10.0, session_timeout_s=0)
    w0 = h.register("10.0.0.0:7000")
    h.advance(0.5)  # silent: suspect
    s = h.open_session()
    assert not h.open_mesh(s, 1, [0]).placed
    h.report(w0)  # alive again: the waiting session is placed at once
    assert sched_state(h, s) == "running"


def test_a_frozen_session_whose_workers_are_lost_resumes_with_what_is_left(make_harness):
    h = make_harness(snapshot_every_batches=0)  # recovery off: high's lost device is not placed again
    w0, w1 = workers(h, 2)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0, 1]).placed
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed  # low frozen; w1 reserved for it
    h.handle(ev.WorkerUnreachable(w0))  # high's (and low's) device dies: low can resume on w1 alone
    assert sched_state(h, low) == "running" and leases(h, w1) == {low: 0}


def test_a_rebuilt_session_takes_a_free_worker_for_its_lost_device_even_when_others_queue(h):
    w0, w1, w2 = workers(h, 3)
    a, b = h.open_session(), h.open_session()
    assert h.open_mesh(a, 1, [0, 1]).placed
    assert not h.open_mesh(b, 1, [0, 1]).placed  # only w2 is free: b waits
    h.handle(ev.WorkerUnreachable(w1))  # a is rebuilt: its device 1 goes to w2, not squeezed onto w0
    assert h.core.sessions[a].devices == {0: w0, 1: w2}
    assert sched_state(h, b) == "waiting"


def test_status_shows_schedule_queue_and_leases(h):
    h.register("10.0.0.0:7000", labels={"node": "rack1"})
    a, b = h.open_session(priority="high"), h.open_session(priority="low")
    assert h.open_mesh(a, 1, [0]).placed and not h.open_mesh(b, 1, [0]).placed
    st = h.status()
    assert st.policy == "priority (preempt=on, pack=on)" and st.queued == 1
    sessions = {s.session: s for s in st.sessions}
    assert (sessions[a].schedule, sessions[a].queue_position, sessions[a].priority) == ("running", 0, "high")
    assert (sessions[b].schedule, sessions[b].queue_position, sessions[b].kind) == ("waiting", 1, "batch")
    assert st.workers[0].node == "rack1" and st.workers[0].leases == {a: 0}


def test_tenant_table_is_closed_under_its_events():
    for state, moves in TENANT_TABLE.items():
        assert set(moves.values()) <= set(TENANT_TABLE), state
    from dtorch_controller.core.scheduler import Scheduler, Tenant

    sched = Scheduler(FifoPolicy(), {})
    t = Tenant("s", "normal", "batch", 0)
    with pytest.raises(IllegalTenantTransition) as e:
        sched._step(t, "resume")
    assert str(e.value) == "session s: no transition from 'idle' on 'resume'"


# ---------------------------------------------------------------- elastic growth and moves


def test_a_scheduler_whose_owner_cannot_move_devices_never_grows_a_session():
    """Rule 5: growth moves logical devices, so it waits for the owner (the core) to say it can (`growth`)."""
    from dtorch_controller.core.model import Worker
    from dtorch_controller.core.scheduler import Scheduler

    workers = {}
    sched = Scheduler(FifoPolicy(), workers)

    def add(wid):
        workers[wid] = Worker(wid, f"{wid}:1", "cpu", 1 << 30, {}, len(workers), 0.0)
        return sched.add_worker(0.0, workers[wid])

    add("w0")
    sched.open("s", "normal", "batch")
    changes, answer = sched.place(0.0, "s", 1, (0, 1), min_devices=1)
    assert answer.placed and changes.placed == [("s", {0: "w0", 1: "w0"})]
    assert add("w1").grown == [] and sched.pool.is_free("w1")
    sched.growth = True
    assert sched.tick(1.0).grown == [("s", ["w1"])]


def test_an_elastic_session_grows_onto_a_worker_that_joins_when_moves_are_possible(h):
    h.core.sched.growth = True
    w0 = h.register("10.0.0.0:7000")
    a = h.open_session()
    assert h.open_mesh(a, 1, [0, 1, 2, 3], min_devices=1).placed  # 4 logical devices on one worker
    fixed = h.open_session()
    w1 = h.register("10.0.0.1:7000")
    assert leases(h, w1) == {a: 0}  # a grows (nobody waits)
    assert any("grows onto 1 more device (2 for 4 logical)" in line for line in h.core.log.lines())
    assert not h.open_mesh(fixed, 1, [0]).placed  # now someone waits: no more growth
    w2 = h.register("10.0.0.2:7000")
    assert leases(h, w2) == {fixed: 0}
    h.core.sched.shrink(h.now, a, [w1])  # the core could not use it: given back, not offered again
    assert h.core.sched.pool.is_free(w1)
    h.register("10.0.0.3:7000")
    assert len(h.core.sched.tenants[a].workers) == 1 and leases(h, w0) == {a: 0}


def test_moves_swap_leases_and_free_the_source(h):
    w0, w1 = workers(h, 2)
    a, b = h.open_session(), h.open_session()
    assert h.open_mesh(a, 1, [0]).placed
    assert not h.open_mesh(b, 1, [0, 1]).placed
    h.core.sched.moved(h.now, a, w0, w1, src_empty=False)
    assert leases(h, w0) == {a: 0} and leases(h, w1) == {a: 0}
    h.core.sched.moved(h.now, a, w0, w1, src_empty=True)  # nothing of a left on w0: it goes back to the pool
    assert leases(h, w0) == {} and h.core.sched.pool.is_free(w0)


def test_growth_plan_takes_from_the_most_loaded_worker():
    assert elastic.grow({0: "a", 1: "a", 2: "a", 3: "a"}, ["b"]) == ([("a", "b", [2, 3])], [])
    assert elastic.grow({0: "a", 1: "a", 2: "b", 3: "b", 4: "a", 5: "b"}, ["c"]) == (
        [("b", "c", [5]), ("a", "c", [4])], [])
    assert elastic.grow({0: "a"}, ["b"]) == ([], ["b"])  # one logical device: nothing to spread, b goes back


def test_relocation_plan_moves_every_device_of_a_lost_worker_to_its_substitute():
    assert elastic.relocate({0: "a", 1: "a", 2: "b"}, {"a": "x", "c": "y"}) == ([("a", "x", [0, 1])], ["y"])


def test_shrink_plan_moves_each_device_given_up_to_the_least_loaded_kept_worker():
    order = {"a": 0, "b": 1, "c": 2, "d": 3}.__getitem__
    # c and d are given up; a and b host one device each: c's go to a then b, d's to a then b (ties: order)
    assert elastic.shrink({0: "a", 1: "b", 2: "c", 3: "c", 4: "d", 5: "d"}, {"c", "d"}, order) == [
        ("c", "a", [2]), ("c", "b", [3]), ("d", "a", [4]), ("d", "b", [5])]
    assert elastic.shrink({0: "a", 1: "a", 2: "b"}, {"b"}, order) == [("b", "a", [2])]
    assert elastic.shrink({0: "a"}, {"a"}, order) == []  # nothing kept: nowhere to move (the scheduler keeps one)


def test_a_growing_session_moves_devices_through_the_mover_and_swaps_leases(h):
    w0 = h.register("10.0.0.0:7000")
    a = h.open_session()
    assert h.open_mesh(a, 1, [0, 1], min_devices=1).placed
    h.submit(a, 1, [create(1)])
    h.report_all()
    h.take_sent()
    w1 = h.register("10.0.0.1:7000")  # a grows: logical device 1 moves to w1
    sent = h.take_sent()
    assert [(x.worker_id, type(x.execute.cmds[0]).__name__) for x in sent] == [(w0, "CmdSendShards")]
    assert leases(h, w1) == {a: 0}
    h.report_all()  # the copy is done: device 1 is rebound to w1
    assert h.core.sessions[a].devices == {0: w0, 1: w1}
    assert any("grows: logical [1] w0 -> w1" in line for line in h.core.log.lines())
    assert any("moved w0 -> w1" in line for line in h.core.log.lines())


def test_a_session_asking_for_a_second_mesh_while_its_first_waits_is_told_so(h):
    workers(h, 1)
    first = h.open_session()
    assert h.open_mesh(first, 1, [0]).placed
    sid = h.open_session()
    assert not h.open_mesh(sid, 1, [0]).placed
    reply = h.open_mesh(sid, 2, [0])
    assert not reply.placed and reply.queue_position == 1 and reply.message == "waiting for mesh 1 to be placed first"


def test_decisions_count_placements_queueings_freezes_and_resumes(h):
    workers(h, 1)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0]).placed  # 1: placed
    other = h.open_session(priority="low")
    before_queueing = h.core.view.decisions
    assert not h.open_mesh(other, 1, [0]).placed  # 2: queued
    assert h.core.view.decisions == before_queueing + 1  # one decision: its queueing
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed  # 3: queued, 4: freezes low, 5: placed
    before = h.core.view.decisions
    close(h, high)  # low resumes (its own device back), the other still waits
    assert sched_state(h, low) == "running" and h.core.view.decisions == before + 1
    assert h.open_mesh(low, 2, [1]).placed  # a running session's later mesh: placed at once
    assert h.core.view.decisions == before + 2


def test_a_packed_request_behind_a_blocked_one_takes_only_room_on_shared_devices(h):
    """scheduler.py rule 4: behind a blocked request, packed requests may use the room left on shared devices, never
    a free device (the blocked one may need it)."""
    w0 = h.register("10.0.0.0:7000", memory=1000)
    w1 = h.register("10.0.0.1:7000", memory=1000)
    packed = h.open_session(memory_cap=750)
    assert h.open_mesh(packed, 1, [0]).placed and leases(h, w0) == {packed: 750}  # 250 left on w0
    blocked = h.open_session()
    assert not h.open_mesh(blocked, 1, [0, 1]).placed  # needs w0 and w1 to itself
    small, large = h.open_session(memory_cap=200), h.open_session(memory_cap=500)
    assert h.open_mesh(small, 1, [0]).placed and leases(h, w0) == {packed: 750, small: 200}
    assert not h.open_mesh(large, 1, [0]).placed  # does not fit w0's room; w1 is free but not its to take
    assert leases(h, w1) == {}


def test_a_packed_sessions_later_mesh_leases_free_devices_with_its_cap(h):
    w0 = h.register("10.0.0.0:7000", memory=1000)
    w1 = h.register("10.0.0.1:7000", memory=1000)
    s = h.open_session(memory_cap=400)
    assert h.open_mesh(s, 1, [0]).placed
    assert h.open_mesh(s, 2, [1]).placed  # nobody waits: the new logical device takes a free device
    assert leases(h, w0) == {s: 400} and leases(h, w1) == {s: 400}
    other = h.open_session(memory_cap=600)
    assert h.open_mesh(other, 1, [0]).placed and leases(h, w0) == {s: 400, other: 600}  # 1000: fits exactly


@pytest.mark.parametrize("ahead, high_seq", [(0, 4), (1, 2)])
def test_a_dispatch_window_lets_a_preemptor_run_after_k_batches_of_its_victim_not_all_it_sent(make_harness, ahead,
                                                                                             high_seq):
    """Pipeline rule 7: a frozen session's batches already sent still run; with `dispatch_ahead` 1 only one was
    sent, so the preemptor's first batch runs right after it (without a window: after all three). The victim's
    others go out, in order, when it resumes."""
    h = make_harness(policy=PriorityPolicy({"relocate": False}), dispatch_ahead=ahead, snapshot_every_batches=0,
                     **QUIET)
    (w0,) = workers(h, 1)
    low, high = h.open_session("low", priority="low"), h.open_session("high", priority="high")
    assert h.open_mesh(low, 1, [0]).placed
    h.submit(low, 1, [create(1)])
    h.submit(low, 2, [m.InstrDelete(tids=[1])])
    h.submit(low, 3, [create(2)])
    assert h.open_mesh(high, 1, [0]).placed and sched_state(h, low) == "frozen"
    h.submit(high, 1, [create(1)])
    sent = [(x.execute.session, x.execute.seq) for x in h.take_sent()]
    assert sent[-1] == (high, high_seq) and [q for s, q in sent if s == low] == list(range(1, high_seq))
    close(h, high)
    h.report_all()
    assert sched_state(h, low) == "running"
    for _ in range(3):
        h.report_all()
    assert [x.execute.session for x in h.take_sent()].count(low) == 3 - (high_seq - 1)  # the rest, after the resume


def test_a_drain_that_moves_a_frozen_sessions_devices_keeps_every_device_exclusive(make_harness):
    """A drain moves every session's devices, frozen ones' too. The scheduler ignored the move of a frozen one: it
    leased nothing for it, the session later ran on the drain's target with no lease there, and a new session was
    given that device exclusively while the frozen one was bound and running on it."""
    h = make_harness(policy=PriorityPolicy({"relocate_after": 1000}), heartbeat_interval_s=1e5,
                     heartbeat_timeout_s=1e6, session_timeout_s=0)
    (w0,) = workers(h, 1)
    low = h.open_session()
    assert h.open_mesh(low, 1, [0]).placed
    h.submit(low, 1, [create(1)])
    h.report_all()
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed and sched_state(h, low) == "frozen"
    workers(h, 2, start=1)
    rid, _ = h.ask(ev.Drain, m.DrainRequest(worker=w0, timeout_s=50))
    for _ in range(6):
        h.report_all()
    assert h.replies[rid].ok
    newcomer = h.open_session()
    h.open_mesh(newcomer, 1, [0])
    for sid, s in h.core.sessions.items():  # a running session holds a lease on every device it is bound to
        if sched_state(h, sid) == "running":
            assert all(sid in leases(h, w) for w in s.devices.values()), (sid, s.devices)
    bound = [w for s in h.core.sessions.values() for w in set(s.devices.values())]
    assert sched_state(h, low) == "running" and len(bound) == len(set(bound)), bound  # no device shared
