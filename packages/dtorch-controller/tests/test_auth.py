"""Every Controller RPC refuses a call with no credential, an empty one or a wrong one, and enforces its roles.

The calls go out raw (`wire.raw_call`) with a *valid* request for each method, so a method whose check were
skipped would answer something else than UNAUTHENTICATED / PERMISSION_DENIED. The method list comes from
`wire.SERVICES`: a new RPC without a sample here fails `test_every_method_has_a_sample`.
"""

from __future__ import annotations

import grpc
import pytest

from dtorch_controller.server import run_server
from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m

SERVICE = "dtorch.Controller"
METHODS = sorted(wire.SERVICES[SERVICE])
SAMPLES = {
    "OpenSession": m.OpenSession(hello=wire.hello("client")),
    "OpenMesh": m.OpenMesh(session="s", mesh=0, devices=[0], shape=[1]),
    "Submit": m.Submit(session="s", seq=1, instrs=[]),
    "Sync": m.Sync(session="s", upto=0, timeout_s=0.0),
    "CloseSession": m.CloseSession(session="s"),
    "KeepAlive": m.KeepAlive(session="s"),
    "Status": m.StatusRequest(),
    "Register": m.RegisterWorker(hello=wire.hello("worker"), address="127.0.0.1:1", device_type="cpu",
                                 memory_bytes=0, secret=auth.new_worker_secret()),
    "Report": m.WorkerReport(worker="w99", completed=0),
    "Drain": m.DrainRequest(worker="w99", timeout_s=0.0),
    "Migrate": m.MigrateRequest(session="s", device=0, to_worker="w99", timeout_s=0.0),
}


@pytest.fixture(scope="module")
def controller(module_keys):
    server, address = run_server("127.0.0.1:0", module_keys.authenticate)
    channel = wire.open_channel(address)
    yield channel, module_keys
    channel.close()
    server.stop(0)


def test_every_method_has_a_sample():
    assert set(SAMPLES) == set(METHODS)


def _bad_credentials(keys) -> dict[str, list[tuple[str, str]] | None]:
    never_issued = keys.alice[:-6] + "AAAAAA"  # alice's key id, another secret
    return {
        "none": None,
        "empty header": [(auth.HEADER, "")],
        "empty bearer": [(auth.HEADER, "Bearer ")],
        "other scheme": [(auth.HEADER, f"Basic {keys.admin}")],
        "malformed": [(auth.HEADER, "Bearer let-me-in")],
        "wrong secret": [(auth.HEADER, f"Bearer {never_issued}")],
        "unknown id": [(auth.HEADER, f"Bearer {auth.new_key()[1]}")],
    }


@pytest.mark.parametrize("method", METHODS)
def test_a_call_without_a_valid_credential_is_refused(controller, method):
    channel, keys = controller
    for name, metadata in _bad_credentials(keys).items():
        code, details = wire.raw_call(channel, SERVICE, method, wire.encode(SAMPLES[method]), metadata, timeout=5)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, name, code, details)
        assert details and "\n" not in details


@pytest.mark.parametrize("method", METHODS)
def test_each_method_takes_exactly_its_roles(controller, method):
    """Drain and Migrate are the admin's, Register and Report the workers', the rest the tenants' (and admin's)."""
    channel, keys = controller
    for role, key in ((auth.TENANT, keys.alice), (auth.ADMIN, keys.admin), (auth.WORKER, keys.worker)):
        code, details = wire.raw_call(channel, SERVICE, method, wire.encode(SAMPLES[method]), auth.bearer(key),
                                      timeout=5)
        if role in auth.ROLES[SERVICE][method]:
            assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), \
                (method, role, code, details)
        else:
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, role, code, details)
            assert f"{method} needs" in details and role in details


def test_oversized_and_malformed_requests_are_refused_before_the_core(controller):
    channel, keys = controller
    code, details = wire.raw_call(channel, SERVICE, "KeepAlive", b"\x81" + b"x" * (64 << 10), auth.bearer(keys.alice))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over the limit of 4096 bytes" in details
    nan = wire.encode(m.Sync(session="s", upto=0, timeout_s=float("nan")))
    code, details = wire.raw_call(channel, SERVICE, "Sync", nan, auth.bearer(keys.alice))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in details
    long_name = wire.encode(m.OpenSession(hello=wire.hello("client"), name="x" * 10_000))
    code, details = wire.raw_call(channel, SERVICE, "OpenSession", long_name, auth.bearer(keys.alice))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "name" in details
    big = wire.encode(m.Submit(session="s", seq=1, instrs=[m.InstrDelete(tids=[1])] * (m.MAX_SUBMIT_INSTRS + 1)))
    code, details = wire.raw_call(channel, SERVICE, "Submit", big, auth.bearer(keys.alice))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "instrs" in details


def test_a_workers_node_is_its_keys_unless_the_key_trusts_the_workers_own(tmp_path, register_worker):
    """`keys create --role worker --node rack7`: its workers are on rack7, whatever they claim; `--node '*'`: each
    names its own (Kubernetes' node name); no node: the claim is dropped (the host of the address counts)."""
    from dtorch_controller.keys import KeyFile, Keyring

    kf = KeyFile()
    keys = {node: kf.create(auth.WORKER, node=node)[1] for node in ("", "rack7", auth.ANY_NODE)}
    admin = kf.create(auth.ADMIN)[1]
    kf.write(tmp_path / "keys.json")
    server, address = run_server(keys=Keyring(tmp_path / "keys.json").authenticate)
    try:
        for i, key in enumerate(keys.values()):
            stub = wire.Stub("dtorch.Controller", address, key)
            register_worker(stub, f"10.0.0.{i}:7000", labels={"node": "claimed", "rack": "r"})
            stub.close()
        stub = wire.Stub("dtorch.Controller", address, admin)
        workers = stub.call("Status", m.StatusRequest()).workers
        stub.close()
        assert [(w.node, w.labels.get("node", ""), w.labels["rack"]) for w in workers] == [
            ("10.0.0.0", "", "r"), ("rack7", "rack7", "r"), ("claimed", "claimed", "r")]
    finally:
        server.stop(0)
