"""TensorStore: bounded waits, poison, deletion and per-session stats."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dtorch.protocol.messages import ErrorReport, ShardStats
from dtorch_worker.store import Poison, ShardMissing, TensorStore


def test_get_waits_for_a_shard_put_later() -> None:
    store = TensorStore()
    t = torch.ones(3)
    threading.Timer(0.05, store.put, args=(("s", 1, 0), t)).start()
    start = time.monotonic()
    assert store.get(("s", 1, 0), timeout=5.0) is t
    assert time.monotonic() - start < 2.0


def test_get_times_out_with_a_readable_error() -> None:
    store = TensorStore()
    start = time.monotonic()
    with pytest.raises(ShardMissing, match=r"no shard for tensor 7 on logical device 2 .* after waiting 0.1s"):
        store.get(("session", 7, 2), timeout=0.1)
    assert 0.09 <= time.monotonic() - start < 2.0
    with pytest.raises(ShardMissing):
        store.get(("session", 7, 2))  # no timeout: no wait


def test_poison_delete_and_drop_session() -> None:
    store = TensorStore()
    report = ErrorReport(op="aten.add.Tensor", src="x.py:1", message="RuntimeError: boom", tid=3)
    store.put(("a", 3, 0), Poison(report))
    store.put(("a", 4, 0), torch.zeros(2))
    store.put(("b", 4, 0), torch.zeros(2))
    assert store.get(("a", 3, 0)) == Poison(report)
    assert store.delete(("a", 4, 0)) and not store.delete(("a", 4, 0))
    assert store.drop_session("a") == 1
    assert store.keys() == [("b", 4, 0)]


def test_stats_count_shared_storage_once() -> None:
    store = TensorStore()
    base = torch.zeros(4, 4)  # 64 bytes
    store.put(("s", 1, 0), base)
    store.put(("s", 2, 0), base.view(16))  # a view: same storage
    store.put(("s", 3, 1), torch.zeros(2, dtype=torch.float64))  # 16 bytes
    store.put(("s", 4, 1), Poison(ErrorReport(op="x", src="", message="m")))
    store.put(("t", 1, 0), torch.zeros(0))
    assert store.stats() == {"s": ShardStats(tensors=4, bytes=80), "t": ShardStats(tensors=1, bytes=0)}
