"""The gRPC adapter: drives one ControllerCore with the wall clock, handler threads and a timer thread.

Thin on purpose. Every handler turns its request into an event, feeds the core under one lock (the
core is single-threaded), performs the effects outside the lock and blocks, bounded, on the future
its Reply completes. Execute batches go out asynchronously; a failed send comes back to the core as
WorkerUnreachable. All logic lives in `dtorch_controller.core`, which the simulator drives too.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

import grpc

from dtorch_controller.core import Config, ControllerCore, Notice, Refusal, Reply, SendExecute, SetTimer
from dtorch_controller.core import events as ev
from dtorch_controller.core.config import format_seconds
from dtorch_controller.core.policies import Policy
from dtorch_controller.timers import TimerThread
from dtorch_protocol import messages as m
from dtorch_protocol import wire

log = logging.getLogger("dtorch_controller.server")

REPLY_WAIT_S = 30.0  # how long a handler waits for an immediate answer (the core answers at once)
SYNC_GRACE_S = 10.0  # a Sync handler waits for the core's own timeout plus this
EXECUTE_TIMEOUT_S = 60.0  # Execute only enqueues on the worker, so this is about reaching it at all
SERVER_THREADS = 256  # Syncs park a thread each; heartbeats must never starve behind them


def wall_clock_formatter(clock: Callable[[], float] = time.monotonic) -> Callable[[float], str]:
    """Render the core's monotonic times as local wall-clock times in event-log lines."""
    offset = time.time() - clock()
    return lambda t: time.strftime("%H:%M:%S", time.localtime(t + offset)) + f".{int((t + offset) % 1 * 1000):03d}"


class ControllerService:
    """Implements wire.SERVICES["dtorch.Controller"] around a ControllerCore."""

    def __init__(self, core: ControllerCore, token: str, clock: Callable[[], float] = time.monotonic,
                 execute_timeout_s: float = EXECUTE_TIMEOUT_S) -> None:
        self.core = core
        self._token = token
        self._clock = clock
        self._execute_timeout_s = execute_timeout_s
        self._lock = threading.Lock()  # guards the core
        self._waiters: dict[Hashable, Future] = {}
        self._waiters_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stubs: dict[str, wire.Stub] = {}
        self._stubs_lock = threading.Lock()
        self.timers = TimerThread(lambda key: self.feed(ev.TimerFired(key)), clock)

    # ------------------------------------------------------------ driving the core

    def feed(self, event: ev.Event) -> None:
        """Hand one event to the core and perform its effects."""
        with self._lock:
            effects = self.core.handle(self._clock(), event)
        for effect in effects:
            try:
                self._perform(effect)
            except Exception:  # one failed effect must not drop the others
                log.exception("effect %r failed", effect)

    def _perform(self, effect: Any) -> None:
        if isinstance(effect, Reply):
            with self._waiters_lock:
                future = self._waiters.get(effect.request_id)
            if future is not None and not future.done():
                future.set_result(effect.message)
        elif isinstance(effect, SendExecute):
            self._send(effect)
        elif isinstance(effect, SetTimer):
            self.timers.set(effect.at, effect.key)
        elif isinstance(effect, Notice):
            log.debug("%s", effect)  # for observers; the event log (Status) has its own line
        else:
            raise TypeError(f"unknown effect {effect!r}")

    def _stub(self, address: str) -> wire.Stub:
        with self._stubs_lock:
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = wire.Stub("dtorch.Worker", address, self._token)
            return stub

    def _send(self, effect: SendExecute) -> None:
        stub = self._stub(effect.address)
        try:
            call = stub.call_future("Execute", effect.execute, timeout=self._execute_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to start the call means the batch is not delivered
            self.feed(ev.WorkerUnreachable(effect.worker_id, effect.address, str(e)))
            return

        def done(f: grpc.Future) -> None:
            try:
                ack: m.Ack = stub.decode_reply("Execute", f)
                problem = "" if ack.ok else f"refused batch {effect.execute.seq}: {ack.message}"
            except Exception as e:  # noqa: BLE001
                problem = str(e)
            if problem:
                self.feed(ev.WorkerUnreachable(effect.worker_id, effect.address, problem))

        call.add_done_callback(done)

    def request(self, make: Callable[[Hashable], ev.Event], wait_s: float = REPLY_WAIT_S) -> Any:
        """Feed a request event and wait for its Reply; refusals raise ProtocolError / RemoteError."""
        request_id = next(self._ids)
        future: Future = Future()
        with self._waiters_lock:
            self._waiters[request_id] = future
        try:
            try:
                self.feed(make(request_id))
            except Exception as e:
                log.exception("controller core failed on request %s", request_id)
                raise wire.RemoteError(f"internal controller error: {type(e).__name__}: {e}") from None
            try:
                message = future.result(timeout=wait_s)
            except FutureTimeout:
                raise wire.RemoteError(f"the controller did not answer within {wait_s:g}s") from None
        finally:
            with self._waiters_lock:
                self._waiters.pop(request_id, None)
        if isinstance(message, Refusal):
            text = " ".join(message.message.split())  # gRPC details travel best as one line
            raise (wire.ProtocolError if message.kind == "protocol" else wire.RemoteError)(text)
        return message

    def close(self) -> None:
        """Answer requests still parked (a Sync may wait for minutes), stop the timers, close worker channels."""
        with self._waiters_lock:
            parked = list(self._waiters.values())
        for future in parked:
            if not future.done():
                future.set_result(Refusal("refused", "the controller is shutting down"))
        self.timers.stop()
        with self._stubs_lock:
            stubs, self._stubs = list(self._stubs.values()), {}
        for stub in stubs:
            stub.close()

    # ------------------------------------------------------------ the service table

    def OpenSession(self, request: m.OpenSession) -> m.SessionOpened:
        return self.request(lambda rid: ev.OpenSession(rid, request))

    def OpenMesh(self, request: m.OpenMesh) -> m.MeshPlaced:
        return self.request(lambda rid: ev.OpenMesh(rid, request))

    def Submit(self, request: m.Submit) -> m.SubmitReply:
        return self.request(lambda rid: ev.Submit(rid, request))

    def Sync(self, request: m.Sync) -> m.SyncReply:
        timeout = request.timeout_s if request.timeout_s == request.timeout_s else 0.0  # NaN: answer at once
        wait = min(max(timeout, 0.0), self.core.config.max_sync_timeout_s) + SYNC_GRACE_S
        return self.request(lambda rid: ev.Sync(rid, request), wait_s=wait)

    def CloseSession(self, request: m.CloseSession) -> m.Ack:
        return self.request(lambda rid: ev.CloseSession(rid, request))

    def KeepAlive(self, request: m.KeepAlive) -> m.Ack:
        return self.request(lambda rid: ev.KeepAlive(rid, request))

    def Status(self, request: m.StatusRequest) -> m.StatusReply:
        return self.request(lambda rid: ev.Status(rid, request))

    def Register(self, request: m.RegisterWorker) -> m.Registered:
        return self.request(lambda rid: ev.Register(rid, request))

    def Report(self, request: m.WorkerReport) -> m.ReportReply:
        return self.request(lambda rid: ev.Report(rid, request))

    def Drain(self, request: m.DrainRequest) -> m.AdminReply:
        wait = min(max(request.timeout_s, 0.0), self.core.config.max_sync_timeout_s) + SYNC_GRACE_S
        return self.request(lambda rid: ev.Drain(rid, request), wait_s=wait)

    def Migrate(self, request: m.MigrateRequest) -> m.AdminReply:
        wait = min(max(request.timeout_s, 0.0), self.core.config.max_sync_timeout_s) + SYNC_GRACE_S
        return self.request(lambda rid: ev.Migrate(rid, request), wait_s=wait)


class ControllerServer:
    """A running controller: the gRPC server and the service that drives the core."""

    def __init__(self, grpc_server: grpc.Server, service: ControllerService, address: str) -> None:
        self.grpc_server = grpc_server
        self.service = service
        self.address = address

    @property
    def core(self) -> ControllerCore:
        return self.service.core

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: calls in flight get `grace` seconds, then parked ones are answered and timers stop."""
        stopped = self.grpc_server.stop(grace)
        stopped.wait((grace or 0) + 0.1)
        self.service.close()
        stopped.wait(1.0)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def run_server(listen: str = "127.0.0.1:0", token: str = "", config: Config | None = None,
               core: ControllerCore | None = None, policy: Policy | None = None) -> tuple[ControllerServer, str]:
    """Start a controller on `listen` ("HOST:PORT", port 0 picks one); returns it and the address it serves on."""
    if core is None:
        config = config or Config()
        if config.format_time is format_seconds:  # the default: show wall-clock times instead
            config = replace(config, format_time=wall_clock_formatter())
        core = ControllerCore(config, policy=policy)
    service = ControllerService(core, token)
    try:
        grpc_server, address = wire.serve("dtorch.Controller", service, token, listen=listen,
                                          max_workers=SERVER_THREADS)
    except BaseException:
        service.close()
        raise
    return ControllerServer(grpc_server, service, address), address
