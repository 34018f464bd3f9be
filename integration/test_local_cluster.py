"""The quickstart on an embedded cluster, and the same program against a running controller and workers."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import CONTROLLER, Keys, start_controller, start_worker, stop_all

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def _children_of(pid: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"--parent-pid {pid}" in text:
                out.append(int(proc.name))
    return out


def test_quickstart_prints_tensor_and_leaves_nothing_behind():
    proc = subprocess.Popen([sys.executable, str(QUICKSTART)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"})
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert out.startswith("x=DTensor(tensor([[")
    assert out.count("[") - out.count("[0, 1]") >= 5  # a (4, 3) tensor: four rows
    assert "device_mesh=DeviceMesh('cpu', [0, 1])" in out and "placements=(Shard(dim=0),)" in out
    time.sleep(0.5)
    assert _children_of(proc.pid) == []


def test_embedded_cluster_dies_with_a_killed_client():
    code = "import dtorch, time; dtorch.connect(workers=1); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    assert len(_children_of(proc.pid)) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _children_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children_of(proc.pid) == []


def _started_at(pid: int) -> float:
    """When process `pid` started, on time.time()'s clock (to the kernel's clock tick)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_boot


def test_the_workers_start_beside_the_controller_not_after_it():
    """The embedded cluster started its workers once the controller was up (its port file written), so their own
    start, mostly importing torch, came after the controller's. They now start at once, told the port held for it."""
    from dtorch.local_cluster import LocalCluster

    cluster = LocalCluster(2)
    try:
        port_file = cluster.dir / "controller.addr"
        assert port_file.read_text().strip() == cluster.address
        up = port_file.stat().st_mtime
        started = [_started_at(p.pid) for p in cluster.procs[1:]]
        assert len(started) == 2 and all(t < up for t in started), (started, up)
    finally:
        cluster.stop()


def test_a_stopped_cluster_leaves_no_directory_and_one_with_a_failed_process_keeps_its_logs(capsys):
    """Every embedded cluster left its temporary directory behind (its key file and logs): hundreds of them in /tmp
    after a day's runs. A clean stop removes it; a process that died keeps its logs, and only them."""
    from dtorch.local_cluster import LocalCluster

    clean = LocalCluster(1)
    assert (clean.dir / "keys.json").exists()
    clean.stop()
    assert not clean.dir.exists()
    assert capsys.readouterr().err == ""

    failed = LocalCluster(1)
    try:
        failed.procs[1].send_signal(signal.SIGKILL)
        failed.procs[1].wait(10)
    finally:
        failed.stop()
    try:
        assert sorted(p.name for p in failed.dir.iterdir()) == ["controller.addr", "controller.log", "worker0.log"]
        assert capsys.readouterr().err.strip() == (
            "dtorch: local cluster process(es) exited before the cluster was stopped: worker0 (code -9); "
            f"logs kept in {failed.dir}")
        failed.stop()  # again, as at exit: the logs stay
        assert (failed.dir / "worker0.log").exists()
    finally:
        shutil.rmtree(failed.dir, ignore_errors=True)

    with pytest.raises(TimeoutError) as late:  # a start that fails: the error names where its logs are
        LocalCluster(1, start_timeout=0.01)
    kept = Path(re.search(r"\(logs in (.+)\)$", str(late.value)).group(1))
    try:
        names = {p.name for p in kept.iterdir()}
        assert {"controller.log", "worker0.log"} <= names and "keys.json" not in names
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_connect_starts_the_cluster_before_it_imports_torch():
    """`dtorch.connect` imported the session's modules (torch among them, about 3 s) before it started the local
    cluster's processes, which then took as long again to import torch themselves. It now starts them first and
    imports while they start: `dtorch.runtime` itself imports no torch."""
    code = ("import sys, dtorch.runtime; "
            "print(sorted(m for m in ('torch', 'dtorch.session', 'dtorch._capture') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_with_block_closes_its_session_and_stops_its_cluster():
    code = """
import os, torch, dtorch
with dtorch.connect(workers=1) as s:
    x = torch.arange(6.0).reshape(2, 3)
    d = dtorch.distribute_tensor(x, dtorch.DeviceMesh("cpu", [0, 1]), [dtorch.Shard(0)])
    assert torch.equal((d * 2).full_tensor(), x * 2)
    procs = list(s.cluster.procs)
    print("inside", len(procs), flush=True)
print("closed", s.closed, all(p.poll() is not None for p in procs), flush=True)
for use in (lambda: d.to_torch(), lambda: print(d + 1), lambda: d.sum().item()):  # the early read's pool is shut
    try:
        use()
    except dtorch.DTorchError as e:
        print("refused", "was closed" in str(e) and "\\n" not in str(e), flush=True)
y = dtorch.distribute_tensor(x, dtorch.DeviceMesh("cpu", [0, 1]), [dtorch.Shard(1)])  # a new default session
print("again", torch.equal(y.full_tensor(), x), dtorch.runtime.get_session() is not s, flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:6] == ["inside 2", "closed True True", *["refused True"] * 3, "again True True"]


@pytest.fixture
def standalone_cluster(tmp_path):
    keys = Keys.make(tmp_path)
    controller, address = start_controller(tmp_path / "addr", keys.env(keys.admin), limit=30)
    procs = [controller]
    try:
        for _ in range(2):
            procs.append(start_worker(address, keys.env(keys.worker)))
        yield address, keys, procs
    finally:
        stop_all(procs)


def test_quickstart_against_running_controller(standalone_cluster):
    address, keys, procs = standalone_cluster
    env = keys.env(keys.admin)
    status = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = subprocess.run([*CONTROLLER, "status", "--controller", address], env=env,
                                capture_output=True, text=True)
        if status.returncode == 0 and status.stdout.count("alive") >= 2:
            break
        time.sleep(0.2)
    assert status is not None and status.stdout.count("alive") >= 2, status
    out = subprocess.run([sys.executable, str(QUICKSTART)], env=keys.env(keys.alice, DTORCH_CONTROLLER=address),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"x=DTensor\(tensor\(\[\[", out.stdout)
    assert "Shard(dim=0)" in out.stdout
    wrong = subprocess.run([sys.executable, str(QUICKSTART)], env=keys.env("wrong", DTORCH_CONTROLLER=address),
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0
    assert "malformed API key" in wrong.stderr.strip().splitlines()[-1]
    revoked = keys.bob[:-4] + "AAAA"  # well-formed, never issued
    wrong = subprocess.run([sys.executable, str(QUICKSTART)], env=keys.env(revoked, DTORCH_CONTROLLER=address),
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0
    assert "unknown or revoked API key" in wrong.stderr.strip().splitlines()[-1]
