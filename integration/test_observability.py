"""Metrics scraped by a real Prometheus, and usage records, on a cluster of real processes.

A controller (with --metrics-port, --usage-file) and two workers (with --metrics-port) are started with their CLIs;
a tenant's program runs a known workload: MM matrix products on each of 2 workers, one read of a 16 KiB result,
then holds its 2 devices for HOLD_S seconds. A Prometheus server (the Debian `prometheus` binary; skipped with
one line where it is absent, `nox -s observability` installs it) scrapes the three endpoints, and its HTTP API
must return the values that workload produces. The usage records must add up to the device-time the program
really held (within 1%), and survive a controller restart (and a torn last line) without double counting.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from _helpers import CONTROLLER, Keys, start_controller, start_worker, stop_all
from dtorch_protocol import messages as m
from dtorch_protocol import wire

PROMETHEUS = shutil.which("prometheus")
WAIT_S = 90.0
MM = 6
HOLD_S = 3.0

WORKLOAD = textwrap.dedent("""
    import json, sys, time, dtorch
    from dtorch import Replicate, Shard
    dtorch.connect(name="metered")
    t0 = time.time()
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    w = dtorch.ones((64, 64), device_mesh=mesh, placements=[Replicate()])   # places the mesh: 2 devices
    t1 = time.time()
    x = dtorch.ones((64, 64), device_mesh=mesh, placements=[Shard(0)])
    for _ in range(MM):
        x = (x @ w) / 64                                                       # one mm on each worker
    assert x.to_torch().eq(1).all()                                           # 16 KiB read by the client
    time.sleep(HOLD)
    t2 = time.time()
    dtorch.shutdown()
    t3 = time.time()
    print(json.dumps({"times": [t0, t1, t2, t3]}), flush=True)
""").replace("MM", str(MM)).replace("HOLD", str(HOLD_S))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(ready, what: str, limit: float = WAIT_S):
    deadline = time.monotonic() + limit
    while True:
        got = ready()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.keys = Keys.make(tmp)
        self.usage = tmp / "usage.jsonl"
        self.ports = {"controller": free_port(), "w0": free_port(), "w1": free_port()}
        self.procs: list[subprocess.Popen] = []
        self.controller, self.address = self.start_controller("c1")
        for i in range(2):
            self.procs.append(start_worker(self.address, self.keys.env(self.keys.worker), "--metrics-port",
                                           str(self.ports[f"w{i}"]), log=tmp / f"w{i}.log"))
        self.admin = wire.Stub("dtorch.Controller", self.address, self.keys.admin)
        until(lambda: sum(w.state == "alive" for w in self.status().workers) == 2, "workers")

    def start_controller(self, name: str):
        proc, address = start_controller(self.tmp / f"{name}.addr", self.keys.env(self.keys.admin), "--metrics-port",
                                         str(self.ports["controller"]), "--usage-file", str(self.usage),
                                         "--usage-interval", "0.5", log=self.tmp / f"{name}.log", limit=WAIT_S)
        self.procs.append(proc)
        return proc, address

    def status(self) -> m.StatusReply:
        return self.admin.call("Status", m.StatusRequest(), timeout=10)

    def run_workload(self) -> list[float]:
        (self.tmp / "workload.py").write_text(WORKLOAD)
        out = subprocess.run([sys.executable, str(self.tmp / "workload.py")], capture_output=True, text=True,
                             timeout=WAIT_S, env=self.keys.env(self.keys.alice, DTORCH_CONTROLLER=self.address))
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])["times"]

    def close(self) -> None:
        self.admin.close()
        stop_all(self.procs[::-1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("observability"))
    try:
        c.times = c.run_workload()
        c.scraped = scrape(c, tmp_path_factory.mktemp("prometheus")) if PROMETHEUS else {}
    except BaseException:
        c.close()
        raise
    yield c
    c.close()


class Prometheus:
    """A real Prometheus server scraping the cluster every 0.5 s; `value(query)` through its HTTP API."""

    def __init__(self, tmp: Path, targets: list[int]) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(textwrap.dedent(f"""
            global: {{scrape_interval: 500ms, scrape_timeout: 400ms}}
            scrape_configs:
              - job_name: dtorch
                static_configs: [{{targets: {json.dumps([f"127.0.0.1:{p}" for p in targets])}}}]
        """))
        self.log = open(tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def query(self, q: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                reply = json.load(r)
        except OSError:
            return []
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def value(self, q: str) -> float | None:
        result = self.query(q)
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


QUERIES = {
    "up": 'count(up{job="dtorch"} == 1)',
    "mm": 'sum(dtorch_worker_op_seconds_count{op="aten.mm.default"})',
    "client_out": 'sum(dtorch_worker_moved_bytes_total{path="client",direction="out"})',
    "batches": "sum(dtorch_worker_batches_total)",
    "capacity": "min(dtorch_worker_memory_capacity_bytes)",
    "alive": 'dtorch_controller_workers{state="alive"}',
    "lost": 'dtorch_controller_workers{state="lost"}',
    "instructions": "dtorch_controller_instructions_total",
    "syncs": 'dtorch_controller_request_seconds_count{method="Sync"}',
    "submits": 'dtorch_controller_request_seconds_count{method="Submit"}',
    "waits": "dtorch_controller_queue_wait_seconds_count",
    "queue": "dtorch_controller_queue_length",
    "held": 'dtorch_controller_tenant_device_seconds_total{tenant="alice"}',
    "moved": 'dtorch_controller_tenant_moved_bytes_total{tenant="alice"}',
}


def scrape(cluster: Cluster, tmp: Path) -> dict[str, float | None]:
    """Every query's value once Prometheus has scraped the workload (done while the first controller runs)."""
    prom = Prometheus(tmp, list(cluster.ports.values()))
    try:
        until(lambda: prom.value(QUERIES["up"]) == 3, "prometheus to scrape all three targets")
        until(lambda: prom.value(QUERIES["mm"]), "op histograms")
        return {name: prom.value(q) for name, q in QUERIES.items()}
    finally:
        prom.close()


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus; "
                                               "`nox -s observability` installs it)")
def test_a_real_prometheus_scrapes_the_values_a_known_workload_produces(cluster):
    v = cluster.scraped
    # the workers: MM matrix products each, the client's read of 64 x 64 float32 = 16 KiB
    assert v["mm"] == 2 * MM and v["client_out"] == 64 * 64 * 4
    assert v["batches"] >= 2 and v["capacity"] > 0
    # the controller: its two workers, the program's Submits and Syncs, its wait (none) and device-time
    assert v["alive"] == 2 and v["lost"] == 0
    assert v["instructions"] >= MM * 2 + 2  # mm and div per step, creates
    assert v["syncs"] >= 1 and v["submits"] >= 1
    assert v["waits"] == 1 and v["queue"] == 0  # one mesh, placed at once
    t0, t1, t2, t3 = cluster.times
    assert 2 * (t2 - t1) * 0.99 <= v["held"] <= 2 * (t3 - t0) * 1.01
    assert v["moved"] >= 64 * 64 * 4


def usage(cluster: Cluster, *args: str) -> list[dict]:
    out = subprocess.run([*CONTROLLER, "usage", "--usage-file", str(cluster.usage), "--format", "json", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_usage_records_add_up_to_the_device_time_held_and_survive_a_restart(cluster):
    """Within 1% of what the program held: from its mesh's placement to its close, on 2 devices."""
    t0, t1, t2, t3 = cluster.times
    records = until(lambda: [json.loads(line) for line in cluster.usage.read_text().splitlines()
                             if '"final":true' in line and '"tenant":"alice"' in line], "the session's last record")
    (alice,) = usage(cluster, "--by", "tenant")
    assert alice["tenant"] == "alice" and alice["sessions"] == 1 and alice["devices"] == 2
    assert 2 * (t2 - t1) * 0.99 <= alice["device_seconds"] <= 2 * (t3 - t0) * 1.01, (alice, cluster.times)
    assert alice["moved_bytes"] >= 64 * 64 * 4 and alice["instructions"] >= MM * 2 + 2
    assert alice["memory_byte_seconds"] > 0 and len(records) == 1
    # a restart: the old controller's last records stay, a torn line is dropped, nothing counts twice
    stop_all([cluster.controller])
    with open(cluster.usage, "a") as f:
        f.write('{"run":"x","seq":1,"tenant":"alice","device_se')
    controller, address = cluster.start_controller("c2")
    bob = wire.Stub("dtorch.Controller", address, cluster.keys.bob)
    sid = bob.call("OpenSession", m.OpenSession(hello=wire.hello("client"), name="after"), timeout=10).session
    assert bob.call("CloseSession", m.CloseSession(session=sid), timeout=10).ok
    bob.close()
    until(lambda: sid in cluster.usage.read_text(), "the new run's record")
    stop_all([controller])
    rows = {r["tenant"]: r for r in usage(cluster)}
    assert rows["alice"] == alice and rows["bob"]["sessions"] == 1 and rows["bob"]["device_seconds"] == 0
    assert all(line.endswith("}") for line in cluster.usage.read_text().splitlines())
