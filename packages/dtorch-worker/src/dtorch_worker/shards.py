"""Whole shards with their aliasing: pack a set of shards into storages and views, and back.

Rules:

1. This is how shards move whole between workers (migration, snapshots, restores after a loss): a
   `Pull` copies a box of one tensor, this copies every listed shard of a device at once.
2. Shards that share storage here share one storage in the copy, with the same offsets and strides: a
   view stays a view of its base, so an in-place op on one still shows through the others. (A storage
   is copied whole, even when only part of it is viewed.)
3. A poisoned shard travels as its ErrorReport and arrives poisoned.
4. Conjugate/negative-bit views are materialized (they lose their aliasing); nothing else is changed.
5. Streams (`chunks` / `Receiver`) are one header message listing views and storage sizes, then the
   storages' raw bytes in order, in pieces of at most wire.CHUNK_BYTES. Both ends copy through host buffers of
   the device backend (pinned on a GPU), never numpy. Between workers of one host the header names a segment
   (`dtorch_protocol.segments`) holding the storages instead, and the receiver keeps its copy-on-write mapping of
   it as the storages (host copies) or copies it to its device once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dtorch_protocol import segments, wire
from dtorch_protocol.messages import ShardsChunk, ShardView
from dtorch_protocol.values import dtype_from_name, dtype_name, host_bytes
from dtorch_worker.device import CPU, DeviceBackend
from dtorch_worker.store import Poison, Shard

Item = tuple[int, int, Shard]  # (tid, logical device, shard)


@dataclass
class Packed:
    views: list[ShardView]
    storages: list[torch.Tensor]  # uint8 views of whole storages, on the shards' device

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.storages)


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t` (no copy)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def pack(items: Iterable[Item]) -> Packed:
    """Group shards by the storage they view; every storage is listed once."""
    views: list[ShardView] = []
    storages: list[torch.Tensor] = []
    index: dict[tuple[str, int], int] = {}
    for tid, device, shard in items:
        if isinstance(shard, Poison):
            views.append(ShardView(tid=tid, device=device, storage=-1, dtype="", shape=[], stride=[], offset=0,
                                   report=shard.report))
            continue
        t = shard.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if t.layout != torch.strided:
            raise TypeError(f"cannot copy a {t.layout} shard of tensor {tid} whole")
        ptr = t.untyped_storage().data_ptr()
        key = (str(t.device), ptr) if ptr else (str(t.device), -len(storages) - 1)  # empty storages: each its own
        n = index.get(key)
        if n is None:
            n = index[key] = len(storages)
            storages.append(_whole_storage(t))
        views.append(ShardView(tid=tid, device=device, storage=n, dtype=dtype_name(t.dtype), shape=list(t.shape),
                               stride=list(t.stride()), offset=t.storage_offset()))
    return Packed(views, storages)


def unpack(views: Sequence[ShardView], storages: Sequence[torch.Tensor], device: torch.device | str,
           ) -> list[Item]:
    """Rebuild the shards over `storages` (uint8, moved to `device` once each, so aliasing survives)."""
    device = torch.device(device)
    bases = [s if s.device == device else s.to(device) for s in storages]
    out: list[Item] = []
    for v in views:
        if v.storage < 0:
            if v.report is None:
                raise ValueError(f"shard of tensor {v.tid} has neither a storage nor an error report")
            out.append((v.tid, v.device, Poison(v.report)))
            continue
        if not 0 <= v.storage < len(bases):
            raise ValueError(f"shard of tensor {v.tid} names storage {v.storage} of {len(bases)}")
        base = bases[v.storage]
        t = torch.empty(0, dtype=dtype_from_name(v.dtype), device=device)
        t.set_(base.untyped_storage(), v.offset, list(v.shape), list(v.stride))
        out.append((v.tid, v.device, t))
    return out


def clone(items: Iterable[Item], device: torch.device | str) -> list[Item]:
    """Copies of `items` on `device` that share nothing with the originals but keep their own aliasing."""
    packed = pack(items)
    copies = [s.to(device, copy=True) for s in packed.storages]
    return unpack(packed.views, copies, device)


def chunks(packed: Packed, chunk_bytes: int = wire.CHUNK_BYTES, backend: DeviceBackend = CPU,
           **header: object) -> Iterator[ShardsChunk]:
    """The stream for `packed`: a header (with `header` fields, e.g. namespace for PutShards), then bytes (none when
    the header names a segment holding them: `host_parts`)."""
    yield ShardsChunk(views=packed.views, storages=[s.numel() for s in packed.storages], **header)  # type: ignore[arg-type]
    if header.get("segment"):
        return
    for view in host_parts(packed, backend):
        for start in range(0, len(view), chunk_bytes):
            yield ShardsChunk(data=view[start:start + chunk_bytes])  # type: ignore[arg-type]  # msgspec encodes views


def host_parts(packed: Packed, backend: DeviceBackend = CPU) -> Iterator[memoryview]:
    """The bytes of `packed`'s storages in order, as host views (a device's copied to pinned host buffers)."""
    for s in packed.storages:
        if s.numel():
            yield host_bytes(backend.to_host(s))


class Receiver:
    """Assembles a ShardsChunk stream into preallocated host storages (pinned for a GPU); `header` is the first
    message."""

    def __init__(self, backend: DeviceBackend = CPU, max_bytes: int = 0, session: str = "") -> None:
        self.backend = backend
        self.session = session  # what a segment's header must name: the namespace pulled (PullShards), else the
        # header's namespace (PutShards)
        self.max_bytes = max_bytes  # bound on the storages a header may announce (0: none)
        self.header: ShardsChunk | None = None
        self.storages: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        self._i = 0
        self._pos = 0

    def add(self, chunk: ShardsChunk) -> None:
        if chunk.error:
            raise RuntimeError(chunk.error)
        if self.header is None:
            if any(n < 0 for n in chunk.storages):
                raise ValueError(f"negative storage size in {chunk.storages[:8]}")
            if self.max_bytes and sum(chunk.storages) > self.max_bytes:
                raise ValueError(f"the shards announce {sum(chunk.storages)} bytes, over the {self.max_bytes} this "
                                 "worker accepts")
            self.header = chunk
            if chunk.segment:  # the storages are the sender's segment (its private mapping here): nothing follows
                view = segments.open_for(chunk.segment, self.session or chunk.namespace, -1, -1,
                                         sum(chunk.storages))
                ends = list(itertools.accumulate(chunk.storages, initial=0))
                self.storages = [torch.frombuffer(view[a:b], dtype=torch.uint8) if b > a else CPU.host_buffer(0)
                                 for a, b in itertools.pairwise(ends)]
                self._i = len(self.storages)
                return
            # copies kept in host memory (backups) need no pinning: pinned memory is for copies to the device
            alloc = CPU.host_buffer if chunk.host else self.backend.host_buffer
            self.storages = [alloc(n) for n in chunk.storages]
            self._views = [host_bytes(s) for s in self.storages]
            self._skip_empty()
            return
        if self.header.segment:
            raise ValueError("shard bytes after a header that named a segment holding them")
        data = memoryview(chunk.data)
        while len(data):
            if self._i >= len(self.storages):
                raise ValueError("more shard bytes than the header announced")
            dst = self._views[self._i]
            n = min(len(data), len(dst) - self._pos)
            dst[self._pos:self._pos + n] = data[:n]
            self._pos += n
            data = data[n:]
            self._skip_empty()

    def _skip_empty(self) -> None:
        while self._i < len(self.storages) and self._pos >= self.storages[self._i].numel():
            self._i += 1
            self._pos = 0

    def finish(self, host: bool = False) -> tuple[ShardsChunk, list[Item]]:
        """The header and the shards, on the backend's device (in host memory with `host`)."""
        if self.header is None:
            raise ValueError("empty shard stream")
        if self._i < len(self.storages):
            raise ValueError(f"shard stream ended early: storage {self._i} of {len(self.storages)} incomplete")
        storages = self.storages if host else [self.backend.to_device(s) for s in self.storages]
        return self.header, unpack(self.header.views, storages, "cpu" if host else self.backend.device)


def receive(stream: Iterable[ShardsChunk], backend: DeviceBackend = CPU, segment: segments.Segment | None = None,
            session: str = "") -> tuple[ShardsChunk, list[Item]]:
    """A PullShards reply; `segment`: the puller's (ShardsRequest.segment), sealed once a header names it."""
    r = Receiver(backend, session=session)
    for chunk in stream:
        if r.header is None and chunk.segment:
            if segment is None or chunk.segment != segment.name:
                raise ValueError(f"the peer's reply names segment {chunk.segment[:64]!r}, not the one asked for")
            segment.seal()
        r.add(chunk)
    return r.finish()
