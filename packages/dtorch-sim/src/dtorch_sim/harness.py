"""The harness: one real `ControllerCore` on a simpy clock, fake workers and jobs around it.

The harness is the core's adapter, like the gRPC server: it feeds events with `env.now` and performs the
effects it gets back (a Reply wakes the process waiting for it, a SendExecute lands in a fake worker's
inbox, a SetTimer becomes a simpy timeout). Nothing in the core knows it is being simulated.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import simpy

from dtorch_controller.core import Config, ControllerCore, counter_ids
from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_sim.jobs import JobRecord, generate, job
from dtorch_sim.policies import make_policy
from dtorch_sim.scenario import Fault, NodeGroup, Scenario
from dtorch_sim.workers import Worker


@dataclass
class FailureRecord:
    kind: str  # worker_failure | node_failure | remove_nodes
    worker: str  # address
    at: float
    detected: float | None = None


@dataclass(frozen=True)
class Sample:
    t: float
    alive: int  # registered workers not failed
    allocated: int  # alive workers with at least one logical device bound
    bound: int  # logical devices bound on alive workers (above `alive` means oversubscribed)
    busy: float  # mean fraction of the interval the alive workers spent executing


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = sc = scenario
        self.env = simpy.Environment()
        self.rng = random.Random(f"sim-{sc.seed}")
        config = Config(heartbeat_interval_s=sc.heartbeat.interval_s, heartbeat_timeout_s=sc.heartbeat.timeout_s,
                        max_sync_timeout_s=1e12, session_timeout_s=0.0,  # simulated clients never vanish
                        snapshot_every_batches=0)  # fake workers hold no data: a job restarts after a loss
        self.core = ControllerCore(config, session_ids=counter_ids("s"), policy=make_policy(sc.policy.name,
                                                                                              sc.policy.params))
        self.events = 0  # events fed to the core
        self._request_ids = itertools.count()
        self._waiting: dict[int, simpy.Event | None] = {}
        self._timers: dict[Hashable, int] = {}  # key -> generation of the live timer
        self._timer_gen = itertools.count()
        self.workers: dict[str, Worker] = {}  # core id -> worker
        self.all_workers: list[Worker] = []  # in creation order
        self.nodes: dict[str, list[Worker]] = {}
        self.failures: list[FailureRecord] = []
        self._undetected: dict[str, FailureRecord] = {}  # core worker id -> its failure, until the core notices
        self.samples: list[Sample] = []
        self.fenced_workers = 0
        self.specs = generate(sc)
        self.jobs = [JobRecord(spec) for spec in self.specs]
        for group in sc.cluster.nodes:
            self.add_nodes(group)
        self._job_processes = [self.env.process(job(self, rec.spec, sc.workload, rec)) for rec in self.jobs]
        self.all_jobs_done = self.env.all_of(self._job_processes)
        self.all_jobs_done.callbacks.append(simpy.core.StopSimulation.callback)  # stop right there
        for fault in sc.faults:
            self.env.process(self.inject(fault))
        for change in sc.elastic:
            self.env.process(self.elastic(change))
        self.end_time = sc.duration_s if sc.duration_s is not None else self._default_end()
        self.sample_interval = sc.metrics.sample_interval_s or self.end_guess() / 200
        self.env.process(self.sampler())

    # ------------------------------------------------------------ the adapter

    def request(self, make: Callable[[int], ev.Event]) -> simpy.Event:
        """Feed `make(request_id)` to the core; the returned event fires with the Reply's message."""
        rid = next(self._request_ids)
        done = self._waiting[rid] = self.env.event()
        self.handle(make(rid))
        return done

    def tell(self, make: Callable[[int], ev.Event]) -> None:
        """Like `request`, for callers that do not wait for the reply."""
        rid = next(self._request_ids)
        self._waiting[rid] = None
        self.handle(make(rid))

    def handle(self, event: ev.Event) -> None:
        queue = deque([event])
        while queue:
            event = queue.popleft()
            self.events += 1
            for effect in self.core.handle(self.env.now, event):
                if isinstance(effect, fx.Reply):
                    waiter = self._waiting.pop(effect.request_id)
                    if waiter is not None:
                        waiter.succeed(effect.message)
                elif isinstance(effect, fx.SendExecute):
                    failed = self.send(effect)
                    if failed is not None:
                        queue.append(failed)
                elif isinstance(effect, fx.SetTimer):
                    self.set_timer(effect.at, effect.key)
            if self._undetected and isinstance(event, (ev.TimerFired, ev.WorkerUnreachable, ev.Register)):
                self._check_detected()

    def send(self, effect: fx.SendExecute) -> ev.WorkerUnreachable | None:
        worker = self.workers[effect.worker_id]
        if not worker.alive:
            if worker.crash:
                return ev.WorkerUnreachable(effect.worker_id, effect.address, "connection refused")
            return None  # a silent (hung, partitioned) worker swallows it
        latency = self.scenario.cost.rpc_latency_s
        if latency:
            self.env.timeout(latency).callbacks.append(lambda _e: worker.inbox.put(effect.execute))
        else:
            worker.inbox.put(effect.execute)
        return None

    def set_timer(self, at: float, key: Hashable) -> None:
        """A callback on a simpy timeout (not a process: there is one per worker per interval)."""
        gen = self._timers[key] = next(self._timer_gen)

        def fire(_event, key=key, gen=gen):
            if self._timers.get(key) == gen:  # not replaced by a later SetTimer with the same key
                del self._timers[key]
                self.handle(ev.TimerFired(key))

        self.env.timeout(max(0.0, at - self.env.now)).callbacks.append(fire)

    def _check_detected(self) -> None:
        for worker_id in list(self._undetected):
            w = self.core.workers.get(worker_id)
            if w is None or w.state == st.LOST:
                self._undetected.pop(worker_id).detected = self.env.now

    # ------------------------------------------------------------ workers coming and going

    def add_nodes(self, group: NodeGroup) -> list[str]:
        dtype = self.scenario.cluster.device_types[group.device_type]
        names = []
        for _ in range(group.count):
            node = f"{group.name}{len(self.nodes)}"
            names.append(node)
            self.nodes[node] = [
                Worker(self, f"{node}/gpu{d}", node, group.device_type, dtype.speed, dtype.memory_gb,
                       {**group.labels, "node": node})
                for d in range(group.devices_per_node)]
            self.all_workers.extend(self.nodes[node])
        return names

    def registered(self, worker: Worker) -> None:
        self.workers[worker.id] = worker  # type: ignore[index]

    def fenced(self, worker: Worker) -> None:
        self.fenced_workers += 1
        worker.fail()

    def stop_worker(self, worker: Worker, kind: str, crash: bool = False) -> None:
        if not worker.alive:
            return
        worker.crash = crash
        worker.fail()
        record = FailureRecord(kind, worker.address, self.env.now)
        self.failures.append(record)
        if worker.id is not None:
            self._undetected[worker.id] = record

    def alive_workers(self) -> list[Worker]:
        return [w for w in self.all_workers if w.alive]

    def inject(self, fault: Fault):
        """One fault at its time, or recurring ones with exponential gaps of mean `mtbf_s`."""
        rng = random.Random(f"faults-{self.scenario.seed}-{self.scenario.faults.index(fault)}")
        while True:
            wait = fault.at if fault.at is not None else rng.expovariate(1.0 / fault.mtbf_s)  # type: ignore[operator]
            yield self.env.timeout(max(0.0, wait - (self.env.now if fault.at is not None else 0.0)))
            for worker in self._targets(fault, rng):
                if fault.kind == "slow_worker":
                    self.env.process(self.slow_down(worker, fault))
                else:
                    self.stop_worker(worker, fault.kind, crash=fault.mode == "crash")
            if fault.at is not None:
                return

    def _targets(self, fault: Fault, rng: random.Random) -> list[Worker]:
        alive = self.alive_workers()
        if fault.kind == "node_failure" or (fault.node and not fault.worker):
            nodes = sorted({w.node for w in alive})
            node = fault.node if fault.node else (rng.choice(nodes) if nodes else None)
            return [w for w in self.nodes.get(node or "", []) if w.alive]
        if fault.worker:
            return [w for w in alive if w.address == fault.worker]
        return [rng.choice(alive)] if alive else []

    def slow_down(self, worker: Worker, fault: Fault):
        worker.slow = fault.factor
        if fault.until is not None:
            yield self.env.timeout(fault.until - self.env.now)
            worker.slow = 1.0

    def elastic(self, change):
        yield self.env.timeout(change.at)
        if change.action == "add_nodes":
            self.add_nodes(change.add)
            return
        names = change.nodes or sorted((n for n, ws in self.nodes.items() if any(w.alive for w in ws)),
                                       key=lambda n: self.nodes[n][0].address)
        if not change.nodes:  # by count: the newest nodes leave
            order = list(self.nodes)
            names = sorted(names, key=order.index)[-change.count:]
        for node in names:
            for worker in self.nodes.get(node, []):
                self.stop_worker(worker, "remove_nodes")

    # ------------------------------------------------------------ measuring

    def sampler(self):
        """Every sample interval: how many devices are alive, allocated, and how busy they were."""
        seen: dict[int, float] = {}  # id(worker) -> its busy seconds at the previous sample
        while True:
            yield self.env.timeout(self.sample_interval)
            alive = [w for w in self.all_workers if w.alive and w.id is not None]
            busy_s = 0.0
            for w in alive:  # only devices alive now: a failed one neither counts nor divides
                now_busy = w.busy_until_now()
                busy_s += now_busy - seen.get(id(w), 0.0)
                seen[id(w)] = now_busy
            core_workers = self.core.workers
            bound = [core_workers[w.id].bound for w in alive if w.id in core_workers]  # type: ignore[index]
            busy = min(1.0, busy_s / (self.sample_interval * len(alive))) if alive else 0.0
            self.samples.append(Sample(self.env.now, len(alive), sum(b > 0 for b in bound), sum(bound), busy))

    def _default_end(self) -> float:
        """Without duration_s: a generous cap, so a workload that cannot finish still ends."""
        last = self.specs[-1].arrival if self.specs else 0.0
        return last + 10 * sum(s.duration for s in self.specs) + 3600.0

    def end_guess(self) -> float:
        """Roughly when the run ends, to size the sampling interval."""
        if self.scenario.duration_s is not None:
            return self.scenario.duration_s
        last = self.specs[-1].arrival if self.specs else 0.0
        return max(last + max((s.duration for s in self.specs), default=1.0), 1.0)

    # ------------------------------------------------------------ running

    def run(self, chunks: int = 200) -> Iterator[float]:
        """Advance until every job ended or the end time; yields the simulated time after each slice."""
        step = self.end_guess() / chunks
        while not self.all_jobs_done.triggered and self.env.now < self.end_time:
            self.env.run(until=min(self.env.now + step, self.end_time))
            yield self.env.now
        self._check_detected()

    def run_all(self) -> None:
        for _ in self.run():
            pass

    def jobs_ended(self) -> int:
        return sum(r.finished is not None or r.failed is not None for r in self.jobs)
