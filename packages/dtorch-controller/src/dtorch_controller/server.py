"""The gRPC adapter: drives one ControllerCore with the wall clock, handler threads and a timer thread.

Thin on purpose. Every handler turns its request into an event, feeds the core under one lock (the
core is single-threaded), performs the effects outside the lock and blocks, bounded, on the future
its Reply completes. Execute batches go out asynchronously, in order per worker, on the sender's long-lived
threads (`sender.py`); a failed send comes back to the core as WorkerUnreachable. All logic lives in
`dtorch_controller.core`, which the simulator drives too.

Authentication happens before a handler runs (`wire`: API keys from the key file, roles per method,
mutual TLS for workers). The adapter then does what needs the credentials, never the core: it keeps each
worker's secret (`credentials.py`), signs Execute batches with it, checks that a Report comes from the
process that registered, sets a worker's node label from its key (the admin's word, not the worker's, unless
the key says `*`), and hands the owner of a session capabilities next to every location it is told.

Observing (`metrics.py`, `usage.py`) happens here too, from what passes through: request times, instructions,
queue waits, the bytes in workers' reports, the core's notices (preemptions, recoveries, their latencies); and from
the core's own status, asked like any admin would (`snapshot`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import grpc
import msgspec

from dtorch_controller.core import Config, ControllerCore, Notice, Refusal, Reply, SendExecute, SetTimer
from dtorch_controller.core import events as ev
from dtorch_controller.core.config import format_seconds
from dtorch_controller.core.effects import Accepted
from dtorch_controller.core.policies import Policy
from dtorch_controller.credentials import Credentials, check_secret
from dtorch_controller.metrics import ControllerMetrics
from dtorch_controller.sender import Sender
from dtorch_controller.timers import TimerThread
from dtorch_controller.usage import Accounting, UsageLog
from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m
from dtorch_protocol.health import Health
from dtorch_protocol.tls import Tls

log = logging.getLogger("dtorch_controller.server")

REPLY_WAIT_S = 30.0  # how long a handler waits for an immediate answer (the core answers at once)
SYNC_GRACE_S = 10.0  # a Sync handler waits for the core's own timeout plus this
EXECUTE_TIMEOUT_S = 60.0  # Execute only enqueues on the worker, so this is about reaching it at all
SERVER_THREADS = 256  # Syncs park a thread each; heartbeats must never starve behind them
TENANT_THREADS = 192  # at most this many handler threads serve tenants at once: the rest stay free for workers
CALLS_PER_TENANT = 64  # concurrent calls of one tenant
SYNCS_PER_SESSION = 8  # Syncs of one session waiting at once
MAX_WAIT_S = 120.0  # longest a Sync waits at the controller (clients ask for 30 s at a time)
USAGE_INTERVAL_S = 60.0  # usage records: one per session and interval (usage.py)


_GAVE_UP = object()  # what a waiter's future holds when its caller cancelled or its deadline passed


def _settle(future: Future, value: Any) -> None:
    try:
        future.set_result(value)
    except InvalidStateError:  # answered just before
        pass


class InternalError(Exception):
    """The core raised: a bug, answered INTERNAL (never a refusal the caller could act on)."""


REFUSALS: dict[str, type[Exception]] = {  # a core Refusal's kind -> what the caller gets (its status code)
    "protocol": wire.ProtocolError, "quota": wire.LimitExceeded, "conflict": wire.Conflict, "refused": wire.RemoteError}


def wall_clock_formatter(clock: Callable[[], float] = time.monotonic) -> Callable[[float], str]:
    """Render the core's monotonic times as local wall-clock times in event-log lines."""
    offset = time.time() - clock()
    return lambda t: time.strftime("%H:%M:%S", time.localtime(t + offset)) + f".{int((t + offset) % 1 * 1000):03d}"


class ControllerService:
    """Implements wire.SERVICES["dtorch.Controller"] around a ControllerCore."""

    def __init__(self, core: ControllerCore, clock: Callable[[], float] = time.monotonic,
                 execute_timeout_s: float = EXECUTE_TIMEOUT_S, tls: Tls | None = None,
                 quotas: Callable[[str], ev.Quota] | None = None) -> None:
        self.core = core
        self.tls = tls
        self.quotas = quotas or (lambda tenant: ev.Quota())  # the admin's limits per tenant (the key file)
        self.credentials = Credentials()
        self._clock = clock
        self._execute_timeout_s = execute_timeout_s
        self._lock = threading.Lock()  # guards the core
        self._waiters: dict[Hashable, Future] = {}
        self._waiters_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stubs: dict[str, wire.Stub] = {}
        self._stubs_lock = threading.Lock()
        self._sender = Sender()
        self._syncs: dict[str, int] = {}  # session -> its Syncs in flight
        self._registering: dict[Hashable, tuple[m.RegisterWorker, str]] = {}  # request id -> (request, key id)
        self.timers = TimerThread(lambda key: self.feed(ev.TimerFired(key)), clock)
        self.accounts = Accounting()  # usage per session (records, per-tenant metrics)
        self.metrics = ControllerMetrics(self.snapshot, self.accounts, clock)
        self.usage: UsageLog | None = None  # where records go (`keep_accounts`)
        self._usage_stop = threading.Event()
        self._usage_thread: threading.Thread | None = None

    # ------------------------------------------------------------ driving the core

    def feed(self, event: ev.Event) -> None:
        """Hand one event to the core and perform its effects."""
        with self._lock:
            effects = self.core.handle(self._clock(), event)
        for effect in effects:  # a worker's credentials before anything is sent its way (growth, in this batch)
            if isinstance(effect, Reply) and isinstance(effect.message, m.Registered):
                pending = self._registering.pop(effect.request_id, None)
                if pending is not None:
                    self.credentials.registered(effect.message.worker, *pending)
        for effect in effects:
            try:
                self._perform(effect)
            except Exception:  # one failed effect must not drop the others
                log.exception("effect %r failed", effect)

    def _perform(self, effect: Any) -> None:
        if isinstance(effect, Reply):
            with self._waiters_lock:
                future = self._waiters.get(effect.request_id)
            if future is not None:
                _settle(future, effect.message)
        elif isinstance(effect, SendExecute):
            self._send(effect)
        elif isinstance(effect, SetTimer):
            self.timers.set(effect.at, effect.key)
        elif isinstance(effect, Notice):
            self.metrics.notice(effect)  # counted and timed; the event log (Status) has its own line
            if isinstance(effect, Accepted):
                self.accounts.submitted(effect.session, effect.instructions)
        else:
            raise TypeError(f"unknown effect {effect!r}")

    def _stub(self, address: str) -> wire.Stub:
        with self._stubs_lock:
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = wire.Stub("dtorch.Worker", address, "", tls=self.tls)
            return stub

    def _send(self, effect: SendExecute) -> None:
        stub = self._stub(effect.address)
        try:
            token = self.credentials.execute_token(effect.address)
            if token is None:
                raise ConnectionError(f"no credentials for a worker at {effect.address}")
            execute = self.credentials.with_peer_caps(effect.execute, effect.address)
        except Exception as e:  # noqa: BLE001 - any failure to start the call means the batch is not delivered
            self.feed(ev.WorkerUnreachable(effect.worker_id, effect.address, str(e)))
            return

        def deliver() -> None:
            try:
                ack: m.Ack = stub.call("Execute", execute, timeout=self._execute_timeout_s, credential=token)
                problem = "" if ack.ok else f"refused batch {effect.execute.seq}: {ack.message}"
            except Exception as e:  # noqa: BLE001
                problem = str(e)
            if problem:
                self.feed(ev.WorkerUnreachable(effect.worker_id, effect.address, problem))

        self._sender.send(effect.address, deliver)

    def request(self, make: Callable[[Hashable], ev.Event], wait_s: float = REPLY_WAIT_S) -> Any:
        """Feed a request event and wait for its Reply; refusals raise ProtocolError / RemoteError."""
        request_id = next(self._ids)
        future: Future = Future()
        with self._waiters_lock:
            self._waiters[request_id] = future
        try:
            try:
                self.feed(make(request_id))
            except Exception as e:  # a bug in the core: the call gets INTERNAL (and the log a traceback)
                raise InternalError(f"internal controller error: {type(e).__name__}: {e}") from e
            wire.on_call_end(lambda: _settle(future, _GAVE_UP))  # a caller that gave up frees this thread at once
            try:
                message = future.result(timeout=wait_s)
            except FutureTimeout:
                raise wire.RemoteError(f"the controller did not answer within {wait_s:g}s") from None
            if message is _GAVE_UP:
                raise wire.RemoteError("the caller gave up")
        finally:
            with self._waiters_lock:
                self._waiters.pop(request_id, None)
        if isinstance(message, Refusal):
            text = " ".join(message.message.split())  # gRPC details travel best as one line
            raise REFUSALS.get(message.kind, wire.RemoteError)(text)
        return message

    def snapshot(self) -> m.StatusReply | None:
        """The core's status as an admin sees it (metrics, usage); None when the core does not answer."""
        try:
            return self.request(lambda rid: ev.Status(rid, m.StatusRequest(), ev.OPERATOR), wait_s=5.0)
        except Exception:  # noqa: BLE001 - observing must never break anything
            log.exception("status snapshot failed")
            return None

    def keep_accounts(self, interval_s: float = USAGE_INTERVAL_S, usage: UsageLog | None = None) -> None:
        """Settle each session's usage every `interval_s` seconds (and when it closes), appending the records to
        `usage` when given (usage.py); the per-tenant metrics come from the same accounts."""
        self.usage = usage

        def loop() -> None:
            while not self._usage_stop.wait(interval_s):
                self._write_usage()

        self._usage_thread = threading.Thread(target=loop, name="dtorch-usage", daemon=True)
        self._usage_thread.start()

    def _write_usage(self, only: str | None = None, who: ev.Principal | None = None) -> None:
        """Usage records up to now (`only`: of that session, if `who` may name it)."""
        status = self.snapshot()
        if status is not None and only is not None and who is not None and not who.admin and not any(
                s.session == only and s.tenant == who.tenant for s in status.sessions):
            return
        if status is not None:
            records = self.accounts.take(status, only)
            if self.usage is not None:
                self.usage.append(records)

    def close(self) -> None:
        """Answer requests still parked (a Sync may wait for minutes), stop the timers, close worker channels."""
        if self._usage_thread is not None:  # the last interval, while the core still answers
            self._usage_stop.set()
            self._usage_thread.join(10.0)
            self._write_usage()
            if self.usage is not None:
                self.usage.close()
        with self._waiters_lock:
            parked = list(self._waiters.values())
        for future in parked:
            _settle(future, Refusal("refused", "the controller is shutting down"))
        self.timers.stop()
        self._sender.close()
        with self._stubs_lock:
            stubs, self._stubs = list(self._stubs.values()), {}
        for stub in stubs:
            stub.close()

    # ------------------------------------------------------------ the service table (callers are authenticated)

    def _who(self, caller: auth.Caller) -> ev.Principal:
        """The core's view of a tenant or admin caller (its sessions are its tenant's; quotas from the key file)."""
        return ev.Principal(tenant=caller.name, admin=caller.role == auth.ADMIN, quota=self.quotas(caller.name))

    @contextmanager
    def _timed(self, method: str) -> Iterator[None]:
        started = self._clock()
        try:
            yield
        finally:
            self.metrics.timed(method, self._clock() - started)

    def OpenSession(self, request: m.OpenSession, caller: auth.Caller) -> m.SessionOpened:
        who = self._who(caller)
        with self._timed("OpenSession"):
            reply: m.SessionOpened = self.request(lambda rid: ev.OpenSession(rid, request, who))
        self.accounts.opened(reply.session, caller.name, request.name)
        return reply

    def OpenMesh(self, request: m.OpenMesh, caller: auth.Caller) -> m.MeshPlaced:
        who = self._who(caller)
        with self._timed("OpenMesh"):
            reply: m.MeshPlaced = self.request(lambda rid: ev.OpenMesh(rid, request, who))
        self.metrics.mesh(request.session, reply)
        if not reply.placed:
            return reply
        locations, caps = self.credentials.for_client(request.session, reply.locations, reply.memory_cap)
        return msgspec.structs.replace(reply, locations=locations, caps=caps)

    def Submit(self, request: m.Submit, caller: auth.Caller) -> m.SubmitReply:
        who = self._who(caller)
        with self._timed("Submit"):
            reply: m.SubmitReply = self.request(lambda rid: ev.Submit(rid, request, who))
        return reply  # its instructions are counted when the core accepts them (`_perform`)

    def Sync(self, request: m.Sync, caller: auth.Caller) -> m.SyncReply:
        who = self._who(caller)
        if request.timeout_s > MAX_WAIT_S:
            request = msgspec.structs.replace(request, timeout_s=MAX_WAIT_S)
        wait = min(request.timeout_s, self.core.config.max_sync_timeout_s) + SYNC_GRACE_S
        with self._sync_slot(request.session), self._timed("Sync"):
            if request.instrs:  # batch `upto` rides along (protocol 1.7): accepted first, as its Submit would be
                batch = m.Submit(session=request.session, seq=request.upto, instrs=request.instrs)
                self.request(lambda rid: ev.Submit(rid, batch, who, carried=True))
                request = msgspec.structs.replace(request, instrs=[])
            reply: m.SyncReply = self.request(lambda rid: ev.Sync(rid, request, who), wait_s=wait)
        locations, caps = self.credentials.for_client(request.session, reply.locations, reply.memory_cap)
        return msgspec.structs.replace(reply, locations=locations, caps=caps)

    @contextmanager
    def _sync_slot(self, session: str) -> Iterator[None]:
        with self._waiters_lock:
            n = self._syncs.get(session, 0)
            if n >= SYNCS_PER_SESSION:
                raise wire.LimitExceeded(f"Sync refused: session {session[:8]} already has {n} Syncs waiting "
                                         f"(limit {SYNCS_PER_SESSION})")
            self._syncs[session] = n + 1
        try:
            yield
        finally:
            with self._waiters_lock:
                n = self._syncs.pop(session) - 1
                if n:
                    self._syncs[session] = n

    def CloseSession(self, request: m.CloseSession, caller: auth.Caller) -> m.Ack:
        who = self._who(caller)
        self._write_usage(only=request.session, who=who)  # up to now; its last record follows once it is gone
        with self._timed("CloseSession"):
            reply: m.Ack = self.request(lambda rid: ev.CloseSession(rid, request, who))
        if reply.ok:  # another tenant's session (or none) is no close: its queue wait stays
            self.metrics.closed(request.session)
        return reply

    def KeepAlive(self, request: m.KeepAlive, caller: auth.Caller) -> m.KeepAliveReply:
        who = self._who(caller)
        with self._timed("KeepAlive"):
            return self.request(lambda rid: ev.KeepAlive(rid, request, who))

    def Status(self, request: m.StatusRequest, caller: auth.Caller) -> m.StatusReply:
        """The core's view for this caller, with client addresses, and capabilities for the caller's own sessions
        (a client that lost track of a device finds it, and its capability, here)."""
        who = self._who(caller)
        with self._timed("Status"):
            reply: m.StatusReply = self.request(lambda rid: ev.Status(rid, request, who))
        address = {w.worker: w.address for w in reply.workers}
        sessions = []
        for s in reply.sessions:
            if s.tenant == caller.name:
                where = {d: address[w] for d, w in s.devices.items() if w in address}
                s = msgspec.structs.replace(s, caps=self.credentials.for_client(s.session, where, s.memory_cap)[1])
            sessions.append(s)
        workers = [msgspec.structs.replace(w, address=self.credentials.client_address(w.address))
                   for w in reply.workers]
        return msgspec.structs.replace(reply, workers=workers, sessions=sessions)

    def Register(self, request: m.RegisterWorker, caller: auth.Caller) -> m.Registered:
        check_secret(request.secret)
        labels = {k: v for k, v in request.labels.items() if k != "node"}  # a node is the admin's word ...
        if caller.node == auth.ANY_NODE:  # ... who may let the key's workers say it (Kubernetes: the node name)
            if request.labels.get("node"):
                labels["node"] = request.labels["node"]
        elif caller.node:
            labels["node"] = caller.node
        request = msgspec.structs.replace(request, labels=labels)
        rids: list[Hashable] = []

        def register(rid: Hashable) -> ev.Register:
            rids.append(rid)
            self._registering[rid] = (request, caller.key_id)  # recorded by `feed` if the core accepts it
            return ev.Register(rid, request)

        try:
            reply: m.Registered = self.request(register)
        finally:
            for rid in rids:
                self._registering.pop(rid, None)
        return reply

    def Report(self, request: m.WorkerReport, caller: auth.Caller) -> m.ReportReply:
        self.credentials.check_report(caller, request)
        reply: m.ReportReply = self.request(lambda rid: ev.Report(rid, request))
        if reply.ok:
            self.accounts.reported(request.worker, request.sessions)
        return reply

    def Drain(self, request: m.DrainRequest, caller: auth.Caller) -> m.AdminReply:
        wait = min(request.timeout_s, self.core.config.max_sync_timeout_s) + SYNC_GRACE_S
        return self.request(lambda rid: ev.Drain(rid, request), wait_s=wait)

    def Migrate(self, request: m.MigrateRequest, caller: auth.Caller) -> m.AdminReply:
        wait = min(request.timeout_s, self.core.config.max_sync_timeout_s) + SYNC_GRACE_S
        return self.request(lambda rid: ev.Migrate(rid, request), wait_s=wait)


class ControllerServer:
    """A running controller: the gRPC server and the service that drives the core."""

    def __init__(self, grpc_server: grpc.Server, service: ControllerService, address: str,
                 worker_address: str | None = None, health: Health | None = None) -> None:
        self.grpc_server = grpc_server
        self.service = service
        self.address = address  # clients and admins
        self.worker_address = worker_address or address  # workers (the mutual-TLS port under TLS)
        self.health = health

    @property
    def core(self) -> ControllerCore:
        return self.service.core

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving: calls in flight get `grace` seconds, then parked ones are answered and timers stop."""
        if self.health is not None:
            self.health.stop()
        stopped = self.grpc_server.stop(grace)
        stopped.wait((grace or 0) + 0.1)
        self.service.close()
        stopped.wait(1.0)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def run_server(listen: str = "127.0.0.1:0", keys: wire.Authenticate | None = None, config: Config | None = None,
               core: ControllerCore | None = None, policy: Policy | None = None, tls: Tls | None = None,
               worker_listen: str | None = None, quotas: Callable[[str], ev.Quota] | None = None,
               threads: int = SERVER_THREADS, tenant_threads: int = TENANT_THREADS,
               usage: UsageLog | None = None, usage_interval_s: float = USAGE_INTERVAL_S,
               ) -> tuple[ControllerServer, str]:
    """Start a controller on `listen` ("HOST:PORT", port 0 picks one); returns it and the address it serves on.

    `keys` authenticates every call (`Keyring.authenticate`): there is no open mode. With `tls`, clients use
    `listen` (server TLS) and workers `worker_listen` (mutual TLS). Of the `threads` handler threads, tenants'
    calls hold at most `tenant_threads` at once: the rest always serve workers (heartbeats) and admins.
    """
    if keys is None:
        raise ValueError("a controller needs keys to authenticate its callers (a Keyring over the key file)")
    if core is None:
        config = config or Config()
        if config.format_time is format_seconds:  # the default: show wall-clock times instead
            config = replace(config, format_time=wall_clock_formatter())
        core = ControllerCore(config, policy=policy)
    service = ControllerService(core, tls=tls, quotas=quotas)
    health = Health("dtorch.Controller", ready=True)
    try:
        served = wire.serve("dtorch.Controller", service, keys, listen=listen, max_workers=threads, tls=tls,
                            cluster_listen=worker_listen,
                            admission=wire.Admission(min(CALLS_PER_TENANT, tenant_threads), tenant_threads),
                            health=health)
    except BaseException:
        service.close()
        raise
    service.keep_accounts(usage_interval_s, usage)
    return (ControllerServer(served.server, service, served.address, served.cluster_address, health),
            served.address)
