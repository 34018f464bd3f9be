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

import bisect
import itertools
import math
from collections.abc import Collection, Sequence
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
    loc = {device: (worker, address) for device, worker, address in where}
    plan = _Shared(shape, src_mesh, src_placements, dst_mesh, dst_placements, loc.keys())
    sources = _Sources(shape, src_mesh, src_placements)
    return tuple((d, _plan_one(plan, sources, d, c_d, i, loc))
                 for i, (d, c_d) in enumerate(zip(dst_mesh[0], coords(dst_mesh[1]))))


@lru_cache(maxsize=1024)
def pulled(shape: tuple[int, ...], src_mesh: MeshKey, src_placements: tuple[Placement, ...], dst_mesh: MeshKey,
           dst_placements: tuple[Placement, ...], binding: tuple[tuple[int, str], ...]) -> dict[str, int]:
    """Elements each worker would pull from other workers under `plan_redistribute`'s plans, without making them.

    `binding`: (logical device, worker id) pairs. A piece is pulled unless a replica of its box lies on the
    destination's worker (`_choose` picks that one), so this reads only the sources on that worker:
    O(destinations x sources per worker), where the plans are O(destinations x sources) (1,048,576 pieces for an
    all_gather on 1,024 devices). The collective cost rule compares with it (collectives.py rule 5)."""
    worker = dict(binding)
    plan = _Shared(shape, src_mesh, src_placements, dst_mesh, dst_placements, worker.keys())
    local: dict[str, list[tuple[int, ...]]] = {}
    for s, c_s in zip(src_mesh[0], coords(src_mesh[1])):
        local.setdefault(worker[s], []).append(c_s)
    groups = math.prod(src_mesh[1][k] for k in plan.reduced)  # every combination of the reduced coordinates
    out: dict[str, int] = {}
    for d, c_d in zip(dst_mesh[0], coords(dst_mesh[1])):
        target = plan.target(c_d)
        if target is None:
            continue
        covered: set[tuple[tuple[int, ...], Box]] = set()  # (group, overlap): one layout's overlaps tile once
        for c_s in local.get(worker[d], ()):
            if all(c_s[k] == c_d[k] for k in plan.kept):
                overlap = intersect(shard_box(shape, src_mesh[1], src_placements, c_s), target)
                if overlap is not None:
                    covered.add((tuple(c_s[k] for k in plan.reduced), overlap))
        n = groups * volume(target) - sum(volume(overlap) for _g, overlap in covered)
        if n:
            out[worker[d]] = out.get(worker[d], 0) + n
    return out


class _Shared:
    """What every destination's plan shares: the checked layouts, and which Partial source dims are kept or reduced
    (module docstring)."""

    def __init__(self, shape: tuple[int, ...], src_mesh: MeshKey, src_pl: tuple[Placement, ...], dst_mesh: MeshKey,
                 dst_pl: tuple[Placement, ...], placed: Collection[int]) -> None:
        check_layout(shape, src_mesh[1], src_pl)
        check_layout(shape, dst_mesh[1], dst_pl)
        missing = sorted(set(src_mesh[0]) - set(placed) | set(dst_mesh[0]) - set(placed))
        if missing:
            raise PlanError(f"logical devices {missing} are not placed on any worker")
        self.shape, self.src_shape, self.src_pl, self.dst_shape, self.dst_pl = \
            shape, src_mesh[1], src_pl, dst_mesh[1], dst_pl
        self.same = src_mesh == dst_mesh
        self.kept = [k for k, p in enumerate(src_pl) if p.is_partial() and self.same and dst_pl[k] == p]
        self.reduced = [k for k, p in enumerate(src_pl) if p.is_partial() and k not in self.kept]
        self.ops = sorted({src_pl[k].reduce_op for k in self.reduced})  # type: ignore[attr-defined]

    def target(self, c_d: tuple[int, ...]) -> Box | None:
        """The box the destination at `c_d` builds from the sources; None when it builds nothing (an empty box, or
        zeros where a Partial("sum") dim it does not share with the source puts them)."""
        target = shard_box(self.shape, self.dst_shape, self.dst_pl, c_d)
        if volume(target) == 0:
            return None
        for k, p in enumerate(self.dst_pl):
            if p == _PSUM and not (self.same and self.src_pl[k] == _PSUM) and c_d[k] != 0:
                return None
        if len(self.ops) > 1:
            raise PlanError(f"cannot reduce different Partial ops {self.ops} in one redistribution")
        return target


class _Sources:
    """The source shards by box, found for a target box per tensor dim by bisection: a layout's boxes are identical
    or disjoint, and so are their non-empty extents along each dim. A destination's plan then costs what overlaps
    it, not a pass over every source (a move between two 1,024-device meshes took the core 0.9 s for 1,024 pieces)."""

    def __init__(self, shape: tuple[int, ...], mesh: MeshKey, placements: tuple[Placement, ...]) -> None:
        self.by_box: dict[Box, list[tuple[int, int, tuple[int, ...]]]] = {}  # (mesh position, device, coordinate)
        for i, (s, c_s) in enumerate(zip(mesh[0], coords(mesh[1]))):
            self.by_box.setdefault(shard_box(shape, mesh[1], placements, c_s), []).append((i, s, c_s))
        self.extents = [sorted({box[k] for box in self.by_box if box[k][1]}) for k in range(len(shape))]
        self.starts = [[start for start, _ in extents] for extents in self.extents]

    def overlapping(self, target: Box) -> list[tuple[int, tuple[int, ...]]]:
        """(device, coordinate) of the sources whose boxes overlap `target` (not empty), in mesh order."""
        per_dim = []
        for (t0, tl), extents, starts in zip(target, self.extents, self.starts):
            j = max(bisect.bisect_right(starts, t0) - 1, 0)
            hits = []
            while j < len(extents) and extents[j][0] < t0 + tl:
                if extents[j][0] + extents[j][1] > t0:
                    hits.append(extents[j])
                j += 1
            per_dim.append(hits)
        found = [src for box in itertools.product(*per_dim) for src in self.by_box.get(box, ())]
        return [(s, c_s) for _i, s, c_s in sorted(found)]


def _plan_one(plan: _Shared, sources: _Sources, d: int, c_d: tuple[int, ...], index: int,
              loc: dict[int, tuple[str, str]]) -> ShardPlan:
    target = plan.target(c_d)
    if target is None:
        return ShardPlan(shape=list(box_shape(shard_box(plan.shape, plan.dst_shape, plan.dst_pl, c_d))), groups=[])
    groups: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}
    for s, c_s in sources.overlapping(target):
        if all(c_s[k] == c_d[k] for k in plan.kept):
            groups.setdefault(tuple(c_s[k] for k in plan.reduced), []).append((s, c_s))
    plan_groups = [_tile(plan.shape, plan.src_shape, plan.src_pl, target, members, d, index, loc)
                   for _key, members in sorted(groups.items())]
    return ShardPlan(shape=list(box_shape(target)), groups=plan_groups, reduce=plan.ops[0] if plan.ops else "sum")


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
