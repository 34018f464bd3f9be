"""Many sessions on one cluster, with real processes: a controller and workers started with their CLIs,
clients as separate Python processes. Every wait is bounded; the order of events is forced with files, so
nothing depends on timing luck.

* two clients at once, packed onto the same devices, each with correct results;
* a packed session going over its memory cap: the workers refuse it, with a one-line error;
* a SIGKILLed client: the controller closes its silent session and every worker frees its shards;
* a mesh that waits in the queue (the client shows its position) and is placed as soon as a worker joins;
* a high-priority session freezes a low-priority one, which resumes afterwards and finishes correctly;
* a frozen session relocates onto workers that join (its shards move there) and finishes while its preemptor runs;
* an elastic session is shrunk from 4 workers to 2 by a higher-priority one (not frozen), runs there, and grows
  back to 4 when it leaves, with results equal to plain torch throughout;
* with the default dispatch window (`--dispatch-ahead 1`) a stream of batches goes out as the workers report,
  with torch's results.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _helpers import CONTROLLER, Keys, start_controller, start_worker, stop_all
from dtorch_protocol import messages as m
from dtorch_protocol import wire

WAIT_S = 60.0  # bound on every wait in these tests

# A client: the program of a DTorch user, with a few helpers to coordinate with the test through files.
PRELUDE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    import dtorch
    from dtorch import Replicate, Shard

    DIR = Path(sys.argv[1])

    def say(word):
        print(word, flush=True)

    def wait_for(name, limit=60.0):
        deadline = time.monotonic() + limit
        while not (DIR / name).exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"gave up waiting for {name}")
            time.sleep(0.05)
""")


class Cluster:
    """A controller and workers started with the CLIs; clients are scripts run with DTORCH_CONTROLLER set."""

    def __init__(self, tmp: Path, workers: int, *controller_args: str) -> None:
        self.tmp = tmp
        self.keys = Keys.make(tmp)
        self.env = self.keys.env(self.keys.admin)  # the controller, the CLI and this test's stub: the operator
        self.procs: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.controller, self.address = start_controller(tmp / "controller.addr", self.env, *controller_args,
                                                         log=self._log("controller"), limit=WAIT_S)
        self.procs.append(self.controller)
        self.stub = wire.Stub("dtorch.Controller", self.address, self.keys.admin)
        for _ in range(workers):
            self.add_worker()
        self.wait(lambda st: sum(w.state == "alive" for w in st.workers) == workers, "workers to register")

    def _log(self, name: str) -> Path:
        """One log per process, numbered in the order they were started."""
        return self.tmp / f"{name}-{len(self.procs)}.log"

    def add_worker(self) -> subprocess.Popen:
        proc = start_worker(self.address, {**self.env, "DTORCH_API_KEY": self.keys.worker}, log=self._log("worker"))
        self.procs.append(proc)
        self.workers.append(proc)
        return proc

    def client(self, name: str, code: str, **consts: object) -> subprocess.Popen:
        """Run a client script; its stdout is a pipe (lines the test waits for), stderr goes to a file."""
        script = self.tmp / f"{name}.py"
        script.write_text(PRELUDE + "".join(f"{k} = {v!r}\n" for k, v in consts.items()) + textwrap.dedent(code))
        err = open(self.tmp / f"{name}.err", "w")
        proc = subprocess.Popen([sys.executable, str(script), str(self.tmp)], stdout=subprocess.PIPE, stderr=err,
                                text=True, env={**self.env, "DTORCH_CONTROLLER": self.address,
                                                "DTORCH_API_KEY": self.keys.alice})
        err.close()
        self.procs.append(proc)
        return proc

    def stderr(self, name: str) -> str:
        return (self.tmp / f"{name}.err").read_bytes().decode()  # keep "\r" as written

    def status(self) -> m.StatusReply:
        return self.stub.call("Status", m.StatusRequest(), timeout=10.0)

    def wait(self, ready, what: str, limit: float = WAIT_S) -> m.StatusReply:
        deadline = time.monotonic() + limit
        while True:
            st = self.status()
            if ready(st):
                return st
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
            time.sleep(0.05)

    def signal(self, name: str) -> None:
        (self.tmp / name).write_text("go")

    def close(self) -> None:
        self.stub.close()
        stop_all(self.procs[::-1])  # the newest first: clients, then workers, then the controller


def expect_line(proc: subprocess.Popen, line: str, limit: float = WAIT_S) -> None:
    """Read the client's stdout until `line` (bounded: a stuck client is killed and the test fails)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = proc.stdout.readline()  # type: ignore[union-attr]
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            err = Path(proc.args[-1]) / (Path(proc.args[-2]).stem + ".err")
            pytest.fail(f"the client exited with {proc.returncode} before printing {line!r}: {err.read_text()[-2000:]}")
    proc.kill()
    pytest.fail(f"the client did not print {line!r} within {limit:g}s")


def finish(proc: subprocess.Popen, cluster: Cluster, name: str, limit: float = WAIT_S) -> str:
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"client {name} did not finish within {limit:g}s")
    assert proc.returncode == 0, cluster.stderr(name)
    return out


@pytest.fixture
def make_cluster(tmp_path):
    clusters: list[Cluster] = []

    def make(workers: int, *args: str) -> Cluster:
        clusters.append(Cluster(tmp_path, workers, "--session-timeout", "2", *args))
        return clusters[-1]

    yield make
    for c in clusters:
        c.close()


# ---------------------------------------------------------------- two clients at once

TWO_AT_ONCE = """
    dtorch.connect(name=NAME, memory_cap=256 << 20)  # capped: the two sessions may share devices
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    torch.manual_seed(SEED)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    da = dtorch.distribute_tensor(a, mesh, [Shard(0)])
    db = dtorch.distribute_tensor(b, mesh, [Replicate()])
    assert torch.allclose((da @ db).to_torch(), a @ b, atol=1e-5)
    say("placed")
    wait_for("both-running")
    out = ((da @ db) * SEED).sum(dim=0)  # same tensor ids in both sessions: each names only its own
    assert torch.allclose(out.to_torch(), ((a @ b) * SEED).sum(dim=0), atol=1e-4)
    say("ok")
"""


def test_two_clients_at_once_share_the_devices_and_get_correct_results(make_cluster):
    cluster = make_cluster(2)
    procs = {name: cluster.client(name, TWO_AT_ONCE, NAME=name, SEED=seed)
             for name, seed in (("one", 1), ("two", 2))}
    for proc in procs.values():
        expect_line(proc, "placed")
    st = cluster.status()
    running = [s for s in st.sessions if s.schedule == "running"]
    assert sorted(s.name for s in running) == ["one", "two"]
    for w in st.workers:  # packed: each device carries both sessions, each within its cap
        assert sorted(w.leases.values()) == [256 << 20, 256 << 20], w
    cluster.signal("both-running")
    for name, proc in procs.items():
        assert finish(proc, cluster, name).split() == ["ok"]


# ---------------------------------------------------------------- the workers enforce a packed session's cap

CAPPED = """
    dtorch.connect(name="capped", memory_cap=1 << 20)  # 1 MiB per device: packed, the workers enforce it
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    da = dtorch.distribute_tensor(a, mesh, [Shard(0)])
    db = dtorch.distribute_tensor(b, mesh, [Replicate()])
    assert torch.allclose((da @ db).to_torch(), a @ b, atol=1e-5)  # under the cap: plain torch's values
    big = dtorch.zeros(1024, 512, device_mesh=mesh, placements=[Replicate()])  # 2 MiB on each device
    try:
        big.to_torch()
    except dtorch.DTorchError as e:
        say("error: " + str(e))
    try:
        dtorch.distribute_tensor(torch.ones(1024, 512), mesh, [Replicate()])
    except Exception as e:
        say("upload: " + str(e))
    assert torch.allclose(((da @ db) * 2).to_torch(), (a @ b) * 2, atol=1e-5)  # the session goes on
    say("ok")
"""


def test_a_capped_session_going_over_its_cap_gets_a_one_line_error_and_goes_on(make_cluster):
    cluster = make_cluster(2)
    proc = cluster.client("capped", CAPPED)
    out = finish(proc, cluster, "capped").splitlines()
    assert len(out) == 3 and out[-1] == "ok", out
    assert out[0].startswith("error: create failed on a worker at ") and "big = dtorch.zeros(" in out[0], out
    assert out[0].endswith(": memory cap exceeded: session holds 2.0 MiB on this worker, over its cap of "
                           "1.0 MiB per device"), out
    assert out[1].startswith("upload: ") and out[1].endswith(  # refused before a byte of it was kept
        "refused Put: memory cap exceeded: session holds 2.0 MiB on this worker, over its cap of 1.0 MiB per "
        "device"), out


FIRST_UPLOAD = """
    dtorch.connect(name="capped", memory_cap=1 << 20)
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    try:  # the session's first act: no batch of it has reached a worker, the cap rides in its capabilities
        dtorch.distribute_tensor(torch.ones(1024, 512), mesh, [Replicate()])
    except Exception as e:
        say("upload: " + str(e))
    x = dtorch.distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    assert torch.equal((x * 2).to_torch(), torch.arange(8.0) * 2)
    say("ok")
"""


def test_a_capped_sessions_first_upload_is_held_to_its_cap(make_cluster):
    """Workers learned the cap from the session's first Execute: uploads before it were not held to any."""
    cluster = make_cluster(2)
    out = finish(cluster.client("capped", FIRST_UPLOAD), cluster, "capped").splitlines()
    assert len(out) == 2 and out[-1] == "ok", out
    assert out[0].startswith("upload: ") and out[0].endswith(
        "refused Put: memory cap exceeded: session holds 2.0 MiB on this worker, over its cap of 1.0 MiB per "
        "device"), out


# ---------------------------------------------------------------- a killed client leaks nothing

KILLED = """
    dtorch.connect()
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2, 3])
    xs = [dtorch.randn(64, 32, device_mesh=mesh, placements=[Shard(0)]) for _ in range(5)]
    ys = [x @ x.T for x in xs]
    ys[-1].to_torch()
    say("ready")
    time.sleep(120)
"""


def test_a_killed_client_has_every_shard_freed_on_every_worker(make_cluster):
    cluster = make_cluster(2)
    baseline = {w.worker: w.tensors for w in cluster.status().workers}
    proc = cluster.client("victim", KILLED)
    expect_line(proc, "ready")
    st = cluster.wait(lambda st: all(w.tensors > baseline[w.worker] for w in st.workers), "shards on both workers")
    (session,) = [s.session for s in st.sessions]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    st = cluster.wait(lambda st: not st.sessions and all(w.tensors == baseline[w.worker] for w in st.workers),
                      "the dead client's shards to be freed", limit=60)
    assert all(w.bytes == 0 and not w.leases for w in st.workers)
    assert any(f"session {session[:8]} timed out: client silent" in line for line in st.events)


# ---------------------------------------------------------------- waiting for a worker that joins

HOLDER = """
    dtorch.connect(name="holder")
    mesh = dtorch.DeviceMesh("cpu", [0])
    x = dtorch.ones(4, device_mesh=mesh, placements=[Replicate()])
    assert torch.equal(x.to_torch(), torch.ones(4))
    say("holding")
    wait_for("release-holder")
"""

WAITER = """
    dtorch.connect(name="waiter")
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.arange(8, device_mesh=mesh, placements=[Shard(0)]).float()
    say("placed")
    assert torch.equal((x * 2).to_torch(), torch.arange(8).float() * 2)
    say("ok")
"""


def test_a_waiting_mesh_shows_its_position_and_is_placed_when_a_worker_joins(make_cluster):
    cluster = make_cluster(1)
    holder = cluster.client("holder", HOLDER)
    expect_line(holder, "holding")
    waiter = cluster.client("waiter", WAITER)
    st = cluster.wait(lambda st: any(s.name == "waiter" and s.schedule == "waiting" for s in st.sessions),
                      "the waiter to queue")
    assert [s.queue_position for s in st.sessions if s.name == "waiter"] == [1]
    cli = subprocess.run([*CONTROLLER, "status", "--controller", cluster.address], env={**cluster.env,
                         "COLUMNS": "250"}, capture_output=True, text=True, timeout=30)
    assert cli.returncode == 0 and "1 queued" in cli.stdout, cli.stdout
    assert any("waiter" in line and "waiting" in line for line in cli.stdout.splitlines()), cli.stdout
    deadline = time.monotonic() + 10
    while "position 1 in the queue" not in cluster.stderr("waiter"):  # one line, rewritten in place
        assert time.monotonic() < deadline, cluster.stderr("waiter")
        time.sleep(0.05)
    cluster.add_worker()
    expect_line(waiter, "placed")
    assert finish(waiter, cluster, "waiter").split() == ["ok"]
    err = cluster.stderr("waiter")
    assert err.count("\n") <= 1 and "\r" in err and "devices placed" in err, repr(err)
    lines = cluster.status().events
    joined = next(i for i, line in enumerate(lines) if "registered" in line and "w1 " in line)
    assert "placed on 1 device" in lines[joined + 1]  # in the same step as the registration
    cluster.signal("release-holder")
    assert finish(holder, cluster, "holder") == ""


# ---------------------------------------------------------------- preemption and resume

LOW = """
    os.environ["DTORCH_TIMEOUT"] = "2"  # its frozen wait below is longer: devices, not workers (the queue's bound)
    dtorch.connect(name="low", priority="low")
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    w = torch.randn(16, 16) / 4
    x = torch.randn(32, 16)
    dw = dtorch.distribute_tensor(w, mesh, [Replicate()])
    dx = dtorch.distribute_tensor(x, mesh, [Shard(0)])
    for _ in range(5):
        dx = torch.tanh(dx @ dw)
        x = torch.tanh(x @ w)
    assert torch.allclose(dx.to_torch(), x, atol=1e-5)
    say("phase1")
    wait_for("low-phase2")
    for _ in range(5):  # submitted while frozen: held by the controller, the sync waits for the resume
        dx = torch.tanh(dx @ dw)
        x = torch.tanh(x @ w)
    t0 = time.monotonic()
    assert torch.allclose(dx.to_torch(), x, atol=1e-5)
    say(f"ok waited {time.monotonic() - t0:.1f}")
"""

HIGH = """
    dtorch.connect(name="high", priority="high")
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    y = dtorch.full((8, 4), 3.0, device_mesh=mesh, placements=[Shard(0)])
    assert torch.equal((y + 1).to_torch(), torch.full((8, 4), 4.0))
    say("placed")
    wait_for("high-finish")
    assert torch.equal((y * y).sum().to_torch(), torch.tensor(288.0))
    say("ok")
"""


WINDOWED = """
    dtorch.connect(name="windowed")
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    w, x = torch.randn(1024, 1024) / 32, torch.randn(1024, 1024)
    dw = dtorch.distribute_tensor(w, mesh, [Replicate()])
    dx = dtorch.distribute_tensor(x, mesh, [Shard(0)])
    for _ in range(20):  # the stream flushes every 5 ms: a batch per matmul, faster than the workers run them
        dx = torch.tanh(dx @ dw)
        x = torch.tanh(x @ w)
        time.sleep(0.005)
    assert torch.allclose(dx.to_torch(), x, atol=1e-5)
    say("ok")
"""


def test_with_a_dispatch_window_batches_go_out_as_real_workers_report_and_the_results_are_torchs(make_cluster):
    """The controller's default window (`--dispatch-ahead 1`, pipeline rule 7): each batch waits for a real worker's
    report of the one before it."""
    cluster = make_cluster(2)
    client = cluster.client("windowed", WINDOWED)
    assert finish(client, cluster, "windowed").split() == ["ok"]


def test_high_priority_freezes_low_priority_which_resumes_and_finishes_correctly(make_cluster):
    cluster = make_cluster(2, "--policy", "priority")
    low = cluster.client("low", LOW)
    expect_line(low, "phase1")
    high = cluster.client("high", HIGH)
    expect_line(high, "placed")
    st = cluster.status()
    states = {s.name: s.schedule for s in st.sessions}
    assert states == {"low": "frozen", "high": "running"}, states
    assert all(list(w.leases.values()) == [0] and len(w.leases) == 1 for w in st.workers)  # high holds both
    cluster.signal("low-phase2")
    time.sleep(3.5)  # longer than low's DTORCH_TIMEOUT: a frozen sync raised a TimeoutError after it (protocol 1.13)
    assert low.poll() is None  # frozen: its sync cannot finish while high holds the devices
    assert {s.name: s.schedule for s in cluster.status().sessions}["low"] == "frozen"
    cluster.signal("high-finish")
    assert finish(high, cluster, "high").split() == ["ok"]
    out = finish(low, cluster, "low").split()
    assert out[:2] == ["ok", "waited"] and float(out[2]) >= 3.0, out
    shown = cluster.stderr("low")  # where the sync stood while it waited, then how it ended, on one line
    assert re.search(r"dtorch: sync point waiting \d+s: the session is frozen \(preempted\); it resumes when its "
                     r"devices free up", shown), shown
    assert "\rdtorch: sync point done after " in shown, shown
    events = cluster.status().events
    assert any("(low) frozen on 2 devices: preempted by session" in line and "(high)" in line for line in events)
    assert any("resumed on 2 devices" in line for line in events)


def test_a_frozen_session_relocates_onto_workers_that_join_and_finishes_correctly(make_cluster):
    cluster = make_cluster(2, "--policy", "priority", "--policy-param", "relocate_after=0")
    low = cluster.client("low", LOW)
    expect_line(low, "phase1")
    high = cluster.client("high", HIGH)
    expect_line(high, "placed")
    cluster.signal("low-phase2")  # low's next batches are held while it is frozen
    time.sleep(0.5)
    assert {s.name: s.schedule for s in cluster.status().sessions}["low"] == "frozen"
    cluster.add_worker()
    cluster.add_worker()  # two free workers: low need not wait for high, its shards move there
    out = finish(low, cluster, "low").split()  # values equal plain torch after the move
    assert out[:2] == ["ok", "waited"], out
    assert high.poll() is None  # high still holds low's old devices
    st = cluster.status()
    high_workers = {w.worker for w in st.workers if any(s for s in w.leases if s.startswith(_session(st, "high")))}
    events = st.events
    assert any("relocates 2 devices off the devices it was preempted from" in line for line in events), events
    assert any("resumed on 2 devices" in line for line in events)
    assert len(high_workers) == 2
    cluster.signal("high-finish")
    assert finish(high, cluster, "high").split() == ["ok"]


def _session(st: m.StatusReply, name: str) -> str:
    return next(s.session for s in st.sessions if s.name == name)


# ---------------------------------------------------------------- an elastic session grows

ELASTIC = """
    dtorch.connect(name="elastic", min_devices=1)  # elastic: starts on one device, grows when more join
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    a = torch.randn(16, 8)
    da = dtorch.distribute_tensor(a, mesh, [Shard(0)])
    db = da * 2 + 1
    assert torch.allclose(db.to_torch(), a * 2 + 1)
    say("running")
    wait_for("grown")
    assert torch.allclose((db @ da.T).to_torch(), (a * 2 + 1) @ a.T, atol=1e-4)  # shards moved, values kept
    say("ok")
"""


def test_an_elastic_session_grows_onto_a_worker_that_joins(make_cluster):
    cluster = make_cluster(1)
    proc = cluster.client("elastic", ELASTIC)
    expect_line(proc, "running")
    (s,) = cluster.status().sessions
    assert len(set(s.devices.values())) == 1
    cluster.add_worker()
    joined = time.monotonic()
    st = cluster.wait(lambda st: len({w for x in st.sessions for w in x.devices.values()}) == 2,
                      "the session to spread onto the new worker", limit=30)
    grew_s = time.monotonic() - joined
    assert all(w.leases == {s.session: 0} for w in st.workers)
    assert any("grows: logical [1]" in line for line in st.events)
    cluster.signal("grown")
    assert finish(proc, cluster, "elastic").split() == ["ok"]
    print(f"grew onto the new worker {grew_s:.1f}s after it was started (includes the worker's start-up)")


# ---------------------------------------------------------------- an elastic session is shrunk, then grows back

SHRINKING = """
    dtorch.connect(name="elastic", priority="low", min_devices=2)  # elastic: may run on 2 of its 4 devices
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2, 3])
    torch.manual_seed(0)
    w = torch.randn(16, 16) / 4
    x = torch.randn(32, 16)
    dw = dtorch.distribute_tensor(w, mesh, [Replicate()])
    dx = dtorch.distribute_tensor(x, mesh, [Shard(0)])

    def steps():
        global dx, x
        for _ in range(3):
            dx = torch.tanh(dx @ dw)
            x = torch.tanh(x @ w)
        assert torch.allclose(dx.to_torch(), x, atol=1e-5)

    steps()
    say("running")
    wait_for("shrunk")
    steps()  # on 2 workers, two logical devices each (virtual devices)
    say("ran-shrunk")
    wait_for("grown")
    steps()  # on 4 workers again
    say("ok")
"""


def test_an_elastic_session_is_shrunk_instead_of_frozen_and_grows_back_with_torch_results(make_cluster):
    # the default policy (dtorch) shrinks elastic sessions before it freezes anyone; neither sessions nor workers
    # are expired here (4 workers and 2 clients on a loaded machine: a keepalive or a report may come late)
    cluster = make_cluster(4, "--session-timeout", "60", "--heartbeat-timeout", "30")
    elastic = cluster.client("elastic", SHRINKING)
    expect_line(elastic, "running")
    (s,) = cluster.status().sessions
    assert len(set(s.devices.values())) == 4
    high = cluster.client("high", HIGH)
    expect_line(high, "placed")
    st = cluster.wait(lambda st: len({w for x in st.sessions if x.name == "elastic" for w in x.devices.values()})
                      == 2, "the elastic session's devices to move onto the 2 workers it keeps")
    states = {x.name: x.schedule for x in st.sessions}
    assert states == {"elastic": "running", "high": "running"}, states  # shrunk, not frozen
    kept = {w for x in st.sessions if x.name == "elastic" for w in x.devices.values()}
    high_workers = {w for x in st.sessions if x.name == "high" for w in x.devices.values()}
    assert len(high_workers) == 2 and not kept & high_workers
    assert any("shrinks to 2 devices (4 logical)" in line for line in st.events), st.events
    cluster.signal("shrunk")
    expect_line(elastic, "ran-shrunk")  # values equal plain torch on the 2 workers
    cluster.signal("high-finish")
    assert finish(high, cluster, "high").split() == ["ok"]
    st = cluster.wait(lambda st: len({w for x in st.sessions if x.name == "elastic" for w in x.devices.values()})
                      == 4, "the elastic session to grow back onto 4 workers")
    assert any("grows: logical" in line for line in st.events), st.events
    cluster.signal("grown")
    assert finish(elastic, cluster, "elastic").split() == ["ok"]
