"""Redistributions lowered to collectives between workers: which steps, on which groups, and when. Pure.

The translator asks `lower(...)` before it plans point-to-point pieces (redistribute.py); `None` means
pieces. Nothing here touches the network or a clock; plans are cached per layout.

Rules:

1. One mesh dim moves at a time (table `placement_types.MOVES`): Shard(i) -> Replicate is an all_gather,
   Shard(i) -> Shard(j) an all_to_all, Replicate -> Shard(j) a local slice, Partial -> Replicate an all_reduce and
   Partial -> Shard(j) a reduce_scatter, among the devices that differ only in that mesh dim (a *mesh group*,
   positions in mesh order). Kept dims stay as they are (a Partial that stays the same Partial stays a partial).
2. Every Partial dim that is reduced is reduced in ONE step, over the devices that differ only in those dims,
   in row-major order of their coordinates: the order the point-to-point plan reduces in. Collectives only
   move bytes; the owner of each piece reduces it with torch in that order (worker `collectives.py`), so a
   value never depends on the path, the backend, the number of workers or where devices are bound (a
   rebuild on fewer workers gives bit-identical results).
3. Geometry is checked, not assumed: each candidate step's shard boxes (`layout.shard_box`) must satisfy its
   kind's contract (CONTRACTS: e.g. an all_gather's input boxes tile its output box in position order), uneven
   and empty shards included. The orders of the moves are searched exhaustively (a mesh has few dims) and the
   valid order moving the fewest bytes is kept; none valid: pieces.
4. A worker is one rank. The ranks of a mesh group are its distinct workers in the order of their first
   position; a worker hosting several positions (virtual devices) packs them into one contribution and
   unpacks after. A group on one worker moves nothing (it runs locally, without a process group).
5. Cost rule (`route`): the collective path is taken when the source and destination are the same mesh, every
   group of two or more workers has members of one device type that all registered a rendezvous store, none is
   lost, no two share a physical device (NCCL allows one rank per GPU), and the busiest worker receives at most
   COST_FACTOR times the bytes the point-to-point plan would make it pull (padding of uneven shards can make a
   collective move more), counted without making that plan (`redistribute.pulled`: the plan is O(devices^2)).
   Cross-mesh moves, recovery, migration, client Pull and Put stay point-to-point.
6. Groups (`CommGroups`, one table per session): a group is identified by its ranks' workers; it carries the
   session's current generation. Any change of where the session's devices are bound (loss and rebuild,
   migration, relocation, elastic growth, drain) bumps the generation (`CommGroups.bump`): later steps name
   new groups, and workers fence the older generations (worker `groups.py`). Each op of a group gets the
   group's next sequence number; every member issues a group's ops in that order. Each group (and generation)
   gets a fresh secret `key`, sent in its CmdGroup to its members only: the workers' rendezvous stores are
   reachable by anyone on the network, and only a holder of the key can name the group's keys there. Keys are
   drawn by `CommGroups.new_key` (the one random input here, like session ids: unguessable by default,
   replaceable for reproducible runs).
7. Short forms: every rank of a group needs the group's layout and its positions' lengths, O(ranks) each, so a
   collective on 2,048 ranks sent 20 MB of commands. Where they are regular they go short: an empty layout where
   rank r hosts position r only (with `ranks`), one length where every position has it. The worker spells them
   out on receipt (worker `collectives.spelled_out`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from dtorch_controller.core.ids import random_session_id
from dtorch_controller.core.redistribute import pulled
from dtorch_protocol import messages as m
from dtorch_protocol.layout import Box, coords, shard_box
from dtorch_protocol.placement_types import MOVES, Placement, Replicate, move

MeshKey = tuple[tuple[int, ...], tuple[int, ...]]  # (logical devices row-major, mesh shape)
Binding = tuple[tuple[int, str], ...]  # (logical device, worker id), sorted by device
Workers = tuple[tuple[str, str, bool], ...]  # (worker id, device kind, can join collectives), sorted by id

COST_FACTOR = 2.0  # collectives win unless they make the busiest worker receive more than this x the pieces' bytes
ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4,
    "float32": 4, "complex32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


# ---------------------------------------------------------------------------- geometry (binding-free)


@dataclass(frozen=True)
class GroupGeom:
    """One mesh group of a step: its devices' flat mesh indices by position and the lengths the worker needs."""

    members: tuple[int, ...]  # flat (row-major) mesh indices, by position
    sizes: tuple[int, ...]  # per position: length along `dim` (all_gather: of its input; others: of its output)
    src_sizes: tuple[int, ...]  # all_to_all: per position, length of its input along `src_dim`
    other: int  # elements per unit of length: the product of the box's other extents (all_to_all: but src_dim)
    total: int  # all_reduce: elements of the (common) box


@dataclass(frozen=True)
class Step:
    kind: str
    mesh_dims: tuple[int, ...]
    dim: int  # tensor dim: gathered (all_gather), scattered to (reduce_scatter, all_to_all, slice); -1 all_reduce
    src_dim: int  # all_to_all: the tensor dim sharded before; else -1
    reduce: str  # the Partial's op (all_reduce, reduce_scatter)
    groups: tuple[GroupGeom, ...]


@dataclass(frozen=True)
class _Move:
    kind: str
    mesh_dims: tuple[int, ...]
    to: tuple[Placement, ...]  # placements of those mesh dims after the move


def _length(box: Box, d: int) -> int:
    return box[d][1]


def _others(box: Box, skip: tuple[int, ...]) -> int:
    return math.prod(length for d, (_, length) in enumerate(box) if d not in skip)


def _same_except(a: Box, b: Box, skip: tuple[int, ...]) -> bool:
    return all(x == y for d, (x, y) in enumerate(zip(a, b)) if d not in skip)


def _tiles(parts: list[tuple[int, int]], whole: tuple[int, int]) -> bool:
    """`parts` ([start, length] in position order) are consecutive and cover `whole` exactly."""
    pos = whole[0]
    for start, length in parts:
        if start != pos and length:
            return False
        pos = start + length if length else pos
    return pos == whole[0] + whole[1]


def _contract(kind: str, dim: int, src_dim: int, ins: list[Box], outs: list[Box]) -> GroupGeom | None:
    """The group's lengths when its boxes satisfy `kind`'s contract (CONTRACTS), else None."""
    if kind == "all_gather":
        out = outs[0]
        if any(o != out for o in outs) or not all(_same_except(i, out, (dim,)) for i in ins) \
                or not _tiles([i[dim] for i in ins], out[dim]):
            return None
        return GroupGeom((), tuple(_length(i, dim) for i in ins), (), _others(out, (dim,)), 0)
    if kind in ("slice", "reduce_scatter"):
        src = ins[0]
        if any(i != src for i in ins) or not all(_same_except(o, src, (dim,)) for o in outs) \
                or not _tiles([o[dim] for o in outs], src[dim]):
            return None
        return GroupGeom((), tuple(_length(o, dim) for o in outs), (), _others(src, (dim,)), 0)
    if kind == "all_to_all":
        whole_j = ins[0][dim]
        whole_i = (ins[0][src_dim][0], sum(_length(i, src_dim) for i in ins))
        if any(i[dim] != whole_j for i in ins) or any(o[src_dim] != whole_i for o in outs) \
                or not _tiles([i[src_dim] for i in ins], whole_i) or not _tiles([o[dim] for o in outs], whole_j) \
                or not all(_same_except(b, ins[0], (dim, src_dim)) for b in ins + outs):
            return None
        return GroupGeom((), tuple(_length(o, dim) for o in outs), tuple(_length(i, src_dim) for i in ins),
                         _others(ins[0], (dim, src_dim)), 0)
    if kind == "all_reduce":
        if any(b != ins[0] for b in ins + outs):
            return None
        return GroupGeom((), (), (), 0, _others(ins[0], ()))
    raise ValueError(f"unknown step kind {kind!r}")


CONTRACTS = {  # what `_contract` checks, per kind (positions p in mesh order; I input boxes, O output boxes)
    "all_gather": "O all equal; I_p equal O except on dim; the I_p tile O along dim in order",
    "slice": "I all equal; O_p equal I except on dim; the O_p tile I along dim in order",
    "reduce_scatter": "as slice (the inputs are partial values of the same box)",
    "all_to_all": "I_p tile along src_dim and span dim; O_p tile along dim and span src_dim; other dims equal",
    "all_reduce": "every I_p and O_p is the same box",
}


def _mesh_groups(mesh_shape: tuple[int, ...], dims: tuple[int, ...]) -> list[list[int]]:
    """Flat indices of the devices that differ only in `dims`, one list per group, positions row-major."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for flat, c in enumerate(coords(mesh_shape)):
        groups.setdefault(tuple(x for k, x in enumerate(c) if k not in dims), []).append(flat)
    return list(groups.values())


def _apply(shape: tuple[int, ...], mesh_shape: tuple[int, ...], state: tuple[Placement, ...], mv: _Move,
           ) -> tuple[Step, tuple[Placement, ...], int] | None:
    """The step `mv` makes from `state` (with the new state and its estimated bytes), or None when invalid."""
    after = list(state)
    for k, p in zip(mv.mesh_dims, mv.to):
        after[k] = p
    new = tuple(after)
    k0 = mv.mesh_dims[0]
    gathered = state[k0] if mv.kind == "all_gather" else mv.to[0]  # all_gather: the dim it unshards
    dim = gathered.dim if gathered.is_shard() else -1  # type: ignore[attr-defined]
    src_dim = state[k0].dim if mv.kind == "all_to_all" else -1  # type: ignore[attr-defined]
    reduce = state[k0].reduce_op if state[k0].is_partial() else "sum"  # type: ignore[attr-defined]
    cs = coords(mesh_shape)
    groups, cost = [], 0
    for members in _mesh_groups(mesh_shape, mv.mesh_dims):
        ins = [shard_box(shape, mesh_shape, state, cs[f]) for f in members]
        outs = [shard_box(shape, mesh_shape, new, cs[f]) for f in members]
        g = _contract(mv.kind, dim, src_dim, ins, outs)
        if g is None:
            return None
        g = GroupGeom(tuple(members), g.sizes, g.src_sizes, g.other, g.total)
        groups.append(g)
        cost = max(cost, *_received(mv.kind, g, [[p] for p in range(len(members))]))
    return Step(mv.kind, mv.mesh_dims, dim, src_dim, reduce, tuple(groups)), new, cost


def _moves(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> list[list[_Move]] | None:
    """The candidate sets of moves (variants of the reduction) from `src` to `dst`, or None when unsupported."""
    reduced = tuple(k for k, p in enumerate(src) if p.is_partial() and dst[k] != p)
    if any(dst[k].is_partial() for k in reduced) or len({src[k].reduce_op for k in reduced}) > 1:  # type: ignore[attr-defined]
        return None
    plain: list[_Move] = []
    for k, (a, b) in enumerate(zip(src, dst)):
        if k in reduced or a == b:
            continue
        kind = move(a, b)
        if kind is None:  # to a Partial: local zeros, the pieces do it without moving anything
            return None
        plain.append(_Move(kind, (k,), (b,)))
    if not reduced:
        return [plain]
    scattered = [k for k in reduced if dst[k].is_shard()]
    all_reduce = _Move("all_reduce", reduced, tuple(Replicate() for _ in reduced))
    variants = [plain + [all_reduce] + [_Move("slice", (k,), (dst[k],)) for k in scattered]]
    if len(reduced) == 1 and scattered:
        variants.insert(0, plain + [_Move("reduce_scatter", reduced, (dst[reduced[0]],))])
    return variants


@lru_cache(maxsize=4096)
def steps_for(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
              dst: tuple[Placement, ...]) -> tuple[Step, ...] | None:
    """The cheapest valid sequence of steps from `src` to `dst` on one mesh, or None (rules 1-3)."""
    if len(src) != len(mesh_shape) or len(dst) != len(mesh_shape) or src == dst:
        return None
    variants = _moves(src, dst)
    if variants is None:
        return None
    best: tuple[int, tuple[Step, ...]] | None = None
    for moves in variants:
        for order in itertools.permutations(moves):
            state, steps, cost = src, [], 0
            for mv in order:
                made = _apply(shape, mesh_shape, state, mv)
                if made is None:
                    break
                step, state, c = made
                steps.append(step)
                cost += c
            else:
                if state == dst and (best is None or cost < best[0]):
                    best = (cost, tuple(steps))
    return best[1] if best is not None else None


# ---------------------------------------------------------------------------- binding: ranks and bytes


@dataclass(frozen=True)
class BoundGroup:
    """A mesh group on workers: ranks are its distinct workers in order of first position (rule 4)."""

    geom: GroupGeom
    devices: tuple[int, ...]  # logical devices by position
    ranks: tuple[str, ...]  # worker ids by rank
    layout: tuple[tuple[int, ...], ...]  # positions hosted by each rank


@dataclass(frozen=True)
class Lowering:
    steps: tuple[tuple[Step, tuple[BoundGroup, ...]], ...]
    received: dict[str, int]  # worker -> bytes it receives over the whole redistribution


def _received(kind: str, g: GroupGeom, layout: list[list[int]] | tuple[tuple[int, ...], ...]) -> list[int]:
    """Elements each rank receives from the other ranks in one step of group `g` (what the workers move), by rank.
    O(positions): a 1,024-rank group is one pass, not one per rank."""
    w = len(layout)
    if w < 2 or kind == "slice":
        return [0] * w
    positions = sum(len(ps) for ps in layout)
    if kind == "all_gather":
        return [(w - 1) * max(len(ps) for ps in layout) * max(g.sizes) * g.other] * w
    if kind == "all_to_all":  # every other position's input rows times this rank's output columns
        every = sum(g.src_sizes)
        return [(every - sum(g.src_sizes[p] for p in ps)) * sum(g.sizes[q] for q in ps) * g.other for ps in layout]
    if kind == "reduce_scatter":
        return [(positions - len(ps)) * sum(g.sizes[q] for q in ps) * g.other for ps in layout]
    if kind == "all_reduce":
        chunk = -(-g.total // w)
        return [(positions - len(ps)) * max(0, min(chunk, g.total - r * chunk)) + (w - 1) * chunk
                for r, ps in enumerate(layout)]
    raise ValueError(f"unknown step kind {kind!r}")


def _bind(g: GroupGeom, devices: tuple[int, ...], worker_of: dict[int, str]) -> BoundGroup:
    ranks: list[str] = []
    layout: dict[str, list[int]] = {}
    for pos, flat in enumerate(g.members):
        w = worker_of[devices[flat]]
        if w not in layout:
            ranks.append(w)
            layout[w] = []
        layout[w].append(pos)
    return BoundGroup(g, tuple(devices[f] for f in g.members), tuple(ranks), tuple(tuple(layout[w]) for w in ranks))


@lru_cache(maxsize=4096)
def lower(shape: tuple[int, ...], dtype: str, mesh: MeshKey, src: tuple[Placement, ...],
          dst: tuple[Placement, ...], binding: Binding, workers: Workers) -> Lowering | None:
    """The collective lowering of a same-mesh redistribution on this binding, or None (rule 5, first part).

    `workers` describes every worker of the binding; the caller compares `received` with the pieces' bytes.
    """
    steps = steps_for(shape, mesh[1], src, dst)
    if steps is None:
        return None
    worker_of = dict(binding)
    info = {w: (kind, ok) for w, kind, ok in workers}
    itemsize = ITEMSIZE.get(dtype, 4)
    received: dict[str, int] = {}
    bound_steps = []
    for step in steps:
        bound = tuple(_bind(g, mesh[0], worker_of) for g in step.groups)
        for b in bound:
            if len(b.ranks) < 2:
                continue
            if not all(info[w][1] for w in b.ranks) or len({info[w][0] for w in b.ranks}) > 1:
                return None  # a rank cannot join collectives, or the group mixes device kinds: pieces
            for w, n in zip(b.ranks, _received(step.kind, b.geom, b.layout)):
                received[w] = received.get(w, 0) + n * itemsize
        bound_steps.append((step, bound))
    return Lowering(tuple(bound_steps), received)


def cheaper(lowering: Lowering, piece_bytes: dict[str, int]) -> bool:
    """Rule 5's cost comparison: the busiest worker's bytes on collectives vs on pieces."""
    coll = max(lowering.received.values(), default=0)
    return coll <= COST_FACTOR * max(piece_bytes.values(), default=0) or coll == 0


# ---------------------------------------------------------------------------- groups and commands (rule 6)


@dataclass
class CommGroup:
    id: str
    generation: int
    ranks: tuple[str, ...]  # worker ids by rank
    key: str  # the group's secret (CmdGroup.key): only its members can name its keys in the rendezvous store
    seq: int = 0  # the last op number handed out


@dataclass
class CommGroups:
    """A session's communication groups (rule 6)."""

    generation: int = 1
    groups: dict[tuple[str, ...], CommGroup] = field(default_factory=dict)
    made: int = 0
    timeout_s: float = 60.0  # bound on each rendezvous and op (Config.collective_timeout_s)
    new_key: Callable[[], str] = field(default=random_session_id, repr=False)  # a fresh group's secret (rule 6)

    def bump(self) -> None:
        """Where the session's devices are bound changed: the next steps use groups of a new generation."""
        if self.groups:
            self.generation += 1
            self.groups.clear()

    def get(self, ranks: tuple[str, ...]) -> tuple[CommGroup, bool]:
        g = self.groups.get(ranks)
        if g is not None:
            return g, False
        self.made += 1
        g = self.groups[ranks] = CommGroup(f"g{self.made}", self.generation, ranks, self.new_key())
        return g, True


@dataclass(frozen=True)
class Member:
    """What the commands need to know about a worker: its address (for messages), its rendezvous store and
    its physical device ("" for CPUs)."""

    address: str
    rendezvous: str
    device_id: str = ""


def commands(lowering: Lowering, groups: CommGroups, members: dict[str, Member], src: int, dst: int, dtype: str,
             shapes: tuple[dict[int, list[int]], dict[int, list[int]]], src_line: str = "", timeout_s: float = 60.0,
             ) -> dict[str, list[m.Cmd]]:
    """Per worker: CmdGroup for each group it joins now, then one CmdCollective with its part of every step.

    `shapes`: the shapes of every logical device's shard of the source and of the destination."""
    cmds: dict[str, list[m.Cmd]] = {}
    parts: dict[str, list[list[m.GroupOp]]] = {}
    for i, (_step, bound) in enumerate(lowering.steps):
        for b in bound:
            gid, gen, seq = "", 0, 0
            if len(b.ranks) > 1:
                cg, new = groups.get(b.ranks)
                if new:
                    names = [f"{w} at {members[w].address}" for w in b.ranks]
                    for r, w in enumerate(b.ranks):
                        cmds.setdefault(w, []).append(m.CmdGroup(
                            group=cg.id, generation=cg.generation, rank=r, members=names,
                            store=members[b.ranks[0]].rendezvous, timeout_s=timeout_s, key=cg.key))
                cg.seq += 1
                gid, gen, seq = cg.id, cg.generation, cg.seq
            # short forms (rule 7): each rank's commands are O(1), not O(ranks), where the group is regular
            plain = all(ps == (r,) for r, ps in enumerate(b.layout))
            layout = [] if plain else [list(ps) for ps in b.layout]
            sizes, src_sizes = _short(b.geom.sizes), _short(b.geom.src_sizes)
            for r, w in enumerate(b.ranks):
                mine = {p: b.devices[p] for p in b.layout[r]}
                steps = parts.setdefault(w, [[] for _ in lowering.steps])
                steps[i].append(m.GroupOp(group=gid, generation=gen, seq=seq, rank=r, layout=layout, devices=mine,
                                          sizes=sizes, src_sizes=src_sizes, ranks=len(b.ranks) if plain else 0))
    for w, ops in parts.items():
        mine = sorted({d for op in ops[0] for d in op.devices.values()})
        cmds.setdefault(w, []).append(m.CmdCollective(
            src=src, dst=dst, dtype=dtype, src_line=src_line, in_shapes={d: shapes[0][d] for d in mine},
            out_shapes={d: shapes[1][d] for d in mine},
            steps=[m.CollectiveStep(kind=step.kind, dim=step.dim, src_dim=step.src_dim, reduce=step.reduce,
                                    ops=ops[i]) for i, (step, _b) in enumerate(lowering.steps)]))
    return cmds


def _short(lengths: tuple[int, ...]) -> list[int]:
    """A list of lengths as GroupOp carries it: one length when every position has it (rule 7)."""
    return [lengths[0]] if lengths and lengths.count(lengths[0]) == len(lengths) else list(lengths)


def route(groups: CommGroups, shape: tuple[int, ...], dtype: str, mesh: MeshKey, src: tuple[Placement, ...],
          dst: tuple[Placement, ...], worker_of: dict[int, str], info: dict[str, tuple[str, bool, Member]],
          tids: tuple[int, int], src_line: str) -> dict[str, list[m.Cmd]] | None:
    """The translator's entry: the commands of the collective path for a same-mesh redistribution, or None when
    the pieces' path is the one to take (rule 5). `info`: worker -> (device type, can join collectives, Member)."""
    binding = tuple(sorted((d, worker_of[d]) for d in mesh[0]))
    used = {w for _d, w in binding}
    shared = {w for w in used if info[w][2].device_id and
              any(v != w and info[v][2].device_id == info[w][2].device_id for v in used)}
    workers = tuple(sorted((w, info[w][0], info[w][1] and w not in shared) for w in used))
    low = lower(shape, dtype, mesh, src, dst, binding, workers)
    if low is None:
        return None
    itemsize = ITEMSIZE.get(dtype, 4)
    if not cheaper(low, {w: n * itemsize for w, n in pulled(shape, mesh, src, mesh, dst, binding).items()}):
        return None
    cs = coords(mesh[1])
    boxes = [{d: [n for _s, n in shard_box(shape, mesh[1], pl, cs[i])] for i, d in enumerate(mesh[0])}
             for pl in (src, dst)]
    return commands(low, groups, {w: info[w][2] for w, _t, _ok in workers}, tids[0], tids[1], dtype,
                    (boxes[0], boxes[1]), src_line, groups.timeout_s)


__all__ = ["MOVES", "COST_FACTOR", "CONTRACTS", "Step", "GroupGeom", "Lowering", "CommGroups", "Member",
           "steps_for", "lower", "cheaper", "commands", "route"]
