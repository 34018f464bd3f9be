"""Fault-tolerance figures with real processes: detection and recovery after SIGKILL, migration downtime per MB.

    python benchmarks/bench_recovery.py [--trials 3] [--sizes-mb 1 16 64] [--state-mb 16]

* detection: SIGKILL of the worker hosting a logical device, to the controller declaring it lost (polled).
* recovery: the controller's own figure (loss declared -> every worker rebuilt: restore + replay), and the
  client's stall (the training step spanning the kill, minus a normal step).
* migration: `dtorch.migrate` of one logical device holding N MB, to a spare worker and back; downtime is
  how long the session's batches were held (the controller's report).

Figures only: nothing here passes or fails on time. Each trial starts its own embedded cluster.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import threading
import time

import torch
import torch.nn as nn

import dtorch
from dtorch import Replicate, Shard, runtime
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module


def worker_pid(worker_id: str) -> int:
    cluster = runtime._cluster
    for i, proc in enumerate(cluster.procs[1:]):
        text = (cluster.dir / f"worker{i}.log").read_text(errors="replace")
        if re.search(rf"dtorch-worker {worker_id} on", text):
            return proc.pid
    raise LookupError(worker_id)


def devices() -> dict[int, str]:
    sid = runtime.get_session().id
    return next(s for s in dtorch.status().sessions if s.session == sid).devices


def watch(victim: str, t_kill: float, out: dict[str, float]) -> None:
    """Poll the controller until it declares `victim` lost (the training loop goes on meanwhile)."""
    session = runtime.get_session()
    while time.monotonic() - t_kill < 30:
        if next(w.state for w in session.status().workers if w.worker == victim) == "lost":
            out["detection_s"] = time.monotonic() - t_kill
            return
        time.sleep(0.005)


def kill_trial(state_mb: float, steps: int = 8, at: int = 4) -> dict[str, float]:
    dtorch.connect(workers=3)
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ballast = dtorch.randn(int(state_mb * 2**20 / 4 / 3) * 3, device_mesh=mesh, placements=[Shard(0)])  # more state
    gen = torch.Generator().manual_seed(1)
    times, out = [], {}
    for step in range(steps):
        t0 = time.monotonic()
        x = dtorch.distribute_tensor(torch.randn(32, 64, generator=gen), mesh, [Replicate()])
        loss = (model(x) ** 2).mean() + ballast.sum() * 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        times.append(time.monotonic() - t0)
        if step == at:
            victim = devices()[1]
            t_kill = time.monotonic()
            os.kill(worker_pid(victim), signal.SIGKILL)
            watcher = threading.Thread(target=watch, args=(victim, t_kill, out))
            watcher.start()
    watcher.join(60)
    normal = statistics.median(times[:at] + times[at + 2:])
    out["client_stall_s"] = times[at + 1] - normal
    line = next(e for e in dtorch.status().events if "recovered in" in e)
    out["recovery_s"] = float(re.search(r"recovered in ([0-9.]+)s", line).group(1))
    out["step_s"] = normal
    dtorch.shutdown()
    return out


def migration_trial(sizes_mb: list[float], repeats: int) -> list[tuple[float, float, float]]:
    dtorch.connect(workers=4)
    mesh = dtorch.DeviceMesh("cpu", [0, 1, 2])
    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20 / 4)
        t = dtorch.randn(3, n, device_mesh=mesh, placements=[Shard(0)])  # one third on each logical device
        t.mul_(2)
        t.to_torch() if mb <= 16 else (t.sum().item())
        downtimes, moved = [], 0
        for _ in range(repeats):
            here = devices()[1]
            spare = next(w.worker for w in dtorch.status().workers
                         if w.state == "alive" and w.worker not in devices().values())
            for target in (spare, here):
                reply = dtorch.migrate(1, target, timeout_s=120)
                assert reply.ok, reply.message
                downtimes.append(reply.moves[0].downtime_s)
                moved = reply.moves[0].bytes
        rows.append((moved / 2**20, statistics.median(downtimes), min(downtimes)))
        del t
    dtorch.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--state-mb", type=float, default=16.0, help="extra session state rebuilt after the kill")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=3, help="migrations per size (there and back each)")
    args = p.parse_args()
    os.environ.setdefault("DTORCH_SNAPSHOT_BATCHES", "8")
    torch.set_num_threads(1)

    print(f"SIGKILL of a worker mid-training (3 workers, +{args.state_mb:g} MB of state, snapshots every "
          f"{os.environ['DTORCH_SNAPSHOT_BATCHES']} batches, heartbeat timeout 1 s)")
    results = [kill_trial(args.state_mb) for _ in range(args.trials)]
    for key, label in [("detection_s", "detection (kill -> declared lost)"),
                       ("recovery_s", "recovery (declared lost -> rebuilt)"),
                       ("client_stall_s", "client stall (extra time of the step)"),
                       ("step_s", "a normal training step")]:
        values = [r[key] for r in results]
        print(f"  {label:40s} median {statistics.median(values) * 1000:8.1f} ms   "
              f"min {min(values) * 1000:8.1f}   max {max(values) * 1000:8.1f}")

    print("migration of one logical device to a spare worker (4 workers), downtime = batches held")
    print(f"  {'MB moved':>10s} {'downtime ms (median)':>22s} {'min':>8s} {'ms per MB':>10s}")
    for mb, median, low in migration_trial(args.sizes_mb, args.repeats):
        print(f"  {mb:10.2f} {median * 1000:22.1f} {low * 1000:8.1f} {median * 1000 / max(mb, 1e-9):10.2f}")


if __name__ == "__main__":
    main()
