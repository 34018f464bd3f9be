"""An in-place op right after a redistribution must not change what the redistribution read.

Each worker runs its own command stream, so the source of a remote piece may reach `x.add_(1)` before
the destination has pulled that piece. Sources hold in-place writes until their announced reads are
served (CmdExpectReads); without that, the copies below would see the mutation.
"""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Replicate, Shard

SHAPE = (2048, 1024)  # 8 MiB of float32: pulls take long enough for the race to show


def full_tensor(seed):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def split(cluster, mesh4):
    """Two 1-d meshes on different workers: (source-only, destination-only) for cross-mesh moves."""
    dtorch.zeros(4, device_mesh=mesh4, placements=[Shard(0)])  # binds mesh4's logical devices to workers
    cluster.sync()
    (mine,) = [s for s in dtorch.status().sessions if s.session == cluster.id]
    by_worker: dict[str, list[int]] = {}
    for d in mesh4.devices:
        by_worker.setdefault(mine.devices[d], []).append(d)
    assert len(by_worker) == 2, by_worker
    a, b = by_worker.values()
    return DeviceMesh("cpu", a), DeviceMesh("cpu", b)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)])
def test_in_place_after_redistribute_on_the_same_mesh(mesh4, placement):
    for i in range(3):
        full = full_tensor(i)
        x = dtorch.distribute_tensor(full, mesh4, [placement])
        y = x.redistribute(placements=[Replicate()])
        x.add_(1)
        assert torch.equal(y.to_torch(), full), f"round {i}: the copy saw the in-place add"
        assert torch.equal(x.to_torch(), full + 1)


def test_in_place_on_a_source_only_worker_waits_for_the_busy_reader(split):
    src, dst = split
    for i in range(3):
        full = full_tensor(10 + i)
        x = dtorch.distribute_tensor(full, src, [Shard(0)])
        busy = dtorch.randn(512, 512, device_mesh=dst, placements=[Replicate()])
        for _ in range(4):
            busy = busy @ busy / 512  # keeps the destination worker busy before it reaches the pull
        y = x.redistribute(device_mesh=dst, placements=[Replicate()])
        x.add_(1)  # the source worker has nothing else to do: it gets here first
        assert torch.equal(y.to_torch(), full), f"round {i}: the copy saw the in-place add"
        assert torch.equal(x.to_torch(), full + 1)
        del busy


def test_in_place_through_a_view_after_redistribute(split):
    src, dst = split
    full = full_tensor(20)
    x = dtorch.distribute_tensor(full, src, [Shard(0)])  # row shards: view(-1) is a view of x's shards
    busy = dtorch.randn(512, 512, device_mesh=dst, placements=[Replicate()])
    for _ in range(4):
        busy = busy @ busy / 512
    y = x.redistribute(device_mesh=dst, placements=[Shard(1)])
    x.view(-1).mul_(0)  # writes x's storage through another tensor id
    assert torch.equal(y.to_torch(), full)
    assert torch.equal(x.to_torch(), torch.zeros_like(full))
