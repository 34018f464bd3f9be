"""Shard boxes follow torch.chunk, nested mesh dim by mesh dim; gather groups rebuild the tensor."""

from __future__ import annotations

import itertools

import pytest
import torch

from dtorch_protocol.layout import chunk_range, coords, gather_groups, holds_value, intersect, shard_box
from dtorch_protocol.placement_types import Partial, Replicate, Shard, placement_from_wire


@pytest.mark.parametrize("n,parts", [(0, 3), (3, 4), (5, 4), (8, 4), (7, 2), (1, 1)])
def test_chunk_range_matches_torch_chunk(n, parts):
    chunks = torch.arange(n).chunk(parts) if n else ()
    for i in range(parts):
        start, length = chunk_range(0, n, parts, i)
        expected = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(start, start + length)) == expected


def test_nested_sharding_of_one_dim():
    # Shard(0) on both mesh dims of a 2x2 mesh: chunk rows in 2, then each half in 2
    boxes = [shard_box((8, 3), (2, 2), (Shard(0), Shard(0)), c) for c in coords((2, 2))]
    assert [b[0] for b in boxes] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert all(b[1] == (0, 3) for b in boxes)


@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Partial(), Shard(1)),
                                        (Shard(1), Shard(1)), (Partial("max"), Replicate())])
def test_gather_groups_tile_the_tensor_once_per_group(placements):
    shape, mesh = (5, 7), (2, 2)
    groups, op = gather_groups(shape, mesh, placements)
    assert op == next((p.reduce_op for p in placements if p.is_partial()), None)
    assert len(groups) == (2 if any(p.is_partial() for p in placements) else 1)
    for group in groups:
        covered = torch.zeros(shape, dtype=torch.int32)
        for _, box in group:
            covered[tuple(slice(s, s + n) for s, n in box)] += 1
        assert torch.equal(covered, torch.ones(shape, dtype=torch.int32))


def test_partial_sum_holds_value_only_at_coordinate_zero():
    assert holds_value((Partial(),), (0,)) and not holds_value((Partial(),), (1,))
    assert holds_value((Partial("max"),), (1,))
    assert holds_value((Replicate(), Shard(0)), (1, 1))


def test_intersect():
    assert intersect(((0, 4),), ((2, 4),)) == ((2, 2),)
    assert intersect(((0, 2),), ((2, 2),)) is None
    assert intersect(((0, 2), (0, 3)), ((1, 5), (1, 1))) == ((1, 1), (1, 1))


def test_placement_wire_round_trip_and_errors():
    for p in (Shard(0), Shard(3), Replicate(), *(Partial(op) for op in ("sum", "avg", "max", "min"))):
        assert placement_from_wire(p.to_wire()) == p
    for bad in ("X", "S", "Sx", "Pprod", ""):
        with pytest.raises(ValueError, match="bad placement"):
            placement_from_wire(bad)
    with pytest.raises(ValueError, match="reduce_op"):
        Partial("prod")
    with pytest.raises(TypeError):
        Shard("0")  # type: ignore[arg-type]


def test_coords_are_row_major():
    assert coords((2, 3)) == list(itertools.product(range(2), range(3)))
