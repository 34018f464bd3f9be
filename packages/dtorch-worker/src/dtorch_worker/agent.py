"""The worker's link to the controller: registration, then one report thread.

A WorkerReport is heartbeat and completion notice in one. It goes out every
heartbeat interval and promptly whenever the completed batch moves (`poke`), or at
most REPORT_LAG_S later where the executor says nobody can be waiting for that
completion alone (`poke_later`: a later batch of the same session is still running
here, and its completion is told in turn); pokes that arrive while a report is in
flight coalesce into the next one, so at most one is ever in flight. The
controller fences a worker it declared lost (ok=False): such a worker must stop
executing and exit, since its shards were rebuilt elsewhere.
A worker that cannot reach the controller for `lost_after_s` exits too.

It registers over its worker API key (and its certificate under TLS), handing the controller the
secret it checks every later credential against (`dtorch_protocol.auth`); each report carries the proof
derived from that secret, so nobody else can report for this worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dtorch_protocol import auth, wire
from dtorch_protocol.messages import Registered, RegisterWorker, ReportReply, WorkerReport
from dtorch_protocol.tls import Tls
from dtorch_worker import __version__
from dtorch_worker.executor import Executor
from dtorch_worker.store import TensorStore

log = logging.getLogger("dtorch_worker.agent")

EXIT_FENCED = 3
REPORT_LAG_S = 0.01  # bound on how late a deferred completion (`poke_later`) is reported
EXIT_LOST = 4


class ControllerUnreachable(ConnectionError):
    """Registration failed after every retry."""


class Agent:
    """Registers with the controller and runs the report loop; `on_exit(code, reason)` ends the worker."""

    def __init__(self, controller: str, api_key: str, executor: Executor, store: TensorStore,
                 on_exit: Callable[[int, str], None], lost_after_s: float = 10.0,
                 report_timeout_s: float = 5.0, secret: str = "", tls: Tls | None = None) -> None:
        self.controller = controller
        self.stub = wire.Stub("dtorch.Controller", controller, api_key, tls=tls)
        self.secret = secret  # the worker's own (auth.WorkerAuth.secret)
        self.proof = auth.report_proof(secret) if secret else ""
        self.executor = executor
        self.store = store
        self.on_exit = on_exit
        self.lost_after_s = lost_after_s
        self.report_timeout_s = report_timeout_s
        self.worker_id = ""
        self.heartbeat_s = 1.0
        self.reports_sent = 0
        self._busy_mark = (time.monotonic(), 0.0)  # (when, executor busy seconds then): utilization
        self._wake = threading.Event()
        self._now = False  # a poke asks for a report now
        self._due: float | None = None  # when a deferred completion must be reported at the latest
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, address: str, device_type: str, memory_bytes: int, labels: dict[str, str],
                 attempts: int = 10, delay_s: float = 0.25, client_address: str = "", rendezvous: str = "",
                 device_id: str = "") -> Registered:
        """Register, retrying while the controller is unreachable (or a lost predecessor still holds the
        address); raises ControllerUnreachable at the end."""
        request = RegisterWorker(hello=wire.hello("worker", __version__), address=address, device_type=device_type,
                                 memory_bytes=memory_bytes, labels=dict(labels), secret=self.secret,
                                 client_address=client_address if client_address != address else "",
                                 rendezvous=rendezvous, device_id=device_id)
        last: Exception | None = None
        for attempt in range(max(attempts, 1)):
            try:
                reply: Registered = self.stub.call("Register", request, timeout=self.report_timeout_s)
            except (ConnectionError, TimeoutError, wire.Conflict) as e:  # not up yet: retry; refusals are final
                last = e
                if attempt + 1 < attempts:
                    time.sleep(min(delay_s * 2 ** attempt, 2.0))
                continue
            self.worker_id = reply.worker
            self.heartbeat_s = max(reply.heartbeat_interval_s, 0.01)
            return reply
        raise ControllerUnreachable(
            f"cannot register with the controller at {self.controller} after {attempts} attempts: {last}")

    def start(self) -> Agent:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dtorch-report", daemon=True)
            self._thread.start()
        return self

    def poke(self, _seq: int = 0) -> None:
        """Ask for a report now (a batch completed); cheap, never blocks."""
        self._now = True
        self._wake.set()

    def poke_later(self, _seq: int = 0) -> None:
        """Ask for a report within REPORT_LAG_S (a completion nobody waits for alone); cheap, never blocks."""
        if self._due is None:
            self._due = time.monotonic() + REPORT_LAG_S
            self._wake.set()  # the loop waits until then at most

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.stub.close()

    def report_once(self) -> ReportReply:
        """Send one report; errors that do not get through are put back for the next one."""
        completed = self.executor.completed  # before the errors: every error of a completed batch rides along
        errors = self.executor.take_errors()
        now, busy = time.monotonic(), self.executor.busy_s
        then, busy_then = self._busy_mark
        utilization = min(1.0, max(0.0, (busy - busy_then) / (now - then))) if now > then else 0.0
        report = WorkerReport(worker=self.worker_id, completed=completed, errors=errors, sessions=self.store.stats(),
                              utilization=utilization, received_bytes=self.executor.received_bytes,
                              proof=self.proof)
        self.executor.release_reads(completed)  # the early reads' bytes go out behind this report (executor.py)
        try:
            reply: ReportReply = self.stub.call("Report", report, timeout=self.report_timeout_s)
        except Exception:
            self.executor.restore_errors(errors)
            raise
        self.reports_sent += 1
        self._busy_mark = (now, busy)
        return reply

    def _loop(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.is_set():
            due = self._due
            self._wake.wait(self.heartbeat_s if due is None else max(due - time.monotonic(), 0.0))
            self._wake.clear()
            if self._stop.is_set():
                return
            due = self._due
            if not self._now and due is not None and time.monotonic() < due:
                continue  # woken to wait for a deferred completion's deadline
            self._now, self._due = False, None  # this report carries whatever completed up to now
            try:
                reply = self.report_once()
            except Exception as e:  # noqa: BLE001 (any failure to report counts as unreachable)
                down = time.monotonic() - last_ok
                if down > self.lost_after_s:
                    self._exit(EXIT_LOST, f"controller {self.controller} unreachable for {down:.0f}s: {e}")
                    return
                log.warning("report to %s failed: %s", self.controller, e)
                self._stop.wait(min(self.heartbeat_s, 0.5))  # do not spin while it is down
                continue
            last_ok = time.monotonic()
            if not reply.ok:
                self.executor.stop(timeout=0.0)
                self._exit(EXIT_FENCED, f"controller refused this worker ({reply.message or 'fenced'})")
                return

    def _exit(self, code: int, reason: str) -> None:
        self._stop.set()
        try:
            self.on_exit(code, reason)
        except Exception:
            log.exception("exit callback failed")
