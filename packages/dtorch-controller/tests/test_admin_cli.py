"""`dtorch-controller drain` / `migrate` against an in-process server: one-line refusals, exit codes, output."""

from __future__ import annotations

import pytest
from rich.console import Console

from dtorch_controller import cli, status_view
from dtorch_controller.server import run_server
from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m


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


def test_status_shows_what_each_sessions_snapshot_holds_and_what_its_taking_copied():
    session = m.SessionStatus(session="s" * 16, name="serve", priority="normal", state="open", devices={0: "w0"},
                              tensors=9, snapshot_batch=64, replay_batches=6, snapshot_bytes=17 << 20,
                              snapshot_copied_bytes=512 << 10)
    console = Console(width=250, record=True)
    status_view.render(m.StatusReply(workers=[], events=[], sessions=[session]), console)
    assert "batch 64 +6, 17.0 MiB (512.0 KiB copied)" in console.export_text()


def test_top_shows_workers_sessions_the_queue_and_each_sessions_throughput(controller, capsys, register_worker):
    from dtorch_controller import top

    server, address, keys = controller
    stub = wire.Stub("dtorch.Controller", address, keys.admin)
    worker = wire.Stub("dtorch.Controller", address, keys.worker)
    register_worker(worker, "127.0.0.1:9", memory=1 << 30)
    worker.close()
    opened = stub.call("OpenSession", m.OpenSession(hello=wire.hello("client"), name="trainer"))
    assert cli.main(["top", "--iterations", "2", "--interval", "0.05"]) == 0
    out = capsys.readouterr().out
    assert f"dtorch-controller {address}" in out and "workers 1/1 alive" in out and "trainer" in out
    # the rates come from two replies: 30 batches and 2 device-seconds in 2 s
    before = stub.call("Status", m.StatusRequest())
    s0 = before.sessions[0]
    after = m.StatusReply(workers=before.workers, events=[], queued=1, sessions=[
        m.SessionStatus(**{f: getattr(s0, f) for f in s0.__struct_fields__ if f not in ("batches", "attained_s")},
                        batches=s0.batches + 30, attained_s=s0.attained_s + 2.0),
        m.SessionStatus(session="waiting-one", name="next", priority="low", state="open", devices={}, tensors=0,
                        queue_position=1, schedule="waiting")])
    console = Console(width=250, record=True)
    console.print(top.frame(top.Snapshot(10.0, before), top.Snapshot(12.0, after), address))
    text = console.export_text()
    row = next(line for line in text.splitlines() if opened.session[:8] in line)
    assert "15.0" in row and "1.00" in row  # batches/s, devices busy
    assert "queue (1)" in text and "waiting-" in text
    assert cli.main(["top", "--controller", "127.0.0.1:1", "--iterations", "1"]) == 1
    assert "cannot reach 127.0.0.1:1" in capsys.readouterr().err
    stub.close()


def test_names_from_tenants_and_workers_reach_the_operators_terminal_as_plain_text(controller, capsys):
    """A session's name and a worker's device type are anyone's text: `status` and `top` show rich markup as it is
    (a `[/]` crashed both) and escape control characters (an ESC sequence cleared the operator's screen)."""
    _, address, keys = controller
    worker = wire.Stub("dtorch.Controller", address, keys.worker)
    worker.call("Register", m.RegisterWorker(hello=wire.hello("worker"), address="127.0.0.1:9",
                                             device_type="cpu\x1b]0;owned\x07", memory_bytes=1 << 30,
                                             secret=auth.new_worker_secret()))
    tenant = wire.Stub("dtorch.Controller", address, keys.alice)
    tenant.call("OpenSession", m.OpenSession(hello=wire.hello("client"), name="[/]x\x1b[2J[bold]y\u202e"))
    for argv in (["status"], ["top", "--iterations", "1"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "[/]x\\x1b[2J[bold]y\\u202e" in out and "cpu\\x1b]0;owned\\x07" in out, out
        assert not {"\x1b", "\x07", "\u202e"} & set(out)
    worker.close()
    tenant.close()
