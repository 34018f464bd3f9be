"""Two real worker servers (in-process gRPC): redistribution pulls pieces from the peer; Put/Pull move big tensors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from dtorch_protocol import wire
from dtorch_protocol.messages import (
    CmdCreate,
    CmdExpectReads,
    CmdReadable,
    CmdRedistribute,
    CmdRun,
    ErrorReport,
    Execute,
    Piece,
    PullRequest,
    ShardPlan,
)
from dtorch_protocol.placement_types import Shard
from dtorch_worker import random_blocks
from dtorch_worker.server import WorkerHandle, start_worker
from dtorch_worker.store import Poison
from dtorch_worker.transfer import put_chunks, receive_chunks

S = "sess-peers"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[WorkerHandle, WorkerHandle]]:
    a = start_worker()
    b = start_worker()
    yield a, b
    a.stop(0)
    b.stop(0)


class Seq:
    """Per-worker batch numbering, as the controller keeps it, and its signature: the execute token, with a peer
    capability for the session on every other worker of the pair."""

    def __init__(self, workers: tuple[WorkerHandle, ...]) -> None:
        self.workers = workers
        self.next: dict[str, int] = {}

    def send(self, w: WorkerHandle, *cmds: object) -> int:
        seq = self.next.get(w.address, w.executor.completed + 1)
        self.next[w.address] = seq + 1
        stub = wire.Stub("dtorch.Worker", w.address, w.execute_token())
        caps = {p.address: p.capability(S, "peer") for p in self.workers if p is not w}
        assert stub.call("Execute", Execute(seq=seq, session=S, cmds=list(cmds), caps=caps)).ok  # type: ignore
        stub.close()
        return seq


def wait(w: WorkerHandle, seq: int) -> None:
    assert w.executor.wait_completed(seq, 30.0), f"batch {seq} did not finish on {w.address}"


def test_all_gather_shard0_to_replicate(pair: tuple[WorkerHandle, WorkerHandle], h: SimpleNamespace) -> None:
    a, b = pair
    seqs = Seq(pair)
    shape = [5, 3]
    boxes = h.boxes_for(shape, [2], [Shard(0)])  # device 0 on a (rows 0-2), device 1 on b (rows 3-4)
    create = {"tid": 1, "dtype": "float32", "shape": shape, "init": "randn", "seed": 42}
    # b's redistribute goes out before a has even created its shard: the Pull waits for it
    plan = {
        "a": ShardPlan(shape=shape, groups=[[Piece("", 0, [0, 0], [0, 0], [3, 3]),
                                             Piece(b.address, 1, [0, 0], [3, 0], [2, 3])]]),
        "b": ShardPlan(shape=shape, groups=[[Piece(a.address, 0, [0, 0], [0, 0], [3, 3]),
                                             Piece("", 1, [0, 0], [3, 0], [2, 3])]]),
    }
    sb = seqs.send(b, CmdCreate(boxes={1: boxes[1]}, **create),  # type: ignore[arg-type]
                   CmdExpectReads(tid=1, reads={1: 1}, dst=2),
                   CmdRedistribute(src=1, dst=2, dtype="float32", plans={1: plan["b"]}))
    time.sleep(0.1)
    sa = seqs.send(a, CmdCreate(boxes={0: boxes[0]}, **create),  # type: ignore[arg-type]
                   CmdExpectReads(tid=1, reads={0: 1}, dst=2),
                   CmdRedistribute(src=1, dst=2, dtype="float32", plans={0: plan["a"]}))
    wait(a, sa)
    wait(b, sb)
    expected = random_blocks.draw("randn", 42, shape, [[0, 5], [0, 3]], torch.float32)
    assert torch.equal(a.store.get((S, 2, 0)), expected)
    assert torch.equal(b.store.get((S, 2, 1)), expected)
    assert a.executor.take_errors() == {} and b.executor.take_errors() == {}


def test_partial_sum_to_replicate_from_uploaded_shards(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, b = pair
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    for w, dev, value in ((a, 0, x), (b, 1, y)):
        stub = wire.Stub("dtorch.Worker", w.address, w.capability(S))
        assert stub.send_stream("Put", put_chunks(S, 10, dev, value)).ok
        stub.close()
    whole = [0, 0], [0, 0], [4, 6]
    seqs = Seq(pair)
    sa = seqs.send(a, CmdExpectReads(tid=10, reads={0: 1}, dst=11),
                   CmdRedistribute(src=10, dst=11, dtype="float64", plans={0: ShardPlan(
        shape=[4, 6], groups=[[Piece("", 0, *whole)], [Piece(b.address, 1, *whole)]], reduce="sum")}))
    sb = seqs.send(b, CmdExpectReads(tid=10, reads={1: 1}, dst=11),
                   CmdRedistribute(src=10, dst=11, dtype="float64", plans={1: ShardPlan(
        shape=[4, 6], groups=[[Piece(a.address, 0, *whole)], [Piece(b.address, 1, *whole)]], reduce="sum")}))
    wait(a, sa)
    wait(b, sb)
    assert torch.equal(a.store.get((S, 11, 0)), x + y)
    assert torch.equal(b.store.get((S, 11, 1)), x + y)


def test_a_poisoned_remote_source_passes_the_original_report_on(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, b = pair
    seqs = Seq(pair)
    sa = seqs.send(a, CmdRun(op="aten.nonexistent.default", devices=[0], args=[], kwargs={}, outs=[20],
                             src="model.py:3"), CmdExpectReads(tid=20, reads={0: 1}, dst=21))
    wait(a, sa)
    (report,) = a.executor.take_errors()[S]
    sb = seqs.send(b, CmdRedistribute(src=20, dst=21, dtype="float32", src_line="model.py:4", plans={
        1: ShardPlan(shape=[2], groups=[[Piece(a.address, 0, [0], [0], [2])]])}))
    wait(b, sb)
    assert b.store.get((S, 21, 1)) == Poison(report)
    assert b.executor.take_errors() == {}  # reported once, by a


def test_pull_of_a_missing_shard_times_out_with_a_clear_error(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, _ = pair
    stub = wire.Stub("dtorch.Worker", a.address, a.capability(S))
    with pytest.raises(RuntimeError, match="no shard for tensor 999 on logical device 0 .* after waiting 0.1s"):
        receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=999, device=0, timeout_s=0.1)), "pull")
    stub.close()


def test_wrong_token_is_refused(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, _ = pair
    stub = wire.Stub("dtorch.Worker", a.address, "wrong")
    with pytest.raises(PermissionError):
        stub.call("Execute", Execute(seq=10**6, session=S, cmds=[]))
    stub.close()


def test_put_and_pull_beyond_the_message_limit(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, _ = pair
    big = torch.randn(5 * 1024, 4 * 1024, generator=torch.Generator().manual_seed(0))  # 80 MiB of float32
    assert big.numel() * 4 > wire.MAX_MESSAGE_BYTES
    stub = wire.Stub("dtorch.Worker", a.address, a.capability(S))
    assert stub.send_stream("Put", put_chunks(S, 30, 0, big)).ok
    assert torch.equal(a.store.get((S, 30, 0)), big)
    back = receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=30, device=0)), "pull")
    assert torch.equal(back, big)
    box = receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=30, device=0, offset=[1000, 7],
                                                          size=[3000, 4000])), "pull")
    assert torch.equal(box, big[1000:4000, 7:4007])
    stub.close()
    a.store.delete((S, 30, 0))


def test_bool_bfloat16_and_empty_shards_round_trip(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, _ = pair
    stub = wire.Stub("dtorch.Worker", a.address, a.capability(S))
    for i, value in enumerate([torch.tensor([True, False, True]), torch.randn(3, 2).bfloat16(),
                               torch.zeros(0, 4), torch.tensor(3.5), torch.arange(6).view(2, 3).t()]):
        assert stub.send_stream("Put", put_chunks(S, 40 + i, 0, value)).ok
        back = receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=40 + i, device=0)), "pull")
        assert back.dtype == value.dtype and torch.equal(back, value)
    stub.close()


def test_a_poisoned_shard_pulls_as_an_error_chunk(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, _ = pair
    report = ErrorReport(op="aten.mm.default", src="m.py:1", message="RuntimeError: shapes", tid=50)
    a.store.put((S, 50, 0), Poison(report))
    stub = wire.Stub("dtorch.Worker", a.address, a.capability(S))
    (chunk,) = list(stub.stream("Pull", PullRequest(session=S, tid=50, device=0)))
    assert chunk.report == report and "aten.mm.default" in chunk.error and "m.py:1" in chunk.error
    stub.close()


# ---------------------------------------------------------------- in-place writes wait for announced reads


def put(w: WorkerHandle, tid: int, device: int, value: torch.Tensor) -> None:
    stub = wire.Stub("dtorch.Worker", w.address, w.capability(S))
    assert stub.send_stream("Put", put_chunks(S, tid, device, value)).ok
    stub.close()


def test_an_in_place_write_waits_for_the_peer_pull_announced_before_it(
        pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    """b is ahead of a: it reaches add_ on x before a reaches the redistribution that pulls x from b."""
    a, b = pair
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    put(b, 60, 1, x.clone())
    seqs = Seq(pair)
    sb = seqs.send(b, CmdExpectReads(tid=60, reads={1: 1}, dst=61),
                   CmdRun(op="aten.add_.Tensor", devices=[1], args=[{"$t": 60}, 1.0], kwargs={}, outs=[60]))
    time.sleep(0.3)  # without the wait, b has long run add_ by now
    assert not b.executor.wait_completed(sb, 0.0), "b wrote x in place before the announced read"
    sa = seqs.send(a, CmdRedistribute(src=60, dst=61, dtype="float32", plans={0: ShardPlan(
        shape=[64, 32], groups=[[Piece(b.address, 1, [0, 0], [0, 0], [64, 32])]])}))
    wait(a, sa)
    wait(b, sb)
    assert torch.equal(a.store.get((S, 61, 0)), x)  # the pre-mutation values
    assert torch.equal(b.store.get((S, 60, 1)), x + 1)
    assert b.store.pending_reads((S, 60, 1)) == 0
    assert a.executor.take_errors() == {} and b.executor.take_errors() == {}


def test_a_pull_waits_until_the_source_reaches_the_redistribution(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    """a is ahead: it pulls x before b ran the in-place write that precedes the redistribution in b's stream."""
    a, b = pair
    x = torch.arange(12.0).view(3, 4)
    put(b, 70, 1, x.clone())
    seqs = Seq(pair)
    sa = seqs.send(a, CmdRedistribute(src=70, dst=71, dtype="float32", plans={0: ShardPlan(
        shape=[2, 4], groups=[[Piece(b.address, 1, [1, 0], [0, 0], [2, 4])]])}))
    time.sleep(0.3)  # without the wait for the announcement, a has long read the unwritten x
    assert not a.executor.wait_completed(sa, 0.0), "a read x before b reached the redistribution"
    sb = seqs.send(b, CmdRun(op="aten.mul_.Tensor", devices=[1], args=[{"$t": 70}, 2.0], kwargs={}, outs=[70]),
                   CmdExpectReads(tid=70, reads={1: 1}, dst=71))
    wait(b, sb)
    wait(a, sa)
    assert torch.equal(a.store.get((S, 71, 0)), x[1:] * 2)  # the value at the redistribution's place in b's stream
    assert b.store.pending_reads((S, 70, 1)) == 0


class WaitSeen(threading.Condition):
    """A store's condition that says when a thread first waits on it (the interleaving is driven by events)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()  # still holding the lock: nobody can change the store before this thread sleeps
        return super().wait(timeout)


def test_a_pull_waiting_for_the_announcement_wakes_when_it_runs() -> None:
    """The peer's pull arrives first and sleeps until the source announces it; then the source's in-place write
    holds for that pull, and the announcement is the only thing that can wake it (no put comes in between).

    Without the wake-up both sit out their timeouts: the 60 s stall of the in-place race test under load.
    """
    src = start_worker()
    try:
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
        put(src, 100, 0, x.clone())
        cond = src.store._cond = WaitSeen()
        pulled: list[torch.Tensor] = []

        def peer() -> None:
            stub = wire.Stub("dtorch.Worker", src.address, src.capability(S, "peer"))
            pulled.append(receive_chunks(stub.stream("Pull", PullRequest(
                session=S, tid=100, device=0, timeout_s=300.0, expected=True, dst=101)), "pull"))
            stub.close()

        reader = threading.Thread(target=peer)
        reader.start()
        assert cond.waiting.wait(30.0), "the pull never waited for the announcement"
        seq = Seq((src,)).send(src, CmdExpectReads(tid=100, reads={0: 1}, dst=101),
                         CmdRun(op="aten.add_.Tensor", devices=[0], args=[{"$t": 100}, 1.0], kwargs={}, outs=[100]))
        reader.join(30.0)
        assert not reader.is_alive(), "the announcement did not wake the waiting pull"
        wait(src, seq)
        assert torch.equal(pulled[0], x)  # read before the in-place add
        assert torch.equal(src.store.get((S, 100, 0)), x + 1)
        assert src.store.pending_reads((S, 100, 0)) == 0
        assert src.executor.take_errors() == {}
    finally:
        src.stop(0)


def test_a_client_read_with_a_mark_is_served_once_the_stream_ran_it() -> None:
    """An early read (`PullRequest.after`, dtorch/session.py) comes before the batch it follows: the shard exists,
    but it is served only once the stream reached the read's mark, so it holds what the batch wrote before it."""
    w = start_worker()
    try:
        put(w, 200, 0, torch.zeros(8))
        cond = w.store._marks = WaitSeen()
        got: list[torch.Tensor] = []

        def client() -> None:
            stub = wire.Stub("dtorch.Worker", w.address, w.capability(S))
            got.append(receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=200, device=0, timeout_s=30.0,
                                                                      after=1)), "early read"))
            stub.close()

        reader = threading.Thread(target=client)
        reader.start()
        assert cond.waiting.wait(30.0), "the read did not wait for its mark"
        add = CmdRun(op="aten.add_.Tensor", devices=[0], args=[{"$t": 200}, 1.0], kwargs={}, outs=[200])
        wait(w, Seq((w,)).send(w, add, CmdReadable(mark=1)))
        reader.join(30.0)
        assert not reader.is_alive(), "the mark did not wake the waiting read"
        assert torch.equal(got[0], torch.ones(8))  # the in-place add before the mark, not the value it found

        stub = wire.Stub("dtorch.Worker", w.address, w.capability(S))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not reach the client's read 2 within 0.2s"):  # bounded
            receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=200, device=0, timeout_s=0.2, after=2)),
                           "early read")
        assert time.monotonic() - t0 < 10.0
        other = wire.Stub("dtorch.Worker", w.address, w.capability("sess-other"))  # marks are per session
        assert other.send_stream("Put", put_chunks("sess-other", 200, 0, torch.zeros(8))).ok
        with pytest.raises(RuntimeError, match="did not reach the client's read 1"):
            receive_chunks(other.stream("Pull", PullRequest(session="sess-other", tid=200, device=0, timeout_s=0.2,
                                                            after=1)), "early read")
        w.store.mark_moved(S, [0])  # the device left: its new worker's stream has the mark, stop waiting here
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not reach the client's read 3"):
            receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=200, device=0, timeout_s=30.0, after=3)),
                           "early read")
        assert time.monotonic() - t0 < 10.0
        stub.close()
        other.close()
    finally:
        w.stop(0)


def test_client_fetches_and_failed_pulls(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    """Only planned pulls count; a planned pull counts as served even when it fails."""
    a, _ = pair
    put(a, 80, 0, torch.ones(3))
    stub = wire.Stub("dtorch.Worker", a.address, a.capability(S))
    receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=80, device=0)), "client fetch")
    assert a.store.pending_reads((S, 80, 0)) == 0
    a.store.expect_reads((S, 81, 0), 1, dst=82)
    with pytest.raises(PermissionError, match="a planned read .* is a peer's"):  # a client cannot pose as one
        list(stub.stream("Pull", PullRequest(session=S, tid=81, device=0, timeout_s=0.05, expected=True, dst=82)))
    assert a.store.pending_reads((S, 81, 0)) == 1
    with pytest.raises(RuntimeError, match="no shard"):
        receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=81, device=0, timeout_s=0.05,
                                                       expected=True, dst=82), credential=a.capability(S, "peer")),
                       "pull")
    assert a.store.pending_reads((S, 81, 0)) == 0
    stub.close()


def test_a_poisoned_local_piece_does_not_cancel_the_announced_remote_pulls(
        pair: tuple[WorkerHandle, WorkerHandle], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    monkeypatch.setattr(b.executor, "reads_timeout_s", 600.0)  # past wait()'s bound: only a's pull lets b write
    report = ErrorReport(op="aten.mm.default", src="m.py:2", message="RuntimeError: shapes", tid=90)
    a.store.put((S, 90, 0), Poison(report))
    put(b, 90, 1, torch.zeros(2))
    seqs = Seq(pair)
    sb = seqs.send(b, CmdExpectReads(tid=90, reads={1: 1}, dst=91),
                   CmdRun(op="aten.add_.Tensor", devices=[1], args=[{"$t": 90}, 1.0], kwargs={}, outs=[90]))
    sa = seqs.send(a, CmdRedistribute(src=90, dst=91, dtype="float32", plans={0: ShardPlan(
        shape=[4], groups=[[Piece("", 0, [0], [0], [2]), Piece(b.address, 1, [0], [2], [2])]])}))
    wait(a, sa)
    wait(b, sb)
    assert "planned reads" not in caplog.text and b.store.pending_reads((S, 90, 1)) == 0  # served, not given up on
    assert a.store.get((S, 91, 0)) == Poison(report)
    assert torch.equal(b.store.get((S, 90, 1)), torch.ones(2))
