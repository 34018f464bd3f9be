"""TensorStore: bounded waits, poison, deletion and per-session stats."""

from __future__ import annotations

import threading

import pytest
import torch

from dtorch_protocol.messages import ErrorKind, ErrorReport, ShardStats
from dtorch_worker.store import GONE_MAX, Poison, ShardMissing, TensorStore

# A put must wake the waiter: its own timeout (LONG) is longer than pytest's (300 s), so a missed wake-up fails the
# test instead of passing late.
LONG = 600.0


def test_get_waits_for_a_shard_put_later() -> None:
    store = TensorStore()
    t = torch.ones(3)
    threading.Timer(0.05, store.put, args=(("s", 1, 0), t)).start()
    assert store.get(("s", 1, 0), timeout=LONG) is t


def test_get_times_out_with_a_readable_error() -> None:
    store = TensorStore()
    with pytest.raises(ShardMissing, match=r"no shard for tensor 7 on logical device 2 .* after waiting 0.1s"):
        store.get(("session", 7, 2), timeout=0.1)
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


def test_stats_walk_copies_again_only_once_they_changed(monkeypatch) -> None:
    """Every report carries `stats`: the namespaces of copies ("s#..."), which nothing writes in place, are walked
    again only after a put or a drop there, while the session's own shards are walked each time (an in-place
    resize of one shows at once)."""
    from dtorch_worker import store as store_module

    store = TensorStore()
    live = torch.zeros(4)
    store.put(("s", 1, 0), live)
    for tid in range(10):
        store.put(("s#s1", tid, 0), torch.zeros(2))
    walked = []
    real = store_module._storage
    monkeypatch.setattr(store_module, "_storage", lambda v: (walked.append(v), real(v))[1])
    assert store.stats() == {"s": ShardStats(tensors=1, bytes=16), "s#s1": ShardStats(tensors=10, bytes=80)}
    assert len(walked) == 11
    walked.clear()
    live.resize_(8)  # in place, no put: the session's own count follows
    assert store.stats() == {"s": ShardStats(tensors=1, bytes=32), "s#s1": ShardStats(tensors=10, bytes=80)}
    assert len(walked) == 1
    store.delete(("s#s1", 0, 0))
    store.put(("s#s1", 20, 0), torch.zeros(4))
    assert store.stats()["s#s1"] == ShardStats(tensors=10, bytes=88)
    assert store.drop_derived("s") == 10 and "s#s1" not in store.stats()
    store.put(("s#s1", 1, 0), torch.zeros(1))  # a namespace made again starts afresh
    assert store.stats()["s#s1"] == ShardStats(tensors=1, bytes=4)


def test_planned_reads_hold_writers_of_the_same_storage_until_served() -> None:
    store = TensorStore()
    x = torch.zeros(4, 2)
    other = torch.zeros(3)
    store.put(("s", 1, 0), x)
    store.put(("s", 2, 0), x.view(-1))  # another tid, same storage
    store.put(("s", 3, 0), other)
    store.expect_reads(("s", 2, 0), 2)
    assert store.pending_reads(("s", 2, 0)) == 2
    assert store.wait_reads([other], 0.0) == []
    assert store.wait_reads([x[1]], 0.0) == [("s", 2, 0)]  # a view of the base: same memory
    store.read_served(("s", 2, 0))
    threading.Timer(0.05, store.read_served, args=(("s", 2, 0),)).start()
    assert store.wait_reads([x], LONG) == []
    assert store.pending_reads(("s", 2, 0)) == 0


def test_reads_served_early_balance_and_deletes_forget_reads() -> None:
    store = TensorStore()
    store.put(("s", 1, 0), torch.ones(2))
    store.read_served(("s", 1, 0))  # the peer was faster than this worker's CmdExpectReads
    store.expect_reads(("s", 1, 0), 1)
    assert store.pending_reads(("s", 1, 0)) == 0 and store.wait_reads([store.get(("s", 1, 0))], 0.0) == []
    store.expect_reads(("s", 1, 0), 1)  # a reader that was lost: the delete drops the count
    assert store.wait_reads([store.get(("s", 1, 0))], 0.01) == [("s", 1, 0)]
    store.delete(("s", 1, 0))
    assert store.pending_reads(("s", 1, 0)) == 0
    store.put(("t", 1, 0), torch.ones(2))
    store.expect_reads(("t", 1, 0), 3)
    store.drop_session("t")
    assert store.pending_reads(("t", 1, 0)) == 0


def test_the_uploads_a_session_deleted_are_remembered_up_to_a_bound_and_forgotten_when_it_closes() -> None:
    """A Put of an upload used and deleted here is refused (store.py); the record keeps each session's last GONE_MAX
    deletes by its program (not ops' outputs, nor a move's or a rebuild's drops), and closing the session forgets
    it."""
    store = TensorStore()
    for tid in range(GONE_MAX + 1):
        assert store.put_upload(("s", tid, 0), torch.ones(1)) is None
        store.delete(("s", tid, 0), by_program=True)
    store.put(("s", -1, 0), torch.ones(1))  # an op's output
    store.delete(("s", -1, 0), by_program=True)
    store.put_upload(("s", -2, 0), torch.ones(1))
    store.delete(("s", -2, 0))  # a move's or a rebuild's drop
    assert store.refused_upload(("s", GONE_MAX, 0)).endswith("was uploaded, used and deleted here: not stored again")
    assert store.put_upload(("s", GONE_MAX, 0), torch.ones(1))[0] == ErrorKind.REFUSED
    assert store.refused_upload(("s", 0, 0)) == ""  # the oldest, past the bound
    assert store.refused_upload(("s", -1, 0)) == "" and store.refused_upload(("s", -2, 0)) == ""
    store.drop_session("s")
    assert store.refused_upload(("s", GONE_MAX, 0)) == ""
