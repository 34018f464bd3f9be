"""Memory caps of packed sessions, enforced by the worker: the Execute's `memory_cap` bounds the bytes the
session's shards hold on this worker; a command or an upload that would go over it fails."""

from __future__ import annotations

import resource

import pytest
import torch

from dtorch_protocol import auth, wire
from dtorch_protocol.messages import CmdCloseSession, CmdCreate, CmdRun, ErrorKind, Execute, PutChunk, ShardStats
from dtorch_protocol.values import tensor_to_bytes
from dtorch_worker.executor import Executor
from dtorch_worker.server import WorkerService
from dtorch_worker.store import Poison, TensorStore, cap_message, format_bytes

S = "capped-session"
CAP = 1000  # bytes


@pytest.fixture
def ex() -> Executor:
    executor = Executor(TensorStore(), input_timeout_s=0.05)
    yield executor
    executor.stop()


def run(ex: Executor, *cmds: object, cap: int = CAP, session: str = S) -> None:
    ex.run_batch(Execute(seq=1, session=session, cmds=list(cmds), memory_cap=cap))  # type: ignore[arg-type]


def zeros(tid: int, n: int, devices: tuple[int, ...] = (0,), src: str = "train.py:7") -> CmdCreate:
    """A float32 vector of n elements, replicated on `devices` (4 * n bytes each)."""
    return CmdCreate(tid=tid, dtype="float32", shape=[n], init="zeros", boxes={d: [[0, n]] for d in devices},
                     src=src)


def t(tid: int) -> dict[str, int]:
    return {"$t": tid}


def test_a_command_over_the_cap_is_poisoned_its_memory_freed_and_later_readers_get_its_error(ex: Executor) -> None:
    run(ex, zeros(1, 100))  # 400 bytes: under the cap
    assert ex.store.session_bytes(S) == 400 and ex.take_errors() == {}
    run(ex, zeros(2, 200, src="train.py:9"))  # 400 + 800 > 1000
    shard = ex.store.get((S, 2, 0))
    assert isinstance(shard, Poison)
    report = shard.report
    assert (report.op, report.src, report.tid) == ("create", "train.py:9", 2)
    assert report.message == ("memory cap exceeded: session holds 1.2 KiB on this worker, over its cap of "
                              "1000 bytes per device")
    assert report.kind == ErrorKind.MEMORY_CAP
    assert ex.store.session_bytes(S) == 400  # the new shard is gone, the old one stays
    assert ex.store.stats()[S] == ShardStats(tensors=2, bytes=400)
    assert isinstance(ex.store.get((S, 1, 0)), torch.Tensor)
    assert ex.take_errors() == {S: [report]}
    # an op reading it fails with the original error, reported once
    run(ex, CmdRun(op="aten.add.Tensor", devices=[0], args=[t(2), t(1)], kwargs={}, outs=[3], src="train.py:11"))
    assert ex.store.get((S, 3, 0)) == Poison(report)
    assert ex.take_errors() == {}


def test_an_op_over_the_cap_is_poisoned_on_every_device_and_an_op_under_it_runs(ex: Executor) -> None:
    run(ex, zeros(1, 50, devices=(0, 1)), CmdCreate(tid=2, dtype="float32", shape=[50], init="arange",
                                                  arange=[0, 50, 1], boxes={0: [[0, 50]], 1: [[0, 50]]}))
    assert ex.store.session_bytes(S) == 800  # two logical devices on this worker, 200 bytes each per tensor
    run(ex, CmdRun(op="aten.add.Tensor", devices=[0, 1], args=[t(2), 1.5], kwargs={}, outs=[3]))  # 1200 bytes
    assert all(isinstance(ex.store.get((S, 3, d)), Poison) for d in (0, 1))  # a tensor is whole or poisoned
    assert ex.store.session_bytes(S) == 800  # its shards were dropped: room for one more
    run(ex, CmdRun(op="aten.add.Tensor", devices=[0], args=[t(2), 1.5], kwargs={}, outs=[4]))
    assert ex.store.session_bytes(S) == 1000  # exactly the cap is fine
    assert torch.equal(ex.store.get((S, 4, 0)), torch.arange(50, dtype=torch.float32) + 1.5)  # type: ignore[arg-type]
    assert [r.op for r in ex.take_errors()[S]] == ["aten.add.Tensor"]


def test_views_count_their_storage_once_and_uncapped_sessions_are_not_limited(ex: Executor) -> None:
    run(ex, zeros(1, 200))  # 800 bytes
    run(ex, CmdRun(op="aten.view.default", devices=[0], args=[t(1), [20, 10]], kwargs={}, outs=[2]))
    assert isinstance(ex.store.get((S, 2, 0)), torch.Tensor)  # a view: no new bytes
    assert ex.store.session_bytes(S) == 800
    run(ex, zeros(1, 2000), cap=0, session="whole-device")  # no cap: whole devices
    run(ex, zeros(1, 2000), cap=0, session=S + "#s1")  # backups are never capped
    assert isinstance(ex.store.get(("whole-device", 1, 0)), torch.Tensor)
    assert isinstance(ex.store.get((S + "#s1", 1, 0)), torch.Tensor)
    assert ex.take_errors() == {}


def test_commands_that_add_no_memory_run_even_over_the_cap(ex: Executor) -> None:
    ex.store.put((S, 1, 0), torch.zeros(300))  # 1200 bytes uploaded before this worker knew the cap
    run(ex, CmdRun(op="aten.add_.Tensor", devices=[0], args=[t(1), 1.0], kwargs={}, outs=[1]))  # in place
    run(ex, CmdRun(op="aten.view.default", devices=[0], args=[t(1), [3, 100]], kwargs={}, outs=[2]))
    assert torch.equal(ex.store.get((S, 2, 0)), torch.ones(3, 100))  # type: ignore[arg-type]
    assert ex.take_errors() == {}
    run(ex, zeros(3, 1))  # but no new bytes
    assert isinstance(ex.store.get((S, 3, 0)), Poison) and "holds 1.2 KiB" in ex.take_errors()[S][0].message


def test_the_latest_execute_sets_the_cap_and_closing_forgets_it(ex: Executor) -> None:
    run(ex, zeros(1, 200))
    run(ex, zeros(2, 200), cap=2000)  # a larger cap: 1600 fits
    assert isinstance(ex.store.get((S, 2, 0)), torch.Tensor) and ex.store.cap(S) == 2000
    run(ex, CmdCloseSession())
    assert ex.store.cap(S) == 0 and ex.store.session_bytes(S) == 0


def put(service: WorkerService, session: str, tid: int, n: int, data: bytes | None = None, cap: int = 0) -> None:
    if data is None:
        data = tensor_to_bytes(torch.zeros(n))
    service.Put(iter([PutChunk(session=session, tid=tid, device=0, dtype="float32", shape=[n], data=data)]),
                auth.Caller(auth.CLIENT, name=session, memory_cap=cap))


def test_uploads_before_the_first_execute_are_held_to_the_cap_the_capability_carries(ex: Executor) -> None:
    """A packed session's client uploads before any of its batches reached this worker: the worker knew no cap, and
    any upload fit (a co-tenant's device could be filled until the session's next Sync)."""
    service = WorkerService(ex.store, ex)
    put(service, S, 1, 200, cap=CAP)  # 800 bytes
    with pytest.raises(wire.LimitExceeded, match="over its cap of 1000 bytes per device"):  # declared: refused at once
        put(service, S, 2, 100, cap=CAP)
    assert ex.store.session_bytes(S) == 800 and ex.store.cap(S) == CAP
    run(ex, zeros(3, 10), cap=2000)  # the Execute's cap holds from then on
    put(service, S, 4, 100, cap=CAP)
    assert ex.store.cap(S) == 2000 and ex.store.session_bytes(S) == 800 + 40 + 400
    put(service, "uncapped", 1, 1000)  # a capability without a cap: none
    assert ex.store.cap("uncapped") == 0


def test_uploads_over_the_cap_are_refused_with_a_one_line_reason(ex: Executor) -> None:
    service = WorkerService(ex.store, ex)
    assert ex.submit(Execute(seq=1, session=S, cmds=[zeros(1, 100)], memory_cap=CAP))  # the cap is known at once
    put(service, S, 5, 100)  # 400 bytes (the create is not run: the executor thread is not started)
    with pytest.raises(wire.Conflict, match="already exists here") as err:
        put(service, S, 5, 150)  # an upload never replaces a live shard
    assert err.value.kind == ErrorKind.REFUSED  # typed: a client's Put again leaves the shard there
    put(service, S, 7, 50)  # 600 bytes
    with pytest.raises(wire.RemoteError) as err:
        put(service, S, 6, 150)
    assert str(err.value) == "memory cap exceeded: session holds 1.2 KiB on this worker, over its cap of " \
                             "1000 bytes per device"
    assert err.value.kind == ErrorKind.MEMORY_CAP
    assert ex.store.peek((S, 6, 0)) is None and ex.store.session_bytes(S) == 600
    assert ex.store.put_upload((S + "#u1", 6, 0), torch.zeros(1000)) is None  # a backup namespace: not capped


def test_a_put_declaring_more_than_it_sends_allocates_only_what_arrives(ex: Executor) -> None:
    """A Put that declares a gigabyte and sends 64 bytes used to make the worker allocate the gigabyte at once."""
    service = WorkerService(ex.store, ex, max_put_bytes=1 << 20)
    with pytest.raises(wire.LimitExceeded, match="declares 4.0 GiB, over this worker's 1.0 MiB"):
        put(service, S, 1, 1 << 30, data=b"x" * 64)
    service.max_put_bytes = 0
    ex.store.set_cap(S, 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(wire.ProtocolError, match="got 64 of 4294967296 bytes"):  # no cap here: the stream is short
        put(service, S, 1, 1 << 30, data=b"x" * 64)
    assert ex.store.peek((S, 1, 0)) is None
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 << 10  # nowhere near the 4 GiB


def test_byte_sizes_read_well() -> None:
    assert format_bytes(512) == "512 bytes" and format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 20) == "3.0 MiB" and format_bytes(5 << 30) == "5.0 GiB"
    assert cap_message(1_258_291, 1 << 20) == ("memory cap exceeded: session holds 1.2 MiB on this worker, over "
                                               "its cap of 1.0 MiB per device")
    assert "holds 1048577 bytes" in cap_message((1 << 20) + 1, 1 << 20)  # rounding would hide the difference


def test_a_create_that_could_never_fit_is_refused_before_allocating(ex: Executor) -> None:
    """Its size is known beforehand: a capped session asking for a terabyte gets the cap's line, not an attempt."""
    run(ex, CmdCreate(tid=9, dtype="float32", shape=[1 << 38], init="zeros", boxes={0: [[0, 1 << 38]]}))
    (report,) = ex.take_errors()[S]
    assert report.message.startswith("memory cap exceeded: session holds 1.0 TiB") and report.op == "create"
    assert isinstance(ex.store.get((S, 9, 0)), Poison)
