"""The controller's series fed by the core's notices (metrics.py `NOTICES`): instructions, preemptions,
relocations, recoveries and the detection and recovery latencies, on the fake clock the core is driven with (the
latencies are the core's own times, not the adapter's). The wiring in the real server, scraped over HTTP and by a
real Prometheus: integration/test_observability.py."""

from __future__ import annotations

import pytest

from _core_helpers import add_, create
from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_controller.core.policies import PriorityPolicy
from dtorch_controller.metrics import ControllerMetrics
from dtorch_controller.usage import Accounting
from dtorch_protocol import messages as m


def metrics_of(h) -> ControllerMetrics:
    """The metrics an adapter keeps, told every notice the core emitted so far."""
    metrics = ControllerMetrics(lambda: None, Accounting())
    for n in h.notices:
        metrics.notice(n)
    return metrics


def value(metrics: ControllerMetrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(f"dtorch_controller_{name}", labels)
    assert got is not None, f"no sample {name}{labels}"
    return got


def test_every_series_shows_zero_before_anything_happened():
    metrics = ControllerMetrics(lambda: None, Accounting())
    assert value(metrics, "instructions_total") == 0
    assert value(metrics, "preemptions_total") == value(metrics, "relocations_total") == 0
    assert value(metrics, "recoveries_total", outcome="rebuilt") == value(metrics, "recoveries_total",
                                                                          outcome="data_lost") == 0
    assert value(metrics, "failure_detection_seconds_count", cause="timeout") == 0
    assert value(metrics, "failure_detection_seconds_count", cause="unreachable") == 0
    assert value(metrics, "recovery_seconds_count") == 0


def test_instructions_are_counted_when_the_core_accepts_their_batch(make_harness, refused):
    h = make_harness()
    h.register("10.0.0.0:7000")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0]).placed
    h.submit(sid, 1, [create(1), create(2)])
    h.submit(sid, 2, [add_(1)])
    assert refused(h.submit(sid, 5, [add_(1), add_(2)]))  # out of order: refused, not counted
    assert [(n.seq, n.instructions) for n in h.notices if isinstance(n, fx.Accepted)] == [(1, 2), (2, 1)]
    assert value(metrics_of(h), "instructions_total") == 3
    step = [create(0), add_(0), m.InstrDelete(tids=[0])]  # in slots: tid 0 is the replay's first id
    assert h.submit(sid, 3, [m.InstrDefine(program=1, instrs=step, ntids=1, nseeds=1),
                             m.InstrReplay(program=1, tids=[3], seeds=[3])]).accepted == 3
    assert h.submit(sid, 4, [m.InstrReplay(program=1, tids=[4], seeds=[4]),
                             m.InstrReplay(program=1, tids=[5], seeds=[5])]).accepted == 4
    assert value(metrics_of(h), "instructions_total") == 3 + 3 + 2 * 3  # a replay: the instructions it stands for


def test_a_preemption_and_the_relocation_that_ends_it_are_counted(make_harness):
    h = make_harness(policy=PriorityPolicy({"relocate_after": 0}))
    w0, w1, w2 = (h.register(f"10.0.0.{i}:7000") for i in range(3))
    low, other = h.open_session(priority="low"), h.open_session()
    assert h.open_mesh(low, 1, [0, 1]).placed and h.open_mesh(other, 1, [0]).placed
    h.submit(low, 1, [create(1)])
    h.report_all()
    high = h.open_session(priority="high")
    assert h.open_mesh(high, 1, [0]).placed  # freezes low
    metrics = metrics_of(h)
    assert value(metrics, "preemptions_total") == 1 and value(metrics, "relocations_total") == 0
    assert h.call(ev.CloseSession, m.CloseSession(session=other)).ok  # a device comes free: low relocates there
    metrics = metrics_of(h)
    assert value(metrics, "preemptions_total") == 1 and value(metrics, "relocations_total") == 1
    assert value(metrics, "recoveries_total", outcome="rebuilt") == 0


def test_a_silent_worker_is_timed_from_its_last_report_and_its_session_from_the_fencing_to_rebuilt(make_harness):
    h = make_harness(snapshot_every_batches=2)
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(3)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    h.submit(sid, 1, [create(1)])
    h.submit(sid, 2, [add_(1)])
    h.report_all()  # the snapshot after batch 2 is complete; the victim's last report
    victim = h.core.sessions[sid].devices[1]
    last_report = h.now
    while not any(isinstance(n, fx.Fenced) for n in h.notices):  # the victim falls silent, the others report
        h.advance(0.2)
        for w in ids:
            if w != victim:
                h.report(w)
    fenced_at = last_report + h.core.config.heartbeat_timeout_s  # its heartbeat timer fires then
    while not any(isinstance(n, fx.Recovered) for n in h.notices):
        assert h.now < fenced_at + 10, "the session was not rebuilt"
        h.advance(0.25)
        h.report_all()
    recovered_at = h.now
    metrics = metrics_of(h)
    assert value(metrics, "failure_detection_seconds_count", cause="timeout") == 1
    assert value(metrics, "failure_detection_seconds_sum", cause="timeout") == pytest.approx(
        h.core.config.heartbeat_timeout_s)
    assert value(metrics, "failure_detection_seconds_count", cause="unreachable") == 0
    assert value(metrics, "recoveries_total", outcome="rebuilt") == 1
    assert value(metrics, "recovery_seconds_count") == 1
    assert value(metrics, "recovery_seconds_sum") == pytest.approx(recovered_at - fenced_at)
    assert recovered_at > fenced_at  # a rebuild takes reports: the latency is not zero by construction
    assert value(metrics, "preemptions_total") == 0


def test_an_unreachable_worker_whose_data_is_lost_is_a_data_lost_outcome_and_no_recovery_time(make_harness):
    h = make_harness(snapshot_every_batches=0)  # no copies: a loss cannot be rebuilt
    for i in range(3):
        h.register(f"10.0.0.{i}:7000")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1, 2]).placed
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.advance(0.3)  # before anyone is suspect
    h.handle(ev.WorkerUnreachable(h.core.sessions[sid].devices[0], "", "killed"))
    metrics = metrics_of(h)
    assert value(metrics, "failure_detection_seconds_count", cause="unreachable") == 1
    assert value(metrics, "failure_detection_seconds_sum", cause="unreachable") == pytest.approx(0.3)
    assert value(metrics, "recoveries_total", outcome="data_lost") == 1
    assert value(metrics, "recoveries_total", outcome="rebuilt") == 0 and value(metrics, "recovery_seconds_count") == 0
