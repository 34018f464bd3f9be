"""scheduler.py's rules through the core on a fake clock, for cases the rule-by-rule tests of
test_core_scheduling.py do not reach: each test here fails on a mutant that `nox -s mutation` found surviving
(checked by applying the mutant by hand) or on a bug found meanwhile, and asserts what the rule says, not what the
code happens to do."""

from __future__ import annotations

from dtorch_controller.core import events as ev
from dtorch_controller.core.policies import DTorchPolicy, PriorityPolicy
from dtorch_protocol import messages as m

QUIET = dict(heartbeat_interval_s=1e5, heartbeat_timeout_s=1e6, session_timeout_s=0)


def workers(h, n, start=0):
    return [h.register(f"10.0.0.{i}:7000") for i in range(start, start + n)]


def state(h, sid):
    return h.core.sched.state(sid)


def leased(h, sid):
    """The workers `sid` leases, sorted."""
    return sorted(w for w, slot in h.core.sched.pool.slots.items() if sid in slot.leases)


def lines(h, text):
    return [line for line in h.core.log.lines() if text in line]


# ---------------------------------------------------------------- rebuilds (rule 3: lost devices placed again)


def test_a_session_rebuilt_after_losing_every_device_counts_them_once_so_its_shield_ends_on_time(make_harness):
    """A session rebuilt after losing its only device asks again (running -> waiting -> running: rule 1) and is
    still 1 logical device wide. The DTorch shield (policies/dtorch.py rule 3) measures its running time as its
    service over its width: counted twice, the lost device made it look half as far along, and the shield
    outlived its frozen time."""
    h = make_harness(policy=DTorchPolicy({"thresholds": [10], "fairness": 1}), **QUIET)
    (w0,) = workers(h, 1)
    a = h.open_session()
    assert h.open_mesh(a, 1, [0]).placed
    h.advance(1)  # 1 device-s
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed and state(h, a) == "frozen"
    h.advance(20)
    assert h.call(ev.CloseSession, m.CloseSession(session=high)).ok
    assert state(h, a) == "running"  # frozen 20 s, ran 1 s: shielded until it ran 20 s, 19 s from now
    (w1,) = workers(h, 1, start=1)
    h.handle(ev.WorkerUnreachable(w0, "", "killed"))
    for _ in range(3):
        h.report_all()
    assert state(h, a) == "running" and leased(h, a) == [w1]
    assert h.core.sched.tenants[a].wanted_devices == 1
    h.advance(25)  # ran 26 s: unshielded since 19 s, at level 1 (26 device-s)
    newcomer = h.open_session()
    assert h.open_mesh(newcomer, 1, [0]).placed  # level 0 of the same class: it preempts a
    assert state(h, a) == "frozen"


def test_a_session_rebuilt_after_losing_one_device_counts_it_once_so_its_shield_ends_on_time(make_harness):
    """The same for a session of 2 devices that loses one: placed again onto a free device while it runs (rule 3),
    without asking again. (Each loss is its own event: losing the second device too is the same path again.)"""
    _rebuilt_shield_ends_on_time(make_harness, lost=1)


def _rebuilt_shield_ends_on_time(make_harness, lost):
    h = make_harness(policy=DTorchPolicy({"thresholds": [10], "fairness": 1}), **QUIET)
    w0, w1 = workers(h, 2)
    a = h.open_session()
    assert h.open_mesh(a, 1, [0, 1]).placed  # not elastic: only the shield reads its width
    h.advance(1)  # 2 device-s
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0, 1]).placed and state(h, a) == "frozen"
    h.advance(20)
    assert h.call(ev.CloseSession, m.CloseSession(session=high)).ok
    assert state(h, a) == "running"  # frozen 20 s, ran 1 s: shielded until it ran 20 s, 19 s from now
    workers(h, lost, start=2)  # as many as it loses: then nothing is free
    for w in (w0, w1)[:lost]:
        h.handle(ev.WorkerUnreachable(w, "", "killed"))
    for _ in range(3):
        h.report_all()
    assert state(h, a) == "running" and len(leased(h, a)) == 2
    assert set(leased(h, a)).isdisjoint((w0, w1)[:lost])
    assert h.core.sched.tenants[a].wanted_devices == 2
    h.advance(25)  # ran 26 s on 2 devices: unshielded since 19 s, at level 1 (54 device-s)
    newcomer = h.open_session()
    assert h.open_mesh(newcomer, 1, [0]).placed  # level 0 of the same class: it preempts a
    assert state(h, a) == "frozen"


# ---------------------------------------------------------------- preemption (rules 6 and 10)


def test_a_policy_that_does_not_shrink_freezes_an_elastic_session(h):
    """Rule 10 is the policy's choice (`shrinks`): under `priority` an elastic session above its minimum is
    frozen whole by a better class, not shrunk."""
    h.core.sched.relocation = False
    ws = workers(h, 3)
    e = h.open_session(priority="low")
    assert h.open_mesh(e, 1, [0, 1, 2], min_devices=1).placed and leased(h, e) == ws
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed
    assert state(h, e) == "frozen" and not lines(h, "shrinks to")


def test_a_session_that_did_not_ask_for_a_minimum_is_frozen_not_shrunk(make_harness):
    """Only elastic sessions (asked with a minimum below their size) are shrunk (rule 10): one that leases more
    devices than its first mesh because a later mesh took free devices (rule 3) is frozen whole."""
    h = make_harness(policy=DTorchPolicy({"fairness": 0}), **QUIET)
    workers(h, 4)
    a = h.open_session()
    assert h.open_mesh(a, 1, [0, 1]).placed and h.open_mesh(a, 2, [2, 3]).placed
    assert len(leased(h, a)) == 4
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed
    assert state(h, a) == "frozen" and not lines(h, "shrinks to")


def test_an_elastic_session_gives_up_only_what_the_frozen_sessions_of_worse_ranks_did_not_free(make_harness):
    """Preemption goes from the least important rank up (rule 6): a low session is frozen first (1 device);
    the request needs 3, so the elastic normal session gives up the 2 still missing, not 3 (rule 10)."""
    h = make_harness(policy=DTorchPolicy({"fairness": 0}), **QUIET)
    workers(h, 5)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0]).placed
    e = h.open_session()
    assert h.open_mesh(e, 1, [0, 1, 2, 3], min_devices=1).placed and len(leased(h, e)) == 4
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0, 1, 2]).placed
    assert state(h, low) == "frozen" and state(h, e) == "running"
    assert lines(h, "shrinks to 2 devices (4 logical)") and not lines(h, "shrinks to 1 device")
    assert len(leased(h, e)) == 2 and len(leased(h, high)) == 3


def test_a_frozen_session_does_not_relocate_while_a_better_ranked_request_is_blocked(make_harness):
    """Rule 6: frozen sessions take free devices in rank order and not while a request of a better rank is
    blocked, even when a request of a worse rank is blocked as well (the walk goes on past the first)."""
    h = make_harness(policy=PriorityPolicy({"relocate_after": 10}), **QUIET)
    (w0,) = workers(h, 1)
    normal = h.open_session()
    assert h.open_mesh(normal, 1, [0]).placed
    assert h.open_mesh(h.open_session(priority="high"), 1, [0]).placed and state(h, normal) == "frozen"
    w1, w2 = workers(h, 2, start=1)  # free, but the frozen session waits 10 s before it may move
    blocked_high, blocked_low = h.open_session(priority="high"), h.open_session(priority="low")
    assert not h.open_mesh(blocked_high, 1, [0, 1, 2]).placed  # 2 free of the 3 it needs; nobody to preempt
    assert not h.open_mesh(blocked_low, 1, [0, 1, 2]).placed
    h.advance(11)  # the frozen session's patience is over, but the high request still waits
    assert state(h, normal) == "frozen" and h.core.sched.pool.free_total == 2
    assert not lines(h, "relocates")


def test_a_running_session_ranked_down_at_its_step_is_preempted_by_a_waiting_request_at_once(make_harness):
    """Rule 9: a running session is ranked anew at each of its steps; one that falls below a waiting request's
    rank can be preempted by it (rule 6), then and there, not at whatever pass comes next. Its first step (1 s of 3
    declared) estimates 2 device-s left: level 0, where it stays while its estimate holds although it attains 100
    device-s; its second step, 99 s later, estimates 50 left (level 1): the newcomer queued at level 0 freezes it
    (backfill off: after 30 s the newcomer would move above the level and preempt it then)."""
    h = make_harness(policy=DTorchPolicy({"thresholds": [50], "fairness": 0, "backfill_after": 0}), **QUIET)
    workers(h, 1)
    a = h.open_session(expected_steps=3)
    assert h.open_mesh(a, 1, [0]).placed

    def step(tid: int) -> None:
        h.submit(a, tid, [m.InstrCreate(tid=tid, spec=m.TensorSpec(shape=[4], dtype="float32", mesh=1,
                                                                    placements=["R"]), init="zeros")])
        h.report_all()
        h.sync(a, tid)

    h.advance(1)
    step(1)
    b = h.open_session()
    assert not h.open_mesh(b, 1, [0]).placed  # both at level 0 of the same class: it waits
    h.advance(99)
    assert state(h, a) == "running"
    step(2)
    assert state(h, a) == "frozen" and state(h, b) == "running"


def test_a_better_ranked_request_takes_a_frozen_sessions_reservation_before_waiting(h):
    """Rule 6: a request may take devices reserved by frozen sessions of a worse rank (before freezing running
    work). Low is frozen by high and keeps a reservation on its other device; a normal request takes it."""
    w0, w1 = workers(h, 2)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0, 1]).placed
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed and state(h, low) == "frozen"
    (kept,) = {w0, w1} - set(leased(h, high))
    assert h.core.sched.reserved(kept) == [low]
    normal = h.open_session()
    assert h.open_mesh(normal, 1, [0]).placed and leased(h, normal) == [kept]
    assert state(h, low) == "frozen" and h.core.sched.reserved(kept) == []


def test_an_elastic_session_whose_devices_are_on_the_move_is_not_shrunk_again(make_harness):
    """Rules 6 and 10: a session with moves in flight is neither shrunk nor frozen until they are done (its moves
    go to devices it would give up). Shrunk to 2 of 4 devices, its pulls not yet done, a second preemptor waits."""
    h = make_harness(policy=DTorchPolicy({"fairness": 0}), **QUIET)
    workers(h, 4)
    e = h.open_session(priority="low")
    assert h.open_mesh(e, 1, [0, 1, 2, 3], min_devices=1).placed
    h.submit(e, 1, [m.InstrCreate(tid=1, spec=m.TensorSpec(shape=[8], dtype="float32", mesh=1, placements=["S0"]),
                                  init="zeros")])
    h.report_all()
    assert h.open_mesh(h.open_session(priority="high"), 1, [0, 1]).placed
    assert lines(h, "shrinks to 2 devices (4 logical)") and h.core.moves.busy(e)
    second = h.open_session(priority="high")
    assert not h.open_mesh(second, 1, [0]).placed
    assert len(leased(h, e)) == 2 and not lines(h, "shrinks to 1 device") and state(h, e) == "running"


def test_a_frozen_packed_session_takes_back_its_own_device_when_room_for_its_cap_frees_there(make_harness):
    """Rule 6 with a lending policy: a frozen session takes back its own devices that it fits on (no move). For a
    packed session that is room for its cap on its device, although another packed session still leases it."""
    h = make_harness(policy=DTorchPolicy({"fairness": 0}), **QUIET)
    w0 = h.register("10.0.0.0:7000", memory=1000)
    p = h.open_session(memory_cap=300)
    assert h.open_mesh(p, 1, [0]).placed
    q = h.open_session(priority="high", memory_cap=800)
    assert h.open_mesh(q, 1, [0]).placed and state(h, p) == "frozen"  # 300 + 800 do not fit in 1000
    r = h.open_session(priority="high", memory_cap=100)
    assert h.open_mesh(r, 1, [0]).placed  # 100 of the 200 left
    assert h.call(ev.CloseSession, m.CloseSession(session=q)).ok  # 900 free on w0, which still carries r
    assert state(h, p) == "running" and h.core.sched.pool.slots[w0].leases == {r: 100, p: 300}
    assert not lines(h, "relocates")


# ---------------------------------------------------------------- growth (rule 5)


def test_a_packed_elastic_session_grows_onto_another_device_not_onto_room_left_on_its_own(h):
    """Rule 5: growing means more physical devices. A packed session's own device still has room for its cap;
    growth must not lease it a second time."""
    w0 = h.register("10.0.0.0:7000", memory=1000)
    e = h.open_session(memory_cap=300)
    assert h.open_mesh(e, 1, [0, 1], min_devices=1).placed and leased(h, e) == [w0]
    w1 = h.register("10.0.0.1:7000", memory=1000)
    assert leased(h, e) == [w0, w1]
    assert lines(h, "grows onto 1 more device (2 for 2 logical)")


def test_growths_given_back_one_after_the_other_both_return_to_the_pool():
    """The scheduler is sans-IO: its owner may apply two growths after both were decided. Both unusable, both
    are given back (`shrink`); the second finds the session no longer growing and must not fail."""
    from dtorch_controller.core.model import Worker
    from dtorch_controller.core.policies import FifoPolicy
    from dtorch_controller.core.scheduler import Scheduler

    table = {}
    sched = Scheduler(FifoPolicy(), table)
    sched.growth = True

    def add(wid):
        table[wid] = Worker(wid, f"{wid}:1", "cpu", 1 << 30, {}, len(table), 0.0)
        return sched.add_worker(0.0, table[wid])

    add("w0")
    sched.open("s", "normal", "batch")
    assert sched.place(0.0, "s", 1, (0, 1, 2), min_devices=1)[1].placed
    assert add("w1").grown == [("s", ["w1"])] and add("w2").grown == [("s", ["w2"])]
    sched.shrink(1.0, "s", ["w1"])
    sched.shrink(1.0, "s", ["w2"])
    assert sched.pool.is_free("w1") and sched.pool.is_free("w2")
    assert add("w3").grown == []  # not offered more


# ---------------------------------------------------------------- memory caps


def test_a_session_back_within_its_cap_is_told_again_when_it_goes_over_again(h):
    """`over_cap`: a tenant is told once per excursion over its cap; using exactly its cap is within it."""
    w0 = h.register("10.0.0.0:7000", memory=1000)
    s = h.open_session(memory_cap=100)
    assert h.open_mesh(s, 1, [0]).placed
    for used in (100, 150, 160, 100, 150):
        h.report(w0, sessions={s: m.ShardStats(tensors=1, bytes=used)})
    _, reply = h.sync(s, 0)
    assert [e.op for e in reply.errors] == ["memory cap", "memory cap"]
    assert all(e.message.startswith(f"session holds 150 bytes on worker {w0}") for e in reply.errors)  # not at 100


def test_reserved_names_the_frozen_sessions_holding_a_reservation_on_a_device(h):
    """Rule 6 (a policy that does not lend): the device the preemptor did not take is leased back to the frozen
    session as a reservation; `reserved` names it there, and nobody on the preemptor's device."""
    w0, w1 = workers(h, 2)
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0, 1]).placed
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed and state(h, low) == "frozen"
    (taken,) = leased(h, high)
    (kept,) = {w0, w1} - {taken}
    assert h.core.sched.reserved(kept) == [low] and h.core.sched.reserved(taken) == []


# ---------------------------------------------------------------- the frozen tenants' indexes (pass cost)


def _check_indexes(sched):
    """The indexes a pass reads instead of walking every frozen tenant agree with the tenants themselves."""
    frozen = [t for t in sched.tenants.values() if t.state == "frozen"]
    by_missing = {}
    for t in frozen:
        if t.missing:
            by_missing.setdefault(len(t.missing), set()).add(t.session)
    assert {n: set(b) for n, b in sched._missing_n.items()} == by_missing
    completes = {}  # each worker: the frozen tenants that miss it alone (a lending policy offers it to those only)
    for t in frozen:
        if len(t.missing) == 1:
            completes.setdefault(next(iter(t.missing)), set()).add(t.session)
    assert {w: set(b) for w, b in sched._completes.items()} == completes
    wanted = {}  # each worker: the frozen tenants that miss it, by rank (a re-ranked holder looks at better ones only)
    for t in frozen:
        for w in t.missing:
            wanted.setdefault(w, {}).setdefault(t.rank, set()).add(t.session)
    assert {w: {r: set(b) for r, b in ranks.items()} for w, ranks in sched._wanted_at.items()} == wanted
    assert {w: set(b) for w, b in sched._wanted.items()} == {w: set().union(*r.values()) for w, r in wanted.items()}
    assert {t.session for t in frozen if len(t.missing) < len(t.workers)} <= sched._reserving
    assert sched._frozen_packed == sum(sched._packs(t) for t in frozen)
    for bucket in list(sched._frozen.values()) + list(sched._ranks.values()):  # bucket order is `bucketed` order
        stamps = [sched.tenants[s].bucketed for s in bucket]
        assert stamps == sorted(stamps)
    for upto in (None, *sched._frozen):  # relocation looks at the tenants the full walk would reach, in its order
        walk = [sched.tenants[s] for r in sorted(sched._frozen) if upto is None or r <= upto for s in sched._frozen[r]]
        if not sched._frozen_packed:
            walk = [t for t in walk if 0 < len(t.missing) <= sched.pool.free_total]
        assert [t.session for t in sched._relocatable(upto)] == [t.session for t in walk]


def test_the_frozen_tenants_indexes_follow_every_freeze_resume_loss_and_close(make_harness):
    """A pass reads indexes of the frozen tenants (by devices missing, the ones holding reservations, how many pack,
    the ones a device completes, the ones wanting each device by rank) instead of walking all of them, hundreds under
    LAS. Through a churn of preemptions
    (wide and packed sessions, three classes), relocations, worker losses and closes, under the DTorch policy
    (which lends) and a policy that keeps reservations, they agree with the tenants after every event."""
    import random

    for policy in (DTorchPolicy({"thresholds": [5, 50]}), PriorityPolicy({"relocate_after": 30})):
        rng = random.Random(7)
        h = make_harness(policy=policy, **QUIET)
        ws = workers(h, 12)
        sessions: list[str] = []
        for i in range(160):
            r = rng.random()
            if r < 0.45 or len(sessions) < 3:
                sid = h.open_session(priority=rng.choice(["high", "normal", "normal", "low"]),
                                     memory_cap=rng.choice([0, 0, 0, 1 << 28]))
                sessions.append(sid)
                n = rng.choice([1, 1, 2, 3, 4, 6])
                h.open_mesh(sid, 1, list(range(n)))
            elif r < 0.7:
                sid = sessions.pop(rng.randrange(len(sessions)))
                assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
            elif r < 0.75 and len(ws) > 6:
                h.handle(ev.WorkerUnreachable(ws.pop(rng.randrange(len(ws))), "", "killed"))
            elif r < 0.8:
                ws += workers(h, 1, start=100 + i)
            else:
                h.advance(rng.choice([1, 10, 40]))
            h.report_all()
            _check_indexes(h.core.sched)
        assert h.core.sched.decisions > 100 and any(lines(h, "frozen on"))


def test_a_re_ranked_holder_is_reclaimed_from_as_if_every_frozen_tenant_wanting_its_devices_looked(
        make_harness, monkeypatch):
    """A re-ranked tenant's devices are taken back (rule 6, `_reclaim_all`) by the frozen tenants that want them and
    now outrank every holder of theirs. Only those of a better rank than its own are looked at until one takes
    devices back (`_wanted_at`); after that, all of them after it, in order, as the walk over all did. Through a
    churn of least-attained-service demotions (each one a re-rank, dozens of them taking devices back, several
    in one walk), every tenant's state, rank, devices and missing devices after each event are the same as with
    every frozen tenant that wants a re-ranked tenant's devices looked at."""
    import random

    from dtorch_controller.core.scheduler import Scheduler

    def churn(seed):
        rng = random.Random(seed)
        h = make_harness(policy=DTorchPolicy({"thresholds": [2, 10, 40], "fairness": 0}), **QUIET)
        workers(h, 16)
        sessions: list[str] = []
        seen = []
        for _ in range(300):
            r = rng.random()
            if r < 0.4 or len(sessions) < 3:
                sid = h.open_session()
                sessions.append(sid)
                h.open_mesh(sid, 1, list(range(rng.choice([1, 1, 2, 3, 4, 6]))))
            elif r < 0.55:
                assert h.call(ev.CloseSession, m.CloseSession(session=sessions.pop(rng.randrange(len(sessions))))).ok
            else:
                h.advance(rng.choice([1, 3, 10]))
            h.report_all()
            sched = h.core.sched
            _check_indexes(sched)
            seen.append((sched.decisions, [(t.session, t.state, t.rank, list(t.workers), sorted(t.missing))
                                           for t in sched.tenants.values()]))
        return seen, len(lines(h, "frozen on"))

    wanters = Scheduler._wanters
    took = []

    def every_one(self, t, better, held):  # the walk as it was: every frozen tenant wanting its devices looks
        wanters(self, t, better, held)
        for _holder, _w, _rank, worse in held:
            better.update(dict.fromkeys(worse))
        held.clear()

    for seed in range(3):
        fast, frozen = churn(seed)
        with monkeypatch.context() as mp:
            mp.setattr(Scheduler, "_wanters", every_one)
            full, _ = churn(seed)
        assert fast == full
        took.append(frozen)
    assert min(took) > 20
