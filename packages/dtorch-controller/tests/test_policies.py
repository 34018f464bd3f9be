"""The policies alone, on real `Tenant` records: parameters (defaults, refusals by their one line), ranks and
queue keys as the policies' docstrings state them, and when a rank changes by the clock alone."""

from __future__ import annotations

import math

import pytest

from dtorch_controller.core import events as ev
from dtorch_controller.core.policies import (
    DTorchPolicy,
    FifoPolicy,
    LasPolicy,
    PolicyError,
    PriorityPolicy,
    known,
    make_policy,
)
from dtorch_controller.core.scheduler import FROZEN, RUNNING, WAITING, Tenant
from dtorch_protocol import messages as m


def tenant(state: str = WAITING, *, devices: int = 0, attained: float = 0.0, since: float = 0.0,
           waiting_since: float | None = None, priority: str = "normal", kind: str = "batch", **fields) -> Tenant:
    t = Tenant(session="s", priority=priority, kind=kind, cap=0, state=state, attained=attained, since=since,
               waiting_since=waiting_since, **fields)
    t.workers = {f"w{i}": None for i in range(devices)}
    return t


# ---------------------------------------------------------------- parameters


def test_policies_by_name_with_their_defaults():
    assert known() == "dtorch, fifo, las, priority"
    assert isinstance(make_policy(), DTorchPolicy)
    assert [type(make_policy(name)) for name in ("dtorch", "fifo", "las", "priority")] == [
        DTorchPolicy, FifoPolicy, LasPolicy, PriorityPolicy]
    with pytest.raises(PolicyError) as e:
        make_policy("sjf")
    assert str(e.value) == "unknown policy 'sjf': known policies are dtorch, fifo, las, priority"
    fifo, prio, las, dt = FifoPolicy(), PriorityPolicy(), LasPolicy(), DTorchPolicy()
    assert (fifo.preempts, fifo.packs, fifo.relocates) == (False, False, False)
    assert not any(p.shrinks or p.lends for p in (fifo, prio, las))  # only dtorch shrinks and lends
    assert (prio.preempts, prio.packs, prio.relocates, prio.relocate_after) == (True, True, True, 600.0)
    assert (las.preempts, las.packs, las.relocates, las.relocate_after) == (True, False, True, 600.0)
    assert (las.thresholds, las.starve_factor, las.starve_min_s) == ((60.0, 600.0, 3600.0), 0.0, 60.0)
    assert (dt.preempts, dt.packs, dt.relocates, dt.relocate_after, dt.lends, dt.shrinks) == \
        (True, True, True, 0.0, True, True)
    assert (dt.thresholds, dt.levels, dt.fairness) == ((60.0, 600.0, 3600.0), 4, 0.0)  # no shield by default


def test_parameters_are_taken_as_given():
    dt = DTorchPolicy({"thresholds": [10, 20], "fairness": 2, "preempt": False, "pack": False, "lend": False,
                       "shrink": False, "relocate": False, "relocate_after": 5})
    assert (dt.thresholds, dt.levels, dt.fairness) == ((10.0, 20.0), 3, 2.0)
    assert (dt.preempts, dt.packs, dt.lends, dt.shrinks, dt.relocates, dt.relocate_after) == \
        (False, False, False, False, False, 5.0)
    las = LasPolicy({"thresholds": [5], "starve_factor": 2, "starve_min_s": 0, "preempt": False})
    assert (las.thresholds, las.starve_factor, las.starve_min_s, las.preempts) == ((5.0,), 2.0, 0.0, False)
    prio = PriorityPolicy({"preempt": False, "pack": False, "relocate": False})
    assert (prio.preempts, prio.packs, prio.relocates) == (False, False, False)


@pytest.mark.parametrize("policy, params, message", [
    (FifoPolicy, {"preempt": True}, "policy 'fifo' takes no parameter 'preempt'"),
    (PriorityPolicy, {"zz": 1, "aa": 2}, "policy 'priority' takes no parameter 'aa', 'zz' (it takes preempt, pack, "
                                         "fgd, relocate, relocate_after)"),
    (PriorityPolicy, {"pack": "yes"}, "policy parameter 'pack' must be true or false, got 'yes'"),
    (PriorityPolicy, {"preempt": 1}, "policy parameter 'preempt' must be true or false, got 1"),
    (LasPolicy, {"relocate": None}, "policy parameter 'relocate' must be true or false, got None"),
    (LasPolicy, {"starve_factor": -1}, "policy parameter 'starve_factor' must be a finite number >= 0, got -1"),
    (LasPolicy, {"starve_min_s": True}, "policy parameter 'starve_min_s' must be a finite number >= 0, got True"),
    (LasPolicy, {"relocate_after": "1"}, "policy parameter 'relocate_after' must be a finite number >= 0, got '1'"),
    (DTorchPolicy, {"fairness": -0.5}, "policy parameter 'fairness' must be a finite number >= 0, got -0.5"),
    # nan passed every bound (comparisons with it are false); inf is no time (relocate=false says "never")
    (DTorchPolicy, {"backfill_after": math.nan}, "policy parameter 'backfill_after' must be a finite number >= 0, "
                                                 "got nan"),
    (LasPolicy, {"relocate_after": math.inf}, "policy parameter 'relocate_after' must be a finite number >= 0, "
                                              "got inf"),
])
def test_a_bad_parameter_is_refused_in_one_line(policy, params, message):
    with pytest.raises(PolicyError) as e:
        policy(params)
    assert str(e.value) == message


@pytest.mark.parametrize("policy", [LasPolicy, DTorchPolicy])
@pytest.mark.parametrize("thresholds", [[], [10, 5], [5, 5], [0, 5], [-1], [True, 5], "60", ["1"], 60,
                                        [math.nan], [60, math.inf]])
def test_thresholds_must_be_ascending_positive_numbers(policy, thresholds):
    with pytest.raises(PolicyError) as e:
        policy({"thresholds": thresholds})
    assert str(e.value) == ("policy parameter 'thresholds' must be ascending positive device-seconds, got "
                            f"{thresholds!r}")


def test_zero_is_an_accepted_number():
    assert LasPolicy({"starve_min_s": 0, "relocate_after": 0.0}).relocate_after == 0.0
    assert DTorchPolicy({"fairness": 0}).fairness == 0.0


def test_policies_describe_themselves():
    assert FifoPolicy().describe() == "fifo"
    assert PriorityPolicy().describe() == "priority (preempt=on, pack=on)"
    assert PriorityPolicy({"preempt": False, "pack": False}).describe() == "priority (preempt=off, pack=off)"
    assert LasPolicy({"thresholds": [1.5, 60], "starve_factor": 2}).describe() == \
        "las (thresholds 1.5, 60 device-s, starve_factor 2)"
    assert DTorchPolicy().describe() == ("dtorch (levels at 60, 600, 3600 device-s of remaining or attained work, "
                                         "no shield, preempt=on, pack=on, lend=on, pace=on)")
    assert DTorchPolicy({"preempt": False, "pack": False, "lend": False, "fairness": 0.5, "pace": False}).describe() \
        == ("dtorch (levels at 60, 600, 3600 device-s of remaining or attained work, shielded once frozen 0.5x "
            "its running time, preempt=off, pack=off, lend=off, pace=off)")


# ---------------------------------------------------------------- fifo and priority


def test_fifo_ranks_everyone_alike():
    fifo = FifoPolicy()
    high, low = tenant(priority="high"), tenant(priority="low", kind="realtime")
    assert fifo.rank(high, 0) == fifo.rank(low, 0) == 0 and fifo.key(high, 0) == fifo.key(low, 0) == ()
    assert fifo.next_change(high, 0) is None


def test_priority_classes_and_realtime_first_within_a_class():
    prio = PriorityPolicy()
    assert [prio.rank(tenant(priority=p), 0) for p in ("high", "normal", "low")] == [0, 1, 2]
    assert prio.key(tenant(kind="realtime"), 0) < prio.key(tenant(kind="batch"), 0)
    assert prio.next_change(tenant(RUNNING, devices=2), 0) is None


# ---------------------------------------------------------------- las


def test_las_levels_by_attained_service():
    las = LasPolicy({"thresholds": [60, 600]})
    assert las.rank(tenant(attained=0), 0) == 0
    assert las.rank(tenant(attained=59.9), 0) == 0
    assert las.rank(tenant(attained=60), 0) == 1  # a threshold reached counts as crossed
    assert las.rank(tenant(attained=60 - 1e-9), 0) == 1  # ... up to float rounding
    assert las.rank(tenant(attained=599), 0) == 1 and las.rank(tenant(attained=600), 0) == 2
    running = tenant(RUNNING, devices=2, attained=10, since=100)  # + 2 devices x 20 s = 50 device-s at t=120
    assert las.rank(running, 120) == 0 and las.rank(running, 125) == 1
    assert las.rank(tenant(attained=100, base=50), 0) == 0  # counted from its last promotion


def test_las_next_change_is_when_running_service_crosses_the_next_threshold():
    las = LasPolicy({"thresholds": [60, 600]})
    running = tenant(RUNNING, devices=2, attained=10, since=100)
    assert las.next_change(running, 100) == pytest.approx(125.0)  # 50 device-s to go at 2 devices
    assert las.next_change(running, 125) == pytest.approx(125 + 540 / 2)  # at 60 now: 600 next
    assert las.next_change(tenant(RUNNING, devices=2, attained=700, since=0), 0) is None  # past the last level
    assert las.next_change(tenant(RUNNING, devices=0, attained=0), 0) is None  # holds nothing: service stands still
    assert las.next_change(tenant(WAITING, attained=10, waiting_since=0), 5) is None  # no starvation promotion


def test_las_promotes_a_starving_session_after_factor_times_its_service():
    las = LasPolicy({"starve_factor": 3, "starve_min_s": 60})
    t = tenant(FROZEN, attained=100, waiting_since=1000)
    assert las.next_change(t, 1000) == 1300  # waited 3 x its 100 device-s
    assert not las.starving(t, 1299.9) and las.starving(t, 1300)
    short = tenant(WAITING, attained=10, waiting_since=1000)
    assert las.next_change(short, 1000) == 1060  # at least starve_min_s
    assert las.next_change(tenant(WAITING, attained=0, waiting_since=1000), 1000) is None  # no service yet
    assert las.next_change(tenant(WAITING, attained=100), 1000) is None  # not waiting
    assert not LasPolicy().starving(t, 10**9)  # starve_factor 0: never


# ---------------------------------------------------------------- dtorch


def test_dtorch_ranks_classes_strictly_then_levels():
    dt = DTorchPolicy({"fairness": 0})
    # classes of 5 ranks: slot 0, then 4 levels
    assert [dt.rank(tenant(priority=p, attained=0), 0) for p in ("high", "normal", "low")] == [1, 6, 11]
    assert dt.rank(tenant(priority="high", attained=10_000), 0) == 4 < dt.rank(tenant(priority="normal"), 0)
    assert [dt.rank(tenant(attained=a), 0) for a in (59, 60, 600, 3600)] == [6, 7, 8, 9]


def test_dtorch_scores_by_remaining_work_when_progress_is_trustworthy():
    dt = DTorchPolicy({"fairness": 0})
    t = tenant(attained=500, expected_steps=10, steps=8, step_service=400)  # 50 per step, 2 steps left
    assert dt.remaining(t) == 100 and dt.score(t, 0) == 100 and dt.rank(t, 0) == 5 + 1 + 1
    for untrusted in (dict(expected_steps=0, steps=8), dict(expected_steps=10, steps=0),
                      dict(expected_steps=10, steps=10), dict(expected_steps=10, steps=12)):
        u = tenant(attained=500, step_service=400, **untrusted)
        assert dt.remaining(u) is None and dt.score(u, 0) == 500, untrusted
    assert dt.remaining(tenant(expected_steps=10, steps=5, step_service=0)) is None
    assert dt.key(tenant(kind="realtime", attained=900), 0) < dt.key(tenant(attained=0), 0)
    assert dt.key(tenant(attained=10), 0) < dt.key(tenant(attained=20), 0)


def test_dtorch_shields_a_running_session_frozen_fairness_times_its_running_time():
    dt = DTorchPolicy({"fairness": 2})
    t = tenant(RUNNING, devices=4, logical=4, attained=400, since=100, waited=300, frozen_s=300)  # ran 100 s
    assert dt.rank(t, 100) == 5 + 0  # slot 0 of its class, although 400 device-s make it level 1
    assert dt.next_change(t, 100) == pytest.approx(100 + 300 / 2 - 100)  # until it ran 150 s
    assert dt.rank(t, 151) == 5 + 1 + 2  # 604 device-s: its own level again
    half = tenant(RUNNING, devices=2, logical=4, attained=400, since=100, waited=300, frozen_s=300)  # shrunk
    assert dt.next_change(half, 100) == pytest.approx(100 + 50 * 4 / 2)  # half the pace
    assert dt.rank(tenant(WAITING, logical=4, attained=400, frozen_s=300), 100) == 5 + 1 + 1  # only while it runs
    assert DTorchPolicy({"fairness": 0}).rank(t, 100) == 5 + 1 + 1  # no shield
    queued = tenant(RUNNING, devices=4, logical=4, attained=400, since=100, waited=300)  # it only queued
    assert dt.rank(queued, 100) == 5 + 1 + 1 and dt.next_change(queued, 100) == pytest.approx(100 + 200 / 4)


def test_dtorch_shield_ends_when_the_running_time_reaches_the_frozen_time_up_to_float_rounding():
    """Rule 3: shielded *until* it has run as long as it was frozen; like a threshold, reached up to float rounding
    (1e-6) counts as reached."""
    dt = DTorchPolicy({"thresholds": [1], "fairness": 1})
    t = tenant(RUNNING, devices=1, logical=1, attained=1.0, since=0, frozen_s=1.0 + 1e-6)  # ran 1 s
    assert dt.next_change(t, 0) is None and dt.rank(t, 0) == 3 + 1 + 1  # not shielded: its own level (1 device-s)
    longer = tenant(RUNNING, devices=1, logical=1, attained=1.0, since=0, frozen_s=1.0 + 1e-5)
    assert dt.rank(longer, 0) == 3 + 0 and dt.next_change(longer, 0) == pytest.approx(1e-5)


def test_dtorch_next_change():
    dt = DTorchPolicy({"fairness": 2})
    running = tenant(RUNNING, devices=2, attained=10, since=100)
    assert dt.next_change(running, 100) == pytest.approx(125.0)
    assert dt.next_change(tenant(RUNNING, devices=2, attained=5000), 0) is None
    assert dt.next_change(tenant(RUNNING, devices=0), 0) is None
    assert dt.next_change(tenant(RUNNING, devices=2, expected_steps=10, steps=2, step_service=4), 0) is None
    # exactly at a threshold (60 device-s) the session is in the next level: its next change is at 600
    assert dt.next_change(tenant(RUNNING, devices=2, attained=60, since=100), 100) == pytest.approx(100 + 540 / 2)


# ---------------------------------------------------------------- the scheduler's books (through the core)


def test_a_frozen_session_resumes_with_its_frozen_time_counted_as_waiting(make_harness):
    h = make_harness(policy=PriorityPolicy({"relocate": False}), session_timeout_s=0, heartbeat_interval_s=1e5,
                     heartbeat_timeout_s=1e6)  # neither workers nor sessions time out while the clock moves
    h.register("10.0.0.0:7000")
    low = h.open_session(priority="low")
    assert h.open_mesh(low, 1, [0]).placed
    h.advance(2.0)  # low runs 2 s on 1 device
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed  # freezes low
    h.advance(7.5)
    assert h.call(ev.CloseSession, m.CloseSession(session=high)).ok  # low gets its device back
    t = h.core.sched.tenants[low]
    assert t.state == RUNNING and t.waited == pytest.approx(7.5) and t.attained == pytest.approx(2.0)
    assert any("resumed on 1 device after 7.50s frozen" in line for line in h.core.log.lines())
