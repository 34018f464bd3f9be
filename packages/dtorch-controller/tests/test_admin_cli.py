"""`dtorch-controller drain` / `migrate` against an in-process server: one-line refusals, exit codes, output."""

from __future__ import annotations

import pytest
from rich.console import Console

from dtorch_controller import cli, status_view
from dtorch_controller.server import run_server
from dtorch_protocol import messages as m
from dtorch_protocol import wire


@pytest.fixture
def controller(monkeypatch, keys):
    server, address = run_server(keys=keys.authenticate)
    monkeypatch.setenv("DTORCH_API_KEY", keys.admin)
    monkeypatch.setenv("DTORCH_CONTROLLER", address)
    yield server, address, keys
    server.stop(0)


def test_unknown_ids_are_refused_in_one_line(controller, capsys):
    assert cli.main(["drain", "w7"]) == 1
    err = capsys.readouterr().err
    assert err == "dtorch-controller drain: unknown worker 'w7' (workers: none)\n"
    assert cli.main(["migrate", "abcdef", "--device", "0", "--to", "w0"]) == 1
    err = capsys.readouterr().err
    assert err == "dtorch-controller migrate: unknown session 'abcdef' (sessions: none)\n"


def test_drain_and_migrate_need_an_admin_key(controller, capsys, monkeypatch):
    _, _, keys = controller
    monkeypatch.setenv("DTORCH_API_KEY", keys.alice)
    for argv in (["drain", "w0"], ["migrate", "abcdef", "--device", "0", "--to", "w0"]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs admin credentials" in err and "tenant 'alice'" in err


def test_draining_an_idle_worker_releases_it(controller, capsys, register_worker):
    server, address, keys = controller
    stub = wire.Stub("dtorch.Controller", address, keys.admin)
    worker = wire.Stub("dtorch.Controller", address, keys.worker)
    reply, proof = register_worker(worker, "127.0.0.1:9", memory=1 << 30)
    assert cli.main(["drain", reply.worker, "--timeout", "5"]) == 0
    assert f"drained {reply.worker}" in capsys.readouterr().out
    status = stub.call("Status", m.StatusRequest())
    assert [w.state for w in status.workers] == ["lost"]
    assert worker.call("Report", m.WorkerReport(worker=reply.worker, completed=0, proof=proof)).ok is False
    assert cli.main(["drain", reply.worker, "--json"]) == 1
    assert "already gone" in capsys.readouterr().err
    stub.close()
    worker.close()


def test_status_shows_utilization_copies_and_snapshots(controller, capsys, register_worker):
    server, address, keys = controller
    stub = wire.Stub("dtorch.Controller", address, keys.admin)
    worker = wire.Stub("dtorch.Controller", address, keys.worker)
    reply, proof = register_worker(worker, "127.0.0.1:9", memory=1 << 30)
    worker.call("Report", m.WorkerReport(worker=reply.worker, completed=0, utilization=0.25, proof=proof,
                                         sessions={"s#s1": m.ShardStats(tensors=2, bytes=2048)}))
    status = stub.call("Status", m.StatusRequest())
    assert status.workers[0].utilization == 0.25 and status.workers[0].backup_bytes == 2048
    console = Console(width=250, record=True)
    status_view.render(status, console)
    out = console.export_text()
    assert "25%" in out and "2.0 KiB" in out and "copies" in out
    stub.close()
