"""The real gRPC server on port 0, called through wire.Stub."""

from __future__ import annotations

import time

import pytest

from dtorch_controller.core import Config
from dtorch_controller.server import run_server
from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m


@pytest.fixture(scope="module")
def controller(module_keys):
    keys = module_keys
    server, address = run_server("127.0.0.1:0", keys.authenticate,
                                 Config(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5))
    yield server, address, keys
    server.stop(0)


def test_open_session_status_and_refusals(controller):
    server, address, keys = controller
    stub = wire.Stub("dtorch.Controller", address, keys.alice)
    try:
        opened = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client"), name="grpc-test"), timeout=5)
        assert len(opened.session) == 32  # secrets.token_hex(16)
        status = stub.call("Status", m.StatusRequest(), timeout=5)
        assert [s.session for s in status.sessions] == [opened.session]
        assert status.sessions[0].tenant == "alice"

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


def test_register_sync_and_unreachable_worker(controller, register_worker):
    """A worker whose address accepts nothing is declared lost when its batch cannot be delivered."""
    server, address, keys = controller
    worker = wire.Stub("dtorch.Controller", address, keys.worker)
    stub = wire.Stub("dtorch.Controller", address, keys.alice)
    try:
        reg, proof = register_worker(worker, "127.0.0.1:1")
        assert reg.heartbeat_interval_s == 0.1
        sid = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client")), timeout=5).session
        placed = stub.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0], shape=[1]), timeout=5)
        assert placed.placed and placed.locations == {0: "127.0.0.1:1"}
        assert auth.cap_expiry(placed.caps["127.0.0.1:1"]) > 0  # the owner's capability for that worker
        spec = m.TensorSpec(shape=[2], dtype="float32", mesh=1, placements=["R"])
        stub.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrCreate(tid=1, spec=spec, init="ones")]),
                  timeout=5)
        reply = stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=5), timeout=10)
        assert reply.done and reply.errors and reg.worker in reply.errors[0].message
        assert worker.call("Report", m.WorkerReport(worker=reg.worker, completed=1, proof=proof), timeout=5).ok is False
        assert stub.call("CloseSession", m.CloseSession(session=sid), timeout=5).ok
    finally:
        stub.close()
        worker.close()


class SilentWorker:
    """A dtorch.Worker that accepts batches and never reports: its batches stay unfinished."""

    def __init__(self) -> None:
        self.batches: list[m.Execute] = []

    def Execute(self, request: m.Execute, caller: auth.Caller) -> m.Ack:
        self.batches.append(request)
        return m.Ack()


@pytest.fixture
def silent(keys, register_worker):
    """A controller with one SilentWorker registered, and alice's session on a 2-device mesh: (controller server,
    alice's stub, the session id, the worker, a Shard(0) spec of 4 elements on that mesh)."""
    worker = SilentWorker()
    worker_auth = auth.WorkerAuth()
    served = wire.serve("dtorch.Worker", worker, worker_auth.authenticate)
    server, address = run_server("127.0.0.1:0", keys.authenticate,
                                 Config(heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0))
    stub = wire.Stub("dtorch.Controller", address, keys.alice)
    try:
        register_worker(wire.Stub("dtorch.Controller", address, keys.worker), served.address,
                        secret=worker_auth.secret)
        sid = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client")), timeout=5).session
        stub.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0, 1], shape=[2]), timeout=5)
        yield server, stub, sid, worker, m.TensorSpec(shape=[4], dtype="float32", mesh=1, placements=["S0"])
    finally:
        stub.close()
        server.stop(0)
        served.server.stop(0)


def test_sync_times_out_and_shutdown_answers_parked_syncs(silent):
    import threading
    import time

    server, stub, sid, worker, spec = silent
    stub.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrCreate(tid=1, spec=spec, init="ones")]),
              timeout=5)
    reply = stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=0.3), timeout=60)  # its own timeout answers
    assert not reply.done and "w0" in reply.message
    assert [b.seq for b in worker.batches] == [1]  # delivered over the execute token
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


def test_a_sync_carrying_its_batch_is_one_call_that_submits_it_first(silent):
    """Protocol 1.7: a Sync's `instrs` are its batch `upto`, accepted (counted, translated, sent) as a Submit of them
    would be, before the wait; a carried batch out of order is refused as its Submit would be."""
    server, stub, sid, worker, spec = silent
    create = m.InstrCreate(tid=1, spec=spec, init="ones")
    with pytest.raises(wire.RemoteError, match="batch 2 out of order: session .* expects batch 1"):
        stub.call("Sync", m.Sync(session=sid, upto=2, timeout_s=0.3, instrs=[create]), timeout=60)
    reply = stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=0.3, instrs=[create]), timeout=60)
    assert not reply.done and "w0" in reply.message  # the batch is out, and waited for
    assert [b.seq for b in worker.batches] == [1] and worker.batches[0].cmds[0].boxes == {0: [[0, 2]], 1: [[2, 2]]}
    metrics = server.service.metrics.registry
    assert metrics.get_sample_value("dtorch_controller_instructions_total") == 1
    assert metrics.get_sample_value("dtorch_controller_request_seconds_count", {"method": "Submit"}) == 0
    assert metrics.get_sample_value("dtorch_controller_request_seconds_count", {"method": "Sync"}) == 2
    with pytest.raises(wire.RemoteError, match="expects batch 2"):
        stub.call("Submit", m.Submit(session=sid, seq=1, instrs=[create]), timeout=5)


def test_a_sync_carrying_its_batch_is_answered_at_once_with_the_uploads_a_rebuild_asked_for(silent):
    """Protocol 1.12: the first Submit or Sync after a rebuild asked for uploads again answers them (recovery.py rule
    7); the batch a Sync carries is submitted first, and leaves them to the Sync, answered at once: the batch's readers
    wait for those uploads, so a Sync answered when they are done would wait out the workers' input wait."""
    server, stub, sid, worker, spec = silent
    with server.service._lock:  # as a rebuild's replay leaves it (test_core_recovery drives a whole one)
        server.service.core.sessions[sid].reput = {5: [1]}
    create = m.InstrCreate(tid=1, spec=spec, init="ones")
    reply = stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=0.3, instrs=[create]), timeout=60)
    assert reply.reput == {5: [1]} and not reply.done and reply.message == "the rebuild needs 1 uploads again"
    again = stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=0.3), timeout=60)
    assert again.reput == {}  # told once


def _try(stub, sid):
    try:
        return stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=60), timeout=90)
    except Exception as e:  # noqa: BLE001
        return e


def test_tenant_traffic_never_starves_heartbeats(keys, register_worker):
    """Parked Syncs used to take every handler thread: then no report got through and workers were fenced.
    Tenants now hold at most `tenant_threads` threads; the rest serve workers, and extra tenant calls are refused
    at once."""
    import threading
    import time

    worker = SilentWorker()
    worker_auth = auth.WorkerAuth()
    served = wire.serve("dtorch.Worker", worker, worker_auth.authenticate)
    server, address = run_server("127.0.0.1:0", keys.authenticate, Config(heartbeat_interval_s=1.0,
                                                                          heartbeat_timeout_s=30.0),
                                 threads=12, tenant_threads=6)
    reporter = wire.Stub("dtorch.Controller", address, keys.worker)
    reg, proof = register_worker(reporter, served.address, secret=worker_auth.secret, memory=1 << 30)
    stubs, outcomes = [], []
    try:
        sessions = []
        for key in (keys.alice, keys.bob):
            stub = wire.Stub("dtorch.Controller", address, key)
            stubs.append(stub)
            for _ in range(3):  # three sessions each, whose Syncs park (the worker never reports their batches)
                sid = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client"), memory_cap=1 << 20),
                                timeout=5).session  # packed: every session shares the one worker
                assert stub.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0], shape=[1]), timeout=5).placed
                spec = m.TensorSpec(shape=[1], dtype="float32", mesh=1, placements=["R"])
                stub.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrCreate(tid=1, spec=spec,
                                                                                      init="ones")]), timeout=5)
                sessions.append((stub, sid))
        for stub, sid in sessions:
            for _ in range(3):
                t = threading.Thread(target=lambda s=stub, i=sid: outcomes.append(_try_sync(s, i)), daemon=True)
                t.start()
        deadline = time.monotonic() + 10
        while len(outcomes) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)  # 6 Syncs park, the other 12 are refused at once
        assert sum(isinstance(o, wire.LimitExceeded) for o in outcomes) == 12, outcomes
        assert all("retry shortly" in str(o) or "per caller" in str(o) for o in outcomes)
        for _ in range(5):  # heartbeats go through, promptly, while every tenant thread is parked
            assert reporter.call("Report", m.WorkerReport(worker=reg.worker, completed=0, proof=proof), timeout=2).ok
    finally:
        for stub in stubs:
            stub.close()
        reporter.close()
        server.stop(0)
        served.server.stop(0)


def _try_sync(stub, sid):
    try:
        return stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=30), timeout=40)
    except Exception as e:  # noqa: BLE001
        return e


def test_a_sync_whose_caller_gave_up_frees_its_thread_and_slot(keys, register_worker):
    import time

    worker = SilentWorker()
    worker_auth = auth.WorkerAuth()
    served = wire.serve("dtorch.Worker", worker, worker_auth.authenticate)
    server, address = run_server("127.0.0.1:0", keys.authenticate, Config(heartbeat_interval_s=1.0,
                                                                          heartbeat_timeout_s=30.0))
    stub = wire.Stub("dtorch.Controller", address, keys.alice)
    try:
        register_worker(wire.Stub("dtorch.Controller", address, keys.worker), served.address,
                        secret=worker_auth.secret)
        sid = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client")), timeout=5).session
        stub.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0], shape=[1]), timeout=5)
        spec = m.TensorSpec(shape=[1], dtype="float32", mesh=1, placements=["R"])
        stub.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrCreate(tid=1, spec=spec, init="ones")]),
                  timeout=5)
        for _ in range(12):  # more than the 8 Syncs a session may have waiting: each caller gives up after 0.3 s
            with pytest.raises(TimeoutError):
                stub.call("Sync", m.Sync(session=sid, upto=1, timeout_s=100.0), timeout=0.3)
        deadline = time.monotonic() + 10
        while server.service._waiters or server.service._syncs:  # freed at once, not after 100 s
            assert time.monotonic() < deadline, (server.service._waiters, server.service._syncs)
            time.sleep(0.02)
    finally:
        stub.close()
        server.stop(0)
        served.server.stop(0)


def test_closing_another_tenants_session_writes_nothing_for_it(keys, tmp_path, register_worker):
    """CloseSession of alice's session by bob is refused as for an unknown one; before, it first settled alice's
    usage (a record in her name, at bob's asking) and dropped her session's queue-wait metric."""
    from dtorch_controller.usage import UsageLog

    server, address = run_server("127.0.0.1:0", keys.authenticate, Config(), usage=UsageLog(tmp_path / "usage.jsonl"),
                                 usage_interval_s=3600.0)
    alice, bob, worker = (wire.Stub("dtorch.Controller", address, key) for key in (keys.alice, keys.bob, keys.worker))
    try:
        register_worker(worker, "127.0.0.1:1")
        sid = alice.call("OpenSession", m.OpenSession(hello=wire.hello("client")), timeout=5).session
        assert alice.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0], shape=[1]), timeout=5).placed
        time.sleep(0.2)  # device-seconds to account for
        assert bob.call("CloseSession", m.CloseSession(session=sid), timeout=5).ok is False
        assert sid not in (tmp_path / "usage.jsonl").read_text()
        assert alice.call("CloseSession", m.CloseSession(session=sid), timeout=5).ok
        assert sid in (tmp_path / "usage.jsonl").read_text()
    finally:
        for stub in (alice, bob, worker):
            stub.close()
        server.stop(0)
