"""The `dtorch.Worker` gRPC service: Execute (enqueue), Pull (serve a shard box), Put (upload a shard).

Who may call what is `dtorch_protocol.auth`: Execute only with the controller's execute token; Pull and Put
with a capability for the session named in the request (a client's for its own session; a peer's, from
the controller, also for the session's backup namespaces); PullShards and PutShards with a peer's. Checked
here on top: the request's session is the one the capability covers, a client cannot pose as a planned
peer read (`expected`), a Put never replaces a live shard, and a Put's declared size is admitted (the
session's memory cap here, `max_put_bytes`) before a byte of it is kept. Profile (`dtorch.profile()`) only
with the client capability of the very session it names.

A Put that would take a capped session over its memory cap on this worker is refused with a one-line
reason (the client raises it); so is one for a device that moved away (kind MOVED: the client retries).
A client on this host may pass a Put's bytes, or have a Pull's written, through a shared-memory segment it made
(`dtorch_protocol.segments`: used only if made for the request's session, tid and device).

Execute never waits for execution, and Pull runs on the server's own threads:
a peer that is redistributing must always be able to read our shards, or two
workers pulling from each other would deadlock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from dtorch_protocol import auth, segments, wire
from dtorch_protocol.health import Health
from dtorch_protocol.messages import (
    Ack,
    Chunk,
    ErrorKind,
    Execute,
    ProfileReply,
    ProfileRequest,
    PullRequest,
    PutChunk,
    ShardsChunk,
    ShardsRequest,
)
from dtorch_protocol.tls import Tls
from dtorch_worker import shards
from dtorch_worker.executor import BatchRefused, Executor, one_line
from dtorch_worker.store import Poison, Shard, ShardMissing, TensorStore, format_bytes
from dtorch_worker.telemetry import Telemetry
from dtorch_worker.transfer import into_segment, nbytes, poison_chunk, receive_put, take_box, tensor_chunks

log = logging.getLogger("dtorch_worker.server")

SERVER_THREADS = 128  # Pulls may wait for shards; keep room for Execute, peers and Put meanwhile
CLIENT_THREADS = 48  # at most this many handler threads serve clients at once: peers and Execute keep the rest
SEGMENT = "shared_memory"  # the path label of client bytes that went through a same-host segment
CALLS_PER_SESSION = 16  # concurrent client calls (Pulls waiting for shards, Puts) of one session


def _covered(caller: auth.Caller, session: str, method: str, store: TensorStore) -> None:
    if not auth.covers(caller, session):
        raise wire.PermissionDenied(f"{method} of session {session[:16]!r} refused: the call came with "
                                    f"{caller.describe()}")
    if store.closed(session):
        raise wire.PermissionDenied(f"{method} of session {session[:16]!r} refused: the session was closed")


class WorkerService:
    """Implements the methods of wire.SERVICES["dtorch.Worker"] over a store and an executor."""

    def __init__(self, store: TensorStore, executor: Executor, max_pull_wait_s: float = 600.0,
                 max_put_bytes: int = 0, telemetry: Telemetry | None = None) -> None:
        self.store = store
        self.executor = executor
        self.max_pull_wait_s = max_pull_wait_s
        self.max_put_bytes = max_put_bytes  # largest shard one Put may declare (0: no bound but the caps)
        self.telemetry = telemetry or Telemetry()

    def Execute(self, request: Execute, caller: auth.Caller) -> Ack:
        try:
            if self.executor.submit(request):
                return Ack()
        except BatchRefused as e:
            return Ack(ok=False, message=str(e))
        if self.executor.stopped:
            return Ack(ok=False, message="the worker is stopping")
        # batch numbers come from the controller alone, once each: a repeat means the stream is not what it
        # thinks it is, so it must hear about it (it declares this worker lost) rather than get a silent ok
        return Ack(ok=False, message=f"batch {request.seq} is a duplicate: this worker already ran or queued it")

    def Pull(self, request: PullRequest, caller: auth.Caller) -> Iterator[Chunk]:
        _covered(caller, request.session, "Pull", self.store)
        wire.on_call_end(self.store.wake)  # a caller that gives up ends the wait for the shard
        if request.expected and caller.role != auth.PEER:
            raise wire.PermissionDenied("a planned read (expected=True) is a peer's: a client capability cannot "
                                        "make one")
        key = (request.session, request.tid, request.device)
        counted = not request.expected  # a planned read holds back in-place writes of the shard until counted
        path = "point_to_point" if request.expected else "client"
        try:
            for chunk in self._pull(key, request):
                moved = nbytes(chunk.dtype, chunk.shape) if chunk.in_segment else len(chunk.data)
                self.telemetry.bytes_moved(SEGMENT if chunk.in_segment else path, "out", moved,
                                           key[0] if path == "client" else "")
                if chunk.error and not counted:
                    # an error chunk is the last and reads nothing: count it before the reader can see it
                    counted = True
                    self.store.read_served(key)
                yield chunk
        finally:
            if not counted:  # after the last data chunk went out (they may be views of the shard) or a cancel
                self.store.read_served(key)

    def _pull(self, key: tuple[str, int, int], request: PullRequest) -> Iterator[Chunk]:
        wait = min(max(request.timeout_s, 0.0), self.max_pull_wait_s)
        if request.expected and request.dst >= 0 and not self.store.wait_announced(key, request.dst, wait):
            yield Chunk(data=b"", error=f"this worker never reached the redistribution into tensor {request.dst} "
                                        f"within {wait:g}s", kind=ErrorKind.MISSING)
            return
        early = request.after >= 0 and not request.expected  # a client's early read (store.py): after its mark
        if early and not self.store.wait_readable(key[0], key[2], request.after, wait):
            yield Chunk(data=b"", error=f"this worker's stream did not reach the client's read {request.after} "
                                        f"within {wait:g}s", kind=ErrorKind.MISSING)
            return
        try:
            value = self.store.get(key, wait) if request.expected else self._client_get(key, wait)
        except ShardMissing as e:
            yield Chunk(data=b"", error=str(e), kind=e.kind)
            return
        if isinstance(value, Poison):
            yield poison_chunk(value.report)
            return
        try:
            chunks = self._reply(key, request, value)
        except (ValueError, TypeError, RuntimeError) as e:
            yield Chunk(data=b"", error=one_line(e), kind=ErrorKind.REFUSED)
            return
        yield from chunks

    def _reply(self, key: tuple[str, int, int], request: PullRequest, value: torch.Tensor) -> list[Chunk]:
        """The box written into the client's segment when it named one this worker can open (segments.py rule 4);
        else its bytes as a stream (views of one contiguous copy at most: listing them up front is cheap)."""
        box = take_box(value, request.offset, request.size)
        if request.segment:
            try:
                return [into_segment(request.segment, key, box, self.executor.backend)]
            except segments.SegmentMissing:
                pass  # another host: stream
        return list(tensor_chunks(box, backend=self.executor.backend))

    def _client_get(self, key: tuple[str, int, int], wait: float) -> Shard:
        """A client's read: never of a session that is being rebuilt after a worker loss (it would see
        values from the middle of the replay), so wait for the rebuild first, and again if one starts."""
        deadline = time.monotonic() + wait
        first = True
        while True:
            if not self.store.wait_rebuilt(key[0], deadline - time.monotonic()):
                raise ShardMissing(f"the session's shards on this worker are still being rebuilt after {wait:g}s")
            try:
                return self.store.get(key, wait if first else max(0.0, deadline - time.monotonic()))
            except ShardMissing:
                first = False
                if time.monotonic() >= deadline or not self.store.rebuilding(key[0]) or wire.call_ended():
                    raise

    def _admit_put(self, caller: auth.Caller, key: tuple[str, int, int], declared: int) -> None:
        """Before anything of a Put is kept: its session, that it replaces nothing, and its declared size."""
        _covered(caller, key[0], "Put", self.store)
        self.store.learn_cap(key[0], caller.memory_cap)  # uploads may come before the session's first Execute
        if refused := self.store.refused_upload(key):  # a client's Put again leaves it (store.py)
            raise wire.Conflict(f"Put refused: {refused}", ErrorKind.REFUSED)
        if self.max_put_bytes and declared > self.max_put_bytes:
            raise wire.LimitExceeded(f"Put refused: it declares {format_bytes(declared)}, over this worker's "
                                     f"{format_bytes(self.max_put_bytes)} of memory")
        refused = self.store.admit_upload(key[0], declared)  # over the session's memory cap here
        if refused:
            raise wire.LimitExceeded(refused, ErrorKind.MEMORY_CAP)

    def Put(self, requests: Iterable[PutChunk], caller: auth.Caller) -> Ack:
        try:
            key, tensor, in_segment = receive_put(requests, self.executor.backend,
                                                  lambda key, declared: self._admit_put(caller, key, declared))
        except segments.SegmentMissing as e:
            raise wire.RemoteError(str(e), ErrorKind.NO_SEGMENT) from None
        except segments.SegmentRefused as e:
            raise wire.PermissionDenied(str(e)) from None
        except (ValueError, TypeError) as e:
            raise wire.ProtocolError(one_line(e)) from None
        refused = self.store.put_upload(key, tensor)  # (MOVED or MEMORY_CAP, reason)
        if refused is not None:
            kind, reason = refused
            raise wire.RemoteError(reason, kind)
        self.telemetry.bytes_moved(SEGMENT if in_segment else "client", "in", tensor.numel() * tensor.element_size(),
                                   key[0])
        return Ack()

    def PullShards(self, request: ShardsRequest, caller: auth.Caller) -> Iterator[ShardsChunk]:
        """Whole shards with their aliasing (restores and copies between workers); waits for missing ones.

        With `move`, those devices are leaving for the puller: uploads for them are refused from now on, and
        the ones not adopted yet go along (and are dropped here once sent)."""
        _covered(caller, request.session, "PullShards", self.store)
        wire.on_call_end(self.store.wake)
        wait = min(max(request.timeout_s, 0.0), self.max_pull_wait_s)
        listed = {(tid, device) for device, tids in request.devices.items() for tid in tids}
        extra = []
        if request.move:
            self.store.mark_moved(request.session, list(request.move))
            extra = [k for k in self.store.device_keys(request.session, list(request.move)) if k[1:] not in listed]
        try:
            items = [(tid, device, self.store.get((request.session, tid, device), wait))
                     for device, tids in request.devices.items() for tid in tids]
            items += [(k[1], k[2], v) for k in extra if (v := self.store.peek(k)) is not None]
            packed = shards.pack(items)
        except (ShardMissing, TypeError) as e:
            yield ShardsChunk(error=one_line(e) if not isinstance(e, ShardMissing) else str(e))
            return
        nbytes = packed.nbytes
        in_segment = False
        if request.segment and nbytes >= segments.MIN_BYTES:
            try:  # the puller's segment on this host: the storages go in with system calls, no stream
                segments.append_into(request.segment, request.session,
                                     list(shards.host_parts(packed, self.executor.backend)))
                in_segment = True
            except segments.SegmentMissing:  # another host: stream
                pass
            except segments.SegmentRefused as e:
                yield ShardsChunk(error=str(e))
                return
        for chunk in shards.chunks(packed, backend=self.executor.backend,
                                   segment=request.segment if in_segment else ""):
            self.telemetry.bytes_moved("copy", "out", nbytes if chunk.segment else len(chunk.data))
            yield chunk
        for k in extra:
            self.store.delete(k)

    def PutShards(self, requests: Iterable[ShardsChunk], caller: auth.Caller) -> Ack:
        """Store whole shards a peer sends (CmdSendShards), under the namespace its first message names."""
        receiver = shards.Receiver(self.executor.backend, max_bytes=self.max_put_bytes)
        try:
            for chunk in requests:
                if receiver.header is None:  # before the header's storages are allocated
                    _covered(caller, chunk.namespace, "PutShards", self.store)
                receiver.add(chunk)
                self.telemetry.bytes_moved("copy", "in", sum(chunk.storages) if chunk.segment else len(chunk.data))
            header, items = receiver.finish(host=receiver.header is not None and receiver.header.host)
        except segments.SegmentMissing as e:
            raise wire.RemoteError(str(e), ErrorKind.NO_SEGMENT) from None
        except (ValueError, TypeError, RuntimeError) as e:
            return Ack(ok=False, message=one_line(e))
        if header.sender and self.executor.peers.fenced(header.sender):
            return Ack(ok=False, message=f"{header.sender} was declared lost: its shards are refused")
        for tid, device, shard in items:
            self.store.put((header.namespace, tid, device), shard)
        if header.move:
            self.store.clear_moved(header.namespace, list(header.move))
        return Ack()

    def Profile(self, request: ProfileRequest, caller: auth.Caller) -> ProfileReply:
        """Start recording the session's commands here (`dtorch.profile()`), or stop and return the records.

        Only the session's own client may: its capability names exactly that session (not a peer's, not one for
        a backup namespace), so no tenant can watch, or stop, another's profile."""
        if caller.role != auth.CLIENT or caller.name != request.session:
            raise wire.PermissionDenied(f"Profile of session {request.session[:16]!r} refused: the call came with "
                                        f"{caller.describe()}")
        if request.start:
            self.telemetry.profiler.start(request.session)
            return ProfileReply()
        return self.telemetry.profiler.stop(request.session)


@dataclass
class WorkerHandle:
    """A running worker (store, executor, gRPC server) without a controller: tests and embedding use it."""

    address: str  # where the controller and peers call (the mutual-TLS port under TLS)
    store: TensorStore
    executor: Executor
    server: grpc.Server
    credentials: auth.WorkerAuth = field(repr=False)  # checks every caller's credential
    client_address: str = ""  # where clients call (the server-TLS port under TLS)
    service: WorkerService | None = field(default=None, repr=False)
    health: Health = field(default_factory=lambda: Health("dtorch.Worker"), repr=False)

    def stop(self, grace: float = 1.0) -> None:
        self.health.stop()
        self.executor.stop()
        self.server.stop(grace).wait(grace + 1.0)

    # credentials a test (or an embedding) may hand out in the controller's place
    def execute_token(self) -> str:
        return auth.execute_token(self.credentials.secret)

    def capability(self, session: str, role: str = auth.CLIENT, memory_cap: int = 0) -> str:
        return auth.mint(self.credentials.secret, role, session, memory_cap=memory_cap)


def start_worker(listen: str = "127.0.0.1:0", device: str | torch.device = "cpu", tls: Tls | None = None,
                 client_listen: str | None = None, max_put_bytes: int = 0, memory_bytes: int = 0,
                 **executor_options: object) -> WorkerHandle:
    """Start a store, an executor thread and the Worker service; returns its handle (call .stop()).

    With `tls`, the controller and peers call `listen` (mutual TLS) and clients `client_listen` (server TLS).
    Its Prometheus series are in `handle.service.telemetry.registry` (served by the CLI's --metrics-port).
    """
    store = TensorStore()
    executor = Executor(store, device=device, tls=tls, **executor_options)  # type: ignore[arg-type]
    telemetry = Telemetry(used_bytes=lambda: store.memory()[0], capacity_bytes=memory_bytes,
                          capped_bytes=lambda: store.memory()[1], batches=lambda: executor.batches,
                          busy_s=lambda: executor.busy_s, traffic=store.count_traffic)
    telemetry.is_local = executor._is_local
    executor.observe = telemetry.observe
    executor.on_received = telemetry.collective_in
    service = WorkerService(store, executor, max_put_bytes=max_put_bytes, telemetry=telemetry)
    worker_auth = auth.WorkerAuth()
    health = Health("dtorch.Worker", ready=False)  # ready once registered with a controller (cli.py)
    if tls is not None and not client_listen:
        client_listen = f"{listen.rpartition(':')[0] or '127.0.0.1'}:0"
    served = wire.serve("dtorch.Worker", service, worker_auth.authenticate,
                        listen=client_listen if tls is not None else listen, max_workers=SERVER_THREADS, tls=tls,
                        cluster_listen=listen if tls is not None else None,
                        admission=wire.Admission(CALLS_PER_SESSION, CLIENT_THREADS), health=health)
    executor.address = served.cluster_address
    executor.start()
    return WorkerHandle(address=served.cluster_address, store=store, executor=executor, server=served.server,
                        credentials=worker_auth, client_address=served.address, service=service, health=health)
