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


def test_redistribute_casts_as_torch_forward_dtype_and_backward_dtype(mesh4):
    """torch's `redistribute(forward_dtype=, backward_dtype=)`: the move runs in forward_dtype and gives it, the
    gradient moves back in backward_dtype and ends in the input's dtype (before: a TypeError on the keywords)."""
    full = torch.randn(8, 3, dtype=torch.float64)
    x = dtorch.distribute_tensor(full, mesh4, [Shard(0)]).requires_grad_()
    y = x.redistribute(mesh4, [Replicate()], async_op=True, forward_dtype=torch.bfloat16,
                       backward_dtype=torch.float32)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.full_tensor(), full.bfloat16())
    (y.float() * torch.linspace(0.1, 1.7, 3)).sum().backward()
    assert x.grad.dtype == torch.float64 and x.grad.placements == (Shard(0),)
    ref = full.clone().requires_grad_()
    (ref.bfloat16().float() * torch.linspace(0.1, 1.7, 3)).sum().backward()  # y's gradient is bfloat16, as y
    assert torch.equal(x.grad.full_tensor(), ref.grad)


def test_full_tensor_is_differentiable_as_torchs(mesh2d):
    """torch's `full_tensor()` is differentiable; DTorch's read gave a tensor with no history, so a loss computed from
    it gave the model no gradient: an error when the whole loss was, silently none from that term when it was mixed
    with a DTensor one."""
    full = torch.randn(4, 6)
    ref = full.clone().requires_grad_()
    target = torch.randn(4, 6)
    (torch.nn.functional.mse_loss(ref * 3, target) + (ref * 3).sum()).backward()
    x = dtorch.distribute_tensor(full, mesh2d, [Shard(0), Shard(1)]).requires_grad_()
    y = x * 3
    (torch.nn.functional.mse_loss(y.full_tensor(), target) + y.sum()).backward()
    assert x.grad.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad)
    z = dtorch.distribute_tensor(full, mesh2d, [Shard(0), Replicate()]).requires_grad_()
    (z.to_torch(grad_placements=[Replicate(), Shard(1)]) ** 2).sum().backward()
    assert z.grad.placements == (Replicate(), Shard(1))
    torch.testing.assert_close(z.grad.full_tensor(), 2 * full)
    with pytest.raises(ValueError, match="placements"):
        z.full_tensor(grad_placements=[Replicate()])


def test_from_local_one_tensor_is_every_devices_local_tensor(mesh2d):
    """torch's `DTensor.from_local`, for a program that runs once: the tensor every rank of an SPMD program would
    pass (before: AttributeError)."""
    local = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(dtorch.DTensor.from_local(local, mesh2d).full_tensor(), local)
    x = dtorch.DTensor.from_local(local, mesh2d, [Shard(0), Shard(1)])
    assert x.placements == (Shard(0), Shard(1))
    assert torch.equal(x.full_tensor(), local.repeat(2, 2))
    assert torch.equal(dtorch.DTensor.from_local(local, mesh2d, [Partial(), Replicate()]).full_tensor(), 2 * local)
    assert torch.equal(dtorch.DTensor.from_local(local, mesh2d, [Partial("max"), Replicate()]).full_tensor(), local)
    leaf = local.clone().requires_grad_()
    (dtorch.DTensor.from_local(leaf, mesh2d, [Shard(0), Partial()]) * 3).sum().backward()
    assert torch.equal(leaf.grad, torch.full((2, 3), 12.0))  # it stands for all four devices' tensors: 4 x 3


def test_from_local_one_tensor_per_device(mesh2d):
    """A list is one local tensor per device in the mesh's row-major order: Shard concatenates, Partial reduces in
    mesh order, and each local tensor gets its own gradient."""
    parts = [torch.randn(2, 3, requires_grad=True) for _ in range(4)]
    ref = torch.cat([torch.cat(parts[0:2], 1), torch.cat(parts[2:4], 1)], 0)
    x = dtorch.DTensor.from_local(parts, mesh2d, [Shard(0), Shard(1)], shape=(4, 6), stride=(6, 1))
    assert torch.equal(x.full_tensor(), ref)
    weights = torch.randn(4, 6)
    (x * weights).sum().backward()
    for i, part in enumerate(parts):
        rows, cols = divmod(i, 2)
        assert torch.equal(part.grad, weights[2 * rows:2 * rows + 2, 3 * cols:3 * cols + 3])
    summed = dtorch.DTensor.from_local([p.detach() for p in parts], mesh2d, [Partial(), Shard(0)])
    assert torch.equal(summed.full_tensor(), torch.cat([parts[0] + parts[2], parts[1] + parts[3]]).detach())
    with pytest.raises(ValueError, match="got 3 local tensors for a mesh of 4 devices"):
        dtorch.DTensor.from_local(parts[:3], mesh2d, [Shard(0), Shard(1)])
    with pytest.raises(ValueError, match=r"shape \[4, 6\].*not shape=\[4, 5\]"):
        dtorch.DTensor.from_local(parts, mesh2d, [Shard(0), Shard(1)], shape=(4, 5))
    with pytest.raises(ValueError, match="Replicate.. but not equal"):
        dtorch.DTensor.from_local(parts, mesh2d, [Replicate(), Replicate()], run_check=True)
    with pytest.raises(ValueError, match="local tensors differ"):
        dtorch.DTensor.from_local([*parts[:3], torch.ones(2, 3, dtype=torch.int64)], mesh2d, [Shard(0), Shard(1)])
    with pytest.raises(TypeError, match="plain torch.Tensors"):
        dtorch.DTensor.from_local(x, mesh2d, [Shard(0), Shard(1)])


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
