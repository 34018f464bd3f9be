"""Plans for ops on DisjointPartial tensors (`_disjoint`, through the planner), the replicated grouped-matmul rule
and the chunk arithmetic of joint sequences (`_joint`): no session, no cluster."""

from __future__ import annotations

import torch

from dtorch._disjoint import DisjointPartial
from dtorch._joint import _chunks, _rows, _segment_at
from dtorch._planner import plan
from dtorch._sharding import NestedShard
from dtorch_protocol.placement_types import Partial, Replicate, Shard

aten = torch.ops.aten
D = DisjointPartial(routing=7, dim=0)


def test_an_elementwise_op_that_keeps_zeros_runs_where_the_rows_are(spec, mesh2):
    x = spec((6, 4), [D], mesh2)
    p = plan(aten.silu.default, (x,), {})
    assert p.inputs == [None] and p.outputs.placements == (D,)
    both = plan(aten.mul.Tensor, (x, spec((6, 4), [D], mesh2)), {})  # silu(gate) * up: same routing
    assert both.inputs == [None, None] and both.outputs.placements == (D,)
    scaled = plan(aten.mul.Tensor, (x, spec((6, 1), [Replicate()], mesh2)), {})  # by the routing weights
    assert scaled.inputs == [None, None] and scaled.outputs.placements == (D,)


def test_an_op_that_makes_zeros_nonzero_reduces_first(spec, mesh2):
    x = spec((6, 4), [D], mesh2)
    p = plan(aten.add.Tensor, (x, spec((6, 4), [Replicate()], mesh2)), {})  # 0 + r is not 0
    assert not isinstance(p.outputs.placements[0], DisjointPartial)
    p = plan(aten.exp.default, (x,), {})  # exp(0) = 1
    assert p.inputs[0].placements == (Replicate(),)


def test_two_routings_never_combine_where_they_are(spec, mesh2):
    other = DisjointPartial(routing=8, dim=0)
    p = plan(aten.mul.Tensor, (spec((6, 4), [D], mesh2), spec((6, 4), [other], mesh2)), {})
    assert not isinstance(p.outputs.placements[0], DisjointPartial)
    assert any(target is not None for target in p.inputs)  # values first: the rows of one are not the other's


def test_views_follow_the_owned_dim_and_reductions_over_it_are_ordinary_partials(spec, mesh2):
    x = spec((6, 4), [D], mesh2)
    assert plan(aten.t.default, (x,), {}).outputs.placements == (DisjointPartial(routing=7, dim=1),)
    halves = plan(aten.split.Tensor, (x, 2, 1), {}).outputs
    assert [h.placements for h in halves] == [(D,), (D,)]
    assert plan(aten.sum.dim_IntList, (x, [1]), {}).outputs.placements == (D,)
    assert plan(aten.sum.dim_IntList, (x, [0]), {}).outputs.placements == (Partial(),)
    rows = plan(aten.slice.Tensor, (x, 0, 1, 3), {})  # some rows only: whose they are is lost
    assert not isinstance(rows.outputs.placements[0], DisjointPartial)


def test_grouped_matmul_without_expert_shards_runs_replicated_on_the_workers(spec, mesh2):
    x, w = spec((12, 16), [Shard(0)], mesh2), spec((4, 16, 32), [Replicate()], mesh2)
    offs = spec((4,), [Replicate()], mesh2, torch.int32)
    p = plan(aten._grouped_mm.default, (x, w, offs), {})
    assert p.route == "sharded" and p.outputs.shape == (12, 32) and p.outputs.placements == (Replicate(),)
    assert p.inputs[0].placements == (Replicate(),)


def test_a_batch_by_sequence_flattening_stays_sharded(spec):
    from dtorch.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("cfg", "sp"))
    x = spec((2, 8, 4), [Shard(0), Shard(1)], mesh)
    flat = plan(aten.view.default, (x, [16, 4]), {})
    assert flat.inputs == [None] and flat.outputs.placements == (Shard(0), NestedShard(0))
    back = plan(aten.view.default, (spec((16, 4), [Shard(0), NestedShard(0)], mesh), [2, 8, 4]), {})
    assert back.inputs == [None] and back.outputs.placements == (Shard(0), Shard(1))


def test_joint_sequence_chunks():
    segments = ((10, "S"), (3, "R"))  # 10 image tokens sharded, 3 text tokens replicated, over 2 devices
    assert _chunks(segments, 2, 0) == [(0, 0, 5), (1, 10, 2)]
    assert _chunks(segments, 2, 1) == [(0, 5, 5), (1, 12, 1)]
    assert sorted(_rows(segments, 2, 0) + _rows(segments, 2, 1)) == list(range(13))  # every row, once
    assert _segment_at(segments, 10, 13) == 1 and _segment_at(segments, 0, 10) == 0
    assert _segment_at(segments, 0, 13) is None
