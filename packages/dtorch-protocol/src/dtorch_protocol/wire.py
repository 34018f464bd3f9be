"""msgpack over gRPC: generic handlers, validation on receipt, credentials, version handshake, chunking.

No protoc step and no pickle: each RPC carries one msgspec-encoded message (or a
stream of them). `SERVICES` is the table of every method with its request and
reply types; servers and stubs are both built from it, so they cannot disagree.

Every call is checked in this order, before its handler runs (`service_handler`):
1. the credential (`dtorch_protocol.auth`): none, empty or unknown is UNAUTHENTICATED;
2. the caller's role against `auth.ROLES` (and mutual TLS for cluster roles when the server runs TLS):
   PERMISSION_DENIED;
3. admission (`Admission`): concurrent calls per caller and per class of caller, so tenants cannot take every
   handler thread (heartbeats and Execute always find one): RESOURCE_EXHAUSTED;
4. each message's size against `REQUEST_LIMITS` and its type (msgspec, with the bounds written on the
   message types): RESOURCE_EXHAUSTED / INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import grpc
import msgspec

from dtorch_protocol import auth
from dtorch_protocol import messages as m
from dtorch_protocol._version import __version__
from dtorch_protocol.health import Health
from dtorch_protocol.tls import Tls

log = logging.getLogger("dtorch_protocol.wire")

KIND_HEADER = "dtorch-error-kind"  # trailing metadata of a refused call: its `messages.ErrorKind`
CHUNK_BYTES = 4 << 20  # tensor payloads move in 4 MiB pieces, far below the message limit
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_http_proxy", 0),
]

# method -> (request type, reply type, kind); kind: "unary" | "stream_out" (server streams) | "stream_in"
SERVICES: dict[str, dict[str, tuple[type, type, str]]] = {
    "dtorch.Controller": {
        "OpenSession": (m.OpenSession, m.SessionOpened, "unary"),
        "OpenMesh": (m.OpenMesh, m.MeshPlaced, "unary"),
        "Submit": (m.Submit, m.SubmitReply, "unary"),
        "Sync": (m.Sync, m.SyncReply, "unary"),
        "CloseSession": (m.CloseSession, m.Ack, "unary"),
        "KeepAlive": (m.KeepAlive, m.KeepAliveReply, "unary"),
        "Status": (m.StatusRequest, m.StatusReply, "unary"),
        "Register": (m.RegisterWorker, m.Registered, "unary"),
        "Report": (m.WorkerReport, m.ReportReply, "unary"),
        "Drain": (m.DrainRequest, m.AdminReply, "unary"),
        "Migrate": (m.MigrateRequest, m.AdminReply, "unary"),
    },
    "dtorch.Worker": {
        "Execute": (m.Execute, m.Ack, "unary"),
        "Pull": (m.PullRequest, m.Chunk, "stream_out"),
        "Put": (m.PutChunk, m.Ack, "stream_in"),
        "PullShards": (m.ShardsRequest, m.ShardsChunk, "stream_out"),
        "PutShards": (m.ShardsChunk, m.Ack, "stream_in"),
        "Profile": (m.ProfileRequest, m.ProfileReply, "unary"),
    },
}

KIB, MIB = 1 << 10, 1 << 20
# Largest request message each method accepts (each message of a stream), far below gRPC's own limit where
# the message is small by nature: a huge KeepAlive is an attack, not a keep-alive.
REQUEST_LIMITS: dict[str, int] = {
    "OpenSession": 16 * KIB, "OpenMesh": 1 * MIB, "Submit": MAX_MESSAGE_BYTES, "Sync": MAX_MESSAGE_BYTES,
    "CloseSession": 4 * KIB, "KeepAlive": 4 * KIB, "Status": 1 * KIB, "Register": 64 * KIB, "Report": 16 * MIB,
    "Drain": 4 * KIB, "Migrate": 4 * KIB,
    "Execute": MAX_MESSAGE_BYTES, "Pull": 64 * KIB, "Put": CHUNK_BYTES + 64 * KIB, "PullShards": 16 * MIB,
    "PutShards": MAX_MESSAGE_BYTES, "Profile": 4 * KIB,
}


class ProtocolError(Exception):
    """A message that does not match its declared type, or a refused handshake."""


class RemoteError(Exception):
    """A peer refused or failed a call; the message is the peer's own one-line reason, `kind` what went wrong
    (None: not said). A server raising it sends `kind` along (trailing metadata), a stub's error carries it."""

    def __init__(self, message: str = "", kind: m.ErrorKind | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class PermissionDenied(RemoteError):
    """The caller is known but may not do this (another tenant's session, an admin-only call, ...)."""


class LimitExceeded(RemoteError):
    """A limit or quota refused the call at once; the message names the limit."""


class Unimplemented(RemoteError):
    """The server has no such method: it runs an older version (a client goes on without what it asked for)."""


class Conflict(RemoteError):
    """Refused for now because of something that may change (an address held by a live worker): retry later."""


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(kind: type, data: bytes) -> Any:
    """Decode and validate; raises ProtocolError naming the message and the bad field."""
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return dec.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProtocolError(f"bad {kind.__name__} message: {e}") from None
    except RecursionError:
        raise ProtocolError(f"bad {kind.__name__} message: nested too deeply") from None


# ---------------------------------------------------------------- versions


def hello(role: str, package_version: str = __version__) -> m.Hello:
    """The Hello a `role` ("client" | "worker") opens with; `package_version` is the sender's own package."""
    return m.Hello(protocol_version=m.PROTOCOL_VERSION, package_version=package_version, role=role)


# The handshake (the policy is in docs/architecture.md, "Versions"). Protocol versions are MAJOR.MINOR; a minor
# only adds (fields with defaults, new messages), a major may change anything. A controller speaking X.Y serves:
#
#   role     major   minor   because
#   client   X       <= Y    the controller reads every older client message; a newer client's new fields would be
#                            dropped unread (decoding skips unknown fields), so it is refused
#   worker   X       >= Y    a worker reads every older command; an older worker would skip newer commands' fields
#                            (memory caps) and run them wrongly, so it is refused
#
# So upgrade workers first, then the controller, then clients. Each package pins the dtorch-protocol minor it was
# written for (`dtorch-protocol~=X.Y.0`), so its Hello names the protocol it really speaks.
MINORS: dict[str, tuple[Callable[[int, int], bool], str]] = {  # role -> (theirs, ours accepted?, the fix)
    "client": (lambda theirs, ours: theirs <= ours,
               "clients may be older than the controller, not newer: upgrade dtorch-controller"),
    "worker": (lambda theirs, ours: theirs >= ours,
               "workers may be newer than the controller, not older: upgrade dtorch-worker"),
}


_VERSION = re.compile(r"(\d{1,9})\.(\d{1,9})", re.ASCII)


def _major_minor(version: str) -> tuple[int, int] | None:
    found = _VERSION.fullmatch(version)
    return (int(found[1]), int(found[2])) if found else None


def _shown(text: str, limit: int = 40) -> str:
    """A peer's string as it may appear in a one-line refusal: short and printable, else quoted and cut."""
    if len(text) <= limit and text.isprintable():
        return text
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def check_hello(h: m.Hello, role: str | None = None, ours: str = m.PROTOCOL_VERSION) -> None:
    """Refuse a Hello the table above refuses, or one of another `role` than expected (None: any role), with one
    line naming both versions and what to upgrade."""
    if role is not None and h.role != role:
        raise ProtocolError(f"expected a {role} hello, got role {_shown(h.role)!r}")
    if h.role not in MINORS:
        raise ProtocolError(f"unknown role {_shown(h.role)!r} in hello: expected one of {sorted(MINORS)}")
    theirs, mine = _major_minor(h.protocol_version), _major_minor(ours)
    assert mine is not None, ours
    who = (f"{h.role} speaks {_shown(h.protocol_version)} (package {_shown(h.package_version)}), this side speaks "
           f"{ours}")
    if theirs is None:
        raise ProtocolError(f"protocol version mismatch: {who}; expected MAJOR.MINOR")
    if theirs[0] != mine[0]:
        raise ProtocolError(f"protocol version mismatch: {who}; the majors must be equal")
    accepted, fix = MINORS[h.role]
    if not accepted(theirs[1], mine[1]):
        raise ProtocolError(f"protocol version mismatch: {who}; {fix}")


# ---------------------------------------------------------------- servers


class Admission:
    """Bounds on concurrent calls: `per_caller` for each tenant (or session capability), `shared` for all of
    them together. Callers in auth.CLUSTER_ROLES and admins are not counted: the handler threads beyond
    `shared` stay free for them, so tenant traffic can never starve heartbeats or Execute."""

    def __init__(self, per_caller: int, shared: int) -> None:
        self.per_caller, self.shared = per_caller, shared
        self._lock = threading.Lock()
        self._by_caller: dict[tuple[str, str], int] = {}
        self._total = 0

    @contextmanager
    def admit(self, caller: auth.Caller, method: str) -> Iterator[None]:
        if caller.role not in (auth.TENANT, auth.CLIENT):
            yield
            return
        key = (caller.role, caller.name)
        with self._lock:
            mine = self._by_caller.get(key, 0)
            if mine >= self.per_caller:
                raise LimitExceeded(f"{method} refused: {caller.describe()} already has {mine} calls in flight "
                                    f"(limit {self.per_caller} per caller)")
            if self._total >= self.shared:
                raise LimitExceeded(f"{method} refused: the server is serving {self._total} tenant calls (limit "
                                    f"{self.shared}); retry shortly")
            self._by_caller[key] = mine + 1
            self._total += 1
        try:
            yield
        finally:
            with self._lock:
                self._total -= 1
                left = self._by_caller[key] - 1
                if left:
                    self._by_caller[key] = left
                else:
                    del self._by_caller[key]

    def in_flight(self) -> int:
        with self._lock:
            return self._total


Authenticate = Callable[[str], auth.Caller]
_call = threading.local()  # the call the current handler thread serves (`_CallEnd`), or None


class _CallEnd:
    """Set when a call terminates (done, cancelled, deadline passed); runs the callbacks handlers registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ended = False
        self._callbacks: list[Callable[[], Any]] = []

    def add(self, fn: Callable[[], Any]) -> None:
        with self._lock:
            if not self.ended:
                self._callbacks.append(fn)
                return
        fn()

    def end(self) -> None:
        with self._lock:
            self.ended, callbacks, self._callbacks = True, self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one failing callback must not keep the others from running
                log.exception("call-end callback failed")


def call_ended() -> bool:
    """Whether the call this handler thread serves has ended: its caller cancelled or its deadline passed."""
    state = getattr(_call, "state", None)
    return state is not None and state.ended


def on_call_end(fn: Callable[[], Any]) -> None:
    """Run `fn` when the call this handler thread serves ends (at once if it has). A handler that waits (a parked
    Sync, a Pull waiting for a shard) wakes itself this way, so a caller that gave up does not keep a thread."""
    state = getattr(_call, "state", None)
    if state is not None:
        state.add(fn)


@contextmanager
def _tracking(context: grpc.ServicerContext) -> Iterator[None]:
    state = _CallEnd()
    if not context.add_callback(state.end):
        state.end()  # already over
    _call.state = state
    try:
        yield
    finally:
        _call.state = None
_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [  # most specific first
    (ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (RemoteError, grpc.StatusCode.FAILED_PRECONDITION),
]


def _abort(context: grpc.ServicerContext, e: Exception, method: str) -> None:
    for kind, code in _CODES:
        if isinstance(e, kind):
            if isinstance(e, RemoteError) and e.kind is not None:
                context.set_trailing_metadata(((KIND_HEADER, e.kind.value),))
            context.abort(code, " ".join(str(e).split()))
    log.exception("unhandled exception in %s", method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}")


class _Gate:
    """Everything checked before a method runs (module docstring, steps 1-3), for one method of a service."""

    def __init__(self, service: str, method: str, authenticate: Authenticate, tls: bool,
                 admission: Admission | None) -> None:
        self.method, self.authenticate, self.tls, self.admission = method, authenticate, tls, admission
        self.roles = auth.ROLES[service][method]
        self.limit = REQUEST_LIMITS[method]

    def caller(self, context: grpc.ServicerContext) -> auth.Caller:
        try:
            caller = self.authenticate(auth.credential_of(context.invocation_metadata()))
        except auth.Unauthenticated as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        caller = replace(caller, mtls=context.peer_identities() is not None)
        if caller.role not in self.roles:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{self.method} needs {' or '.join(sorted(self.roles))} credentials; this call came with "
                          f"{caller.describe()}")
        if self.tls and caller.role in auth.CLUSTER_ROLES and not caller.mtls:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{self.method} from {caller.describe()} must come over mutual TLS (the cluster port, with "
                          "a certificate signed by the cluster CA)")
        return caller

    @contextmanager
    def admitted(self, caller: auth.Caller) -> Iterator[None]:
        if self.admission is None:
            yield
        else:
            with self.admission.admit(caller, self.method):
                yield

    def decode(self, req_t: type, raw: bytes) -> Any:
        if len(raw) > self.limit:
            raise LimitExceeded(f"{self.method} message of {len(raw)} bytes is over the limit of {self.limit} bytes")
        return decode(req_t, raw)


def service_handler(service: str, impl: Any, authenticate: Authenticate, tls: bool = False,
                    admission: Admission | None = None) -> grpc.GenericRpcHandler:
    """Bind `impl.<Method>(request, caller) -> reply` (or iterators for streams) to the table entry of `service`.

    `authenticate(credential) -> auth.Caller` raises auth.Unauthenticated for anything it does not know.
    Raising ProtocolError, RemoteError or one of its kinds in a method aborts the call with its message and
    status code; anything else is logged and answered INTERNAL.
    """
    handlers = {}
    for name, (req_t, _rep_t, kind) in SERVICES[service].items():
        fn = getattr(impl, name, None)
        if fn is None:  # a partial implementation (a test's fake peer): gRPC answers UNIMPLEMENTED
            continue
        gate = _Gate(service, name, authenticate, tls, admission)
        if kind == "unary":
            def unary(raw: bytes, context: grpc.ServicerContext, fn=fn, req_t=req_t, gate=gate) -> bytes:
                caller = gate.caller(context)
                try:
                    with gate.admitted(caller), _tracking(context):
                        return encode(fn(gate.decode(req_t, raw), caller))
                except Exception as e:  # noqa: BLE001 - mapped to a status code (or INTERNAL, logged)
                    _abort(context, e, gate.method)

            handlers[name] = grpc.unary_unary_rpc_method_handler(unary)
        elif kind == "stream_out":
            def stream_out(raw: bytes, context: grpc.ServicerContext, fn=fn, req_t=req_t, gate=gate,
                           ) -> Iterator[bytes]:
                caller = gate.caller(context)
                try:
                    with gate.admitted(caller), _tracking(context):
                        for reply in fn(gate.decode(req_t, raw), caller):
                            yield encode(reply)
                except Exception as e:  # noqa: BLE001
                    _abort(context, e, gate.method)

            handlers[name] = grpc.unary_stream_rpc_method_handler(stream_out)
        else:
            def stream_in(raws: Iterable[bytes], context: grpc.ServicerContext, fn=fn, req_t=req_t, gate=gate,
                          ) -> bytes:
                caller = gate.caller(context)
                try:
                    with gate.admitted(caller), _tracking(context):
                        return encode(fn((gate.decode(req_t, r) for r in raws), caller))
                except Exception as e:  # noqa: BLE001
                    _abort(context, e, gate.method)

            handlers[name] = grpc.stream_unary_rpc_method_handler(stream_in)
    return grpc.method_handlers_generic_handler(service, handlers)


@dataclass
class Served:
    """A running gRPC server: `address` for clients; `cluster_address` for cluster roles (the mutual-TLS port
    under TLS, else the same as `address`)."""

    server: grpc.Server
    address: str
    cluster_address: str


def _bind(server: grpc.Server, listen: str, credentials: grpc.ServerCredentials | None) -> str:
    host, _, _port = listen.rpartition(":")
    bound = server.add_insecure_port(listen) if credentials is None else server.add_secure_port(listen, credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {listen}")
    return f"{host or '127.0.0.1'}:{bound}"


def serve(service: str, impl: Any, authenticate: Authenticate, listen: str = "127.0.0.1:0", max_workers: int = 32,
          tls: Tls | None = None, cluster_listen: str | None = None, admission: Admission | None = None,
          health: Health | None = None) -> Served:
    """Start a gRPC server for `service` on `listen` ("HOST:PORT", port 0 picks one).

    With `tls`, `listen` is server TLS (clients) and `cluster_listen` (required) mutual TLS (cluster roles).
    With `health`, the server also answers the standard gRPC health service (no credential: see health.py).
    """
    from concurrent.futures import ThreadPoolExecutor

    if tls is not None and not cluster_listen:
        raise ValueError(f"{service} with TLS needs a second address for the cluster (mutual TLS) port")
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=service),
                         options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((service_handler(service, impl, authenticate, tls is not None, admission),))
    if health is not None:
        health.attach(server)
    try:
        address = _bind(server, listen, None if tls is None else tls.server_credentials(require_client_cert=False))
        cluster = address if tls is None else _bind(server, cluster_listen or "",
                                                    tls.server_credentials(require_client_cert=True))
    except BaseException:
        server.stop(None)
        raise
    server.start()
    return Served(server, address, cluster)


# ---------------------------------------------------------------- clients


def _describe(err: grpc.RpcError, target: str, method: str) -> Exception:
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNAVAILABLE and "handshake" in (detail or "").lower():  # gRPC's words, not ours
        return ConnectionError(f"TLS handshake with {target} failed ({method}): its certificate is not signed by "
                               "the CA given (--tls-ca, DTORCH_TLS_CA), it does not speak TLS, or it wants a client "
                               "certificate")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(f"cannot reach {target} ({method}): {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"{method} on {target} timed out")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return PermissionError(f"{target} refused the connection: {detail}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionError(f"{target} refused {method}: {detail}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ProtocolError(f"{target} refused {method}: {detail}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return LimitExceeded(f"{target} refused {method}: {detail}", _kind(err))
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return Conflict(f"{target} refused {method}: {detail}", _kind(err))
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(f"{target} has no {method} (an older version): {detail}")
    return RemoteError(f"{method} on {target} failed: {detail}", _kind(err))


def _kind(err: grpc.RpcError) -> m.ErrorKind | None:
    """The ErrorKind a server sent along with its refusal (an unknown one reads as None)."""
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == KIND_HEADER:
            try:
                return m.ErrorKind(value)
            except ValueError:
                return None
    return None


def open_channel(target: str, tls: Tls | None = None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to `target` with CHANNEL_OPTIONS and `options` (a caller's own, e.g. gRPC's experimental ones)."""
    opts = [*CHANNEL_OPTIONS, *options]
    if tls is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, tls.channel_credentials(), options=opts)


class Stub:
    """A typed caller for one service at one address. Every call has a deadline and carries a credential
    (the stub's own, or `credential=` for that call)."""

    def __init__(self, service: str, target: str, credential: str, channel: grpc.Channel | None = None,
                 tls: Tls | None = None) -> None:
        self.service, self.target = service, target
        self.channel = channel or open_channel(target, tls)
        self._meta = auth.bearer(credential)
        self._calls: dict[str, Any] = {}
        for name, (_req_t, _rep_t, kind) in SERVICES[service].items():
            path = f"/{service}/{name}"
            if kind == "unary":
                self._calls[name] = self.channel.unary_unary(path)
            elif kind == "stream_out":
                self._calls[name] = self.channel.unary_stream(path)
            else:
                self._calls[name] = self.channel.stream_unary(path)

    def set_credential(self, credential: str) -> None:
        self._meta = auth.bearer(credential)

    def _metadata(self, credential: str | None) -> tuple[tuple[str, str], ...]:
        return self._meta if credential is None else auth.bearer(credential)

    def _reply_type(self, method: str) -> type:
        return SERVICES[self.service][method][1]

    def call(self, method: str, request: Any, timeout: float = 30.0, credential: str | None = None) -> Any:
        try:
            raw = self._calls[method](encode(request), timeout=timeout, metadata=self._metadata(credential))
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None
        return decode(self._reply_type(method), raw)

    def call_future(self, method: str, request: Any, timeout: float = 30.0,
                    credential: str | None = None) -> grpc.Future:
        """Start a unary call; the future's result() is raw bytes (use `decode_reply`)."""
        return self._calls[method].future(encode(request), timeout=timeout, metadata=self._metadata(credential))

    def decode_reply(self, method: str, future: grpc.Future) -> Any:
        try:
            return decode(self._reply_type(method), future.result())
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None

    def stream(self, method: str, request: Any, timeout: float = 300.0,
               credential: str | None = None) -> Iterator[Any]:
        rep_t = self._reply_type(method)
        try:
            for raw in self._calls[method](encode(request), timeout=timeout, metadata=self._metadata(credential)):
                yield decode(rep_t, raw)
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None

    def send_stream(self, method: str, requests: Iterable[Any], timeout: float = 300.0,
                    credential: str | None = None) -> Any:
        try:
            raw = self._calls[method]((encode(r) for r in requests), timeout=timeout,
                                      metadata=self._metadata(credential))
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None
        return decode(self._reply_type(method), raw)

    def open_stream(self, method: str, request: Any, timeout: float = 300.0,
                    credential: str | None = None) -> tuple[Any, Iterator[Any]]:
        """Start a server-streaming call; returns (call, replies). `call.cancel()` ends it from another thread."""
        call = self._calls[method](encode(request), timeout=timeout, metadata=self._metadata(credential))
        rep_t = self._reply_type(method)

        def replies() -> Iterator[Any]:
            try:
                for raw in call:
                    yield decode(rep_t, raw)
            except grpc.RpcError as e:
                raise _describe(e, self.target, method) from None

        return call, replies()

    def send_stream_future(self, method: str, requests: Iterable[Any], timeout: float = 300.0,
                           credential: str | None = None) -> grpc.Future:
        """Start a client-streaming call; `decode_reply(method, future)` waits, `future.cancel()` ends it."""
        return self._calls[method].future((encode(r) for r in requests), timeout=timeout,
                                          metadata=self._metadata(credential))

    def close(self) -> None:
        self.channel.close()


def raw_call(channel: grpc.Channel, service: str, method: str, payload: bytes | list[bytes],
             metadata: Iterable[tuple[str, str]] | None, timeout: float = 10.0) -> tuple[grpc.StatusCode, str]:
    """Send raw request bytes (a list of messages for a client stream) to `method`, read every reply, and return
    the call's status code and details. What credential checks and fuzzers use: nothing is encoded or decoded
    here, and an RPC error is an answer, not an exception."""
    kind = SERVICES[service][method][2]
    path = f"/{service}/{method}"
    meta = None if metadata is None else tuple(metadata)
    try:
        if kind == "unary":
            channel.unary_unary(path)(payload, timeout=timeout, metadata=meta)
        elif kind == "stream_out":
            for _ in channel.unary_stream(path)(payload, timeout=timeout, metadata=meta):
                pass
        else:
            channel.stream_unary(path)(iter(payload if isinstance(payload, list) else [payload]), timeout=timeout,
                                       metadata=meta)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


# ---------------------------------------------------------------- payload chunking


def chunks(data: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Split a payload so no message nears gRPC's limit; an empty payload is one empty chunk."""
    view = memoryview(data)
    if len(view) == 0:
        yield view
        return
    for start in range(0, len(view), size):
        yield view[start:start + size]
