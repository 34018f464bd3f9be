"""Registration and the report loop, in-process and as a real `python -m dtorch_worker` against a fake controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dtorch_protocol import auth, wire
from dtorch_protocol.messages import (
    CmdCreate,
    CmdRun,
    Execute,
    Registered,
    RegisterWorker,
    ReportReply,
    ShardStats,
    WorkerReport,
)
from dtorch_worker.agent import EXIT_FENCED, EXIT_LOST, Agent, ControllerUnreachable
from dtorch_worker.executor import Executor
from dtorch_worker.store import TensorStore

KEY = auth.new_key()[1]  # the worker key this fake controller accepts


def authenticate(credential: str) -> auth.Caller:
    if credential != KEY:
        raise auth.Unauthenticated("not the worker key")
    return auth.Caller(auth.WORKER, key_id=credential.split("_")[1])


class FakeController:
    """Just enough of dtorch.Controller: Register and Report, recorded for the test to inspect."""

    def __init__(self, heartbeat_s: float = 0.2) -> None:
        self.heartbeat_s = heartbeat_s
        self.registered: list[RegisterWorker] = []
        self.reports: list[WorkerReport] = []
        self.fenced = False
        self.cond = threading.Condition()

    def Register(self, request: RegisterWorker, caller: auth.Caller) -> Registered:
        wire.check_hello(request.hello)
        with self.cond:
            self.registered.append(request)
            self.cond.notify_all()
        return Registered(worker=f"w{len(self.registered)}", heartbeat_interval_s=self.heartbeat_s)

    def Report(self, request: WorkerReport, caller: auth.Caller) -> ReportReply:
        with self.cond:
            self.reports.append(request)
            self.cond.notify_all()
        return ReportReply(ok=False, message="fenced") if self.fenced else ReportReply(ok=True)

    def wait_for(self, pred: Callable[[], bool], timeout: float = 30.0) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def __getattr__(self, name: str) -> Callable[..., object]:
        if name in wire.SERVICES["dtorch.Controller"]:
            def refuse(_request: object, _caller: object) -> object:
                raise wire.RemoteError(f"{name} is not implemented by the fake controller")
            return refuse
        raise AttributeError(name)


@pytest.fixture
def controller() -> Iterator[tuple[FakeController, str, object]]:
    fake = FakeController()
    served = wire.serve("dtorch.Controller", fake, authenticate)
    yield fake, served.address, served.server
    served.server.stop(0)


# ---------------------------------------------------------------- in-process agent


def test_register_fails_clearly_when_the_controller_is_unreachable() -> None:
    agent = Agent("127.0.0.1:1", KEY, Executor(TensorStore()), TensorStore(), on_exit=lambda c, r: None)
    with pytest.raises(ControllerUnreachable, match="cannot register with the controller at 127.0.0.1:1 after 2"):
        agent.register("127.0.0.1:2", "cpu", 0, {}, attempts=2, delay_s=0.01)
    agent.stop()


def test_a_deferred_completion_is_reported_without_waiting_for_the_heartbeat(controller: tuple) -> None:
    fake, address, _server = controller
    fake.heartbeat_s = 30.0  # a report before then comes from the deferred poke's lag bound
    store = TensorStore()
    ex = Executor(store)
    agent = Agent(address, KEY, ex, store, on_exit=lambda c, r: None, secret=auth.new_worker_secret())
    ex.on_complete, ex.on_deferred = agent.poke, agent.poke_later
    agent.register("127.0.0.1:9", "cpu", 123, {})
    agent.start()
    try:
        ex.submit(Execute(seq=1, session="s", cmds=[]))
        ex.submit(Execute(seq=2, session="s", cmds=[]))  # batch 1 is followed by one of its session: deferred
        ex.start()
        assert fake.wait_for(lambda: any(r.completed == 2 for r in fake.reports), timeout=10.0)
        agent.poke_later()  # nothing new: still one report within the lag, carrying what is done
        assert fake.wait_for(lambda: sum(r.completed == 2 for r in fake.reports) >= 2, timeout=10.0)
    finally:
        ex.stop()
        agent.stop()


def test_agent_reports_promptly_carries_errors_and_exits_when_the_controller_is_lost(controller: tuple) -> None:
    fake, address, server = controller
    fake.heartbeat_s = 5.0  # long: a prompt report must come from the completion poke, not the timer
    store = TensorStore()
    exits: list[tuple[int, str]] = []
    ex = Executor(store)
    secret = auth.new_worker_secret()
    agent = Agent(address, KEY, ex, store, on_exit=lambda c, r: exits.append((c, r)), lost_after_s=0.5,
                  report_timeout_s=0.5, secret=secret)
    ex.on_complete = agent.poke
    reg = agent.register("127.0.0.1:9", "cpu", 123, {"zone": "a"})
    assert reg.worker == "w1" and fake.registered[0].labels == {"zone": "a"}
    assert fake.registered[0].secret == secret  # the controller derives every credential for this worker from it
    agent.start()
    ex.start()
    ex.submit(Execute(seq=1, session="s", cmds=[
        CmdCreate(tid=1, dtype="float32", shape=[4], init="ones", boxes={0: [[0, 4]]}),
        CmdRun(op="aten.bogus.default", devices=[0], args=[], kwargs={}, outs=[2], src="u.py:1")]))
    assert fake.wait_for(lambda: any(r.completed == 1 for r in fake.reports), timeout=3.0)
    report = next(r for r in fake.reports if r.completed == 1)
    assert report.worker == "w1" and report.errors["s"][0].op == "aten.bogus.default"
    assert report.proof == auth.report_proof(secret)
    assert report.sessions == {"s": ShardStats(tensors=2, bytes=16)}
    server.stop(0)  # the controller goes away: the heartbeat timer must notice, not just pokes
    agent.heartbeat_s = 0.1
    agent.poke()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits and exits[0][0] == EXIT_LOST and "unreachable" in exits[0][1]
    ex.stop()
    agent.stop()


# ---------------------------------------------------------------- the real process


def spawn(address: str, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, DTORCH_API_KEY=KEY)
    return subprocess.Popen([sys.executable, "-m", "dtorch_worker", "--controller", address, "--label", "rack=r1",
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_worker_process_registers_reports_executes_and_exits_when_fenced(controller: tuple) -> None:
    fake, address, _ = controller
    proc = spawn(address)
    try:
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line.startswith("dtorch-worker w1 on cpu listening on 127.0.0.1:"), line
        worker_address = line.rsplit(" ", 1)[1]
        reg = fake.registered[0]
        assert (reg.address, reg.device_type, reg.labels) == (worker_address, "cpu", {"rack": "r1"})
        assert reg.memory_bytes > 0
        assert fake.wait_for(lambda: len(fake.reports) >= 2)  # heartbeats
        stub = wire.Stub("dtorch.Worker", worker_address, auth.execute_token(reg.secret))
        stub.call("Execute", Execute(seq=1, session="s", cmds=[
            CmdCreate(tid=1, dtype="float32", shape=[8], init="zeros", boxes={0: [[0, 8]]})]))
        assert fake.wait_for(lambda: any(r.completed == 1 and r.sessions.get("s") == ShardStats(1, 32)
                                         for r in fake.reports))
        stub.close()
        fake.fenced = True
        assert proc.wait(timeout=30) == EXIT_FENCED
        assert "fenced" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_worker_process_exits_on_sigterm_or_its_parents_death_and_shows_stacks_on_sigusr1(controller: tuple) -> None:
    _fake, address, _ = controller
    parent = subprocess.Popen(["sleep", "60"])
    orphan = spawn(address, "--parent-pid", str(parent.pid))
    term = spawn(address)
    try:
        for proc in (orphan, term):
            assert proc.stdout.readline().startswith("dtorch-worker w")  # type: ignore[union-attr]
        parent.kill()
        parent.wait()
        assert orphan.wait(timeout=20) == 0
        term.send_signal(signal.SIGUSR1)  # every thread's stack to stderr; it goes on
        time.sleep(0.5)
        assert term.poll() is None
        term.send_signal(signal.SIGTERM)
        assert term.wait(timeout=20) == 0
        err = term.stderr.read()  # type: ignore[union-attr]
        assert err.count("(most recent call first)") >= 2 and "dtorch_worker/cli.py" in err, err
    finally:
        for proc in (parent, orphan, term):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_worker_process_refuses_to_start_without_a_controller() -> None:
    proc = spawn("127.0.0.1:1", "--register-attempts", "2")
    try:
        assert proc.wait(timeout=30) == 5
        assert "cannot register with the controller at 127.0.0.1:1" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_is_alive_at_once_and_ready_once_registered(controller: tuple) -> None:
    """The standard gRPC health service, asked without a token (Kubernetes probes and load balancers)."""
    from dtorch_protocol.health import check
    from dtorch_worker.server import start_worker

    handle = start_worker()
    try:
        assert check(handle.address, "liveness") == "SERVING"
        assert check(handle.address) == "NOT_SERVING"  # not registered with a controller yet
    finally:
        handle.stop(0.0)
    _fake, address, _ = controller
    proc = spawn(address)
    try:
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        worker_address = line.rsplit(" ", 1)[1]
        deadline = time.monotonic() + 10
        while check(worker_address) != "SERVING":  # registered: the worker is ready
            assert time.monotonic() < deadline, line
            time.sleep(0.05)
        assert check(worker_address, "dtorch.Worker") == "SERVING"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_node_of_several_devices_gives_each_worker_its_device_and_ports() -> None:
    from dtorch_worker import node

    assert node.expand("cuda:all", 3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert node.expand("cpu,cpu", 0) == ["cpu", "cpu"] and node.expand("cuda:1", 2) is None
    with pytest.raises(SystemExit, match="torch sees no CUDA device"):
        node.expand("cuda:all", 0)
    argv = node.child_argv(["--controller", "c:1", "--device", "cuda:all"], "cuda:2", 2, "0.0.0.0:50061",
                           "10.0.0.5:50061", 9400)
    assert argv[-8:] == ["--device", "cuda:2", "--listen", "0.0.0.0:50063", "--advertise", "10.0.0.5:50063",
                          "--metrics-port", "9402"]
def test_worker_process_needs_a_worker_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DTORCH_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "dtorch_worker", "--controller", "127.0.0.1:1"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no worker key: set DTORCH_API_KEY" in out.stderr


def test_worker_process_is_refused_with_a_wrong_key(controller: tuple) -> None:
    _fake, address, _ = controller
    env = dict(os.environ, DTORCH_API_KEY=auth.new_key()[1])
    out = subprocess.run([sys.executable, "-m", "dtorch_worker", "--controller", address], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "registration refused" in out.stderr and "not the worker key" in out.stderr


def test_worker_process_whose_advertised_host_is_not_its_own_says_so(controller: tuple) -> None:
    """The rendezvous store listens on the advertised host only: one that is not this machine's is one line."""
    _fake, address, _ = controller
    proc = spawn(address, "--advertise", "192.0.2.1:7000")  # TEST-NET-1: never an address of this machine
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "dtorch-worker: cannot listen for rendezvous on '192.0.2.1', the host this worker is reached at" in err
    assert "Traceback" not in err
