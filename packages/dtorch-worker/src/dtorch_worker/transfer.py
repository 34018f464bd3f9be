"""Tensors <-> Chunk streams, and pulling boxes of shards from peer workers.

Payloads travel as raw little-endian bytes in wire.CHUNK_BYTES pieces, so a
tensor of any size stays far below gRPC's message limit. Both ends avoid
whole-payload copies where they can: the sender slices a byte view of the
(contiguous) host tensor; the receiver fills a host buffer (pinned for a GPU)
that grows with the bytes that actually arrive, doubling (a stream declaring a
gigabyte and sending 64 bytes costs 64 bytes), after the declared size was
admitted. Host copies of device tensors go through the device backend
(`device.py`): pinned buffers and one DMA on CUDA, no numpy anywhere.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import torch

from dtorch_protocol import segments, wire
from dtorch_protocol.messages import Chunk, ErrorKind, ErrorReport, PullRequest, PutChunk, ShardsChunk, ShardsRequest
from dtorch_protocol.tls import Tls
from dtorch_protocol.values import copy_pieces, dtype_from_name, dtype_name, host_bytes, segment_tensor
from dtorch_worker import shards
from dtorch_worker.device import CPU, DeviceBackend, typed
from dtorch_worker.store import Poison


class PoisonedInput(Exception):
    """An input shard was poisoned by an earlier failure: outputs inherit the original report."""

    def __init__(self, report: ErrorReport) -> None:
        super().__init__(report.message)
        self.report = report


def take_box(t: torch.Tensor, offset: Sequence[int] | None, size: Sequence[int] | None) -> torch.Tensor:
    """The view of `t` at `offset` with extent `size` (the whole tensor when either is None)."""
    if offset is None or size is None:
        return t
    if len(offset) != t.dim() or len(size) != t.dim():
        raise ValueError(f"box offset {list(offset)} / size {list(size)} does not match a {t.dim()}-d shard "
                         f"of shape {list(t.shape)}")
    for d, (o, n) in enumerate(zip(offset, size)):
        if o < 0 or n < 0 or o + n > t.shape[d]:
            raise ValueError(f"box offset {list(offset)} size {list(size)} is outside a shard of shape "
                             f"{list(t.shape)}")
        t = t.narrow(d, o, n)
    return t


def byte_view(t: torch.Tensor, backend: DeviceBackend = CPU) -> memoryview:
    """A flat byte view of a host copy of `t` (no copy when it is already a contiguous host tensor)."""
    return host_bytes(backend.to_host(t))


def tensor_chunks(t: torch.Tensor, chunk_bytes: int = wire.CHUNK_BYTES, backend: DeviceBackend = CPU,
                  ) -> Iterator[Chunk]:
    """A tensor as a Chunk stream: dtype and shape on the first chunk, then raw bytes."""
    view = byte_view(t, backend)
    dtype, shape = dtype_name(t.dtype), list(t.shape)
    for i, piece in enumerate(wire.chunks(view, chunk_bytes)):
        if i == 0:
            yield Chunk(data=piece, dtype=dtype, shape=shape)  # type: ignore[arg-type]  # msgspec encodes views
        else:
            yield Chunk(data=piece)  # type: ignore[arg-type]


def put_chunks(session: str, tid: int, device: int, t: torch.Tensor,
               chunk_bytes: int = wire.CHUNK_BYTES) -> Iterator[PutChunk]:
    """A tensor as a Put stream (what a client sends to upload a shard)."""
    dtype, shape = dtype_name(t.dtype), list(t.shape)
    for piece in wire.chunks(byte_view(t), chunk_bytes):
        yield PutChunk(session=session, tid=tid, device=device, dtype=dtype, shape=shape,
                       data=piece)  # type: ignore[arg-type]  # msgspec encodes views


def poison_chunk(report: ErrorReport) -> Chunk:
    return Chunk(data=b"", error=f"{report.op} failed ({report.src or 'unknown line'}): {report.message}",
                 report=report, kind=ErrorKind.POISONED)


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of `dtype` and `shape` holds; ValueError for a negative size or an unknown dtype."""
    n = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"negative size in shape {list(shape)}")
        n *= s
    return n * torch.empty((), dtype=dtype_from_name(dtype)).element_size()


class _Assembler:
    """Keeps payload pieces as they arrive (memory grows with what arrives, never with what the stream declares)
    and checks the total size; at the end copies them once into one host buffer (pinned for a GPU)."""

    def __init__(self, dtype: str, shape: Sequence[int], what: str, backend: DeviceBackend = CPU) -> None:
        self.dtype, self.shape, self.what = dtype, list(shape), what
        self.size = nbytes(dtype, shape)
        self.backend = backend
        self.pieces: list[bytes] = []
        self.pos = 0

    def add(self, data: bytes) -> None:
        end = self.pos + len(data)
        if end > self.size:
            raise ValueError(f"{self.what}: more bytes than a {self.dtype} tensor of shape {self.shape} holds")
        self.pieces.append(data)
        self.pos = end

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor on the backend's device (one host-to-device copy for a GPU)."""
        if self.pos != self.size:
            raise ValueError(f"{self.what}: got {self.pos} of {self.size} bytes")
        host = self.backend.host_buffer(self.size)
        copy_pieces(self.pieces, host_bytes(host))
        self.pieces.clear()
        return self.backend.to_device(typed(host, dtype_from_name(self.dtype), self.shape))


def receive_chunks(stream: Iterable[Chunk], what: str, backend: DeviceBackend = CPU) -> torch.Tensor:
    """Rebuild a tensor (on the backend's device) from a Pull reply; raises PoisonedInput or RuntimeError when
    the peer reports an error."""
    asm: _Assembler | None = None
    for chunk in stream:
        if chunk.report is not None:
            raise PoisonedInput(chunk.report)
        if chunk.error:
            raise RuntimeError(chunk.error)
        if asm is None:
            asm = _Assembler(chunk.dtype, chunk.shape, what, backend)
        asm.add(chunk.data)
    if asm is None:
        raise RuntimeError(f"{what}: the peer sent no data")
    return asm.tensor()


def receive_put(stream: Iterable[PutChunk], backend: DeviceBackend = CPU,
                admit: Callable[[tuple[str, int, int], int], None] = lambda k, n: None,
                ) -> tuple[tuple[str, int, int], torch.Tensor, bool]:
    """Assemble a Put upload on the backend's device: (shard key, tensor, whether it came through a segment).
    Every chunk names the same shard, the first fixes dtype and shape. A first chunk naming a segment is the whole
    upload: its bytes are in that same-host segment (`from_segment`).

    `admit(key, declared bytes)` runs on the first chunk, before anything is kept: it raises to refuse.
    """
    asm: _Assembler | None = None
    key: tuple[str, int, int] | None = None
    for chunk in stream:
        k = (chunk.session, chunk.tid, chunk.device)
        if asm is None:
            key = k
            asm = _Assembler(chunk.dtype, chunk.shape, f"Put of tensor {chunk.tid} on device {chunk.device}", backend)
            admit(k, asm.size)
            if chunk.segment:
                return k, from_segment(chunk, asm.size, backend), True
        elif k != key:
            raise ValueError(f"Put stream mixes shards {key[1:] if key else None} and {k[1:]}")
        asm.add(chunk.data)
    if asm is None or key is None:
        raise ValueError("empty Put stream")
    return key, asm.tensor(), False


def from_segment(chunk: PutChunk, size: int, backend: DeviceBackend = CPU) -> torch.Tensor:
    """An upload from the client's same-host segment: on the CPU the segment itself becomes the shard (a
    copy-on-write mapping of memory the client sealed against changes: no copy), on a GPU one copy to the device.
    The mapping holds no descriptor (segments.py rule 6). `segments.SegmentMissing` / `SegmentRefused` as
    `segments.opened`."""
    fd = segments.opened(chunk.segment, chunk.session, chunk.tid, chunk.device, size)
    try:
        return backend.to_device(segment_tensor(fd, size, chunk.dtype, chunk.shape, shared=False))
    finally:
        os.close(fd)


def into_segment(name: str, key: tuple[str, int, int], box: torch.Tensor, backend: DeviceBackend = CPU) -> Chunk:
    """A Pull's reply written into the client's same-host segment `name` (from a host copy: pinned on a GPU): the
    one chunk that says so. `segments.SegmentMissing` / `SegmentRefused` as `segments.write_into`."""
    segments.write_into(name, *key, byte_view(box, backend))
    return Chunk(data=b"", dtype=dtype_name(box.dtype), shape=list(box.shape), in_segment=True)


class PeerPool:
    """One gRPC channel per peer address, reused by every pull.

    Calls are tracked per session so a recovery can cut them short (`cancel`), and addresses of workers
    the controller declared lost are fenced: calls to them fail at once, calls in flight end. Each call
    carries the peer capability the controller sent for its session and that peer (`grant`, from Execute).
    """

    def __init__(self, tls: Tls | None = None, backend: DeviceBackend = CPU) -> None:
        self.tls = tls
        self.backend = backend
        self._caps: dict[str, dict[str, str]] = {}  # session -> peer address -> capability
        self._stubs: dict[str, wire.Stub] = {}
        self._lock = threading.Lock()
        self._fenced: set[str] = set()
        self._inflight: dict[str, set[Any]] = {}  # session -> cancellable calls in flight
        self._elsewhere: set[str] = set()  # peers that could not open one of our segments (another host)
        self.segments = os.environ.get("DTORCH_SHARED_MEMORY", "1") != "0"  # whole shards through segments

    def stub(self, address: str) -> wire.Stub:
        with self._lock:
            if address in self._fenced:
                raise ConnectionError(f"{address} was declared lost by the controller (fenced)")
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = wire.Stub("dtorch.Worker", address, "", tls=self.tls)
            return stub

    def grant(self, session: str, caps: dict[str, str]) -> None:
        """Capabilities for `session` on peers (newer ones replace older ones for the same peer)."""
        if caps:
            with self._lock:
                self._caps.setdefault(session, {}).update(caps)

    def forget(self, session: str) -> None:
        with self._lock:
            self._caps.pop(session, None)

    def cap(self, session: str, address: str) -> str:
        with self._lock:
            cap = self._caps.get(session.partition("#")[0], {}).get(address)
        if cap is None:
            raise PermissionError(f"no capability for session {session[:8]} on {address} (the controller sends "
                                  "one with every batch that names a peer)")
        return cap

    def fence(self, addresses: Iterable[str]) -> None:
        """Talk to these addresses no more (until `lift`ed); calls in flight to them end now."""
        with self._lock:
            stubs = []
            for a in addresses:
                self._fenced.add(a)
                if a in self._stubs:
                    stubs.append(self._stubs.pop(a))
        for stub in stubs:
            stub.close()

    def lift(self, addresses: Iterable[str]) -> None:
        """A new worker registered at these addresses (their old one was declared lost): reach them again."""
        with self._lock:
            self._fenced.difference_update(addresses)

    def fenced(self, address: str) -> bool:
        with self._lock:
            return address in self._fenced

    def cancel(self, session: str) -> None:
        """End every call in flight for `session` (it is being rebuilt)."""
        with self._lock:
            calls = self._inflight.pop(session, set())
        for call in calls:
            call.cancel()

    @contextmanager
    def _tracked(self, session: str, call: Any) -> Iterator[None]:
        with self._lock:
            self._inflight.setdefault(session, set()).add(call)
        try:
            yield
        finally:
            with self._lock:
                calls = self._inflight.get(session)
                if calls is not None:
                    calls.discard(call)
                    if not calls:
                        del self._inflight[session]

    def pull(self, address: str, request: PullRequest, transfer_timeout_s: float = 600.0) -> torch.Tensor:
        """Fetch a box of a peer's shard; raises PoisonedInput when the peer holds a poisoned shard."""
        what = f"pull of tensor {request.tid} on device {request.device} from {address}"
        call, stream = self.stub(address).open_stream("Pull", request, timeout=request.timeout_s + transfer_timeout_s,
                                                      credential=self.cap(request.session, address))
        with self._tracked(request.session, call):
            return receive_chunks(stream, what, self.backend)

    def pull_shards(self, address: str, request: ShardsRequest, session: str,
                    transfer_timeout_s: float = 600.0) -> list[tuple[int, int, Any]]:
        """Whole shards (aliasing kept) from a peer's store, on this worker's device; `session` is the one to
        cancel them with. A peer on this host appends them to a segment of this worker's, which keeps its mapping
        as the shards (dtorch_protocol.segments); a peer that streams a large reply instead is on another host."""
        segment = segments.for_shards(request.session) if self.segments and address not in self._elsewhere else None
        if segment is not None:
            request = msgspec.structs.replace(request, segment=segment.name)
        try:
            call, stream = self.stub(address).open_stream("PullShards", request,
                                                          timeout=request.timeout_s + transfer_timeout_s,
                                                          credential=self.cap(session, address))
            with self._tracked(session, call):
                header, items = shards.receive(stream, self.backend, segment, request.session)
        finally:
            if segment is not None:
                segment.close()
        if segment is not None and not header.segment and sum(header.storages) >= segments.MIN_BYTES:
            self._elsewhere.add(address)
        return items

    def put_shards(self, address: str, packed: shards.Packed, session: str, timeout_s: float = 600.0,
                   **header: Any) -> None:
        """Send whole shards into a peer's store (PutShards, `header`: the fields of its first message); raises when
        the peer refuses them. To a peer on this host their bytes go in a segment (dtorch_protocol.segments) it
        maps, unless it could not open one before (another host: then they stream)."""
        segment = None
        if self.segments and address not in self._elsewhere and packed.nbytes >= segments.MIN_BYTES:
            segment = segments.for_put(header["namespace"], -1, -1, list(shards.host_parts(packed, self.backend)))
        try:
            if segment is not None:
                try:
                    self._put_shards(address, shards.chunks(packed, backend=self.backend, segment=segment.name,
                                                            **header), session, timeout_s)
                    return
                except wire.RemoteError as e:
                    if e.kind != ErrorKind.NO_SEGMENT:
                        raise
                    self._elsewhere.add(address)
            self._put_shards(address, shards.chunks(packed, backend=self.backend, **header), session, timeout_s)
        finally:
            if segment is not None:
                segment.close()

    def _put_shards(self, address: str, stream: Iterable[ShardsChunk], session: str, timeout_s: float) -> None:
        stub = self.stub(address)
        future = stub.send_stream_future("PutShards", stream, timeout=timeout_s, credential=self.cap(session, address))
        with self._tracked(session, future):
            ack = stub.decode_reply("PutShards", future)
        if not ack.ok:
            raise RuntimeError(f"{address} refused the shards: {ack.message}")

    def close(self) -> None:
        with self._lock:
            stubs, self._stubs = list(self._stubs.values()), {}
        for stub in stubs:
            stub.close()


def poisoned_or(value: torch.Tensor | Poison) -> torch.Tensor:
    """The tensor, or raise PoisonedInput with the original report."""
    if isinstance(value, Poison):
        raise PoisonedInput(value.report)
    return value
