"""Fake workers: register, heartbeat, run command batches in seq order for as long as the cost model says.

A worker keeps only the local shard shapes it needs to price a command (a matmul costs 2*m*k*n flops on
each device it hosts). It reports after every batch and every heartbeat interval, like the real one. When
it fails it just stops: no more reports, no more work (and in "crash" mode sends to it fail at once).
"""

from __future__ import annotations

import math

import simpy

from dtorch.protocol import messages as m
from dtorch_controller.core import events as ev
from dtorch_sim import __version__
from dtorch_sim.scenario import CostModel

HELLO = m.Hello(protocol_version=m.PROTOCOL_VERSION, package_version=__version__, role="worker")
MATMULS = {"aten.mm.default", "aten.matmul.default", "aten.bmm.default", "aten.addmm.default"}


class Worker:
    def __init__(self, sim, address: str, node: str, device_type: str, speed: float, memory_gb: float,
                 labels: dict[str, str]) -> None:
        self.sim, self.env = sim, sim.env
        self.address, self.node, self.device_type = address, node, device_type
        self.speed, self.memory_gb, self.labels = speed, memory_gb, labels
        self.slow = 1.0  # slow_worker faults scale the speed
        self.id: str | None = None  # the core's id, once registered
        self.alive = True
        self.crash = False  # when failed: sends to it fail at once (else they vanish)
        self.completed = 0
        self.inbox = simpy.Store(self.env)
        self.shapes: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {}  # session -> (tid, device) -> shape
        self.busy_since: float | None = None
        self.busy_s = 0.0  # finished busy time
        self.process = self.env.process(self.life())
        self.heart: simpy.Process | None = None

    # ------------------------------------------------------------ the story

    def life(self):
        """Register, start heartbeating, then run batches in order until failed."""
        try:
            reg = yield self.sim.request(lambda r: ev.Register(r, m.RegisterWorker(
                hello=HELLO, address=self.address, device_type=self.device_type,
                memory_bytes=int(self.memory_gb * 2**30), labels=self.labels)))
            self.id = reg.worker
            self.sim.registered(self)
            self.heart = self.env.process(self.heartbeat(reg.heartbeat_interval_s))
            while True:
                batch = yield self.inbox.get()
                self.busy_since = self.env.now
                yield self.env.timeout(self.cost(batch))
                self.idle()
                self.completed = batch.seq
                self.sim.tell(lambda r: ev.Report(r, m.WorkerReport(worker=self.id, completed=self.completed)))
        except simpy.Interrupt:
            self.idle()

    def heartbeat(self, interval: float):
        """Report every `interval` seconds (first one at a seeded offset, so workers do not beat in step)."""
        try:
            yield self.env.timeout(self.sim.rng.uniform(0, interval))
            while True:
                reply = yield self.sim.request(lambda r: ev.Report(r, m.WorkerReport(worker=self.id,
                                                                                     completed=self.completed)))
                if not reply.ok:  # fenced: declared lost while merely slow; a real worker would re-register
                    self.sim.fenced(self)
                    return
                yield self.env.timeout(interval)
        except simpy.Interrupt:
            pass

    def fail(self) -> None:
        """Stop everything at once: no reports, no more work."""
        if not self.alive:
            return
        self.alive = False
        for p in (self.process, self.heart):
            if p is not None and p.is_alive:
                p.interrupt()

    def idle(self) -> None:
        if self.busy_since is not None:
            self.busy_s += self.env.now - self.busy_since
            self.busy_since = None

    def busy_until_now(self) -> float:
        return self.busy_s + (self.env.now - self.busy_since if self.busy_since is not None else 0.0)

    # ------------------------------------------------------------ the cost model

    def cost(self, batch: m.Execute) -> float:
        """Seconds to run one batch; also tracks the shard shapes later commands are priced by."""
        cost: CostModel = self.sim.scenario.cost
        flops_per_s = cost.reference_tflops * 1e12 * self.speed * self.slow
        shapes = self.shapes.setdefault(batch.session, {})
        seconds = 0.0
        for cmd in batch.cmds:
            seconds += cost.launch_s
            if isinstance(cmd, m.CmdRun):
                seconds += sum(self._run(cmd, d, shapes) for d in cmd.devices) / flops_per_s
            elif isinstance(cmd, m.CmdCreate):
                for device, box in cmd.boxes.items():
                    shapes[(cmd.tid, device)] = tuple(length for _start, length in box)
            elif isinstance(cmd, m.CmdDelete):
                for tid in cmd.tids:
                    for device in cmd.devices:
                        shapes.pop((tid, device), None)
            elif isinstance(cmd, m.CmdCloseSession):
                self.shapes.pop(batch.session, None)
        return seconds

    @staticmethod
    def _run(cmd: m.CmdRun, device: int, shapes: dict[tuple[int, int], tuple[int, ...]]) -> float:
        """Flops of `cmd` on one device: 2*m*k*n for a matmul, one per element otherwise."""
        inputs = [shapes.get((a["$t"], device), ()) for a in cmd.args if isinstance(a, dict) and "$t" in a]
        if cmd.op in MATMULS and len(inputs) >= 2 and len(inputs[-2]) >= 2 and len(inputs[-1]) >= 2:
            a, b = inputs[-2], inputs[-1]
            out = (*a[:-1], b[-1])
            flops = 2.0 * math.prod(a) * b[-1]
        else:
            out = inputs[0] if inputs else ()
            flops = float(math.prod(out)) if out else 0.0
        for tid in cmd.outs:
            if tid is not None:
                shapes[(tid, device)] = out
        return flops
