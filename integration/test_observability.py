"""Metrics scraped by a real Prometheus, and usage records, on a cluster of real processes.

A controller (with --metrics-port, --usage-file) and two workers (with --metrics-port) are started with their CLIs;
a tenant's program runs a known workload: MM matrix products on each of 2 workers, one read of a 16 KiB result,
then holds its 2 devices for HOLD_S seconds. A Prometheus server (the Debian `prometheus` binary; skipped with
one line where it is absent, `nox -s observability` installs it) scrapes the three endpoints, and its HTTP API
must return the values that workload produces. Then a second tenant's program has one of the workers killed under
it: its session is rebuilt on the survivor, and the controller's /metrics (read directly, and through Prometheus
where it runs) count one recovery with its detection and recovery latencies. The usage records must add up to the
device-time the first program really held (within 1%), and survive a controller restart (and a torn last line)
without double counting.
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
from prometheus_client.parser import text_string_to_metric_families

from _helpers import CONTROLLER, Keys, start_controller, start_worker, stop_all
from dtorch_controller.keys import KeyFile
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

LOSS = textwrap.dedent("""
    import os, signal, sys, torch, dtorch
    from dtorch import Shard
    dtorch.connect(name="survivor")
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.ones(8, 4, device_mesh=mesh, placements=[Shard(0)])
    x.mul_(3)
    assert torch.equal(x.to_torch(), torch.full((8, 4), 3.0))
    os.kill(int(sys.argv[1]), signal.SIGKILL)                                 # one of its two workers
    y = x * 2
    assert torch.equal(y.to_torch(), torch.full((8, 4), 6.0))                # rebuilt on the survivor
    dtorch.shutdown()
""")


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
        keys = KeyFile.read(self.keys.path)
        self.carol = keys.create("tenant", "carol")[1]  # the tenant whose worker is killed (not in alice's bill)
        keys.write(self.keys.path)
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

    def run(self, script: str, key: str, *args: str) -> str:
        (self.tmp / "program.py").write_text(script)
        out = subprocess.run([sys.executable, str(self.tmp / "program.py"), *args], capture_output=True, text=True,
                             timeout=WAIT_S, env=self.keys.env(key, DTORCH_CONTROLLER=self.address))
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    def run_workload(self) -> list[float]:
        return json.loads(self.run(WORKLOAD, self.keys.alice).strip().splitlines()[-1])["times"]

    def run_loss(self) -> None:
        """Carol's program, with the first worker killed under it."""
        self.run(LOSS, self.carol, str(self.procs[1].pid))

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The controller's /metrics, read directly: (sample name, labels) -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['controller']}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def close(self) -> None:
        self.admin.close()
        stop_all(self.procs[::-1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("observability"))
    c.scraped, c.scraped_loss, prom = {}, {}, None
    try:
        if PROMETHEUS:
            prom = Prometheus(tmp_path_factory.mktemp("prometheus"), list(c.ports.values()))
        c.times = c.run_workload()
        if prom:
            until(lambda: prom.value(QUERIES["up"]) == 3, "prometheus to scrape all three targets")
            # a scrape from after the workload ended: one during its last sleep showed the mms but not all the
            # device-time its session went on to hold (7.02 s where 7.08 were held)
            until(lambda: (prom.value(f'timestamp({QUERIES["held"]})') or 0) >= c.times[3],
                  "prometheus to scrape the controller after the workload ended")
            c.scraped = scrape(prom, QUERIES, "mm")
        c.run_loss()
        c.after_loss = until(lambda: (v := c.metrics()).get(REBUILT) and v, "the recovery in /metrics")
        if prom:
            c.scraped_loss = scrape(prom, LOSS_QUERIES, "rebuilt")
    except BaseException:
        c.close()
        raise
    finally:
        if prom is not None:
            prom.close()
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


LOSS_QUERIES = {
    "rebuilt": 'dtorch_controller_recoveries_total{outcome="rebuilt"}',
    "data_lost": 'dtorch_controller_recoveries_total{outcome="data_lost"}',
    "detected": "sum(dtorch_controller_failure_detection_seconds_count)",
    "detection_s": "sum(dtorch_controller_failure_detection_seconds_sum)",
    "recovered": "dtorch_controller_recovery_seconds_count",
    "recovery_s": "dtorch_controller_recovery_seconds_sum",
    "preemptions": "dtorch_controller_preemptions_total",
    "lost": 'dtorch_controller_workers{state="lost"}',
}
REBUILT = ("dtorch_controller_recoveries_total", (("outcome", "rebuilt"),))


def scrape(prom: Prometheus, queries: dict[str, str], ready: str) -> dict[str, float | None]:
    """Every query's value once Prometheus has scraped what the `ready` query shows (while the first controller
    runs)."""
    until(lambda: prom.value(queries[ready]), f"prometheus to see {ready}")
    return {name: prom.value(q) for name, q in queries.items()}


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
    assert v["syncs"] >= 1 and v["submits"] is not None  # a sync point's batch rides in its Sync (protocol 1.7)
    assert v["waits"] == 1 and v["queue"] == 0  # one mesh, placed at once
    t0, t1, t2, t3 = cluster.times
    assert 2 * (t2 - t1) * 0.99 <= v["held"] <= 2 * (t3 - t0) * 1.01
    assert v["moved"] >= 64 * 64 * 4


def test_a_worker_killed_under_a_session_shows_as_a_recovery_with_its_latencies(cluster):
    v = cluster.after_loss

    def total(name: str) -> float:
        return sum(value for (sample, _labels), value in v.items() if sample == name)

    assert v[REBUILT] == 1 and v[("dtorch_controller_recoveries_total", (("outcome", "data_lost"),))] == 0
    assert total("dtorch_controller_failure_detection_seconds_count") == 1  # by cause: timeout or unreachable
    assert total("dtorch_controller_failure_detection_seconds_sum") >= 0
    assert v[("dtorch_controller_recovery_seconds_count", ())] == 1
    assert v[("dtorch_controller_recovery_seconds_sum", ())] > 0  # placing, resetting, replaying took reports
    assert v[("dtorch_controller_preemptions_total", ())] == 0
    assert v[("dtorch_controller_workers", (("state", "lost"),))] == 1
    if PROMETHEUS:  # the same values through a real Prometheus
        p = cluster.scraped_loss
        assert (p["rebuilt"], p["data_lost"], p["detected"], p["recovered"], p["preemptions"], p["lost"]) == \
            (1, 0, 1, 1, 0, 1)
        assert p["recovery_s"] == v[("dtorch_controller_recovery_seconds_sum", ())]
        assert p["detection_s"] == total("dtorch_controller_failure_detection_seconds_sum")


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
    alice = {r["tenant"]: r for r in usage(cluster, "--by", "tenant")}["alice"]  # (and carol's session)
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
