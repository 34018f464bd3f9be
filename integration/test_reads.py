"""Reads (`_dataplane.read`): values equal torch's, each a tensor of its own, and a read starts no thread (a thread's
start waits until it holds the GIL: on a busy client, up to a switch interval per read): a replicated value is
pulled on the calling thread, Pull replies are read by the asking thread, one watcher thread looks after every
transfer."""

from __future__ import annotations

import threading

import torch

import dtorch
from dtorch import Partial, Replicate, Shard


def test_a_read_starts_no_thread_and_returns_a_tensor_of_its_own(cluster, mesh1, monkeypatch):
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    layouts = ([Replicate()], [Shard(0)], [Shard(1)], [Partial()])
    tensors = [dtorch.distribute_tensor(full, mesh1, p) for p in layouts]
    for x in tensors:
        (x * 2).to_torch()  # warm: placed, plans cached, the I/O pool's threads started
    started: list[str] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), start(self))[1])
    got = [(x * 2).to_torch() for x in tensors]
    # the I/O pool may add a thread of its own when reads overlap (several shards); nothing else may start one
    assert [name for name in started if not name.startswith("dtorch-io")] == []
    for layout, value in zip(layouts, got):
        assert torch.equal(value, full * 2), layout
    got[0].add_(1)  # the replicated read is the pulled tensor itself: writable, shared with nothing of the session
    assert torch.equal(tensors[0].to_torch(), full)
