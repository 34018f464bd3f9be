"""The real gRPC server on port 0, called through wire.Stub."""

from __future__ import annotations

import pytest

from dtorch_controller.core import Config
from dtorch_controller.server import run_server
from dtorch_protocol import messages as m
from dtorch_protocol import wire

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def controller():
    server, address = run_server("127.0.0.1:0", TOKEN, Config(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5))
    yield server, address
    server.stop(0)


def test_open_session_status_and_refusals(controller):
    server, address = controller
    stub = wire.Stub("dtorch.Controller", address, TOKEN)
    try:
        opened = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client"), name="grpc-test"), timeout=5)
        assert len(opened.session) == 32  # secrets.token_hex(16)
        status = stub.call("Status", m.StatusRequest(), timeout=5)
        assert [s.session for s in status.sessions] == [opened.session]
        assert any("opened" in e for e in status.events)

        with pytest.raises(wire.ProtocolError) as err:
            old = m.Hello(protocol_version="9.0", package_version="9.0.0", role="client")
            stub.call("OpenSession", m.OpenSession(hello=old), timeout=5)
        assert "9.0" in str(err.value) and m.PROTOCOL_VERSION in str(err.value)

        with pytest.raises(wire.RemoteError) as err:
            stub.call("Submit", m.Submit(session=opened.session, seq=5, instrs=[]), timeout=5)
        assert "expects batch 1" in str(err.value)
    finally:
        stub.close()
    intruder = wire.Stub("dtorch.Controller", address, "wrong")
    try:
        with pytest.raises(PermissionError):
            intruder.call("Status", m.StatusRequest(), timeout=5)
    finally:
        intruder.close()


def test_register_sync_and_unreachable_worker(controller):
    """A worker whose address accepts nothing is declared lost when its batch cannot be delivered."""
    server, address = controller
    stub = wire.Stub("dtorch.Controller", address, TOKEN)
    try:
        reg = stub.call("Register", m.RegisterWorker(hello=wire.hello("worker"), address="127.0.0.1:1",
                                                     device_type="cpu", memory_bytes=0), timeout=5)
        assert reg.heartbeat_interval_s == 0.1
        sid = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client")), timeout=5).session
        placed = stub.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0], shape=[1]), timeout=5)
        assert placed.placed and placed.locations == {0: "127.0.0.1:1"}
        spec = m.TensorSpec(shape=[2], dtype="float32", mesh=1, placements=["R"])
        stub.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrCreate(tid=1, spec=spec, init="ones")]),
                  timeout=5)
        reply = stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=5), timeout=10)
        assert reply.done and reply.errors and reg.worker in reply.errors[0].message
        assert stub.call("Report", m.WorkerReport(worker=reg.worker, completed=1), timeout=5).ok is False
        assert stub.call("CloseSession", m.CloseSession(session=sid), timeout=5).ok
    finally:
        stub.close()


class SilentWorker:
    """A dtorch.Worker that accepts batches and never reports: its batches stay unfinished."""

    def __init__(self) -> None:
        self.batches: list[m.Execute] = []

    def Execute(self, request: m.Execute) -> m.Ack:
        self.batches.append(request)
        return m.Ack()

    def Pull(self, request):
        raise wire.RemoteError("not here")

    def Put(self, requests):
        raise wire.RemoteError("not here")


def test_sync_times_out_and_shutdown_answers_parked_syncs():
    import threading
    import time

    worker = SilentWorker()
    worker_server, worker_address = wire.serve("dtorch.Worker", worker, TOKEN)
    server, address = run_server("127.0.0.1:0", TOKEN, Config(heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0))
    stub = wire.Stub("dtorch.Controller", address, TOKEN)
    try:
        stub.call("Register", m.RegisterWorker(hello=wire.hello("worker"), address=worker_address,
                                               device_type="cpu", memory_bytes=0), timeout=5)
        sid = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client")), timeout=5).session
        stub.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0, 1], shape=[2]), timeout=5)
        spec = m.TensorSpec(shape=[4], dtype="float32", mesh=1, placements=["S0"])
        stub.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrCreate(tid=1, spec=spec, init="ones")]),
                  timeout=5)
        reply = stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=0.3), timeout=60)  # its own timeout answers
        assert not reply.done and "w0" in reply.message
        assert [b.seq for b in worker.batches] == [1]
        assert worker.batches[0].cmds[0].boxes == {0: [[0, 2]], 1: [[2, 2]]}

        outcome: list[object] = []
        parked = threading.Thread(target=lambda: outcome.append(_try(stub, sid)))
        parked.start()
        deadline = time.monotonic() + 30
        while not server.service._waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        server.stop(0)
        parked.join(30)
        assert not parked.is_alive()
        assert isinstance(outcome[0], Exception)
        deadline = time.monotonic() + 30  # the handler thread forgets its waiter just after the client saw the abort
        while server.service._waiters and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.service._waiters
    finally:
        stub.close()
        server.stop(0)
        worker_server.stop(0)


def _try(stub, sid):
    try:
        return stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=60), timeout=90)
    except Exception as e:  # noqa: BLE001
        return e
