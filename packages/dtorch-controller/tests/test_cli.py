"""The dtorch-controller command: serve with a port file, status, watchdog, signals, keys."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dtorch_controller import cli
from dtorch_controller.keys import new_key_file


def start(tmp_path, *extra, listen="127.0.0.1:0"):
    port_file = tmp_path / "port"
    if not (tmp_path / "keys.json").exists():
        new_key_file(tmp_path / "keys.json", ("admin", ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    proc = subprocess.Popen([sys.executable, "-m", "dtorch_controller", "--listen", listen,
                             "--keys", str(tmp_path / "keys.json"), "--port-file", str(port_file), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the controller did not write its port file"
        time.sleep(0.05)
    return proc, port_file.read_text()


def test_serve_status_and_sigterm(tmp_path, monkeypatch, capsys):
    (admin,) = new_key_file(tmp_path / "keys.json", ("admin", ""))
    proc, address = start(tmp_path)
    try:
        assert proc.stdout.readline().strip() == f"dtorch-controller listening on {address}"
        monkeypatch.setenv("DTORCH_API_KEY", admin)
        monkeypatch.setenv("DTORCH_CONTROLLER", address)
        assert cli.main(["status", "--json"]) == 0
        reply = json.loads(capsys.readouterr().out)
        assert reply.pop("policy").startswith("dtorch (")  # the default policy
        assert reply == {"workers": [], "sessions": [], "events": [], "queued": 0,
                         "other_sessions": 0, "other_devices": 0, "other_workers": 0}
        assert cli.main(["status", "--controller", address]) == 0
        assert "workers (0)" in capsys.readouterr().out
        monkeypatch.setenv("DTORCH_API_KEY", "bad")
        assert cli.main(["status"]) == 1
        assert "refused" in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert "warning" not in proc.stderr.read()  # loopback: cleartext is fine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigusr1_prints_every_threads_stack_and_the_controller_goes_on(tmp_path):
    proc, _ = start(tmp_path)
    try:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None  # still serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        err = proc.stderr.read()
        assert err.count("(most recent call first)") >= 2, err  # the main thread and the server's
        assert "dtorch_controller/cli.py" in err, err
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


@pytest.mark.parametrize("pid", ["-1", "0", "x"])
def test_a_parent_pid_that_names_no_process_is_refused_in_one_line(tmp_path, pid):
    """-1 (every process this user may signal: always alive) and 0 (no watchdog at all) were taken, so a
    controller told to follow its parent outlived it."""
    out = _run("--keys", str(tmp_path / "keys.json"), "--listen", "127.0.0.1:0", "--parent-pid", pid)
    assert out.returncode == 2 and "listening" not in out.stdout
    assert out.stderr.splitlines()[-1] == ("dtorch-controller: error: argument --parent-pid: expected a process id "
                                           f"(a whole number >= 1), got '{pid}'")


def test_status_of_an_unreachable_controller_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setenv("DTORCH_API_KEY", "dtorch_00000000_x")
    assert cli.main(["status", "--controller", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach 127.0.0.1:1" in err


def test_asking_without_an_api_key_says_which_variable_to_set(capsys, monkeypatch, keys):
    """The controller's refusal named an HTTP header ("empty credential: expected 'authorization: Bearer <key>'")."""
    from dtorch_controller.server import run_server

    server, address = run_server(keys=keys.authenticate)
    monkeypatch.delenv("DTORCH_API_KEY", raising=False)
    try:
        for argv in (["status"], ["top", "--iterations", "1"], ["drain", "w0"]):
            assert cli.main([*argv, "--controller", address]) == 1
            assert capsys.readouterr().err == (f"dtorch-controller {argv[0]}: no API key: set DTORCH_API_KEY to an "
                                               "admin key (`dtorch-controller keys create --keys FILE --role admin` "
                                               "prints one)\n")
    finally:
        server.stop(0)


@pytest.mark.parametrize("listen", ["nonsense", "host:port"])
def test_bad_listen_address(listen):
    with pytest.raises(SystemExit):
        cli._normalize_listen(listen)
    assert cli._normalize_listen(":50051") == "0.0.0.0:50051"


def test_a_port_file_that_cannot_be_written_is_one_line_and_the_controller_stops(tmp_path):
    """It was a traceback naming the temporary file (".port.4242.tmp")."""
    keys = _admin_keys(tmp_path)
    out = _run("--keys", keys, "--listen", "127.0.0.1:0", "--port-file", str(tmp_path / "none" / "port"))
    assert out.returncode == 1 and out.stderr == (f"dtorch-controller: cannot write --port-file "
                                                  f"{tmp_path / 'none' / 'port'}: No such file or directory\n")


def test_a_bad_worker_port_is_named_as_the_worker_option(tmp_path):
    """--worker-listen HOST:99999 was refused as '--listen needs HOST:PORT', naming the option that was right."""
    keys = _admin_keys(tmp_path)
    out = _run("--keys", keys, "--listen", "127.0.0.1:0", "--worker-listen", "127.0.0.1:99999")
    assert out.returncode == 1 and out.stderr == ("dtorch-controller: --worker-listen needs HOST:PORT with a port "
                                                  "0-65535, got '127.0.0.1:99999'\n")


def _admin_keys(tmp_path) -> str:
    """A key file with an admin key, made by `keys create`: its path."""
    keys = str(tmp_path / "keys.json")
    assert _run("keys", "create", "--keys", keys, "--role", "admin").returncode == 0
    return keys


def _run(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "dtorch_controller", *argv], capture_output=True, text=True,
                          timeout=60, env=env or {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")})


def test_no_key_file_is_fatal_at_start(tmp_path):
    """A controller never runs open: no key file, an unreadable one or a malformed one stops it at once."""
    out = _run("--listen", "127.0.0.1:0")
    assert out.returncode == 2 and "no key file" in out.stderr and out.stderr.count("\n") == 1
    out = _run("--keys", str(tmp_path / "missing.json"), "--listen", "127.0.0.1:0")
    assert out.returncode == 2 and "no key file at" in out.stderr
    (tmp_path / "bad.json").write_text("{not json")
    out = _run("--keys", str(tmp_path / "bad.json"), "--listen", "127.0.0.1:0")
    assert out.returncode == 2 and "not valid JSON" in out.stderr
    (tmp_path / "locked.json").write_text("{}")
    (tmp_path / "locked.json").chmod(0)
    if not os.access(tmp_path / "locked.json", os.R_OK):  # root reads anything
        out = _run("--keys", str(tmp_path / "locked.json"), "--listen", "127.0.0.1:0")
        assert out.returncode == 2 and "cannot read the key file" in out.stderr


def test_a_key_file_of_the_wrong_shape_names_where_and_stops_the_start(tmp_path):
    """A missing field was Python's 'KeyEntry.__init__() missing 2 required positional arguments', and a field of
    another type was taken: a quota of devices "x" started the controller, to fail at the first comparison."""
    cases = [({"version": 1, "keys": [{"id": "k1", "role": "admin"}]},
              "Object missing required field `sha256` - at `$.keys[0]`"),
             ({"version": 1, "quotas": {"alice": {"devices": "x"}}},
              "Expected `int`, got `str` - at `$.quotas[...].devices`"),
             ([], "version None, expected 1"),
             # names `keys create` refuses, hand-edited in: escape codes reached the terminal of `keys list`
             ({"version": 1, "keys": [{"id": "k1", "role": "tenant", "sha256": "0" * 64, "tenant": "a\x1b[2J"}]},
              "tenant name 'a\\x1b[2J' must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or "
              "digit"),
             ({"version": 1, "quotas": {"[/]": {"devices": 1}}},
              "tenant name '[/]' must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")]
    for content, what in cases:
        (tmp_path / "keys.json").write_text(json.dumps(content))
        out = _run("--keys", str(tmp_path / "keys.json"), "--listen", "127.0.0.1:0")
        assert out.returncode == 2 and out.stderr == f"dtorch-controller: the key file {tmp_path / 'keys.json'} is " \
                                                     f"malformed: {what}\n"


def test_a_key_file_that_cannot_be_written_is_named_not_its_temporary_file(tmp_path, capsys):
    """It said "No such file or directory: '.../.keys.json.4242.tmp'", a file the operator never named."""
    path = tmp_path / "none" / "keys.json"
    assert cli.main(["keys", "create", "--keys", str(path), "--role", "admin"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"dtorch-controller keys create: cannot write the key file {path}: No such "
                                         "file or directory\n")


def test_a_negative_dispatch_window_is_refused_in_one_line(tmp_path):
    out = _run("--dispatch-ahead", "-1", "--listen", "127.0.0.1:0")
    assert out.returncode == 2 and out.stderr == "dtorch-controller: --dispatch-ahead must be >= 0, got -1\n"


def test_settings_out_of_range_name_the_options_an_operator_typed(tmp_path):
    """The refusals named the core's fields (heartbeat_timeout_s, snapshot_every_s), not the options."""
    keys = _admin_keys(tmp_path)
    out = _run("--keys", keys, "--listen", "127.0.0.1:0", "--heartbeat-timeout", "0.1")
    assert out.returncode == 2 and out.stderr == ("dtorch-controller: --heartbeat-timeout (0.1) must exceed "
                                                  "--heartbeat-interval (0.2)\n")
    # a nanosecond interval was taken: workers report every 10 ms at most, so the core saw each one suspect between
    # its reports (suspect after two intervals)
    out = _run("--keys", keys, "--listen", "127.0.0.1:0", "--heartbeat-interval", "1e-9")
    assert out.returncode == 2 and out.stderr == ("dtorch-controller: --heartbeat-interval must be >= 0.01 s (workers "
                                                  "report at most that often), got 1e-09\n")
    out = _run("--keys", keys, "--listen", "127.0.0.1:0", "--session-timeout", "1e-9")  # closed every session
    assert out.returncode == 2 and out.stderr == ("dtorch-controller: --session-timeout must be 0 (never) or >= 0.1 s, "
                                                  "got 1e-09\n")
    out = _run("--keys", keys, "--listen", "127.0.0.1:0", "--snapshot-interval", "0")
    assert out.returncode == 2 and out.stderr == ("dtorch-controller: --snapshot-batches must be >= 0 and "
                                                  "--snapshot-interval > 0, got 32 and 0.0\n")


@pytest.mark.parametrize(("name", "takes"), [("DTORCH_DISPATCH_AHEAD", "a whole number"),
                                             ("DTORCH_HEARTBEAT_TIMEOUT", "a finite number"),
                                             ("DTORCH_SNAPSHOT_BATCHES", "a whole number")])
def test_a_malformed_environment_default_is_one_line_naming_the_variable(name, takes):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    out = _run("--listen", "127.0.0.1:0", env={**env, name: "1.5x"})
    assert out.returncode == 2 and out.stderr == f"dtorch-controller: ${name} must be {takes}, not '1.5x'\n"


def test_ports_and_times_out_of_range_are_refused_naming_the_option(tmp_path):
    """A port above 65535 was served on a random port (--listen) or crashed the start (--metrics-port, and -1 ran
    without metrics); an infinite time crashed a timer thread (--usage-interval inf) while the controller went on."""
    keys = _admin_keys(tmp_path)
    for argv, line in [
        (["--listen", "127.0.0.1:99999"], "dtorch-controller: --listen needs HOST:PORT with a port 0-65535, got "
                                          "'127.0.0.1:99999'"),
        (["--metrics-port", "99999"], "dtorch-controller: error: argument --metrics-port: expected a port number "
                                      "0-65535 (0: none), got '99999'"),
        (["--metrics-port", "-1"], "dtorch-controller: error: argument --metrics-port: expected a port number "
                                   "0-65535 (0: none), got '-1'"),
        (["--usage-interval", "inf"], "dtorch-controller: error: argument --usage-interval: expected a finite "
                                      "number of seconds, got 'inf'"),
        # 1e-9 settled every session's usage (a Status of the core, a record and an fsync each) in a busy loop
        (["--usage-interval", "1e-9"], "dtorch-controller: --usage-interval must be at least 0.1 seconds, got 1e-09"),
        (["--usage-interval", "0"], "dtorch-controller: --usage-interval must be at least 0.1 seconds, got 0"),
    ]:
        out = _run("--keys", keys, "--listen", "127.0.0.1:0", *argv)
        assert out.returncode in (1, 2) and out.stderr.splitlines()[-1] == line, (argv, out.stderr)
        assert "Traceback" not in out.stderr and "listening" not in out.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    out = _run("--keys", keys, "--listen", "127.0.0.1:0", env={**env, "DTORCH_SESSION_TIMEOUT": "inf"})
    assert out.returncode == 2
    assert out.stderr == "dtorch-controller: $DTORCH_SESSION_TIMEOUT must be a finite number, not 'inf'\n"


@pytest.mark.parametrize("command", [["drain", "w1"], ["migrate", "abcd", "--device", "0", "--to", "w1"]])
@pytest.mark.parametrize("timeout", ["-1", "3601", "1e10"])
def test_an_admin_timeout_the_protocol_refuses_is_one_line_before_asking(capsys, monkeypatch, command, timeout):
    """-1 came back as the controller's 'bad DrainRequest message: Expected `float` >= 0.0 - at `$.timeout_s`', 1e10
    as 'timed out' at once (gRPC's deadline overflowed), neither naming the option."""
    monkeypatch.setenv("DTORCH_API_KEY", "dtorch_x_y")
    with pytest.raises(SystemExit):
        cli.main([*command, "--timeout", timeout, "--controller", "127.0.0.1:1"])
    assert capsys.readouterr().err.splitlines()[-1] == (f"dtorch-controller {command[0]}: error: argument --timeout: "
                                                        f"expected seconds from 0 to 3600 (an hour), got '{timeout}'")


def test_top_refuses_an_interval_that_is_no_pause(capsys):
    """--interval 0 (or -1) asked the controller for its Status as fast as it answered, without end."""
    for interval in ("0", "-1"):
        with pytest.raises(SystemExit):
            cli.main(["top", "--interval", interval])
        err = capsys.readouterr().err
        assert err.splitlines()[-1] == (f"dtorch-controller top: error: argument --interval: expected seconds > 0 "
                                        f"between refreshes, got '{interval}'")


def test_metrics_are_served_on_the_listen_host_only(tmp_path):
    """A controller listening on loopback served its metrics (tenants' names, device-seconds, bytes) on every
    interface, without a key."""
    import urllib.request
    from pathlib import Path

    keys = _admin_keys(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dtorch_controller", "--keys", keys, "--listen", "127.0.0.1:0",
                             "--metrics-port", str(port), "--port-file", str(tmp_path / "port")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            if (tmp_path / "port").exists():
                break
            time.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"dtorch_controller_workers" in r.read()
        listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        local = {f[1] for f in listening if f[3] == "0A"}  # LISTEN sockets, as hex address:port
        assert f"0100007F:{port:04X}" in local and f"00000000:{port:04X}" not in local
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_keys_create_list_revoke_quota(tmp_path, monkeypatch, capsys):
    """Keys are shown once and stored hashed; a running controller honours a revocation within a second."""
    path = tmp_path / "keys.json"
    created = _run("keys", "create", "--keys", str(path), "--role", "tenant", "--tenant", "alice")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("dtorch_") and "created tenant key" in created.stderr
    stored = path.read_text()
    assert key not in stored and key.split("_", 2)[2] not in stored  # only the hash is kept (the secret may hold "_")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert _run("keys", "create", "--keys", str(path), "--role", "tenant").returncode == 1  # no tenant named
    admin = _run("keys", "create", "--keys", str(path), "--role", "admin").stdout.strip()
    quota = _run("keys", "quota", "alice", "--keys", str(path), "--devices", "4", "--sessions", "2")
    assert quota.returncode == 0 and "devices 4" in quota.stdout
    listing = _run("keys", "list", "--keys", str(path)).stdout
    key_id = key.split("_")[1]
    assert key_id in listing and "alice" in listing and "quota alice: devices 4" in listing

    proc, address = start(tmp_path)
    try:
        monkeypatch.setenv("DTORCH_CONTROLLER", address)
        monkeypatch.setenv("DTORCH_API_KEY", key)
        assert cli.main(["status"]) == 0
        capsys.readouterr()
        revoked = _run("keys", "revoke", key_id, "--keys", str(path))
        assert revoked.returncode == 0 and "revoked tenant key" in revoked.stdout
        assert "20" in _run("keys", "list", "--keys", str(path)).stdout.split(key_id)[1].splitlines()[0]
        deadline = time.monotonic() + 10
        while cli.main(["status"]) == 0:
            assert time.monotonic() < deadline, "the revoked key still works"
            time.sleep(0.2)
        assert f"unknown or revoked API key {key_id}" in capsys.readouterr().err
        monkeypatch.setenv("DTORCH_API_KEY", admin)
        assert cli.main(["status"]) == 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_keys_list_is_a_table_that_tells_keys_apart_and_shows_no_secret(tmp_path):
    """Fixed column widths glued a long tenant or node to the next column ('research-vision-team-' then the node);
    each column is now as wide as its longest value, a revoked key says so, and neither a key nor its hash shows."""
    path = str(tmp_path / "keys.json")
    made = [_run("keys", "create", "--keys", path, *argv).stdout.strip() for argv in (
        ("--role", "tenant", "--tenant", "research-vision-team"), ("--role", "worker", "--node", "gpu-node-42.example"),
        ("--role", "admin",))]
    ids = [key.split("_")[1] for key in made]
    assert _run("keys", "revoke", ids[2], "--keys", path).returncode == 0
    out = _run("keys", "list", "--keys", path)
    assert out.returncode == 0, out.stderr
    header, *rows = [line.split() for line in out.stdout.splitlines()]
    assert header == ["ID", "ROLE", "TENANT", "NODE", "CREATED", "STATE"]
    assert [row[:4] for row in rows] == [[ids[0], "tenant", "research-vision-team", "-"],
                                         [ids[1], "worker", "-", "gpu-node-42.example"],
                                         [ids[2], "admin", "admin", "-"]]
    assert [row[6:] for row in rows][:2] == [["active"], ["active"]] and rows[2][6] == "revoked", out.stdout
    first, *lines = out.stdout.splitlines()
    starts = [first.index(name) for name in header]
    for line, row in zip(lines, rows):  # each cell starts under its column's name, after at least two spaces
        assert [line[at:].split()[0] for at in starts] == row[:5] + row[6:7], line
        assert all(line[at - 2:at] == "  " for at in starts[1:]), line
    stored = json.loads((tmp_path / "keys.json").read_text())["keys"]
    for key, entry in zip(made, stored):
        assert key.split("_", 2)[2] not in out.stdout and entry["sha256"] not in out.stdout
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"version": 1, "keys": [], "quotas": {}}))
    assert _run("keys", "list", "--keys", str(empty)).stdout.splitlines()[1] == (
        "(no keys: `dtorch-controller keys create` makes one)")


def test_a_quota_names_a_tenant_that_has_keys(tmp_path):
    """`keys quota alcie` (a typo) set a quota on a tenant no key names, said so as if it were done, and left alice
    without one."""
    path = str(tmp_path / "keys.json")
    assert _run("keys", "create", "--keys", path, "--role", "tenant", "--tenant", "alice").returncode == 0
    assert _run("keys", "create", "--keys", path, "--role", "admin").returncode == 0
    out = _run("keys", "quota", "alcie", "--keys", path, "--devices", "4")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == ("dtorch-controller keys quota: no tenant 'alcie': no key names it (tenants: alice; "
                          "`keys create --role tenant --tenant alcie` makes one)\n")
    out = _run("keys", "quota", "admin", "--keys", path, "--devices", "4")
    assert out.returncode == 1 and out.stderr == ("dtorch-controller keys quota: tenant name 'admin' is the admin "
                                                  "keys' own: admins have no quota\n")
    assert "quota" not in _run("keys", "list", "--keys", path).stdout
    assert _run("keys", "quota", "alice", "--keys", path, "--devices", "4").returncode == 0


def test_tenant_and_node_names_are_labels_and_admin_is_no_tenants(tmp_path, capsys):
    """Any string was a tenant: a newline broke `keys list` and every log line naming it, and a tenant key named
    'admin' shared the admin keys' tenant, which is what isolation compares."""
    path = str(tmp_path / "keys.json")
    for args, said in (
            (["--role", "tenant", "--tenant", "x\ny"], "tenant name 'x\\ny' must be 1-63 letters, digits"),
            (["--role", "tenant", "--tenant", "a" * 64], "must be 1-63"),
            (["--role", "tenant", "--tenant=-a"], "starting with a letter or digit"),
            (["--role", "tenant", "--tenant", "admin"], "tenant name 'admin' is the admin keys' own"),
            (["--role", "worker", "--node", "rack 1"], "node name 'rack 1' must be '*' or 1-253")):
        assert cli.main(["keys", "create", "--keys", path, *args]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    for args in (["--role", "tenant", "--tenant", "team-a.ml_1"], ["--role", "worker", "--node", "*"],
                 ["--role", "worker", "--node", "gpu-node-7.example.com"], ["--role", "admin"]):
        assert cli.main(["keys", "create", "--keys", path, *args]) == 0
    assert cli.main(["keys", "quota", "team-a.ml_1", "--keys", path, "--devices", "2"]) == 0
    capsys.readouterr()
    assert cli.main(["keys", "quota", "a b", "--keys", path, "--devices", "1"]) == 1
    assert "tenant name 'a b' must be" in capsys.readouterr().err


def test_cleartext_off_loopback_warns_once(tmp_path):
    proc, address = start(tmp_path, listen="0.0.0.0:0")
    try:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == 1 and "without TLS" in warnings[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_busy_metrics_port_and_an_unwritable_usage_file_are_one_line_each_and_it_serves_without_them(
        tmp_path, monkeypatch, capsys):
    (admin,) = new_key_file(tmp_path / "keys.json", ("admin", ""))
    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        proc, address = start(tmp_path, "--metrics-port", str(busy), "--usage-file", str(tmp_path))  # a directory
        try:
            monkeypatch.setenv("DTORCH_API_KEY", admin)
            assert cli.main(["status", "--json", "--controller", address]) == 0  # it serves
            assert json.loads(capsys.readouterr().out)["workers"] == []
            proc.terminate()
            _, err = proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0
    usage, metrics = [line for line in err.splitlines() if line.startswith("dtorch-controller:")]
    assert f"cannot write usage records to {tmp_path}" in usage and usage.endswith("running without usage records")
    assert metrics.startswith(f"dtorch-controller: cannot serve metrics on 127.0.0.1:{busy}")
    assert metrics.endswith("running without metrics")
