"""The scheduler: admission, the queue, preemption by freezing, resuming, attained service. Sans-IO.

Rules:

1. Each session is a *tenant* whose scheduling state follows `TENANT_TABLE` (through `_step` only):
   idle (nothing asked yet) -> waiting (a mesh request queued) -> running (leases devices) <-> frozen
   (preempted: its logical devices stay bound, its shards stay on its workers, the core holds its batches
   from the `Changes` that froze it to the one that resumes it) -> closed. A running tenant whose every worker
   was lost asks again (running -> waiting).
2. Admission is all-or-nothing per mesh. A mesh of n logical devices wants n physical devices and needs at
   least `need` of them: n, or the elastic minimum `min_devices`, capped by the number of workers known when
   it asks (and at the time of each try, if workers were lost): a mesh never waits for devices that do not
   exist, and more logical devices than workers run as virtual devices. It takes up to n when free.
3. Across sessions devices are exclusive, unless the policy packs: then batch sessions that declared a memory
   cap share devices while the caps fit (pool.py). A running or frozen tenant's later meshes never wait:
   their new logical devices go to free devices when nobody is queued, else onto the tenant's own devices.
   Logical devices a rebuild places again (their worker was lost) take free devices even when others queue.
4. The queue holds waiting requests, ordered by (policy rank, policy key, arrival). A *pass* runs whenever
   capacity may have grown (worker registered or alive again, session closed, worker lost, timer, a running
   tenant ranked anew at its step) and on every new request: first every frozen tenant that got all its
   devices back resumes, then the queue is walked in order. A request that cannot be placed blocks the later
   ones unless it could preempt them later (policies/base.py), so the walk jumps to the next rank at once: a
   pass costs O(ranks), not O(queue).
   One exception, when the policy packs: a blocked request lets the packed requests just behind it (a window
   of `_FIT_WINDOW`) use the room left on shared devices, which it cannot use (it is blocked with that room
   there): they take no free device and freeze nobody, so they cannot delay it.
5. Elastic tenants (asked with a minimum below their size) that run on fewer devices than they have
   logical devices grow onto free devices when nobody waits (`growth`, set by the core when it can move
   logical devices): the core moves some of their logical devices there and reports it with `moved`.
6. Preemption freezes running tenants of a strictly higher rank, least important and most recently started
   first (but within a rank a recent one that frees enough by itself goes first: when the policy `paces`, the one
   whose sent batches should be done soonest by the pace of its batches (`busy_for`, pipeline.py rule 8); then the
   smallest), only when that frees enough devices. A frozen tenant *reserves* its devices: the ones the
   preemptor did not take, and each one that comes free later, are leased back to it (reservation leases;
   several frozen tenants wanting one device: the best ranked gets it). It resumes, with its batches
   flushed in order, once it holds all of them again. A higher-ranked request may take reserved devices
   (before freezing running work). With ranks that change over time (LAS), a frozen tenant that comes to
   outrank the holders of its devices takes them back at the next tick. A policy that `lends` keeps no idle
   reservations: a device a frozen tenant waits for is leased back to it only when it completes it (it resumes
   at once); until then it serves anyone, and the frozen tenant takes back its own devices that are free (no
   move) when they are all free, or with substitutes when it relocates (also when the policy does not relocate:
   a device that frees before the last one never completes it, so without this it would wait for ever).
   *Relocation* (the core sets `relocation` when it can move logical devices; the policy's `relocates`): a
   frozen tenant need not wait for the devices it lost. Once it has been frozen `relocate_after` seconds
   (most preemptions end sooner: moving would cost more than waiting), when as many free devices as it
   misses are free (and no better-ranked request waits for them), it leases them as substitutes and resumes
   at once; the core moves its logical devices from the lost devices to the substitutes
   (`Changes.relocated`), worker to worker, before its held batches go out. Frozen tenants get free devices
   in rank order, before queued requests of a worse rank, and not while a request of a better rank is
   blocked (it would freeze them again as soon as it fits). (A move that fails leaves its devices where
   they were, on the preemptor's device.)
7. Attained service (device-seconds) accrues while running, with the number of devices leased.
8. Every public call returns `Changes`: devices to bind (placed), tenants frozen and resumed, log lines, and
   when to call `tick` next. The controller applies them; the scheduler never touches sessions or workers.
9. Progress: a session may declare the steps (sync points) it expects; the core reports each Sync (`progress`):
   one past the batch the last one reached is a new step (a Sync repeated while the client waits is not). A
   tenant keeps its steps, its service at the last one and the time it spent queued or frozen before the
   current wait (`waited`, of which frozen: `frozen_s`); policies may rank by them (policies/dtorch.py). A
   policy's rank of a running tenant is refreshed at each of its steps (a pass follows when it changed: a
   waiting request may now preempt it).
10. Elastic shrink (a policy that `shrinks`): before freezing running tenants of a rank, preemption takes the
    spare devices of that rank's running elastic tenants (above the minimum they asked for, leased to them
    alone): they keep running on the rest, as virtual devices (the core moves their logical devices off the
    devices they give up, `Changes.shrunk`), and grow back when devices free up and nobody waits (rule 5).
11. Cost: no pass does a tenant's work for every frozen tenant (with LAS or the DTorch policy, hundreds sit frozen
    while a pass runs at every close, move and step). Indexes kept as tenants change: frozen tenants by how many
    devices they miss (relocation, rule 6, tries only the ones that fit in the free devices, when none packs: it
    walks the rank buckets in order, passing over the others with one set lookup each, and stops once the free
    devices are gone), the ones that may
    hold a reservation (preemption takes those first), the elastic ones (shrink), for each worker the ones that miss
    it alone (a lending policy offers a freed device to those only, rule 6) and the ones that miss it by rank (a
    re-ranked tenant's devices are looked at by the frozen tenants that outrank it, and by the others only once it
    lets go of them, rule 6), and each tenant's place in its rank bucket (`bucketed`), which keeps every walk in the
    order the rules state.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

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
_FIT_WINDOW = 64  # preemption looks this far among a rank's most recent running sessions for a best fit
_MIN_WAKE_S = 1e-3  # a policy deadline is never sooner than this after now (no busy timer loops)
_RANKED = operator.attrgetter("rank", "arrival")  # frozen tenants' order for devices (unique: arrivals are)


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
    workers: dict[str, None] = field(default_factory=dict)  # its devices: leased (running) / its own (frozen)
    missing: dict[str, None] = field(default_factory=dict)  # frozen: its devices it holds no reservation on, in
    # its devices' order (a set's order follows the string hash, which changes from process to process)
    request: Request | None = None
    arrival: int = 0  # queue tie-break, from its first request (kept through freezes)
    key: tuple | None = None  # its queue entry while waiting
    rank: int = 0  # its bucket while running or frozen
    attained: float = 0.0  # device-seconds of service
    base: float = 0.0  # counted service starts here (a starvation promotion resets it)
    since: float = 0.0  # running since
    waiting_since: float | None = None  # waiting or frozen since
    logical: int = 0  # logical devices placed: the most physical devices it can use
    elastic: bool = False  # asked with a minimum below its size: it grows onto devices that come free
    floor: int = 0  # elastic: the fewest physical devices it accepts (it may be shrunk down to them)
    over_cap: set[str] = field(default_factory=set)  # workers where it was told it exceeds its cap
    stamp: int = 0  # invalidates stale wake-ups
    bucketed: int = 0  # when it entered its rank bucket: the order within a bucket (scheduler indexes)
    expected_steps: int = 0  # steps (sync points) the client said it will reach; 0: unknown
    steps: int = 0  # sync points reached so far
    synced_upto: int = 0  # the batch its last sync point reached
    step_service: float = 0.0  # attained service at its last sync point
    waited: float = 0.0  # seconds spent queued or frozen before the current wait
    frozen_s: float = 0.0  # of which frozen (preempted)

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    @property
    def held_devices(self) -> int:
        return len(self.workers) if self.running else 0

    @property
    def wanted_devices(self) -> int:
        """Logical devices it has and asks for: how wide it is, whether running or not."""
        return self.logical + (len(self.request.devices) if self.request is not None else 0)

    def service(self, now: float) -> float:
        return self.attained + (len(self.workers) * max(0.0, now - self.since) if self.running else 0.0)

    def counted(self, now: float) -> float:
        return self.service(now) - self.base


@dataclass
class Changes:
    placed: list[tuple[str, dict[int, str]]] = field(default_factory=list)  # session -> devices to bind
    grown: list[tuple[str, list[str]]] = field(default_factory=list)  # session -> workers leased to grow onto
    shrunk: list[tuple[str, list[str]]] = field(default_factory=list)  # session -> workers it gave up (rule 10)
    relocated: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # session -> {lost worker: substitute}
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


# A re-ranked tenant, a device it holds, its rank then, and the frozen tenants that want that device and that rank
# does not let take it back (`Scheduler._wanters`).
_Held = tuple[Tenant, str, int, list[str]]


def _short(session: str) -> str:
    return session[:8]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class Scheduler:
    def __init__(self, policy: Policy, workers: Mapping[str, Worker]) -> None:
        self.policy = policy
        self.workers = workers  # the core's worker table, read only (bound counts, order)
        self.pool = Pool()
        self.tenants: dict[str, Tenant] = {}
        self._queue: list[tuple] = []  # waiting requests, sorted (rank, *key, arrival, session)
        self._ranks: dict[int, dict[str, None]] = {}  # running tenants by rank, in start order
        self._frozen: dict[int, dict[str, None]] = {}  # frozen tenants by rank, in freeze order
        self._wanted: dict[str, dict[str, None]] = {}  # worker -> frozen tenants missing it
        # The same by rank (worker -> rank -> frozen tenants missing it): a re-ranked holder of a device is outranked
        # only by the ones of a better rank than its own (`_wanters`), a few of the hundreds that may want it.
        self._wanted_at: dict[str, dict[int, dict[str, None]]] = {}
        # Indexes of the frozen tenants, so that a pass does not walk all of them (with LAS, hundreds): by how many
        # devices each misses (relocation looks only at those that fit in the free devices), the ones that may hold
        # a reservation (preemption takes those first; a superset, pruned as it is read), and how many pack.
        self._missing_n: dict[int, dict[str, None]] = {}  # len(missing) > 0 -> frozen tenants
        self._completes: dict[str, dict[str, None]] = {}  # worker -> frozen tenants it alone is missing from
        self._sole: dict[str, str] = {}  # frozen tenant -> the one worker it misses (the key in `_completes`)
        self._reserving: set[str] = set()
        self._frozen_packed = 0
        self._bucketing = itertools.count(1)
        self._resumable: dict[str, None] = {}  # frozen tenants holding all their devices again
        self._elastic: dict[str, None] = {}  # elastic tenants, oldest first (the ones that may grow)
        self._freed: list[str] = []  # workers released in the current step, offered to frozen tenants after it
        self._wakeups: list[tuple[float, int, str]] = []  # heap of (at, stamp, session)
        self._armed: float | None = None
        self._arrivals = itertools.count(1)
        self._capped = 0  # open tenants with a memory cap
        self.decisions = 0  # placements, queueings, freezes, resumes (for benchmarks)
        self.growth = False  # the core can move logical devices: elastic tenants may grow (see _grow)
        self.relocation = False  # ... and frozen tenants may resume on substitutes (see _relocate)
        self.relocations = 0  # frozen tenants resumed on substitutes (for tests and benchmarks, like `decisions`)
        # Does a session have moves of its logical devices in flight (the core's mover, read only)? Such a tenant
        # is neither preempted nor relocated nor shrunk again until they are done: its moves go to the devices
        # it leases now, which it would give up meanwhile (rules 6 and 10).
        self.moving: Callable[[str], bool] = lambda session: False
        self.busy_for: Callable[[str, float], float] = lambda session, now: 0.0

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

    def reserved(self, worker: str) -> list[str]:
        """Frozen tenants holding a reservation lease on `worker`."""
        return [s for s in self.pool.holders(worker) if self.tenants[s].state == FROZEN]

    # ------------------------------------------------------------ tenants

    def open(self, session: str, priority: str, kind: str, cap: int = 0, expected_steps: int = 0) -> None:
        old = self.tenants.get(session)
        self._capped += (cap > 0) - (old is not None and old.cap > 0)
        self.tenants[session] = Tenant(session, priority, kind, max(0, cap), expected_steps=max(0, expected_steps))

    def progress(self, now: float, session: str, upto: int) -> Changes:
        """The session synced up to batch `upto`: a new sync point (a step) when `upto` is past the last one (a
        client repeats a Sync while it waits), and policies that rank by progress may rank it anew (rule 9)."""
        t = self.tenants.get(session)
        if t is None or upto <= t.synced_upto:
            return Changes()
        t.synced_upto = upto
        t.steps += 1
        t.step_service = t.service(now)
        if not t.running:
            return Changes()
        ch = Changes()
        better: dict[str, None] = {}
        held: list[_Held] = []
        self._accrue(now, t)
        reranked = self._rerank(t, self.policy.rank(t, now), self._ranks, now, ch)
        if reranked:
            self._wanters(t, better, held)
        self._watch(t, now)
        if better or held:
            self._reclaim_all(now, better, held, ch)
        if reranked:  # a waiting request may now outrank it and preempt it (rule 6), as after a tick
            return self._pass(now, ch)
        return self._finish(ch)

    def close(self, now: float, session: str) -> Changes:
        ch = Changes()
        t = self.tenants.get(session)
        if t is None:
            return ch
        if t.running:
            self._stop(now, t)
        if t.key is not None:
            self._dequeue(t)
        if t.state == FROZEN:
            self._unfreeze(t)
        for w in t.workers:
            self._release(w, session)
        t.workers.clear()
        self._step(t, CLOSE)
        self._capped -= t.cap > 0
        del self.tenants[session]
        self._elastic.pop(session, None)
        return self._pass(now, ch)

    def cap(self, session: str) -> int:
        """The memory cap its leases carry: its declared cap when the policy packs it, else 0 (whole devices)."""
        t = self.tenants.get(session)
        return self._cap(t) if t is not None else 0

    @property
    def capping(self) -> bool:
        """Does any open session have a memory cap (else `over_cap` has nothing to say)?"""
        return self._capped > 0

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
        for session in self.pool.remove(worker):
            t = self.tenants[session]
            if t.running:
                self._accrue(now, t)
                t.workers.pop(worker, None)
                self._watch(t, now)
        self._wanted_at.pop(worker, None)
        for session in self._wanted.pop(worker, {}):
            t = self.tenants[session]
            n = len(t.missing)
            t.missing.pop(worker, None)
            self._index_missing(t, n)
        for t in (self.tenants[s] for b in self._frozen.values() for s in b):
            if worker in t.workers:
                del t.workers[worker]
                if not t.missing:
                    self._resumable[t.session] = None
        return self._pass(now, Changes())

    # ------------------------------------------------------------ meshes

    def place(self, now: float, session: str, mesh: int, devices: tuple[int, ...], min_devices: int = 0,
              restore: bool = False) -> tuple[Changes, Answer]:
        """Place `devices` (not yet bound) of `mesh` for `session`: at once, or queue it. `restore`: they were
        bound before and their worker was lost (a rebuild): they take free devices even when others queue."""
        t = self.tenants[session]
        ch = Changes()
        own = [w for w in t.workers if w in self.pool]
        if t.state in (RUNNING, FROZEN) and own:
            if not restore:  # restored devices were counted when first placed
                t.logical += len(devices)
            ch.placed.append((session, self._extra(now, t, devices, own, restore)))
            self.decisions += 1
            return self._finish(ch), Answer(True)
        if t.state == FROZEN:  # every device it had was lost: it resumes (with nothing) in a pass
            self._pass(now, ch)
            if t.state == FROZEN:
                return self._finish(ch), Answer(False, 0, self._why(t))
        if t.request is not None:
            if t.request.mesh != mesh:
                return self._finish(ch), Answer(False, self.position(session),
                                                f"waiting for mesh {t.request.mesh} to be placed first")
            return self._finish(ch), Answer(False, self.position(session), self._why(t))
        n = len(devices)
        if restore:  # counted when first placed: the request holds them now, and its admission counts them again
            t.logical -= n
        need = min(min_devices, n) if min_devices > 0 else n
        t.request = Request(mesh, tuple(devices), max(1, min(need, len(self.pool))))
        if 0 < min_devices < n:
            t.elastic = True
            self._elastic[session] = None
        t.arrival = t.arrival or next(self._arrivals)
        if t.running:  # every device it leased was lost: it asks again
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
        if t.state == FROZEN:
            return "frozen (preempted by a session of a better rank)"  # its owner: the preemptor may be another's
        if not self.pool:
            return "no workers registered"
        need = max(1, min(t.request.need if t.request else 1, len(self.pool)))
        return f"needs {_plural(need, 'physical device')}, {self.pool.free_total} of {len(self.pool)} free"

    def _extra(self, now: float, t: Tenant, devices: tuple[int, ...], own: list[str], restore: bool = False,
               ) -> dict[int, str]:
        """New logical devices of a running or frozen tenant: free devices if nobody waits (or they replace
        devices it lost: a worker loss must not squeeze it onto fewer devices), else its own."""
        workers = list(own)
        if t.running and (restore or not self._queue):
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
        """Each logical device to the worker given the fewest of them so far, then the fewest bound devices (a
        frozen session's devices stay bound where they were: they must not push two onto one worker), then
        registration order."""
        heap = [(0, self.workers[w].bound, self.workers[w].order, w) for w in dict.fromkeys(workers)]
        heapq.heapify(heap)  # orders are unique: the least entry is the one `min` over the workers would pick
        assignment = {}
        for d in devices:
            given, bound, order, w = heap[0]
            assignment[d] = w
            heapq.heapreplace(heap, (given + 1, bound, order, w))
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
        better: dict[str, None] = {}  # frozen tenants that may now outrank the holders of their devices (`_wanters`)
        held: list[_Held] = []  # ... and the ones a re-ranked holder still outranks, with the device it holds
        for t in due:
            if t.running:
                self._accrue(now, t)
                if self._rerank(t, self.policy.rank(t, now), self._ranks, now, ch):
                    self._wanters(t, better, held)
                self._watch(t, now)
                continue
            if self.policy.starving(t, now):
                t.base = t.service(now)
                ch.notes.append(f"session {_short(t.session)} promoted after waiting "
                                f"{now - (t.waiting_since or now):.0f}s")
            if t.key is not None:
                self._dequeue(t)
                self._enqueue(t, now)
            elif t.state == FROZEN:
                if self._rerank(t, self.policy.rank(t, now), self._frozen, now, ch):
                    self._wanters(t, better, held)
                better[t.session] = None
                self._watch(t, now)
        self._reclaim_all(now, better, held, ch)
        return self._pass(now, ch)

    def _wanters(self, t: Tenant, better: dict[str, None], held: list[_Held]) -> None:
        """`t`'s rank changed: the frozen tenants waiting for the devices it holds may now outrank it. `better` gets
        the ones of a better rank than `t`'s (`_wanted_at`), and `held` the others, with the device `t` holds that
        they want: they cannot take devices back while it holds it (`_reclaim_all`)."""
        frozen = t.state == FROZEN
        for w in t.workers:
            if frozen and w in t.missing:
                continue
            wanting = self._wanted.get(w)
            if not wanting:
                continue
            if self._frozen_packed or t.session not in self.pool.holders(w):  # no sure witness: all of them look
                better.update(wanting)
                continue
            worse: list[str] = []
            for rank, bucket in self._wanted_at[w].items():  # a few ranks
                if rank < t.rank:
                    better.update(bucket)
                else:
                    worse.extend(bucket)
            if worse:
                held.append((t, w, t.rank, worse))

    def _reclaim_all(self, now: float, better: Mapping[str, None], held: list[_Held], ch: Changes) -> bool:
        """Ranks moved: the frozen tenants that may now outrank the holders of their devices (`_wanters`) take
        them back, best ranked first (only those whose rank, or whose devices' holders' ranks, changed: not a walk
        over every frozen tenant). True when any did.

        The ones in `held` are not looked at while the holder that outranks them (a holder of a device they miss,
        of a rank at most theirs: `_reclaim` would stop there) still holds that device at that rank: the walk over
        all of them found the same, and only their failures (6.7 million looks in the benchmark's first 20,000
        jobs, 3.5 million now). Each time one takes devices back, the ones whose holder let go of the device join
        the walk, in their place in its order. (Nothing that packs is frozen, or `_wanters` holds nobody back: then
        a frozen tenant gets a device only when it has no lease, so one that a holder still holds is still
        missing.)"""
        tenants = self.tenants
        walk = [(t.rank, t.arrival, t.session) for t in (tenants[s] for s in better if s in tenants)]
        heapq.heapify(walk)  # (rank, arrival) is unique; a frozen tenant's rank does not change in the walk
        looked = set(better)
        took = False
        while walk:
            at = heapq.heappop(walk)
            t = tenants[at[2]]
            if not (t.state == FROZEN and t.missing and self._reclaim(now, t, ch)):
                continue
            took = True
            still = []
            for h in held:
                holder, w, rank, worse = h
                if holder.rank == rank and holder.session in self.pool.holders(w):
                    still.append(h)
                    continue
                for s in worse:  # the holder let go: they may take devices back after all, after `t`
                    if s not in looked and s in tenants:
                        looked.add(s)
                        u = tenants[s]
                        if (u.rank, u.arrival) > at[:2]:
                            heapq.heappush(walk, (u.rank, u.arrival, s))
            held = still
        return took

    def _rerank(self, t: Tenant, rank: int, buckets: dict[int, dict[str, None]], now: float, ch: Changes) -> bool:
        """Move `t` to bucket `rank`; True when its rank changed."""
        if rank == t.rank:
            return False
        self._unbucket(t, buckets)
        ch.notes.append(f"session {_short(t.session)} now at rank {rank} ({t.service(now):.0f} device-s attained)")
        if t.state == FROZEN:
            for w in t.missing:
                self._unwant_at(t, w)
        t.rank = rank
        if t.state == FROZEN:
            for w in t.missing:
                self._want_at(t, w)
        self._bucket(t, buckets)
        return True

    def _reclaim(self, now: float, t: Tenant, ch: Changes) -> bool:
        if not self.policy.preempts:
            return False
        holders: set[str] = set()
        for w in t.missing:  # it takes them back only if it outranks every holder: stop at the first it does not
            for h in self.pool.holders(w):
                if h not in holders:
                    if self.tenants[h].rank <= t.rank or self.moving(h):
                        return False
                    holders.add(h)
        if not holders:
            return False
        for h in sorted(holders, key=lambda h: self.tenants[h].arrival):
            v = self.tenants[h]
            if v.running:
                self._freeze(now, v, t, ch)
            else:
                self._unreserve(v)
        self._offer()
        return True

    # ------------------------------------------------------------ the pass

    def _pass(self, now: float, ch: Changes) -> Changes:
        """Resume the frozen tenants that hold all their devices again (or get substitutes), then walk the
        queue in order. Frozen tenants get free devices before queued requests of a worse rank, and never
        while a request of a better rank is blocked (it would freeze them again as soon as it fits)."""
        self._offer()
        self._relocate(now, ch, self._queue[0][0] if self._queue else None)
        self._resume_ready(now, ch)
        # The live queue, not a copy (a pass must not cost O(queue)): an admission removes only its own entry.
        queue = self._queue
        blocked: int | None = None  # rank of the first request that could not be placed
        i = 0
        while i < len(queue):
            entry = queue[i]
            if self._admit(now, self.tenants[entry[-1]], ch):
                self._resume_ready(now, ch)  # an admission may have handed devices back
                continue
            blocked = entry[0] if blocked is None else blocked
            self._fill_fragments(now, i + 1, ch)
            if not self.policy.preempts:
                break  # nobody may overtake a blocked request
            i = bisect.bisect_left(queue, (entry[0] + 1,), i + 1)  # only a lower rank may go ahead
        self._relocate(now, ch, blocked)
        self._resume_ready(now, ch)
        if self.growth and not self._queue and self.pool.free_total:
            self._grow(now, ch)
        return self._finish(ch)

    def _fill_fragments(self, now: float, start: int, ch: Changes) -> None:
        """A request is blocked: later packed requests (up to `_FIT_WINDOW` of them) that fit in the room left on
        shared devices go ahead. They take no free device and freeze nobody, so they cannot delay it: that room
        is of no use to it (it is blocked with that room there) and would stay unallocated (rule 4)."""
        if not self.policy.packs or not self.pool.shared_room():
            return
        queue = self._queue
        i, end = start, start + _FIT_WINDOW
        while i < min(end, len(queue)) and self.pool.shared_room():
            t = self.tenants[queue[i][-1]]
            if self._packs(t) and self._admit(now, t, ch, fragments=True):
                end -= 1  # its entry left the queue: the window keeps its length
                continue
            i += 1

    def _resume_ready(self, now: float, ch: Changes) -> None:
        for session in list(self._resumable):
            self._resume(now, self.tenants[session], ch)

    def _relocate(self, now: float, ch: Changes, upto: int | None) -> None:
        """Frozen tenants of rank <= `upto` (all when None), best first, that miss devices lease free devices
        as substitutes when there are enough for all they miss (rule 6). A lending policy's tenants take back their
        own devices that are free, with or without relocation (without it, that is the only way back: a freed
        device is reserved for a lending tenant only when it completes it, and one that frees first never is)."""
        moves = self.relocation and self.policy.relocates
        lends = self.policy.lends
        if not self._frozen or not (moves or lends):
            return
        if not self.pool.free_total and not self.pool.shared_room():
            return  # nothing to take (the usual case in a busy cluster): no walk over the frozen
        patience = self.policy.relocate_after - _EPS if moves else -_EPS  # own devices only: no move to wait for
        for t in self._relocatable(upto):
            session = t.session
            if not t.missing or session in self._resumable or now < (t.waiting_since or now) + patience \
                    or self.moving(session):
                continue
            if not self.pool.free_total and not (self._packs(t) and self.pool.shared_room()):
                return
            if len(t.missing) > self.pool.free_total and not self._packs(t):
                continue
            cap = self._cap(t)
            own = [w for w in t.missing if self.pool.is_free(w) or (cap and self.pool.fits(w, cap)
                                                                    and self.pool.slots[w].placeable)] \
                if lends else []  # its own devices that are free now come back as they are (no move)
            subs = self._pick(t, len(t.missing) - len(own), t.workers) if moves else []
            if len(own) + len(subs) < len(t.missing):
                continue  # all or nothing: a lending policy keeps no idle reservation
            for w in own:
                self.pool.lease(w, t.session, cap)
                self._unwant(t, w)
            if t.missing:
                self._substitute(t, subs, ch)
            else:
                self._resumable[t.session] = None

    def _relocatable(self, upto: int | None) -> Iterator[Tenant]:
        """The frozen tenants of rank <= `upto` that `_relocate` looks at, in its order (rank, then freeze order):
        when none packs, only the ones that miss no more devices than are free (the others could take none: free
        devices only get fewer as it goes), from `_missing_n`. Taken as `_relocate` goes: it stops once the free
        devices are gone, usually after the first few of hundreds (a sort of them all at every pass was a tenth of a
        long run's time, and building a heap of them all 5% of it): the rank buckets in order, each in freeze order
        (`bucketed`), skipping the ones that do not fit, which `_relocate` would skip (it changes no bucket)."""
        if self._frozen_packed:
            ranks = [r for r in sorted(self._frozen) if upto is None or r <= upto]
            yield from [self.tenants[s] for r in ranks for s in self._frozen[r]]
            return
        free = self.pool.free_total
        fit: dict[str, None] = {}
        for n, bucket in self._missing_n.items():
            if n <= free:
                fit.update(bucket)
        if not fit:
            return
        tenants = self.tenants
        for rank in sorted(self._frozen):
            if upto is not None and rank > upto:
                return
            for s in self._frozen[rank]:
                if s in fit:
                    yield tenants[s]

    def _reserving_in(self, rank: int) -> list[Tenant]:
        """The frozen tenants of `rank` that hold a reservation, most recently frozen first (`_reserving`,
        pruned of the ones that no longer do: only a lease back, `_offer` or `_unwant`, makes one again)."""
        bucket = self._frozen.get(rank)
        found = []
        for session in list(self._reserving):
            t = self.tenants.get(session)
            if t is None or t.state != FROZEN or len(t.missing) >= len(t.workers):
                self._reserving.discard(session)
            elif bucket is not None and session in bucket:
                found.append(t)
        found.sort(key=lambda t: t.bucketed, reverse=True)
        return found

    def _substitute(self, t: Tenant, subs: list[str], ch: Changes) -> None:
        lost = sorted(t.missing, key=lambda w: self.workers[w].order)
        cap = self._cap(t)
        for w in subs:
            self.pool.lease(w, t.session, cap)
        swap = dict(zip(lost, subs))
        workers = {}
        for w in t.workers:
            workers[swap.get(w, w)] = None
        t.workers = workers
        self._unfreeze_wants(t)
        self._resumable[t.session] = None
        self.relocations += 1
        self.decisions += 1
        ch.relocated.append((t.session, swap))
        ch.notes.append(f"session {_short(t.session)} relocates {_plural(len(swap), 'device')} off the devices it "
                        "was preempted from: " + ", ".join(f"{a} -> {b}" for a, b in swap.items()))

    def _grow(self, now: float, ch: Changes) -> None:
        """Nobody waits and devices are free: running elastic tenants on fewer devices than logical ones take
        more (oldest first); the core moves some of their logical devices there."""
        for session in list(self._elastic):
            t = self.tenants[session]
            short = t.logical - len(t.workers)
            if not t.running or short <= 0:
                continue
            grabbed = self._pick(t, short, t.workers)
            if not grabbed:
                return
            self._accrue(now, t)
            cap = self._cap(t)
            for w in grabbed:
                self.pool.lease(w, t.session, cap)
                t.workers[w] = None
            self._watch(t, now)
            self.decisions += 1
            ch.grown.append((t.session, grabbed))
            ch.notes.append(f"session {_short(t.session)} grows onto {_plural(len(grabbed), 'more device')} "
                            f"({len(t.workers)} for {t.logical} logical)")

    def moved(self, now: float, session: str, src: str, dst: str, src_empty: bool) -> Changes:
        """Logical devices of `session` moved from `src` to `dst` (a migration, a drain, a growth): `dst` is
        leased to it, and `src` goes back to the pool when none of its devices is left there."""
        t = self.tenants.get(session)
        if t is None:
            return self._finish(Changes())
        if t.state == FROZEN:
            return self._moved_frozen(now, t, src, dst, src_empty)
        self._accrue(now, t)
        if dst not in t.workers and dst in self.pool:
            self.pool.lease(dst, session, self._cap(t))
            t.workers[dst] = None
        if src_empty and src in t.workers and src != dst:
            del t.workers[src]
            self._release(src, session)
        self._watch(t, now)
        return self._pass(now, Changes())

    def _moved_frozen(self, now: float, t: Tenant, src: str, dst: str, src_empty: bool) -> Changes:
        """A frozen tenant's devices moved (a drain moves everyone's): its own devices are now where its shards
        are, and it wants `dst` back instead of `src` (it took nothing: `dst` was leased to nobody for it, and a
        running session could be given it while the frozen one is bound there)."""
        n = len(t.missing)
        if src_empty and src != dst and src in t.workers:
            del t.workers[src]
            if src in t.missing:
                del t.missing[src]
                self._drop_want(t, src)
            else:  # a reservation it held there
                self._release(src, t.session)
        if dst not in t.workers:
            t.workers[dst] = None
            t.missing[dst] = None
            self._wanted.setdefault(dst, {})[t.session] = None
            self._want_at(t, dst)
            if self.pool.is_free(dst):
                self._freed.append(dst)  # offered to it as a device that just came free (rule 6)
        self._index_missing(t, n)
        return self._pass(now, Changes())

    def shrink(self, now: float, session: str, workers: list[str], stop_growing: bool = True) -> Changes:
        """Give back workers leased to `session` that hold none of its devices (a growth that could not be
        used: the tenant is not offered more, unless `stop_growing` is False)."""
        t = self.tenants.get(session)
        if t is None:
            return self._finish(Changes())
        if stop_growing:
            t.elastic = False
            self._elastic.pop(session, None)
        self._accrue(now, t)
        for w in workers:
            if w in t.workers:
                del t.workers[w]
                self._release(w, session)
        self._watch(t, now)
        return self._pass(now, Changes())

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

    def _pick(self, t: Tenant, k: int, exclude: Collection[str] = ()) -> list[str]:
        if self._packs(t):
            return self.pool.pick_packed(k, t.cap, exclude)
        return self.pool.pick(k, exclude)

    def _admit(self, now: float, t: Tenant, ch: Changes, fragments: bool = False) -> bool:
        """Place `t`'s request now, freezing victims if the policy preempts; `fragments`: only on room left on
        shared devices (no free device, no preemption: a backfill that cannot delay a blocked request)."""
        req = t.request
        assert req is not None
        if not self.pool:
            return False
        want = len(req.devices)
        need = max(1, min(req.need, len(self.pool)))
        if fragments:
            picked = self.pool.pick_packed(want, t.cap, shared_only=True)
        else:
            picked = self._pick(t, want) if self.pool.free_total or self._packs(t) else []
        if len(picked) < need and self.policy.preempts and not fragments:
            victims = self._victims(t, need - len(picked), now)
            if victims:
                for v, give in victims:
                    if give:
                        self._shrink_for(now, v, give, t, ch)
                    elif v.running:
                        self._freeze(now, v, t, ch)
                    else:
                        self._unreserve(v)
                picked = self._pick(t, want)
        if len(picked) < need:
            self._offer()
            return False
        cap = self._cap(t)
        for w in picked:
            self.pool.lease(w, t.session, cap)
        self._offer()  # devices the victims gave up and this request did not take go back to them
        t.workers = dict.fromkeys(picked)
        t.logical += want
        t.floor = need if t.elastic else 0
        assignment = self._spread(req.devices, picked)
        t.request = None
        self._dequeue(t)
        self._step(t, PLACE)
        self._start(now, t, self._ranks)
        self.decisions += 1
        ch.placed.append((t.session, assignment))
        nodes = len({self.pool.slots[w].node for w in picked})
        ch.notes.append(f"session {_short(t.session)} mesh {req.mesh} placed on {_plural(len(picked), 'device')} "
                        f"({_plural(nodes, 'node')}) after {now - (t.waiting_since or now):.2f}s in the queue")
        return True

    def _victims(self, t: Tenant, short: int, now: float) -> list[tuple[Tenant, list[str]]] | None:
        """Tenants of a higher rank to give up devices so that `short` more come free, or None when they cannot:
        per rank from the least important, reservations of frozen tenants first, then the spare devices of
        running elastic tenants (shrunk, when the policy `shrinks`: rule 10), then running tenants (frozen), most
        recent first. Each comes with the workers it gives up when shrunk (empty: frozen, or its reservations
        go)."""
        mine = t.key[0] if t.key is not None else self.policy.rank(t, now)
        victims: list[tuple[Tenant, list[str]]] = []
        chosen: set[str] = set()
        pending: set[str] = set()
        freed: set[str] = set()
        shrinks = self.policy.shrinks
        for rank in sorted(self._ranks.keys() | self._frozen.keys(), reverse=True):
            if rank <= mine:
                break
            frozen = self._reserving_in(rank)  # the others reserve nothing: they cannot give a device
            running = self._best_fit_first(self._ranks.get(rank, {}), short - len(freed), now)
            for v in itertools.chain(frozen, (None,), running):
                if v is None:  # the frozen tenants' reservations were not enough: shrink, then freeze
                    for e, give in self._spares(self._ranks.get(rank, {}), short - len(freed)) if shrinks else ():
                        victims.append((e, give))
                        chosen.add(e.session)
                        freed.update(give)
                        if len(freed) >= short:
                            return victims
                    continue
                if v.session in chosen or self.moving(v.session):
                    continue  # shrunk already, or its devices are on the move
                if v.state == FROZEN and len(v.missing) >= len(v.workers):
                    continue  # reserves nothing
                held = [w for w in v.workers if w not in v.missing] if v.state == FROZEN else list(v.workers)
                if not held:
                    continue
                victims.append((v, []))
                chosen.add(v.session)
                pending.update(held)
                for w in list(pending):
                    slot = self.pool.slots.get(w)
                    if slot is None or not slot.placeable:
                        pending.discard(w)
                    elif all(h in chosen for h in slot.leases):
                        pending.discard(w)
                        freed.add(w)
                if len(freed) >= short:
                    return victims
        return None

    def _spares(self, bucket: Mapping[str, None], left: int) -> Iterator[tuple[Tenant, list[str]]]:
        """Running elastic tenants of one rank above their floor, most recent first, with the devices each can give
        up (leased to it alone, the most recently leased first) until `left` are found."""
        elastic = sorted((self.tenants[s] for s in self._elastic if s in bucket), key=lambda t: t.bucketed,
                         reverse=True)  # the bucket's elastic tenants, most recent first (not a walk over the bucket)
        for v in elastic:
            if left <= 0:
                return
            session = v.session
            spare = len(v.workers) - max(1, v.floor)
            if not v.elastic or spare <= 0 or self.moving(session):
                continue
            give = [w for w in reversed(v.workers) if len(self.pool.holders(w)) == 1][:min(spare, left)]
            if give:
                left -= len(give)
                yield v, give

    def _shrink_for(self, now: float, v: Tenant, give: list[str], by: Tenant, ch: Changes) -> None:
        """`v` gives up `give` instead of being frozen (rule 10): it keeps running on the rest; the core moves its
        logical devices off them onto the ones it keeps (`Changes.shrunk`); it may grow again later (rule 5)."""
        self._accrue(now, v)
        for w in give:
            del v.workers[w]
            self._release(w, v.session)
        self._watch(v, now)
        self.decisions += 1
        ch.shrunk.append((v.session, list(give)))
        ch.notes.append(f"session {_short(v.session)} shrinks to {_plural(len(v.workers), 'device')} "
                        f"({v.logical} logical): preempted by session {_short(by.session)}")

    def _best_fit_first(self, bucket: Mapping[str, None], left: int, now: float) -> Iterator[Tenant]:
        """Running tenants of one rank, most recent first, except that one among the most recent `_FIT_WINDOW` that
        frees `left` devices by itself goes first: when the policy `paces`, the one whose devices should be done
        soonest (`busy_for`: a freeze takes effect when the batches sent run out, and the preemptor's devices wait
        idle until then); the smallest among equals (a 1-device request should not freeze an 8-device session when
        a 1-device one would do)."""
        recent = [self.tenants[s] for s in itertools.islice(reversed(bucket), _FIT_WINDOW)]
        fits = [v for v in recent if len(v.workers) >= left]
        if fits:
            pace = self.busy_for if self.policy.paces else lambda session, now: 0.0
            best = min(fits, key=lambda v: (pace(v.session, now), len(v.workers)))  # the most recent of equals
            recent.remove(best)
            recent.insert(0, best)
        rest = (self.tenants[s] for s in itertools.islice(reversed(bucket), _FIT_WINDOW, None))
        return itertools.chain(recent, rest)

    def _freeze(self, now: float, v: Tenant, by: Tenant, ch: Changes) -> None:
        """Stop dispatching `v`: its devices go back to the pool (it gets back the ones left over)."""
        self._stop(now, v)
        self._step(v, FREEZE)
        v.waiting_since = now
        v.rank = self.policy.rank(v, now)
        self._bucket(v, self._frozen)
        self._frozen_packed += self._packs(v)
        self._unreserve(v)
        self._watch(v, now)
        self.decisions += 1
        ch.frozen.append(v.session)
        ch.notes.append(f"session {_short(v.session)} ({v.priority}) frozen on {_plural(len(v.workers), 'device')}:"
                        f" preempted by session {_short(by.session)} ({by.priority})")

    def _unreserve(self, v: Tenant) -> None:
        """A frozen tenant lets go of the devices it holds; it wants them all back."""
        n = len(v.missing)
        for w in v.workers:
            if w not in v.missing:
                v.missing[w] = None
                self._wanted.setdefault(w, {})[v.session] = None
                self._want_at(v, w)
                self._release(w, v.session)
        self._index_missing(v, n)
        self._resumable.pop(v.session, None)

    def _unfreeze(self, t: Tenant) -> None:
        """Forget a frozen tenant's wants (it resumes or closes)."""
        self._unfreeze_wants(t)
        self._unbucket(t, self._frozen)
        self._frozen_packed -= self._packs(t)
        self._resumable.pop(t.session, None)

    def _unwant(self, t: Tenant, w: str) -> None:
        """`t` holds `w` again."""
        n = len(t.missing)
        t.missing.pop(w, None)
        self._index_missing(t, n)
        self._reserving.add(t.session)
        self._drop_want(t, w)

    def _drop_want(self, t: Tenant, w: str) -> None:
        """`t` leaves the indexes of the frozen tenants that want `w` (`_wanted`, `_wanted_at`)."""
        wanting = self._wanted.get(w)
        if wanting is not None:
            wanting.pop(t.session, None)
            if not wanting:
                del self._wanted[w]
        self._unwant_at(t, w)

    def _want_at(self, t: Tenant, w: str) -> None:
        """`t`, frozen, misses `w` at its rank (`_wanted_at`)."""
        self._wanted_at.setdefault(w, {}).setdefault(t.rank, {})[t.session] = None

    def _unwant_at(self, t: Tenant, w: str) -> None:
        """`t` leaves `_wanted_at[w]` (it holds `w` again, or its rank changes)."""
        ranks = self._wanted_at.get(w)
        if ranks is not None:
            bucket = ranks.get(t.rank)
            if bucket is not None:
                bucket.pop(t.session, None)
                if not bucket:
                    del ranks[t.rank]
                    if not ranks:
                        del self._wanted_at[w]

    def _unfreeze_wants(self, t: Tenant) -> None:
        for w in t.missing:
            self._drop_want(t, w)
        n = len(t.missing)
        t.missing.clear()
        self._index_missing(t, n)

    def _release(self, worker: str, session: str) -> None:
        self.pool.release(worker, session)
        if worker in self._wanted:
            self._freed.append(worker)

    def _offer(self) -> None:
        """Reserve each released device that frozen tenants want for the best ranked one it fits. A policy that
        `lends` reserves a device only for a tenant it completes (it resumes at once): the others stay free for
        anyone meanwhile (rule 6)."""
        freed, self._freed = self._freed, []
        lends = self.policy.lends
        for w in freed:
            wanting = self._wanted.get(w)
            if not wanting or w not in self.pool:
                continue
            if not self._frozen_packed and not self.pool.fits(w, 0):
                continue  # nothing frozen packs: a device with a lease fits none of them
            # A lending policy offers it only to the tenants it completes (`_completes`), not to every frozen
            # tenant it had (hundreds, under preemption).
            wants = [self.tenants[s] for s in (self._completes.get(w, ()) if lends else wanting) if s in wanting]
            if not self._frozen_packed and wants:  # whole devices: the best ranked one takes it, nobody else fits
                wants = [min(wants, key=_RANKED)]
            for t in sorted(wants, key=_RANKED):
                cap = self._cap(t)
                if not self.pool.fits(w, cap):
                    continue
                self.pool.lease(w, t.session, cap)
                n = len(t.missing)
                t.missing.pop(w, None)
                self._index_missing(t, n)
                self._reserving.add(t.session)
                del wanting[t.session]
                self._unwant_at(t, w)
                if not t.missing:
                    self._resumable[t.session] = None
            if not wanting:
                del self._wanted[w]

    def _resume(self, now: float, t: Tenant, ch: Changes) -> None:
        """`t` holds all its (live) devices again: their reservation leases become its running leases."""
        self._unfreeze(t)
        self._step(t, RESUME)
        waited = now - (t.waiting_since or now)
        t.frozen_s += waited
        self._start(now, t, self._ranks)
        self.decisions += 1
        ch.resumed.append(t.session)
        ch.notes.append(f"session {_short(t.session)} resumed on {_plural(len(t.workers), 'device')} after "
                        f"{waited:.2f}s frozen")

    # ------------------------------------------------------------ bookkeeping

    def _step(self, t: Tenant, event: str) -> None:
        try:
            t.state = TENANT_TABLE[t.state][event]
        except KeyError:
            raise IllegalTenantTransition(f"session {t.session}: no transition from {t.state!r} on {event!r}") from None

    def _start(self, now: float, t: Tenant, buckets: dict[int, dict[str, None]]) -> None:
        t.since = now
        if t.waiting_since is not None:
            t.waited += now - t.waiting_since
        t.waiting_since = None
        t.rank = self.policy.rank(t, now)
        self._bucket(t, buckets)
        self._watch(t, now)

    def _stop(self, now: float, t: Tenant) -> None:
        """Leaving `running`: bank the service, leave the rank buckets."""
        self._accrue(now, t)
        self._unbucket(t, self._ranks)

    def _bucket(self, t: Tenant, buckets: dict[int, dict[str, None]]) -> None:
        t.bucketed = next(self._bucketing)
        buckets.setdefault(t.rank, {})[t.session] = None

    def _index_missing(self, t: Tenant, before: int) -> None:
        """A frozen tenant's `missing` went from `before` devices to what it is now: move it in `_missing_n`."""
        n = len(t.missing)
        if n == before:
            return
        if before:
            bucket = self._missing_n[before]
            del bucket[t.session]
            if not bucket:
                del self._missing_n[before]
        if n:
            self._missing_n.setdefault(n, {})[t.session] = None
        sole = self._sole.pop(t.session, None)
        if sole is not None:
            bucket = self._completes[sole]
            del bucket[t.session]
            if not bucket:
                del self._completes[sole]
        if n == 1:
            (w,) = t.missing
            self._sole[t.session] = w
            self._completes.setdefault(w, {})[t.session] = None

    @staticmethod
    def _unbucket(t: Tenant, buckets: dict[int, dict[str, None]]) -> None:
        bucket = buckets.get(t.rank)
        if bucket is not None and t.session in bucket:
            del bucket[t.session]
            if not bucket:
                del buckets[t.rank]

    def _accrue(self, now: float, t: Tenant) -> None:
        if t.running:
            t.attained += len(t.workers) * max(0.0, now - t.since)
            t.since = now

    def _enqueue(self, t: Tenant, now: float) -> None:
        if t.request is not None and getattr(self.policy, "fgd", True):  # what requests look like: packing avoids
            self.pool.saw(self._cap(t), len(t.request.devices))  # stranding room they need (pool rule 7)
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
        if t.state == FROZEN and self.relocation and self.policy.relocates:
            patient = (t.waiting_since or now) + self.policy.relocate_after
            if patient > now:  # look again when its patience runs out: it may relocate then
                at = patient if at is None else min(at, patient)
        if at is not None:
            heapq.heappush(self._wakeups, (max(at, now + _MIN_WAKE_S), t.stamp, t.session))
