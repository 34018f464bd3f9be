"""The user thread streams instructions without waiting for workers; it blocks only at sync points."""

from __future__ import annotations

import os
import signal
import time

import torch

import dtorch
from dtorch import Shard, runtime


def test_ops_return_while_workers_are_frozen(cluster, mesh1):
    workers = runtime._cluster.procs[1:]
    x = dtorch.ones(64, 64, device_mesh=mesh1, placements=[Shard(0)])
    (x + 1).to_torch()  # placed, and the op's plan cached: planning is a one-time cost per signature
    for p in workers:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        y = x
        for _ in range(200):
            y = y + 1
        elapsed = time.monotonic() - t0
        pending = y.to_torch_async()  # a future: returns at once too
        assert not pending.done()
    finally:
        for p in workers:
            os.kill(p.pid, signal.SIGCONT)
    assert elapsed < 0.5, elapsed  # no round trip per op: the workers could not have answered
    assert torch.equal(pending.result(timeout=60), torch.full((64, 64), 201.0))


def test_an_async_fetch_returns_the_value_at_the_call_even_if_written_in_place_after(cluster, mesh1):
    x = dtorch.zeros(8, 4, device_mesh=mesh1, placements=[Shard(0)])
    futures = []
    for _ in range(20):
        futures.append(x.to_torch_async())
        x.add_(1)  # written right after: the fetch must not see it
    assert [f.result(timeout=60)[0, 0].item() for f in futures] == [float(i) for i in range(20)]
    assert torch.equal(x.to_torch(), torch.full((8, 4), 20.0))
