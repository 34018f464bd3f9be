"""msgpack over gRPC: generic handlers, validation on receipt, tokens, version handshake, chunking.

No protoc step and no pickle: each RPC carries one msgspec-encoded message (or a
stream of them). `SERVICES` is the table of every method with its request and
reply types; servers and stubs are both built from it, so they cannot disagree.
Every call carries the shared token in metadata and is refused without it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import msgspec

from dtorch_protocol import messages as m
from dtorch_protocol._version import __version__
from dtorch_protocol.health import Health

TOKEN_HEADER = "dtorch-token"
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
        "KeepAlive": (m.KeepAlive, m.Ack, "unary"),
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


class ProtocolError(Exception):
    """A message that does not match its declared type, or a refused handshake."""


class RemoteError(Exception):
    """A peer refused or failed a call; the message is the peer's own one-line reason, `kind` what went wrong
    (None: not said). A server raising it sends `kind` along (trailing metadata), a stub's error carries it."""

    def __init__(self, message: str = "", kind: m.ErrorKind | None = None) -> None:
        super().__init__(message)
        self.kind = kind


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


# ---------------------------------------------------------------- versions and tokens


def hello(role: str, package_version: str = __version__) -> m.Hello:
    """The Hello a `role` ("client" | "worker") opens with; `package_version` is the sender's own package."""
    return m.Hello(protocol_version=m.PROTOCOL_VERSION, package_version=package_version, role=role)


def check_hello(h: m.Hello, ours: str = m.PROTOCOL_VERSION) -> None:
    """Refuse a different protocol major, naming both versions; a newer minor is fine."""
    theirs_major = h.protocol_version.split(".", 1)[0]
    if theirs_major != ours.split(".", 1)[0]:
        raise ProtocolError(
            f"protocol version mismatch: {h.role} speaks {h.protocol_version} "
            f"(package {h.package_version}), this side speaks {ours}")


def token_from_env() -> str:
    return os.environ.get("DTORCH_TOKEN", "")


def _metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, token),)


# ---------------------------------------------------------------- servers


def _token_ok(context: grpc.ServicerContext, token: str) -> bool:
    for key, value in context.invocation_metadata():
        if key == TOKEN_HEADER:
            return hmac.compare_digest(value.encode(), token.encode())
    return not token


def _abort_bad_token(context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing DTORCH_TOKEN")


def _aborting(context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ProtocolError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except RemoteError as e:
        if e.kind is not None:
            context.set_trailing_metadata(((KIND_HEADER, e.kind.value),))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))


def service_handler(service: str, impl: Any, token: str) -> grpc.GenericRpcHandler:
    """Bind `impl.<Method>(request) -> reply` (or iterators for streams) to the table entry of `service`.

    Raising ProtocolError or RemoteError in a method aborts the call with its message.
    """
    handlers = {}
    for name, (req_t, _rep_t, kind) in SERVICES[service].items():
        fn = getattr(impl, name, None)
        if fn is None:  # a partial implementation (a test's fake peer): gRPC answers UNIMPLEMENTED
            continue
        if kind == "unary":
            def unary(raw: bytes, context: grpc.ServicerContext, fn=fn, req_t=req_t) -> bytes:
                if not _token_ok(context, token):
                    _abort_bad_token(context)
                return _aborting(context, lambda: encode(fn(decode(req_t, raw))))

            handlers[name] = grpc.unary_unary_rpc_method_handler(unary)
        elif kind == "stream_out":
            def stream_out(raw: bytes, context: grpc.ServicerContext, fn=fn, req_t=req_t) -> Iterator[bytes]:
                if not _token_ok(context, token):
                    _abort_bad_token(context)
                request = _aborting(context, lambda: decode(req_t, raw))
                for reply in fn(request):
                    yield encode(reply)

            handlers[name] = grpc.unary_stream_rpc_method_handler(stream_out)
        else:
            def stream_in(raws: Iterable[bytes], context: grpc.ServicerContext, fn=fn, req_t=req_t) -> bytes:
                if not _token_ok(context, token):
                    _abort_bad_token(context)
                return _aborting(context, lambda: encode(fn(decode(req_t, r) for r in raws)))

            handlers[name] = grpc.stream_unary_rpc_method_handler(stream_in)
    return grpc.method_handlers_generic_handler(service, handlers)


def serve(service: str, impl: Any, token: str, listen: str = "127.0.0.1:0", max_workers: int = 32,
          health: Health | None = None) -> tuple[grpc.Server, str]:
    """Start a gRPC server for `service`; returns it with the address it actually listens on.

    With `health`, the server also answers the standard gRPC health service (no token: see health.py)."""
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=service),
                         options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((service_handler(service, impl, token),))
    if health is not None:
        health.attach(server)
    host, _, port = listen.rpartition(":")
    bound = server.add_insecure_port(listen)
    if bound == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, f"{host or '127.0.0.1'}:{bound}"


# ---------------------------------------------------------------- clients


def _describe(err: grpc.RpcError, target: str, method: str) -> Exception:
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(f"cannot reach {target} ({method}): {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"{method} on {target} timed out")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return PermissionError(f"{target} refused the connection: {detail}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ProtocolError(f"{target} refused {method}: {detail}")
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


class Stub:
    """A typed caller for one service at one address. Every call has a deadline."""

    def __init__(self, service: str, target: str, token: str, channel: grpc.Channel | None = None) -> None:
        self.service, self.target = service, target
        self.channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._meta = _metadata(token)
        self._calls: dict[str, Any] = {}
        for name, (_req_t, _rep_t, kind) in SERVICES[service].items():
            path = f"/{service}/{name}"
            if kind == "unary":
                self._calls[name] = self.channel.unary_unary(path)
            elif kind == "stream_out":
                self._calls[name] = self.channel.unary_stream(path)
            else:
                self._calls[name] = self.channel.stream_unary(path)

    def _reply_type(self, method: str) -> type:
        return SERVICES[self.service][method][1]

    def call(self, method: str, request: Any, timeout: float = 30.0) -> Any:
        try:
            raw = self._calls[method](encode(request), timeout=timeout, metadata=self._meta)
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None
        return decode(self._reply_type(method), raw)

    def call_future(self, method: str, request: Any, timeout: float = 30.0) -> grpc.Future:
        """Start a unary call; the future's result() is raw bytes (use `decode_reply`)."""
        return self._calls[method].future(encode(request), timeout=timeout, metadata=self._meta)

    def decode_reply(self, method: str, future: grpc.Future) -> Any:
        try:
            return decode(self._reply_type(method), future.result())
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None

    def stream(self, method: str, request: Any, timeout: float = 300.0) -> Iterator[Any]:
        rep_t = self._reply_type(method)
        try:
            for raw in self._calls[method](encode(request), timeout=timeout, metadata=self._meta):
                yield decode(rep_t, raw)
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None

    def send_stream(self, method: str, requests: Iterable[Any], timeout: float = 300.0) -> Any:
        try:
            raw = self._calls[method]((encode(r) for r in requests), timeout=timeout, metadata=self._meta)
        except grpc.RpcError as e:
            raise _describe(e, self.target, method) from None
        return decode(self._reply_type(method), raw)

    def open_stream(self, method: str, request: Any, timeout: float = 300.0) -> tuple[Any, Iterator[Any]]:
        """Start a server-streaming call; returns (call, replies). `call.cancel()` ends it from another thread."""
        call = self._calls[method](encode(request), timeout=timeout, metadata=self._meta)
        rep_t = self._reply_type(method)

        def replies() -> Iterator[Any]:
            try:
                for raw in call:
                    yield decode(rep_t, raw)
            except grpc.RpcError as e:
                raise _describe(e, self.target, method) from None

        return call, replies()

    def send_stream_future(self, method: str, requests: Iterable[Any], timeout: float = 300.0) -> grpc.Future:
        """Start a client-streaming call; `decode_reply(method, future)` waits, `future.cancel()` ends it."""
        return self._calls[method].future((encode(r) for r in requests), timeout=timeout, metadata=self._meta)

    def close(self) -> None:
        self.channel.close()


# ---------------------------------------------------------------- payload chunking


def chunks(data: bytes | memoryview, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Split a payload so no message nears gRPC's limit; an empty payload is one empty chunk."""
    view = memoryview(data)
    if len(view) == 0:
        yield view
        return
    for start in range(0, len(view), size):
        yield view[start:start + size]
