"""The controller core's longest single events at cluster scale (printed, never asserted).

The core is single-threaded: one event that holds it for a second holds every tenant's heartbeats, Syncs and
Submits with it. This drives the real core (no gRPC, a fake clock) on N registered workers with rendezvous
stores, and prints the time of each event below, for N = 1,024 and 4,096:

  all_gather       a same-mesh Shard(0) -> Replicate on N/2 devices: collectives
  swap 2-D         (Shard(0), Shard(1)) -> (Shard(1), Shard(0)) on a square mesh of N/4 devices: pieces
  cross-mesh       Shard(0) on N/2 devices -> (Shard(0), Shard(1)) on a square mesh of N/4: pieces
  snapshot         the Submit that starts a recovery snapshot of the N/2-device session
  alive, rebuild   a heartbeat round (`WorkersAlive` of every worker) while that session is being rebuilt

and the bytes of the Execute batches the all_gather sends, the first time (its group is made) and the next.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable

from dtorch_controller.core import Config, ControllerCore, SendExecute, counter_ids
from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m
from dtorch_protocol import wire
from dtorch_protocol.wire import hello


class Core:
    """The core on `n` workers, and what a test harness would do with it: calls, reports, a clock."""

    def __init__(self, n: int) -> None:
        self.core = ControllerCore(Config(heartbeat_interval_s=1e6, heartbeat_timeout_s=1e7, session_timeout_s=0.0,
                                          snapshot_every_batches=8, event_log_size=1000),
                                   session_ids=counter_ids("s"))
        self.now = 0.0
        self.rids = itertools.count()
        self.seqs: dict[str, int] = {}
        self.workers = [self.call(ev.Register, m.RegisterWorker(
            hello=hello("worker"), address=f"w{i}:7000", device_type="cpu", memory_bytes=80 << 30,
            rendezvous=f"w{i}:29500")).worker for i in range(n)]

    def handle(self, event: object) -> list[object]:
        self.now += 1e-3
        self.effects = self.core.handle(self.now, event)
        return self.effects

    def sent_bytes(self) -> int:
        """Bytes of the Execute batches the last event sent, encoded as the wire encodes them."""
        return sum(len(wire.encode(e.execute)) for e in self.effects if isinstance(e, SendExecute))

    def call(self, cls: Callable, msg: object) -> object:
        rid = next(self.rids)
        return next(e.message for e in self.handle(cls(rid, msg)) if getattr(e, "request_id", None) == rid)

    def session(self, meshes: dict[int, list[int]]) -> str:
        sid = self.call(ev.OpenSession, m.OpenSession(hello=hello("client"))).session
        start = 0
        for mesh, shape in meshes.items():
            n = math.prod(shape)
            assert self.call(ev.OpenMesh, m.OpenMesh(session=sid, mesh=mesh, devices=list(range(start, start + n)),
                                                     shape=shape)).placed
            start += n
        return sid

    def submit(self, sid: str, *instrs: object) -> None:
        self.seqs[sid] = self.seqs.get(sid, 0) + 1
        self.call(ev.Submit, m.Submit(session=sid, seq=self.seqs[sid], instrs=list(instrs)))

    def report_all(self) -> None:
        for w in self.workers:
            worker = self.core.workers[w]
            if worker.state != "lost":
                self.call(ev.Report, m.WorkerReport(worker=w, completed=worker.sent))


def spec(shape: list[int], mesh: int, placements: tuple[str, ...]) -> m.TensorSpec:
    return m.TensorSpec(shape=shape, dtype="float32", mesh=mesh, placements=list(placements))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(n: int) -> dict[str, float]:
    c = Core(n)
    half, side = n // 2, math.isqrt(n // 4)
    big = c.session({1: [half], 2: [side, side]})
    square = c.session({1: [side, side]})
    one, two = [half * 4, half * 4], [side * 8, side * 8]
    c.submit(big, m.InstrCreate(tid=1, spec=spec(one, 1, ("S0",)), init="ones"))
    c.submit(square, m.InstrCreate(tid=1, spec=spec(two, 1, ("S0", "S1")), init="ones"))
    c.report_all()
    gather = m.InstrRedistribute(src=1, dst=2, src_spec=spec(one, 1, ("S0",)), dst_spec=spec(one, 1, ("R",)))
    out = {
        "all_gather (s)": timed(lambda: c.submit(big, gather)),
        "its Executes (MB)": c.sent_bytes() / 1e6,
    }
    c.report_all()
    c.submit(big, m.InstrDelete(tids=[2]), gather)
    out["again (MB)"] = c.sent_bytes() / 1e6
    out |= {
        "swap 2-D (s)": timed(lambda: c.submit(square, m.InstrRedistribute(
            src=1, dst=2, src_spec=spec(two, 1, ("S0", "S1")), dst_spec=spec(two, 1, ("S1", "S0"))))),
        "cross-mesh (s)": timed(lambda: c.submit(big, m.InstrRedistribute(
            src=1, dst=3, src_spec=spec(one, 1, ("S0",)), dst_spec=spec(one, 2, ("S0", "S1"))))),
    }
    c.report_all()
    add = m.InstrCall(op="aten.add.Tensor", mesh=1, args=[m.tensor_slot(1), m.tensor_slot(1)], kwargs={},
                      outs=[m.OutSpec(tid=4, spec=spec(one, 1, ("S0",)))])
    submits = []
    for _ in range(10):
        submits.append(timed(lambda: c.submit(big, add)))
        c.report_all()
    out["snapshot (s)"] = max(submits)
    victim = c.core.sessions[big].devices[7]
    c.handle(ev.WorkerUnreachable(victim, "", "killed"))
    assert c.core.sessions[big].state == "recovering"
    alive = {w: -1.0 for w in c.workers if w != victim}
    out["alive, rebuild (s)"] = timed(lambda: c.call(ev.WorkersAlive, alive))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    print(__doc__.splitlines()[0])
    results = {n: run(n) for n in args.workers}
    print(f"{'event':<22}" + "".join(f"{n:>10,}" for n in args.workers))
    for name in results[args.workers[0]]:
        print(f"{name:<22}" + "".join(f"{results[n][name]:>10.3f}" for n in args.workers))


if __name__ == "__main__":
    main()
