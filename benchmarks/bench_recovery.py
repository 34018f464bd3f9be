"""Fault-tolerance figures with real processes: detection and recovery after SIGKILL, migration downtime per MB.

    python benchmarks/bench_recovery.py [--trials 3] [--sizes-mb 1 16 64] [--state-mb 16]
    python benchmarks/bench_recovery.py --core [--workers 10000] [--per-node 8] [--sessions 1000]

* detection: SIGKILL of the worker hosting a logical device, to the controller declaring it lost (polled).
* recovery: the controller's own figure (loss declared -> every worker rebuilt: restore + replay), and the
  client's stall (the training step spanning the kill, minus a normal step).
* migration: `dtorch.migrate` of one logical device holding N MB, to a spare worker and back; downtime is
  how long the session's batches were held (the controller's report).

With --core, no processes: the controller core driven directly on a fake clock, at cluster scale (10,000 fake
workers on 1,250 nodes, 1,000 sessions of 1-8 devices, a snapshot after every batch):
* snapshot: every session submits one batch, which starts its snapshot (copies on another worker): batches/s;
* reports: every worker reports its batches done, which completes the snapshots: reports/s (each report
  advances the sessions waiting for it);
* node loss: every worker of 4 nodes hosting sessions (not neighbours) is lost at once, then every worker
  reports until the rebuilds are done: sessions rebuilt vs degraded (lost data), and the time in the core;
* drain: one worker per node of 16 nodes is drained; moves that land on another node than the drained one.

Figures only: nothing here passes or fails on time. Each trial starts its own embedded cluster.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import signal
import statistics
import threading
import time
from typing import Any

try:
    import torch
    import torch.nn as nn

    import dtorch
    from dtorch import Replicate, Shard, runtime
    from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module
except ImportError:  # --core needs neither torch nor the client
    pass


def worker_pid(worker_id: str) -> int:
    cluster = runtime.get_session().cluster
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


class CoreBench:
    """The controller core alone, on a fake clock: fake workers that report whatever they were sent as done."""

    def __init__(self, workers: int, per_node: int) -> None:
        from dtorch_controller.core import Config, ControllerCore, counter_ids
        from dtorch_controller.core import events as ev
        from dtorch_protocol import messages as m
        from dtorch_protocol.wire import hello

        self.m, self.ev, self.hello = m, ev, hello
        config = Config(heartbeat_interval_s=1e6, heartbeat_timeout_s=1e7, session_timeout_s=0.0,
                        event_log_size=1000, snapshot_every_batches=1)
        self.core = ControllerCore(config, session_ids=counter_ids("s"))
        self.now = 0.0
        self.rids = itertools.count()
        self.ids = [self.call(ev.Register, m.RegisterWorker(
            hello=hello("worker"), address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:7000", device_type="cuda",
            memory_bytes=80 << 30, labels={"node": f"node{i // per_node}"})).worker for i in range(workers)]

    def call(self, cls: Any, msg: object) -> Any:
        self.now += 1e-4
        rid = next(self.rids)
        reply = None
        for effect in self.core.handle(self.now, cls(rid, msg)):
            if getattr(effect, "request_id", None) == rid:
                reply = effect.message
        return reply

    def report(self, wid: str) -> None:
        w = self.core.workers.get(wid)
        if w is not None and w.state != "lost":
            self.call(self.ev.Report, self.m.WorkerReport(worker=wid, completed=w.sent, errors={}, sessions={}))

    def submit(self, sid: str, seq: int) -> None:
        m = self.m
        s = self.core.sessions[sid]
        spec = m.TensorSpec(shape=[8 * len(s.devices)], dtype="float32", mesh=1, placements=["S0"])
        instr = m.InstrCreate(tid=1, spec=spec, init="rand", seed=seq, src="bench") if seq == 1 else m.InstrCall(
            op="aten.add_.Scalar", mesh=1, args=[{"$t": 1}, 1.0], kwargs={}, outs=[m.OutSpec(tid=1, spec=spec)],
            src="bench")
        self.call(self.ev.Submit, m.Submit(session=sid, seq=seq, instrs=[instr]))


def core_scale(workers: int, per_node: int, sessions: int) -> None:
    rng = random.Random(3)
    t0 = time.perf_counter()
    b = CoreBench(workers, per_node)
    m, ev, hello = b.m, b.ev, b.hello
    sids = []
    while len(sids) < sessions and b.core.sched.pool.free_total:
        sid = b.call(ev.OpenSession, m.OpenSession(hello=hello("client"))).session
        n = min(rng.choice((1, 1, 2, 4, 8)), b.core.sched.pool.free_total)
        assert b.call(ev.OpenMesh, m.OpenMesh(session=sid, mesh=1, devices=list(range(n)), shape=[n])).placed
        sids.append(sid)
    used = {w for sid in sids for w in b.core.sessions[sid].devices.values()}
    print(f"core only: {workers} workers on {workers // per_node} nodes, {len(sids)} sessions on {len(used)} "
          f"workers, a snapshot after every batch (setup {time.perf_counter() - t0:.1f} s)")
    recs = b.core.pipeline.recs

    nodes_of = {wid: w.labels["node"] for wid, w in b.core.workers.items()}

    def node(wid: str) -> str:
        return nodes_of[wid]

    for seq in (1, 2):
        t = time.perf_counter()
        for sid in sids:
            b.submit(sid, seq)
        took = time.perf_counter() - t
        print(f"  round {seq}: snapshot   {len(sids) / took:10.0f} batches/s ({took:.2f} s)")
        t = time.perf_counter()
        for wid in b.ids:
            b.report(wid)
        took = time.perf_counter() - t
        done = sum(1 for sid in sids if recs[sid].snapshot is not None and recs[sid].snapshot.upto == seq)
        print(f"  round {seq}: reports    {len(b.ids) / took:10.0f} reports/s ({took:.2f} s), "
              f"{done}/{len(sids)} snapshots complete")
    remote = [(p, h) for sid in sids for d, (p, h) in recs[sid].snapshot.holders.items()]
    off = sum(1 for p, h in remote if node(p) != node(h))
    print(f"  backup copies on another node than their device: {off}/{len(remote)}")

    nodes = sorted({node(w) for w in used}, key=lambda n: int(n[4:]))[::4][:4]  # not neighbours
    hit = sorted({sid for sid in sids if any(node(w) in nodes for w in b.core.sessions[sid].devices.values())})
    t = time.perf_counter()
    for wid in b.ids:
        if node(wid) in nodes:
            b.core.handle(b.now, ev.WorkerUnreachable(wid, "", "node down"))
    for _ in range(6):
        for wid in b.ids:
            b.report(wid)
    took = time.perf_counter() - t
    states = [b.core.sessions[sid].state for sid in hit]
    rebuilt = sum(1 for sid in hit if recs[sid].recoveries)
    print(f"  node loss: {len(nodes)} nodes, {len(hit)} sessions hit: {rebuilt} rebuilt, "
          f"{states.count('degraded')} degraded ({took:.2f} s in the core, 6 report rounds)")
    for why in sorted({recs[sid].why for sid in hit if recs[sid].why}):
        print(f"    not rebuilt: {why}")

    drained = [w for w in sorted(used - {w for w in b.ids if node(w) in nodes}, key=lambda w: int(w[1:]))
               if b.core.workers[w].state == "alive"]
    picks, seen = [], set()
    for w in drained:
        if node(w) not in seen and len(picks) < 16:
            seen.add(node(w))
            picks.append(w)
    before = {sid: dict(b.core.sessions[sid].devices) for sid in sids}
    t = time.perf_counter()
    for w in picks:
        b.call(ev.Drain, m.DrainRequest(worker=w, timeout_s=1e6))
    for _ in range(6):
        for wid in b.ids:
            b.report(wid)
    took = time.perf_counter() - t
    moves = [(w, after) for sid in sids for d, after in b.core.sessions[sid].devices.items()
             for w in [before[sid].get(d)] if w in picks and after != w]
    released = sum(1 for w in picks if w not in b.core.workers or b.core.workers[w].state == "lost")
    print(f"  drain: {len(picks)} workers, {released} released, {len(moves)} devices moved, "
          f"{sum(1 for w, a in moves if node(w) != node(a))} to another node ({took:.2f} s in the core)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--state-mb", type=float, default=16.0, help="extra session state rebuilt after the kill")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=3, help="migrations per size (there and back each)")
    p.add_argument("--core", action="store_true", help="the core alone at cluster scale (no processes)")
    p.add_argument("--workers", type=int, default=10000)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--sessions", type=int, default=1000)
    args = p.parse_args()
    if args.core:
        return core_scale(args.workers, args.per_node, args.sessions)
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
