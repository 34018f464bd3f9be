"""Redistribution plans: from which source pieces each destination shard is built. Pure and cached.

A plan for destination device d (coordinate c_d in the destination mesh, target box B) is a list of
groups, each a set of pieces that tiles B exactly once, plus the reduce op that combines the groups:

* Zeros. If some destination mesh dim k is Partial("sum") and the source does not carry that same
  partial on the same mesh (so d would have to hold its own share), devices with c_d[k] != 0 hold
  zeros (no groups); coordinate 0 carries the whole value.
* Kept partials. A source mesh dim that is Partial and stays the same Partial on the same mesh keeps
  each device's own share: only sources with the same coordinate there are read.
* Reduced partials. Every other Partial source mesh dim is reduced: each combination of coordinates
  on those dims is one group, combined with the source's reduce op.
* Within a group, candidate boxes are the source shard boxes intersected with B. Shard boxes of one
  layout are identical (replicas) or disjoint, so the distinct intersections tile B; a replica is
  picked preferring d itself, then a device on d's worker, then the others in rotation (to spread reads).

Coordinates are row-major positions in a mesh's device list. Shards follow torch.chunk semantics, so
a shard may be empty; an empty target box gets an empty plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from dtorch_protocol.layout import Box, box_shape, coords, intersect, shard_box
from dtorch_protocol.messages import Piece, ShardPlan
from dtorch_protocol.placement_types import Partial, Placement, placement_from_wire

MeshKey = tuple[tuple[int, ...], tuple[int, ...]]  # (logical devices row-major, mesh shape)
Where = tuple[tuple[int, str, str], ...]  # (logical device, worker id, worker address), sorted by device
Plans = tuple[tuple[int, ShardPlan], ...]  # destination device -> plan, in destination mesh order

_PSUM = Partial("sum")


class PlanError(ValueError):
    """The redistribution cannot be planned (inconsistent specs, unplaced devices, mixed partial ops)."""


@lru_cache(maxsize=1024)
def parse_placements(wire: tuple[str, ...]) -> tuple[Placement, ...]:
    """Wire placements ("S0", "R", "Psum") as Placement objects; ValueError names a bad one."""
    return tuple(placement_from_wire(p) for p in wire)


def check_layout(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> None:
    """Raise PlanError unless `placements` fit the mesh (one per dim) and the tensor (shard dims in range)."""
    if shape and min(shape) < 0:
        raise PlanError(f"negative size in shape {list(shape)}")
    if len(placements) != len(mesh_shape):
        raise PlanError(f"{len(placements)} placements for a {len(mesh_shape)}-d mesh")
    for p in placements:
        if p.is_shard() and not 0 <= p.dim < len(shape):  # type: ignore[attr-defined]
            raise PlanError(f"{p!r} is out of range for a tensor with {len(shape)} dims")


def volume(box: Box) -> int:
    return math.prod(length for _, length in box)


@lru_cache(maxsize=4096)
def plan_redistribute(shape: tuple[int, ...], src_mesh: MeshKey, src_placements: tuple[Placement, ...],
                      dst_mesh: MeshKey, dst_placements: tuple[Placement, ...], where: Where) -> Plans:
    """One ShardPlan per destination device. Cached: a training loop plans each redistribution once."""
    check_layout(shape, src_mesh[1], src_placements)
    check_layout(shape, dst_mesh[1], dst_placements)
    loc = {device: (worker, address) for device, worker, address in where}
    missing = sorted(set(src_mesh[0]) - loc.keys() | set(dst_mesh[0]) - loc.keys())
    if missing:
        raise PlanError(f"logical devices {missing} are not placed on any worker")
    sources = list(zip(src_mesh[0], coords(src_mesh[1])))
    same = src_mesh == dst_mesh
    return tuple(
        (d, _plan_one(shape, src_mesh[1], src_placements, dst_mesh[1], dst_placements, same, sources, d, c_d, i, loc))
        for i, (d, c_d) in enumerate(zip(dst_mesh[0], coords(dst_mesh[1]))))


def _plan_one(shape: tuple[int, ...], src_shape: tuple[int, ...], src_pl: tuple[Placement, ...],
              dst_shape: tuple[int, ...], dst_pl: tuple[Placement, ...], same: bool,
              sources: list[tuple[int, tuple[int, ...]]], d: int, c_d: tuple[int, ...], index: int,
              loc: dict[int, tuple[str, str]]) -> ShardPlan:
    target = shard_box(shape, dst_shape, dst_pl, c_d)
    out_shape = list(box_shape(target))
    if volume(target) == 0:
        return ShardPlan(shape=out_shape, groups=[])
    for k, p in enumerate(dst_pl):
        if p == _PSUM and not (same and src_pl[k] == _PSUM) and c_d[k] != 0:
            return ShardPlan(shape=out_shape, groups=[])
    kept = [k for k, p in enumerate(src_pl) if p.is_partial() and same and dst_pl[k] == p]
    reduced = [k for k, p in enumerate(src_pl) if p.is_partial() and k not in kept]
    ops = sorted({src_pl[k].reduce_op for k in reduced})  # type: ignore[attr-defined]
    if len(ops) > 1:
        raise PlanError(f"cannot reduce different Partial ops {ops} in one redistribution")
    groups: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}
    for s, c_s in sources:
        if all(c_s[k] == c_d[k] for k in kept):
            groups.setdefault(tuple(c_s[k] for k in reduced), []).append((s, c_s))
    plan_groups = [_tile(shape, src_shape, src_pl, target, members, d, index, loc)
                   for _key, members in sorted(groups.items())]
    return ShardPlan(shape=out_shape, groups=plan_groups, reduce=ops[0] if ops else "sum")


def _tile(shape: tuple[int, ...], src_shape: tuple[int, ...], src_pl: tuple[Placement, ...], target: Box,
          members: list[tuple[int, tuple[int, ...]]], d: int, index: int,
          loc: dict[int, tuple[str, str]]) -> list[Piece]:
    """Pieces from `members` that cover `target` exactly once."""
    by_box: dict[Box, list[tuple[int, Box]]] = {}
    for s, c_s in members:
        src_box = shard_box(shape, src_shape, src_pl, c_s)
        overlap = intersect(src_box, target)
        if overlap is not None and volume(overlap):
            by_box.setdefault(overlap, []).append((s, src_box))
    if sum(volume(b) for b in by_box) != volume(target):
        raise PlanError(f"source shards do not tile the target box {target} exactly once")
    d_worker = loc[d][0]
    pieces = []
    for overlap in sorted(by_box):
        s, src_box = _choose(by_box[overlap], d, d_worker, index, loc)
        worker, address = loc[s]
        pieces.append(Piece(
            address="" if worker == d_worker else address, device=s,
            src_offset=[o - b for (o, _), (b, _) in zip(overlap, src_box)],
            dst_offset=[o - b for (o, _), (b, _) in zip(overlap, target)],
            size=[length for _, length in overlap]))
    return pieces


def _choose(replicas: list[tuple[int, Box]], d: int, d_worker: str, index: int,
            loc: dict[int, tuple[str, str]]) -> tuple[int, Box]:
    """The replica to read: d itself, else one on d's worker, else any, rotating with d's index."""
    for replica in replicas:
        if replica[0] == d:
            return replica
    local = [r for r in replicas if loc[r[0]][0] == d_worker]
    pool = local or replicas
    return pool[index % len(pool)]
