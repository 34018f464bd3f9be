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


REDUCE = {"sum": lambda t: t.sum(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0),
          "avg": lambda t: t.mean(0)}
PARTIALS = [Partial(op) for op in REDUCE]


def partial_from_shares(mesh, op, shares, sharded=False):
    """A Partial(op) DTensor whose share on device i is shares[i]: shares sharded by their first dim on the first
    mesh dim, then reduced over it (torch's rule leaves the reduction pending as Partial(op), each device holding
    its own share); `sharded`: the second mesh dim shards the result's first dim."""
    y = REDUCE[op](dtorch.distribute_tensor(shares, mesh, [Shard(0), Shard(1)] if sharded else [Shard(0)]))
    assert y.placements == ((Partial(op), Shard(0)) if sharded else (Partial(op),))
    return y


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("dst", [Replicate(), Shard(0), Shard(1), *PARTIALS], ids=str)
def test_partial_shares_that_differ_per_device(mesh4, op, dst):
    """Signed per-device shares: sum, avg, max and min of them all differ, so a wrong reduce op shows."""
    shares = torch.randn(4, 5, 3)  # 5 rows over 4 devices: Shard(0) leaves one empty
    want = REDUCE[op](shares)
    x = partial_from_shares(mesh4, op, shares)
    assert_same(x, want, exact=False)
    y = x.redistribute(placements=[dst])
    assert y.placements == (dst,)
    assert_same(y, want, exact=False)
    assert_same(y.redistribute(placements=[Replicate()]), want, exact=False)


@pytest.mark.parametrize("op", sorted(REDUCE))
@pytest.mark.parametrize("dst", [(Replicate(), Replicate()), (Shard(1), Shard(0)), (Replicate(), Shard(1))], ids=str)
def test_partial_shares_on_one_dim_of_a_2d_mesh(mesh2d, op, dst):
    shares = torch.randn(2, 6, 5)  # device (i, j) holds shares[i], rows j of 2
    x = partial_from_shares(mesh2d, op, shares, sharded=True)
    assert_same(x.redistribute(placements=list(dst)), REDUCE[op](shares), exact=False)


@pytest.mark.parametrize("op", sorted(REDUCE))
def test_replicate_to_each_partial_op_and_back(mesh4, op):
    """A value put into Partial(op) means that value: only sum may leave zeros on the other devices."""
    full = torch.randn(4, 6)
    x = dtorch.distribute_tensor(full, mesh4, [Replicate()])
    y = x.redistribute(placements=[Partial(op)])
    assert y.placements == (Partial(op),)
    assert_same(y, full, exact=False)
    assert_same(y.redistribute(placements=[Shard(1)]), full, exact=False)
    assert_same((y * 1).redistribute(placements=[Replicate()]), full, exact=False)


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


def test_a_replicated_upload_streamed_to_several_workers_leaves_the_client_once(cluster, mesh4, mesh2d, monkeypatch):
    """Replicate sent every device the whole tensor: n copies through the client's link (64 GiB for a 1 GiB model on
    64 workers). Streamed to two or more workers, it goes out once, sharded, and the workers gather it."""
    data = cluster._data
    monkeypatch.setattr(data, "_segments", False)  # as to workers on other hosts (DTORCH_SHARED_MEMORY=0)
    sent: list[int] = []
    put = data._put_to
    monkeypatch.setattr(data, "_put_to", lambda address, tid, device, local: sent.append(
        local.numel() * local.element_size()) or put(address, tid, device, local))
    t = torch.randn(1024, 300)  # 1.2 MB
    for mesh, placements in ((mesh4, [Replicate()]), (mesh2d, [Replicate(), Shard(1)])):
        sent.clear()
        x = dtorch.distribute_tensor(t, mesh, placements)
        assert x.placements == tuple(placements)
        assert_same(x, t)
        assert_same(x * 2, t * 2)
        assert sum(sent) == t.numel() * 4  # once (it was 4 and 2 times)
    sent.clear()
    small = torch.randn(16, 16)
    assert_same(dtorch.distribute_tensor(small, mesh4, [Replicate()]), small)
    assert sum(sent) == 4 * small.numel() * 4  # below SHARDED_MIN_BYTES: each device its copy
