"""Scheduler figures (printed, never asserted): decisions per second of the real controller core, driven
directly (no gRPC, a fake clock), with 10,000 registered fake workers and 1,000 queued sessions.

For each policy:
  admit    1,000 sessions open a mesh each (sizes 1-16) on an empty 10,000-worker cluster: placements/s
  queue    1,000 more sessions ask while every worker is taken: queueing decisions/s (all 1,000 wait)
  poll     the 1,000 waiting clients poll their position (OpenMesh again), 10 times each: answers/s
  drain    the first sessions close one by one; each close re-runs the queue of up to 1,000:
           placements/s (decisions / time spent in the closes), until the queue is empty
  preempt  (priority, las) then 500 high-priority (priority) / fresh (las) sessions arrive on the full
           cluster of lower-ranked running work and freeze some of it: freezes + placements per second

A decision is one placement, queueing, freeze or resume (`Scheduler.decisions`).
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Callable

from dtorch_controller.core import Config, ControllerCore, counter_ids, make_policy
from dtorch_controller.core import events as ev
from dtorch_controller.core.timers import PolicyTick
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello

SIZES = (1, 1, 2, 2, 4, 4, 8, 8, 16)


class Bench:
    def __init__(self, policy: str, workers: int, per_node: int) -> None:
        config = Config(heartbeat_interval_s=1e6, heartbeat_timeout_s=1e7, session_timeout_s=0.0,
                        event_log_size=1000)
        self.core = ControllerCore(config, session_ids=counter_ids("s"), policy=make_policy(policy))
        self.now = 0.0
        self.rids = itertools.count()
        self.rng = random.Random(7)
        for i in range(workers):
            self.call(ev.Register, m.RegisterWorker(hello=hello("worker"), address=f"10.{i // 65536}.{i // 256 % 256}."
                                                    f"{i % 256}:7000", device_type="cuda", memory_bytes=80 << 30,
                                                    labels={"node": f"node{i // per_node}"}))

    def call(self, cls: Callable, msg: object) -> object:
        self.now += 1e-4
        reply = None
        rid = next(self.rids)
        for effect in self.core.handle(self.now, cls(rid, msg)):
            if getattr(effect, "request_id", None) == rid:
                reply = effect.message
        return reply

    def session(self, priority: str = "normal") -> str:
        return self.call(ev.OpenSession, m.OpenSession(hello=hello("client"), priority=priority)).session

    def mesh(self, sid: str, n: int) -> m.MeshPlaced:
        return self.call(ev.OpenMesh, m.OpenMesh(session=sid, mesh=0, devices=list(range(n)), shape=[n]))

    def decisions(self) -> int:
        return self.core.view.decisions


def timed(bench: Bench, fn: Callable[[], None]) -> tuple[float, int]:
    d0, t0 = bench.decisions(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, bench.decisions() - d0


def run(policy: str, workers: int, per_node: int, queued: int) -> dict[str, float]:
    b = Bench(policy, workers, per_node)
    out: dict[str, float] = {}
    rng = b.rng
    running: list[str] = []

    def admit() -> None:
        while b.core.sched.pool.free_total:
            sid = b.session("low" if policy == "priority" else "normal")
            n = min(rng.choice(SIZES), b.core.sched.pool.free_total)
            assert b.mesh(sid, n).placed
            running.append(sid)

    secs, n = timed(b, admit)
    out["admit"] = n / secs
    out["running"] = len(running)
    waiting = [b.session("low" if policy == "priority" else "normal") for _ in range(queued)]

    def queue() -> None:
        for sid in waiting:
            assert not b.mesh(sid, rng.choice(SIZES)).placed

    secs, n = timed(b, queue)
    out["queue"] = n / secs
    assert b.core.sched.queued == queued

    def poll() -> None:
        for _ in range(10):
            for sid in waiting:
                b.call(ev.OpenMesh, m.OpenMesh(session=sid, mesh=0, devices=[0], shape=[1]))

    t0 = time.perf_counter()
    poll()
    out["poll"] = 10 * queued / (time.perf_counter() - t0)

    def drain() -> None:
        rng.shuffle(running)
        while running and b.core.sched.queued:
            b.call(ev.CloseSession, m.CloseSession(session=running.pop()))

    secs, n = timed(b, drain)
    out["drain"] = n / secs
    out["drained_queue"] = queued - b.core.sched.queued

    if policy in ("priority", "las"):
        def preempt() -> None:
            for _ in range(500):
                sid = b.session("high" if policy == "priority" else "normal")
                b.mesh(sid, rng.choice(SIZES))

        if policy == "las":  # the running work attains service, so that newcomers outrank it
            b.now += 1e5
            b.core.handle(b.now, ev.TimerFired(PolicyTick()))
        secs, n = timed(b, preempt)
        out["preempt"] = n / secs
        out["frozen"] = sum(t.state == "frozen" for t in b.core.sched.tenants.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--queued", type=int, default=1_000)
    parser.add_argument("--policies", default="fifo,priority,las")
    args = parser.parse_args()
    print(f"scheduler: {args.workers:,} fake workers ({args.per_node} per node), {args.queued:,} queued sessions; "
          "decisions per second through ControllerCore.handle")
    print(f"{'policy':<10}{'admit/s':>10}{'queue/s':>10}{'poll/s':>10}{'preempt/s':>11}{'drain/s':>10}  notes")
    for policy in args.policies.split(","):
        r = run(policy, args.workers, args.per_node, args.queued)
        pre = f"{r['preempt']:>11,.0f}" if "preempt" in r else f"{'-':>11}"
        print(f"{policy:<10}{r['admit']:>10,.0f}{r['queue']:>10,.0f}{r['poll']:>10,.0f}{pre}{r['drain']:>10,.0f}  "
              f"{r['running']:.0f} sessions filled the cluster; the drain placed {r['drained_queue']:.0f} queued"
              + (f"; {r['frozen']:.0f} frozen by the preemptions" if "frozen" in r else ""))


if __name__ == "__main__":
    main()
