"""A worker's part of a redistribution lowered to collectives (CmdCollective), step by step.

Rules:

1. Each step kind (table KINDS) is prepared on the executor thread when the command runs: its inputs are packed
   into a send buffer then, unless rule 7 sends them as they are. What is left (the transfer, then unpacking and
   reducing into fresh output tensors) is a `Finish` run on the group's lane (groups.py), or at once for a group
   entirely on this worker (`GroupOp.group == ""`, a local exchange).
2. Collectives move bytes (uint8 views: every dtype travels, bool and complex too), and reductions are done
   here with torch, by the rank that receives each piece, over the positions in mesh order: the same order and
   the same function (`reduce_in_order`) as the point-to-point plan, so both paths give identical values.
   Exception (table NATIVE_SUM): the backend's own all_reduce, where its result cannot differ from that order's:
   integer sums of the widths both backends reduce (exact in any order; not int16), and float32/float64 sums of
   exactly two values (one addition, and a + b is b + a in IEEE arithmetic): two ranks holding one position each.
   gloo and NCCL optimize that one best.
3. Uneven shards: an all_gather (or an all_to_all of copies, where the backend prefers it) pads every rank's
   contribution to the most positions times the longest length; exchanges (all_to_all, reduce_scatter, the
   first half of all_reduce) send exact byte counts per rank (all_to_all with splits). The padding never
   leaves this module.
4. Virtual devices: a rank hosting several positions sends them together in position order and unpacks each.
5. Scratch buffers (send and receive buffers, reduced chunks) come from the worker's `BufferPool` and go back
   once the outputs are built: a fresh large host buffer costs a page fault per 4 KiB, about as much as moving it.
6. Poison travels with the op: each rank's packed contribution to each peer ends with one flag element, set when
   an input it packed was poisoned (an earlier op failed there). The poisoned rank still takes part (with zeros),
   so its peers never wait for it, and puts the original report in the group's store first; an output built from
   a flagged contribution is poisoned with that report. Every device gets its own output tensor.
7. Direct sends: from DIRECT_MIN_BYTES up, where packing would copy the whole input, the backend reads the stored
   shard itself. An all_gather of even shards, one position per rank, contiguous, goes from the shard straight
   into the output tensor where it is gathered along a dim with only size-1 dims before it (rank order is then
   the output's order), and along an inner dim into a receive buffer that one strided copy lays into the output
   (on two ranks where the backend gathers by all_to_all: the shard to the peer alone, and its own slot copied
   from the shard here). An exchange whose pieces for the ranks lie back to back in one shard (`_back_to_back`)
   sends that shard as it is. An all_reduce on two ranks of one position each, where the backend gathers by
   all_to_all, is two all_to_alls to the peer alone (`_pair_all_reduce`): the half the peer reduces goes to it
   as it lies, the peer's contribution to our half comes back and is combined with ours in position order
   straight into our half of the output, which then goes to the peer as it lies while its half lands in place;
   the backend's own all_reduce (rule 2) works in place, so it would copy the input into the output first, and
   that copy costs as much as the transfer. No flag travels then: the poisoned rank's report is in the store
   before it takes part, so once the op is done every rank looks there once (a mark per op; the pair's look runs
   during its second transfer, the peer having published before the first). `prepare` names the shards it sends
   as they are; the executor holds in-place writes to their storage until the op is done (`Executor._wait_sends`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from dtorch_protocol.messages import CollectiveStep, ErrorReport, GroupOp
from dtorch_protocol.values import REDUCE_OPS, divide, reduce_in_order
from dtorch_worker.device import fresh

Reports = dict[int, ErrorReport]  # logical device -> why its value is poisoned


def spelled_out(op: GroupOp) -> GroupOp:
    """`op` with its layout and lengths in full: the controller sends short forms where they are regular (an empty
    layout: rank r hosts position r only, of `op.ranks`; one length: every position's)."""
    layout = op.layout or [[r] for r in range(op.ranks)]
    n = sum(len(ps) for ps in layout)
    sizes = op.sizes * n if len(op.sizes) == 1 else op.sizes
    src_sizes = op.src_sizes * n if len(op.src_sizes) == 1 else op.src_sizes
    if layout is op.layout and sizes is op.sizes and src_sizes is op.src_sizes:
        return op
    return msgspec.structs.replace(op, layout=layout, sizes=sizes, src_sizes=src_sizes)


@dataclass
class Result:
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # logical device -> its new shard
    poisoned: Reports = field(default_factory=dict)  # logical device -> the report its output carries


Finish = Callable[[Any], Result]  # run on the lane with a groups.Ctx, or with a LocalCtx


class BufferPool:
    """Reusable host scratch buffers of at least 1 MiB, up to `limit` bytes kept (device buffers come from torch's
    caching allocator, which pools them already)."""

    SMALLEST = 1 << 20

    def __init__(self, limit: int = 1 << 30) -> None:
        self.limit = limit
        self._free: list[torch.Tensor] = []
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` (at most twice as large when reused)."""
        if device.type == "cpu" and nbytes >= self.SMALLEST:
            with self._lock:
                fits = [b for b in self._free if nbytes <= b.numel() <= 2 * nbytes]
                if fits:
                    best = min(fits, key=lambda b: b.numel())
                    self._free = [b for b in self._free if b is not best]
                    self._kept -= best.numel()
                    return best
        return fresh(nbytes, torch.uint8, device)

    def give(self, buf: torch.Tensor) -> None:
        if buf.device.type != "cpu" or buf.numel() < self.SMALLEST:
            return
        with self._lock:
            while self._free and self._kept + buf.numel() > self.limit:
                self._kept -= self._free.pop(0).numel()  # the oldest go first
            if self._kept + buf.numel() <= self.limit:
                self._free.append(buf)
                self._kept += buf.numel()


NO_POOL = BufferPool(limit=0)


class LocalCtx:
    """The exchange of a group whose every position is on this worker: copies, nothing moves."""

    rank, size, received = 0, 1, 0

    def __init__(self, reports: Reports | None = None) -> None:
        self.reports = reports or {}

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   meanwhile: Callable[[], Any] | None = None) -> Any:
        out.copy_(inp)
        return meanwhile() if meanwhile is not None else None

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.copy_(inp)

    def all_reduce(self, buf: torch.Tensor) -> None:
        pass

    def published(self, rank: int) -> bool:
        return bool(self.reports)

    def any_published(self) -> bool:
        return bool(self.reports)

    def publish(self, report: ErrorReport) -> None:
        pass

    def report_of(self, rank: int) -> ErrorReport | None:
        return next(iter(self.reports.values()), None)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (what travels)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _offsets(sizes: list[int]) -> list[int]:
    out, pos = [], 0
    for s in sizes:
        out.append(pos)
        pos += s
    return out


def _flagged(buf: torch.Tensor, at: list[int]) -> list[bool]:
    """Are the flag elements at `at` (element indices of `buf`) set? One read from the device for all of them."""
    index = torch.tensor([k * buf.element_size() for k in at], dtype=torch.long, device=buf.device)
    return [bool(b) for b in _bytes(buf)[index].tolist()]


def _set_flag(buf: torch.Tensor, at: int, on: bool) -> None:
    flag = _bytes(buf[at: at + 1])
    flag.zero_()
    if on:
        flag[0] = 1


class _Packing:
    """What `prepare` leaves for the lane: the op, this rank's positions and whether it contributes poison."""

    def __init__(self, step: CollectiveStep, op: GroupOp, inputs: dict[int, torch.Tensor], poisoned: Reports,
                 dtype: torch.dtype, pool: BufferPool, gather_by_all_to_all: bool) -> None:
        if not 0 <= op.rank < len(op.layout):
            raise ValueError(f"rank {op.rank} is outside a layout of {len(op.layout)} ranks")
        self.mine = list(op.layout[op.rank])
        if sorted(self.mine) != sorted(op.devices) or any(op.devices[p] not in inputs for p in self.mine):
            raise ValueError(f"positions {self.mine} of rank {op.rank} do not match the devices "
                             f"{dict(op.devices)} here")
        self.step, self.op, self.dtype = step, op, dtype
        self.inputs = {p: inputs[op.devices[p]] for p in self.mine}
        self.template = self.inputs[self.mine[0]]
        self.device = self.template.device
        self.own = next((poisoned[op.devices[p]] for p in self.mine if op.devices[p] in poisoned), None)
        self.w = len(op.layout)
        self.n = sum(len(ps) for ps in op.layout)
        self.pool = pool
        self.gather_by_all_to_all = gather_by_all_to_all
        self._taken: list[torch.Tensor] = []
        self.direct: list[torch.Tensor] = []  # inputs the op sends as they are (rule 7)

    def scratch(self, elements: int) -> torch.Tensor:
        """A flat buffer of `elements` of the op's dtype, returned to the pool by `release`."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        buf = self.pool.take(elements * itemsize, self.device)
        self._taken.append(buf)
        return buf[: elements * itemsize].view(self.dtype)

    def release(self) -> None:
        taken, self._taken = self._taken, []
        for buf in taken:
            self.pool.give(buf)

    def report(self, ctx: Any, flags: list[bool]) -> ErrorReport | None:
        """Our own poison, else the report of the first rank whose contribution was flagged."""
        if self.own is not None:
            return self.own
        return next((ctx.report_of(r) for r, f in enumerate(flags) if f), None)

    def finish(self, ctx: Any, flags: list[bool], outputs: dict[int, torch.Tensor]) -> Result:
        """The outputs, poisoned when built from a flagged contribution."""
        report = self.report(ctx, flags)
        return Result(outputs, {d: report for d in outputs} if report is not None else {})


def _back_to_back(pieces: list[torch.Tensor]) -> torch.Tensor | None:
    """The pieces as one flat tensor, where they lie back to back in order in one contiguous storage (rule 7)."""
    pieces = [t for t in pieces if t.numel()]
    if not pieces or any(not t.is_contiguous() for t in pieces):
        return None
    storage, at = pieces[0].untyped_storage(), pieces[0].data_ptr()
    for t in pieces:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != at:
            return None
        at += t.numel() * t.element_size()
    flat = torch.empty(0, dtype=pieces[0].dtype, device=pieces[0].device)
    return flat.set_(storage, pieces[0].storage_offset(), (sum(t.numel() for t in pieces),), (1,))


def _exchange(pk: _Packing, send_pieces: Callable[[int], list[torch.Tensor]],
              recv_shapes: Callable[[int], list[list[int]]]) -> Callable[[Any], tuple[list[list[torch.Tensor]],
                                                                                        list[bool]]]:
    """Pack, for every rank r, `send_pieces(r)` plus a flag element; return what the lane runs: the all_to_all,
    giving per source rank the pieces shaped `recv_shapes(r)` and its flag. Where the pieces already lie back to
    back in the input, from DIRECT_MIN_BYTES up, they are sent as they are, and flags come from the store
    (rule 7)."""
    w = pk.w
    pieces = [send_pieces(r) for r in range(w)]
    sizes_in = [sum(t.numel() for t in ps) for ps in pieces]
    send = _back_to_back([t for ps in pieces for t in ps]) if w > 1 and \
        sum(sizes_in) * pk.template.element_size() >= DIRECT_MIN_BYTES else None
    flag = 0 if send is not None else 1  # elements of flag after each rank's part
    counts_in = [n + flag for n in sizes_in]
    counts_out = [sum(math.prod(s) for s in recv_shapes(r)) + flag for r in range(w)]
    if send is not None:
        pk.direct.append(send)
    else:
        send = pk.scratch(sum(counts_in))
        pos = 0
        for r in range(w):
            for t in pieces[r]:
                send[pos: pos + t.numel()].view(t.shape).copy_(t)
                pos += t.numel()
            _set_flag(send, pos, pk.own is not None)
            pos += 1
    itemsize = send.element_size()

    def run(ctx: Any) -> tuple[list[list[torch.Tensor]], list[bool]]:
        if pk.own is not None:
            ctx.publish(pk.own)
        out = pk.scratch(sum(counts_out))
        ctx.all_to_all(_bytes(out), _bytes(send), [c * itemsize for c in counts_out],
                       [c * itemsize for c in counts_in])
        got, marks, at = [], [], 0
        for r in range(w):
            parts = []
            for s in recv_shapes(r):
                k = math.prod(s)
                parts.append(out[at: at + k].view(s))
                at += k
            got.append(parts)
            marks.append(at)
            at += flag
        return got, _flagged(out, marks) if flag else _published_flags(pk, ctx)

    return run


def _gather(pk: _Packing, parts: list[torch.Tensor], slot: int, slots: int
            ) -> Callable[[Any], tuple[list[list[torch.Tensor]], list[bool]]]:
    """Pack `parts` (this rank's positions, at most `slot` elements each) into `slots` padded slots and a
    flag element; return what the lane runs: the all_gather, giving every rank's slots and flag."""
    size = slots * slot + 1
    copies = pk.w if pk.gather_by_all_to_all else 1  # an all_to_all sends every rank its own copy
    send = pk.scratch(copies * size)
    for s, t in enumerate(parts):
        send[s * slot: s * slot + t.numel()].view(t.shape).copy_(t)  # one copy, whatever the strides
    _set_flag(send, slots * slot, pk.own is not None)
    for c in range(1, copies):
        send[c * size: (c + 1) * size].copy_(send[:size])

    def run(ctx: Any) -> tuple[list[list[torch.Tensor]], list[bool]]:
        if pk.own is not None:
            ctx.publish(pk.own)
        out = pk.scratch(pk.w * size)
        if copies > 1:
            nbytes = size * out.element_size()
            ctx.all_to_all(_bytes(out), _bytes(send), [nbytes] * pk.w, [nbytes] * pk.w)
        else:
            ctx.all_gather(_bytes(out), _bytes(send))
        got = [[out[r * size + s * slot: r * size + (s + 1) * slot] for s in range(slots)] for r in range(pk.w)]
        return got, _flagged(out, [r * size + slots * slot for r in range(pk.w)])

    return run


def _published_flags(pk: _Packing, ctx: Any) -> list[bool]:
    """Rule 7's poison flags: which ranks published a report before taking part (one look when none did)."""
    if not ctx.any_published():
        return [False] * pk.w
    return [ctx.published(r) for r in range(pk.w)]


# ---------------------------------------------------------------------------- kinds

DIRECT_MIN_BYTES = 1 << 18  # rule 7: below it, a copy costs less than the look in the store


def _direct_gather(pk: _Packing) -> bool:
    x = pk.template
    return (x.numel() * x.element_size() >= DIRECT_MIN_BYTES and all(len(ps) == 1 for ps in pk.op.layout)
            and len(set(pk.op.sizes)) == 1 and x.is_contiguous() and (pk.w == 2 or not pk.gather_by_all_to_all))


def _all_gather_direct(pk: _Packing) -> Finish:
    """Rule 7: the shard as it lies, gathered by the backend's all_gather, or where the backend gathers by all_to_all,
    on two ranks, by an all_to_all sending the shard to the peer alone (nothing to self, so no copies to pack) with
    the shard's own slot copied here while the transfer runs. Along the outermost dim that is not 1 the ranks' slots
    are the output's own bytes; along an inner one they are a receive buffer, laid into the output by one strided
    copy."""
    x, i, w, me = pk.template, pk.step.dim, pk.w, pk.op.rank
    pk.direct.append(x)
    shape = list(x.shape)
    shape[i] *= w
    out = fresh(shape, pk.dtype, pk.device)
    outer = math.prod(x.shape[:i])
    # the output as [outer, rank, the rest of a shard]: rank r's shard is out_by_rank[:, r]
    out_by_rank = _bytes(out).view(outer, w, -1)
    inner = outer > 1
    if not inner:
        recv = out
    else:  # all_to_all on two ranks receives the peer's shard alone
        recv = pk.scratch(x.numel() * (1 if pk.gather_by_all_to_all else w))
    slots = _bytes(recv).view(1 if inner and pk.gather_by_all_to_all else w, -1)

    def finish(ctx: Any) -> Result:
        if pk.own is not None:
            ctx.publish(pk.own)
        mine = _bytes(x)
        if pk.gather_by_all_to_all:
            peer = 1 - me
            n = mine.numel()
            splits = [n if r == peer else 0 for r in range(2)]
            into = slots[0] if inner else slots[peer]
            own = out_by_rank[:, me] if inner else slots[me]  # our slot of the output: not where the peer's lands
            ctx.all_to_all(into, mine, splits, splits, meanwhile=lambda: own.copy_(mine.view(own.shape)))
            if inner:
                out_by_rank[:, peer].copy_(into.view(outer, -1))
        else:
            ctx.all_gather(_bytes(recv), mine)
            if inner:
                out_by_rank.copy_(slots.view(w, outer, -1).transpose(0, 1))
        return pk.finish(ctx, _published_flags(pk, ctx), {pk.op.devices[pk.mine[0]]: out})

    return finish


def _all_gather(pk: _Packing) -> Finish:
    if _direct_gather(pk):
        return _all_gather_direct(pk)
    op, i = pk.op, pk.step.dim
    sizes = list(op.sizes)
    rest = [n for d, n in enumerate(pk.template.shape) if d != i]
    unit = math.prod(rest)  # elements per unit of length along dim i
    slots = max(len(ps) for ps in op.layout)
    slot = max(sizes) * unit
    run = _gather(pk, [pk.inputs[p].movedim(i, 0) for p in pk.mine], slot, slots)

    def finish(ctx: Any) -> Result:
        got, flags = run(ctx)
        parts = {p: got[r][s][: sizes[p] * unit].view([sizes[p], *rest]).movedim(0, i)
                 for r, ps in enumerate(op.layout) for s, p in enumerate(ps)}
        full = torch.cat([parts[p] for p in range(pk.n)], dim=i).contiguous()
        return pk.finish(ctx, flags, {op.devices[p]: full if k == 0 else full.clone()
                                      for k, p in enumerate(pk.mine)})

    return finish


def _exchanges(pk: _Packing) -> Finish:
    """all_to_all and reduce_scatter: position p sends position q its slice q along dim; q combines the slices
    (concatenated along src_dim for all_to_all, reduced in position order for reduce_scatter)."""
    op, j, i = pk.op, pk.step.dim, pk.step.src_dim
    sizes, offs = list(op.sizes), _offsets(list(op.sizes))
    a2a = pk.step.kind == "all_to_all"

    def shape(p: int, q: int) -> list[int]:
        s = list(pk.template.shape)
        s[j] = sizes[q]
        if a2a:
            s[i] = op.src_sizes[p]
        return s

    run = _exchange(pk, lambda r: [pk.inputs[p].narrow(j, offs[q], sizes[q]) for q in op.layout[r] for p in pk.mine],
                    lambda r: [shape(p, q) for q in pk.mine for p in op.layout[r]])

    def finish(ctx: Any) -> Result:
        got, flags = run(ctx)
        pieces: dict[tuple[int, int], torch.Tensor] = {}
        for r, ps in enumerate(op.layout):
            for k, (q, p) in enumerate((q, p) for q in pk.mine for p in ps):
                pieces[(p, q)] = got[r][k]
        outputs = {}
        for q in pk.mine:
            ordered = [pieces[(p, q)] for p in range(pk.n)]
            if a2a:
                outputs[op.devices[q]] = torch.cat(ordered, dim=i)
            else:
                out = fresh(ordered[0].shape, pk.dtype, pk.device)
                outputs[op.devices[q]] = reduce_in_order(ordered, pk.step.reduce, out=out)
        return pk.finish(ctx, flags, outputs)

    return finish


NATIVE_SUM: dict[torch.dtype, str] = {  # dtype -> when the backend's sum equals the sum in mesh order
    # (int16 is exact too, but neither gloo nor NCCL reduces it: "Invalid scalar type"; it sums here)
    **{t: "any" for t in (torch.uint8, torch.int8, torch.int32, torch.int64)},
    torch.float32: "two", torch.float64: "two",
}


def _native(pk: _Packing) -> bool:
    when = NATIVE_SUM.get(pk.dtype)
    return pk.step.reduce in ("sum", "avg") and pk.w > 1 and (
        when == "any" or when == "two" and pk.n == 2 and all(len(ps) == 1 for ps in pk.op.layout))


def _native_all_reduce(pk: _Packing) -> Finish:
    """The backend's all_reduce, in place on this rank's (locally summed) value and a trailing poison count."""
    shape, total = list(pk.template.shape), pk.template.numel()
    buf = fresh(total + 1, pk.dtype, pk.device)  # becomes the output: not scratch
    reduce_in_order([pk.inputs[p].reshape(-1) for p in pk.mine], "sum", out=buf[:total])
    buf[total] = 1 if pk.own is not None else 0

    def finish(ctx: Any) -> Result:
        if pk.own is not None:
            ctx.publish(pk.own)
        ctx.all_reduce(buf)
        value = buf[:total].view(shape)
        if pk.step.reduce == "avg":
            divide(value, pk.n)
        report = None
        if buf[total].item():  # how many ranks contributed poison: find whose report to carry
            report = pk.own or ctx.report_of(next((r for r in range(pk.w) if ctx.published(r)), 0))
        outputs = {pk.op.devices[p]: value if k == 0 else value.clone() for k, p in enumerate(pk.mine)}
        return Result(outputs, {d: report for d in outputs} if report is not None else {})

    return finish


def _pair(pk: _Packing) -> bool:
    x = pk.template
    return (pk.gather_by_all_to_all and pk.w == 2 and pk.n == 2 and x.is_contiguous()
            and x.numel() * x.element_size() >= DIRECT_MIN_BYTES)


def _pair_all_reduce(pk: _Packing) -> Finish:
    """Rule 7 on two ranks of one position each, where the backend gathers by all_to_all: nothing is packed or
    copied. The half of the input the peer reduces goes to it as it lies, the peer's contribution to our half
    arrives in a scratch buffer, the two are combined in position order straight into our half of the output,
    and that half goes to the peer as it lies while the peer's half arrives in place."""
    x, me = pk.template, pk.op.rank
    peer, total = 1 - me, x.numel()
    half = -(-total // 2)
    (lo, hi), (plo, phi) = [(0, half), (half, total)][me], [(0, half), (half, total)][peer]
    flat = x.reshape(-1)  # a view: the shard is contiguous
    pk.direct.append(x)
    out = fresh(total, pk.dtype, pk.device)
    theirs = pk.scratch(hi - lo)
    first = pk.mine[0] < pk.op.layout[peer][0]  # our position comes first in mesh order

    def splits(elements: int) -> list[int]:
        return [elements * x.element_size() if r == peer else 0 for r in range(2)]

    def finish(ctx: Any) -> Result:
        if pk.own is not None:
            ctx.publish(pk.own)
        ctx.all_to_all(_bytes(theirs), _bytes(flat[plo:phi]), splits(hi - lo), splits(phi - plo))
        ours = flat[lo:hi]
        reduce_in_order([ours, theirs] if first else [theirs, ours], pk.step.reduce, out=out[lo:hi])
        # the peer published any poison before the first exchange, so the look in the store runs during the second
        flags = ctx.all_to_all(_bytes(out[plo:phi]), _bytes(out[lo:hi]), splits(phi - plo), splits(hi - lo),
                               meanwhile=lambda: _published_flags(pk, ctx))
        return pk.finish(ctx, flags, {pk.op.devices[pk.mine[0]]: out.view(x.shape)})

    return finish


def _all_reduce(pk: _Packing) -> Finish:
    """A reduce-scatter of flat chunks (one per rank, reduced in position order by its owner), then an all_gather
    of the reduced chunks. The first exchange carries every rank's poison flag to every rank, so the all_gather
    needs none and its output is the value itself (no copy)."""
    if _pair(pk):
        return _pair_all_reduce(pk)
    if _native(pk):
        return _native_all_reduce(pk)
    op, w = pk.op, pk.w
    shape, total = list(pk.template.shape), pk.template.numel()
    chunk = -(-total // w) if total else 0
    bounds = [(min(r * chunk, total), min((r + 1) * chunk, total)) for r in range(w)]
    flats = {p: pk.inputs[p].reshape(-1) for p in pk.mine}
    lo_r, hi_r = bounds[op.rank]
    run = _exchange(pk, lambda r: [flats[p][bounds[r][0]: bounds[r][1]] for p in pk.mine],
                    lambda r: [[hi_r - lo_r] for _p in op.layout[r]])

    def finish(ctx: Any) -> Result:
        got, flags = run(ctx)
        report = pk.report(ctx, flags)  # a poisoned contribution poisons every chunk, on every rank
        by_pos = {p: got[r][k] for r, ps in enumerate(op.layout) for k, p in enumerate(ps)}
        mine = pk.scratch(chunk)
        reduce_in_order([by_pos[p] for p in range(pk.n)], pk.step.reduce, out=mine[: hi_r - lo_r])
        out = fresh(w * chunk, pk.dtype, pk.device)
        if total:
            ctx.all_gather(_bytes(out), _bytes(mine))
        full = out[:total].view(shape)
        outputs = {op.devices[p]: full if k == 0 else full.clone() for k, p in enumerate(pk.mine)}
        return Result(outputs, {d: report for d in outputs} if report is not None else {})

    return finish


def _slice(pk: _Packing) -> Finish:
    offs = _offsets(list(pk.op.sizes))
    result = Result({pk.op.devices[p]: pk.inputs[p].narrow(pk.step.dim, offs[p], pk.op.sizes[p]).clone(
        memory_format=torch.contiguous_format) for p in pk.mine})
    if pk.own is not None:
        result.poisoned = {d: pk.own for d in result.outputs}
    return lambda _ctx: result


KINDS: dict[str, Callable[[_Packing], Finish]] = {
    "all_gather": _all_gather,
    "all_to_all": _exchanges,
    "reduce_scatter": _exchanges,
    "all_reduce": _all_reduce,
    "slice": _slice,
}


def prepare(step: CollectiveStep, op: GroupOp, inputs: dict[int, torch.Tensor], poisoned: Reports,
            dtype: torch.dtype, pool: BufferPool = NO_POOL, gather_by_all_to_all: bool = False,
            direct: list[torch.Tensor] | None = None) -> Finish:
    """Pack this rank's inputs for `op` now (poisoned ones as they are: zeros); the result finishes on the lane.
    `direct` receives the inputs it will send as they are, unpacked (rule 7): keep them unwritten until it is done."""
    make = KINDS.get(step.kind)
    if make is None:
        raise ValueError(f"unknown collective step {step.kind!r}")
    if step.kind in ("reduce_scatter", "all_reduce") and step.reduce not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {step.reduce!r}")
    inputs = {d: t if t.dtype == dtype else t.to(dtype) for d, t in inputs.items()}
    pk = _Packing(step, op, inputs, poisoned, dtype, pool, gather_by_all_to_all)
    finish = make(pk)
    if direct is not None:
        direct.extend(pk.direct)

    def finish_and_release(ctx: Any) -> Result:
        try:
            return finish(ctx)
        finally:
            pk.release()  # the outputs share nothing with the scratch buffers

    return finish_and_release
