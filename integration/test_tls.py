"""TLS on every channel, with certificates made by the test (`_certs.py`): a controller, two workers and a client
started with their CLIs. Clients check the servers (server TLS); the controller and workers check each other
(mutual TLS, on ports of their own). A wrong CA, a missing client certificate, a certificate from another CA and
cleartext are each refused with one line.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from _certs import CA

from _helpers import Keys, start_controller, start_worker, stop_all
from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m
from dtorch_protocol.tls import Tls

WAIT_S = 60.0

CLIENT = textwrap.dedent("""
    import torch, dtorch
    from dtorch import Replicate, Shard
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = torch.arange(24.0).reshape(6, 4)
    d = dtorch.distribute_tensor(x, mesh, [Shard(0)])
    y = (d @ d.T).redistribute(mesh, [Replicate()])
    print("same" if torch.equal(y.to_torch(), x @ x.T) else "DIFFERENT", flush=True)
""")


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    ca, rogue = CA(tmp / "ca"), CA(tmp / "rogue", "rogue-ca")
    keys = Keys.make(tmp)
    controller_cert = ca.leaf("controller")
    env = keys.env(keys.admin)
    controller, addresses = start_controller(tmp / "addr", env, "--worker-listen", "127.0.0.1:0",
                                             *controller_cert.args(ca.path), log=tmp / "controller.log",
                                             limit=WAIT_S)
    address, worker_address = addresses.splitlines()
    procs = [controller]
    try:
        for i in range(2):
            cert = ca.leaf(f"worker{i}")
            procs.append(start_worker(worker_address, keys.env(keys.worker), *cert.args(ca.path),
                                      log=tmp / f"worker{i}.log"))
        admin = wire.Stub("dtorch.Controller", address, keys.admin, tls=Tls.load(ca=str(ca.path), env=False))
        deadline = time.monotonic() + WAIT_S
        while sum(w.state == "alive" for w in admin.call("Status", m.StatusRequest(), timeout=10).workers) < 2:
            assert time.monotonic() < deadline, (tmp / "worker0.log").read_text()
            time.sleep(0.1)
        yield {"tmp": tmp, "ca": ca, "rogue": rogue, "keys": keys, "address": address,
               "worker_address": worker_address, "admin": admin}
        admin.close()
    finally:
        stop_all(procs)


def _client(cluster, ca_path) -> subprocess.CompletedProcess:
    keys = cluster["keys"]
    env = keys.env(keys.alice, DTORCH_CONTROLLER=cluster["address"], DTORCH_TLS_CA=str(ca_path))
    return subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=120)


def test_a_computation_over_tls_matches_torch(tls_cluster):
    out = _client(tls_cluster, tls_cluster["ca"].path)
    assert out.returncode == 0 and out.stdout.strip() == "same", out.stderr[-2000:]
    workers = tls_cluster["admin"].call("Status", m.StatusRequest(), timeout=10).workers
    # clients are told the workers' server-TLS ports, not the mutual-TLS ones the controller and peers use
    assert all(w.address != tls_cluster["worker_address"] for w in workers)


def test_a_client_trusting_another_ca_is_refused_in_one_line(tls_cluster):
    from dtorch.session import Session

    with pytest.raises(ConnectionError) as err:
        Session(tls_cluster["address"], tls_cluster["keys"].alice,
                tls=Tls.load(ca=str(tls_cluster["rogue"].path), env=False))
    assert str(err.value).startswith("TLS handshake with") and "not signed by the CA given" in str(err.value)
    assert "\n" not in str(err.value)


def test_cleartext_is_refused_by_a_tls_controller(tls_cluster):
    stub = wire.Stub("dtorch.Controller", tls_cluster["address"], tls_cluster["keys"].admin)
    with pytest.raises(ConnectionError):
        stub.call("Status", m.StatusRequest(), timeout=5)
    stub.close()


def test_workers_must_come_over_mutual_tls(tls_cluster):
    """The worker port wants a certificate signed by the cluster CA; the client port takes no worker calls."""
    ca, rogue, keys = tls_cluster["ca"], tls_cluster["rogue"], tls_cluster["keys"]
    register = m.RegisterWorker(hello=wire.hello("worker"), address="127.0.0.1:9", device_type="cpu",
                                memory_bytes=0, secret=auth.new_worker_secret())
    stranger, member = rogue.leaf("stranger"), ca.leaf("member")
    for tls in (Tls.load(ca=str(ca.path), env=False),  # no certificate: the handshake fails (TLS 1.3: socket closed)
                Tls.load(str(stranger.cert), str(stranger.key), str(ca.path), env=False)):  # another CA's
        refused = wire.Stub("dtorch.Controller", tls_cluster["worker_address"], keys.worker, tls=tls)
        with pytest.raises(ConnectionError):
            refused.call("Register", register, timeout=5)
        refused.close()
    accepted = wire.Stub("dtorch.Controller", tls_cluster["worker_address"], keys.worker,
                         tls=Tls.load(str(member.cert), str(member.key), str(ca.path), env=False))
    assert accepted.call("Register", register, timeout=5).worker  # the same call with a cluster certificate
    accepted.close()
    client_port = wire.Stub("dtorch.Controller", tls_cluster["address"], keys.worker,
                            tls=Tls.load(ca=str(ca.path), env=False))
    with pytest.raises(PermissionError, match="must come over mutual TLS"):
        client_port.call("Register", register, timeout=5)
    client_port.close()


def test_a_workers_cluster_port_wants_a_certificate(tls_cluster):
    """Execute and peer calls reach a worker only over mutual TLS, and then only with the controller's token."""
    ca, rogue = tls_cluster["ca"], tls_cluster["rogue"]
    log = (tls_cluster["tmp"] / "worker0.log").read_text()
    cluster_port = log.split("listening on ", 1)[1].split()[0]  # the address the worker registered
    execute = m.Execute(seq=10**6, session="x", cmds=[])
    for tls in (Tls.load(ca=str(ca.path), env=False),
                Tls.load(str(rogue.leaf("intruder").cert), str(rogue.directory / "intruder.key"), str(ca.path),
                         env=False)):
        stub = wire.Stub("dtorch.Worker", cluster_port, "ctl1.0", tls=tls)
        with pytest.raises(ConnectionError):
            stub.call("Execute", execute, timeout=5)
        stub.close()
    member = ca.leaf("member")  # a certificate of the cluster is not enough: Execute needs the controller's token
    stub = wire.Stub("dtorch.Worker", cluster_port, "ctl1.0",
                     tls=Tls.load(str(member.cert), str(member.key), str(ca.path), env=False))
    with pytest.raises(PermissionError, match="wrong execute token"):
        stub.call("Execute", execute, timeout=5)
    stub.close()


def test_tls_settings_are_checked_at_start(tmp_path):
    ca = CA(tmp_path / "ca")
    leaf = ca.leaf("controller")
    keys = Keys.make(tmp_path)
    no_worker_port = subprocess.run([sys.executable, "-m", "dtorch_controller", "--listen", "127.0.0.1:0",
                                     *leaf.args(ca.path)], env=keys.env(keys.admin), capture_output=True, text=True,
                                    timeout=60)
    assert no_worker_port.returncode == 2 and "--worker-listen" in no_worker_port.stderr
    with pytest.raises(ValueError, match="both a certificate and its key"):
        Tls.load(cert=str(leaf.cert), env=False)
    (tmp_path / "not.pem").write_text("hello")
    with pytest.raises(ValueError, match="is not PEM"):
        Tls.load(ca=str(tmp_path / "not.pem"), env=False)
