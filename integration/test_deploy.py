"""deploy/: the Kubernetes manifests validate against Kubernetes' own schemas (offline, `kubernetes-validate`),
agree with each other and with the image, and the programs they start do what they say: the controller and a
worker node run with the manifests' own command lines (as the kubelet expands them), the workers register with
the node name Kubernetes gives the pod (their key trusts the label: `--node '*'`), and both answer the standard
gRPC health service."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from _helpers import stop_all
from dtorch_protocol import health, wire
from dtorch_protocol import messages as m

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests promise (gRPC probes are GA since 1.27)


def resources() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def by_kind(kind: str, name: str) -> dict:
    return next(d for d in resources() if d["kind"] == kind and d["metadata"]["name"] == name)


def container(kind: str, name: str) -> dict:
    (c,) = by_kind(kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def test_every_manifest_is_valid_for_kubernetes():
    docs = resources()
    assert {d["kind"] for d in docs} == {"Namespace", "Deployment", "Service", "DaemonSet"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises naming the bad field


def test_a_broken_manifest_is_refused():
    """The validation bites: a probe port written as text, and a misspelled field."""
    doc = by_kind("Deployment", "dtorch-controller")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    doc = by_kind("DaemonSet", "dtorch-worker")
    doc["spec"]["template"]["spec"]["nodeSelektor"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_manifests_agree_with_each_other_and_the_image():
    service, deployment = by_kind("Service", "dtorch-controller"), by_kind("Deployment", "dtorch-controller")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container("Deployment", "dtorch-controller")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports.keys()
    worker = container("DaemonSet", "dtorch-worker")
    assert f"--controller={service['metadata']['name']}:{service['spec']['ports'][0]['port']}" in worker["args"]
    scripts = {ep.name for ep in entry_points(group="console_scripts") if ep.value.startswith("dtorch_")}
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for c in (container("Deployment", "dtorch-controller"), worker):
        assert c["command"][0] in scripts
        assert c["image"] in {i["name"] for i in kustomization["images"]}
        declared = {p["containerPort"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] in declared
        for env in c["env"]:  # every Secret the pods need is one the operator's guide says how to make
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            assert ref is None or ref["name"] in (DEPLOY / "README.md").read_text()
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            assert (ROOT / line.split()[1]).exists(), line


def _kubelet_args(c: dict, env: dict[str, str]) -> list[str]:
    """The container's command line as the kubelet runs it: $(VAR) replaced by the container's variables."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda mt: env[mt.group(1)], a) for a in c["args"]]


def _free_ports(n: int) -> int:
    """A port p with p..p+n-1 free on the loopback (the node's workers take consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _localize(args: list[str], replace: dict[str, str]) -> list[str]:
    """Loopback only here: the manifests' ports and wildcard hosts become free loopback ones."""
    out = []
    for a in args:
        for old, new in replace.items():
            a = a.replace(old, new)
        out.append(a)
    return out


def _wait(pred, limit: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < deadline, f"not within {limit:g}s: {what}"
        time.sleep(0.1)


def _serving(address: str, service: str = "") -> bool:
    try:
        return health.check(address, service, timeout=2.0) == "SERVING"
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _key(keys: Path, role: str, *extra: str) -> str:
    """A key made the way deploy/README.md tells the operator to."""
    line = " ".join(["dtorch-controller keys create --keys keys.json --role", role, *(
        f"'{a}'" if a == "*" else a for a in extra)])
    assert line in (ROOT / "deploy" / "README.md").read_text(), line
    out = subprocess.run([sys.executable, "-m", "dtorch_controller", "keys", "create", "--keys", str(keys),
                          "--role", role, *extra], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_the_manifests_command_lines_run_a_cluster_whose_workers_share_their_pods_node(tmp_path):
    keys = tmp_path / "keys.json"  # the Secret dtorch-keys, mounted where the manifest says
    admin, worker_key = _key(keys, "admin"), _key(keys, "worker", "--node", "*")
    controller_port, worker_port = _free_ports(1), _free_ports(2)
    manifest_env = {e["name"]: e["value"] for e in container("Deployment", "dtorch-controller")["env"] if "value" in e}
    controller_env = {"DTORCH_KEYS": str(keys)}
    assert manifest_env["DTORCH_KEYS"].startswith(
        container("Deployment", "dtorch-controller")["volumeMounts"][0]["mountPath"] + "/")
    controller_args = _localize(_kubelet_args(container("Deployment", "dtorch-controller"), controller_env),
                                {"0.0.0.0:50051": f"127.0.0.1:{controller_port}"})
    worker_env = {"POD_IP": "127.0.0.1", "NODE_NAME": "gpu-node-7", "DTORCH_API_KEY": worker_key}
    worker_args = _localize(_kubelet_args(container("DaemonSet", "dtorch-worker"), worker_env), {
        "0.0.0.0:50061": f"127.0.0.1:{worker_port}", ":50061": f":{worker_port}",
        "dtorch-controller:50051": f"127.0.0.1:{controller_port}",
        "cuda:all": "cpu,cpu"})  # no GPU here: two CPU devices stand in for the node's GPUs
    env = {**os.environ, **controller_env, **worker_env}
    procs = [subprocess.Popen([sys.executable, "-m", "dtorch_controller", *controller_args], env=env,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "controller.log").open("wb"))]
    address = f"127.0.0.1:{controller_port}"
    try:
        _wait(lambda: _serving(address), what="controller healthy")
        assert _serving(address, "liveness") and _serving(address, "dtorch.Controller")
        procs.append(subprocess.Popen([sys.executable, "-m", "dtorch_worker", *worker_args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=(tmp_path / "worker.log").open("wb")))
        stub = wire.Stub("dtorch.Controller", address, admin)

        def workers() -> list[m.WorkerStatus]:
            return stub.call("Status", m.StatusRequest(), timeout=5).workers

        _wait(lambda: len(workers()) == 2, what="two workers registered: " + (tmp_path / "worker.log").read_text())
        assert sorted((w.address, w.node) for w in workers()) == [  # one node: the name Kubernetes gave it
            (f"127.0.0.1:{worker_port + i}", "gpu-node-7") for i in range(2)]
        for i in range(2):
            _wait(lambda i=i: _serving(f"127.0.0.1:{worker_port + i}"), what=f"worker {i} ready")
        stub.close()
        procs[1].send_signal(signal.SIGTERM)  # the kubelet stopping the pod: every worker of the node goes
        assert procs[1].wait(30) == 0
        assert not _serving(f"127.0.0.1:{worker_port}", "liveness")
    finally:
        stop_all(reversed(procs))
