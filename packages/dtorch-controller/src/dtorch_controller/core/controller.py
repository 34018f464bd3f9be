"""The controller core: events in, effects out. The façade that drives the core's components.

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
   emitted as a `SendExecute` (pipeline.py), so a worker that runs batches in seq order never waits for a gap.
6. A worker declared lost is fenced for good: its reports are answered "fenced", it gets no commands,
   and it must register again under a new id. Lifecycles are the tables in `state.py`.
7. Timers may fire late, early or after they stopped mattering: each firing rechecks the state. Timer keys
   are typed (`timers.py`) and handled by type, like events.
8. Who runs where is the scheduler's (`scheduler.py`, `pool.py`, `policies/`): the core feeds it capacity
   changes and mesh requests and applies the `Changes` it returns (bind devices, hold a frozen session's
   batches and let them go when it resumes, move devices for growth, shrink and relocation, set its wake-up
   timer).
9. A client session that says nothing (any request naming it, or KeepAlive) for `session_timeout_s` is
   closed as if it had called CloseSession: every worker it used frees its shards, whatever protocol
   version the client speaks (one that sends no keep-alives must keep talking). The client is asked for a
   KeepAlive every `SessionOpened.keepalive_s`, also where silent sessions stay open but recovery is on: the
   answer carries the uploads a rebuild asks for again (recovery.py rule 7) to a client between sync points,
   and a KeepAlive of a session whose client keeps uploads until a snapshot holds them (snapshots.py rule 7)
   takes that snapshot once it is due by time, though no batch goes out (an idle notebook).
10. Calls point one way (docs/architecture.md, `.importlinter`): this module drives the components and none
   of them calls back into it. A handler does its event's own work, then the *settle pass* applies the
   scheduler's decisions and looks at the sessions the event touched (their copies, rebuild, moves,
   snapshot), again until nothing changes any more, like h11's state-triggered transitions run to a fixed
   point; then it files the sessions that wait (waits.py) and answers the Syncs that can be answered. A session
   that a completion pumped and that sent nothing (its dispatch window still full on another worker) is looked
   at only where a look could change something (`_inert`): the same effects, without the look.
11. A session belongs to the tenant that opened it (`event.who`): a request naming another tenant's session
   is answered as for an unknown one, and keeps nothing alive. A tenant's Status shows its own sessions, the
   workers they use (with its own shards only) and everyone else's work as anonymous counts; an admin sees
   all (status.py). Quotas (`who.quota`, tenancy.py) are checked when a session or mesh is asked for, and
   refused at once, naming the quota. A session has at most `MAX_LOGICAL_PER_DEVICE` logical devices per device
   of the cluster: a point-to-point redistribution's plan costs the core the pieces it makes, up to O(sources x
   destinations) for a Shard -> Replicate across meshes (redistribute.py), and a 2,048-device mesh packed onto
   one worker (a 1-byte memory cap) held the core for 29 s, long enough for its workers to give the controller up.
12. A Sync is a step of its session's progress (`Scheduler.progress`, scheduler.py rule 9); a parked Sync is
   filed under the worker it waits for (waits.py), so that worker's completion answers it even when it hosts
   none of the session's devices any more (a shrunk or relocated session).
13. `WorkersAlive` is one `Report` with nothing new per worker, in order, each with its own step and settle pass
   (`_alive`); a worker that such a report leaves as it was (alive or draining, no memory cap to check, nothing
   filed under it, polled or fresh, no drain going on) costs its `last_seen` and utilization only.
14. A worker speaks only for the sessions bound to it or sent work there (`Worker.sessions`, `Session.sent`):
   errors and shard stats it reports for any other live session are dropped, so a worker cannot fail another
   tenant's Sync, bill it or push it over its memory cap. A session keeps at most `MAX_ERRORS_HELD` of its
   workers' error reports for its next Sync, which says how many more came (a flood of them grew without bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dtorch_controller import __version__
from dtorch_controller.core import effects as fx
from dtorch_controller.core import elastic
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_controller.core import timers as tk
from dtorch_controller.core.config import Config
from dtorch_controller.core.drain import Drains
from dtorch_controller.core.eventlog import EventLog
from dtorch_controller.core.ids import random_session_id
from dtorch_controller.core.model import Cluster, Mesh, PendingSync, Session, Worker
from dtorch_controller.core.moves import Move, Moves
from dtorch_controller.core.pipeline import Pipeline
from dtorch_controller.core.policies import Policy, make_policy
from dtorch_controller.core.recovery import Recovery
from dtorch_controller.core.scheduler import Changes, Scheduler
from dtorch_controller.core.snapshots import Snapshots
from dtorch_controller.core.status import status
from dtorch_controller.core.step import Step
from dtorch_controller.core.tenancy import device_quota, owns, session_quota
from dtorch_controller.core.view import CoreView
from dtorch_controller.core.waits import WaitIndex
from dtorch_protocol import messages as m
from dtorch_protocol.wire import ProtocolError, check_hello

PRIORITIES = ("high", "normal", "low")
KINDS = ("batch", "realtime")
_EPS = 1e-9  # timers due "at" a deadline must count as past it despite float rounding
_SETTLE_ROUNDS = 64  # a settle pass that has not come to rest by then leaves the rest to the next event
MAX_LOGICAL_PER_DEVICE = 64  # rule 11: a session's logical devices per device of the cluster (virtual devices)
MAX_ERRORS_HELD = 4096  # rule 14: workers' error reports a session keeps for its next Sync (the rest are counted)
_REPORT_OK = m.ReportReply(ok=True)  # immutable: one for every accepted report


class ControllerCore:
    """All controller logic: workers, sessions, placement, routing, health. See the module rules."""

    def __init__(self, config: Config | None = None, *, session_ids: Callable[[], str] | None = None,
                 policy: Policy | None = None, version: str = __version__) -> None:
        self.config = config = config or Config()
        self._suspect_after = config.suspect_after_s  # read on every heartbeat check (Config is frozen)
        self.policy: Policy = policy or make_policy()
        self.version = version
        self.log = EventLog(config.event_log_size, config.format_time)
        self.cluster = Cluster(config.lost_workers_kept)
        self.sched = Scheduler(self.policy, self.cluster.workers)
        self.sched.growth = True  # elastic sessions grow onto free workers: their devices move (elastic.py)
        self.sched.relocation = True  # frozen sessions resume on free workers: their devices move (elastic.py)
        self.pipeline = Pipeline(self.cluster, self.sched.pool, recovery=config.snapshot_every_batches > 0,
                                 ahead=config.dispatch_ahead)
        self.waits = WaitIndex()
        self.snapshots = Snapshots(config, self.cluster, self.sched.pool, self.pipeline)
        self.moves = Moves(self.cluster, self.sched, self.pipeline)
        self.sched.moving = self.moves.busy  # ... and are left alone while their devices move (scheduler rule 6)
        self.sched.busy_for = self.pipeline.busy_for  # ... and when their devices should be done (policies that pace)
        self.recovery = Recovery(self.cluster, self.sched, self.pipeline, self.snapshots, self.moves)
        self.drains = Drains(self.cluster, self.sched, self.pipeline, self.snapshots, self.moves)
        self.view = CoreView(self.cluster, self.sched)
        self._new_session_id = session_ids or random_session_id
        self._handlers: dict[type, Callable[[Step, Any], None]] = {
            ev.OpenSession: self._open_session, ev.OpenMesh: self._open_mesh, ev.Submit: self._submit,
            ev.Sync: self._sync, ev.CloseSession: self._close_session, ev.Status: self._status,
            ev.Register: self._register, ev.Report: self._report, ev.TimerFired: self._timer,
            ev.WorkerUnreachable: self._unreachable, ev.Drain: self.drains.drain, ev.Migrate: self.moves.migrate,
            ev.KeepAlive: self._keepalive,
        }
        self._timers: dict[type, Callable[[Step, Any], None]] = {
            tk.Heartbeat: self._check_heartbeat, tk.SyncDeadline: self._sync_deadline,
            tk.ClientSilence: self._check_client, tk.PolicyTick: self._policy_tick,
            tk.AdminDeadline: self._admin_deadline,
        }

    @property
    def workers(self) -> dict[str, Worker]:
        return self.cluster.workers

    @property
    def sessions(self) -> dict[str, Session]:
        return self.cluster.sessions

    def handle(self, now: float, event: ev.Event) -> list[fx.Effect]:
        """Apply one event at time `now`; returns what the adapter must do, in order."""
        if type(event) is ev.WorkersAlive:
            return self._alive(now, event)  # rule 13: a step per worker
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a controller event: {event!r}")
        step = Step(now, self.log)
        s = self.cluster.sessions.get(getattr(getattr(event, "msg", None), "session", None))  # type: ignore[arg-type]
        if s is not None and owns(getattr(event, "who", ev.OPERATOR), s):  # rule 11: another's request is no sign
            s.last_heard = now
        handler(step, event)
        self._settle(step)
        return step.out

    # ------------------------------------------------------------ the settle pass (rule 10)

    def _settle(self, step: Step) -> None:
        if not (step.changes or step.touched or step.pumped or step.synced or step.everyone or self.drains.jobs):
            if step.reporter is None or (not step.completed and self.waits.idle_for(step.reporter)):
                return  # nothing changed that could let anything move on (most requests, idle heartbeats)
        if step.completed and step.reporter is not None and self.pipeline.windowed:
            for sid in self.pipeline.unblock(step, step.reporter.id):  # pipeline rule 7: the next batches fit now
                if self._inert(sid):  # nothing went out, and a look at it would change nothing
                    step.pumped.discard(sid)
        if step.reporter is not None:
            look = self.waits.looked_at_by(step.reporter)
        elif step.everyone:
            look = set(self.waits.active)
        else:
            look = set()
        looked: set[str] = set()
        for _ in range(_SETTLE_ROUNDS):
            while step.changes:
                self._apply(step, step.changes.pop(0))
            if step.touched:
                look |= step.touched
                step.touched.clear()
            if step.pumped:
                look |= step.pumped - looked
            if not look and not self.drains.jobs:
                break
            for sid in sorted(look):
                self._advance(step, sid)
            looked |= look
            look = set()
            self.drains.advance(step)
            if not step.touched and not step.changes:
                break
        if looked or step.touched or self.waits.fresh:
            for sid in sorted(looked | step.touched | self.waits.fresh):
                self._file(sid)
        sessions = self.cluster.sessions
        reporter = step.reporter
        if reporter is not None and step.completed:  # deletes waiting for its reads, Syncs waiting for its work
            # Only these can move on: a Sync that waits is parked on a busy worker and looks again at its report
            # (waits.py rule 4), so the one it waits for last finds it there; a frozen session's Syncs wait for
            # its release. Not every session bound here (under preemption, hundreds of frozen ones).
            todo = self.waits.parked_on(reporter.id)
            deferring = self.pipeline.deferring
            if deferring:
                todo |= reporter.sessions & deferring
            for sid in sorted(todo):
                s = sessions.get(sid)
                if s is None:
                    deferring.discard(sid)
                    continue
                if s.deferred:
                    self.pipeline.flush_deferred(step, s)
                if not s.deferred:
                    deferring.discard(sid)
                if s.syncs:
                    step.synced.add(sid)
        if step.synced or looked:
            for sid in sorted(step.synced | looked):
                s = sessions.get(sid)
                if s is not None:
                    self._answer_syncs(step, s)

    def _inert(self, sid: str) -> bool:
        """A look at the session in this settle pass would change nothing, when its pump sent nothing because the
        dispatch window is full on another worker (the completions of a wide session's workers but the last of a
        step): no lineage (no snapshot may be due, none in flight), no upload copies, no rebuild, no move or drop of
        its own, no drop of anyone's (any look flushes them), not in the wait index, and its parked Syncs wait for
        the batches the window holds back (`Pipeline.held`)."""
        rec = self.pipeline.recs.get(sid)
        moves = self.moves
        return rec is not None and not rec.enabled and rec.taking is None and not rec.adopts \
            and not self.recovery.rebuilding(sid) and not moves.busy(sid) and not moves.drops \
            and sid not in self.waits.active

    def _answer_syncs(self, step: Step, s: Session) -> None:
        """Answer the session's parked Syncs if they can be, else file them under a worker they wait for."""
        busy = self.pipeline.answer_syncs(step, s)
        if busy is not None:  # its report of a completion looks again, even if it hosts no device of `s` now
            self.waits.park(busy, s.id)

    def _advance(self, step: Step, sid: str) -> None:
        """Let a session's copies, rebuild and moves go on as far as they can now."""
        s = self.cluster.sessions.get(sid)
        if s is None:
            return
        recs = self.pipeline.recs  # a session has lineage from its first batch on
        if sid in recs:
            self.snapshots.advance(step, s, recs[sid])
        self.recovery.advance(step, s)
        if sid in recs and (sid in step.pumped or recs[sid].force):
            self.snapshots.maybe(step, s)
        self.moves.advance(step, s)
        if sid in recs and recs[sid].force:
            self.snapshots.maybe(step, s)

    def _file(self, sid: str) -> None:
        """Active while copies, a rebuild or a move are in flight: filed under what it waits for (waits.py)."""
        s = self.cluster.sessions.get(sid)
        if s is None:
            return self.waits.stop(sid)
        rec = self.pipeline.recs.get(sid)
        if (rec is None or not self.snapshots.busy(s, rec)) and not self.recovery.rebuilding(sid) \
                and not self.moves.busy(sid):
            return self.waits.stop(sid)
        self.waits.start(sid)
        self.waits.file(sid, self._awaits(s, rec))

    def _awaits(self, s: Session, rec: Any) -> list[tuple[str, int]] | None:
        waits: list[tuple[str, int]] = []
        if self.recovery.rebuilding(s.id):
            more = self.recovery.awaits(s.id)
            if more is None:
                return None
            waits += more
        if rec is not None:
            more = self.snapshots.awaits(s, rec)
            if more is None:
                return None
            waits += more
        more = self.moves.awaits(s)
        return None if more is None else waits + more

    def _apply(self, step: Step, changes: Changes) -> None:
        """Carry out what the scheduler decided (rule 8)."""
        sessions = self.cluster.sessions
        for session_id, assignment in changes.placed:
            s = sessions[session_id]
            for device, worker_id in assignment.items():
                self.cluster.bind(s, device, worker_id)
            step.emit(fx.Placed(session_id, dict(assignment)))
            step.touch(session_id)
        for line in changes.notes:
            step.note(line)
        for session_id in changes.frozen:
            s = sessions.get(session_id)
            if s is not None and self.sched.frozen(session_id):
                self.pipeline.hold(s, st.Hold.FROZEN)  # its batches wait, untranslated, until it resumes
            step.emit(fx.Frozen(session_id))
        for session_id, swap in changes.relocated:  # moves first: they hold the batches the resume lets go
            s = sessions.get(session_id)
            if s is None:
                continue
            plan, unused = elastic.relocate(s.devices, swap)
            if unused:
                self._apply(step, self.sched.shrink(step.now, session_id, unused, stop_growing=False))
            self.moves.enqueue(step, s, [Move(session=s.id, devices=ds, src=src, dst=dst, requested=step.now,
                                              pull=True) for src, dst, ds in plan], verb="relocates")
            step.emit(fx.Relocated(session_id, dict(swap)))
        for session_id in changes.resumed:
            s = sessions.get(session_id)
            if s is not None and not self.sched.frozen(session_id):
                self.pipeline.release(step, s, st.Hold.FROZEN)
            step.emit(fx.Resumed(session_id))
        for session_id, workers in changes.shrunk:
            s = sessions.get(session_id)
            if s is not None:  # pulls: the preemptor's work may be queued on the workers given up (elastic rule 4)
                plan = elastic.shrink(s.devices, set(workers), lambda w: self.cluster.workers[w].order)
                self.moves.enqueue(step, s, [Move(session=s.id, devices=ds, src=src, dst=dst, requested=step.now,
                                                  pull=True) for src, dst, ds in plan], verb="shrinks")
        for session_id, workers in changes.grown:
            s = sessions.get(session_id)
            plan, unused = elastic.grow(s.devices, workers) if s is not None else ([], list(workers))
            if unused:
                self._apply(step, self.sched.shrink(step.now, session_id, unused))
            if s is not None:
                self.moves.enqueue(step, s, [Move(session=s.id, devices=ds, src=src, dst=dst, requested=step.now)
                                             for src, dst, ds in plan], verb="grows")
        if changes.wake is not None:
            step.emit(fx.SetTimer(changes.wake, tk.PolicyTick()))

    # ------------------------------------------------------------ small helpers

    def _session(self, step: Step, request_id: Any, session_id: str, who: ev.Principal) -> Session | None:
        """The session, if it exists and `who` owns it; otherwise refused (another's reads as unknown: rule 11)."""
        s = self.cluster.sessions.get(session_id)
        if s is None or not owns(who, s):
            step.refuse(request_id, f"unknown session {session_id[:16]!r} (closed, or never opened here)")
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

    # ------------------------------------------------------------ sessions and meshes

    def _open_session(self, step: Step, e: ev.OpenSession) -> None:
        msg = e.msg
        refusal = self._hello_refusal(msg.hello, "client")
        if refusal:
            return step.refuse(e.request_id, refusal, "protocol")
        if msg.priority not in PRIORITIES:
            return step.refuse(e.request_id, f"bad priority {msg.priority!r}: expected one of {PRIORITIES}")
        if msg.kind not in KINDS:
            return step.refuse(e.request_id, f"bad session kind {msg.kind!r}: expected one of {KINDS}")
        if msg.memory_cap < 0:
            return step.refuse(e.request_id, f"bad memory_cap {msg.memory_cap}: expected bytes >= 0")
        if msg.expected_steps < 0:
            return step.refuse(e.request_id, f"bad expected_steps {msg.expected_steps}: expected a count >= 0")
        problem = session_quota(self.cluster, e.who, msg.memory_cap)
        if problem:
            return step.refuse(e.request_id, problem, "quota")
        sid = self._new_session_id()
        while sid in self.cluster.sessions:
            sid = self._new_session_id()
        now = step.now
        s = self.cluster.sessions[sid] = Session(id=sid, name=msg.name, priority=msg.priority, kind=msg.kind,
                                                 opened_at=now, last_heard=now, tenant=e.who.tenant)
        s.comm.timeout_s = self.config.collective_timeout_s
        self.sched.open(sid, msg.priority, msg.kind, msg.memory_cap, msg.expected_steps)
        s.memory_cap = self.sched.cap(sid)
        step.note(f"session {sid[:8]} opened ({msg.name or 'unnamed'}, {msg.priority}, {msg.kind})")
        timeout = self.config.session_timeout_s
        keepalive = 0.0
        if timeout > 0:
            keepalive = min(1.0, timeout / 4)
            step.emit(fx.SetTimer(now + timeout, tk.ClientSilence(sid)))
        elif self.config.snapshot_every_batches:  # rule 9: a rebuild's requests reach a silent client
            keepalive = 1.0
        step.reply(e.request_id, m.SessionOpened(session=sid, controller_version=self.version, keepalive_s=keepalive,
                                                 recovery=self.config.snapshot_every_batches > 0))

    def _open_mesh(self, step: Step, e: ev.OpenMesh) -> None:
        msg = e.msg
        s = self._session(step, e.request_id, msg.session, e.who)
        if s is None:
            return
        devices, shape = tuple(msg.devices), tuple(msg.shape)
        problem = _mesh_problem(devices, shape)
        if problem:
            return step.refuse(e.request_id, f"bad mesh {msg.mesh}: {problem}")
        known = s.meshes.get(msg.mesh)
        if known is not None and known.key != (devices, shape):
            return step.refuse(e.request_id, f"mesh {msg.mesh} is already open with devices "
                                             f"{list(known.devices)} and shape {list(known.shape)}")
        new = tuple(d for d in devices if d not in s.devices)
        if new and (problem := device_quota(self.cluster, self.sched, e.who, s, len(new))):
            return step.refuse(e.request_id, problem, "quota")
        most = MAX_LOGICAL_PER_DEVICE * max(1, len(self.sched.pool))
        if len(s.devices) + len(new) > most:
            return step.refuse(e.request_id, f"bad mesh {msg.mesh}: the session would have "
                                             f"{len(s.devices) + len(new)} logical devices, over {most} "
                                             f"({MAX_LOGICAL_PER_DEVICE} per device of the cluster's "
                                             f"{len(self.sched.pool)}): use fewer logical devices")
        if new:
            queued = self.sched.position(s.id)
            changes, answer = self.sched.place(step.now, s.id, msg.mesh, new, msg.min_devices)
            self._apply(step, changes)
            if not answer.placed:
                if not queued:
                    step.note(f"session {s.id[:8]} mesh {msg.mesh} waits: {answer.message}")
                    step.emit(fx.Queued(s.id, answer.queue_position))
                return step.reply(e.request_id, m.MeshPlaced(
                    mesh=msg.mesh, placed=False, queue_position=answer.queue_position, message=answer.message))
            step.note(f"session {s.id[:8]} mesh {msg.mesh}: devices " + ", ".join(f"{d}->{s.devices[d]}"
                                                                                 for d in new))
        s.meshes[msg.mesh] = Mesh(id=msg.mesh, devices=devices, shape=shape)
        workers = self.cluster.workers
        step.reply(e.request_id, m.MeshPlaced(
            mesh=msg.mesh, placed=True, locations={d: self.cluster.address(s.devices[d]) for d in devices},
            device_types={d: workers[s.devices[d]].device_type for d in devices}, memory_cap=s.memory_cap))

    def _submit(self, step: Step, e: ev.Submit) -> None:
        msg = e.msg
        s = self._session(step, e.request_id, msg.session, e.who)
        if s is None:
            return
        if msg.seq != s.seq + 1:
            return step.refuse(e.request_id, f"batch {msg.seq} out of order: session {s.id[:8]} expects batch "
                                             f"{s.seq + 1}")
        s.seq = msg.seq
        self.pipeline.accept(step, s, msg.instrs)  # logged; sent unless frozen, recovering or migrating
        if (s.reput or s.safe) and not e.carried:  # a client streaming without a sync hears of its uploads (recovery.py
            # rule 7: a rebuild needs them again, or they are safe); a Sync carrying the batch is answered at once
            return step.reply(e.request_id, m.SubmitReply(accepted=msg.seq, reput=s.take_reput(), safe=s.take_safe()))
        step.reply(e.request_id, m.SubmitReply(accepted=msg.seq))

    def _close_session(self, step: Step, e: ev.CloseSession) -> None:
        s = self.cluster.sessions.get(e.msg.session)
        if s is None or not owns(e.who, s):
            return step.reply(e.request_id, m.Ack(ok=False, message="unknown session (already closed?)"))
        self._end_session(step, s, "closed")
        step.reply(e.request_id, m.Ack(ok=True))

    def _end_session(self, step: Step, s: Session, reason: str) -> None:
        """Free the session's shards on every worker it used, answer its parked syncs, release its devices."""
        holders = self.cluster.order({w for w in s.devices.values() if self.cluster.alive(w)})
        self.pipeline.send(step, s, {w: [m.CmdCloseSession()] for w in holders})
        for pending in s.syncs.values():
            step.reply(pending.request_id, m.SyncReply(done=False, message="session closed"))
        s.syncs.clear()
        self.cluster.unbind_all(s)
        copies = self.moves.closed(step, s) | self.recovery.closed(s)  # workers that may hold shards, no device
        others = self.cluster.order({w for w in copies if w not in holders and self.cluster.alive(w)})
        self.pipeline.send(step, s, {w: [m.CmdCloseSession()] for w in others})
        self.waits.stop(s.id)
        rec = self.pipeline.close(s)
        if rec is not None:
            self.snapshots.drop(step, rec, set(rec.namespaces))
        s.state = st.step(st.SESSION_TABLE, s.state, st.CLOSE)
        del self.cluster.sessions[s.id]
        step.note(f"session {s.id[:8]} {reason}")
        if len(holders) < len(set(s.devices.values())):  # it used a lost worker, which may be forgotten now
            self.cluster.prune_lost()
        self._apply(step, self.sched.close(step.now, s.id))

    # ------------------------------------------------------------ sync

    def _sync(self, step: Step, e: ev.Sync) -> None:
        msg = e.msg
        s = self._session(step, e.request_id, msg.session, e.who)
        if s is None:
            return
        if msg.upto > s.seq:
            return step.refuse(e.request_id, f"sync upto batch {msg.upto}, but the last batch accepted for "
                                             f"session {s.id[:8]} is {s.seq}")
        self._apply(step, self.sched.progress(step.now, s.id, msg.upto))  # a sync point is a step (rule 12)
        if s.reput:  # a rebuild needs uploads again (recovery.py rule 7)
            return step.reply(e.request_id, self.pipeline.reput(s))
        if not self.pipeline.held(s) and self.pipeline.first_busy(s) is None:
            return step.reply(e.request_id, self.pipeline.done(s))
        timeout = 0.0 if math.isnan(msg.timeout_s) else min(max(msg.timeout_s, 0.0), self.config.max_sync_timeout_s)
        s.syncs[e.request_id] = PendingSync(e.request_id, msg.upto, timeout)
        step.emit(fx.SetTimer(step.now + timeout, tk.SyncDeadline(s.id, e.request_id)))
        step.synced.add(s.id)  # the settle pass files it under a worker it waits for (rule 12)

    def _sync_deadline(self, step: Step, key: tk.SyncDeadline) -> None:
        s = self.cluster.sessions.get(key.session)
        pending = s.syncs.pop(key.request, None) if s is not None else None
        if s is None or pending is None:
            return  # answered already
        busy = self.pipeline.busy(s)
        not_done = f"batch {pending.upto} not done after {pending.timeout_s:g}s"
        locations = self.cluster.locations(s)
        if not busy and not self.pipeline.held(s):
            return step.reply(key.request, self.pipeline.done(s))
        if not busy and self.pipeline.holding(s) - {st.Hold.FROZEN}:
            return step.reply(key.request, m.SyncReply(
                done=False, locations=locations, memory_cap=s.memory_cap,
                message=f"{not_done}; the session is {s.state} with batches held"))
        if not busy:
            position = self.sched.position(s.id)
            return step.reply(key.request, m.SyncReply(
                done=False, locations=locations, memory_cap=s.memory_cap, frozen=True, queue_position=position,
                message=f"{not_done}; the session is frozen (preempted) with batches held, queue position "
                        f"{position}"))
        names = ", ".join(f"{w.id} at {w.address}" for w in busy)  # its batch counts are every tenant's
        step.reply(key.request, m.SyncReply(done=False, locations=locations, memory_cap=s.memory_cap,
                                            message=f"{not_done}; workers still busy: {names}"))

    # ------------------------------------------------------------ workers

    def _register(self, step: Step, e: ev.Register) -> None:
        msg = e.msg
        refusal = self._hello_refusal(msg.hello, "worker")
        if refusal:
            return step.refuse(e.request_id, refusal, "protocol")
        if not msg.address:
            return step.refuse(e.request_id, "a worker must register with the address peers reach it at")
        previous = self.cluster.at(msg.address)
        if previous is not None:  # a registration never fences a live worker: the old one must be lost first
            return step.refuse(e.request_id, f"address {msg.address} belongs to live worker {previous.id}: a worker "
                                             "restarting there is accepted once that one is declared lost", "conflict")
        w = self.cluster.add_worker(msg, step.now)
        step.note(f"worker {w.id} registered at {msg.address} ({msg.device_type})")
        self.recovery.worker_registered(step, w)
        step.emit(fx.SetTimer(step.now + self.config.suspect_after_s, tk.Heartbeat(w.id)))
        self._apply(step, self.sched.add_worker(step.now, w))
        step.reply(e.request_id, m.Registered(worker=w.id, heartbeat_interval_s=self.config.heartbeat_interval_s))

    def _report(self, step: Step, e: ev.Report) -> None:
        msg = e.msg
        w = self.cluster.workers.get(msg.worker)
        if w is None or w.state == st.LOST:
            return step.reply(e.request_id, m.ReportReply(ok=False, message="fenced"))
        self._heard(step, w)
        before = w.completed
        w.completed = max(w.completed, min(msg.completed, w.sent))  # it cannot have finished what it never got
        w.stats = self._own(w, msg.sessions)  # read only, here and by whoever sent it
        w.received_bytes = msg.received_bytes
        if msg.utilization >= 0:
            w.utilization = msg.utilization
        for session_id, errors in msg.errors.items():
            s = self.cluster.sessions.get(session_id)
            if s is not None and (w.id in s.sent or session_id in w.sessions):  # rule 14: none for a stranger's
                kept = self.recovery.errors(s, w, errors)
                room = max(0, MAX_ERRORS_HELD - len(s.errors))  # rule 14: what a session holds until its Sync
                s.errors.extend(kept[:room])
                s.errors_dropped += max(0, len(kept) - room)
        if w.stats and self.sched.capping:  # every report carries its shards: checked only when caps exist
            self._check_caps(step, w, w.stats)
        step.reporter = w  # the settle pass moves on what waited for it (waits.py)
        step.completed = w.completed > before  # only a completion lets deletes and Syncs go (holds: on release)
        step.reply(e.request_id, _REPORT_OK)

    def _own(self, w: Worker, stats: dict[str, m.ShardStats]) -> dict[str, m.ShardStats]:
        """`stats` without the live sessions neither bound to `w` nor sent work there (rule 14): what a worker says
        of them would count in their owners' Status, bills and memory caps. (A session's `#` namespaces, its
        recovery copies, land on workers it sends nothing and count only in the admin's backup bytes.) The same
        dict when there are none (the usual case)."""
        sessions = self.cluster.sessions
        foreign = [k for k in stats
                   if k not in w.sessions and (s := sessions.get(k)) is not None and w.id not in s.sent]
        return {k: v for k, v in stats.items() if k not in foreign} if foreign else stats

    def _heard(self, step: Step, w: Worker) -> None:
        """What any report of a worker that is not lost does first: it is alive (a suspect one is back)."""
        was = w.state
        if w.state == st.SUSPECT:
            step.note(f"worker {w.id} reported again after {step.now - w.last_seen:.2f}s")
        w.state = st.step(st.WORKER_TABLE, w.state, st.REPORT)
        w.last_seen = step.now
        if w.state != was:
            self._apply(step, self.sched.worker_changed(step.now, w))

    def _alive(self, now: float, e: ev.WorkersAlive) -> list[fx.Effect]:
        """Rule 13: each worker as its own `Report` with nothing new (the same `completed`, no errors, the same
        shards), one after the other; one `AliveReply` at the end names the fenced ones."""
        out: list[fx.Effect] = []
        fenced: list[str] = []
        workers, waits, sched = self.cluster.workers, self.waits, self.sched
        idle_for, lost, suspect = waits.idle_for, st.LOST, st.SUSPECT  # once, not per worker (thousands a slot)
        quiet = not sched.capping and not self.drains.jobs  # no memory cap to check, no drain to advance
        for worker_id, utilization in e.workers.items():
            w = workers.get(worker_id)
            if w is None or w.state == lost:
                fenced.append(worker_id)
                continue
            if quiet and w.state != suspect and idle_for(w):
                w.last_seen = now  # all that the report below would change: its settle pass returns at once
                if utilization >= 0:
                    w.utilization = utilization
                continue
            step = Step(now, self.log, out)
            self._heard(step, w)
            if utilization >= 0:
                w.utilization = utilization
            if w.stats and sched.capping:
                self._check_caps(step, w, w.stats)
            step.reporter = w
            self._settle(step)
            quiet = not sched.capping and not self.drains.jobs
        out.append(fx.Reply(e.request_id, fx.AliveReply(tuple(fenced))))
        return out

    def _timer(self, step: Step, e: ev.TimerFired) -> None:
        handler = self._timers.get(type(e.key))
        if handler is not None:  # rule 7: an unknown or stale key is ignored
            handler(step, e.key)

    def _check_heartbeat(self, step: Step, key: tk.Heartbeat) -> None:
        w = self.cluster.workers.get(key.worker)
        if w is None or w.state == st.LOST:
            return
        cfg = self.config
        silence = step.now - w.last_seen
        if silence >= cfg.heartbeat_timeout_s - _EPS:
            return self._lose(step, w, st.TIMEOUT, f"no report for {silence:.2f}s")
        suspect_after = self._suspect_after
        if silence >= suspect_after - _EPS and w.state == st.ALIVE:
            w.state = st.step(st.WORKER_TABLE, w.state, st.SILENT)
            step.note(f"worker {w.id} suspect: no report for {silence:.2f}s")
            self._apply(step, self.sched.worker_changed(step.now, w))
        due = w.last_seen + (suspect_after if w.state == st.ALIVE else cfg.heartbeat_timeout_s)
        step.emit(fx.SetTimer(due, key))

    def _unreachable(self, step: Step, e: ev.WorkerUnreachable) -> None:
        w = self.cluster.workers.get(e.worker_id)
        if w is not None and w.state != st.LOST:
            self._lose(step, w, st.UNREACHABLE, f"unreachable: {e.message or 'send failed'}")

    def _lose(self, step: Step, w: Worker, event: str, reason: str) -> None:
        """Fence `w`; its sessions are rebuilt or told what they lost (recovery.py); every active session is
        looked at again."""
        w.state = st.step(st.WORKER_TABLE, w.state, event)
        self.cluster.fence(w)
        step.note(f"worker {w.id} at {w.address} lost: {reason}")
        cause = "timeout" if event == st.TIMEOUT else "unreachable"
        step.emit(fx.Fenced(w.id, reason, cause, silent_s=step.now - w.last_seen))
        self.recovery.worker_lost(step, w, reason)
        self.pipeline.unblock(step, w.id)  # its batches count no more (pipeline rule 7)
        self.drains.worker_lost(w)
        self.cluster.prune_lost()
        self._apply(step, self.sched.worker_changed(step.now, w))
        step.synced |= self.waits.forget_worker(w.id)  # it completes nothing more: parked Syncs look again
        step.everyone = True

    def _check_caps(self, step: Step, w: Worker, usage: dict[str, m.ShardStats]) -> None:
        for session_id, used, cap in self.sched.over_cap(w.id, {k: v.bytes for k, v in usage.items()}):
            s = self.cluster.sessions.get(session_id)
            if s is None:
                continue
            text = f"session holds {used} bytes on worker {w.id}, over its memory cap of {cap} bytes per device"
            s.errors.append(m.ErrorReport(op="memory cap", src="", message=text, kind=m.ErrorKind.MEMORY_CAP))
            step.note(f"session {session_id[:8]}: {text}")

    # ------------------------------------------------------------ scheduling, liveness, admin, status

    def _policy_tick(self, step: Step, key: tk.PolicyTick) -> None:
        self._apply(step, self.sched.tick(step.now))

    def _keepalive(self, step: Step, e: ev.KeepAlive) -> None:
        s = self.cluster.sessions.get(e.msg.session)
        known = s is not None and owns(e.who, s)  # handle() already noted that the client is alive
        if not known:
            return step.reply(e.request_id, m.KeepAliveReply(ok=False, message="unknown session (timed out?)"))
        # a silent client hears of its uploads (recovery.py rule 7: a rebuild needs them again, or they are safe)
        step.reply(e.request_id, m.KeepAliveReply(reput=s.take_reput(), safe=s.take_safe()))
        if s.asked:  # what it keeps for a snapshot (snapshots.py rule 7): one due by time is taken without a batch
            step.pumped.add(s.id)

    def _check_client(self, step: Step, key: tk.ClientSilence) -> None:
        s = self.cluster.sessions.get(key.session)
        if s is None:
            return
        timeout = self.config.session_timeout_s
        silence = step.now - s.last_heard
        if silence >= timeout - _EPS:
            return self._end_session(step, s, f"timed out: client silent for {silence:.1f}s")
        step.emit(fx.SetTimer(s.last_heard + timeout, tk.ClientSilence(s.id)))

    def _admin_deadline(self, step: Step, key: tk.AdminDeadline) -> None:
        if not self.moves.deadline(step, key.request):
            self.drains.deadline(step, key.request)

    def _status(self, step: Step, e: ev.Status) -> None:
        step.reply(e.request_id, status(step.now, self.cluster, self.sched, self.recovery, self.log, e.who))


def _mesh_problem(devices: tuple[int, ...], shape: tuple[int, ...]) -> str | None:
    """Why `devices` with `shape` is not a valid mesh, or None."""
    if not shape or any(n <= 0 for n in shape):
        return f"shape {list(shape)} must have at least one dim, each >= 1"
    if math.prod(shape) != len(devices):
        return f"shape {list(shape)} needs {math.prod(shape)} devices, got {len(devices)}"
    if len(set(devices)) != len(devices):
        return f"a logical device may appear only once in a mesh, got {list(devices)}"
    return None
