"""Where each device's shard sits in the global tensor: pure index arithmetic, no torch.

Shared by the client (upload, fetch), the controller (redistribution plans) and the
simulator. Every shard is a box: one `(start, length)` per tensor dim. Sharding
follows `torch.chunk` semantics, applied mesh dim by mesh dim, left to right, so
two mesh dims sharding the same tensor dim nest.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import product

from dtorch_protocol.placement_types import Placement

Box = tuple[tuple[int, int], ...]


def chunk_range(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th of `parts` torch.chunk pieces of `[start, start+length)`; may be empty."""
    size = -(-length // parts) if length else 0
    lo = min(index * size, length)
    hi = min(lo + size, length)
    return (start + lo, hi - lo)


def coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """All mesh coordinates in row-major order (the order of the mesh's flattened device ids)."""
    return list(product(*(range(n) for n in mesh_shape)))


@lru_cache(maxsize=65536)
def shard_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...],
              coord: tuple[int, ...]) -> Box:
    """The global box held by the device at `coord`."""
    box = [(0, n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            d = placement.dim  # type: ignore[attr-defined]
            start, length = box[d]
            box[d] = chunk_range(start, length, mesh_shape[mesh_dim], coord[mesh_dim])
    return tuple(box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(length for _, length in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when it is empty (a zero-size box overlaps a zero-size box)."""
    out = []
    for (s1, l1), (s2, l2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + l1, s2 + l2)
        if hi < lo or (hi == lo and (l1 or l2)):
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def holds_value(placements: Sequence[Placement], coord: Sequence[int]) -> bool:
    """False where a `Partial("sum")` dim puts zeros: only coordinate 0 carries a value built from a full one.

    avg, max and min partials keep the full value on every coordinate.
    """
    return all(not (p.is_partial() and p.reduce_op == "sum" and c != 0)  # type: ignore[attr-defined]
               for p, c in zip(placements, coord))


def normalize_dim(dim: int, ndim: int) -> int:
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"Shard dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % max(ndim, 1)


def gather_groups(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...],
                  ) -> tuple[list[list[tuple[int, Box]]], str | None]:
    """Which devices to read to rebuild the whole tensor.

    Returns groups (one per combination of coordinates on Partial mesh dims), each a list of
    `(flat device index, box)` that tiles the tensor once, and the reduce op that combines the
    groups (None when nothing is partial).
    """
    partial_dims = [k for k, p in enumerate(placements) if p.is_partial()]
    ops = {placements[k].reduce_op for k in partial_dims}  # type: ignore[attr-defined]
    if len(ops) > 1:
        raise NotImplementedError(f"cannot combine different Partial reduce ops {sorted(ops)} on one tensor")
    groups: dict[tuple[int, ...], dict[Box, int]] = {}
    for flat, c in enumerate(coords(mesh_shape)):
        tiles = groups.setdefault(tuple(c[k] for k in partial_dims), {})
        tiles.setdefault(shard_box(shape, mesh_shape, placements, c), flat)
    return [[(flat, box) for box, flat in tiles.items()] for tiles in groups.values()], (ops.pop() if ops else None)
