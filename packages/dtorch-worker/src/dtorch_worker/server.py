"""The `dtorch.Worker` gRPC service: Execute (enqueue), Pull (serve a shard box), Put (upload a shard).

A Put that would take a capped session over its memory cap on this worker is refused with a one-line
reason (the client raises it); so is one for a device that moved away (kind MOVED: the client retries).

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

from dtorch_protocol import wire
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
from dtorch_worker import shards
from dtorch_worker.executor import Executor, one_line
from dtorch_worker.store import Poison, Shard, ShardMissing, TensorStore
from dtorch_worker.telemetry import Telemetry
from dtorch_worker.transfer import poison_chunk, receive_put, take_box, tensor_chunks

log = logging.getLogger("dtorch_worker.server")

SERVER_THREADS = 64  # Pulls may wait for shards; keep room for Execute and Put meanwhile


class WorkerService:
    """Implements the methods of wire.SERVICES["dtorch.Worker"] over a store and an executor."""

    def __init__(self, store: TensorStore, executor: Executor, max_pull_wait_s: float = 600.0,
                 telemetry: Telemetry | None = None) -> None:
        self.store = store
        self.executor = executor
        self.max_pull_wait_s = max_pull_wait_s
        self.telemetry = telemetry or Telemetry()

    def Execute(self, request: Execute) -> Ack:
        if self.executor.submit(request):
            return Ack()
        if self.executor.stopped:
            return Ack(ok=False, message="the worker is stopping")
        return Ack(ok=True, message=f"batch {request.seq} is a duplicate: already done or queued")

    def Pull(self, request: PullRequest) -> Iterator[Chunk]:
        key = (request.session, request.tid, request.device)
        counted = not request.expected  # a planned read holds back in-place writes of the shard until counted
        path = "point_to_point" if request.expected else "client"
        try:
            for chunk in self._pull(key, request):
                self.telemetry.bytes_moved(path, "out", len(chunk.data), key[0] if path == "client" else "")
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
        try:
            value = self.store.get(key, wait) if request.expected else self._client_get(key, wait)
        except ShardMissing as e:
            yield Chunk(data=b"", error=str(e), kind=e.kind)
            return
        if isinstance(value, Poison):
            yield poison_chunk(value.report)
            return
        try:
            # Chunks hold views of one contiguous copy at most, so building the list up front is cheap.
            chunks = list(tensor_chunks(take_box(value, request.offset, request.size)))
        except (ValueError, TypeError, RuntimeError) as e:
            yield Chunk(data=b"", error=one_line(e), kind=ErrorKind.REFUSED)
            return
        yield from chunks

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
                if time.monotonic() >= deadline or not self.store.rebuilding(key[0]):
                    raise

    def Put(self, requests: Iterable[PutChunk]) -> Ack:
        try:
            key, tensor = receive_put(requests)
            if tensor.device != self.executor.device:
                tensor = tensor.to(self.executor.device)
        except (ValueError, TypeError) as e:
            raise wire.ProtocolError(one_line(e)) from None
        refused = self.store.put_upload(key, tensor)  # (MOVED or MEMORY_CAP, reason)
        if refused is not None:
            kind, reason = refused
            raise wire.RemoteError(reason, kind)
        self.telemetry.bytes_moved("client", "in", tensor.numel() * tensor.element_size(), key[0])
        return Ack()

    def PullShards(self, request: ShardsRequest) -> Iterator[ShardsChunk]:
        """Whole shards with their aliasing (restores and copies between workers); waits for missing ones.

        With `move`, those devices are leaving for the puller: uploads for them are refused from now on, and
        the ones not adopted yet go along (and are dropped here once sent)."""
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
        for chunk in shards.chunks(packed):
            self.telemetry.bytes_moved("copy", "out", len(chunk.data))
            yield chunk
        for k in extra:
            self.store.delete(k)

    def PutShards(self, requests: Iterable[ShardsChunk]) -> Ack:
        """Store whole shards a peer sends (CmdSendShards), under the namespace its first message names."""
        receiver = shards.Receiver()
        try:
            for chunk in requests:
                receiver.add(chunk)
                self.telemetry.bytes_moved("copy", "in", len(chunk.data))
            host = receiver.header is not None and receiver.header.host
            header, items = receiver.finish("cpu" if host else self.executor.device)
        except (ValueError, TypeError, RuntimeError) as e:
            return Ack(ok=False, message=one_line(e))
        if header.sender and self.executor.peers.fenced(header.sender):
            return Ack(ok=False, message=f"{header.sender} was declared lost: its shards are refused")
        for tid, device, shard in items:
            self.store.put((header.namespace, tid, device), shard)
        if header.move:
            self.store.clear_moved(header.namespace, list(header.move))
        return Ack()


    def Profile(self, request: ProfileRequest) -> ProfileReply:
        """Start recording the session's commands here (`dtorch.profile()`), or stop and return the records."""
        if request.start:
            self.telemetry.profiler.start(request.session)
            return ProfileReply()
        return self.telemetry.profiler.stop(request.session)


@dataclass
class WorkerHandle:
    """A running worker (store, executor, gRPC server) without a controller: tests and embedding use it."""

    address: str
    store: TensorStore
    executor: Executor
    server: grpc.Server
    service: WorkerService = field(repr=False)
    health: Health = field(default_factory=lambda: Health("dtorch.Worker"), repr=False)

    def stop(self, grace: float = 1.0) -> None:
        self.health.stop()
        self.executor.stop()
        self.server.stop(grace).wait(grace + 1.0)


def start_worker(token: str = "", listen: str = "127.0.0.1:0", device: str | torch.device = "cpu",
                 memory_bytes: int = 0, **executor_options: object) -> WorkerHandle:
    """Start a store, an executor thread and the Worker service; returns its handle (call .stop()).

    Its Prometheus series are in `handle.service.telemetry.registry` (served by the CLI's --metrics-port)."""
    store = TensorStore()
    executor = Executor(store, device=device, token=token, **executor_options)  # type: ignore[arg-type]
    telemetry = Telemetry(used_bytes=lambda: store.memory()[0], capacity_bytes=memory_bytes,
                          capped_bytes=lambda: store.memory()[1], batches=lambda: executor.batches,
                          busy_s=lambda: executor.busy_s, traffic=store.count_traffic)
    telemetry.is_local = executor._is_local
    executor.observe = telemetry.observe
    service = WorkerService(store, executor, telemetry=telemetry)
    health = Health("dtorch.Worker", ready=False)  # ready once registered with a controller (cli.py)
    server, address = wire.serve("dtorch.Worker", service, token, listen=listen, max_workers=SERVER_THREADS,
                                 health=health)
    executor.address = address
    executor.start()
    return WorkerHandle(address=address, store=store, executor=executor, server=server, service=service,
                        health=health)
