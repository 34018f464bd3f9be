"""Two tenants and an attacker on one cluster of real processes (a controller and two workers started with their
CLIs, the tenants' programs as separate processes). The victim (alice) computes while the attacker (bob, with a
tenant key of his own, and later a leaked worker key) tries every route that worked before keys and roles:
reading, overwriting, deleting and closing alice's work, admin actions, fencing workers, forged reports,
resource floods, NaN timeouts, reading freed memory. Each is refused with one clear line; alice's results are
exactly torch's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from _helpers import Keys, start_controller, start_worker, stop_all
from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m
from dtorch_worker.transfer import put_chunks

WAIT_S = 90.0
SECRET = 1234.5

VICTIM = textwrap.dedent("""
    import sys, time, torch, dtorch
    from pathlib import Path
    from dtorch import Replicate, Shard
    DIR = Path(sys.argv[1])
    dtorch.connect(name="alice-job", memory_cap=64 << 20)
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = torch.arange(64.0).reshape(8, 8)
    dx = dtorch.distribute_tensor(x, mesh, [Shard(0)])     # tensor 1 on both workers
    ws = [dtorch.full((4, 1000), SECRET, device_mesh=mesh, placements=[Shard(0)]) for _ in range(8)]
    guard = dtorch.ones((4, 1000), device_mesh=mesh, placements=[Shard(0)])  # keeps them off the heap's top
    guard.to_torch()
    del ws                                                 # freed: their bytes stay in the workers' allocators
    dtorch.runtime.get_session().sync()
    (DIR / "victim.sid.part").write_text(dtorch.runtime.get_session().id)
    (DIR / "victim.sid.part").rename(DIR / "victim.sid")  # whole or absent: the test reads it once it exists
    deadline = time.monotonic() + 90
    while not (DIR / "go").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    y = (dx @ dx.T + 1).redistribute(mesh, [Replicate()])
    print("same" if torch.equal(y.to_torch(), x @ x.T + 1) and torch.equal(dx.to_torch(), x) else "DIFFERENT",
          flush=True)
""").replace("SECRET", repr(SECRET))

ATTACKER = textwrap.dedent("""
    import torch, dtorch
    dtorch.connect(name="bob-job", memory_cap=64 << 20)
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    probe = dtorch.zeros((4, 1000), device_mesh=mesh, placements=[dtorch.Shard(0)])
    fresh = [torch.empty_like(probe) for _ in range(6)] + [probe.new_empty((4, 1000)) for _ in range(2)]
    leaked = [t.to_torch() for t in fresh]
    print(sum(int((t == SECRET).sum()) for t in leaked), flush=True)
""").replace("SECRET", repr(SECRET))


class Tenancy:
    """The cluster, alice's running program and what bob can reach."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.keys = Keys.make(tmp)
        self.controller, self.address = start_controller(tmp / "addr", self.keys.env(self.keys.admin),
                                                         log=tmp / "controller.log", limit=WAIT_S)
        self.procs = [self.controller]
        for i in range(2):
            self.procs.append(start_worker(self.address, self.keys.env(self.keys.worker), log=tmp / f"w{i}.log"))
        self.admin = wire.Stub("dtorch.Controller", self.address, self.keys.admin)
        self.bob = wire.Stub("dtorch.Controller", self.address, self.keys.bob)
        self._until(lambda: sum(w.state == "alive" for w in self.status().workers) == 2, "workers")
        (tmp / "victim.py").write_text(VICTIM)
        self.victim = subprocess.Popen([sys.executable, str(tmp / "victim.py"), str(tmp)], stdout=subprocess.PIPE,
                                       stderr=open(tmp / "victim.err", "w"), text=True,
                                       env=self.keys.env(self.keys.alice, DTORCH_CONTROLLER=self.address))
        self.procs.append(self.victim)
        self._until(lambda: (tmp / "victim.sid").exists(), "the victim to start")
        self.sid = (tmp / "victim.sid").read_text()
        self.workers = {w.worker: w for w in self.status().workers}

    def status(self) -> m.StatusReply:
        return self.admin.call("Status", m.StatusRequest(), timeout=10)

    def _until(self, ready, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready():
            if self.victim_failed():
                pytest.fail(f"the victim failed: {(self.tmp / 'victim.err').read_text()[-2000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def victim_failed(self) -> bool:
        victim = getattr(self, "victim", None)
        return victim is not None and victim.poll() not in (None, 0)

    def close(self) -> None:
        self.admin.close()
        self.bob.close()
        stop_all(self.procs[::-1])


@pytest.fixture
def cluster(tmp_path):
    c = Tenancy(tmp_path)
    yield c
    c.close()


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert text and "\n" not in text, text
    return text


def route_bob_sees_only_counts_of_alices_work(cluster):
    st = cluster.bob.call("Status", m.StatusRequest(), timeout=10)
    assert st.sessions == [] and st.workers == [] and st.events == []
    assert st.other_sessions == 1 and st.other_devices == 2 and st.other_workers == 2
    assert cluster.sid not in repr(st)


def route_bob_cannot_name_alices_session(cluster):
    """Suppose alice's session id leaked: to the controller it is still not bob's."""
    sid = cluster.sid
    for method, request in [("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrDelete(tids=[1])])),
                            ("Sync", m.Sync(session=sid, upto=0, timeout_s=0)),
                            ("OpenMesh", m.OpenMesh(session=sid, mesh=9, devices=[0], shape=[1]))]:
        with pytest.raises(wire.RemoteError) as err:
            cluster.bob.call(method, request, timeout=10)
        assert f"unknown session {sid[:16]!r}" in one_line(err)
    assert not cluster.bob.call("CloseSession", m.CloseSession(session=sid), timeout=10).ok
    assert not cluster.bob.call("KeepAlive", m.KeepAlive(session=sid), timeout=10).ok


def route_bob_cannot_read_write_or_run_anything_on_alices_workers(cluster):
    sid = cluster.sid
    bob_sid = cluster.bob.call("OpenSession", m.OpenSession(hello=wire.hello("client"), memory_cap=1 << 20),
                               timeout=10).session
    placed = cluster.bob.call("OpenMesh", m.OpenMesh(session=bob_sid, mesh=1, devices=[0], shape=[1]), timeout=10)
    address = placed.locations[0]
    own_cap = placed.caps[address]  # bob's capability: for his own session on that worker
    worker = wire.Stub("dtorch.Worker", address, own_cap)
    pull = m.PullRequest(session=sid, tid=1, device=0, timeout_s=0)
    with pytest.raises(PermissionError) as err:
        list(worker.stream("Pull", pull))
    assert f"Pull of session {sid[:16]!r} refused" in one_line(err)
    for credential in (cluster.keys.bob, "", own_cap.replace("client", "peer")):  # his key, nothing, a forgery
        with pytest.raises(PermissionError) as err:
            list(worker.stream("Pull", pull, credential=credential))
        one_line(err)
    with pytest.raises(PermissionError) as err:
        worker.send_stream("Put", put_chunks(sid, 1, 0, torch.zeros(4, 8)))
    assert "Put of session" in one_line(err)
    with pytest.raises(PermissionError) as err:  # PutShards: a peer's, never a client's
        worker.send_stream("PutShards", iter([m.ShardsChunk(namespace=sid)]))
    assert "PutShards needs peer credentials" in one_line(err)
    with pytest.raises(PermissionError) as err:  # Execute: the controller's only (a forged delete used to work)
        worker.call("Execute", m.Execute(seq=10**6, session=sid, cmds=[m.CmdDelete(tids=[1], devices=[0])]))
    assert "Execute needs controller credentials" in one_line(err)
    worker.close()


def route_bob_has_no_admin_actions(cluster):
    victim_worker = sorted(cluster.workers)[0]
    for method, request in [("Migrate", m.MigrateRequest(session=cluster.sid[:4], device=0, to_worker="w1")),
                            ("Drain", m.DrainRequest(worker=victim_worker))]:
        with pytest.raises(PermissionError) as err:
            cluster.bob.call(method, request, timeout=10)
        assert f"{method} needs admin credentials" in one_line(err)


def route_a_leaked_worker_key_cannot_fence_or_impersonate_a_worker(cluster):
    rogue = wire.Stub("dtorch.Controller", cluster.address, cluster.keys.worker)
    live = next(iter(cluster.workers.values()))
    takeover = m.RegisterWorker(hello=wire.hello("worker"), address=live.address, device_type="cpu",
                                memory_bytes=1 << 30, secret=auth.new_worker_secret(), labels={"node": "evil"})
    with pytest.raises(wire.Conflict) as err:  # used to fence the live worker, which then exited
        rogue.call("Register", takeover, timeout=10)
    assert f"belongs to live worker {live.worker}" in one_line(err)
    with pytest.raises(PermissionError) as err:  # a false op error injected into alice's session
        rogue.call("Report", m.WorkerReport(worker=live.worker, completed=0, errors={cluster.sid: [
            m.ErrorReport(op="aten.add.Tensor", src="x.py:1", message="injected")]}), timeout=10)
    assert f"Report for worker {live.worker} refused" in one_line(err)
    # a worker it registers elsewhere claims a node: the node comes from the key (none here), not the claim
    reg = rogue.call("Register", m.RegisterWorker(hello=wire.hello("worker"), address="127.0.0.1:9",
                                                  device_type="cpu", memory_bytes=0, secret=auth.new_worker_secret(),
                                                  labels={"node": "evil"}), timeout=10)
    assert next(w for w in cluster.status().workers if w.worker == reg.worker).node == "127.0.0.1"
    with pytest.raises(PermissionError) as err:
        rogue.call("OpenSession", m.OpenSession(hello=wire.hello("client")), timeout=10)
    assert "OpenSession needs admin or tenant credentials" in one_line(err)
    rogue.close()
    assert all(w.state == "alive" for w in cluster.status().workers if w.worker in cluster.workers)


def route_floods_and_malformed_requests_are_bounded(cluster):
    bob = cluster.bob
    sid = bob.call("OpenSession", m.OpenSession(hello=wire.hello("client"), memory_cap=1 << 20), timeout=10).session
    placed = bob.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0], shape=[1]), timeout=10)
    with pytest.raises(wire.ProtocolError) as err:  # 200,000 instructions in one Submit
        bob.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrDelete(tids=[1])] * 200_000), timeout=30)
    assert "instrs" in one_line(err)
    with pytest.raises(wire.ProtocolError) as err:
        bob.call("OpenSession", m.OpenSession(hello=wire.hello("client"), name="x" * 1000), timeout=10)
    assert "name" in one_line(err)
    address = placed.locations[0]
    worker = wire.Stub("dtorch.Worker", address, placed.caps[address])
    with pytest.raises(wire.ProtocolError) as err:  # a NaN timeout used to spin a worker thread
        list(worker.stream("Pull", m.PullRequest(session=sid, tid=1, device=0, timeout_s=float("nan"))))
    assert "timeout_s" in one_line(err)
    # Syncs and Pulls that wait: a handful per session, the rest refused at once
    bob.call("Submit", m.Submit(session=sid, seq=1, instrs=[m.InstrCreate(
        tid=1, spec=m.TensorSpec([1], "float32", 1, ["R"]), init="ones")]), timeout=10)
    outcomes: list[object] = []

    def pull() -> None:
        try:
            outcomes.append(list(worker.stream("Pull", m.PullRequest(session=sid, tid=99, device=0, timeout_s=3))))
        except Exception as e:  # noqa: BLE001
            outcomes.append(e)

    threads = [threading.Thread(target=pull) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    refused = [o for o in outcomes if isinstance(o, wire.LimitExceeded)]
    assert len(refused) >= 40 - 16 and "limit 16 per caller" in str(refused[0])
    worker.close()
    assert all(w.state == "alive" for w in cluster.status().workers if w.worker in cluster.workers)


def finish_victim_and_read_freed_memory(cluster):
    out = subprocess.run([sys.executable, "-c", ATTACKER], capture_output=True, text=True, timeout=WAIT_S,
                         env=cluster.keys.env(cluster.keys.bob, DTORCH_CONTROLLER=cluster.address))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0"  # empty_like used to hand back 99-100% of another tenant's freed values
    (cluster.tmp / "go").write_text("go")
    got, _ = cluster.victim.communicate(timeout=WAIT_S)
    assert cluster.victim.returncode == 0, (cluster.tmp / "victim.err").read_text()[-2000:]
    assert got.strip() == "same"


def test_an_attacker_is_refused_on_every_route_and_the_victim_is_untouched(cluster):
    """One story, in order: the routes run while alice's program waits mid-run, then she finishes."""
    route_bob_sees_only_counts_of_alices_work(cluster)
    route_bob_cannot_name_alices_session(cluster)
    route_bob_cannot_read_write_or_run_anything_on_alices_workers(cluster)
    route_bob_has_no_admin_actions(cluster)
    route_a_leaked_worker_key_cannot_fence_or_impersonate_a_worker(cluster)
    route_floods_and_malformed_requests_are_bounded(cluster)
    finish_victim_and_read_freed_memory(cluster)
