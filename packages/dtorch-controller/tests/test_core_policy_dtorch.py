"""The DTorch policy (policies/dtorch.py), through the core on a fake clock: one test per rule."""

from __future__ import annotations

import pytest

from dtorch_controller.core import ControllerCore
from dtorch_controller.core import events as ev
from dtorch_controller.core.policies import DEFAULT_POLICY, DTorchPolicy, PolicyError
from dtorch_protocol import messages as m

QUIET = dict(heartbeat_interval_s=1e5, heartbeat_timeout_s=1e6, session_timeout_s=0)


def harness(make_harness, **params):
    return make_harness(policy=DTorchPolicy({"fairness": 0, **params}), **QUIET)


def workers(h, n):
    return [h.register(f"10.0.0.{i}:7000") for i in range(n)]


def state(h, sid):
    return h.core.sched.state(sid)


def step(h, sid, n=1):
    """`sid` reaches `n` sync points: a batch each (it creates a tensor), and a Sync."""
    t = h.core.sched.tenants[sid]
    for _ in range(n):
        seq = h.core.sessions[sid].seq + 1
        h.submit(sid, seq, [m.InstrCreate(tid=seq, spec=m.TensorSpec(shape=[4], dtype="float32", mesh=1,
                                                                      placements=["R"]), init="zeros")])
        before = t.steps
        h.sync(sid, seq)
        h.sync(sid, seq)  # the same sync point again (a client waiting): not a step
        assert t.steps == before + 1


def test_it_is_the_default_policy():
    assert DEFAULT_POLICY == "dtorch" and ControllerCore().policy.name == "dtorch"


def test_least_attained_service_within_a_class_and_strict_classes_above_it(make_harness):
    h = harness(make_harness, thresholds=[10])
    workers(h, 1)
    old = h.open_session()
    assert h.open_mesh(old, 1, [0]).placed
    h.advance(11)  # 11 device-s: level 1
    new = h.open_session()
    assert h.open_mesh(new, 1, [0]).placed and state(h, old) == "frozen"  # less attained: preempts
    h.advance(20)  # new is at level 1 too: no preemption either way
    assert state(h, new) == "running" and state(h, old) == "frozen"
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed and state(h, new) == "frozen"
    h.advance(1000)  # the high session has attained far more than anyone: classes stay strict
    low = h.open_session(priority="normal")
    assert not h.open_mesh(low, 1, [0]).placed and state(h, high) == "running"


def test_declared_steps_rank_by_remaining_work(make_harness):
    # long: 100 steps declared, 10 done in 10 s -> 90 device-s left (level 1). short: 2 of 3 steps done in 4 s
    # (2 device-s each) -> 2 device-s left (level 0). Least attained would favour neither; remaining work does.
    h = harness(make_harness, thresholds=[10])
    workers(h, 1)
    long = h.open_session(expected_steps=100)
    assert h.open_mesh(long, 1, [0]).placed
    for _ in range(10):
        h.advance(1)
        step(h, long)
    assert h.core.sched.tenants[long].rank == 1 * 3 + 1 + 1  # class normal, level 1 (slot 1 + level)
    short = h.open_session(expected_steps=3)
    assert h.open_mesh(short, 1, [0]).placed and state(h, long) == "frozen"  # a newcomer (0 attained) preempts
    for _ in range(2):
        h.advance(2)
        step(h, short)
    assert h.core.sched.tenants[short].rank == 1 * 3 + 1 + 0  # 2 device-s left: level 0, although it attained 4
    h.advance(100)  # its attained service (104 device-s) would make least attained service demote it: it stays
    assert state(h, short) == "running" and state(h, long) == "frozen"


def test_an_estimate_above_the_attained_service_does_not_demote_the_session(make_harness):
    # 1 of 1,000 declared steps done in 5 s: 4,995 device-s left, but 5 attained. Least attained service keeps it at
    # level 0 of [10] (ranked by the estimate it would be at level 1, and a newcomer would freeze it at once), until
    # its attained service crosses 10 device-s by the clock (a wake-up at t + 5 s, not at its next step).
    h = harness(make_harness, thresholds=[10])
    workers(h, 1)
    long = h.open_session(expected_steps=1000)
    assert h.open_mesh(long, 1, [0]).placed
    h.advance(5)
    step(h, long)
    assert h.core.sched.tenants[long].rank == 3 + 1 + 0
    new = h.open_session()
    assert not h.open_mesh(new, 1, [0]).placed and state(h, long) == "running"
    h.advance(6)  # 11 device-s attained, still 4,995 estimated: level 1, and the waiting newcomer preempts it
    assert state(h, long) == "frozen" and state(h, new) == "running"


def test_a_session_past_its_declared_steps_falls_back_to_attained_service(make_harness):
    h = harness(make_harness, thresholds=[10])
    workers(h, 1)
    liar = h.open_session(expected_steps=2)
    assert h.open_mesh(liar, 1, [0]).placed
    h.advance(1)
    step(h, liar)  # 1 of 2 done in 1 device-s: 1 device-s left, level 0
    h.advance(30)
    assert h.core.sched.tenants[liar].rank == 3 + 1 + 0  # level 0 by its estimate, after 31 device-s
    step(h, liar, 2)  # 3 steps of the 2 it declared: the estimate is not trusted, 31 device-s attained
    assert h.core.sched.tenants[liar].rank == 3 + 1 + 1
    new = h.open_session()
    assert h.open_mesh(new, 1, [0]).placed and state(h, liar) == "frozen"


def test_a_session_frozen_fairness_times_its_running_time_is_shielded_until_it_ran_that_long(make_harness):
    # old runs 40 s (level 1 of [10]), is frozen by `new` for 100 s; when it resumes it has been frozen 100 s for
    # 40 s of running: with fairness 1 it keeps level 0 until it has run 100 s (60 s more), so a newcomer cannot
    # freeze it again before; then it is demoted and the waiting newcomer preempts it. Fairness 0: at once.
    for fairness, shield_s in ((1, 60), (0, 0)):
        h = make_harness(policy=DTorchPolicy({"thresholds": [10], "fairness": fairness}), **QUIET)
        workers(h, 1)
        old = h.open_session()
        assert h.open_mesh(old, 1, [0]).placed
        h.advance(40)
        new = h.open_session()
        assert h.open_mesh(new, 1, [0]).placed and state(h, old) == "frozen"
        h.advance(100)
        h.call(ev.CloseSession, m.CloseSession(session=new))
        assert state(h, old) == "running"
        late = h.open_session()
        placed = h.open_mesh(late, 1, [0]).placed
        if not shield_s:
            assert placed and state(h, old) == "frozen"
            continue
        assert not placed and state(h, old) == "running"  # shielded: the newcomer waits
        assert h.core.sched.tenants[old].rank == 1 * 3 + 0  # class normal, slot 0 (shielded)
        h.advance(shield_s - 1)
        assert state(h, old) == "running" and state(h, late) == "waiting"
        h.advance(2)  # it ran as long as it waited: level 1 again, the newcomer (level 0) preempts it
        assert state(h, late) == "running" and state(h, old) == "frozen"


def test_time_spent_queued_does_not_shield(make_harness):
    # the shield is for sessions preempted again and again, not for every session that queued: a session that
    # queued 100 s and then ran 40 s is frozen by a newcomer as under least attained service (shielded sessions
    # that only queued would hold level 0 and block the level-0 queue behind a wide request: ITP cluster02)
    h = make_harness(policy=DTorchPolicy({"thresholds": [10], "fairness": 1}), **QUIET)
    workers(h, 1)
    first = h.open_session(priority="high")
    assert h.open_mesh(first, 1, [0]).placed
    queued = h.open_session()
    assert not h.open_mesh(queued, 1, [0]).placed  # a higher class holds the device
    h.advance(100)
    h.call(ev.CloseSession, m.CloseSession(session=first))
    assert state(h, queued) == "running" and h.core.sched.tenants[queued].waited == pytest.approx(100, abs=0.01)
    h.advance(40)
    late = h.open_session()
    assert h.open_mesh(late, 1, [0]).placed and state(h, queued) == "frozen"


def test_frozen_sessions_lend_the_devices_they_wait_for(make_harness):
    # a (2 devices) is frozen by a newcomer that takes one of them; the other comes free and is not kept idle
    # for a: a third session, of a lower class, uses it; a gets both back when they free (its own, no move)
    h = harness(make_harness, thresholds=[10])
    w0, w1 = workers(h, 2)
    a = h.open_session()
    assert h.open_mesh(a, 1, [0, 1]).placed
    h.advance(20)  # 40 device-s: level 1
    b = h.open_session()
    assert h.open_mesh(b, 1, [0]).placed and state(h, a) == "frozen"
    c = h.open_session(priority="low")
    assert h.open_mesh(c, 1, [0]).placed  # the device a waits for serves c meanwhile
    assert not h.core.sched.reserved(w0) and not h.core.sched.reserved(w1)
    h.call(ev.CloseSession, m.CloseSession(session=b))
    h.call(ev.CloseSession, m.CloseSession(session=c))
    assert state(h, a) == "running" and sorted(h.core.sched.tenants[a].workers) == [w0, w1]
    assert h.core.sched.relocations == 0
    h2 = harness(make_harness, thresholds=[10], lend=False)  # without lending: the device is reserved for a
    workers(h2, 2)
    a = h2.open_session()
    assert h2.open_mesh(a, 1, [0, 1]).placed
    h2.advance(20)
    assert h2.open_mesh(h2.open_session(), 1, [0]).placed and state(h2, a) == "frozen"
    assert not h2.open_mesh(h2.open_session(priority="low"), 1, [0]).placed


def test_a_lending_session_takes_its_own_devices_back_without_relocation(make_harness):
    # relocate=false: no substitutes, but a frozen session that lends gets its own devices back once they are all
    # free again (no move); it waited for ever before (66 of the 600 jobs of the ITP cluster04 subset never ended)
    h = harness(make_harness, thresholds=[10], relocate=False)
    w0, w1 = workers(h, 2)
    a = h.open_session()
    assert h.open_mesh(a, 1, [0, 1]).placed
    h.advance(20)
    b = h.open_session()
    assert h.open_mesh(b, 1, [0]).placed and state(h, a) == "frozen"
    h.call(ev.CloseSession, m.CloseSession(session=b))
    assert state(h, a) == "running" and sorted(h.core.sched.tenants[a].workers) == [w0, w1]
    assert h.core.sched.relocations == 0


def test_parameters_are_checked():
    with pytest.raises(PolicyError, match="ascending"):
        DTorchPolicy({"thresholds": [5, 1]})
    with pytest.raises(PolicyError, match="'fairness' must be a finite number >= 0"):
        DTorchPolicy({"fairness": -1})
    with pytest.raises(PolicyError, match="'lend' must be true or false"):
        DTorchPolicy({"lend": "yes"})
    with pytest.raises(PolicyError, match="takes no parameter 'starve_factor'"):
        DTorchPolicy({"starve_factor": 1})


def test_a_negative_expected_steps_is_refused(h, refused):
    from dtorch_protocol.wire import hello

    reply = h.call(ev.OpenSession, m.OpenSession(hello=hello("client"), expected_steps=-1))
    assert refused(reply) and "bad expected_steps -1: expected a count >= 0" in reply.message


# ---------------------------------------------------------------- packing (pool.py rule 7, scheduler.py rule 4)


def test_packing_strands_the_least_room_for_the_requests_seen():
    from dtorch_controller.core.pool import Pool

    def pool():
        p = Pool()
        for i in range(3):
            p.add(f"w{i}", f"n{i}", 1000, i)
        p.lease("w0", "s0", 550)  # 450 left
        p.lease("w1", "s1", 200)  # 800 left
        return p

    assert pool().pick_packed(1, 400) == ["w0"]  # no history: best fit, although it leaves 50 that nothing uses
    p = pool()
    for _ in range(10):
        p.saw(400)  # requests of 400 are what comes: 800 -> 400 leaves room one can use, 450 -> 50 does not
    assert p.pick_packed(1, 400) == ["w1"]
    assert p.pick_packed(2, 400) == ["w1", "w0"]
    p.saw(0, 50)  # now mostly whole devices are asked for: the free device is kept whole while others have room
    assert sorted(p.pick_packed(2, 400)) == ["w0", "w1"] and p.pick_packed(3, 400)[2] == "w2"


def test_packed_requests_fill_the_room_a_blocked_request_cannot_use(make_harness):
    # w0 is half leased; a whole-device request is blocked (no free device); a packed request behind it fits
    # in w0's room: it goes ahead (it takes nothing the blocked one could use), a second one does not fit
    h = make_harness(policy=DTorchPolicy({"fairness": 0}), **QUIET)
    w0 = h.register("10.0.0.0:7000", memory=1000)
    half = h.open_session(memory_cap=500)
    assert h.open_mesh(half, 1, [0]).placed
    whole = h.open_session()
    assert not h.open_mesh(whole, 1, [0]).placed
    small, big = h.open_session(memory_cap=400), h.open_session(memory_cap=600)
    assert h.open_mesh(small, 1, [0]).placed and h.core.sched.tenants[small].workers == {w0: None}
    assert not h.open_mesh(big, 1, [0]).placed
    assert h.core.sched.state(whole) == "waiting" and h.core.sched.position(whole) == 1


def test_fgd_false_keeps_no_demand_history_so_packing_is_plain_best_fit(make_harness):
    # the baseline of packing studies (openb in docs/simulation.md): pool.py rule 7 with no history is best fit
    for fgd in (True, False):
        h = make_harness(policy=DTorchPolicy({"fairness": 0, "fgd": fgd}), **QUIET)
        h.register("10.0.0.0:7000", memory=1000)
        assert h.open_mesh(h.open_session(memory_cap=400), 1, [0]).placed
        assert bool(h.core.sched.pool._demand) is fgd


# ---------------------------------------------------------------- elastic shrink (scheduler.py rule 10)


def test_an_elastic_session_is_shrunk_instead_of_frozen_and_grows_back(make_harness):
    h = harness(make_harness, thresholds=[10])
    w = workers(h, 4)
    e = h.open_session(priority="low")
    assert h.open_mesh(e, 1, [0, 1, 2, 3], min_devices=2).placed
    assert sorted(h.core.sessions[e].devices.values()) == sorted(w)
    h.submit(e, 1, [m.InstrCreate(tid=1, spec=m.TensorSpec(shape=[8], dtype="float32", mesh=1, placements=["S0"]),
                                  init="zeros")])
    h.report_all()
    h.take_sent()
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0, 1]).placed
    assert state(h, e) == "running"  # not frozen: it gave up two devices
    t = h.core.sched.tenants[e]
    given = sorted(set(w) - set(t.workers))
    assert len(t.workers) == 2 and sorted(h.core.sched.tenants[high].workers) == given
    assert any("shrinks to 2 devices (4 logical)" in line for line in h.core.log.lines())
    fetches = [x for x in h.take_sent() if isinstance(x.execute.cmds[0], m.CmdFetchShards)]
    # each device given up is pulled by a kept worker; the pulls of one shrink go out at once (moves.py rule 3)
    assert len(fetches) == 2 and all(f.worker_id in t.workers and f.execute.cmds[0].move for f in fetches)
    for _ in range(4):
        h.report_all()
    assert sorted(set(h.core.sessions[e].devices.values())) == sorted(t.workers)  # 4 logical on 2 workers
    rid, _ = h.sync(e, 1)
    assert h.replies[rid].done
    h.call(ev.CloseSession, m.CloseSession(session=high))  # devices free, nobody waits: it grows back
    for _ in range(4):
        h.report_all()
    assert len(h.core.sched.tenants[e].workers) == 4
    assert len(set(h.core.sessions[e].devices.values())) == 4


def test_a_shrunk_sessions_syncs_do_not_wait_for_the_cleanup_on_the_workers_it_gave_up(make_harness):
    # the copies a move leaves behind are dropped on the worker given up, after the preemptor's work queued there:
    # the shrunk session's Syncs wait for its own workers only (they waited for that drop: devices idle a step)
    h = harness(make_harness, thresholds=[10])
    workers(h, 4)
    e = h.open_session(priority="low")
    assert h.open_mesh(e, 1, [0, 1, 2, 3], min_devices=2).placed
    spec = m.TensorSpec(shape=[8], dtype="float32", mesh=1, placements=["S0"])
    h.submit(e, 1, [m.InstrCreate(tid=1, spec=spec, init="zeros")])
    h.report_all()
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0, 1]).placed
    given = sorted(h.core.sched.tenants[high].workers)
    h.submit(high, 1, [m.InstrCreate(tid=1, spec=spec, init="zeros")])  # queued on the given workers, not done
    stuck = given[0]  # the first device given up: its move is a pull, its drop is queued behind high's batch
    upto = h.core.workers[stuck].sent - 1  # e's own work there is done, high's is not
    for _ in range(6):  # the moves: every worker reports, `stuck` stays busy with high's batch
        for wid in list(h.core.workers):
            h.report(wid, completed=upto if wid == stuck else None)
    kept = h.core.sched.tenants[e].workers
    assert sorted(set(h.core.sessions[e].devices.values())) == sorted(kept)
    assert h.core.workers[stuck].sent > upto + 1  # the drop went out, behind high's batch
    h.submit(e, 2, [m.InstrCreate(tid=2, spec=spec, init="zeros")])
    rid, _ = h.sync(e, 2)
    for wid in kept:
        h.report(wid)
    assert rid in h.replies and h.replies[rid].done

