"""The dtorch-controller command: serve with a port file, status, watchdog, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dtorch_controller import cli


def start(tmp_path, *extra):
    port_file = tmp_path / "port"
    env = {**os.environ, "DTORCH_TOKEN": "tok"}
    proc = subprocess.Popen([sys.executable, "-m", "dtorch_controller", "--listen", "127.0.0.1:0",
                             "--port-file", str(port_file), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the controller did not write its port file"
        time.sleep(0.05)
    return proc, port_file.read_text()


def test_serve_status_and_sigterm(tmp_path, monkeypatch, capsys):
    proc, address = start(tmp_path)
    try:
        assert proc.stdout.readline().strip() == f"dtorch-controller listening on {address}"
        monkeypatch.setenv("DTORCH_TOKEN", "tok")
        monkeypatch.setenv("DTORCH_CONTROLLER", address)
        assert cli.main(["status", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"workers": [], "sessions": [], "events": [],
                                                       "policy": "priority (preempt=on, pack=on)", "queued": 0}
        assert cli.main(["status", "--controller", address]) == 0
        assert "workers (0)" in capsys.readouterr().out
        monkeypatch.setenv("DTORCH_TOKEN", "bad")
        assert cli.main(["status"]) == 1
        assert "refused" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_exits_when_the_parent_dies(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc, _ = start(tmp_path, "--parent-pid", str(parent.pid))
    try:
        time.sleep(0.3)
        assert proc.poll() is None
        parent.kill()
        parent.wait()
        assert proc.wait(10) == 0
    finally:
        for p in (parent, proc):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_status_of_an_unreachable_controller_is_one_error_line(capsys):
    assert cli.main(["status", "--controller", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach 127.0.0.1:1" in err


@pytest.mark.parametrize("listen", ["nonsense", "host:port"])
def test_bad_listen_address(listen):
    with pytest.raises(SystemExit):
        cli._normalize_listen(listen)
    assert cli._normalize_listen(":50051") == "0.0.0.0:50051"
