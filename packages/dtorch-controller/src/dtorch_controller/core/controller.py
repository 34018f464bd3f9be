"""The controller core: events in, effects out.

Rules:

1. `ControllerCore.handle(now, event) -> list[Effect]` is the only entry point. `now` is the adapter's
   monotonic clock (wall clock in the server, simulated clock in dtorch-sim); the core never reads a
   clock, does no I/O and starts no threads. Randomness (session ids) is injected too.
2. The core is single-threaded: the adapter serializes calls and performs the returned effects, in
   order, outside its lock. Outcomes come back as events (`WorkerUnreachable`, `TimerFired`).
3. Every request event gets exactly one `Reply`, at once or later (Sync waits for workers).
4. Client input never raises out of the core: a bad request is answered with a `Refusal`, a bad
   instruction becomes an ErrorReport surfaced at the session's next Sync.
5. Each worker's Execute seqs are contiguous from 1, across sessions; every seq the core assigns is
   emitted as a `SendExecute`, so a worker that runs batches in seq order never waits for a gap.
6. A worker declared lost is fenced for good: its reports are answered "fenced", it gets no commands,
   and it must register again under a new id. Lifecycles are the tables in `state.py`.
7. Timers may fire late, early or after they stopped mattering: each firing rechecks the state.
8. Who runs where is the scheduler's (`scheduler.py`, `pool.py`, `policies/`): the core feeds it capacity
   changes and mesh requests and applies the `Changes` it returns (bind devices, flush a resumed session's
   held batches, set its wake-up timer). A frozen session's Submits are accepted and held, untranslated.
9. A client session that says nothing (any request naming it, or KeepAlive) for `session_timeout_s` is
   closed as if it had called CloseSession: every worker it used frees its shards, whatever protocol
   version the client speaks (one that sends no keep-alives must keep talking).
10. A session belongs to the tenant that opened it (`event.who`): a request naming another tenant's session
   is answered as for an unknown one, and keeps nothing alive. A tenant's Status shows its own sessions, the
   workers they use (with its own shards only) and everyone else's work as anonymous counts; an admin sees
   all. Quotas (`who.quota`) are checked when a session or mesh is asked for, and refused at once, naming
   the quota.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec

from dtorch_controller import __version__
from dtorch_controller.core import effects as fx
from dtorch_controller.core import elastic
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_controller.core.config import Config
from dtorch_controller.core.eventlog import EventLog
from dtorch_controller.core.ids import random_session_id
from dtorch_controller.core.model import Mesh, PendingSync, Session, Worker
from dtorch_controller.core.policies import Policy, make_policy
from dtorch_controller.core.recovery import Faults
from dtorch_controller.core.scheduler import Changes, Scheduler
from dtorch_protocol import messages as m
from dtorch_protocol.wire import ProtocolError, check_hello

Effects = list[fx.Effect]

PRIORITIES = ("high", "normal", "low")
KINDS = ("batch", "realtime")
_EPS = 1e-9  # timers due "at" a deadline must count as past it despite float rounding


def _short(session_id: str) -> str:
    return session_id[:8]


class ControllerCore:
    """All controller logic: workers, sessions, placement, routing, health. See the module rules."""

    def __init__(self, config: Config | None = None, *, session_ids: Callable[[], str] | None = None,
                 policy: Policy | None = None, version: str = __version__) -> None:
        self.config = config or Config()
        self.policy: Policy = policy or make_policy()
        self.version = version
        self.workers: dict[str, Worker] = {}
        self.sessions: dict[str, Session] = {}
        self.sched = Scheduler(self.policy, self.workers)
        self.log = EventLog(self.config.event_log_size, self.config.format_time)
        self._new_session_id = session_ids or random_session_id
        self._by_address: dict[str, str] = {}  # address -> id of the worker there that is not lost
        self._registrations = 0
        self._sync_waits: dict[str, set[str]] = {}  # worker -> sessions whose parked Syncs wait for it to complete
        self.faults = Faults(self)  # snapshots, recovery after worker loss, migration, drain (recovery.py)
        self.sched.growth = True  # elastic sessions grow onto free workers: elastic.py moves their devices
        self.sched.relocation = True  # frozen sessions resume on free workers: elastic.py moves their devices
        self.sched.moving = self.faults.mover.busy  # ... and are left alone while their devices move
        self._handlers: dict[type, Callable[[float, Any, Effects], None]] = {
            ev.OpenSession: self._open_session, ev.OpenMesh: self._open_mesh, ev.Submit: self._submit,
            ev.Sync: self._sync, ev.CloseSession: self._close_session, ev.Status: self._status,
            ev.Register: self._register, ev.Report: self._report, ev.TimerFired: self._timer,
            ev.WorkerUnreachable: self._unreachable, ev.Drain: self.faults.mover.drain,
            ev.Migrate: self.faults.mover.migrate, ev.KeepAlive: self._keepalive,
        }

    def handle(self, now: float, event: ev.Event) -> list[fx.Effect]:
        """Apply one event at time `now`; returns what the adapter must do, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a controller event: {event!r}")
        out: Effects = []
        self.faults.now = now
        s = self.sessions.get(getattr(getattr(event, "msg", None), "session", None))  # type: ignore[arg-type]
        if s is not None and _owns(getattr(event, "who", ev.OPERATOR), s):
            s.last_heard = now
        handler(now, event, out)
        return out

    # ------------------------------------------------------------ small helpers

    @staticmethod
    def _reply(out: Effects, request_id: Any, message: Any) -> None:
        out.append(fx.Reply(request_id, message))

    def _refuse(self, out: Effects, request_id: Any, message: str, kind: str = "refused") -> None:
        out.append(fx.Reply(request_id, fx.Refusal(kind, message)))  # type: ignore[arg-type]

    def _session(self, out: Effects, request_id: Any, session_id: str, who: ev.Principal) -> Session | None:
        """The session, if it exists and `who` owns it; otherwise refused (another's reads as unknown)."""
        s = self.sessions.get(session_id)
        if s is None or not _owns(who, s):
            self._refuse(out, request_id, f"unknown session {session_id[:16]!r} (closed, or never opened here)")
            return None
        return s

    @staticmethod
    def _hello_refusal(hello: m.Hello, role: str) -> str | None:
        """Why a Hello is refused (the table in `dtorch_protocol.wire`: older clients, newer workers), or None."""
        try:
            check_hello(hello, role)
        except ProtocolError as e:
            return str(e)
        return None

    def _send(self, s: Session, cmds: dict[str, list[m.Cmd]], out: Effects) -> None:
        """One Execute per worker with commands, numbered with the worker's next seq.

        Each carries the session's memory cap when its leases are packed (0: whole devices, no cap), which
        the worker enforces on the session's shards there.
        """
        t = self.sched.tenants.get(s.id)
        cap = self.sched._cap(t) if t is not None else 0
        for worker_id, batch in cmds.items():
            if not batch:
                continue
            w = self.workers[worker_id]
            w.sent += 1
            s.sent[worker_id] = w.sent
            out.append(fx.SendExecute(worker_id, w.address, m.Execute(seq=w.sent, session=s.id, cmds=batch,
                                                                      memory_cap=cap)))

    def _locations(self, s: Session) -> dict[int, str]:
        return {d: self.workers[w].address for d, w in sorted(s.devices.items())}

    # ------------------------------------------------------------ sessions and meshes

    def _open_session(self, now: float, e: ev.OpenSession, out: Effects) -> None:
        msg = e.msg
        refusal = self._hello_refusal(msg.hello, "client")
        if refusal:
            return self._refuse(out, e.request_id, refusal, "protocol")
        if msg.priority not in PRIORITIES:
            return self._refuse(out, e.request_id, f"bad priority {msg.priority!r}: expected one of {PRIORITIES}")
        if msg.kind not in KINDS:
            return self._refuse(out, e.request_id, f"bad session kind {msg.kind!r}: expected one of {KINDS}")
        if msg.memory_cap < 0:
            return self._refuse(out, e.request_id, f"bad memory_cap {msg.memory_cap}: expected bytes >= 0")
        problem = self._session_quota(e.who, msg.memory_cap)
        if problem:
            return self._refuse(out, e.request_id, problem, "quota")
        sid = self._new_session_id()
        while sid in self.sessions:
            sid = self._new_session_id()
        if msg.expected_steps < 0:
            return self._refuse(out, e.request_id, f"bad expected_steps {msg.expected_steps}: expected a count >= 0")
        self.sessions[sid] = Session(id=sid, name=msg.name, priority=msg.priority, kind=msg.kind, opened_at=now,
                                     last_heard=now, tenant=e.who.tenant)
        self.sessions[sid].comm.timeout_s = self.config.collective_timeout_s
        self.sched.open(sid, msg.priority, msg.kind, msg.memory_cap, msg.expected_steps)
        self.log.add(now, f"session {_short(sid)} opened ({msg.name or 'unnamed'}, {msg.priority}, {msg.kind})")
        timeout = self.config.session_timeout_s
        keepalive = 0.0
        if timeout > 0:
            keepalive = min(1.0, timeout / 4)
            out.append(fx.SetTimer(now + timeout, ("session", sid)))
        self._reply(out, e.request_id, m.SessionOpened(session=sid, controller_version=self.version,
                                                       keepalive_s=keepalive))

    def _open_mesh(self, now: float, e: ev.OpenMesh, out: Effects) -> None:
        msg = e.msg
        s = self._session(out, e.request_id, msg.session, e.who)
        if s is None:
            return
        devices, shape = tuple(msg.devices), tuple(msg.shape)
        problem = _mesh_problem(devices, shape)
        if problem:
            return self._refuse(out, e.request_id, f"bad mesh {msg.mesh}: {problem}")
        known = s.meshes.get(msg.mesh)
        if known is not None and known.key != (devices, shape):
            return self._refuse(out, e.request_id, f"mesh {msg.mesh} is already open with devices "
                                                   f"{list(known.devices)} and shape {list(known.shape)}")
        new = tuple(d for d in devices if d not in s.devices)
        if new and (problem := self._device_quota(e.who, s, len(new))):
            return self._refuse(out, e.request_id, problem, "quota")
        if new:
            queued = self.sched.position(s.id)
            changes, answer = self.sched.place(now, s.id, msg.mesh, new, msg.min_devices)
            self._apply(now, changes, out)
            if not answer.placed:
                if not queued:
                    self.log.add(now, f"session {_short(s.id)} mesh {msg.mesh} waits: {answer.message}")
                return self._reply(out, e.request_id, m.MeshPlaced(
                    mesh=msg.mesh, placed=False, queue_position=answer.queue_position, message=answer.message))
            self.log.add(now, f"session {_short(s.id)} mesh {msg.mesh}: devices "
                              + ", ".join(f"{d}->{s.devices[d]}" for d in new))
        s.meshes[msg.mesh] = Mesh(id=msg.mesh, devices=devices, shape=shape)
        self._reply(out, e.request_id, m.MeshPlaced(
            mesh=msg.mesh, placed=True, locations={d: self.workers[s.devices[d]].address for d in devices}))

    def _bind(self, s: Session, device: int, worker_id: str) -> None:
        w = self.workers[worker_id]
        s.devices[device] = worker_id
        w.sessions.add(s.id)
        w.bound += 1

    def _submit(self, now: float, e: ev.Submit, out: Effects) -> None:
        msg = e.msg
        s = self._session(out, e.request_id, msg.session, e.who)
        if s is None:
            return
        if msg.seq != s.seq + 1:
            return self._refuse(out, e.request_id, f"batch {msg.seq} out of order: session {_short(s.id)} "
                                                   f"expects batch {s.seq + 1}")
        s.seq = msg.seq
        self.faults.submitted(s, msg.seq, msg.instrs)  # logged for replay after a worker loss
        if not self.sched.hold(s.id, msg.instrs):  # a frozen session's batches wait until it resumes
            self._dispatch(s, msg.instrs, out)
        self._reply(out, e.request_id, m.SubmitReply(accepted=msg.seq))

    def _dispatch(self, s: Session, instrs: list[m.Instr], out: Effects) -> None:
        """Translate and send a batch (and any held before it), unless recovery or a move holds them."""
        self.faults.dispatch(s, instrs, out)

    def _close_session(self, now: float, e: ev.CloseSession, out: Effects) -> None:
        s = self.sessions.get(e.msg.session)
        if s is None or not _owns(e.who, s):
            return self._reply(out, e.request_id, m.Ack(ok=False, message="unknown session (already closed?)"))
        self._end_session(now, s, "closed", out)
        self._reply(out, e.request_id, m.Ack(ok=True))

    def _end_session(self, now: float, s: Session, reason: str, out: Effects) -> None:
        """Free the session's shards on every worker it used, answer its parked syncs, release its devices."""
        holders = sorted({w for w in s.devices.values() if self.workers[w].state != st.LOST},
                         key=lambda w: self.workers[w].order)
        self._send(s, {w: [m.CmdCloseSession()] for w in holders}, out)
        for pending in s.syncs.values():
            self._reply(out, pending.request_id, m.SyncReply(done=False, message="session closed"))
        for worker_id in s.devices.values():
            w = self.workers[worker_id]
            w.bound -= 1
            w.sessions.discard(s.id)
        self.faults.closed(s, out)
        s.state = st.step(st.SESSION_TABLE, s.state, st.CLOSE)
        del self.sessions[s.id]
        self.log.add(now, f"session {_short(s.id)} {reason}")
        if len(holders) < len(set(s.devices.values())):  # it used a lost worker, which may be forgotten now
            self._prune_lost()
        self._apply(now, self.sched.close(now, s.id), out)

    # ------------------------------------------------------------ sync

    def _busy(self, s: Session) -> list[Worker]:
        """Workers that have not finished the session's batches yet (lost ones are reported, not waited for)."""
        busy = []
        for worker_id, seq in s.sent.items():
            w = self.workers.get(worker_id)  # a forgotten worker was lost: nothing to wait for
            if w is not None and w.state != st.LOST and w.completed < seq:
                busy.append(w)
        return busy

    def _first_busy(self, s: Session) -> str | None:
        """A worker of `_busy(s)`, or None (stops at the first, looking at the latest sent to first: a report of
        each of a wide session's workers asks this, and a relocated session keeps its old workers in `sent`)."""
        workers = self.workers
        for worker_id, seq in reversed(s.sent.items()):
            w = workers.get(worker_id)
            if w is not None and w.completed < seq and w.state != st.LOST:
                return worker_id
        return None

    def _sync(self, now: float, e: ev.Sync, out: Effects) -> None:
        msg = e.msg
        s = self._session(out, e.request_id, msg.session, e.who)
        if s is None:
            return
        if msg.upto > s.seq:
            return self._refuse(out, e.request_id, f"sync upto batch {msg.upto}, but the last batch accepted "
                                                   f"for session {_short(s.id)} is {s.seq}")
        self._apply(now, self.sched.progress(now, s.id, msg.upto), out)  # a sync point is a step of its progress
        if not self._busy(s) and not self._held(s):
            return self._reply(out, e.request_id, self._done(s))
        timeout = 0.0 if math.isnan(msg.timeout_s) else min(max(msg.timeout_s, 0.0), self.config.max_sync_timeout_s)
        s.syncs[e.request_id] = PendingSync(e.request_id, msg.upto, timeout)
        out.append(fx.SetTimer(now + timeout, ("sync", s.id, e.request_id)))
        self._resolve_syncs(s, out)  # files it under a busy worker (answered when that one completes)

    def _held(self, s: Session) -> bool:
        """Batches accepted but not sent yet: frozen by the scheduler, or held by recovery or a move."""
        return self.sched.holding(s.id) or self.faults.holding(s)

    def _done(self, s: Session) -> m.SyncReply:
        self.faults.delivered(s)
        errors, s.errors = s.errors, []
        return m.SyncReply(done=True, errors=errors, locations=self._locations(s))

    def _resolve_syncs(self, s: Session, out: Effects) -> None:
        # held first: it is O(1), and a frozen session's parked Syncs are looked at by every report of the workers
        # it stays bound to (with LAS, hundreds of frozen sessions), where `_busy` walks every worker it used
        if not s.syncs or self._held(s):
            return
        busy = self._first_busy(s)
        if busy is not None:  # its report of a completion looks again, even if it hosts no device of `s` now
            self._sync_waits.setdefault(busy, set()).add(s.id)
        else:
            for pending in s.syncs.values():
                self._reply(out, pending.request_id, self._done(s))
            s.syncs.clear()

    def _sync_timeout(self, now: float, session_id: Any, request_id: Any, out: Effects) -> None:
        s = self.sessions.get(session_id)
        pending = s.syncs.pop(request_id, None) if s is not None else None
        if s is None or pending is None:
            return  # answered already
        busy = self._busy(s)
        if not busy and not self._held(s):
            return self._reply(out, request_id, self._done(s))
        if not busy and self.faults.holding(s):
            return self._reply(out, request_id, m.SyncReply(
                done=False, locations=self._locations(s),
                message=f"sync upto batch {pending.upto} timed out after {pending.timeout_s:g}s; the session is "
                        f"{s.state} with batches held"))
        if not busy:
            return self._reply(out, request_id, m.SyncReply(
                done=False, locations=self._locations(s),
                message=f"sync upto batch {pending.upto} timed out after {pending.timeout_s:g}s; the session is "
                        f"frozen (preempted) with batches held, queue position {self.sched.position(s.id)}"))
        names = ", ".join(f"{w.id} at {w.address} (completed {w.completed} of {s.sent[w.id]})" for w in busy)
        self._reply(out, request_id, m.SyncReply(
            done=False, locations=self._locations(s),
            message=f"sync upto batch {pending.upto} timed out after {pending.timeout_s:g}s; "
                    f"workers still busy: {names}"))

    # ------------------------------------------------------------ workers

    def _register(self, now: float, e: ev.Register, out: Effects) -> None:
        msg = e.msg
        refusal = self._hello_refusal(msg.hello, "worker")
        if refusal:
            return self._refuse(out, e.request_id, refusal, "protocol")
        if not msg.address:
            return self._refuse(out, e.request_id, "a worker must register with the address peers reach it at")
        previous = self._by_address.get(msg.address)
        if previous is not None:  # a registration never fences a live worker: the old one must be lost first
            return self._refuse(out, e.request_id, f"address {msg.address} belongs to live worker {previous}: a "
                                                   "worker restarting there is accepted once that one is declared "
                                                   "lost", "conflict")
        worker_id = f"w{self._registrations}"
        self._registrations += 1
        self.workers[worker_id] = Worker(
            id=worker_id, address=msg.address, device_type=msg.device_type, memory_bytes=msg.memory_bytes,
            labels=dict(msg.labels), order=self._registrations, last_seen=now, rendezvous=msg.rendezvous,
            device_id=msg.device_id)
        self._by_address[msg.address] = worker_id
        self.log.add(now, f"worker {worker_id} registered at {msg.address} ({msg.device_type})")
        out.append(fx.SetTimer(now + self.config.suspect_after_s, ("heartbeat", worker_id)))
        self._apply(now, self.sched.add_worker(now, self.workers[worker_id]), out)
        self._reply(out, e.request_id, m.Registered(worker=worker_id,
                                                    heartbeat_interval_s=self.config.heartbeat_interval_s))

    def _report(self, now: float, e: ev.Report, out: Effects) -> None:
        msg = e.msg
        w = self.workers.get(msg.worker)
        if w is None or w.state == st.LOST:
            return self._reply(out, e.request_id, m.ReportReply(ok=False, message="fenced"))
        was = w.state
        if w.state == st.SUSPECT:
            self.log.add(now, f"worker {w.id} reported again after {now - w.last_seen:.2f}s")
        w.state = st.step(st.WORKER_TABLE, w.state, st.REPORT)
        w.last_seen = now
        if w.state != was:
            self._apply(now, self.sched.worker_changed(now, w), out)
        before = w.completed
        w.completed = max(w.completed, min(msg.completed, w.sent))  # it cannot have finished what it never got
        w.stats = dict(msg.sessions)
        w.received_bytes = msg.received_bytes
        for session_id, errors in msg.errors.items():
            s = self.sessions.get(session_id)
            if s is not None:
                s.errors.extend(self.faults.errors(s, w, errors))
        if msg.sessions:
            self._check_caps(now, w, msg.sessions)
        self.faults.progress(now, w, msg, out)  # snapshots, rebuilds and moves waiting for this worker
        if w.completed > before:  # only a completion lets deletes and Syncs go (a hold resolves its own on release)
            for session_id in sorted(w.sessions | self._sync_waits.pop(w.id, set())):
                s = self.sessions.get(session_id)
                if s is not None:
                    self._flush_deferred(s, out)
                    self._resolve_syncs(s, out)
        self._reply(out, e.request_id, m.ReportReply(ok=True))

    def _timer(self, now: float, e: ev.TimerFired, out: Effects) -> None:
        key = e.key
        if isinstance(key, tuple) and len(key) == 2 and key[0] == "heartbeat":
            self._check_heartbeat(now, key[1], out)
        elif isinstance(key, tuple) and len(key) == 3 and key[0] == "sync":
            self._sync_timeout(now, key[1], key[2], out)
        elif self.faults.timer(key, out):
            pass
        elif key == ("schedule",):
            self._apply(now, self.sched.tick(now), out)
        elif isinstance(key, tuple) and len(key) == 2 and key[0] == "session":
            self._check_session(now, key[1], out)

    def _check_heartbeat(self, now: float, worker_id: Any, out: Effects) -> None:
        w = self.workers.get(worker_id)
        if w is None or w.state == st.LOST:
            return
        cfg = self.config
        silence = now - w.last_seen
        if silence >= cfg.heartbeat_timeout_s - _EPS:
            return self._lose(now, w, st.TIMEOUT, f"no report for {silence:.2f}s", out)
        if silence >= cfg.suspect_after_s - _EPS and w.state == st.ALIVE:
            w.state = st.step(st.WORKER_TABLE, w.state, st.SILENT)
            self.log.add(now, f"worker {w.id} suspect: no report for {silence:.2f}s")
            self._apply(now, self.sched.worker_changed(now, w), out)
        due = w.last_seen + (cfg.suspect_after_s if w.state == st.ALIVE else cfg.heartbeat_timeout_s)
        out.append(fx.SetTimer(due, ("heartbeat", w.id)))

    def _unreachable(self, now: float, e: ev.WorkerUnreachable, out: Effects) -> None:
        w = self.workers.get(e.worker_id)
        if w is not None and w.state != st.LOST:
            self._lose(now, w, st.UNREACHABLE, f"unreachable: {e.message or 'send failed'}", out)

    def _lose(self, now: float, w: Worker, event: str, reason: str, out: Effects) -> None:
        """Fence `w`; tell each session that depended on it which logical devices lost their tensors."""
        w.state = st.step(st.WORKER_TABLE, w.state, event)
        if self._by_address.get(w.address) == w.id:
            del self._by_address[w.address]
        self.log.add(now, f"worker {w.id} at {w.address} lost: {reason}")
        taken = self.faults.losing(w, reason)  # sessions rebuilt from their copies instead (recovery.py)
        waiting = self._sync_waits.pop(w.id, set()) - w.sessions  # it completes nothing more: they look again
        for session_id in sorted(waiting):
            if session_id in self.sessions and session_id not in taken:
                self._resolve_syncs(self.sessions[session_id], out)
        for session_id in sorted(w.sessions):
            if session_id in taken:
                continue
            s = self.sessions[session_id]
            devices = sorted(d for d, worker_id in s.devices.items() if worker_id == w.id)
            on_worker = {mesh.id for mesh in s.meshes.values() if any(s.devices[d] == w.id for d in mesh.devices)}
            lost = sorted(tid for tid, spec in s.tensors.items() if spec.mesh in on_worker)
            unfinished = s.sent.pop(w.id, 0) > w.completed
            s.state = st.step(st.SESSION_TABLE, s.state, st.WORKER_LOST)
            if lost or unfinished:
                what = f"{len(lost)} tensors lost: {self.faults.lost_detail(s, lost)}" if lost \
                    else "unfinished commands lost"
                s.errors.append(m.ErrorReport(
                    op="worker lost", src="", tid=lost[0] if lost else -1, kind=m.ErrorKind.WORKER_LOST,
                    message=f"worker {w.id} at {w.address} was lost ({reason}); logical devices {devices} "
                            f"lost their data: {what}"))
            self.log.add(now, f"session {_short(s.id)} lost logical devices {devices} with worker {w.id}")
            self._flush_deferred(s, out)
            self._resolve_syncs(s, out)
        self._prune_lost()
        self._apply(now, self.sched.worker_changed(now, w), out)
        self.faults.lost(w, taken, out)

    def _prune_lost(self) -> None:
        """Forget the oldest lost workers nothing refers to, keeping `lost_workers_kept` for Status."""
        idle = sorted((w for w in self.workers.values() if w.state == st.LOST and not w.sessions),
                      key=lambda w: w.order)
        for w in idle[:max(0, len(idle) - self.config.lost_workers_kept)]:
            del self.workers[w.id]

    def _flush_deferred(self, s: Session, out: Effects) -> None:
        """Send the deletes whose remote readers have finished (or were lost)."""
        if not s.deferred:
            return
        ready, waiting = [], []
        for dd in s.deferred:
            done = all((w := self.workers.get(wid)) is None or w.state == st.LOST or w.completed >= seq
                       for wid, seq in dd.waits.items())
            (ready if done else waiting).append(dd)
        s.deferred = waiting
        groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        for dd in ready:
            if dd.tid in s.tensors:  # the id was reused: the new tensor already replaced the old shards
                continue
            for worker_id, devices in dd.devices.items():
                if self.workers[worker_id].state != st.LOST:
                    groups.setdefault((worker_id, tuple(devices)), []).append(dd.tid)
        cmds: dict[str, list[m.Cmd]] = {}
        for (worker_id, devices), tids in groups.items():
            cmds.setdefault(worker_id, []).append(m.CmdDelete(tids=tids, devices=list(devices)))
        self._send(s, cmds, out)

    # ------------------------------------------------------------ scheduling and liveness

    def _apply(self, now: float, changes: Changes, out: Effects) -> None:
        """Carry out what the scheduler decided: bind placed devices, flush resumed sessions' held batches."""
        for session_id, assignment in changes.placed:
            s = self.sessions[session_id]
            for device, worker_id in assignment.items():
                self._bind(s, device, worker_id)
        for line in changes.notes:
            self.log.add(now, line)
        for session_id, swap in changes.relocated:  # moves first: they hold the batches the resume flushes
            elastic.relocate(self, now, session_id, swap, out)
        for session_id in changes.resumed:
            s = self.sessions[session_id]
            for instrs in self.sched.take_backlog(session_id):
                self._dispatch(s, instrs, out)
            self._resolve_syncs(s, out)
        for session_id, workers in changes.shrunk:
            elastic.shrink(self, now, session_id, workers, out)
        for session_id, workers in changes.grown:
            elastic.grow(self, now, session_id, workers, out)
        if changes.wake is not None:
            out.append(fx.SetTimer(changes.wake, ("schedule",)))

    def _keepalive(self, now: float, e: ev.KeepAlive, out: Effects) -> None:
        s = self.sessions.get(e.msg.session)
        known = s is not None and _owns(e.who, s)  # handle() already noted that the client is alive
        self._reply(out, e.request_id, m.Ack(ok=known, message="" if known else "unknown session (timed out?)"))

    def _check_session(self, now: float, session_id: Any, out: Effects) -> None:
        s = self.sessions.get(session_id)
        if s is None:
            return
        timeout = self.config.session_timeout_s
        silence = now - s.last_heard
        if silence >= timeout - _EPS:
            return self._end_session(now, s, f"timed out: client silent for {silence:.1f}s", out)
        out.append(fx.SetTimer(s.last_heard + timeout, ("session", s.id)))

    def _check_caps(self, now: float, w: Worker, usage: dict[str, m.ShardStats]) -> None:
        for session_id, used, cap in self.sched.over_cap(w.id, {k: v.bytes for k, v in usage.items()}):
            s = self.sessions.get(session_id)
            if s is None:
                continue
            text = f"session holds {used} bytes on worker {w.id}, over its memory cap of {cap} bytes per device"
            s.errors.append(m.ErrorReport(op="memory cap", src="", message=text, kind=m.ErrorKind.MEMORY_CAP))
            self.log.add(now, f"session {_short(session_id)}: {text}")

    # ------------------------------------------------------------ quotas

    def _tenant_sessions(self, tenant: str) -> list[Session]:
        return [s for s in self.sessions.values() if s.tenant == tenant]

    def _session_quota(self, who: ev.Principal, memory_cap: int) -> str | None:
        q = who.quota
        if q.memory_bytes and not memory_cap:
            return (f"quota: tenant {who.tenant!r} may lease {q.memory_bytes} bytes of device memory (quota "
                    "memory_bytes): open sessions with memory_cap (bytes per device), not whole devices")
        if q.sessions and (n := len(self._tenant_sessions(who.tenant))) >= q.sessions:
            return f"quota: tenant {who.tenant!r} has {n} sessions open, its quota (sessions) is {q.sessions}"
        return None

    def _device_quota(self, who: ev.Principal, s: Session, new: int) -> str | None:
        q = who.quota
        if not (q.devices or q.memory_bytes):
            return None
        mine = self._tenant_sessions(who.tenant)
        held = sum(len(t.devices) for t in mine)
        if q.devices and held + new > q.devices:
            return (f"quota: tenant {who.tenant!r} may hold {q.devices} logical devices (quota devices); it holds "
                    f"{held} and this mesh asks for {new} more")
        caps = {t.id: self.sched.tenants[t.id].cap for t in mine}
        leased = sum(caps[t.id] * len(t.devices) for t in mine)
        if q.memory_bytes and leased + caps[s.id] * new > q.memory_bytes:
            return (f"quota: tenant {who.tenant!r} may lease {q.memory_bytes} bytes of device memory (quota "
                    f"memory_bytes); it leases {leased} and this mesh asks for {caps[s.id] * new} more")
        return None

    # ------------------------------------------------------------ status

    def _status(self, now: float, e: ev.Status, out: Effects) -> None:
        bound: dict[str, list[str]] = {}
        for s in self.sessions.values():
            for d, worker_id in sorted(s.devices.items()):
                bound.setdefault(worker_id, []).append(f"{s.id}:{d}")
        pool, tenants = self.sched.pool.slots, self.sched.tenants
        workers = [m.WorkerStatus(worker=w.id, address=w.address, state=w.state, device_type=w.device_type,
                                  memory_bytes=w.memory_bytes, labels=dict(w.labels), tensors=w.tensors,
                                  bytes=w.bytes, devices=bound.get(w.id, []),
                                  node=pool[w.id].node if w.id in pool else "", received_bytes=w.received_bytes,
                                  leases=dict(pool[w.id].leases) if w.id in pool else {})
                   for w in sorted(self.workers.values(), key=lambda w: w.order)]
        workers = self.faults.worker_status(workers)
        sessions = [m.SessionStatus(session=s.id, name=s.name, priority=s.priority, state=s.state, tenant=s.tenant,
                                    devices=dict(sorted(s.devices.items())), tensors=len(s.tensors),
                                    queue_position=self.sched.position(s.id), kind=s.kind,
                                    schedule=self.sched.state(s.id), memory_cap=tenants[s.id].cap,
                                    attained_s=tenants[s.id].service(now))
                    for s in sorted(self.sessions.values(), key=lambda s: s.opened_at)]
        sessions = self.faults.session_status(sessions)
        reply = m.StatusReply(workers=workers, sessions=sessions, events=self.log.lines(),
                              policy=self.policy.describe(), queued=self.sched.queued)
        self._reply(out, e.request_id, reply if e.who.admin else self._tenant_view(reply, e.who.tenant))

    def _tenant_view(self, reply: m.StatusReply, tenant: str) -> m.StatusReply:
        """What a tenant may see: its sessions, the workers they use with only its own shards and leases, no
        event lines (they name everyone's sessions), and the rest as anonymous counts."""
        mine = {s.id: s for s in self._tenant_sessions(tenant)}
        used = {w for s in mine.values() for w in s.devices.values()}
        workers = []
        for ws in reply.workers:
            if ws.worker not in used:
                continue
            w = self.workers[ws.worker]
            own = [st_ for sid, st_ in w.stats.items() if sid in mine]
            workers.append(msgspec.structs.replace(
                ws, tensors=sum(x.tensors for x in own), bytes=sum(x.bytes for x in own), utilization=-1.0,
                backup_bytes=0, devices=[d for d in ws.devices if d.partition(":")[0] in mine],
                leases={sid: cap for sid, cap in ws.leases.items() if sid in mine}))
        others = [s for s in self.sessions.values() if s.id not in mine]
        return msgspec.structs.replace(
            reply, workers=workers, sessions=[s for s in reply.sessions if s.session in mine], events=[],
            other_sessions=len(others), other_devices=sum(len(s.devices) for s in others),
            other_workers=len(reply.workers) - len(workers))


def _owns(who: ev.Principal, s: Session) -> bool:
    """Whether `who` may name session `s`: its own (in-process callers, the simulator, own everything)."""
    return who is ev.OPERATOR or s.tenant == who.tenant


def _minor(version: str) -> int:
    try:
        return int(version.split(".")[1])
    except (IndexError, ValueError):
        return 0


def _mesh_problem(devices: tuple[int, ...], shape: tuple[int, ...]) -> str | None:
    """Why `devices` with `shape` is not a valid mesh, or None."""
    if not shape or any(n <= 0 for n in shape):
        return f"shape {list(shape)} must have at least one dim, each >= 1"
    if math.prod(shape) != len(devices):
        return f"shape {list(shape)} needs {math.prod(shape)} devices, got {len(devices)}"
    if len(set(devices)) != len(devices):
        return f"a logical device may appear only once in a mesh, got {list(devices)}"
    return None
