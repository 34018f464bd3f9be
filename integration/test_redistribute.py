"""Every pair of Shard(i) / Replicate / Partial, on 1-D and 2-D meshes, uneven shards included, against torch."""

from __future__ import annotations

import itertools

import pytest
import torch

import dtorch
from _helpers import assert_same
from dtorch import Partial, Replicate, Shard

PLACEMENTS_1D = [Shard(0), Shard(1), Replicate(), Partial("sum")]


@pytest.mark.parametrize("src,dst", list(itertools.product(PLACEMENTS_1D, PLACEMENTS_1D)))
@pytest.mark.parametrize("shape", [(5, 3), (8, 6)])  # 5 rows over 4 devices leaves one shard empty
def test_1d_pairs(mesh4, src, dst, shape):
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    x = dtorch.distribute_tensor(full, mesh4, [src])
    y = x.redistribute(placements=[dst])
    assert y.placements == (dst,)
    assert_same(y, full)


PLACEMENTS_2D = [Shard(0), Shard(1), Replicate(), Partial("sum")]


@pytest.mark.parametrize("src", [(a, b) for a in PLACEMENTS_2D for b in PLACEMENTS_2D][::3])
@pytest.mark.parametrize("dst", [(Replicate(), Replicate()), (Shard(1), Shard(0)), (Shard(0), Shard(0)),
                                 (Partial(), Shard(1)), (Replicate(), Partial())])
def test_2d_pairs(mesh2d, src, dst):
    full = torch.randn(7, 5)
    x = dtorch.distribute_tensor(full, mesh2d, list(src))
    y = x.redistribute(placements=list(dst))
    assert y.placements == dst
    got = y.to_torch()
    if any(isinstance(p, Partial) for p in src + dst):
        torch.testing.assert_close(got, full)  # partial sums reassociate
    else:
        assert torch.equal(got, full)


@pytest.mark.parametrize("op", ["max", "min", "avg"])
def test_partial_reduce_ops(mesh4, op):
    full = torch.randn(4, 6)
    x = dtorch.distribute_tensor(full, mesh4, [Partial(op)])
    assert_same(x.redistribute(placements=[Replicate()]), full, exact=False)
    assert_same(x.redistribute(placements=[Shard(1)]), full, exact=False)


def test_cross_mesh_move(mesh1, mesh4):
    full = torch.randn(6, 4)
    x = dtorch.distribute_tensor(full, mesh4, [Shard(0)])
    y = x.redistribute(device_mesh=mesh1, placements=[Shard(1)])
    assert y.device_mesh == mesh1
    assert_same(y, full)


def test_redistribute_is_differentiable(mesh4):
    full = torch.randn(8, 3, requires_grad=True)
    x = dtorch.distribute_tensor(full.detach(), mesh4, [Shard(0)]).requires_grad_()
    y = x.redistribute(placements=[Replicate()])
    (y * 2).sum().backward()
    assert_same(x.grad, torch.full((8, 3), 2.0))
