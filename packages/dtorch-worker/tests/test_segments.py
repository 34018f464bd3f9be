"""Put and Pull through a client's same-host segment (dtorch_protocol.segments), and whole shards between two
workers of one host (PutShards), on real workers over gRPC: the bytes arrive, are counted, and a tenant (or a
peer) cannot use a segment made for another session to read or write."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import closing

import pytest
import torch

from dtorch_protocol import auth, segments, wire
from dtorch_protocol.messages import (
    ErrorKind,
    ErrorReport,
    PullRequest,
    PutChunk,
    ShardsChunk,
    ShardsRequest,
    ShardView,
)
from dtorch_protocol.values import host_bytes, segment_tensor
from dtorch_worker import shards
from dtorch_worker.server import WorkerHandle, start_worker
from dtorch_worker.store import Poison
from dtorch_worker.transfer import receive_chunks

A, B = "tenant-a", "tenant-b"
VALUE = torch.arange(1 << 19, dtype=torch.float32).reshape(512, 1024)  # 2 MiB
N = VALUE.numel() * 4


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerHandle]:
    w = start_worker()
    yield w
    w.stop(0)


def stub(w: WorkerHandle, session: str) -> wire.Stub:
    return wire.Stub("dtorch.Worker", w.address, w.capability(session))


def put(w: WorkerHandle, session: str, tid: int, segment: str) -> None:
    with closing(stub(w, session)) as s:
        s.send_stream("Put", iter([PutChunk(session=session, tid=tid, device=0, dtype="float32", shape=[512, 1024],
                                            data=b"", segment=segment)]))


def moved(w: WorkerHandle, direction: str) -> float:
    got = w.service.telemetry.registry.get_sample_value(
        "dtorch_worker_moved_bytes_total", {"path": "shared_memory", "direction": direction})
    return got or 0.0


def test_a_put_and_a_pull_through_segments_move_the_bytes(worker):
    held = segments.held()
    seg = segments.for_put(A, 1, 0, [host_bytes(VALUE)])
    put(worker, A, 1, seg.name)
    seg.close()
    assert torch.equal(worker.store.get((A, 1, 0)), VALUE)
    assert not segments.held() - held  # the worker keeps the upload's mapping, not a descriptor (segments.py rule 6)
    assert moved(worker, "in") == N
    reply = segments.for_pull(A, 1, 0, N)
    with closing(stub(worker, A)) as s:
        chunks = list(s.stream("Pull", PullRequest(session=A, tid=1, device=0, segment=reply.name)))
    assert [(c.in_segment, c.data, c.dtype, c.shape) for c in chunks] == [(True, b"", "float32", [512, 1024])]
    got = segment_tensor(reply.fd, N, "float32", [512, 1024], shared=True)
    reply.close()
    assert torch.equal(got, VALUE)
    assert moved(worker, "out") == N


def test_a_tenant_naming_another_tenants_segment_gets_nothing_and_writes_nothing(worker):
    worker.store.put((A, 2, 0), VALUE.clone())
    worker.store.put((B, 2, 0), torch.zeros(512, 1024))
    a_upload = segments.for_put(A, 3, 0, [host_bytes(VALUE)])
    # B uploads from A's segment
    with pytest.raises(PermissionError, match="refused Put: segment .* was not made for tensor 3"):
        put(worker, B, 3, a_upload.name)
    assert (B, 3, 0) not in worker.store
    a_reply = segments.for_pull(A, 2, 0, N)
    with closing(stub(worker, B)) as s:  # B has its tensor 2 written into A's reply segment
        chunks = list(s.stream("Pull", PullRequest(session=B, tid=2, device=0, segment=a_reply.name)))
    assert chunks[0].kind == ErrorKind.REFUSED and "not made for" in chunks[0].error
    assert not any(os.pread(a_reply.fd, N, segments.HEADER))
    a_upload.close(), a_reply.close()


def test_a_segment_the_worker_cannot_reach_means_no_segment_for_a_put_and_a_stream_for_a_pull(worker):
    elsewhere = f"{os.getpid()}/999999"  # what a segment of a client on another host looks like from here
    with pytest.raises(wire.RemoteError) as e:
        put(worker, A, 4, elsewhere)
    assert e.value.kind == ErrorKind.NO_SEGMENT and (A, 4, 0) not in worker.store
    worker.store.put((A, 5, 0), VALUE.clone())
    with closing(stub(worker, A)) as s:
        got = receive_chunks(s.stream("Pull", PullRequest(session=A, tid=5, device=0, segment=elsewhere)), "t")
    assert torch.equal(got, VALUE)


# ---------------------------------------------------------------- whole shards between workers of one host


@pytest.fixture
def pair() -> Iterator[tuple[WorkerHandle, WorkerHandle]]:
    a, b = start_worker(), start_worker()
    yield a, b
    a.stop(0)
    b.stop(0)


def shard_set() -> list:
    base = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)  # 4 MiB
    return [(1, 0, base), (2, 0, base.t()), (3, 1, torch.ones(3)), (4, 1, torch.empty(0)),
            (5, 1, Poison(ErrorReport(op="mm", src="train.py:3", message="boom")))]


def test_whole_shards_to_a_peer_on_this_host_go_through_a_segment_and_keep_their_aliasing(pair, monkeypatch):
    a, b = pair
    opened = []
    real = segments.open_for
    monkeypatch.setattr(segments, "open_for", lambda *args, **kw: opened.append(args[1]) or real(*args, **kw))
    a.executor.peers.grant(A, {b.address: b.capability(A, auth.PEER)})
    a.executor.peers.put_shards(b.address, shards.pack(shard_set()), A, namespace=f"{A}#s1", sender=a.address,
                                host=True)
    assert opened == [f"{A}#s1"]
    got = {k[1]: b.store.get(k) for k in [(f"{A}#s1", t, d) for t, d, _ in shard_set()]}
    assert torch.equal(got[1], shard_set()[0][2]) and torch.equal(got[2], shard_set()[0][2].t())
    assert got[1].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()  # a view stays a view
    got[2].add_(1)  # the receiver's in-place write shows through its view, on pages of its own
    assert got[1][0, 1] == 2.0
    assert torch.equal(got[3], torch.ones(3)) and got[4].numel() == 0 and isinstance(got[5], Poison)
    assert b.service.telemetry.registry.get_sample_value(
        "dtorch_worker_moved_bytes_total", {"path": "copy", "direction": "in"}) == (4 << 20) + 12


def test_a_peer_naming_a_segment_made_for_another_namespace_is_refused(pair):
    a, b = pair
    seg = segments.for_put(f"{B}#s1", -1, -1, [host_bytes(torch.ones(1 << 18))])
    header = ShardsChunk(views=[ShardView(tid=1, device=0, storage=0, dtype="float32", shape=[1 << 18],
                                          stride=[1], offset=0)],
                         storages=[1 << 20], namespace=f"{A}#s1", segment=seg.name)
    with closing(wire.Stub("dtorch.Worker", b.address, b.capability(A, auth.PEER))) as s:
        ack = s.send_stream("PutShards", iter([header]))
    seg.close()
    assert not ack.ok and "not made for" in ack.message
    assert (f"{A}#s1", 1, 0) not in b.store


def _made_elsewhere(monkeypatch: pytest.MonkeyPatch, maker: str) -> None:
    """Segments from `maker` look as they do from another host: unreachable."""
    real = getattr(segments, maker)

    def elsewhere(*args):  # noqa: ANN002, ANN202
        seg = real(*args)
        seg.name = f"{os.getpid()}/999999"
        return seg

    monkeypatch.setattr(segments, maker, elsewhere)


def test_a_peer_that_cannot_open_the_segment_gets_the_shards_streamed_from_then_on(pair, monkeypatch):
    a, b = pair
    _made_elsewhere(monkeypatch, "for_put")
    a.executor.peers.grant(A, {b.address: b.capability(A, auth.PEER)})
    a.executor.peers.put_shards(b.address, shards.pack(shard_set()), A, namespace=f"{A}#s2", sender=a.address)
    assert torch.equal(b.store.get((f"{A}#s2", 2, 0)), shard_set()[0][2].t())
    assert b.address in a.executor.peers._elsewhere


# ---------------------------------------------------------------- whole shards pulled from a peer (PullShards)


def _stock(w: WorkerHandle, namespace: str) -> None:
    for tid, device, value in shard_set():
        w.store.put((namespace, tid, device), value)


def test_whole_shards_pulled_from_a_peer_on_this_host_come_in_the_pullers_segment_and_keep_their_aliasing(pair):
    a, b = pair
    _stock(b, f"{A}#s1")
    a.executor.peers.grant(A, {b.address: b.capability(A, auth.PEER)})
    held = segments.held()
    got = {t: v for t, _d, v in a.executor.peers.pull_shards(
        b.address, ShardsRequest(session=f"{A}#s1", devices={0: [1, 2], 1: [3, 4, 5]}), A)}
    assert b.service.telemetry.registry.get_sample_value(  # no byte went through gRPC: the header alone
        "dtorch_worker_moved_bytes_total", {"path": "copy", "direction": "out"}) == (4 << 20) + 12
    assert torch.equal(got[1], shard_set()[0][2]) and torch.equal(got[2], shard_set()[0][2].t())
    assert got[1].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()  # a view stays a view
    got[2].add_(1)  # the puller writes its copy-on-write mapping: the peer's shard is not touched
    assert got[1][0, 1] == 2.0 and b.store.get((f"{A}#s1", 1, 0))[0, 1] == 1.0
    assert torch.equal(got[3], torch.ones(3)) and got[4].numel() == 0 and isinstance(got[5], Poison)
    assert len(segments.held() - held) == 1  # the call's one mapping (segments.py rule 6), while its shards live
    del got
    assert not segments.held() - held and b.address not in a.executor.peers._elsewhere


def test_a_peer_writes_shards_only_into_an_empty_segment_made_for_the_namespace_pulled(pair):
    """A segment made for another namespace is refused; one that already holds bytes (here a Put's) is not
    written: the shards stream."""
    a, b = pair
    _stock(b, f"{A}#s1")
    foreign, used = segments.for_shards(f"{B}#s1"), segments.for_put(f"{A}#s1", -1, -1, [host_bytes(torch.ones(4))])
    replies = {}
    for seg in (foreign, used):
        with closing(wire.Stub("dtorch.Worker", b.address, b.capability(A, auth.PEER))) as s:
            _call, stream = s.open_stream("PullShards", ShardsRequest(session=f"{A}#s1", devices={0: [1]},
                                                                      segment=seg.name))
            replies[seg.name] = list(stream)
    assert len(replies[foreign.name]) == 1 and "not made for" in replies[foreign.name][0].error
    header, *data = replies[used.name]
    assert not header.segment and sum(len(c.data) for c in data) == 4 << 20
    assert [os.fstat(seg.fd).st_size for seg in (foreign, used)] == [segments.HEADER, segments.HEADER + 16]
    foreign.close()
    used.close()


def test_shards_pulled_from_a_peer_that_cannot_reach_the_segment_stream_and_the_peer_is_elsewhere(pair,
                                                                                               monkeypatch):
    a, b = pair
    _made_elsewhere(monkeypatch, "for_shards")
    _stock(b, f"{A}#s1")
    a.executor.peers.grant(A, {b.address: b.capability(A, auth.PEER)})
    got = {t: v for t, _d, v in a.executor.peers.pull_shards(b.address, ShardsRequest(
        session=f"{A}#s1", devices={0: [1, 2]}), A)}
    assert torch.equal(got[2], shard_set()[0][2].t()) and b.address in a.executor.peers._elsewhere
