"""Redistributions on collectives in the embedded cluster (real processes, gloo groups between them)."""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.nn import parallelize_module


def received(session) -> dict[str, int]:
    time.sleep(0.5)  # the next report carries the counters
    return {w.worker: w.received_bytes for w in session.status().workers}


def test_an_all_reduce_moves_o_of_the_size_per_worker_not_a_copy_per_peer(cluster, mesh4):
    """Four logical devices on two workers: the pieces' path would pull 4x the tensor into each worker, the
    collective a little over 1.5x (half out and back, the other worker's two partials of its half)."""
    n = 1 << 18
    x = dtorch.ones(n, device_mesh=mesh4, placements=[Partial()])
    x._session.sync()
    before = received(cluster)
    y = x.redistribute(placements=[Replicate()])
    assert torch.equal(y.to_torch(), torch.ones(n))
    after = received(cluster)
    for w, b in before.items():
        got = (after[w] - b) / (4 * n)
        assert 1.4 < got < 1.6, (w, got)


def test_dp_gradients_are_reduced_as_soon_as_they_are_accumulated(cluster, mesh1):
    """Before the optimizer runs, the gradients are already Replicate (the all-reduce was issued in backward)
    and equal torch's."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = parallelize_module(copy.deepcopy(ref), mesh1, {})
    x = torch.randn(6, 8)
    model(dtorch.distribute_tensor(x, mesh1, [Shard(0)])).sum().backward()
    ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad.placements == (Replicate(),)
        torch.testing.assert_close(p.grad.to_torch(), r.grad, rtol=1e-5, atol=1e-6)


def test_every_lowered_kind_on_the_2d_mesh_matches_torch(cluster, mesh2d):
    g = torch.Generator().manual_seed(4)
    full = torch.randn(7, 5, generator=g)
    cases = [([Shard(0), Shard(1)], [Replicate(), Replicate()]), ([Replicate(), Shard(1)], [Replicate(), Shard(0)]),
             ([Replicate(), Replicate()], [Shard(1), Shard(0)]), ([Shard(1), Shard(0)], [Shard(0), Replicate()])]
    for src, dst in cases:
        got = dtorch.distribute_tensor(full, mesh2d, src).redistribute(placements=dst)
        assert got.placements == tuple(dst)
        assert torch.equal(got.to_torch(), full), (src, dst)
    partial = dtorch.distribute_tensor(full, mesh2d, [Replicate(), Replicate()]).redistribute(
        placements=[Partial("max"), Partial("max")])
    assert torch.equal(partial.redistribute(placements=[Replicate(), Shard(0)]).to_torch(), full)
