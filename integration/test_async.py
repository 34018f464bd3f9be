"""The user thread streams instructions without waiting for workers; it blocks only at sync points."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import dtorch
from dtorch import Partial, Shard, runtime


def test_ops_return_while_workers_are_frozen(cluster, mesh1, monkeypatch):
    """No round trip per op: with the workers stopped, 200 ops return, and the user's thread made no call at all
    (the sender thread ships the batches)."""
    workers = runtime.get_session().cluster.procs[1:]
    x = dtorch.ones(64, 64, device_mesh=mesh1, placements=[Shard(0)])
    (x + 1).to_torch()  # placed, and the op's plan cached: planning is a one-time cost per signature
    session = runtime.get_session()
    calls = []
    for name in ("call", "stream", "send_stream"):
        real = getattr(session.stub, name)
        monkeypatch.setattr(session.stub, name, lambda *a, _real=real, _name=name, **k: (
            calls.append((_name, threading.current_thread() is threading.main_thread())), _real(*a, **k))[1])
    for p in workers:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        y = x
        for _ in range(200):
            y = y + 1
        pending = y.to_torch_async()  # a future: returns at once too
        assert not pending.done()
        assert not [name for name, from_user in calls if from_user], calls
    finally:
        for p in workers:
            os.kill(p.pid, signal.SIGCONT)
    assert torch.equal(pending.result(timeout=60), torch.full((64, 64), 201.0))


def test_an_async_fetch_returns_the_value_at_the_call_even_if_written_in_place_after(cluster, mesh1):
    x = dtorch.zeros(8, 4, device_mesh=mesh1, placements=[Shard(0)])
    futures = []
    for _ in range(20):
        futures.append(x.to_torch_async())
        x.add_(1)  # written right after: the fetch must not see it
    assert [f.result(timeout=60)[0, 0].item() for f in futures] == [float(i) for i in range(20)]
    assert torch.equal(x.to_torch(), torch.full((8, 4), 20.0))


@pytest.mark.parametrize("rows", [8, 1 << 17])  # 128 B and 4 MiB: combined on the client, and on the workers first
def test_an_async_fetch_of_a_partial_tensor_returns_the_value_at_the_call(cluster, mesh1, rows):
    x = dtorch.distribute_tensor(torch.ones(rows, 8), mesh1, [Partial()])
    futures = []
    for _ in range(5):
        futures.append(x.to_torch_async())
        x.mul_(2)  # written right after: the fetch must not see it
    assert [f.result(timeout=60)[-1, -1].item() for f in futures] == [float(2 ** i) for i in range(5)]
