"""The harness: one real `ControllerCore` on a simpy clock, fake workers and jobs around it.

The harness is the core's adapter, like the gRPC server: it feeds events with `env.now` and performs the
effects it gets back (a Reply wakes the process waiting for it, a SendExecute lands in a fake worker, a
SetTimer becomes a simpy timeout with replace-by-key semantics). Nothing in the core knows it is simulated.
Heartbeats with nothing new, due in one heartbeat slot, go to the core as one `WorkersAlive` (see `alive`); idle
workers' are one roster per slot phase, with no call per worker (see `quiet`).

What the harness observes, it observes from outside the core, through the core's observer surface only: the
notices among the effects (a `Placed` session wakes its queued job, `Frozen` counts as a preemption, `Recovered`
ends a job's stall, a `Fenced` worker is a detected failure), the read-only `core.view` (queue length, leases
and bound devices for the samples, the sessions on a worker when it fails), and the replies to admin requests
(a drain's moves are the migrations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from heapq import heappush

import simpy

from dtorch_controller.core import Config, ControllerCore, counter_ids
from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_controller.core.timers import Heartbeat
from dtorch_protocol import messages as m
from dtorch_sim.jobs import GB, JobRecord, JobSpec, end_guess, generate, horizon, job, node_groups
from dtorch_sim.policies import make_policy
from dtorch_sim.scenario import Elastic, Fault, NodeGroup, Scenario
from dtorch_sim.workers import Worker

_SYNC = object()  # a request whose reply the caller reads at once (workers: Register, Report)
_ASK = object()  # a job's request, while the core handles it (see `ask`)
_SEND_EXECUTE, _REPLY = fx.SendExecute, fx.Reply  # the effects of nearly every event, looked up once
WAITING = "waiting"  # the schedule of a session whose mesh request is queued (core.view.schedule)
LOST = "lost"  # the state of a worker the core declared lost (core.view.worker_state)
FOREVER_S = 1e12
DRAIN_RETRY_S = 30.0  # a refused drain (nowhere to move a session yet) is asked again this often
STALL_CHECK = 65_536  # the run's watchdog looks at the clock every 65,536 simulator events
STALL_EVENTS = 1 << 22  # simulator events at one simulated time (plus 64 per job and worker) that mean a stall
GC_THRESHOLD = (50_000, 20, 20)  # while the clock runs: Python's default is (700, 10, 10); see `_rare_collections`


class Stalled(RuntimeError):
    """The simulated clock stopped advancing: a bug, or a setting the simulator cannot handle."""

    def __init__(self, at: float, events: int, core_events: int) -> None:
        super().__init__(f"the simulation stopped making progress at t={at:.6f}s: {events:,} simulator events "
                         f"({core_events:,} of them fed to the controller core) without the simulated clock "
                         "advancing; this is a simulator bug or a setting it cannot handle: please report it "
                         "with the scenario")
        self.at = at


@dataclass
class FailureRecord:
    """One worker that stopped: when, when the core noticed, and when the jobs it hurt ran again."""

    kind: str  # worker_failure | node_failure | partition | remove_nodes
    worker: str  # address
    at: float
    detected: float | None = None
    recovered: float | None = None  # every job it hit runs again (or ended); detection time when it hit none
    jobs: list[str] = field(default_factory=list)  # ids of the jobs with devices on it
    pending: set[str] = field(default_factory=set)  # jobs hit that do not run again yet
    stalling: set[str] = field(default_factory=set)  # jobs hit that still hold their devices without progress
    stalled_device_s: float = 0.0  # devices of the jobs it hit x time until each ran again or let them go


@dataclass
class Move:
    """A logical-device move reported by a drain."""

    at: float
    session: str
    devices: int
    bytes: int
    downtime_s: float


@dataclass(frozen=True)
class Sample:
    t: float
    alive: int  # registered workers that run
    allocated: int  # alive workers leased to at least one session
    bound: int  # logical devices bound on alive workers (above `alive`: virtual devices)
    busy: float  # mean fraction of the interval the alive workers spent executing
    queued: int  # sessions waiting to be placed (the scheduler's queue)
    frozen: int  # sessions frozen (preempted), waiting to resume on their devices
    unallocated: float  # share of the alive devices' capacity no session leases (a packed lease: its cap)
    requested: float  # share of capacity the running jobs asked for (a fractional job: its fraction)


class Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = sc = scenario
        self.env = simpy.Environment()
        self.rng = random.Random(f"sim-{sc.seed}")
        config = {"heartbeat_interval_s": sc.heartbeat.interval_s, "heartbeat_timeout_s": sc.heartbeat.timeout_s,
                  "max_sync_timeout_s": FOREVER_S, "session_timeout_s": 0.0,  # simulated clients never vanish
                  "snapshot_every_batches": sc.recovery.snapshot_every_batches,
                  "snapshot_every_s": sc.recovery.snapshot_every_s,
                  "dispatch_ahead": sc.controller.dispatch_ahead}
        known = {f.name for f in dataclasses.fields(Config)}
        self.core = ControllerCore(Config(**{k: v for k, v in config.items() if k in known}),
                                   session_ids=counter_ids("s"),
                                   policy=make_policy(sc.policy.name, sc.policy.for_name(sc.policy.name)))
        self.events = 0  # events fed to the core
        self.notes: list[str] = []  # harness remarks (refused drains, ...), in metrics.json
        self._request_ids = itertools.count()
        self._waiting: dict[int, object] = {}
        self._registering: Worker | None = None  # the worker whose Register the core handles now (see `send`)
        self._replies: dict[int, object] = {}
        self._timers: dict[Hashable, int] = {}  # key -> generation of the live timer
        self._held: dict[Hashable, float] = {}  # heartbeat deadlines of healthy workers, held back (see `set_timer`)
        self._timer_gen = itertools.count()
        self._slots: dict[float, list] = {}  # time -> calls due then (see `later`)
        self._group: list | None = None  # [time, eid, calls] of the last `at_end` event scheduled
        self.merged = 0  # calls that joined the `at_end` event before them (simpy events saved)
        self.answered = 0  # jobs' requests answered at once and resumed with no simpy event (see `ask`)
        self._alive: dict[str, float] = {}  # worker id -> utilization: heartbeats with nothing new (see `alive`)
        self._slot = sc.heartbeat.interval_s / sc.heartbeat.batch_slots if sc.heartbeat.batch_slots else 0.0
        self._rosters: dict[int, dict[str, Worker]] = {}  # slot phase -> idle workers it beats for (see `quiet`)
        self._joining: dict[float, dict[str, Worker]] = {}  # time -> idle workers that join their roster then
        self._roster_due: dict[int, float] = {}  # slot phase -> when its roster beats next
        self._roster_last: dict[int, float] = {}  # slot phase -> when its roster beat last
        self.workers: dict[str, Worker] = {}  # core id -> worker
        self.by_address: dict[str, Worker] = {}  # address -> the worker process there now
        self.all_workers: list[Worker] = []  # every worker process, in creation order
        self.nodes: dict[str, list[Worker]] = {}  # node -> its workers now
        self.node_groups: dict[str, NodeGroup] = {}
        self.removed_nodes: set[str] = set()
        self.failures: list[FailureRecord] = []
        self._undetected: dict[str, FailureRecord] = {}  # core worker id -> its failure, until the core notices
        self._hurt: dict[str, list[FailureRecord]] = {}  # job id -> failures waiting for it to run again
        self.samples: list[Sample] = []
        self.alive_n = 0  # registered worker processes that run
        self._busy_total = 0.0  # busy seconds of finished (or cut) batches, all workers
        self._running_n = 0  # batches running now
        self._running_since = 0.0  # sum of their start times
        self.moves: list[Move] = []
        self.fenced_workers = 0  # declared lost while alive (slow, partitioned) and told so
        self.drains_refused = 0  # drain requests the core refused (asked again later)
        self.preemptions = 0
        self.resumes = 0
        self.relocations = 0  # frozen sessions resumed on free devices (their state moved there)
        self.moved_bytes = 0  # bytes of logical devices moved between workers (relocations, growth, drains)
        self.move_s = 0.0  # device-seconds those copies took
        self.swapped_bytes = 0  # bytes of frozen state offloaded to host memory and loaded back
        self.swap_s = 0.0
        self.recoveries = 0  # sessions the core rebuilt after a worker loss
        self.redone_device_s = 0.0  # step work done again (replays, restarts) or cut short by a failure
        self.session_jobs: dict[str, JobRecord] = {}  # open session -> its job
        self._placing: dict[str, simpy.Event] = {}  # session -> event fired when the scheduler places it
        self._frozen_now: dict[str, float] = {}  # sessions frozen now (Frozen and Resumed notices) -> since when
        self._high: dict[str, dict[int, int]] = {}  # job id -> logical device -> highest step finished
        self.specs = generate(sc)
        self.jobs = [JobRecord(spec) for spec in self.specs]
        self.jobs_done = 0
        self.all_jobs_done = self.env.event()
        self.all_jobs_done.callbacks.append(simpy.core.StopSimulation.callback)  # stop right there
        self._share_memory = min(dt.memory_gb for dt in sc.cluster.device_types.values())
        self.end_time = horizon(sc, self.specs)
        self.sample_interval = sc.metrics.sample_interval_s or self.end_guess() / 200
        for group in node_groups(sc):
            self.add_nodes(group)
        self.initial_devices = len(self.all_workers)
        self.stall_events = STALL_EVENTS + 64 * (len(self.jobs) + self.initial_devices)
        self.env.process(self.arrivals())
        for i, fault in enumerate(sc.faults):
            self.env.process(self.inject(fault, i))
        for change in sc.elastic:
            self.env.process(self.elastic(change))
        if sc.autoscaler is not None:
            self.env.process(self.autoscale())
        self.env.process(self.sampler())

    # ------------------------------------------------------------ the adapter

    def request(self, make: Callable[[int], ev.Event]) -> simpy.Event:
        """Feed `make(request_id)` to the core; the returned event fires with the Reply's message."""
        rid = next(self._request_ids)
        done = self.env.event()
        self._waiting[rid] = done
        self.handle(make(rid))
        return done

    def ask(self, make: Callable[[int], ev.Event]) -> Iterator[simpy.Event]:
        """`request`, for a job's process: `reply = yield from sim.ask(make)`. An answer the core gives at once (a
        Submit, an open, a close) resumes the job at once, with no simpy event, when the event that would have
        resumed it would have run next anyway: nothing in the heap runs before it (the events at this instant
        scheduled earlier; anything scheduled later, in this event or after it, runs after it, as it would have).
        Otherwise it is that event, with the id it would have had (drawn when the reply came). The job's process
        is the only one waiting for its answer, and nothing else runs between its own resumption and the rest of
        the event it runs in (a job's own event has no other callback)."""
        rid = next(self._request_ids)
        self._waiting[rid] = _ASK
        self.handle(make(rid))
        answer = self._replies.pop(rid, None)
        if answer is None:  # answered later (a parked Sync, a queued mesh): the reply succeeds the event
            done = self._waiting[rid] = self.env.event()
            return (yield done)
        eid, message = answer
        env = self.env
        queue = env._queue
        if queue and queue[0] < (env._now, simpy.core.NORMAL, eid):  # another event runs first: as before
            done = simpy.Event(env)
            done._ok, done._value = True, message
            heappush(queue, (env._now, simpy.core.NORMAL, eid, done))  # what succeed() scheduled, with its id
            return (yield done)
        self.answered += 1
        return message

    def call(self, kind: Callable[[int, object], ev.Event], msg: object) -> object:
        """Feed `kind(request_id, msg)`, a request the core answers at once (Register, Report), and return the
        answer (None if later)."""
        rid = next(self._request_ids)
        self._waiting[rid] = _SYNC
        self.handle(kind(rid, msg))
        self._waiting.pop(rid, None)
        return self._replies.pop(rid, None)

    def register(self, worker: Worker, msg: m.RegisterWorker) -> object:
        """Register `worker` and return the answer. The core may give it work in the same event, before the reply
        says its id (a queued job or a frozen session waiting for devices): `send` delivers that work to it."""
        self._registering = worker
        try:
            return self.call(ev.Register, msg)
        finally:
            self._registering = None

    def alive(self, worker: Worker, utilization: float) -> None:
        """`worker` beats with nothing new (no completion, no error, the same shards: workers.Worker._beat): it
        joins the `WorkersAlive` of this heartbeat slot, fed before any other event and when the slot's calls are
        done, so the core sees the same reports in the same order as one `Report` each (its rule 13)."""
        self._alive[worker.id] = utilization  # type: ignore[index]

    def quiet(self, worker: Worker, due: float) -> bool:
        """`worker` is idle with everything told (workers.Worker._next_beat): from `due` (its next heartbeat) on, the
        roster of its slot phase beats for it, one `alive` entry (utilization 0) an interval apart, the entries its
        own beats would have made, until `wake`. On a long trace most devices idle most of the time, and their
        beats were a quarter of the run. False with exact timing (no slots): it beats on its own."""
        if not self._slot:
            return False
        joining = self._joining.get(due)
        if joining is None:
            joining = self._joining[due] = {}
            self.later(due, self._join, due)
        joining[worker.id] = worker  # type: ignore[index]
        worker.quiet = (None, due)
        return True

    def _join(self, due: float) -> None:
        """The workers joining at `due` beat (this slot's entries) and join the roster of their phase."""
        joining = self._joining.pop(due)
        if not joining:
            return
        phase = round(due / self._slot) % self.scenario.heartbeat.batch_slots
        roster, alive = self._rosters.setdefault(phase, {}), self._alive
        for worker_id, worker in joining.items():
            alive.setdefault(worker_id, 0.0)  # the roster may have beaten in this slot already
            roster[worker_id] = worker
            worker.quiet = (phase, due)
        if phase not in self._roster_due:
            nxt = self._roster_due[phase] = self.slot_after(due + self.scenario.heartbeat.interval_s)
            self.later(nxt, self._roster_beat, phase)

    def wake(self, worker: Worker) -> float:
        """`worker` leaves its roster (or the queue to join one); returns when it last beat (or reported)."""
        phase, since = worker.quiet  # type: ignore[misc]
        worker.quiet = None
        if phase is None:  # not joined yet: `since` is when it would have, and its last report stands
            del self._joining[since][worker.id]  # type: ignore[arg-type]
            return worker.last_report
        del self._rosters[phase][worker.id]  # type: ignore[arg-type]
        return max(since, self._roster_last.get(phase, since))

    def _roster_beat(self, phase: int) -> None:
        del self._roster_due[phase]
        roster = self._rosters[phase]
        if not roster:
            return
        now = self._roster_last[phase] = self.env.now
        alive = self._alive
        if alive:
            for worker_id in roster:
                alive.setdefault(worker_id, 0.0)  # the ones that joined in this slot have beaten already
        else:
            alive.update(dict.fromkeys(roster, 0.0))  # the same entries in the same order, at C speed
        due = self._roster_due[phase] = self.slot_after(now + self.scenario.heartbeat.interval_s)
        self.later(due, self._roster_beat, phase)

    def _feed_alive(self) -> None:
        batch, self._alive = self._alive, {}
        reply = self.call(ev.WorkersAlive, batch)
        for worker_id in reply.fenced:  # type: ignore[attr-defined]
            self.fenced(self.workers[worker_id])

    def handle(self, event: ev.Event) -> None:
        """Feed one event and perform its effects in order; failed sends come back as events, fed next."""
        if self._alive:
            self._feed_alive()
        more = self._handle(event)
        while more:
            follow = more.popleft()
            more.extend(self._handle(follow) or ())

    def _handle(self, event: ev.Event) -> deque | None:
        self.events += 1
        more = None
        for effect in self.core.handle(self.env._now, event):
            kind = type(effect)
            if kind is _SEND_EXECUTE:
                failed = self.send(effect)
                if failed is not None:
                    more = more or deque()
                    more.append(failed)
            elif kind is _REPLY:
                waiter = self._waiting.pop(effect.request_id, None)
                if waiter is _SYNC:
                    self._replies[effect.request_id] = effect.message
                elif waiter is _ASK:  # the id the event resuming the job would draw now (see `ask`)
                    self._replies[effect.request_id] = (next(self.env._eid), effect.message)
                elif waiter is not None:
                    waiter.succeed(effect.message)  # type: ignore[attr-defined]
            elif kind is fx.SetTimer:
                self.set_timer(effect.at, effect.key)
            else:
                self.notice(effect)  # type: ignore[arg-type]
        return more

    def later(self, at: float, fn: Callable[[object], None], arg: object) -> None:
        """Call `fn(arg)` at time `at`; calls due at the same time share one simpy event (heartbeat slots)."""
        bucket = self._slots.get(at)
        if bucket is None:
            bucket = self._slots[at] = []
            self.env.timeout(max(0.0, at - self.env.now), at).callbacks.append(self._run_slot)
        bucket.append((fn, arg))

    def at_end(self, delay: float, fn: Callable[[object], None], arg: object) -> None:
        """Call `fn(arg)` after `delay`, as a simpy timeout made now would: the end of a batch on a worker. Calls due
        at the same instant whose timeouts would have been made one right after the other (consecutive event ids,
        nothing else scheduled between them: the workers of one step, sent one batch each by one core event)
        share one simpy event, which calls them in order where their own events would have run one after the
        other: nothing else can run between them at that instant (it would be scheduled later, so it runs after
        them; the urgent events, processes starting, are never made by these calls). The event ids are drawn as
        the timeouts would have drawn them, so every other event keeps its place."""
        env = self.env
        at = env._now + delay
        eid = next(env._eid)
        group = self._group
        if group is not None and group[1] == eid - 1 and group[0] == at:
            group[1] = eid
            group[2].append((fn, arg))
            self.merged += 1
            return
        calls = [(fn, arg)]
        self._group = [at, eid, calls]
        event = simpy.Event(env)
        event._ok, event._value = True, calls
        event.callbacks.append(self._run_group)  # type: ignore[union-attr]
        heappush(env._queue, (at, simpy.core.NORMAL, eid, event))  # what env.schedule does, with that id

    def _run_group(self, event: simpy.Event) -> None:
        calls = event._value
        if self._group is not None and self._group[2] is calls:
            self._group = None  # running: a call made now is a new event
        for fn, arg in calls:
            fn(arg)

    def _run_slot(self, event: simpy.Event) -> None:
        for fn, arg in self._slots.pop(event.value):
            fn(arg)
        if self._alive:
            self._feed_alive()

    def slot_after(self, at: float) -> float:
        """`at`, rounded up to the next heartbeat slot (exact when the scenario asks for exact timing)."""
        q = self._slot
        return math.ceil(at / q - 1e-9) * q if q else at

    def send(self, effect: fx.SendExecute) -> ev.WorkerUnreachable | None:
        worker = self.workers.get(effect.worker_id)
        if worker is None:  # registering right now: the core may give it work before its Register call returns
            worker = self._registering if self._registering is not None and \
                self._registering.address == effect.address else None
        if worker is None or not worker.alive:
            if worker is None or worker.crash:
                return ev.WorkerUnreachable(effect.worker_id, effect.address, "connection refused")
            return None  # a silent (hung) worker swallows it
        if worker.partitioned:
            return ev.WorkerUnreachable(effect.worker_id, effect.address, "network partition: no route to worker")
        latency = self.scenario.cost.rpc_latency_s
        if latency:
            self.env.timeout(latency).callbacks.append(lambda _e: worker.deliver(effect.execute)
                                                       if worker.alive else None)
        else:
            worker.deliver(effect.execute)
        return None

    def set_timer(self, at: float, key: Hashable) -> None:
        """A callback on a simpy timeout (not a process: there is one per worker per interval). The core's
        heartbeat deadlines share the workers' heartbeat slots: they fire at most one slot late, which the core
        allows (its timers may fire late; each firing rechecks the state).

        A healthy worker's heartbeat deadline is held back until the worker stops or is cut off (`unhold`): a
        worker that runs reports at least every interval (plus a slot), so the deadline could only find it on
        time and set the next one; held, it costs no event (a third of the core's events on a long trace). The
        key names the worker (a deadline set while a worker registers is that worker's: its id is not known yet).
        Released, it fires when it was due or at once if that is past, and finds the state the same
        late firing would have found: the last report less than two intervals ago, so it only sets the next
        deadline (from that report) as it would have anyway."""
        gen = self._timers[key] = next(self._timer_gen)
        if at > self.end_time:
            return  # the run ends first (parked Syncs wait "forever"): keep it out of the event heap
        if type(key) is Heartbeat:
            worker = self.workers.get(key.worker)
            if worker is None:  # its first deadline, set while it registers: the core has not told it its id yet
                worker = self._registering
            if worker is not None and worker.alive and not worker.partitioned:
                self._held[key] = at
                return
            if self._slot:
                self.later(self.slot_after(at), self._fire_key, (key, gen))
                return
        self.env.timeout(max(0.0, at - self.env.now), (key, gen)).callbacks.append(self._fire)

    def unhold(self, worker: Worker) -> None:
        """`worker` stopped or was cut off: its held heartbeat deadline (see `set_timer`) goes on the clock."""
        key = Heartbeat(worker.id)
        at = self._held.pop(key, None)
        if at is not None:
            self.set_timer(max(at, self.env.now), key)

    def _fire(self, event: simpy.Event) -> None:
        self._fire_key(event.value)

    def _fire_key(self, key_gen: tuple) -> None:
        key, gen = key_gen
        if self._timers.get(key) == gen:  # not replaced by a later SetTimer with the same key
            del self._timers[key]
            self.handle(ev.TimerFired(key))

    # ------------------------------------------------------------ what the harness watches

    def notice(self, n: fx.Notice) -> None:
        """What the core says happened: the only way the harness learns about placements, preemptions,
        recoveries and failures it detected."""
        kind = type(n)
        if kind is fx.Placed:
            waiter = self._placing.pop(n.session, None)  # type: ignore[attr-defined]
            if waiter is not None and not waiter.triggered:
                waiter.succeed()
        elif kind is fx.Frozen:
            self.preemptions += 1
            self._frozen_now.setdefault(n.session, self.env.now)  # type: ignore[attr-defined]
            rec = self.session_jobs.get(n.session)  # type: ignore[attr-defined]
            if rec is not None:
                rec.preemptions += 1
        elif kind is fx.Resumed:
            self.resumes += 1
            self._thaw(n.session)  # type: ignore[attr-defined]
        elif kind is fx.Relocated:
            self.relocations += 1
        elif kind is fx.Recovered:
            rec = self.session_jobs.get(n.session)  # type: ignore[attr-defined]
            if rec is not None:
                self.recoveries += 1
                rec.recoveries += 1
                self.job_running(rec)
        elif kind is fx.Fenced or kind is fx.Drained:  # declared lost, or released after a drain
            record = self._undetected.pop(n.worker, None)  # type: ignore[attr-defined]
            if record is not None:
                record.detected = self.env.now
                if not record.pending:
                    record.recovered = self.env.now

    def _thaw(self, session: str) -> None:
        """`session` is no longer frozen (resumed or closed): its job counts the time it spent frozen."""
        since = self._frozen_now.pop(session, None)
        rec = self.session_jobs.get(session)
        if since is not None and rec is not None:
            rec.frozen_s += self.env.now - since

    def placed_or_timeout(self, session: str, retry_s: float) -> simpy.Event:
        """For a queued job: fires when the scheduler places its session, or after `retry_s` at the latest."""
        if self.core.view.schedule(session) != WAITING:
            return self.env.timeout(0)
        placed = self._placing[session] = self.env.event()
        return placed | self.env.timeout(retry_s)

    # ------------------------------------------------------------ jobs

    def arrivals(self):
        """Start each job's process at its arrival (one pending timeout for all of them, not one each)."""
        for rec in self.jobs:
            if rec.spec.arrival > self.env.now:
                yield self.env.timeout(rec.spec.arrival - self.env.now)
            self.env.process(job(self, rec))

    def memory_cap(self, spec: JobSpec) -> int:
        """A job asking for a share of a device declares that share of the smallest device memory as its cap
        (packing policies then share devices; others give it a whole one)."""
        return int(spec.share * self._share_memory * GB) if spec.share < 1 else 0

    def state_bytes(self, spec: JobSpec, cap: int) -> int:
        size = int(spec.state_gb * GB)
        return min(size, cap // 4) if cap else size

    def session_opened(self, session: str, rec: JobRecord) -> None:
        self.session_jobs[session] = rec
        rec.sessions.append(session)

    def session_closed(self, session: str) -> None:
        self._thaw(session)
        rec = self.session_jobs.pop(session, None)
        self._placing.pop(session, None)
        if rec is not None:
            self._unstall(rec)

    def _unstall(self, rec: JobRecord) -> None:
        """The job lets its devices go (it closed its session to restart) or runs again: its stall ends."""
        stalling = [r for r in self._hurt.get(rec.spec.id, ()) if rec.spec.id in r.stalling]
        if stalling:  # several failures at once (a node) stall the job once, from the first of them
            first = min(stalling, key=lambda r: r.at)
            first.stalled_device_s += rec.spec.devices * (self.env.now - first.at)
            for record in stalling:
                record.stalling.discard(rec.spec.id)

    def job_running(self, rec: JobRecord) -> None:
        """The job's session runs (placed after a restart, or rebuilt): failures that hit it are recovered."""
        self._unstall(rec)
        records = self._hurt.pop(rec.spec.id, None)
        for record in records or ():
            record.pending.discard(rec.spec.id)
            if not record.pending:
                record.recovered = max(self.env.now, record.detected or self.env.now)

    def job_ended(self, rec: JobRecord) -> None:
        self.job_running(rec)
        self.jobs_done += 1
        if self.jobs_done == len(self.jobs):
            self.all_jobs_done.succeed()

    def work_done(self, rec: JobRecord, steps: dict[int, int], work: float) -> None:
        """A worker finished step work of `rec` (device -> step index): new steps advance, others are redone."""
        rec.work_s += work
        if not steps:
            return
        high = self._high.get(rec.spec.id)
        if high is None:
            high = self._high[rec.spec.id] = {}
        per_device = work / len(steps)
        for d, step in steps.items():
            if step <= high.get(d, -1):
                self.redone_device_s += per_device
            else:
                high[d] = step

    def moved(self, session: str, nbytes: int, seconds: float) -> None:
        """A worker copied `nbytes` of a session's devices that move (relocation, growth, shrink, drain)."""
        self.moved_bytes += nbytes
        self.move_s += seconds
        rec = self.session_jobs.get(session)
        if rec is not None:
            rec.moved_bytes += nbytes

    def swapped(self, nbytes: int, seconds: float) -> None:
        """A worker offloaded frozen state to host memory or loaded it back (workers.Worker._swap)."""
        self.swapped_bytes += nbytes
        self.swap_s += seconds

    def work_lost(self, rec: JobRecord | None, work: float) -> None:
        """A failure cut a step short: what it had done is lost."""
        if rec is not None:
            rec.work_s += work
        self.redone_device_s += work

    # ------------------------------------------------------------ workers coming and going

    def add_nodes(self, group: NodeGroup) -> list[str]:
        names = []
        for _ in range(group.count):
            node = f"{group.name}{len(self.nodes)}"
            names.append(node)
            self.node_groups[node] = group
            self.nodes[node] = [self._worker(f"{node}/gpu{d}", node, group) for d in range(group.devices_per_node)]
        return names

    def _worker(self, address: str, node: str, group: NodeGroup) -> Worker:
        dtype = self.scenario.cluster.device_types[group.device_type]
        w = Worker(self, address, node, group.device_type, dtype.speed, dtype.memory_gb,
                   {**group.labels, "node": node})
        self.all_workers.append(w)
        self.by_address[address] = w
        w.start()
        return w

    def restart_worker(self, old: Worker) -> None:
        """A new worker process at the same address (after a repair, or a fence): it registers anew."""
        if old.node in self.removed_nodes or self.by_address.get(old.address) is not old:
            return
        group = self.node_groups[old.node]
        new = self._worker(old.address, old.node, group)
        self.nodes[old.node] = [new if w is old else w for w in self.nodes[old.node]]

    def registered(self, worker: Worker) -> None:
        self.workers[worker.id] = worker  # type: ignore[index]
        self.alive_n += 1

    def fenced(self, worker: Worker) -> None:
        """The core answered a report with "fenced": released after a drain, or declared lost while alive."""
        if not worker.draining:
            self.fenced_workers += 1
        worker.stop()

    def note(self, text: str) -> None:
        self.notes.append(f"{self.env.now:.3f} {text}")

    def stop_worker(self, worker: Worker, kind: str, crash: bool = False) -> FailureRecord | None:
        if not worker.alive:
            return None
        worker.crash = crash
        worker.stop()
        return self._record_failure(worker, kind)

    def _record_failure(self, worker: Worker, kind: str) -> FailureRecord:
        record = FailureRecord(kind, worker.address, self.env.now)
        self.failures.append(record)
        state = self.core.view.worker_state(worker.id) if worker.id is not None else None
        if state is not None and state != LOST:
            self._undetected[worker.id] = record  # type: ignore[index]
            for session in sorted(self.core.view.sessions_on(worker.id)):  # type: ignore[arg-type]
                rec = self.session_jobs.get(session)
                if rec is not None and rec.spec.id not in record.pending:
                    record.jobs.append(rec.spec.id)
                    record.pending.add(rec.spec.id)
                    if session not in self._frozen_now:  # a frozen job was not running: the failure stalls nothing
                        record.stalling.add(rec.spec.id)
                    self._hurt.setdefault(rec.spec.id, []).append(record)
        else:
            record.detected = record.recovered = self.env.now
        return record

    def alive_workers(self) -> list[Worker]:
        return [w for ws in self.nodes.values() for w in ws if w.alive]

    def inject(self, fault: Fault, index: int):
        """One fault at its time, or recurring ones with exponential gaps of mean `mtbf_s`."""
        rng = random.Random(f"faults-{self.scenario.seed}-{index}")
        while True:
            if fault.at is not None:
                yield self.env.timeout(max(0.0, fault.at - self.env.now))
            else:
                yield self.env.timeout(rng.expovariate(1.0 / fault.mtbf_s))  # type: ignore[operator]
            for worker in self._targets(fault, rng):
                if fault.kind == "slow_worker":
                    self.env.process(self.slow_down(worker, fault))
                elif fault.kind == "partition":
                    self.env.process(self.partition(worker, fault))
                else:
                    self.stop_worker(worker, fault.kind, crash=fault.mode == "crash")
                    if fault.repair_s is not None:
                        self.env.timeout(fault.repair_s).callbacks.append(
                            lambda _e, w=worker: self.restart_worker(w))
            if fault.at is not None:
                return

    def _targets(self, fault: Fault, rng: random.Random) -> list[Worker]:
        alive = [w for w in self.alive_workers() if w.id is not None and not w.partitioned]
        if fault.kind == "node_failure" or (fault.node and not fault.worker):
            nodes = sorted({w.node for w in alive})
            node = fault.node if fault.node else (rng.choice(nodes) if nodes else None)
            return [w for w in self.nodes.get(node or "", []) if w.alive]
        if fault.worker:
            return [w for w in alive if w.address == fault.worker]
        return [rng.choice(alive)] if alive else []

    def _until(self, fault: Fault) -> float:
        return fault.until if fault.until is not None else self.env.now + (fault.duration_s or 0.0)

    def slow_down(self, worker: Worker, fault: Fault):
        worker.slow = fault.factor
        if fault.until is not None or fault.duration_s is not None:
            yield self.env.timeout(max(0.0, self._until(fault) - self.env.now))
            worker.slow = 1.0

    def partition(self, worker: Worker, fault: Fault):
        """Cut the worker off from the controller: its reports are lost and sends to it fail; it keeps running
        what it has. When the partition heals its next report gets through (or is answered "fenced")."""
        worker.cut_off()
        self.unhold(worker)
        record = self._record_failure(worker, "partition")
        yield self.env.timeout(max(0.0, self._until(fault) - self.env.now))
        if worker.alive:
            worker.heal()
        worker.partitioned = False
        if not worker.alive:  # fenced: it was declared lost meanwhile
            if fault.repair_s is not None:
                self.env.timeout(fault.repair_s).callbacks.append(lambda _e: self.restart_worker(worker))
        elif record.detected is None:  # healed before the controller noticed: nothing was lost
            self._undetected.pop(worker.id, None)  # type: ignore[arg-type]
            for job_id in record.jobs:
                self._hurt[job_id] = [r for r in self._hurt.get(job_id, []) if r is not record]
            record.pending.clear()
            record.stalling.clear()
            record.recovered = self.env.now

    def elastic(self, change: Elastic):
        yield self.env.timeout(change.at)
        if change.action == "add_nodes":
            self.add_nodes(change.add)  # type: ignore[arg-type]
            return
        live = [n for n in self.nodes if n not in self.removed_nodes]
        names = [n for n in change.nodes if n in live] if change.nodes else live[-change.count:]  # type: ignore
        for node in names:
            self.remove_node(node, change.mode, change.drain_timeout_s)

    def remove_node(self, node: str, mode: str, drain_timeout_s: float = 3600.0) -> None:
        """Take a node out: drain its workers (their shards move to other workers first), or kill them (like a
        failure)."""
        self.removed_nodes.add(node)
        workers = [w for w in self.nodes.get(node, []) if w.alive]
        if mode == "drain":
            drained = [w for w in workers if w.id is not None and not w.partitioned]
            for w in drained:
                w.draining = True
            self.env.process(self._drain_node(drained, self.env.now + drain_timeout_s))
            workers = [w for w in workers if w not in drained]
        for worker in workers:
            self.stop_worker(worker, "remove_nodes")

    def _drain_node(self, workers: list[Worker], deadline: float):
        """Drain a node's workers: the ones hosting nothing first, then the others one at a time, so that the
        core never moves a session onto a worker of the node that is drained away under it (it picks a free
        worker, else one the session already uses). A refused or failed drain (nowhere to move a session yet)
        is asked again after DRAIN_RETRY_S; a worker not drained by the deadline is stopped."""
        hosting = {w.id for w in workers if self.core.view.sessions_on(w.id)}  # type: ignore[arg-type]
        for w in sorted(workers, key=lambda w: (w.id in hosting, w.address)):
            while w.alive:
                request = m.DrainRequest(worker=w.id, timeout_s=FOREVER_S)  # type: ignore[arg-type]
                reply = yield self.request(lambda r, request=request: ev.Drain(r, request))
                if not isinstance(reply, fx.Refusal) and reply.ok:
                    for mv in reply.moves:
                        self.moves.append(Move(self.env.now, mv.session, len(mv.devices), mv.bytes, mv.downtime_s))
                    w.stop()  # released by the core; its next report would be fenced
                    break
                if not w.alive:
                    break
                why = reply.message
                if self.env.now + DRAIN_RETRY_S > deadline:
                    self.note(f"drain of {w.address} failed ({why}): the worker is stopped instead")
                    w.draining = False
                    self.stop_worker(w, "remove_nodes")
                    break
                self.drains_refused += 1
                yield self.env.timeout(DRAIN_RETRY_S)

    def autoscale(self):
        """The autoscaler rule: add nodes while sessions wait, drain idle added ones when none do."""
        rule = self.scenario.autoscaler
        assert rule is not None
        added: list[str] = []  # nodes it added, oldest first
        provisioning = 0
        idle_since: dict[str, float] = {}
        view = self.core.view

        def arrive(_e) -> None:
            nonlocal provisioning
            provisioning -= 1
            added.extend(self.add_nodes(rule.node.model_copy(update={"count": 1, "name": rule.node.name})))

        while True:
            yield self.env.timeout(rule.check_interval_s)
            now = self.env.now
            queued = view.queued
            live = [n for n in added if n not in self.removed_nodes]
            if queued >= rule.scale_up_queued and len(live) + provisioning < rule.max_nodes:
                for _ in range(min(rule.step, rule.max_nodes - len(live) - provisioning)):
                    provisioning += 1
                    self.env.timeout(rule.provision_s).callbacks.append(arrive)
                continue
            for node in live:
                ids = [w.id for w in self.nodes[node] if w.alive and w.id is not None]
                if all(not view.leased(i) for i in ids):
                    idle_since.setdefault(node, now)
                else:
                    idle_since.pop(node, None)
            if queued == 0 and len(live) > rule.min_nodes:
                idle = [n for n in live if n in idle_since and now - idle_since[n] >= rule.scale_down_idle_s]
                if idle:
                    self.remove_node(idle[-1], "drain")
                    idle_since.pop(idle[-1], None)

    # ------------------------------------------------------------ measuring

    def busy_start(self, at: float) -> None:
        self._running_n += 1
        self._running_since += at

    def busy_end(self, started: float, elapsed: float) -> None:
        self._running_n -= 1
        self._running_since -= started
        self._busy_total += elapsed

    def busy_seconds(self) -> float:
        """Seconds every worker ever spent executing, up to now (batches running now count so far)."""
        return self._busy_total + self._running_n * self.env.now - self._running_since

    def sampler(self):
        """Every sample interval: devices alive, allocated, busy; the queue; capacity unallocated and asked for.
        One pass over the pool's slots per sample, nothing per worker per event (10,000 workers is normal)."""
        view = self.core.view
        sessions = self.session_jobs
        frozen = self._frozen_now
        before = self.busy_seconds()
        while True:
            yield self.env.timeout(self.sample_interval)
            busy_s = self.busy_seconds()
            n = self.alive_n
            allocated = 0
            leased = requested = 0.0
            for memory, leases in view.leases():
                allocated += 1
                if 0 in leases.values() or not memory:
                    leased += 1.0
                else:
                    leased += min(1.0, sum(leases.values()) / memory)
                asked = 0.0
                for session, cap in leases.items():
                    if session in frozen:
                        continue  # a reservation: the frozen session asks for nothing while frozen
                    rec = sessions.get(session)
                    asked += rec.spec.share if rec is not None else (cap / memory if cap and memory else 1.0)
                requested += min(1.0, asked)
            bound = view.bound_devices()
            busy = min(1.0, (busy_s - before) / (self.sample_interval * n)) if n else 0.0
            before = busy_s
            allocated = min(allocated, n)
            self.samples.append(Sample(self.env.now, n, allocated, bound, busy, view.queued,
                                       len(self._frozen_now),
                                       max(0.0, 1.0 - leased / n) if n else 0.0, min(1.0, requested / n) if n else 0.0))

    def end_guess(self) -> float:
        return end_guess(self.scenario, self.specs)

    # ------------------------------------------------------------ running

    def run(self, chunks: int = 200) -> Iterator[float]:
        """Advance until every job ended or the end time; yields the simulated time after each slice. Raises
        `Stalled` when the clock stops advancing (see `_advance`)."""
        step = self.end_guess() / chunks
        with _rare_collections():
            while not self.all_jobs_done.triggered and self.env.now < self.end_time:
                self._advance(min(self.env.now + step, self.end_time))
                yield self.env.now

    def _advance(self, until: float) -> None:
        """`env.run(until)`, with a watchdog: every `STALL_CHECK` events it checks that the clock moved; after
        `stall_events` events at one simulated time it raises `Stalled` instead of looping forever."""
        env = self.env
        stop = simpy.Event(env)
        stop._ok, stop._value = True, None
        env.schedule(stop, simpy.core.URGENT, until - env.now)
        stop.callbacks.append(simpy.core.StopSimulation.callback)
        step = env.step
        n = 0
        frozen_at, since = env.now, self.events
        with contextlib.suppress(simpy.core.StopSimulation, simpy.core.EmptySchedule):
            while True:
                for _ in itertools.repeat(None, STALL_CHECK):  # the loop's only work per event: the step
                    step()
                n += STALL_CHECK
                if env.now != frozen_at:
                    frozen_at, since = env.now, self.events
                    n = 0
                elif n >= self.stall_events:
                    raise Stalled(env.now, n, self.events - since)

    def run_all(self) -> None:
        for _ in self.run():
            pass

    def jobs_ended(self) -> int:
        return self.jobs_done


@contextlib.contextmanager
def _rare_collections() -> Iterator[None]:
    """Python's cyclic garbage collector, rarely and only over what the run makes, for as long as it runs: a run's
    objects (workers, sessions, jobs, the core's records) live long and make few cycles, and at 10,000 devices
    the default thresholds spent a third of the run walking them (20% at 512). What exists when the run starts is
    frozen (never collected during it). Restoring the defaults between slices cost a full collection each (5% of
    a run): they come back when the run ends, or is abandoned."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
