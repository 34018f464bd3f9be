"""Reads (`_dataplane.read`): values equal torch's, each a tensor of its own, and a read starts no thread (a thread's
start waits until it holds the GIL: on a busy client, up to a switch interval per read): a replicated value is
pulled on the session's one early-read thread (session.py), Pull replies are read by the asking thread, one
watcher thread looks after every transfer."""

from __future__ import annotations

import os
import threading

import torch

import dtorch
from dtorch import Partial, Replicate, Shard, _dataplane
from dtorch_protocol import segments


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


def test_reads_go_out_with_their_sync_and_see_every_write_before_them(cluster, mesh1, mesh4):
    """Early reads (session.py): the pulls leave with the Sync, not after its answer, and each worker serves them
    only once its stream ran the read's mark, so an in-place write just before the read is in the value (the
    shards exist all along: served on arrival, they would hold the value before it)."""
    session = dtorch.runtime.get_session()
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    for mesh in (mesh1, mesh4):
        for layout in ([Replicate()], [Shard(0)], [Shard(1)], [Partial()]):
            x = dtorch.distribute_tensor(full, mesh, layout)
            for i in range(1, 3):
                x.mul_(2)
                early = session.reads["early"]
                assert torch.equal(x.to_torch(), full * 2 ** i), (mesh, layout)
                assert session.reads["early"] == early + 1, (mesh, layout)


def test_an_early_read_that_misses_is_read_again_after_the_sync(cluster, mesh1, monkeypatch):
    """A worker whose stream has not reached the read's mark within the read's wait (none here, behind 24 big
    matmuls issued back to back: the reference is computed before, as computing it between them let the workers
    keep up) answers that it did not: the session reads the value again once the Sync is answered."""
    monkeypatch.setattr(_dataplane, "EARLY_WAIT_S", 0.0)
    session = dtorch.runtime.get_session()
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)) / 23
    want = a
    for _ in range(24):
        want = want @ a
    y = da = dtorch.distribute_tensor(a, mesh1, [Replicate()])
    for _ in range(24):
        y = y @ da
    reads = dict(session.reads)
    assert torch.allclose(y.to_torch(), want, rtol=1e-4, atol=1e-6)
    assert session.reads == {"early": reads["early"], "after_sync": reads["after_sync"] + 1}


def _spy(monkeypatch, name: str, calls: list[str], rename: str = "") -> None:
    real = getattr(segments, name)

    def spy(*args):  # noqa: ANN002, ANN202
        seg = real(*args)
        calls.append(name)
        if seg is not None and rename:
            seg.name = rename
        return seg

    monkeypatch.setattr(segments, name, spy)


def test_big_uploads_and_reads_go_through_same_host_segments_and_leave_no_descriptor(cluster, mesh1, monkeypatch):
    full = torch.randn(1024, 768)  # 3 MiB: a whole shard, a half and a Partial's replicas are over MIN_BYTES
    calls: list[str] = []
    _spy(monkeypatch, "for_put", calls)
    _spy(monkeypatch, "for_pull", calls)
    before = segments.held()  # by inode: an earlier test's transfer may still hold one, and close it meanwhile
    kept = []
    for layout in ([Replicate()], [Shard(0)], [Shard(1)], [Partial()]):
        x = dtorch.distribute_tensor(full, mesh1, layout)
        kept += [x.to_torch(), (x * 2).to_torch()]
        assert torch.equal(kept[-2], full) and torch.equal(kept[-1], full * 2), layout
    assert calls.count("for_put") >= 5 and calls.count("for_pull") >= 8
    assert not segments.held() - before  # closed once each transfer is done; the reads kept hold none either


def test_a_worker_that_cannot_open_the_segments_gets_the_bytes_streamed(cluster, mesh1, monkeypatch):
    """What a worker on another host does (the segment's name means nothing there): refuses the Put's segment, so
    the client streams the bytes, and to that worker from then on; writes a Pull's reply as a stream."""
    plane = dtorch.runtime.get_session()._data
    monkeypatch.setattr(plane, "_elsewhere", set())  # the shared session's own is left as it was
    calls: list[str] = []
    _spy(monkeypatch, "for_put", calls, rename=f"{os.getpid()}/999999")
    _spy(monkeypatch, "for_pull", calls, rename=f"{os.getpid()}/999999")
    full = torch.randn(1024, 1024)
    x = dtorch.distribute_tensor(full, mesh1, [Shard(0)])
    assert torch.equal((x + 1).to_torch(), full + 1)
    assert len(plane._elsewhere) == 2  # both workers: streamed to, from the first refusal on
    y = dtorch.distribute_tensor(full, mesh1, [Shard(1)])
    assert torch.equal(y.to_torch(), full)
    assert calls == ["for_put", "for_put"]  # then no segment is made for them, for reads nor for uploads


def test_a_partial_read_has_the_bits_of_a_redistribution_and_a_large_one_comes_back_once(cluster, mesh4, mesh2d,
                                                                                            monkeypatch):
    """A Partial tensor's values are combined as a redistribution combines them, in mesh order, one addition at a
    time (bfloat16 sums round at every addition, so any other order or a wider accumulator shows): a small one on
    the client from each device's copy, one of SHARDED_MIN_BYTES or more on the workers first, so that one copy
    comes back to the client, not one per device. Both give the bits of `redistribute(Replicate)`."""
    pulled: list[int] = []
    plane = dtorch.runtime.get_session()._data
    pull = plane._pull
    monkeypatch.setattr(plane, "_pull", lambda tid, device, nbytes, after=-1: (pulled.append(nbytes),
                                                                               pull(tid, device, nbytes, after))[1])
    g = torch.Generator().manual_seed(3)
    for rows, cols in ((64, 48), (1024, 512)):  # 6 KiB, 1 MiB
        a, b = torch.randn(rows, 256, generator=g).bfloat16(), torch.randn(256, cols, generator=g).bfloat16()
        want = a[:, :64] @ b[:64]
        for k in range(1, 4):
            want.add_(a[:, k * 64:(k + 1) * 64] @ b[k * 64:(k + 1) * 64])
        for mesh, la, lb in ((mesh4, [Shard(1)], [Shard(0)]), (mesh2d, [Shard(1)] * 2, [Shard(0)] * 2)):
            y = dtorch.distribute_tensor(a, mesh, la) @ dtorch.distribute_tensor(b, mesh, lb)  # a Partial sum
            assert y.placements == (Partial(),) * mesh.ndim
            nbytes = y.numel() * y.element_size()
            pulled.clear()
            got = y.to_torch()
            assert sum(pulled) == (nbytes if nbytes >= _dataplane.SHARDED_MIN_BYTES else 4 * nbytes), (rows, mesh)
            assert torch.equal(got, y.redistribute(mesh, [Replicate()] * mesh.ndim).to_torch()), (rows, mesh)
            assert torch.equal(y.to_torch_async().result(), got)
            assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    x = dtorch.distribute_tensor(torch.tensor([-3, 5, 7]), mesh4, [Partial("avg")])  # integer avg
    assert (x * 3).to_torch().tolist() == (x * 3).redistribute(mesh4, [Replicate()]).to_torch().tolist() == [-9, 15, 21]
    x = dtorch.distribute_tensor(torch.full((1 << 18,), -3), mesh4, [Partial("avg")])  # 2 MiB: on the workers
    assert torch.equal((x * 3).to_torch(), torch.full((1 << 18,), -9))
    assert (dtorch.distribute_tensor(torch.tensor(2.5), mesh4, [Partial()]) * 2).to_torch().item() == 5.0
