"""Dropping the last reference to a DTensor frees its shards on the workers."""

from __future__ import annotations

import gc

import torch

import dtorch
from dtorch import Shard


def live(cluster):
    cluster.sync()
    status = dtorch.status()
    return sum(w.tensors for w in status.workers), sum(w.bytes for w in status.workers)


def test_dropping_dtensors_frees_worker_memory(cluster, mesh4):
    gc.collect()
    base_count, base_bytes = live(cluster)
    xs = [dtorch.zeros(256, 256, device_mesh=mesh4, placements=[Shard(0)]) for _ in range(5)]
    ys = [x + 1 for x in xs]
    count, nbytes = live(cluster)
    assert count - base_count == 10 * 4  # 10 tensors x 4 logical devices
    assert nbytes - base_bytes == 10 * 256 * 256 * 4
    del xs, ys
    gc.collect()
    count, nbytes = live(cluster)
    assert (count, nbytes) == (base_count, base_bytes)


def test_temporaries_of_redistribution_are_freed(cluster, mesh4):
    gc.collect()
    base = live(cluster)
    a = dtorch.distribute_tensor(torch.randn(8, 8), mesh4, [Shard(0)])
    b = dtorch.distribute_tensor(torch.randn(8, 8), mesh4, [Shard(1)])
    c = a @ b  # needs input redistribution into temporaries
    assert torch.allclose(c.to_torch(), a.to_torch() @ b.to_torch(), atol=1e-5)
    del a, b, c
    gc.collect()
    assert live(cluster) == base
