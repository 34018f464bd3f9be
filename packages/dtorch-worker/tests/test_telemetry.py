"""What a worker measures (telemetry.py): op times by aten op, bytes by path, batches, memory; profile windows;
the metrics port, served for real over HTTP, and a port in use (one line, the worker goes on)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from dtorch_protocol import auth, wire
from dtorch_protocol.messages import (
    CmdCloseSession,
    CmdCreate,
    CmdExpectReads,
    CmdRedistribute,
    CmdRun,
    Execute,
    Piece,
    ProfileRequest,
    PullRequest,
    ShardPlan,
    tensor_slot,
)
from dtorch_worker.server import WorkerHandle, start_worker
from dtorch_worker.transfer import put_chunks, receive_chunks

S = "sess-telemetry"


@pytest.fixture
def pair() -> Iterator[tuple[WorkerHandle, WorkerHandle]]:
    a = start_worker(memory_bytes=1 << 30)
    b = start_worker()
    yield a, b
    a.stop(0)
    b.stop(0)


def value(w: WorkerHandle, name: str, **labels: str) -> float:
    got = w.service.telemetry.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def run(w: WorkerHandle, seq: int, *cmds: object, caps: dict[str, str] | None = None) -> None:
    stub = wire.Stub("dtorch.Worker", w.address, w.execute_token())
    assert stub.call("Execute", Execute(seq=seq, session=S, cmds=list(cmds), caps=caps or {})).ok  # type: ignore
    stub.close()
    assert w.executor.wait_completed(seq, 30.0)


def test_ops_bytes_batches_and_memory_are_counted(pair: tuple[WorkerHandle, WorkerHandle]) -> None:
    a, b = pair
    run(a, 1, CmdCreate(tid=1, dtype="float32", shape=[8, 8], init="ones", boxes={0: [[0, 8], [0, 8]]}),
        CmdRun(op="aten.mm.default", devices=[0], args=[tensor_slot(1), tensor_slot(1)], kwargs={}, outs=[2]),
        CmdRun(op="aten.mm.default", devices=[0], args=[tensor_slot(2), tensor_slot(1)], kwargs={}, outs=[3]),
        CmdExpectReads(tid=3, reads={0: 1}, dst=4))
    assert value(a, "dtorch_worker_op_seconds_count", op="aten.mm.default") == 2
    assert value(a, "dtorch_worker_op_seconds_count", op="create") == 1
    assert value(a, "dtorch_worker_batches_total") == 1 and value(a, "dtorch_worker_busy_seconds_total") > 0
    assert value(a, "dtorch_worker_memory_used_bytes") == 3 * 64 * 4
    assert value(a, "dtorch_worker_memory_capacity_bytes") == 1 << 30
    # b pulls a's 8x8 float32 result (256 bytes): counted in on b (from its plan), out on a (served)
    run(b, 1, CmdRedistribute(src=3, dst=4, dtype="float32", plans={1: ShardPlan(
        shape=[8, 8], groups=[[Piece(a.address, 0, [0, 0], [0, 0], [8, 8])]])}),
        caps={a.address: a.capability(S, auth.PEER)})
    assert torch.equal(b.store.get((S, 4, 1)), torch.full((8, 8), 64.0))
    assert value(b, "dtorch_worker_moved_bytes_total", path="point_to_point", direction="in") == 256
    assert value(a, "dtorch_worker_moved_bytes_total", path="point_to_point", direction="out") == 256
    # a client uploads 4 float64 and reads them back
    stub = wire.Stub("dtorch.Worker", a.address, a.capability(S))
    assert stub.send_stream("Put", put_chunks(S, 9, 0, torch.arange(4.0, dtype=torch.float64))).ok
    got = receive_chunks(stub.stream("Pull", PullRequest(session=S, tid=9, device=0)), "tensor 9")
    stub.close()
    assert torch.equal(got, torch.arange(4.0, dtype=torch.float64))
    assert value(a, "dtorch_worker_moved_bytes_total", path="client", direction="in") == 32
    assert value(a, "dtorch_worker_moved_bytes_total", path="client", direction="out") == 32
    # what the controller bills the session for (usage records): pieces in, client bytes in and out
    assert a.store.stats()[S].moved_bytes == 64 and b.store.stats()[S].moved_bytes == 256


def test_a_profile_window_records_only_its_session_between_start_and_stop(pair) -> None:
    a, _ = pair
    stub = wire.Stub("dtorch.Worker", a.address, a.capability(S))
    ctl = wire.Stub("dtorch.Worker", a.address, a.execute_token())
    run(a, 1, CmdCreate(tid=1, dtype="float32", shape=[4], init="ones", boxes={0: [[0, 4]]}))  # before: not seen
    assert stub.call("Profile", ProfileRequest(session=S, start=True)).message == ""
    run(a, 2, CmdRun(op="aten.add.Tensor", devices=[0], args=[tensor_slot(1), tensor_slot(1)], kwargs={}, outs=[2],
                     src="train.py:7"))
    other = Execute(seq=3, session="someone-else", cmds=[
        CmdCreate(tid=1, dtype="float32", shape=[4], init="zeros", boxes={0: [[0, 4]]})])
    assert ctl.call("Execute", other).ok and a.executor.wait_completed(3, 30.0)
    reply = stub.call("Profile", ProfileRequest(session=S, start=False))
    assert [(r.op, r.src, r.tid, r.comm, r.out_bytes, r.devices) for r in reply.records] == [
        ("aten.add.Tensor", "train.py:7", 2, False, 16, 1)]
    assert reply.window_s >= reply.busy_s >= reply.records[0].seconds > 0
    assert "no profile was started" in stub.call("Profile", ProfileRequest(session=S, start=False)).message
    # a window its client never closes ends with the session (no records kept for a session that is gone)
    assert stub.call("Profile", ProfileRequest(session=S, start=True)).message == ""
    run(a, 4, CmdCloseSession())
    assert "no profile was started" in stub.call("Profile", ProfileRequest(session=S, start=False)).message
    stub.close()
    ctl.close()


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_the_metrics_port_serves_and_a_port_in_use_is_one_line_and_no_stop(tmp_path) -> None:
    blocker, busy = _busy_port()
    free_sock, free = _busy_port()
    free_sock.close()
    procs = []
    try:
        for port in (free, busy):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dtorch_worker", "--controller", "127.0.0.1:1", "--register-attempts", "30",
                 "--metrics-port", str(port)], env={**os.environ, "DTORCH_API_KEY": auth.new_key()[1]},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 60
        text = ""
        while "dtorch_worker_batches_total" not in text:
            assert time.monotonic() < deadline, "no metrics served"
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{free}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.2)
        assert "dtorch_worker_memory_capacity_bytes" in text
        line = procs[1].stderr.readline()  # type: ignore[union-attr]
        # on --listen's host (loopback by default), as the controller: it served on 0.0.0.0, every interface
        assert line.startswith(f"dtorch-worker: cannot serve metrics on 127.0.0.1:{busy}") and "without metrics" in line
        assert procs[1].poll() is None  # it goes on (registering, here with a controller that is not there)
    finally:
        blocker.close()
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("option,value,expected", [("--metrics-port", "99999", "expected a port number 0-65535"),
                                                   ("--metrics-port", "-1", "expected a port number 0-65535"),
                                                   ("--parent-pid", "-1", "expected a process id"),
                                                   ("--parent-pid", "0", "expected a process id")])
def test_a_port_or_parent_that_cannot_be_is_refused_in_one_line(option, value, expected) -> None:
    """-1 as --parent-pid named every process (always alive: the worker outlived its parent) and 99999 as a port
    was taken; the controller refuses both alike (dtorch_protocol.options)."""
    done = subprocess.run([sys.executable, "-m", "dtorch_worker", "--controller", "127.0.0.1:1", option, value],
                          env={**os.environ, "DTORCH_API_KEY": auth.new_key()[1]}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and f"argument {option}: {expected}" in done.stderr
