"""Fault-tolerance commands: whole-shard copies that keep aliasing (snapshots, restores, moving devices),
CmdAbandon (start a session over, acting on arrival) and CmdRebuilt, fencing of lost peers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from dtorch_protocol import wire
from dtorch_protocol.messages import (
    CmdAbandon,
    CmdCloseSession,
    CmdCreate,
    CmdDelete,
    CmdFence,
    CmdFetchShards,
    CmdKeepCopies,
    CmdRebuilt,
    CmdRun,
    CmdSendShards,
    CmdStay,
    ErrorKind,
    ErrorReport,
    Execute,
    PullRequest,
    ShardsChunk,
)
from dtorch_worker import shards
from dtorch_worker.server import WorkerHandle, start_worker
from dtorch_worker.store import Poison, TensorStore
from dtorch_worker.transfer import put_chunks, receive_chunks

_workers: list[WorkerHandle] = []  # the pair running now: each batch carries peer capabilities for the other


@pytest.fixture
def pair() -> Iterator[tuple[WorkerHandle, WorkerHandle]]:
    a = start_worker(input_timeout_s=30.0)
    b = start_worker(input_timeout_s=30.0)
    _workers[:] = [a, b]
    _next.clear()  # fresh workers start at seq 1 (a port of an earlier test's worker, reused, carried its count on)
    yield a, b
    a.stop(0)
    b.stop(0)


_next: dict[str, int] = {}


def send(w: WorkerHandle, session: str, *cmds: object) -> int:
    """One batch with the worker's next seq, as the controller numbers and signs them."""
    seq = _next[w.address] = _next.get(w.address, 0) + 1
    stub = wire.Stub("dtorch.Worker", w.address, w.execute_token())
    caps = {p.address: p.capability(session, "peer") for p in _workers if p is not w}
    assert stub.call("Execute", Execute(seq=seq, session=session, cmds=list(cmds), caps=caps)).ok  # type: ignore
    stub.close()
    return seq


def wait(w: WorkerHandle, seq: int) -> None:
    assert w.executor.wait_completed(seq, 30.0), f"batch {seq} did not finish on {w.address}"


def ones(tid: int, devices: list[int], shape: list[int] | None = None) -> CmdCreate:
    shape = shape or [4, 3]
    return CmdCreate(tid=tid, dtype="float32", shape=shape, init="arange", arange=[0, 12, 1],
                     boxes={d: [[0, shape[0]], [0, shape[1]]] for d in devices})


def view_of(tid: int, out: int, device: int) -> CmdRun:
    return CmdRun(op="aten.t.default", devices=[device], args=[{"$t": tid}], kwargs={}, outs=[out])


# ---------------------------------------------------------------- pack / unpack


def test_pack_keeps_views_of_one_storage_and_poison():
    base = torch.arange(12.0).reshape(4, 3)
    items = [(1, 0, base), (2, 0, base.t()), (3, 0, base[1:3]), (4, 0, torch.ones(2)),
             (5, 0, Poison(ErrorReport(op="x", src="m.py:1", message="boom"))), (6, 0, torch.empty(0))]
    packed = shards.pack(items)
    assert len(packed.storages) == 3  # base and its two views share one storage
    copies = {tid: t for tid, _d, t in shards.clone(items, "cpu")}
    assert torch.equal(copies[2], base.t()) and torch.equal(copies[3], base[1:3])
    assert copies[2].untyped_storage().data_ptr() == copies[1].untyped_storage().data_ptr()
    assert copies[1].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    copies[1].add_(1)  # an in-place op on the base shows through the views, as before the copy
    assert torch.equal(copies[2], (base + 1).t())
    assert copies[5] == items[4][2] and copies[6].numel() == 0


def test_stream_round_trip_in_small_pieces():
    base = torch.randn(64, 33, dtype=torch.float64)
    items = [(1, 7, base), (2, 7, base[3:9, 1:]), (3, 8, torch.arange(5, dtype=torch.int16))]
    msgs = [wire.decode(ShardsChunk, wire.encode(c)) for c in shards.chunks(shards.pack(items), chunk_bytes=1000,
                                                                            namespace="ns")]
    assert msgs[0].namespace == "ns" and len(msgs) > 10
    header, got = shards.receive(msgs)
    got_map = {(tid, d): t for tid, d, t in got}
    assert torch.equal(got_map[(1, 7)], base) and torch.equal(got_map[(2, 7)], base[3:9, 1:])
    assert got_map[(2, 7)].untyped_storage().data_ptr() == got_map[(1, 7)].untyped_storage().data_ptr()
    assert torch.equal(got_map[(3, 8)], torch.arange(5, dtype=torch.int16))


# ---------------------------------------------------------------- copies between workers


def test_kept_copies_are_the_earlier_ones_under_the_new_namespace_and_outlive_it(pair):
    """CmdKeepCopies (a snapshot keeping what nothing wrote): no copy, the old namespace's drop leaves them; a copy
    that is not here, or a namespace of another session, fails as a copy (ErrorKind.COPY, never the user's)."""
    a, _b = pair
    s = "sess-keep"
    wait(a, send(a, s, ones(1, [0]), CmdSendShards(devices={0: [1]}, namespace=f"{s}#s1")))
    first = a.store.get((f"{s}#s1", 1, 0))
    wait(a, send(a, s, CmdRun(op="aten.add_.Scalar", devices=[0], args=[{"$t": 1}, 100], kwargs={}, outs=[1]),
                 CmdKeepCopies(devices={0: [1]}, source=f"{s}#s1", namespace=f"{s}#s2")))
    wait(a, send(a, f"{s}#s1", CmdCloseSession()))
    kept = a.store.get((f"{s}#s2", 1, 0))
    assert kept is first and torch.equal(kept, torch.arange(12.0).reshape(4, 3))  # the copy, not the live shard
    assert a.store.peek((f"{s}#s1", 1, 0)) is None and not a.executor.take_errors()
    wait(a, send(a, s, CmdKeepCopies(devices={0: [1]}, source=f"{s}#s1", namespace=f"{s}#s3"),
                 CmdKeepCopies(devices={0: [1]}, source="other#s2", namespace=f"{s}#s3")))
    missing, foreign = a.executor.take_errors()[s]
    assert "tensor 1" in missing.message and "other#s2 is not one of session sess-keep's" in foreign.message
    assert missing.kind == foreign.kind == ErrorKind.COPY and a.store.peek((f"{s}#s3", 1, 0)) is None


def test_the_worker_refuses_to_keep_copies_of_memory_written_or_shared_since_the_copy(pair):
    """CmdKeepCopies.check (snapshots.py rule 6): tensor 2 is a view of 1. Unwritten, both keep their copies;
    written through the view alone, 1 is stale; kept while its view is copied afresh, the two copies would no
    longer alias: stale too. Either way ErrorKind.STALE_COPY and nothing filed."""
    a, _b = pair
    s = "sess-stale"
    copy = CmdSendShards(devices={0: [1, 2]}, namespace=f"{s}#s1")
    wait(a, send(a, s, ones(1, [0]), view_of(1, 2, 0), copy))
    wait(a, send(a, s, CmdKeepCopies(devices={0: [1, 2]}, source=f"{s}#s1", namespace=f"{s}#s2", check=True)))
    assert not a.executor.take_errors() and a.store.peek((f"{s}#s2", 2, 0)) is not None
    wait(a, send(a, s, CmdKeepCopies(devices={0: [1]}, source=f"{s}#s2", namespace=f"{s}#s3", check=True)))
    (shared,) = a.executor.take_errors()[s]
    assert shared.kind == ErrorKind.STALE_COPY and shared.tid == 1  # the kept one, to be copied from now on
    assert "tensor 1 on device 0 shares memory with tensor 2, which is copied afresh" in shared.message
    wait(a, send(a, s, CmdRun(op="aten.add_.Scalar", devices=[0], args=[{"$t": 2}, 1], kwargs={}, outs=[2]),
                 CmdKeepCopies(devices={0: [1]}, source=f"{s}#s2", namespace=f"{s}#s4", check=True),
                 CmdKeepCopies(devices={0: [1]}, source=f"{s}#s2", namespace=f"{s}#s5")))  # the holder's: no check
    (written,) = a.executor.take_errors()[s]
    assert written.kind == ErrorKind.STALE_COPY and written.tid == 1
    assert "tensor 1 on device 0 changed since its copy" in written.message
    assert a.store.peek((f"{s}#s3", 1, 0)) is None and a.store.peek((f"{s}#s4", 1, 0)) is None
    assert a.store.peek((f"{s}#s5", 1, 0)) is not None



def test_backup_to_a_peer_and_restore_keeps_values_and_views(pair):
    a, b = pair
    s = "sess-backup"
    wait(a, send(a, s, ones(1, [0, 1]), view_of(1, 2, 0)))
    # snapshot: a local copy and one on the peer, in a namespace derived from the session
    wait(a, send(a, s, CmdSendShards(devices={0: [1, 2], 1: [1]}, namespace=f"{s}#s1"),
                 CmdSendShards(devices={0: [1, 2], 1: [1]}, namespace=f"{s}#s1", to=b.address, host=True)))
    assert not a.executor.take_errors()
    backup = b.store.get((f"{s}#s1", 2, 0))
    assert torch.equal(backup, torch.arange(12.0).reshape(4, 3).t())
    assert backup.untyped_storage().data_ptr() == b.store.get((f"{s}#s1", 1, 0)).untyped_storage().data_ptr()
    # the session moves on, then is restored to the snapshot on another worker, from the peer's copy
    wait(a, send(a, s, CmdRun(op="aten.add_.Scalar", devices=[0], args=[{"$t": 1}, 100], kwargs={}, outs=[1])))
    assert a.store.get((s, 2, 0))[0, 0] == 100
    wait(b, send(b, s, CmdFetchShards(devices={0: [1, 2]}, namespace=f"{s}#s1", address=a.address)))
    restored = b.store.get((s, 2, 0))
    assert torch.equal(restored, torch.arange(12.0).reshape(4, 3).t())
    wait(b, send(b, s, CmdRun(op="aten.add_.Scalar", devices=[0], args=[{"$t": 1}, 100], kwargs={}, outs=[1])))
    assert torch.equal(b.store.get((s, 2, 0)), a.store.get((s, 2, 0)))  # the view followed its base again
    # a local restore, and closing the session drops its derived namespaces too
    wait(a, send(a, s, CmdFetchShards(devices={1: [1]}, namespace=f"{s}#s1")))
    assert torch.equal(a.store.get((s, 1, 1)), torch.arange(12.0).reshape(4, 3))
    # a replica's copy restores another device (`rename`), from the peer's copy as from a local one
    wait(b, send(b, s, CmdFetchShards(devices={1: [1]}, namespace=f"{s}#s1", address=a.address, rename={1: 3})))
    assert torch.equal(b.store.get((s, 1, 3)), torch.arange(12.0).reshape(4, 3)) and (s, 1, 1) not in b.store
    wait(b, send(b, s, CmdFetchShards(devices={0: [9]}, namespace=f"{s}#s1", address=a.address)))
    (err,) = b.executor.take_errors()[s]
    assert err.op.startswith("restore shards") and "tensor 9" in err.message
    assert err.kind == ErrorKind.OP  # a failed restore poisons the shard: the user sees it
    assert isinstance(b.store.get((s, 9, 0)), Poison)


def test_a_copy_of_an_upload_still_on_its_way_waits_for_it(pair):
    """An upload the client Puts again after a loss may come after its copy's command (recovery.py rule 7): the copy
    waits for it as the upload's readers do (the worker's input wait), and copies the value, not a poisoned shard."""
    a, b = pair
    s = "sess-reput"
    late = threading.Timer(0.3, a.store.put_upload, ((s, 5, 0), torch.arange(6.0)))  # the Put handler's store call
    late.start()
    wait(a, send(a, s, CmdSendShards(devices={0: [5]}, namespace=f"{s}#a1", to=b.address, host=True,
                                     background=True)))
    late.join()
    assert not a.executor.take_errors()
    assert torch.equal(b.store.get((f"{s}#a1", 5, 0)), torch.arange(6.0))


def test_an_upload_put_again_after_it_was_used_and_deleted_here_is_refused_and_holds_nothing(pair):
    """store.py (uploads used and deleted), the controller's recovery.py rule 7: a rebuild asks for an upload going
    out on a device it rebound, and the request can cross the upload's delete here. The second Put is refused, with
    the kind the client's Put again leaves alone (REFUSED), and holds no memory; before, it was stored and held until
    the session closed, read and freed by nothing. A session starting over here (CmdAbandon) may need the upload
    again for its replay: then it is stored. Other sessions' Puts of the same tensor id are theirs."""
    a, _ = pair
    s = "sess-gone"
    client = wire.Stub("dtorch.Worker", a.address, a.capability(s))
    client.send_stream("Put", put_chunks(s, 5, 0, torch.full((2,), 7.0)))
    wait(a, send(a, s, CmdRun(op="aten.add.Tensor", devices=[0], args=[{"$t": 5}, {"$t": 5}], kwargs={}, outs=[6]),
                 CmdDelete(tids=[5], devices=[0])))
    assert torch.equal(a.store.get((s, 6, 0)), torch.full((2,), 14.0)) and (s, 5, 0) not in a.store
    with pytest.raises(wire.RemoteError, match="tensor 5 on logical device 0 was uploaded, used and deleted here") \
            as refused:
        client.send_stream("Put", put_chunks(s, 5, 0, torch.full((2,), 7.0)))
    assert refused.value.kind == ErrorKind.REFUSED
    assert (s, 5, 0) not in a.store and a.store.stats()[s].tensors == 1  # tensor 6 only
    other = wire.Stub("dtorch.Worker", a.address, a.capability("sess-other"))
    other.send_stream("Put", put_chunks("sess-other", 5, 0, torch.ones(2)))
    wait(a, send(a, s, CmdAbandon(tids=[6])))  # a rebuild: its replay adopts tensor 5 again
    client.send_stream("Put", put_chunks(s, 5, 0, torch.full((2,), 7.0)))
    assert torch.equal(a.store.get((s, 5, 0)), torch.full((2,), 7.0))
    assert torch.equal(a.store.get(("sess-other", 5, 0)), torch.ones(2))
    client.close()
    other.close()


def test_moving_a_device_sends_everything_and_redirects_clients(pair):
    a, b = pair
    s = "sess-move"
    wait(a, send(a, s, ones(1, [0, 1])))
    client = wire.Stub("dtorch.Worker", a.address, a.capability(s))
    # an upload the controller does not know about yet (adopted later) travels with its device
    client.send_stream("Put", put_chunks(s, 5, 0, torch.full((2,), 7.0)))
    wait(a, send(a, s, CmdSendShards(devices={0: [1]}, namespace=s, to=b.address, move=[0])))
    assert torch.equal(b.store.get((s, 1, 0)), torch.arange(12.0).reshape(4, 3))
    assert torch.equal(b.store.get((s, 5, 0)), torch.full((2,), 7.0))
    assert (s, 5, 0) not in a.store and (s, 1, 0) in a.store  # the upload moved; known shards wait for readers
    with pytest.raises(wire.RemoteError, match="moved") as refused:
        client.send_stream("Put", put_chunks(s, 6, 0, torch.ones(1)))
    assert refused.value.kind == ErrorKind.MOVED  # typed, across gRPC (the client acts on it, not on the text)
    client.send_stream("Put", put_chunks(s, 6, 1, torch.ones(1)))  # device 1 stays here
    a.store.delete((s, 1, 0))
    (chunk,) = client.stream("Pull", PullRequest(session=s, tid=1, device=0, timeout_s=5))
    assert chunk.kind == ErrorKind.MOVED and chunk.error.startswith("moved:")
    client.close()
    # coming back clears the mark
    wait(b, send(b, s, CmdSendShards(devices={0: [1]}, namespace=s, to=a.address, move=[0])))
    assert not a.store.is_moved(s, 0) and b.store.is_moved(s, 0)
    # a move called off: the device stays
    wait(b, send(b, s, CmdStay(devices=[0])))
    assert not b.store.is_moved(s, 0)


def test_pulling_a_device_over_moves_it_without_waiting_for_the_sources_stream(pair):
    a, b = pair
    s = "sess-pull-move"
    wait(a, send(a, s, ones(1, [0, 1])))
    client = wire.Stub("dtorch.Worker", a.address, a.capability(s))
    client.send_stream("Put", put_chunks(s, 5, 0, torch.full((2,), 7.0)))  # not adopted yet: it goes along
    # a's stream is busy from here on: another session's op waits for an input that is not there yet
    busy = send(a, "other", CmdRun(op="aten.clone.default", devices=[0], args=[{"$t": 9}], kwargs={}, outs=[10]))
    seq = send(b, s, CmdFetchShards(devices={0: [1]}, namespace=s, address=a.address, move=[0]))
    wait(b, seq)  # served by a's server at once, while a's executor still waits for tensor 9
    assert a.executor.completed < busy
    assert torch.equal(b.store.get((s, 1, 0)), torch.arange(12.0).reshape(4, 3))
    assert torch.equal(b.store.get((s, 5, 0)), torch.full((2,), 7.0))
    assert (s, 5, 0) not in a.store and (s, 1, 0) in a.store  # the upload moved; known shards wait for readers
    with pytest.raises(wire.RemoteError, match="moved"):
        client.send_stream("Put", put_chunks(s, 6, 0, torch.ones(1)))
    client.close()
    a.store.put(("other", 9, 0), torch.ones(1))
    wait(a, busy)


# ---------------------------------------------------------------- abandon / rebuilt


def test_abandon_acts_on_arrival_and_skips_earlier_batches(pair):
    a, _b = pair
    a.executor.input_timeout_s = 600.0  # longer than wait()'s bound: only the abandon can end batch 2's wait
    s = "sess-abandon"
    client = wire.Stub("dtorch.Worker", a.address, a.capability(s))
    wait(a, send(a, s, ones(1, [0])))
    # batch 2 waits for an input that never comes; batch 3 would create tensor 3
    stuck = send(a, s, CmdRun(op="aten.neg.default", devices=[0], args=[{"$t": 42}], kwargs={}, outs=[2]))
    send(a, s, ones(3, [0]))
    client.send_stream("Put", put_chunks(s, 50, 0, torch.ones(3)))  # an upload not adopted yet
    assert a.executor.completed == stuck - 1
    reset = send(a, s, CmdAbandon(tids=[1, 2, 3], lost=["127.0.0.1:1"]))
    wait(a, reset)
    assert s not in a.executor.take_errors()  # the cut-short command's failure is not reported
    assert (s, 3, 0) not in a.store and (s, 1, 0) not in a.store
    assert (s, 50, 0) in a.store
    # client reads wait for the rebuild; peers' pulls of the fenced address fail at once
    result: list[object] = []

    def read() -> None:
        result.append(receive_chunks(client.stream("Pull", PullRequest(session=s, tid=1, device=0, timeout_s=10)),
                                     "pull"))

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    assert not result
    done = send(a, s, ones(1, [0]), CmdRebuilt())
    reader.join(10)
    wait(a, done)
    assert torch.equal(result[0], torch.arange(12.0).reshape(4, 3))
    with pytest.raises(ConnectionError, match="fenced"):
        a.executor.peers.stub("127.0.0.1:1")
    client.close()


def test_shards_from_a_fenced_sender_are_refused(pair):
    a, b = pair
    s = "sess-fence"
    wait(a, send(a, s, ones(1, [0])))
    b.executor.peers.fence([a.address])
    wait(a, send(a, s, CmdSendShards(devices={0: [1]}, namespace=f"{s}#s1", to=b.address)))
    (err,) = a.executor.take_errors()[s]
    assert "declared lost" in err.message and err.seq > 0
    assert err.kind == ErrorKind.COPY  # the controller's own copy: it reacts, the user never sees it
    assert (f"{s}#s1", 1, 0) not in b.store


def test_a_fence_ends_a_copy_to_a_peer_that_never_answers_and_the_report_names_that_peer(pair):
    """CmdFence acts on arrival: a snapshot copy to a worker that accepts connections and never answers (a stopped
    one: its kernel still accepts) ends at once, not at the copy's 600 s timeout; its COPY report names the peer
    (ErrorReport.peer), so the controller knows the primary's own copy stands."""
    a, b = pair
    s = "sess-silent"
    silent = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        wait(a, send(a, s, ones(1, [0])))
        seq = _next[a.address] = _next[a.address] + 1
        stub = wire.Stub("dtorch.Worker", a.address, a.execute_token())
        copy = CmdSendShards(devices={0: [1]}, namespace=f"{s}#a0", to=address, host=True)
        assert stub.call("Execute", Execute(seq=seq, session=s, cmds=[copy],
                                            caps={address: b.capability(s, "peer")})).ok
        stub.close()
        time.sleep(0.5)
        assert not a.executor.wait_completed(seq, 0.1)  # waits on the silent peer
        started = time.monotonic()
        wait(a, send(a, "#fence", CmdFence(addresses=[address])))
        assert time.monotonic() - started < 10
        (err,) = a.executor.take_errors()[s]
        assert (err.kind, err.peer, err.seq) == (ErrorKind.COPY, address, seq)
        with pytest.raises(ConnectionError, match="fenced"):
            a.executor.peers.stub(address)
        wait(a, send(a, "#fence", CmdFence(lifted=[address])))  # a worker restarted there: reachable again
        assert a.executor.peers.stub(address) is not None
    finally:
        silent.close()


def test_store_waits_end_when_the_session_is_abandoned():
    store = TensorStore()
    errors: list[str] = []

    def wait_for_it() -> None:
        try:
            store.get(("s", 1, 0), 30.0)
        except KeyError as e:
            errors.append(str(e))

    t = threading.Thread(target=wait_for_it)
    t.start()
    time.sleep(0.1)
    store.abandon("s")
    t.join(5)
    assert errors and "rebuilt" in errors[0]
    assert store.rebuilding("s") and not store.wait_rebuilt("s", 0.01)
    store.rebuilt("s")
    assert store.wait_rebuilt("s", 0.01)


def test_utilization_counts_busy_time(pair):
    a, _b = pair
    before = a.executor.busy_s
    wait(a, send(a, "sess-busy", CmdCreate(tid=1, dtype="float32", shape=[300, 300], init="randn",
                                           boxes={0: [[0, 300], [0, 300]]}),
                 *[CmdRun(op="aten.mm.default", devices=[0], args=[{"$t": 1}, {"$t": 1}], kwargs={}, outs=[2])] * 5))
    assert a.executor.busy_s > before
