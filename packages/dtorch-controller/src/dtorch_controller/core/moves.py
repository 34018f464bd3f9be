"""Moving logical devices between live workers: migrations, and the moves of drains, growth and relocation.

Rules:

1. A move of some logical devices of one session from worker A to worker B holds the session's batches
   and sends A one CmdSendShards(move=...): at that point of A's stream (after everything sent before)
   A copies every shard of those devices whole to B, worker to worker, with their aliasing. Once A
   completed it the devices are rebound to B (later batches go to B, Sync locations name B), held
   batches go out, and A drops its shards when the readers planned before the move are done (the session's
   Syncs do not wait for that drop when A hosts none of its devices any more: it may be queued behind
   another session's work there). The time the batches were held is the move's downtime, reported to the
   operator and in the event log.
2. Uploads under way: from the copy on, A refuses client Puts for the moving devices (kind MOVED), and
   uploads that arrived before it travel with them. The client asks the controller where the device
   went and uploads again (dtorch/_relocate.py).
3. One move per session at a time (but for the pulls of one group, below); later ones queue, and none starts
   while the session is not open (recovering, degraded). A *pull* move (a frozen session relocating off its
   preemptor's worker, or an elastic one shrinking off the workers it gives up: elastic.py) holds the session's
   batches at once, waits until A finished the session's work, then has B pull the shards from A's server
   (CmdFetchShards(move=...)): not at A's place in its stream, which runs another session's work and may be far
   behind. A then refuses uploads for the devices and hands over the ones not adopted yet. The pulls of one
   relocation or shrink (a *group*: enqueued together) run at once, each as soon as its own source is done: none
   waits for another's copy, which may be queued behind other sessions' work on its target (a substitute that
   just came free may still run the batches of a session frozen there). The batches go out when the whole group
   is done.
4. A move that fails (the copy failed, B was lost) is called off: A keeps the devices (CmdStay) and the
   batches go on. If A is lost, recovery.py rebuilds the session instead (or reports the loss); a rebuild
   interrupts a running move (a drain's is tried again afterwards). A session that is not rebuilt (it lost data)
   ends every move whose source is lost (`sources_lost`): the batches go on and its Sync reports the loss.
5. Phases follow `state.MOVE_TABLE`. A finished move keeps its report (or why it failed): a drain reads it.
6. Admin requests get exactly one reply: when done, or at their timeout (the work goes on). Unknown
   sessions, devices and workers are refused in one line; sessions may be named by a unique prefix.
7. Leases follow the devices: the scheduler leases B to the session and takes A back once it hosts nothing of the
   session (`Scheduler.moved`; its `Changes` go to the controller through the step).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_controller.core.lineage import shard_bytes, tensors_on
from dtorch_controller.core.model import Cluster, Session, Worker
from dtorch_controller.core.pipeline import Pipeline
from dtorch_controller.core.scheduler import Scheduler
from dtorch_controller.core.step import Step
from dtorch_controller.core.timers import AdminDeadline
from dtorch_protocol import messages as m


@dataclass
class Move:
    session: str
    devices: list[int]
    src: str
    dst: str
    requested: float
    requests: list[Hashable] = field(default_factory=list)  # Migrate requests to answer
    drain: str = ""  # the worker being drained, when part of a drain
    pull: bool = False  # `dst` pulls once `src` finished the session's work (rule 3)
    group: int = 0  # pulls enqueued together share a group and copy at once (rule 3); 0: alone
    phase: st.MovePhase = st.MovePhase.QUEUED
    seq: int = 0  # Execute seq of the copy on the worker that copies (0: not started)
    started: float = 0.0
    tensors: int = 0
    bytes: int = 0
    failed: str = ""
    report: m.MoveReport | None = None  # once done

    @property
    def copier(self) -> str:
        """The worker that runs the copy."""
        return self.dst if self.pull else self.src

    @property
    def copying(self) -> bool:
        return self.phase == st.MovePhase.COPYING

    @property
    def active(self) -> bool:
        """Holding the session's batches: waiting for its source (a pull) or copying."""
        return self.phase in (st.MovePhase.WAITING, st.MovePhase.COPYING)

    def to(self, event: str) -> None:
        self.phase = st.step(st.MOVE_TABLE, self.phase, event)

    def describe(self, now: float) -> m.MoveReport:
        return m.MoveReport(session=self.session, devices=list(self.devices), from_worker=self.src,
                            to_worker=self.dst, tensors=self.tensors, bytes=self.bytes,
                            downtime_s=max(0.0, now - self.started) if self.started else 0.0)


@dataclass
class Drop:
    """Shards left on a move's source until the readers planned before the move are done."""

    session: str
    worker: str
    tids: list[int]
    devices: list[int]
    waits: dict[str, int]


class Moves:
    def __init__(self, cluster: Cluster, sched: Scheduler, pipeline: Pipeline) -> None:
        self.cluster = cluster
        self.sched = sched
        self.pipeline = pipeline
        self.queues: dict[str, list[Move]] = {}  # session -> moves, the first one may be running
        self.drops: list[Drop] = []  # in the order they were made (their deletes go out in that order)
        self._dropping: dict[str, int] = {}  # session -> its entries in `drops` (`busy`: several times an event)
        self.requests: dict[Hashable, Move] = {}  # Migrate request -> its move, while unanswered
        self.groups = 0  # pull groups made so far (rule 3)

    # ------------------------------------------------------------ queries

    def head(self, sid: str) -> list[Move]:
        """The moves that run now or next: the first queued one, with the other pulls of its group (rule 3)."""
        q = self.queues.get(sid)
        if not q:
            return []
        group = q[0].group
        return [mv for mv in q if mv is q[0] or (group and mv.group == group)]

    def running(self, sid: str) -> list[Move]:
        return [mv for mv in self.head(sid) if mv.copying]

    def busy(self, sid: str) -> bool:
        return bool(self.queues.get(sid)) or sid in self._dropping

    def awaits(self, s: Session) -> list[tuple[str, int]] | None:
        """(worker, Execute seq) pairs the session's move and drops wait on; None when they may go on without a
        report (a queued move waiting for the session, a failed copy, a drop ready to go): waits.py rule 2."""
        waits: list[tuple[str, int]] = []
        for mv in self.head(s.id):
            before = s.sent.get(mv.src, 0) if mv.pull and not mv.copying else 0
            if before and self.cluster.waits_for(mv.src, before):
                waits.append((mv.src, before))  # a pull waiting for the session's work on its source
            elif not mv.copying or mv.failed:
                return None
            else:
                waits.append((mv.copier, mv.seq))
        for drop in self.drops:
            if drop.session == s.id:
                pending = [(w, seq) for w, seq in drop.waits.items() if self.cluster.waits_for(w, seq)]
                if not pending:
                    return None
                waits += pending
        return waits

    def involves(self, sid: str, worker_id: str) -> bool:
        return any(worker_id in (mv.src, mv.dst) for mv in self.running(sid))

    def lease_problem(self, s: Session, dst: str) -> str | None:
        """Why the session may not use worker `dst`, or None (leases: exclusive devices unless packed)."""
        t = self.sched.tenants.get(s.id)
        if t is None:
            return None
        if self.sched.frozen(s.id):
            return f"session {s.id[:8]} is frozen (preempted): its devices move when it runs again"
        if dst in t.workers:
            return None
        slot = self.sched.pool.slots.get(dst)
        if slot is None or not slot.placeable:
            return f"worker {dst} cannot take devices now"
        others = [x for x in slot.leases if x != s.id]
        cap = self.sched.cap(s.id)
        if others and (cap == 0 or slot.exclusive):
            return f"worker {dst} is leased to session {others[0][:8]}"
        if cap and not self.sched.pool.fits(dst, cap):
            return f"worker {dst} has no room for session {s.id[:8]}'s memory cap"
        return None

    def _taken(self, s: Session, dst: str) -> bool:
        """Is `dst` leased to others so that the session cannot have it (any more)?"""
        t = self.sched.tenants.get(s.id)
        return t is not None and dst not in t.workers and not self.sched.pool.fits(dst, self.sched.cap(s.id))

    def incoming(self) -> set[str]:
        """Targets of queued moves not leased to their session yet (drains, migrations): taken for other moves."""
        out = set()
        for sid, q in self.queues.items():
            t = self.sched.tenants.get(sid)
            out |= {mv.dst for mv in q if t is None or mv.dst not in t.workers}
        return out

    def target(self, s: Session, exclude: str, skip: set[str] | None = None) -> str | None:
        """Where a drain moves a session's devices off `exclude`: a free worker on another node (one of a node the
        session uses first, else best fit), a free worker on the same node, one of the session's own workers on
        another node, then on the same node, then (packed sessions) a shared worker with room. `skip`: workers
        other moves head for (default: `incoming()`). O(free index + the session's workers)."""
        skip = self.incoming() if skip is None else skip
        t = self.sched.tenants[s.id]
        pool = self.sched.pool
        slot = pool.slots.get(exclude)
        node = slot.node if slot is not None else ""
        own = [pool.slots[w] for w in t.workers if w != exclude and w in pool.slots and pool.slots[w].placeable]
        prefer = sorted({o.node for o in own if o.node != node})
        dst = pool.free_off(node, prefer=prefer, skip=skip) or pool.free_on(node, skip=skip)
        if dst is not None:
            return dst
        own.sort(key=lambda o: (o.node == node, self.cluster.workers[o.worker].bound, o.order))
        if own:
            return own[0].worker
        cap = self.sched.cap(s.id)
        if cap:
            shared = [w for w in pool.shared(cap, skip) if w != exclude]
            shared.sort(key=lambda w: pool.slots[w].node == node)  # stable: least room first within each
            return next((w for w in shared if self.lease_problem(s, w) is None), None)
        return None

    # ------------------------------------------------------------ requests (rule 6)

    def migrate(self, step: Step, e: ev.Migrate) -> None:
        msg = e.msg
        s, problem = self.cluster.find_session(msg.session)
        if s is None:
            return step.refuse(e.request_id, problem)
        if msg.device not in s.devices:
            devices = ", ".join(map(str, sorted(s.devices))) or "none bound yet"
            return step.refuse(e.request_id, f"session {s.id[:8]} has no logical device {msg.device} "
                                             f"(devices: {devices})")
        w = self.cluster.workers.get(msg.to_worker)
        if w is None:
            return step.refuse(e.request_id, unknown_worker(self.cluster, msg.to_worker))
        if w.state not in st.PLACEABLE:
            return step.refuse(e.request_id, f"worker {w.id} is {w.state}: it cannot take devices")
        if s.state == st.DEGRADED:
            return step.refuse(e.request_id, f"session {s.id[:8]} lost data to a worker loss: its devices are "
                                             "not moved")
        src = s.devices[msg.device]
        if src == w.id:
            return step.reply(e.request_id, m.AdminReply(
                ok=True, message=f"logical device {msg.device} of session {s.id[:8]} is already on {w.id}"))
        problem = self.lease_problem(s, w.id)
        if problem:
            return step.refuse(e.request_id, problem)
        mv = Move(session=s.id, devices=[msg.device], src=src, dst=w.id, requested=step.now,
                  requests=[e.request_id])
        self.requests[e.request_id] = mv
        step.emit(fx.SetTimer(step.now + max(msg.timeout_s, 0.0), AdminDeadline(e.request_id)))
        self.enqueue(step, s, [mv])

    def deadline(self, step: Step, request_id: Hashable) -> bool:
        """A Migrate request's timeout: answered "still in progress" unless done; False if not one of ours."""
        mv = self.requests.pop(request_id, None)
        if mv is None:
            return False
        what = (f"moving logical device {mv.devices} of session {mv.session[:8]} to {mv.dst}: "
                f"{'copying' if mv.copying else 'waiting for the session'}")
        step.reply(request_id, m.AdminReply(ok=False, message=f"still in progress ({what}); it goes on",
                                            seconds=step.now - mv.requested))
        return True

    # ------------------------------------------------------------ moves

    def enqueue(self, step: Step, s: Session, moves: list[Move], verb: str = "") -> None:
        """Queue moves of the session's devices (in order, one at a time but groups of pulls: rule 3); start one."""
        if not moves:
            return
        if all(mv.pull for mv in moves) and len(moves) > 1:  # one relocation or shrink: its pulls copy at once
            self.groups += 1
            for mv in moves:
                mv.group = self.groups
        self.queues.setdefault(s.id, []).extend(moves)
        if verb:
            step.note(f"session {s.id[:8]} {verb}: " + "; ".join(f"logical {mv.devices} {mv.src} -> {mv.dst}"
                                                                 for mv in moves))
        self.start_next(step, s)
        step.touch(s.id)

    def start_next(self, step: Step, s: Session) -> None:
        """Start the first queued move, or the pulls of its group not started yet (rule 3)."""
        head = self.head(s.id)
        going = any(mv.copying for mv in head)
        if not head or (going and not head[0].group) or s.state != (st.MIGRATING if going else st.OPEN):
            return
        for mv in head:
            if not mv.copying:
                self._start(step, s, mv)

    def _start(self, step: Step, s: Session, mv: Move) -> None:
        q = self.queues[s.id]
        devices = [d for d in mv.devices if s.devices.get(d) == mv.src]
        dst = self.cluster.workers.get(mv.dst)
        if not devices:
            q.remove(mv)
            if not mv.drain:
                mv.failed = f"logical device {', '.join(map(str, mv.devices))} is no longer on {mv.src}"
            return self._done(step, s, mv)
        if mv.drain and (dst is None or dst.state not in st.PLACEABLE or self._taken(s, mv.dst)):
            # the target was taken meanwhile (the queue placed a session on it, it went away): pick again
            again = self.target(s, mv.drain, self.incoming() - {mv.dst})
            if again is not None:
                mv.dst, dst = again, self.cluster.workers[again]
        if dst is None or dst.state not in st.PLACEABLE:
            mv.failed = f"worker {mv.dst} can no longer take devices"
            q.remove(mv)
            return self._done(step, s, mv)
        src = self.cluster.workers[mv.src]
        if mv.pull:
            self.pipeline.hold(s, st.Hold.MIGRATING)
            if mv.phase == st.MovePhase.QUEUED:
                mv.to(st.HOLD)
            if src.state != st.LOST and src.completed < s.sent.get(mv.src, 0):
                return  # the session's work there is not done yet: a report of `src` brings us back
        mv.devices = devices
        shards = {d: tensors_on(s.tensors, s.meshes, d) for d in devices}
        mv.tensors = sum(len(t) for t in shards.values())
        mv.bytes = sum(shard_bytes(s.tensors[t], s.meshes[s.tensors[t].mesh], d) for d, tids in shards.items()
                       for t in tids)
        self.pipeline.hold(s, st.Hold.MIGRATING)
        if s.state == st.OPEN:  # the first of its group
            s.state = st.step(st.SESSION_TABLE, s.state, st.MOVE)
        mv.started = step.now
        if mv.pull:
            cmd: m.Cmd = m.CmdFetchShards(devices=shards, namespace=s.id, address=src.address, move=devices)
        else:
            cmd = m.CmdSendShards(devices=shards, namespace=s.id, to=dst.address, move=devices)
        mv.seq = self.pipeline.send(step, s, {mv.copier: [cmd]})[mv.copier]
        mv.to(st.START)

    def copy_failed(self, s: Session, w: Worker, e: m.ErrorReport) -> None:
        for mv in self.running(s.id):
            if mv.copier == w.id and mv.seq == e.seq:
                mv.failed = f"the copy to {mv.dst} failed: {e.message}"

    def advance(self, step: Step, s: Session) -> None:
        self._flush_drops(step)
        if not self.queues.get(s.id):
            return  # no move of the session (most often): nothing runs, nothing to start
        for mv in self.running(s.id):
            if self.cluster.workers[mv.copier].completed < mv.seq and not mv.failed:
                continue
            self.queues[s.id].remove(mv)
            if mv.failed:
                self._call_off(step, s, mv)
            else:
                self._commit(step, s, mv)
        self.start_next(step, s)

    def _settle(self, step: Step, s: Session) -> None:
        """A move ended: once none of the session's is copying it is open again, and once none holds its batches
        (a pull of its group still waiting) they go out."""
        q = self.queues.get(s.id, [])
        if s.state == st.MIGRATING and not any(mv.copying for mv in q):  # not when it lost data meanwhile
            s.state = st.step(st.SESSION_TABLE, s.state, st.MOVED)
        if not any(mv.active for mv in q):
            self.pipeline.release(step, s, st.Hold.MIGRATING)

    def _commit(self, step: Step, s: Session, mv: Move) -> None:
        for d in mv.devices:
            self.cluster.unbind(s, d)
            self.cluster.bind(s, d, mv.dst)
        step.apply(self.sched.moved(step.now, s.id, mv.src, mv.dst, src_empty=mv.src not in s.devices.values()))
        tids = sorted({t for d in mv.devices for t in tensors_on(s.tensors, s.meshes, d)})
        waits: dict[str, int] = {}
        for tid in tids:
            for reader, seq in s.readers.get(tid, {}).items():
                if reader != mv.src and self.cluster.alive(reader):
                    waits[reader] = max(waits.get(reader, 0), seq)
        self.drops.append(Drop(s.id, mv.src, tids, list(mv.devices), waits))
        self._dropping[s.id] = self._dropping.get(s.id, 0) + 1
        self._flush_drops(step)
        rec = self.pipeline.rec(s, step.now)
        rec.migrations += 1
        rec.force = True  # the copies' holders may now include the devices' own worker
        mv.to(st.COPIED)
        report = mv.describe(step.now)
        step.note(f"session {s.id[:8]} logical device{'s' if len(mv.devices) > 1 else ''} "
                  f"{', '.join(map(str, mv.devices))} moved {mv.src} -> {mv.dst}: {mv.tensors} shards, {mv.bytes} "
                  f"bytes, downtime {report.downtime_s:.3f}s")
        step.emit(fx.Moved(s.id, tuple(mv.devices), mv.src, mv.dst, mv.bytes, report.downtime_s))
        self._done(step, s, mv, report)
        self._settle(step, s)

    def _call_off(self, step: Step, s: Session, mv: Move) -> None:
        """Rule 4: the source keeps the devices; what reached the target is dropped there."""
        if self.cluster.alive(mv.src):
            self.pipeline.send(step, s, {mv.src: [m.CmdStay(devices=list(mv.devices))]})
        if self.cluster.alive(mv.dst):
            tids = sorted({t for d in mv.devices for t in tensors_on(s.tensors, s.meshes, d)})
            if tids:
                self.pipeline.send(step, s, {mv.dst: [m.CmdDelete(tids=tids, devices=list(mv.devices))]})
        step.note(f"session {s.id[:8]} move of logical devices {mv.devices} to {mv.dst} called off: {mv.failed}")
        self._done(step, s, mv)
        self._settle(step, s)

    def _done(self, step: Step, s: Session, mv: Move, report: m.MoveReport | None = None,
              closing: bool = False) -> None:
        """The move is over (rule 5): its outcome stays on it, its Migrate requests are answered."""
        ok = not mv.failed
        report = report or mv.describe(step.now)
        waiting = mv.phase == st.MovePhase.WAITING
        if ok:
            mv.report = report
            if mv.phase != st.MovePhase.DONE:
                mv.to(st.GONE)
        elif mv.phase != st.MovePhase.CALLED_OFF:
            mv.to(st.FAIL)
        if waiting and not closing:  # a pull move held the batches while it waited for its source
            self._settle(step, s)
        for rid in mv.requests:
            if self.requests.pop(rid, None) is not None:
                step.reply(rid, m.AdminReply(
                    ok=ok, moves=[report] if ok else [], seconds=step.now - mv.requested,
                    message=(f"moved logical device {', '.join(map(str, mv.devices))} of session {s.id[:8]} from "
                             f"{mv.src} to {mv.dst}: {report.tensors} shards, {report.bytes} bytes, downtime "
                             f"{report.downtime_s:.3f}s") if ok else f"move failed: {mv.failed}"))

    def _flush_drops(self, step: Step) -> None:
        if not self.drops:
            return  # asked on every session's settle pass: most often there is nothing to drop
        keep = []
        for drop in self.drops:
            s = self.cluster.sessions.get(drop.session)
            if s is None or not self.cluster.alive(drop.worker):
                continue
            if any(self.cluster.waits_for(w, seq) for w, seq in drop.waits.items()):
                keep.append(drop)
                continue
            devices = [d for d in drop.devices if s.devices.get(d) != drop.worker]  # unless it came back
            if devices and drop.tids:
                before = s.sent.get(drop.worker)
                self.pipeline.send(step, s, {drop.worker: [m.CmdDelete(tids=drop.tids, devices=devices)]})
                if before is not None and drop.worker not in s.devices.values():
                    s.sent[drop.worker] = before  # cleanup on a worker it left: its Syncs do not wait for it
        self._keep(keep)

    # ------------------------------------------------------------ losses and closing

    def abort(self, step: Step, s: Session, why: str) -> set[str]:
        """The session is being rebuilt: its running move stops (a drain's move is tried again after). Returns
        the workers that may hold shards of it without hosting a device (the move's target)."""
        extra: set[str] = set()
        q = self.queues.get(s.id, [])
        running = self.running(s.id)
        if running:
            self.pipeline.release(step, s, st.Hold.MIGRATING)  # the rebuild holds the batches now
        for mv in running:
            extra.add(mv.dst)
            if mv.drain:
                mv.seq, mv.started = 0, 0.0
                mv.to(st.RETRY)
            else:
                q.remove(mv)
                mv.failed = why
                self._done(step, s, mv)
        self._keep([d for d in self.drops if d.session != s.id])  # the rebuild drops everything anyway
        return extra

    def worker_lost(self, step: Step, s: Session, w: Worker, rebuilt: bool) -> None:
        """For sessions that used `w`, and for moves to it: fail what cannot go on."""
        q = self.queues.get(s.id, [])
        for mv in [mv for mv in q if mv.dst == w.id and not mv.copying]:
            mv.failed = f"worker {w.id} was lost"
            q.remove(mv)
            self._done(step, s, mv)
        for mv in self.running(s.id):
            if mv.dst == w.id and not rebuilt:
                mv.failed = f"worker {w.id} was lost during the copy"

    def sources_lost(self, step: Step, s: Session) -> None:
        """Rule 4, when the session is not rebuilt (it lost data): a move whose source was lost cannot happen (its
        devices went with the worker), so it ends now instead of holding the session's batches for good."""
        q = self.queues.get(s.id, [])
        for mv in [mv for mv in q if not self.cluster.alive(mv.src)]:
            mv.failed = f"worker {mv.src} was lost with the devices"
            q.remove(mv)
            if mv.copying:
                self._call_off(step, s, mv)
            else:
                self._done(step, s, mv)
                self._settle(step, s)

    def closed(self, step: Step, s: Session) -> set[str]:
        """`s` closed: its moves end. Returns the targets of those that started: they may hold copies already."""
        targets = set()
        for mv in self.queues.pop(s.id, []):
            if mv.seq:
                targets.add(mv.dst)
            mv.failed = "the session closed"
            self._done(step, s, mv, closing=True)
        self._keep([d for d in self.drops if d.session != s.id])
        return targets

    def _keep(self, drops: list[Drop]) -> None:
        if len(drops) != len(self.drops):
            self._dropping = {}
            for d in drops:
                self._dropping[d.session] = self._dropping.get(d.session, 0) + 1
        self.drops = drops


def unknown_worker(cluster: Cluster, worker_id: str) -> str:
    return f"unknown worker {worker_id[:32]!r} (workers: {cluster.describe_workers()})"
