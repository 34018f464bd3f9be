"""The wire's gate and error mapping, on a real in-process gRPC server of the Worker service with a small
implementation: credentials on every kind of RPC (unary, server-streaming, client-streaming), roles, mutual TLS
for cluster roles, admission, message limits, how a handler's refusal reaches the caller (status code, one line,
typed kind), and the end-of-call hooks handlers wait on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m

SERVICE = "dtorch.Worker"
SECRET = "ab" * 32
REFUSALS = {  # Execute's session picks what the handler raises
    "protocol": wire.ProtocolError("bad thing"),
    "denied": wire.PermissionDenied("not\n   yours"),
    "limit": wire.LimitExceeded("too many", m.ErrorKind.MEMORY_CAP),
    "conflict": wire.Conflict("held", m.ErrorKind.MOVED),
    "remote": wire.RemoteError("failed", m.ErrorKind.OP),
    "plain": wire.RemoteError("failed"),
    "bug": ValueError("boom"),
}


class Worker:
    """Execute answers with the caller it saw (or raises REFUSALS[session]; for session "wait", first waits for its
    caller to give up); Pull yields two chunks (or, for session "wait", waits for its caller to give up after the
    first); Put counts its chunks. No PullShards or PutShards."""

    def __init__(self) -> None:
        self.gave_up = threading.Event()

    def Execute(self, req: m.Execute, caller: auth.Caller) -> m.Ack:
        if req.session in REFUSALS:
            raise REFUSALS[req.session]
        if req.session == "wait":  # until its caller gives up
            wire.on_call_end(self.gave_up.set)
            self.gave_up.wait(30)
        return m.Ack(message=f"{caller.role} {caller.name} mtls={caller.mtls} ended={wire.call_ended()}")

    def Pull(self, req: m.PullRequest, caller: auth.Caller) -> Iterator[m.Chunk]:
        if req.session == "wait":  # registered before the first reply: gRPC stops iterating once the caller is gone
            wire.on_call_end(self.gave_up.set)
        yield m.Chunk(data=b"ab", dtype="uint8", shape=[4])
        if req.session == "wait":
            self.gave_up.wait(30)
            return
        yield m.Chunk(data=b"cd")

    def Put(self, chunks: Iterator[m.PutChunk], caller: auth.Caller) -> m.Ack:
        return m.Ack(message=str(sum(len(c.data) for c in chunks)))


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[wire.Served, Worker]]:
    impl = Worker()
    served = wire.serve(SERVICE, impl, auth.WorkerAuth(SECRET).authenticate)
    yield served, impl
    served.server.stop(0)


def _stub(address: str, credential: str) -> wire.Stub:
    return wire.Stub(SERVICE, address, credential)


CONTROLLER = auth.execute_token(SECRET)
CLIENT = auth.mint(SECRET, auth.CLIENT, "s1")
PEER = auth.mint(SECRET, auth.PEER, "s1")
EXECUTE = wire.encode(m.Execute(seq=1, session="s1", cmds=[]))
PULL = wire.encode(m.PullRequest(session="s1", tid=1, device=0))
PUT = [wire.encode(m.PutChunk(session="s1", tid=1, device=0, dtype="uint8", shape=[2], data=b"xy"))]
PAYLOADS = {"Execute": EXECUTE, "Pull": PULL, "Put": PUT}
NO_CREDENTIAL = "no credential: set DTORCH_API_KEY to a key from `dtorch-controller keys create`"
EMPTY = "empty credential: expected 'authorization: Bearer <key>'"


@pytest.mark.parametrize("method", ["Execute", "Pull", "Put"])  # one of each kind of RPC
def test_every_kind_of_call_needs_a_credential_its_worker_issued(server, method):
    served, _ = server
    channel = wire.open_channel(served.address)
    other = "cd" * 32
    cases = {
        None: NO_CREDENTIAL,
        ((auth.HEADER, ""),): EMPTY,
        ((auth.HEADER, "Bearer "),): EMPTY,
        auth.bearer(auth.execute_token(other)): "wrong execute token: Execute is accepted only from this worker's "
                                                "controller",
        auth.bearer(auth.mint(other, auth.CLIENT, "s1")): "capability refused: not issued for this worker",
    }
    for metadata, message in cases.items():
        assert wire.raw_call(channel, SERVICE, method, PAYLOADS[method], metadata) == \
            (grpc.StatusCode.UNAUTHENTICATED, message), (method, metadata)
    channel.close()


@pytest.mark.parametrize("method, allowed", [("Execute", {"controller"}), ("Pull", {"client", "peer"}),
                                             ("Put", {"client"})])
def test_each_method_takes_only_its_roles(server, method, allowed):
    served, _ = server
    channel = wire.open_channel(served.address)
    described = {"controller": "the controller credential", "client": "a client capability for session s1",
                 "peer": "a peer capability for session s1"}
    needs = " or ".join(sorted(allowed))
    for role, credential in (("controller", CONTROLLER), ("client", CLIENT), ("peer", PEER)):
        code, details = wire.raw_call(channel, SERVICE, method, PAYLOADS[method], auth.bearer(credential))
        if role in allowed:
            assert (code, details) == (grpc.StatusCode.OK, ""), (method, role)
        else:
            assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED,
                                       f"{method} needs {needs} credentials; this call came with {described[role]}")
    channel.close()


def test_the_handler_gets_the_caller_and_the_decoded_request(server):
    served, _ = server
    stub = _stub(served.address, CONTROLLER)
    assert stub.call("Execute", m.Execute(seq=1, session="s1", cmds=[])) == \
        m.Ack(message="controller  mtls=False ended=False")
    assert [c.data for c in stub.stream("Pull", m.PullRequest(session="s1", tid=1, device=0),
                                        credential=PEER)] == [b"ab", b"cd"]
    assert stub.send_stream("Put", [m.PutChunk(session="s1", tid=1, device=0, dtype="uint8", shape=[3], data=b"x" * n)
                                    for n in (3, 4, 5)], credential=CLIENT) == m.Ack(message="12")
    future = stub.call_future("Execute", m.Execute(seq=2, session="s1", cmds=[]))
    assert stub.decode_reply("Execute", future).message.startswith("controller ")
    future = stub.send_stream_future("Put", [m.PutChunk(session="s1", tid=1, device=0, dtype="uint8", shape=[1],
                                                        data=b"z")], credential=CLIENT)
    assert stub.decode_reply("Put", future) == m.Ack(message="1")
    stub.set_credential(CLIENT)
    assert stub.call("Execute", m.Execute(seq=3, session="s1", cmds=[]), credential=CONTROLLER).ok
    with pytest.raises(PermissionError, match="refused Execute: Execute needs controller credentials"):
        stub.call("Execute", m.Execute(seq=4, session="s1", cmds=[]))
    stub.close()


def test_a_refusal_reaches_the_caller_as_its_kind_in_one_line(server):
    served, _ = server
    target = served.address
    stub = _stub(target, CONTROLLER)
    expected = {
        "protocol": (wire.ProtocolError, f"{target} refused Execute: bad thing", None),
        "denied": (PermissionError, f"{target} refused Execute: not yours", None),
        "limit": (wire.LimitExceeded, f"{target} refused Execute: too many", m.ErrorKind.MEMORY_CAP),
        "conflict": (wire.Conflict, f"{target} refused Execute: held", m.ErrorKind.MOVED),
        "remote": (wire.RemoteError, f"Execute on {target} failed: failed", m.ErrorKind.OP),
        "plain": (wire.RemoteError, f"Execute on {target} failed: failed", None),
        "bug": (wire.RemoteError, f"Execute on {target} failed: internal error in Execute: ValueError", None),
    }
    for session, (kind, message, error_kind) in expected.items():
        with pytest.raises(Exception) as e:
            stub.call("Execute", m.Execute(seq=1, session=session, cmds=[]))
        assert (type(e.value), str(e.value), getattr(e.value, "kind", None)) == (kind, message, error_kind), session
    channel = wire.open_channel(target)
    statuses = {session: wire.raw_call(channel, SERVICE, "Execute",
                                       wire.encode(m.Execute(seq=1, session=session, cmds=[])),
                                       auth.bearer(CONTROLLER))[0] for session in REFUSALS}
    assert statuses == {"protocol": grpc.StatusCode.INVALID_ARGUMENT, "denied": grpc.StatusCode.PERMISSION_DENIED,
                        "limit": grpc.StatusCode.RESOURCE_EXHAUSTED, "conflict": grpc.StatusCode.ALREADY_EXISTS,
                        "remote": grpc.StatusCode.FAILED_PRECONDITION, "plain": grpc.StatusCode.FAILED_PRECONDITION,
                        "bug": grpc.StatusCode.INTERNAL}
    # a method the implementation lacks is gRPC's UNIMPLEMENTED, which the stub reports as a plain failure
    assert wire.raw_call(channel, SERVICE, "PullShards", b"", auth.bearer(PEER))[0] == grpc.StatusCode.UNIMPLEMENTED
    channel.close()
    stub.close()


def test_a_message_over_its_methods_limit_is_refused_before_decoding(server):
    served, _ = server
    channel = wire.open_channel(served.address)
    limit = wire.REQUEST_LIMITS["Pull"]
    assert limit == 64 << 10
    over = wire.raw_call(channel, SERVICE, "Pull", b"\xc1" * (limit + 1), auth.bearer(CLIENT))
    assert over == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Pull message of {limit + 1} bytes is over the limit of {limit} bytes")
    at = wire.raw_call(channel, SERVICE, "Pull", b"\xc1" * limit, auth.bearer(CLIENT))  # at the limit: decoded
    assert at[0] == grpc.StatusCode.INVALID_ARGUMENT and at[1].startswith("bad PullRequest message: ")
    big = wire.encode(m.PutChunk(session="s1", tid=1, device=0, dtype="uint8", shape=[1],
                                 data=bytes(wire.REQUEST_LIMITS["Put"])))
    code, details = wire.raw_call(channel, SERVICE, "Put", [PUT[0], big], auth.bearer(CLIENT))  # each of a stream
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(f"Put message of {len(big)} bytes")
    channel.close()


def test_the_limits_are_small_where_messages_are_small_by_nature():
    assert set(wire.REQUEST_LIMITS) == {name for methods in wire.SERVICES.values() for name in methods}
    assert max(wire.REQUEST_LIMITS.values()) == wire.MAX_MESSAGE_BYTES
    for method in ("CloseSession", "KeepAlive", "Status", "Drain", "Migrate"):
        assert wire.REQUEST_LIMITS[method] <= 4 << 10, method
    assert wire.REQUEST_LIMITS["Sync"] == wire.REQUEST_LIMITS["Submit"]  # it may carry a batch (1.7)
    assert wire.REQUEST_LIMITS["Put"] > wire.CHUNK_BYTES  # a full chunk with its header fits


def test_under_tls_cluster_roles_must_come_with_a_client_certificate():
    """The gate of a TLS server refuses a cluster role whose call has no verified client certificate, and lets
    clients in (here on a plain port, so no call has one)."""
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((wire.service_handler(SERVICE, Worker(), auth.WorkerAuth(SECRET).authenticate,
                                                          tls=True),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = wire.open_channel(f"127.0.0.1:{port}")
    try:
        assert wire.raw_call(channel, SERVICE, "Execute", EXECUTE, auth.bearer(CONTROLLER)) == (
            grpc.StatusCode.PERMISSION_DENIED, "Execute from the controller credential must come over mutual TLS "
            "(the cluster port, with a certificate signed by the cluster CA)")
        assert wire.raw_call(channel, SERVICE, "Pull", PULL, auth.bearer(PEER))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert wire.raw_call(channel, SERVICE, "Pull", PULL, auth.bearer(CLIENT)) == (grpc.StatusCode.OK, "")
    finally:
        channel.close()
        server.stop(0)


def test_serving_tls_needs_a_cluster_port():
    with pytest.raises(ValueError) as e:
        wire.serve(SERVICE, Worker(), auth.WorkerAuth(SECRET).authenticate, tls=object())  # type: ignore[arg-type]
    assert str(e.value) == "dtorch.Worker with TLS needs a second address for the cluster (mutual TLS) port"


def test_admission_counts_tenants_and_clients_only():
    admission = wire.Admission(per_caller=2, shared=3)
    alice, bob = auth.Caller(auth.TENANT, "alice", key_id="k1"), auth.Caller(auth.TENANT, "bob", key_id="k2")
    carol = auth.Caller(auth.CLIENT, "s-carol")

    def refused(caller: auth.Caller, method: str = "Sync") -> str:
        with pytest.raises(wire.LimitExceeded) as e, admission.admit(caller, method):
            pass
        return str(e.value)

    with admission.admit(alice, "Sync"), admission.admit(alice, "Submit"):
        assert refused(alice, "Submit") == ("Submit refused: tenant 'alice' (key k1) already has 2 calls in flight "
                                            "(limit 2 per caller)")
        with admission.admit(carol, "Pull"):
            assert admission.in_flight() == 3
            assert refused(bob) == "Sync refused: the server is serving 3 tenant calls (limit 3); retry shortly"
            for uncounted in (auth.Caller(auth.ADMIN, "ops"), auth.Caller(auth.WORKER), auth.Caller(auth.CONTROLLER),
                              auth.Caller(auth.PEER, "s1")):
                with admission.admit(uncounted, "Status"), admission.admit(uncounted, "Status"), \
                        admission.admit(uncounted, "Status"):
                    assert admission.in_flight() == 3
        assert admission.in_flight() == 2
        with admission.admit(bob, "Sync"):  # alice's limit is hers
            assert admission.in_flight() == 3
    assert admission.in_flight() == 0
    with pytest.raises(RuntimeError), admission.admit(alice, "Sync"):
        raise RuntimeError("the handler failed")
    with admission.admit(alice, "Sync"), admission.admit(alice, "Sync"):  # a failed call gave its place back
        assert admission.in_flight() == 2


def test_the_gate_applies_admission_to_tenant_roles_only():
    served = wire.serve(SERVICE, Worker(), auth.WorkerAuth(SECRET).authenticate,
                        admission=wire.Admission(per_caller=0, shared=10))
    channel = wire.open_channel(served.address)
    try:
        assert wire.raw_call(channel, SERVICE, "Put", PUT, auth.bearer(CLIENT)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Put refused: a client capability for session s1 already has 0 calls in flight (limit 0 per caller)")
        assert wire.raw_call(channel, SERVICE, "Execute", EXECUTE, auth.bearer(CONTROLLER)) == (grpc.StatusCode.OK, "")
        assert wire.raw_call(channel, SERVICE, "Pull", PULL, auth.bearer(PEER)) == (grpc.StatusCode.OK, "")
    finally:
        channel.close()
        served.server.stop(0)


def test_a_handler_learns_when_its_caller_gave_up(server):
    served, impl = server
    impl.gave_up.clear()
    stub = _stub(served.address, CLIENT)
    call, replies = stub.open_stream("Pull", m.PullRequest(session="wait", tid=1, device=0))
    assert next(replies).data == b"ab"
    call.cancel()
    assert impl.gave_up.wait(30)
    stub.close()


def test_call_end_callbacks_run_once_each_even_when_one_fails():
    end, seen = wire._CallEnd(), []

    def boom() -> None:
        raise RuntimeError("a failing callback")

    end.add(lambda: seen.append(1))
    end.add(boom)
    end.add(lambda: seen.append(2))
    assert seen == [] and not end.ended
    end.end()
    assert seen == [1, 2] and end.ended
    end.add(lambda: seen.append(3))  # added after the end: runs at once
    end.end()
    assert seen == [1, 2, 3]
    assert not wire.call_ended()  # no call on this thread: nothing ended, nothing registered
    wire.on_call_end(lambda: seen.append(4))
    assert seen == [1, 2, 3]


def test_unreachable_and_late_peers_are_named():
    stub = _stub("127.0.0.1:1", CONTROLLER)
    with pytest.raises(ConnectionError) as e:
        stub.call("Execute", m.Execute(seq=1, session="s1", cmds=[]), timeout=10)
    assert str(e.value).startswith("cannot reach 127.0.0.1:1 (Execute): ")
    stub.close()


def test_a_deadline_is_a_timeout_naming_method_and_peer(server):
    served, impl = server
    impl.gave_up.clear()
    stub = _stub(served.address, CLIENT)
    with pytest.raises(TimeoutError) as e:
        list(stub.stream("Pull", m.PullRequest(session="wait", tid=1, device=0), timeout=0.5))
    assert str(e.value) == f"Pull on {served.address} timed out"
    assert impl.gave_up.wait(30)
    stub.close()


def test_a_future_call_has_its_deadline_too(server):
    served, impl = server
    impl.gave_up.clear()
    stub = _stub(served.address, CONTROLLER)
    future = stub.call_future("Execute", m.Execute(seq=1, session="wait", cmds=[]), timeout=0.5)
    with pytest.raises(TimeoutError) as e:
        stub.decode_reply("Execute", future)
    assert str(e.value) == f"Execute on {served.address} timed out"
    assert impl.gave_up.wait(30)
    stub.close()


def _ipv6() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6(), reason="this host has no IPv6 loopback (::1)")
def test_a_server_listens_on_an_ipv6_address_and_says_where():
    served = wire.serve(SERVICE, Worker(), auth.WorkerAuth(SECRET).authenticate, listen="[::1]:0")
    try:
        host, _, port = served.address.rpartition(":")
        assert host == "[::1]" and int(port) > 0 and served.cluster_address == served.address
        stub = _stub(served.address, CONTROLLER)
        reply = stub.call("Execute", m.Execute(seq=1, session="s1", cmds=[]), timeout=10)
        assert reply.message.startswith("controller")
        stub.close()
    finally:
        served.server.stop(0)


def test_a_failed_tls_handshake_says_what_to_check():
    class Handshake(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "failed to connect to all addresses; last error: UNKNOWN: Ssl handshake failed"

    e = wire._describe(Handshake(), "w:1", "Pull")
    assert isinstance(e, ConnectionError) and str(e) == (
        "TLS handshake with w:1 failed (Pull): its certificate is not signed by the CA given (--tls-ca, "
        "DTORCH_TLS_CA), it does not speak TLS, or it wants a client certificate")


def test_an_unknown_error_kind_reads_as_none():
    class Refusal(grpc.RpcError):
        def __init__(self, value: str) -> None:
            self.value = value

        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self) -> str:
            return "no"

        def trailing_metadata(self) -> tuple:
            return (("other", "op"), (wire.KIND_HEADER, self.value))

    assert wire._describe(Refusal("moved"), "t", "Pull").kind is m.ErrorKind.MOVED
    assert wire._describe(Refusal("exploded"), "t", "Pull").kind is None


def test_payloads_move_in_chunks_of_at_most_the_chunk_size():
    assert [bytes(c) for c in wire.chunks(b"abcde", size=2)] == [b"ab", b"cd", b"e"]
    assert [bytes(c) for c in wire.chunks(b"abcd", size=2)] == [b"ab", b"cd"]
    assert [bytes(c) for c in wire.chunks(b"a", size=2)] == [b"a"]


def test_a_hello_names_both_sides_in_short_printable_form():
    long_role = "r" * 50
    with pytest.raises(wire.ProtocolError) as e:
        wire.check_hello(m.Hello(m.PROTOCOL_VERSION, "0.1", long_role))
    assert str(e.value) == f"unknown role {repr(repr('r' * 40) + '...')} in hello: expected one of ['client', 'worker']"
    with pytest.raises(wire.ProtocolError) as e:
        wire.check_hello(m.Hello("1.0\n", "p\tq", "client"), ours="1.3")
    assert str(e.value) == ("protocol version mismatch: client speaks '1.0\\n' (package 'p\\tq'), this side "
                            "speaks 1.3; expected MAJOR.MINOR")
    hello = wire.hello("worker", "7.7.7")
    assert (hello.role, hello.package_version, hello.protocol_version) == ("worker", "7.7.7", m.PROTOCOL_VERSION)
    wire.check_hello(hello)  # the current version is accepted, for either role
    wire.check_hello(wire.hello("client"), "client")


def test_a_full_chunk_fits_through_the_server(server):
    """gRPC's own default refuses messages over 4 MiB; a chunk of CHUNK_BYTES plus its header must pass."""
    served, _ = server
    stub = _stub(served.address, CLIENT)
    chunk = m.PutChunk(session="s1", tid=1, device=0, dtype="uint8", shape=[wire.CHUNK_BYTES],
                       data=bytes(wire.CHUNK_BYTES))
    assert stub.send_stream("Put", [chunk, chunk]) == m.Ack(message=str(2 * wire.CHUNK_BYTES))
    stub.close()


def test_a_refused_stream_names_the_peer(server):
    served, _ = server
    stub = _stub(served.address, CONTROLLER)
    _, replies = stub.open_stream("Pull", m.PullRequest(session="s1", tid=1, device=0))
    with pytest.raises(PermissionError) as e:
        next(replies)
    assert str(e.value) == (f"{served.address} refused Pull: Pull needs client or peer credentials; this call came "
                            "with the controller credential")
    stub.close()
