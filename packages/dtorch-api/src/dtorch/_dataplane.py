"""The data plane of one session: shard bytes straight between this client and the workers.

Reads (`Pull`, one replica of each distinct shard; the values of a small Partial tensor combined here as the
workers combine them, a large one's on the workers first: `DTensor.to_torch`) and writes (`Put`, each device's
box of a full tensor) go to the worker that `where(device)` names. When that worker no longer serves the device
(moved, lost, stopped), `_relocate` finds it again and the transfer is retried there; the
new address is kept in this object's own table. A device lost for good raises `DeviceLost`.

It speaks tensor ids and specs; the session tells it where devices are and the capability this session holds
on each of those workers (`learn`, from OpenMesh, Sync and Status). A capability near its expiry (or missing)
is refreshed through `status()`, which brings the session's current ones.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.experimental
import torch

from dtorch._relocate import Moved, Watch, moved_error, relocate, seen
from dtorch.errors import ClusterError, DTorchError, RemoteOpError
from dtorch_protocol import auth, segments, wire
from dtorch_protocol import messages as m
from dtorch_protocol.layout import coords, gather_groups, holds_value, shard_box
from dtorch_protocol.placement_types import Replicate
from dtorch_protocol.tls import Tls
from dtorch_protocol.values import copy_pieces, dtype_from_name, dtype_name, host_bytes, reduce_in_order, segment_tensor

if TYPE_CHECKING:
    from dtorch._spec import Spec

T = TypeVar("T")
IO_THREADS = 8
CAP_REFRESH_S = 600.0  # ask for fresh capabilities when one has less than this left
SHARDED_MIN_BYTES = 1 << 20  # a replicated upload this large goes out once, sharded, and the workers gather it;
# a Partial read this large is combined by the workers into shards first (DTensor.to_torch)
EARLY_WAIT_S = 10.0  # how long a worker holds an early read (session.py) for its stream to reach the read's mark
# A Pull's replies are read by the thread that asked (gRPC's experimental single-threaded server-streaming calls),
# not handed over by a channel thread that gRPC starts for each burst of calls and ends when none is left: one thread
# start less per read, whose `Thread.start` waits until the new thread holds the GIL (a busy client: milliseconds).
SINGLE_THREADED_PULLS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in box)


def _receive(replies: Any, segment: segments.Segment | None) -> tuple[torch.Tensor, bool]:
    """A Pull reply's tensor, and whether the worker wrote it into `segment` (the tensor then lives there, no copy);
    streamed chunks are copied once, into the tensor's own memory."""
    parts: list[bytes] = []
    first = None
    for chunk in replies:
        if chunk.report is not None:
            raise RemoteOpError(chunk.report.op, chunk.report.src, chunk.report.message)
        if chunk.error:
            raise (Moved if chunk.kind == m.ErrorKind.MOVED else DTorchError)(chunk.error)
        if first is None:  # the first chunk names dtype and shape
            first = chunk
        if chunk.in_segment:
            return _in_segment(chunk, segment), True
        parts.append(chunk.data)
    if first is None:
        raise DTorchError("a worker's reply to a read ended before any data")
    dtype, shape = dtype_from_name(first.dtype), first.shape
    size, got = math.prod(shape) * dtype.itemsize, sum(map(len, parts))
    if got != size:
        raise DTorchError(f"a worker sent {got} bytes of a {first.dtype} tensor of shape {shape} ({size} bytes)")
    if size == 0:
        return torch.empty(shape, dtype=dtype), False
    if len(parts) == 1:
        buf = bytearray(parts[0])
    else:
        buf = bytearray(size)
        copy_pieces(parts, memoryview(buf))
    return torch.frombuffer(buf, dtype=dtype).reshape(shape), False


def _in_segment(chunk: m.Chunk, segment: segments.Segment | None) -> torch.Tensor:
    dtype, shape = dtype_from_name(chunk.dtype), chunk.shape
    if segment is None or math.prod(shape) * dtype.itemsize != segment.nbytes:
        raise DTorchError(f"a worker wrote a {chunk.dtype} tensor of shape {shape} into a shared-memory segment this "
                          "read did not make for it")
    return segment_tensor(segment.fd, segment.nbytes, chunk.dtype, shape, shared=True)  # no descriptor kept


def _nbytes(box: tuple[tuple[int, int], ...], dtype: torch.dtype) -> int:
    return math.prod(n for _, n in box) * dtype.itemsize


class DataPlane:
    """Pull and Put for session `session`; `status()` asks the controller where devices are (relocation)."""

    def __init__(self, session: str, timeout: float, status: Callable[[], m.StatusReply],
                 tls: Tls | None = None) -> None:
        self.session, self.timeout, self.tls = session, timeout, tls
        self._status = status
        self._where: dict[int, str] = {}
        self._caps: dict[str, str] = {}  # worker address -> this session's capability there
        self._workers: dict[str, wire.Stub] = {}
        self._segments = os.environ.get("DTORCH_SHARED_MEMORY", "1") != "0"  # same-host segments (segments.py)
        self._elsewhere: set[str] = set()  # workers that could not open one of our segments: stream to them
        self._near: set[str] = set()  # workers that wrote a reply into one
        self._pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="dtorch-io")

    # ------------------------------------------------------------------ where devices are
    def learn(self, locations: dict[int, str], caps: dict[str, str] | None = None) -> None:
        """News from the controller: logical device -> worker address, and worker address -> capability."""
        self._where.update(locations)
        self._caps.update(caps or {})

    def _cap(self, address: str) -> str:
        cap = self._caps.get(address)
        if cap is None or auth.cap_expiry(cap) - time.time() < CAP_REFRESH_S:
            self._status()  # the session passes what it brings back to `learn`
            cap = self._caps.get(address)
        if cap is None:
            raise ClusterError(f"the controller gave this session no capability for the worker at {address}")
        return cap

    def where(self, device: int) -> str:
        address = self._where.get(device)
        if address is None:
            raise ClusterError(f"logical device {device} is not placed on any worker")
        return address

    def _look(self, device: int) -> Any:
        return seen(self._status(), self.session, device)

    def _relocating(self, device: int, call: Callable[[str], T]) -> T:
        """`call(address)` on the device's worker; after "moved" or a lost connection, find it again and retry."""
        deadline = time.monotonic() + self.timeout
        while True:
            address = self.where(device)
            try:
                return call(address)
            except (ConnectionError, Moved, wire.RemoteError) as e:
                if isinstance(e, wire.RemoteError) and not moved_error(e):
                    raise
                if time.monotonic() >= deadline:
                    raise ClusterError(f"logical device {device} is unreachable: {e}") from None
                self._where[device] = relocate(self._look, device, address, deadline)

    def _worker(self, address: str) -> wire.Stub:
        stub = self._workers.get(address)
        if stub is None:
            channel = wire.open_channel(address, self.tls, SINGLE_THREADED_PULLS)
            stub = self._workers[address] = wire.Stub("dtorch.Worker", address, "", channel=channel)
        return stub

    # ------------------------------------------------------------------ reads
    def read(self, tid: int, spec: Spec, after: int = -1) -> torch.Tensor:
        """The full value of tensor `tid` laid out as `spec`: one replica of each distinct shard (a strided shard is
        read in its unflattened layout, each piece reshaped to its box there). `after`: an early read (session.py),
        served once each worker's stream reached that read mark, from where the devices were, never retried."""
        shape, spec = spec.shape, spec.unflattened()
        groups, op = gather_groups(spec.shape, spec.mesh.shape, spec.placements)
        wanted = [[(flat, box) for flat, box in group if all(n for _, n in box)] for group in groups]
        if op is None and len(wanted) == 1 and len(wanted[0]) == 1:  # one shard holds the value: here, as it comes
            flat, box = wanted[0][0]
            if [n for _, n in box] == list(spec.shape):
                return self._pull(tid, spec.mesh.devices[flat], _nbytes(box, spec.dtype), after
                                  ).to(spec.dtype).reshape(shape)
        jobs = [[(box, self._pool.submit(self._pull, tid, spec.mesh.devices[flat], _nbytes(box, spec.dtype), after))
                 for flat, box in group] for group in wanted]
        parts = []
        for group in jobs:
            full = torch.empty(spec.shape, dtype=spec.dtype)
            for box, future in group:
                full[_slices(box)] = future.result().reshape([n for _, n in box])
            parts.append(full)
        # a small Partial tensor (DTensor.to_torch): its groups in mesh order, combined as the workers combine them
        return (parts[0] if op is None else reduce_in_order(parts, op)).reshape(shape)

    def _pull(self, tid: int, device: int, nbytes: int, after: int = -1) -> torch.Tensor:
        if after >= 0:
            return self._pull_from(self.where(device), tid, device, nbytes, after)
        return self._relocating(device, lambda address: self._pull_from(address, tid, device, nbytes))

    def _pull_from(self, address: str, tid: int, device: int, nbytes: int, after: int = -1) -> torch.Tensor:
        segment = segments.for_pull(self.session, tid, device, nbytes) if self._segments_to(address, nbytes) else None
        wait = min(self.timeout, m.MAX_TIMEOUT_S)
        if after >= 0:  # an early read: a worker whose stream is not there by then answers MISSING
            wait = min(wait, EARLY_WAIT_S)
        try:
            call, replies = self._worker(address).open_stream(
                "Pull", m.PullRequest(session=self.session, tid=tid, device=device, timeout_s=wait, after=after,
                                      segment=segment.name if segment else ""),
                timeout=self.timeout + 10.0, credential=self._cap(address))
            with Watch(self._look, device, address, call.cancel) as watch:
                try:
                    value, in_segment = _receive(replies, segment)
                except (ConnectionError, wire.RemoteError):
                    if watch.fired:
                        raise Moved(f"moved: logical device {device} left {address}") from None
                    raise
            if segment is not None and in_segment:
                self._near.add(address)
            elif segment is not None and address not in self._near:
                self._elsewhere.add(address)  # streamed: on another host (where one worked: a size that did not fit)
            return value
        finally:
            if segment is not None:
                segment.close()

    def _segments_to(self, address: str, nbytes: int) -> bool:
        """Whether `nbytes` to or from the worker at `address` go through a same-host segment (segments.py): not
        when they are few, segments are turned off, or that worker could not open one of ours (another host)."""
        return self._segments and nbytes >= segments.MIN_BYTES and address not in self._elsewhere

    # ------------------------------------------------------------------ writes
    def spread(self, spec: Spec, nbytes: int) -> Spec | None:
        """The layout in which to upload a replicated tensor of `nbytes` instead, or None: as it is.

        A Replicate upload sends the whole tensor to every device: n copies through the client's link (64 GiB for a
        1 GiB model replicated on 64 workers). From SHARDED_MIN_BYTES up, on devices of two or more workers the
        bytes reach by streaming (not through a same-host segment, where a copy is a memcpy), each Replicate mesh
        dim becomes a Shard of a tensor dim no other mesh dim shards (the largest that has a row for every device
        of that dim): the client sends the bytes once and the workers gather them (an all_gather where they take
        part in collectives, else pieces between them)."""
        if nbytes < SHARDED_MIN_BYTES or spec.unflattened() is not spec or \
                sum(not self._segments_to(w, nbytes) for w in {self.where(d) for d in spec.mesh.devices}) < 2:
            return None
        placements = spec.sharded_instead(Replicate)
        return None if placements == spec.placements else spec.with_placements(placements)

    def write(self, tensor: torch.Tensor, spec: Spec, tid: int, devices: set[int] | None = None) -> None:
        """Each device's box of the full `tensor` (on the client, of spec's dtype) to its worker, as tensor `tid`.
        `devices`: only those, Put again (a shard already there is left as it is)."""
        futures = []
        for flat, c in enumerate(coords(spec.mesh.shape)):
            device = spec.mesh.devices[flat]
            if devices is not None and device not in devices:
                continue
            box = shard_box(spec.shape, spec.mesh.shape, spec.placements, c)
            local = tensor[_slices(box)] if holds_value(spec.placements, c) else torch.zeros(
                [n for _, n in box], dtype=spec.dtype)
            futures.append(self._pool.submit(self._put, tid, device, local, devices is not None))
        for f in futures:
            f.result()

    def _put(self, tid: int, device: int, local: torch.Tensor, again: bool) -> None:
        def put(address: str) -> None:
            try:
                self._put_to(address, tid, device, local)
            except wire.RemoteError as e:
                if not again or e.kind != m.ErrorKind.REFUSED:  # Put again: the shard is there already
                    raise

        self._relocating(device, put)

    def _put_to(self, address: str, tid: int, device: int, local: torch.Tensor) -> None:
        dtype, shape = dtype_name(local.dtype), list(local.shape)
        data = host_bytes(local.contiguous())  # no copy of a contiguous box: a view of its memory
        segment = segments.for_put(self.session, tid, device, [data]) if self._segments_to(address, len(data)) else None
        if segment is not None:
            try:
                self._send(address, device, iter([m.PutChunk(session=self.session, tid=tid, device=device,
                                                             dtype=dtype, shape=shape, data=b"",
                                                             segment=segment.name)]))
                return
            except wire.RemoteError as e:
                if e.kind != m.ErrorKind.NO_SEGMENT:
                    raise
                self._elsewhere.add(address)  # not on this host: stream, from now on
            finally:
                segment.close()
        self._send(address, device, (m.PutChunk(session=self.session, tid=tid, device=device, dtype=dtype,
                                                shape=shape, data=c)  # type: ignore[arg-type]  # views encode
                                     for c in wire.chunks(data)))

    def _send(self, address: str, device: int, chunks: Iterator[m.PutChunk]) -> None:
        stub = self._worker(address)
        future = stub.send_stream_future("Put", chunks, timeout=self.timeout, credential=self._cap(address))
        with Watch(self._look, device, address, future.cancel) as watch:
            try:
                stub.decode_reply("Put", future)
            except (ConnectionError, wire.RemoteError, grpc.FutureCancelledError):
                if watch.fired:
                    raise Moved(f"moved: logical device {device} left {address}") from None
                raise

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for stub in self._workers.values():
            stub.close()
