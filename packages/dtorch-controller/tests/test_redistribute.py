"""Redistribution plans, verified by executing them on a fake tensor of ints with plain index arithmetic.

Values are signed and drawn at random per element and per partial share, so that the reduce ops tell
each other apart (a share of zeros is not the identity of max, min or avg, and max differs from min and sum).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dtorch_controller.core.redistribute import PlanError, _tile, parse_placements, plan_redistribute, pulled
from dtorch_protocol.layout import box_shape, coords, shard_box
from dtorch_protocol.messages import Piece, ShardPlan
from dtorch_protocol.placement_types import Partial, Replicate, Shard

R, S0, S1, PSUM, PMAX = Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max")
OPS = {"sum": sum, "max": max, "min": min, "avg": lambda xs: sum(xs) / len(xs)}
PARTIALS = [Partial(op) for op in OPS]


def indices(shape):
    return itertools.product(*(range(n) for n in shape))


def where_for(devices, workers):
    """Logical devices spread round-robin over `workers` workers."""
    return tuple((d, f"w{i % workers}", f"host{i % workers}:1") for i, d in enumerate(sorted(devices)))


def partial_op(placements):
    ops = {p.reduce_op for p in placements if p.is_partial()}
    assert len(ops) <= 1
    return ops.pop() if ops else None


def source_shards(shape, mesh, placements):
    """device -> {local index: value}: partial shares differ per coordinate on Partial dims, replicas agree."""
    shards = {}
    for d, c in zip(mesh[0], coords(mesh[1])):
        box = shard_box(shape, mesh[1], placements, c)
        share = tuple(c[k] for k, p in enumerate(placements) if p.is_partial())
        shards[d] = {tuple(i - s for i, (s, _) in zip(idx, box)): value(idx, share)
                     for idx in itertools.product(*(range(s, s + n) for s, n in box))}
    return shards


def value(idx, share):
    """A signed random integer, fixed per (element, share): shares of one element differ, and so do elements."""
    return random.Random(repr((idx, share))).randint(-1000, 1000)


def global_value(shape, mesh, placements):
    """What the source tensor means: its partial shares reduced."""
    partial_dims = [k for k, p in enumerate(placements) if p.is_partial()]
    op = OPS[partial_op(placements) or "sum"]
    shares = list(itertools.product(*(range(mesh[1][k]) for k in partial_dims)))
    return {idx: op([value(idx, s) for s in shares]) for idx in indices(shape)}


def apply_plan(plan: ShardPlan, d, src_shards, where):
    """Run one ShardPlan as a worker would: copy pieces, check they tile each group once, reduce groups."""
    worker_of = {dev: w for dev, w, _ in where}
    address_of = {dev: a for dev, _, a in where}
    shape = tuple(plan.shape)
    if not plan.groups:
        return {idx: 0 for idx in indices(shape)}
    results = []
    for group in plan.groups:
        out = {}
        for piece in group:
            assert isinstance(piece, Piece)
            expected = "" if worker_of[piece.device] == worker_of[d] else address_of[piece.device]
            assert piece.address == expected
            for off in indices(piece.size):
                dst = tuple(o + p for o, p in zip(off, piece.dst_offset))
                assert dst not in out, "a destination element is written twice"
                out[dst] = src_shards[piece.device][tuple(o + p for o, p in zip(off, piece.src_offset))]
        assert set(out) == set(indices(shape)), "the pieces do not cover the shard"
        results.append(out)
    op = OPS[plan.reduce]
    return {idx: op([r[idx] for r in results]) for idx in indices(shape)}


def check(shape, src_mesh, src_pl, dst_mesh, dst_pl, workers=2):
    """Plan, execute, and check that the destination shards mean the same tensor as the source."""
    shape, src_pl, dst_pl = tuple(shape), tuple(src_pl), tuple(dst_pl)
    where = where_for(set(src_mesh[0]) | set(dst_mesh[0]), workers)
    plans = dict(plan_redistribute(shape, src_mesh, src_pl, dst_mesh, dst_pl, where))
    assert list(plans) == list(dst_mesh[0])
    src = source_shards(shape, src_mesh, src_pl)
    want = global_value(shape, src_mesh, src_pl)
    dst = {d: apply_plan(plans[d], d, src, where) for d in dst_mesh[0]}
    # what the collective cost rule reads instead of the plans: each worker's pulled elements, counted without them
    remote: dict[str, int] = {}
    for d, w, _address in where:
        for piece in (p for g in plans[d].groups for p in g if p.address) if d in plans else ():
            remote[w] = remote.get(w, 0) + math.prod(piece.size)
    assert pulled(shape, src_mesh, src_pl, dst_mesh, dst_pl, tuple((d, w) for d, w, _a in where)) == remote
    # group destination devices that share a box and differ only along Partial dims; their reduction is the value
    partial_dims = [k for k, p in enumerate(dst_pl) if p.is_partial()]
    op = OPS[partial_op(dst_pl) or "sum"]
    groups: dict[tuple, list] = {}
    for d, c in zip(dst_mesh[0], coords(dst_mesh[1])):
        box = shard_box(shape, dst_mesh[1], dst_pl, c)
        assert tuple(plans[d].shape) == box_shape(box)
        rest = tuple(x for k, x in enumerate(c) if k not in partial_dims)
        groups.setdefault(rest, []).append((d, box))
    for members in groups.values():
        box = members[0][1]
        for idx in itertools.product(*(range(s, s + n) for s, n in box)):
            local = tuple(i - s for i, (s, _) in zip(idx, box))
            got = op([dst[d][local] for d, _ in members])
            assert got == pytest.approx(want[idx]), (idx, got, want[idx])
    return plans


MESH4 = ((0, 1, 2, 3), (4,))
MESH2x2 = ((0, 1, 2, 3), (2, 2))


ONE_DIM = [R, S0, S1, *PARTIALS]


@pytest.mark.parametrize("shape", [(8, 3), (3, 2), (5, 4), (0, 2)])
@pytest.mark.parametrize("src,dst", [([a], [b]) for a in ONE_DIM for b in ONE_DIM], ids=str)
def test_one_dim_mesh(shape, src, dst):
    """Every pair, every Partial op as a source and as a destination."""
    check(shape, MESH4, src, MESH4, dst)


def test_the_values_tell_the_reduce_ops_apart():
    """The checker's shares: signed, and every reduce op gives another answer (else a wrong op would pass)."""
    mesh = MESH4
    for idx in indices((3, 2)):
        shares = [value(idx, (c,)) for c in range(4)]
        assert min(shares) < 0 < max(shares) or len(set(shares)) == 4
        assert len({OPS[op](shares) for op in OPS}) == 4, shares
    assert global_value((3, 2), mesh, [PMAX]) != global_value((3, 2), mesh, [Partial("min")])


def test_shard0_to_replicate_reads_its_own_piece_locally():
    plans = check((8,), MESH4, [S0], MESH4, [R])
    assert plans[2] == ShardPlan(shape=[8], groups=[[
        Piece("", 0, [0], [0], [2]), Piece("host1:1", 1, [0], [2], [2]),
        Piece("", 2, [0], [4], [2]), Piece("host1:1", 3, [0], [6], [2])]])


def test_partial_to_replicate_is_one_group_per_share():
    plans = check((4,), MESH4, [PSUM], MESH4, [R])
    assert len(plans[0].groups) == 4 and plans[0].reduce == "sum"


def test_replicate_to_partial_keeps_the_value_on_coordinate_zero_only():
    plans = check((4, 2), MESH4, [R], MESH4, [PSUM])
    assert plans[0].groups == [[Piece("", 0, [0, 0], [0, 0], [4, 2])]]
    assert all(plans[d].groups == [] and plans[d].shape == [4, 2] for d in (1, 2, 3))


def test_partial_to_same_partial_on_the_same_mesh_is_a_local_copy():
    plans = check((4,), MESH4, [PSUM], MESH4, [PSUM])
    assert all(plans[d].groups == [[Piece("", d, [0], [0], [4])]] for d in MESH4[0])


def test_uneven_shards_leave_an_empty_device():
    plans = check((3,), MESH4, [R], MESH4, [S0])
    assert plans[3] == ShardPlan(shape=[0], groups=[])
    check((3,), MESH4, [S0], MESH4, [R])
    check((3,), MESH4, [S0], MESH4, [S0])


ALL = [R, S0, S1, PSUM]


@pytest.mark.parametrize("shape", [(5, 3), (3, 2)])
def test_every_pair_of_layouts_on_a_2x2_mesh(shape):
    for src in itertools.product(ALL, repeat=2):
        for dst in itertools.product(ALL, repeat=2):
            check(shape, MESH2x2, src, MESH2x2, dst, workers=3)


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_pair_with_each_partial_op_on_a_2x2_mesh(op):
    layouts = [R, S0, Partial(op)]
    for src in itertools.product(layouts, repeat=2):
        for dst in itertools.product(layouts, repeat=2):
            check((5, 3), MESH2x2, src, MESH2x2, dst, workers=3)


@pytest.mark.parametrize("op", sorted(OPS))
def test_replicate_to_a_partial_destination_keeps_a_value_its_op_reduces_back(op):
    """Only sum puts zeros off coordinate 0; max, min and avg keep the whole value on every device."""
    plans = check((4, 2), MESH4, [R], MESH4, [Partial(op)])
    holding = [d for d in MESH4[0] if plans[d].groups]
    assert holding == ([0] if op == "sum" else [0, 1, 2, 3])


def test_nested_sharding_of_one_tensor_dim_and_max_partials():
    check((7, 2), MESH2x2, [S0, S0], MESH2x2, [S1, S0])
    check((7, 2), MESH2x2, [PMAX, S0], MESH2x2, [S0, S0])
    check((7, 2), MESH2x2, [PMAX, PMAX], MESH2x2, [R, S1])


@pytest.mark.parametrize("src,dst", [([S0], [R]), ([PSUM], [S0]), ([R], [PSUM]), ([PSUM], [PSUM]), ([S1], [S0])])
def test_across_meshes(src, dst):
    stage0, stage1 = ((0, 1), (2,)), ((2, 3, 4), (3,))
    check((5, 4), stage0, src, stage1, dst, workers=3)
    check((5, 4), ((0, 1, 2, 3), (2, 2)), src * 2, stage1, dst * 1, workers=2)


def test_one_worker_hosting_everything_reads_only_locally():
    plans = check((6, 2), MESH2x2, [S0, PSUM], MESH2x2, [R, S1], workers=1)
    assert all(p.address == "" for plan in plans.values() for g in plan.groups for p in g)


def test_replicas_are_read_from_different_devices():
    plans = dict(plan_redistribute((8,), MESH4, (R,), ((4, 5), (2,)), (S0,), where_for(range(6), 6)))
    assert [plans[d].groups[0][0].device for d in (4, 5)] == [0, 1]


def test_plans_are_cached():
    where = where_for(range(4), 2)
    assert plan_redistribute((4,), MESH4, (S0,), MESH4, (R,), where) is \
        plan_redistribute((4,), MESH4, (S0,), MESH4, (R,), where)


def test_a_device_holding_a_replica_reads_it_itself_else_one_on_its_worker():
    """Replicate -> Shard(0) onto other devices: each reads a replica on its own worker (its index picks which)."""
    where = where_for(range(8), 2)  # even devices on w0, odd ones on w1
    plans = dict(plan_redistribute((8,), MESH4, (R,), ((4, 5, 6, 7), (4,)), (S0,), where))
    sources = {d: [p.device for g in plans[d].groups for p in g] for d in (4, 5, 6, 7)}
    assert sources == {4: [0], 5: [3], 6: [0], 7: [3]}  # w0 holds replicas 0 and 2, w1 holds 1 and 3
    assert all(p.address == "" for plan in plans.values() for g in plan.groups for p in g)
    same = dict(plan_redistribute((8,), MESH4, (R,), MESH4, (S0,), where))
    assert [[p.device for g in same[d].groups for p in g] for d in MESH4[0]] == [[0], [1], [2], [3]]


def test_parse_placements_reads_the_wire_form():
    assert parse_placements(("S1", "R", "Pmax")) == (Shard(1), Replicate(), Partial("max"))


def test_bad_layouts_raise_plan_errors():
    where = where_for(range(4), 2)
    with pytest.raises(PlanError, match=r"Shard\(dim=1\) is out of range for a tensor with 1 dims"):
        plan_redistribute((4,), MESH4, (S1,), MESH4, (R,), where)
    with pytest.raises(PlanError, match="2 placements for a 1-d mesh"):
        plan_redistribute((4,), MESH4, (S0, R), MESH4, (R,), where)
    with pytest.raises(PlanError, match=r"negative size in shape \[4, -1\]"):
        plan_redistribute((4, -1), MESH4, (S0,), MESH4, (R,), where)
    with pytest.raises(PlanError, match=r"logical devices \[2, 3\] are not placed on any worker"):
        plan_redistribute((4,), MESH4, (S0,), MESH4, (R,), where[:2])
    with pytest.raises(PlanError, match=r"logical devices \[5\] are not placed on any worker"):
        plan_redistribute((4,), MESH4, (S0,), ((4, 5), (2,)), (R,), where_for(range(5), 2))  # a destination
    with pytest.raises(PlanError, match=r"cannot reduce different Partial ops \['max', 'sum'\] in one"):
        plan_redistribute((4,), MESH2x2, (PSUM, PMAX), MESH2x2, (R, R), where)
    with pytest.raises(ValueError):
        parse_placements(("X",))


def test_sources_that_do_not_tile_the_target_are_refused():
    """The last guard of _tile: a group missing a shard (inconsistent specs) is an error, not a hole of garbage."""
    members = [(0, (0,)), (1, (1,)), (2, (2,))]  # Shard(0) over 4 devices, device 3 missing
    with pytest.raises(PlanError, match=r"source shards do not tile the target box \(\(0, 8\),\) exactly once"):
        _tile((8,), (4,), (S0,), ((0, 8),), members, 0, 0, dict.fromkeys(range(4), ("w0", "a")))
