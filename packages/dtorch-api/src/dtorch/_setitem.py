"""Writes through an index (`x[i] = v`) into a DTensor sharded on an indexed dim, carried out where the rows live.

`x[5] = 1` is `x.select(0, 5).fill_(1)`: a view, then a write through it. On a tensor sharded on dim 0 that row
lives on one device, which no placement can say, so the view was taken of a gathered copy (the whole tensor on
every device) and the copy written back (`_views`): 64 MiB moved, and a quarter of a second, to write one row of a
64 MiB tensor (torch's DTensor gathers too). A sequence-sharded KV cache written at each decoding step, a buffer
filled row by row, a mask set in place: each paid the whole tensor per write.

Rules (`region` decides, `DTensor.__setitem__` carries it out with `write`; outside rule 1 torch's path runs):
  1. The case: basic indexing (ints, slices with a positive step, one `...`) that names part of a dim of `x` that
     is sharded; nothing Partial in `x`; autograd not recording the write (grad mode off, or neither `x` nor the
     value requires grad); no view of a moved copy of `x` alive (`_views`); a value that is a real number or a
     tensor broadcasting to the indexed region (a DTensor on `x`'s mesh; a plain one is lifted, replicated).
  2. The region keeps every dim of `x` (an int is a slice of one). Each device writes the part of the region in
     its own shard: per indexed dim, a slice of its local rows (empty where it holds none of them), taken on the
     workers with per-device arguments, then `fill_` with the number or `copy_` from the value's part.
  3. The value's part: where the value has the region's shape without the ints' dims and each device already
     holds its part of it (`x[:, 3] = y` with `y` sharded as `x`'s rows), the value as it is; otherwise the value
     replicated on the mesh, broadcast to the region and sliced per device (it moves, `x` does not).
  4. The write is one operation of a compiled step (`_capture`), and bumps `x`'s version as torch's write does, so
     autograd still refuses a backward through a tensor written after it was saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtorch import _views
from dtorch._local import emit, is_dtensor, spec, to
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Replicate

aten = torch.ops.aten
Range = tuple[int, int, int]  # (first index, count, step) of one dim


@dataclass(frozen=True)
class Region:
    """What `x[index]` names, per dim of `x` (rule 2), and which dims were ints."""

    ranges: tuple[Range, ...]
    ints: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(count for _, count, _ in self.ranges)

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The shape torch gives `x[index]` (the ints' dims dropped), to which the value broadcasts."""
        return tuple(count for d, (_, count, _) in enumerate(self.ranges) if d not in self.ints)


def region(x: Any, index: Any, value: Any) -> Region | None:
    """The region `x[index] = value` writes, when rule 1 holds; else None (torch's path)."""
    spec_ = x._spec
    if spec_.has_partial() or spec_.unflattened() is not spec_ or _views.by_root and (
            getattr(x, "_origin", None) is not None or _views.by_root.get(_views._root(x))):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or isinstance(value, torch.Tensor) and value.requires_grad):
        return None
    if is_dtensor(value):
        if value.device_mesh != x.device_mesh:
            return None
    elif not isinstance(value, torch.Tensor) and type(value) not in (int, float, bool):
        return None
    ranges = _ranges(index, tuple(x.shape))
    if ranges is None:
        return None
    ranges, ints = ranges
    sharded = {p.dim % x.ndim for p, n in zip(x.placements, x.device_mesh.shape) if p.is_shard() and n > 1}
    if not any(ranges[d] != (0, x.shape[d], 1) for d in sharded):
        return None  # torch's path takes the view where it lies
    where = Region(ranges, ints)
    if isinstance(value, torch.Tensor):
        try:
            if torch.broadcast_shapes(tuple(value.shape), where.value_shape) != where.value_shape:
                return None
        except RuntimeError:
            return None
    return where


def write(x: Any, where: Region, value: Any) -> None:
    """Rules 2 and 3: each device writes its part of `where` (the value a number or a DTensor on `x`'s mesh)."""
    mesh = x.device_mesh
    boxes = [shard_box(tuple(x.shape), mesh.shape, x.placements, c) for c in coords(mesh.shape)]
    parts = [[_part(r, box[d]) for d, r in enumerate(where.ranges)] for box in boxes]  # per device, per dim
    dst = x
    for d, r in enumerate(where.ranges):
        if r != (0, x.shape[d], 1):
            dst = emit(aten.slice.Tensor, (dst, d), spec(mesh, x.placements, where.shape, x.dtype),
                       per_device=[(dst, d, lo, hi, r[2]) for (lo, hi), _ in (p[d] for p in parts)])
    if not isinstance(value, torch.Tensor):
        emit(aten.fill_.Scalar, (dst, value), None)
        return
    emit(aten.copy_.default, (dst, _value_parts(value, where, [[k for _, k in p] for p in parts], boxes)), None)


def _value_parts(value: Any, where: Region, parts: list[list[tuple[int, int]]], boxes: list) -> Any:
    """Rule 3: a DTensor whose local tensor on each device is that device's part of the region (`parts`: per device,
    per dim, (first, count) in the region's coordinates)."""
    mesh, shape = value.device_mesh, where.shape
    own = [tuple(p for d, p in enumerate(dev) if d not in where.ints) for dev in parts]
    if tuple(value.shape) == where.value_shape and not value._spec.has_partial() and \
            value._spec.unflattened() is value._spec and \
            all(shard_box(where.value_shape, mesh.shape, value.placements, c) == mine
                for c, mine in zip(coords(mesh.shape), own)):
        v = value  # rule 3: each device holds its part already
        for d in where.ints:
            v = emit(aten.unsqueeze.default, (v, d), spec(mesh, value.placements, shape, value.dtype))
        return v
    v = to(value, (Replicate(),) * mesh.ndim)
    v = emit(aten.expand.default, (v, list(where.value_shape)), spec(mesh, v.placements, where.value_shape, v.dtype))
    for d in where.ints:
        v = emit(aten.unsqueeze.default, (v, d), spec(mesh, v.placements, shape, v.dtype))
    for d, n in enumerate(shape):
        if any(dev[d] != (0, n) for dev in parts):
            v = emit(aten.slice.Tensor, (v, d), spec(mesh, v.placements, shape, v.dtype),
                     per_device=[(v, d, first, first + count) for first, count in (dev[d] for dev in parts)])
    return v


def _part(r: Range, held: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Of the indices `r` selects in a dim, those in the device's rows `held` (start, length): ((local start, local
    stop), (first, count) in the region's coordinates); (0, 0) and a count of 0 where it holds none."""
    start, n, step = r
    lo, length = held
    first = max(0, -((start - lo) // step))  # ceil((lo - start) / step)
    last = min(n - 1, (lo + length - 1 - start) // step)
    if last < first:
        return (0, 0), (first if first < n else n, 0)
    begin = start + first * step - lo
    return (begin, begin + (last - first) * step + 1), (first, last - first + 1)


def _ranges(index: Any, shape: tuple[int, ...]) -> tuple[tuple[Range, ...], tuple[int, ...]] | None:
    """Per dim of a tensor of `shape`, the range basic indexing `index` selects, and which dims were ints; None for
    any other index (tensors, lists, None, bools, negative steps, an int out of range: torch's path answers)."""
    items = index if type(index) is tuple else (index,)
    ellipses = sum(i is Ellipsis for i in items)
    if ellipses > 1 or len(items) - ellipses > len(shape):
        return None
    if ellipses:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1:]
    items = items + (slice(None),) * (len(shape) - len(items))
    ranges, ints = [], []
    for d, (item, size) in enumerate(zip(items, shape)):
        if type(item) is int:
            i = item + size if item < 0 else item
            if not 0 <= i < size:
                return None
            ranges.append((i, 1, 1))
            ints.append(d)
        elif type(item) is slice and all(type(v) in (int, type(None)) for v in (item.start, item.stop, item.step)):
            if item.step is not None and item.step <= 0:
                return None
            start, stop, step = item.indices(size)
            ranges.append((start, len(range(start, stop, step)), step))
        else:
            return None
    return tuple(ranges), tuple(ints)
