"""The scheduler: admission, the queue, preemption by freezing, resuming, attained service. Sans-IO.

Rules:

1. Each session is a *tenant* whose scheduling state follows `TENANT_TABLE` (through `_step` only):
   idle (nothing asked yet) -> waiting (a mesh request queued) -> running (leases devices) <-> frozen
   (preempted: its logical devices stay bound, its shards stay on its workers, its batches are held in the
   core) -> closed. A running tenant whose every worker was lost asks again (running -> waiting).
2. Admission is all-or-nothing per mesh. A mesh of n logical devices wants n physical devices and needs at
   least `need` of them: n, or the elastic minimum `min_devices`, capped by the number of workers known when
   it asks (and at the time of each try, if workers were lost): a mesh never waits for devices that do not
   exist, and more logical devices than workers run as virtual devices. It takes up to n when free.
3. Across sessions devices are exclusive, unless the policy packs: then batch sessions that declared a memory
   cap share devices while the caps fit (pool.py). A running or frozen tenant's later meshes never wait:
   their new logical devices go to free devices when nobody is queued, else onto the tenant's own devices.
4. The queue is ordered by (policy rank, policy key, arrival). A *pass* walks it in order whenever capacity
   may have grown (worker registered or alive again, session closed, worker lost, timer) and on every new
   request; a request that cannot be placed blocks the later ones unless it could preempt them later
   (policy rules in policies/base.py). A frozen tenant in the queue resumes when all its (live) workers can
   take it again, preempting their holders if it outranks them; until then it reserves those of its
   workers that are free, so others do not take them away from it.
5. Preemption freezes running tenants of a strictly higher rank, least important and most recently started
   first, only when freezing them frees enough devices; their leases go back to the pool at once.
6. Attained service (device-seconds) accrues while running, with the number of devices leased.
7. Every public call returns `Changes`: devices to bind (placed), tenants frozen and resumed, log lines, and
   when to call `tick` next. The controller applies them; the scheduler never touches sessions or workers.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from dtorch_controller.core import state as st
from dtorch_controller.core.model import Worker
from dtorch_controller.core.policies import Policy
from dtorch_controller.core.pool import Pool, node_of

# ---------------------------------------------------------------- tenant lifecycle

IDLE = "idle"
WAITING = "waiting"
RUNNING = "running"
FROZEN = "frozen"
CLOSED = "closed"

ASK = "ask"  # a mesh request that must wait (or a running tenant that lost every worker asks again)
PLACE = "place"
FREEZE = "freeze"
RESUME = "resume"
CLOSE = "close"

TENANT_TABLE: Mapping[str, Mapping[str, str]] = {
    IDLE: {ASK: WAITING, PLACE: RUNNING, CLOSE: CLOSED},
    WAITING: {PLACE: RUNNING, CLOSE: CLOSED},
    RUNNING: {ASK: WAITING, FREEZE: FROZEN, CLOSE: CLOSED},
    FROZEN: {RESUME: RUNNING, CLOSE: CLOSED},
    CLOSED: {},
}

_EPS = 1e-9
_MIN_WAKE_S = 1e-3  # a policy deadline is never sooner than this after now (no busy timer loops)


@dataclass
class Request:
    mesh: int
    devices: tuple[int, ...]  # logical devices to bind, mesh order
    need: int  # fewest physical devices it accepts


@dataclass(eq=False)
class Tenant:
    session: str
    priority: str
    kind: str
    cap: int  # memory cap per device in bytes (0: whole devices)
    state: str = IDLE
    workers: dict[str, None] = field(default_factory=dict)  # leased (running) / to take back (frozen)
    request: Request | None = None
    arrival: int = 0  # queue tie-break, from its first request (kept through freezes)
    key: tuple | None = None  # its queue entry while queued
    rank: int = 0  # its bucket while running
    attained: float = 0.0  # device-seconds of service
    base: float = 0.0  # counted service starts here (a starvation promotion resets it)
    since: float = 0.0  # running since
    waiting_since: float | None = None
    frozen_by: str = ""
    backlog: list[Any] = field(default_factory=list)  # Submit batches held while frozen
    over_cap: set[str] = field(default_factory=set)  # workers where it was told it exceeds its cap
    stamp: int = 0  # invalidates stale wake-ups

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    @property
    def held_devices(self) -> int:
        return len(self.workers) if self.running else 0

    def service(self, now: float) -> float:
        return self.attained + (len(self.workers) * max(0.0, now - self.since) if self.running else 0.0)

    def counted(self, now: float) -> float:
        return self.service(now) - self.base


@dataclass
class Changes:
    placed: list[tuple[str, dict[int, str]]] = field(default_factory=list)  # session -> devices to bind
    frozen: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # event-log lines
    wake: float | None = None  # call tick() then (a new deadline; None: keep the current one)


@dataclass(frozen=True)
class Answer:
    placed: bool
    queue_position: int = 0
    message: str = ""


class IllegalTenantTransition(RuntimeError):
    pass


def _short(session: str) -> str:
    return session[:8]


class Scheduler:
    def __init__(self, policy: Policy, workers: Mapping[str, Worker]) -> None:
        self.policy = policy
        self.workers = workers  # the core's worker table, read only (bound counts, order)
        self.pool = Pool()
        self.tenants: dict[str, Tenant] = {}
        self._queue: list[tuple] = []  # sorted (rank, *key, arrival, session)
        self._ranks: dict[int, dict[str, None]] = {}  # running tenants by rank, in start order
        self._frozen: dict[str, None] = {}
        self._wakeups: list[tuple[float, int, str]] = []  # heap of (at, stamp, session)
        self._armed: float | None = None
        self._arrivals = itertools.count(1)
        self.decisions = 0  # placements, queueings, freezes, resumes (for benchmarks)

    # ------------------------------------------------------------ queries

    @property
    def queued(self) -> int:
        return len(self._queue)

    def position(self, session: str) -> int:
        t = self.tenants.get(session)
        if t is None or t.key is None:
            return 0
        return bisect.bisect_left(self._queue, t.key) + 1

    def state(self, session: str) -> str:
        t = self.tenants.get(session)
        return t.state if t is not None else CLOSED

    def frozen(self, session: str) -> bool:
        t = self.tenants.get(session)
        return t is not None and t.state == FROZEN

    def holding(self, session: str) -> bool:
        """Frozen with batches held: its syncs wait for the resume."""
        t = self.tenants.get(session)
        return t is not None and bool(t.backlog)

    # ------------------------------------------------------------ tenants

    def open(self, session: str, priority: str, kind: str, cap: int = 0) -> None:
        self.tenants[session] = Tenant(session, priority, kind, max(0, cap))

    def close(self, now: float, session: str) -> Changes:
        ch = Changes()
        t = self.tenants.pop(session, None)
        if t is None:
            return ch
        if t.running:
            self._stop(now, t)
        if t.key is not None:
            self._dequeue(t)
        self._frozen.pop(session, None)
        for w in t.workers:
            self.pool.release(w, session)
        t.workers.clear()
        t.backlog.clear()
        self._step(t, CLOSE)
        return self._pass(now, ch)

    def hold(self, session: str, batch: Any) -> bool:
        """Keep a frozen tenant's batch for later; False when the tenant is not frozen."""
        t = self.tenants.get(session)
        if t is None or t.state != FROZEN:
            return False
        t.backlog.append(batch)
        return True

    def take_backlog(self, session: str) -> list[Any]:
        t = self.tenants.get(session)
        if t is None:
            return []
        backlog, t.backlog = t.backlog, []
        return backlog

    def over_cap(self, worker: str, usage: Mapping[str, int]) -> list[tuple[str, int, int]]:
        """(session, bytes, cap) for tenants that just went over their memory cap on `worker`."""
        over = []
        for session, used in usage.items():
            t = self.tenants.get(session)
            if t is None or not t.cap:
                continue
            if used > t.cap and worker not in t.over_cap:
                t.over_cap.add(worker)
                over.append((session, used, t.cap))
            elif used <= t.cap:
                t.over_cap.discard(worker)
        return over

    # ------------------------------------------------------------ workers

    def add_worker(self, now: float, w: Worker) -> Changes:
        self.pool.add(w.id, node_of(w.address, w.labels), w.memory_bytes, w.order, w.state in st.PLACEABLE)
        return self._pass(now, Changes())

    def worker_changed(self, now: float, w: Worker) -> Changes:
        """A worker changed state: lost ones leave the pool; others become placeable or not."""
        if w.state == st.LOST:
            return self._lose_worker(now, w.id)
        if self.pool.set_placeable(w.id, w.state in st.PLACEABLE):
            return self._pass(now, Changes())
        return self._finish(Changes())

    def _lose_worker(self, now: float, worker: str) -> Changes:
        ch = Changes()
        leases = self.pool.remove(worker)
        for session in leases:
            t = self.tenants.get(session)
            if t is not None and t.running:
                self._accrue(now, t)
                t.workers.pop(worker, None)
                self._watch(t, now)
        for session in list(self._frozen):
            self.tenants[session].workers.pop(worker, None)
        return self._pass(now, ch)

    # ------------------------------------------------------------ meshes

    def place(self, now: float, session: str, mesh: int, devices: tuple[int, ...], min_devices: int = 0,
              ) -> tuple[Changes, Answer]:
        """Place `devices` (not yet bound) of `mesh` for `session`: at once, or queue it."""
        t = self.tenants[session]
        ch = Changes()
        own = [w for w in t.workers if w in self.pool]
        if t.state in (RUNNING, FROZEN) and own:
            ch.placed.append((session, self._extra(now, t, devices, own)))
            self.decisions += 1
            return self._finish(ch), Answer(True)
        if t.state == FROZEN:  # every worker it had was lost: it resumes (with nothing) in a pass
            self._pass(now, ch)
            if t.state == FROZEN:
                return self._finish(ch), Answer(False, self.position(session), self._why(t))
        if t.request is not None:
            if t.request.mesh != mesh:
                return self._finish(ch), Answer(False, self.position(session),
                                                f"waiting for mesh {t.request.mesh} to be placed first")
            return self._finish(ch), Answer(False, self.position(session), self._why(t))
        n = len(devices)
        need = min(min_devices, n) if min_devices > 0 else n
        t.request = Request(mesh, tuple(devices), max(1, min(need, len(self.pool))))
        t.arrival = t.arrival or next(self._arrivals)
        if t.running:  # every worker it leased was lost: it asks again
            self._stop(now, t)
        self._step(t, ASK)
        t.waiting_since = now
        self._enqueue(t, now)
        self.decisions += 1
        self._pass(now, ch)
        if t.running:
            return ch, Answer(True)
        return ch, Answer(False, self.position(session), self._why(t))

    def _why(self, t: Tenant) -> str:
        if not self.pool:
            return "no workers registered"
        if t.request is None:
            return f"frozen (preempted by session {_short(t.frozen_by)})"
        need = max(1, min(t.request.need, len(self.pool)))
        return f"needs {need} device{'s' if need > 1 else ''}, {self.pool.free_total} free of {len(self.pool)}"

    def _extra(self, now: float, t: Tenant, devices: tuple[int, ...], own: list[str]) -> dict[int, str]:
        """New logical devices of a running or frozen tenant: free devices if nobody waits, else its own."""
        workers = list(own)
        if t.running and not self._queue:
            grabbed = self._pick(t, len(devices), own)
            if grabbed:
                self._accrue(now, t)
                cap = self._cap(t)
                for w in grabbed:
                    self.pool.lease(w, t.session, cap)
                    t.workers[w] = None
                workers += grabbed
                self._watch(t, now)
        return self._spread(devices, workers)

    def _spread(self, devices: tuple[int, ...], workers: list[str]) -> dict[int, str]:
        """Each logical device to the worker with the fewest bound devices (ties: registration order)."""
        load = {w: (self.workers[w].bound, self.workers[w].order) for w in workers}
        assignment = {}
        for d in devices:
            w = min(load, key=load.__getitem__)
            assignment[d] = w
            bound, order = load[w]
            load[w] = (bound + 1, order)
        return assignment

    # ------------------------------------------------------------ timers

    def tick(self, now: float) -> Changes:
        """A policy deadline passed (or a stale timer fired): re-rank what changed, then run a pass."""
        self._armed = None
        due: list[Tenant] = []
        while self._wakeups and self._wakeups[0][0] <= now + _EPS:
            _at, stamp, session = heapq.heappop(self._wakeups)
            t = self.tenants.get(session)
            if t is not None and t.stamp == stamp:
                due.append(t)
        ch = Changes()
        for t in due:
            if t.running:
                self._accrue(now, t)
                rank = self.policy.rank(t, now)
                if rank != t.rank:
                    self._unrank(t)
                    ch.notes.append(f"session {_short(t.session)} now at rank {rank} "
                                    f"({t.service(now):.0f} device-s attained)")
                    t.rank = rank
                    self._ranks.setdefault(rank, {})[t.session] = None
                self._watch(t, now)
            elif t.key is not None:
                starving = getattr(self.policy, "starving", None)
                if starving is not None and starving(t, now):
                    t.base = t.service(now)
                    ch.notes.append(f"session {_short(t.session)} promoted after waiting "
                                    f"{now - (t.waiting_since or now):.0f}s")
                self._dequeue(t)
                self._enqueue(t, now)
        return self._pass(now, ch)

    # ------------------------------------------------------------ the pass

    def _pass(self, now: float, ch: Changes) -> Changes:
        """Walk the queue in order and place, preempt or resume what the policy allows."""
        blocked: int | None = None
        reserved: set[str] = set()
        preempts = self.policy.preempts
        for entry in list(self._queue):
            t = self.tenants.get(entry[-1])
            if t is None or t.key != entry:
                continue  # placed or re-queued earlier in this pass
            rank = entry[0]
            if blocked is not None and not (preempts and rank > blocked):
                if not preempts:
                    break
                continue
            if t.state == FROZEN:
                if not self._resume(now, t, ch, reserved):
                    reserved.update(w for w in t.workers if self.pool.is_free(w))
            elif not self._admit(now, t, ch, reserved):
                blocked = rank if blocked is None else blocked
        return self._finish(ch)

    def _finish(self, ch: Changes) -> Changes:
        while self._wakeups:
            _at, stamp, session = self._wakeups[0]
            t = self.tenants.get(session)
            if t is not None and t.stamp == stamp:
                break
            heapq.heappop(self._wakeups)
        wake = self._wakeups[0][0] if self._wakeups else None
        if wake is not None and wake != self._armed:
            ch.wake = self._armed = wake
        return ch

    def _packs(self, t: Tenant) -> bool:
        return self.policy.packs and t.cap > 0 and t.kind != "realtime"

    def _cap(self, t: Tenant) -> int:
        return t.cap if self._packs(t) else 0

    def _pick(self, t: Tenant, k: int, exclude: Collection[str]) -> list[str]:
        if self._packs(t):
            return self.pool.pick_packed(k, t.cap, exclude)
        return self.pool.pick(k, exclude)

    def _admit(self, now: float, t: Tenant, ch: Changes, reserved: set[str]) -> bool:
        req = t.request
        assert req is not None
        want = len(req.devices)
        need = max(1, min(req.need, len(self.pool)))
        if not self.pool:
            return False
        picked = self._pick(t, want, reserved) if self.pool.free_total or self.pool.shared_room() else []
        if len(picked) < need and self.policy.preempts:
            victims = self._victims(t, need - len(picked), now, reserved)
            if victims:
                for v in victims:
                    self._freeze(now, v, t, ch)
                picked = self._pick(t, want, reserved)
        if len(picked) < need:
            return False
        cap = self._cap(t)
        for w in picked:
            self.pool.lease(w, t.session, cap)
        t.workers = dict.fromkeys(picked)
        assignment = self._spread(req.devices, picked)
        t.request = None
        self._dequeue(t)
        self._step(t, PLACE)
        self._start(now, t)
        self.decisions += 1
        ch.placed.append((t.session, assignment))
        nodes = len({self.pool.slots[w].node for w in picked})
        ch.notes.append(f"session {_short(t.session)} mesh {req.mesh} placed on {len(picked)} device"
                        f"{'s' if len(picked) > 1 else ''} ({nodes} node{'s' if nodes > 1 else ''}) after "
                        f"{now - (t.waiting_since or now):.2f}s in the queue")
        return True

    def _victims(self, t: Tenant, short: int, now: float, reserved: Collection[str]) -> list[Tenant] | None:
        """Running tenants to freeze so that `short` more devices come free, or None when that cannot be done."""
        mine = t.key[0] if t.key is not None else self.policy.rank(t, now)
        victims: list[Tenant] = []
        chosen: set[str] = set()
        pending: set[str] = set()
        freed: set[str] = set()
        for rank in sorted(self._ranks, reverse=True):
            if rank <= mine:
                break
            for session in reversed(self._ranks[rank]):
                v = self.tenants[session]
                victims.append(v)
                chosen.add(session)
                pending.update(v.workers)
                for w in list(pending):
                    slot = self.pool.slots.get(w)
                    if slot is None or not slot.placeable or w in reserved:
                        pending.discard(w)
                    elif all(h in chosen for h in slot.leases):
                        pending.discard(w)
                        freed.add(w)
                if len(freed) >= short:
                    return victims
        return None

    def _freeze(self, now: float, v: Tenant, by: Tenant, ch: Changes) -> None:
        self._stop(now, v)
        for w in v.workers:
            self.pool.release(w, v.session)
        self._step(v, FREEZE)
        v.frozen_by = by.session
        v.waiting_since = now
        self._frozen[v.session] = None
        self._enqueue(v, now)
        self.decisions += 1
        ch.frozen.append(v.session)
        ch.notes.append(f"session {_short(v.session)} ({v.priority}) frozen on {len(v.workers)} device"
                        f"{'s' if len(v.workers) != 1 else ''}: preempted by session {_short(by.session)} "
                        f"({by.priority})")

    def _resume(self, now: float, t: Tenant, ch: Changes, reserved: set[str]) -> bool:
        live = [w for w in t.workers if w in self.pool]
        if any(w in reserved for w in live):
            return False
        cap = self._cap(t)
        blockers = {h for w in live if not self.pool.fits(w, cap) for h in self.pool.holders(w)}
        if blockers:
            mine = t.key[0] if t.key is not None else self.policy.rank(t, now)
            if not self.policy.preempts or any(self.tenants[b].rank <= mine or not self.tenants[b].running
                                               for b in blockers):
                return False
            for b in sorted(blockers, key=lambda b: self.tenants[b].arrival):
                self._freeze(now, self.tenants[b], t, ch)
        for w in live:
            self.pool.lease(w, t.session, cap)
        t.workers = dict.fromkeys(live)
        self._dequeue(t)
        self._frozen.pop(t.session, None)
        self._step(t, RESUME)
        waited = now - (t.waiting_since or now)
        self._start(now, t)
        self.decisions += 1
        ch.resumed.append(t.session)
        ch.notes.append(f"session {_short(t.session)} resumed on {len(live)} device{'s' if len(live) != 1 else ''}"
                        f" after {waited:.2f}s frozen")
        return True

    # ------------------------------------------------------------ bookkeeping

    def _step(self, t: Tenant, event: str) -> None:
        try:
            t.state = TENANT_TABLE[t.state][event]
        except KeyError:
            raise IllegalTenantTransition(f"session {t.session}: no transition from {t.state!r} on {event!r}") from None

    def _start(self, now: float, t: Tenant) -> None:
        t.since = now
        t.waiting_since = None
        t.frozen_by = ""
        t.rank = self.policy.rank(t, now)
        self._ranks.setdefault(t.rank, {})[t.session] = None
        self._watch(t, now)

    def _stop(self, now: float, t: Tenant) -> None:
        """Leaving `running`: bank the service, leave the rank buckets."""
        self._accrue(now, t)
        self._unrank(t)

    def _unrank(self, t: Tenant) -> None:
        bucket = self._ranks.get(t.rank)
        if bucket is not None:
            bucket.pop(t.session, None)
            if not bucket:
                del self._ranks[t.rank]

    def _accrue(self, now: float, t: Tenant) -> None:
        if t.running:
            t.attained += len(t.workers) * max(0.0, now - t.since)
            t.since = now

    def _enqueue(self, t: Tenant, now: float) -> None:
        t.key = (self.policy.rank(t, now), *self.policy.key(t, now), t.arrival, t.session)
        bisect.insort(self._queue, t.key)
        self._watch(t, now)

    def _dequeue(self, t: Tenant) -> None:
        if t.key is None:
            return
        i = bisect.bisect_left(self._queue, t.key)
        if i < len(self._queue) and self._queue[i] == t.key:
            del self._queue[i]
        t.key = None

    def _watch(self, t: Tenant, now: float) -> None:
        """(Re)schedule the policy's next look at `t`; older wake-ups for it become stale."""
        t.stamp += 1
        at = self.policy.next_change(t, now)
        if at is not None:
            heapq.heappush(self._wakeups, (max(at, now + _MIN_WAKE_S), t.stamp, t.session))
