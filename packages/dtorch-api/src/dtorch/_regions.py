"""Regions of a DTensor named by basic indexing (`x[2:5, 3]`), written and read where their rows live.

A region keeps every dim of its tensor (an int is a slice of one). On a tensor sharded on an indexed dim each device
holds its own part of the region, possibly none; what it holds is worked out per device (`shard_box`) and reached
with per-device arguments (`_local.emit`), so the tensor itself never moves.

Rules:
  1. `write(x, where, value)`: each device slices its part of `where` out of its shard (empty where it holds none)
     and fills it with a number, or copies its part of a DTensor value into it.
  2. The value's part: the value keeps its layout on each mesh dim where that already gives every device its part
     (Replicate there, or the same sharding of the same rows as `x`'s, over the whole dim); elsewhere it is
     replicated; then each device slices its part out of what it holds. A value that broadcasts to the region is
     replicated and expanded first.
  3. `read(x, where)`: a copy of the region laid out as `x` is but replicated on the mesh dims that shard an indexed
     dim. Each device pads its part into a region of its own (the minimum of the dtype elsewhere), declared
     Partial("max") on those mesh dims, and one reduction of the region's bytes, not a gather of `x`, makes the
     copy (`max` keeps every value as it is, -0.0 and NaN included; a sum would lose -0.0's sign). The dtypes of
     `_local.REDUCIBLE` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dtorch._local import emit, on_dims, spec, to
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Partial, Placement, Replicate

aten = torch.ops.aten
Range = tuple[int, int, int]  # (first index, count, step) of one dim
_R = Replicate()


@dataclass(frozen=True)
class Region:
    """What `x[index]` names, per dim of `x`, and which dims were ints."""

    ranges: tuple[Range, ...]
    ints: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(count for _, count, _ in self.ranges)

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The shape torch gives `x[index]` (the ints' dims dropped), to which a written value broadcasts."""
        return tuple(count for d, (_, count, _) in enumerate(self.ranges) if d not in self.ints)

    def partial_dims(self, shape: tuple[int, ...]) -> list[int]:
        """The dims of a tensor of `shape` of which the region names less than the whole."""
        return [d for d, r in enumerate(self.ranges) if r != (0, shape[d], 1)]


def region_of(index: Any, shape: tuple[int, ...]) -> Region | None:
    """The region basic indexing `index` names in a tensor of `shape`; None for any other index (tensors, lists,
    None, bools, negative steps, an int out of range: torch's path answers)."""
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
    return Region(tuple(ranges), tuple(ints))


def sharded_dims(x: Any) -> set[int]:
    """The dims of `x` some mesh dim of more than one device shards."""
    return {p.dim % x.ndim for p, n in zip(x.placements, x.device_mesh.shape) if p.is_shard() and n > 1}


def write(x: Any, where: Region, value: Any) -> None:
    """Rule 1: each device writes its part of `where` (the value a number or a DTensor on `x`'s mesh)."""
    parts = _parts(x, where)
    dst = _own_parts(x, where, parts)
    if not isinstance(value, torch.Tensor):
        emit(aten.fill_.Scalar, (dst, value), None)
        return
    emit(aten.copy_.default, (dst, _value_parts(value, x, where, parts)), None)


def read(x: Any, where: Region) -> Any:
    """Rule 3: the region's values (shape `where.shape`), replicated on the mesh dims that shard an indexed dim."""
    mesh, shape = x.device_mesh, where.shape
    parts = _parts(x, where)
    own = _own_parts(x, where, parts)
    indexed = set(where.partial_dims(tuple(x.shape)))
    spread = [i for i, p in enumerate(x.placements) if p.is_shard() and p.dim % x.ndim in indexed]
    lowest = float("-inf") if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
    pads = []
    for dev in parts:  # constant_pad_nd's pads run from the last dim: (before, after) per dim, indexed dims only
        widths = [w for d in reversed(range(x.ndim))
                  for w in ((dev[d][1][0], shape[d] - sum(dev[d][1])) if d in indexed else (0, 0))]
        pads.append((own, widths, lowest))
    padded = emit(aten.constant_pad_nd.default, pads[0],
                  spec(mesh, on_dims(x.placements, spread, Partial("max")), shape, x.dtype), per_device=pads)
    return to(padded, on_dims(x.placements, spread, _R))


Part = tuple[tuple[int, int, int], tuple[int, int]]  # (local start, local stop, step), (first, count) in the region


def _parts(x: Any, where: Region) -> list[list[Part]]:
    """Per device (the mesh's row-major order), per dim: the device's part of the region."""
    mesh = x.device_mesh
    return [[_part(r, held) for r, held in zip(where.ranges, shard_box(tuple(x.shape), mesh.shape, x.placements, c))]
            for c in coords(mesh.shape)]


def _part(r: Range, held: tuple[int, int]) -> Part:
    """Of the indices `r` selects in a dim, those in the device's rows `held` (start, length)."""
    start, n, step = r
    lo, length = held
    first = max(0, -((start - lo) // step))  # ceil((lo - start) / step)
    last = min(n - 1, (lo + length - 1 - start) // step)
    if last < first:
        return (0, 0, 1), (min(first, n), 0)
    begin = start + first * step - lo
    return (begin, begin + (last - first) * step + 1, step), (first, last - first + 1)


def _own_parts(x: Any, where: Region, parts: list[list[Part]]) -> Any:
    """Each device's part of the region, a view of its shard (the declared layout is `x`'s, of the region's shape:
    the parts' sizes differ per device, which only this module's ops see)."""
    out = x
    for d in where.partial_dims(tuple(x.shape)):
        out = emit(aten.slice.Tensor, (out, d), spec(x.device_mesh, x.placements, where.shape, x.dtype),
                   per_device=[(out, d, *dev[d][0]) for dev in parts])
    return out


def _value_parts(value: Any, x: Any, where: Region, parts: list[list[Part]]) -> Any:
    """Rule 2: a DTensor whose local tensor on each device is that device's part of the region."""
    mesh, shape = value.device_mesh, where.shape
    if tuple(value.shape) != where.value_shape or value._spec.unflattened() is not value._spec:
        v = to(value, (_R,) * mesh.ndim)
        v = emit(aten.expand.default, (v, list(where.value_shape)), spec(mesh, v.placements, where.value_shape,
                                                                           v.dtype))
    else:
        v = to(value, _kept(value, x, where))
    dims = [d for d in range(x.ndim) if d not in where.ints]  # the region dim of each of v's dims
    held = [shard_box(where.value_shape, mesh.shape, v.placements, c) for c in coords(mesh.shape)]
    for j, d in enumerate(dims):
        cuts = [(first - box[j][0], first - box[j][0] + count) for box, dev in zip(held, parts)
                for first, count in (dev[d][1],)]
        if any(cut != (0, box[j][1]) for cut, box in zip(cuts, held)):
            v = emit(aten.slice.Tensor, (v, j), spec(mesh, v.placements, where.value_shape, v.dtype),
                     per_device=[(v, j, *cut) for cut in cuts])
    for d in where.ints:
        v = emit(aten.unsqueeze.default, (v, d), spec(mesh, v.placements, shape, v.dtype))
    return v


def _kept(value: Any, x: Any, where: Region) -> tuple[Placement, ...]:
    """Rule 2: the value's placements where they give every device (a superset of) its part, Replicate elsewhere."""
    dims = [d for d in range(x.ndim) if d not in where.ints]
    out = []
    for p in value.placements:
        if p.is_partial():
            out.append(_R)
        elif p.is_shard():
            j = p.dim % value.ndim
            d = dims[j]
            same = all((q.is_shard() and q.dim % value.ndim == j) == (r.is_shard() and r.dim % x.ndim == d)
                       for q, r in zip(value.placements, x.placements))
            out.append(p if same and where.ranges[d] == (0, x.shape[d], 1) else _R)
        else:
            out.append(p)
    return tuple(out)
