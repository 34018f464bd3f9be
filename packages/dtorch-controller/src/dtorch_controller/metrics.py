"""The controller's Prometheus series, served on `dtorch-controller --metrics-port` (prometheus-client).

The adapter measures what passes through it (request times, instructions, queue waits), counts and times what the
core says happened (its notices, `NOTICES` below: the latencies are the core's own, measured on the clock the core
is driven with), and reads the rest when scraped: counts from the core's own status (`snapshot`, the admin view of
`Status`), and per-tenant totals from the usage accounts (`usage.Accounting`). Nothing here reaches into the core.

series (prefix dtorch_controller_)  type       labels    meaning
workers                             gauge      state     workers by state (alive, suspect, draining, lost)
sessions                            gauge      state     open sessions by scheduling state (idle, waiting,
                                                         running, frozen)
queue_length                        gauge                sessions waiting or frozen
queue_wait_seconds                  histogram            from a session's first queued mesh request to its
                                                         placement (0 when placed at once)
request_seconds                     histogram  method    time the controller took to answer a client call
                                                         (Submit, Sync, OpenMesh, ...; a Sync waits for workers)
instructions_total                  counter              instructions of accepted Submits (rate: per second;
                                                         notice Accepted: a replay counts what it stands for)
tenant_device_seconds_total         counter    tenant    physical device-seconds held by the tenant's sessions
tenant_moved_bytes_total            counter    tenant    tensor bytes moved for the tenant's sessions
preemptions_total                   counter              sessions frozen for a better-ranked request (notice Frozen)
relocations_total                   counter              frozen sessions resumed on substitute devices (Relocated)
recoveries_total                    counter    outcome   sessions that used a lost worker: rebuilt (Recovered) or
                                                         data_lost (DataLost: not rebuildable, its next Sync raises)
failure_detection_seconds           histogram  cause     from a lost worker's last report to its fencing (Fenced;
                                                         cause: timeout = silent, unreachable = a send failed)
recovery_seconds                    histogram            from the fencing to the session rebuilt (Recovered)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dtorch_controller.core import effects as fx
from dtorch_controller.usage import Accounting
from dtorch_protocol import messages as m

WORKER_STATES = ("alive", "suspect", "draining", "lost")
SESSION_STATES = ("idle", "waiting", "running", "frozen")
WAIT_BUCKETS = (0.0, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0)
REQUEST_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 120.0)
TIMED = ("OpenSession", "OpenMesh", "Submit", "Sync", "CloseSession", "KeepAlive", "Status")
DETECTION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
RECOVERY_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0, 300.0, 900.0)

# notice -> what it adds to which series: (series, label values, value: a counter's increment, a histogram's
# observation)
NOTICES: dict[type[fx.Notice], Callable[[Any], list[tuple[str, tuple[str, ...], float]]]] = {
    fx.Accepted: lambda n: [("instructions", (), n.instructions)],
    fx.Frozen: lambda n: [("preemptions", (), 1)],
    fx.Relocated: lambda n: [("relocations", (), 1)],
    fx.Recovered: lambda n: [("recoveries", ("rebuilt",), 1), ("recovery_seconds", (), n.seconds)],
    fx.DataLost: lambda n: [("recoveries", ("data_lost",), 1)],
    fx.Fenced: lambda n: [("failure_detection_seconds", (n.cause,), n.silent_s)],
}


class _FromStatus(Collector):
    """Gauges and per-tenant counters read at scrape time."""

    def __init__(self, snapshot: Callable[[], m.StatusReply | None], accounts: Accounting) -> None:
        self._snapshot = snapshot
        self._accounts = accounts

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        status = self._snapshot()
        workers = GaugeMetricFamily("dtorch_controller_workers", "Workers by state", labels=["state"])
        sessions = GaugeMetricFamily("dtorch_controller_sessions", "Open sessions by scheduling state",
                                     labels=["state"])
        queue = GaugeMetricFamily("dtorch_controller_queue_length", "Sessions waiting or frozen")
        device_s = CounterMetricFamily("dtorch_controller_tenant_device_seconds",
                                       "Physical device-seconds held by the tenant's sessions", labels=["tenant"])
        moved = CounterMetricFamily("dtorch_controller_tenant_moved_bytes",
                                    "Tensor bytes moved for the tenant's sessions", labels=["tenant"])
        if status is not None:
            for state in WORKER_STATES:
                workers.add_metric([state], sum(1 for w in status.workers if w.state == state))
            for state in SESSION_STATES:
                sessions.add_metric([state], sum(1 for s in status.sessions if (s.schedule or "idle") == state))
            queue.add_metric([], status.queued)
            for tenant, (d, b) in sorted(self._accounts.tenant_totals(status).items()):
                device_s.add_metric([tenant], d)
                moved.add_metric([tenant], b)
        yield from (workers, sessions, queue, device_s, moved)

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return iter(())  # read at scrape time only (describing would ask the core at registration)


class ControllerMetrics:
    """The controller's registry; the service tells it what passes through (`timed`, `mesh`, `closed`) and what
    the core noticed (`notice`)."""

    def __init__(self, snapshot: Callable[[], m.StatusReply | None], accounts: Accounting,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Histogram("dtorch_controller_request_seconds", "Time the controller took to answer a "
                                  "client call, by method", ["method"], buckets=REQUEST_BUCKETS,
                                  registry=self.registry)
        self._timed = {method: self.requests.labels(method) for method in TIMED}
        self.queue_wait = Histogram("dtorch_controller_queue_wait_seconds", "From a session's first queued mesh "
                                    "request to its placement", buckets=WAIT_BUCKETS, registry=self.registry)
        self.registry.register(_FromStatus(snapshot, accounts))
        self._noticed: dict[str, Counter | Histogram] = {  # the series NOTICES feeds, by its name in the table
            "instructions": Counter("dtorch_controller_instructions", "Instructions of accepted Submits (a replay "
                                    "of a captured step: the instructions it stands for)", registry=self.registry),
            "preemptions": Counter("dtorch_controller_preemptions", "Sessions frozen for a better-ranked request",
                                   registry=self.registry),
            "relocations": Counter("dtorch_controller_relocations", "Frozen sessions resumed on substitute devices",
                                   registry=self.registry),
            "recoveries": Counter("dtorch_controller_recoveries", "Sessions that used a lost worker, by outcome "
                                  "(rebuilt, data_lost)", ["outcome"], registry=self.registry),
            "failure_detection_seconds": Histogram(
                "dtorch_controller_failure_detection_seconds", "From a lost worker's last report to its fencing, by "
                "cause (timeout, unreachable)", ["cause"], buckets=DETECTION_BUCKETS, registry=self.registry),
            "recovery_seconds": Histogram("dtorch_controller_recovery_seconds", "From a worker's fencing to a "
                                          "session that used it rebuilt", buckets=RECOVERY_BUCKETS,
                                          registry=self.registry),
        }
        for outcome in ("rebuilt", "data_lost"):  # every series shows from the start (0, not absent)
            self._noticed["recoveries"].labels(outcome)
        for cause in ("timeout", "unreachable"):
            self._noticed["failure_detection_seconds"].labels(cause)
        self._queued_since: dict[str, float] = {}  # session -> when its mesh request was first queued
        self._lock = threading.Lock()

    def notice(self, notice: fx.Notice) -> None:
        """Count or time what the core says happened (`NOTICES`); other notices add nothing."""
        rule = NOTICES.get(type(notice))
        for name, labels, value in rule(notice) if rule is not None else ():
            series = self._noticed[name]
            child = series.labels(*labels) if labels else series
            if isinstance(series, Counter):
                child.inc(value)
            else:
                child.observe(value)

    def timed(self, method: str, seconds: float) -> None:
        child = self._timed.get(method)
        if child is not None:
            child.observe(seconds)

    def mesh(self, session: str, reply: m.MeshPlaced) -> None:
        """An OpenMesh answer: queued (the wait starts) or placed (it ends)."""
        now = self._clock()
        with self._lock:
            if not reply.placed:
                self._queued_since.setdefault(session, now)
                return
            since = self._queued_since.pop(session, now)
        self.queue_wait.observe(now - since)

    def closed(self, session: str) -> None:
        with self._lock:
            self._queued_since.pop(session, None)
