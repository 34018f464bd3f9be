"""Moving logical devices between live workers: `migrate` and `drain`. Sans-IO, part of recovery.py's Faults.

Rules:

1. A move of some logical devices of one session from worker A to worker B holds the session's batches
   and sends A one CmdSendShards(move=...): at that point of A's stream (after everything sent before)
   A copies every shard of those devices whole to B, worker to worker, with their aliasing. Once A
   completed it the devices are rebound to B (later batches go to B, Sync locations name B), held
   batches go out, and A drops its shards when the readers planned before the move are done (the session's
   Syncs do not wait for that drop when A hosts none of its devices any more: it may be queued behind
   another session's work there). The time the batches were held is the move's downtime, reported to the
   operator and in the event log.
2. Uploads under way: from the copy on, A refuses client Puts for the moving devices ("moved:"), and
   uploads that arrived before it travel with them. The client asks the controller where the device
   went and uploads again (session.py).
3. One move per session at a time; later ones queue, and none starts while the session is recovering.
   A *pull* move (a frozen session relocating off its preemptor's worker, elastic.py) holds the session's
   batches at once, waits until A finished the session's work, then has B pull the shards from A's server
   (CmdFetchShards(move=...)): not at A's place in its stream, which runs another session's work and
   may be far behind. A then refuses uploads for the devices and hands over the ones not adopted yet.
4. A move that fails (the copy failed, B was lost) is called off: A keeps the devices (CmdStay) and the
   batches go on. If A is lost, recovery.py rebuilds the session instead (or reports the loss).
5. Drain: the worker turns `draining` (no new devices); each session's devices on it move to a free
   worker on another node (a worker is drained because its node is going away, usually), else a free one
   on its node, else one the session already uses (other nodes first); then every session whose copies
   (snapshots, uploads) sat on it takes a new snapshot elsewhere; then it is released (fenced: it exits).
   Nothing is lost. Targets come from the pool's free index, never a scan of every worker; two moves
   never head for the same free worker, and a drain move whose target was taken meanwhile picks again.
6. Admin requests get exactly one reply: when done, or at their timeout (the work goes on). Unknown
   sessions, devices and workers are refused in one line; sessions may be named by a unique prefix.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_controller.core.lineage import shard_bytes, tensors_on
from dtorch_controller.core.model import Session, Worker
from dtorch_controller.core.pool import node_of
from dtorch_protocol import messages as m

if TYPE_CHECKING:
    from dtorch_controller.core.recovery import Faults

Effects = list[fx.Effect]


def _short(session_id: str) -> str:
    return session_id[:8]


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
    seq: int = 0  # Execute seq of the copy on `src` (`dst` when pulling; 0: not started)
    started: float = 0.0
    tensors: int = 0
    bytes: int = 0
    failed: str = ""

    @property
    def copier(self) -> str:
        """The worker that runs the copy."""
        return self.dst if self.pull else self.src

    def report(self, now: float) -> m.MoveReport:
        return m.MoveReport(session=self.session, devices=list(self.devices), from_worker=self.src,
                            to_worker=self.dst, tensors=self.tensors, bytes=self.bytes,
                            downtime_s=max(0.0, now - self.started) if self.started else 0.0)


@dataclass
class DrainJob:
    worker: str
    requested: float
    requests: list[Hashable] = field(default_factory=list)
    moves: list[m.MoveReport] = field(default_factory=list)
    phase: str = "moving"  # moving -> protecting -> released
    failed: str = ""
    sessions: set[str] = field(default_factory=set)  # sessions with moves off the worker
    protect: set[str] | None = None  # protecting: sessions that still keep copies on the worker


@dataclass
class Drop:
    """Shards left on a move's source until the readers planned before the move are done."""

    session: str
    worker: str
    tids: list[int]
    devices: list[int]
    waits: dict[str, int]


class Mover:
    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.core = faults.core
        self.queues: dict[str, list[Move]] = {}  # session -> moves, the first one may be running
        self.drains: dict[str, DrainJob] = {}  # worker -> its drain
        self.drops: list[Drop] = []
        self.requests: dict[Hashable, tuple[str, Any]] = {}  # admin request -> ("move"|"drain", job), unanswered
        self.later: list[tuple[Session, Move]] = []  # moves failed while effects could not be emitted

    # ------------------------------------------------------------ helpers

    @property
    def now(self) -> float:
        return self.faults.now

    def _reply(self, out: Effects, request_id: Hashable, message: Any) -> None:
        if self.requests.pop(request_id, None) is not None or isinstance(message, fx.Refusal):
            out.append(fx.Reply(request_id, message))

    def _refuse(self, out: Effects, request_id: Hashable, message: str) -> None:
        out.append(fx.Reply(request_id, fx.Refusal("refused", message)))

    def active(self, sid: str) -> Move | None:
        q = self.queues.get(sid)
        return q[0] if q and q[0].seq else None

    def busy(self, sid: str) -> bool:
        return bool(self.queues.get(sid)) or any(d.session == sid for d in self.drops)

    def awaits(self, sid: str) -> list[tuple[str, int]] | None:
        """(worker, Execute seq) pairs the session's move and drops wait on; None when they may go on without a
        report (a queued move waiting for the session, a failed copy, a drop ready to go): recovery.py rule 8."""
        waits: list[tuple[str, int]] = []
        q = self.queues.get(sid)
        if q:
            mv = q[0]
            s = self.core.sessions.get(sid)
            before = s.sent.get(mv.src, 0) if s is not None and mv.pull and not mv.seq else 0
            if before and self.faults._waits_for(mv.src, before):
                waits.append((mv.src, before))  # a pull waiting for the session's work on its source
            elif not mv.seq or mv.failed:
                return None
            else:
                waits.append((mv.copier, mv.seq))
        for drop in self.drops:
            if drop.session == sid:
                pending = [(w, seq) for w, seq in drop.waits.items() if self.faults._waits_for(w, seq)]
                if not pending:
                    return None
                waits += pending
        return waits

    def involves(self, sid: str, worker_id: str) -> bool:
        mv = self.active(sid)
        return mv is not None and worker_id in (mv.src, mv.dst)

    def find_session(self, text: str) -> tuple[Session | None, str]:
        sessions = self.core.sessions
        if text in sessions:
            return sessions[text], ""
        hits = [s for sid, s in sessions.items() if len(text) >= 4 and sid.startswith(text)]
        if len(hits) == 1:
            return hits[0], ""
        known = ", ".join(sorted(_short(sid) for sid in sessions)) or "none"
        if len(hits) > 1:
            return None, f"session prefix {text[:16]!r} is ambiguous ({len(hits)} sessions match)"
        return None, f"unknown session {text[:16]!r} (sessions: {known})"

    def _unknown_worker(self, worker_id: str) -> str:
        known = ", ".join(f"{w.id} {w.state}" for w in sorted(self.core.workers.values(), key=lambda w: w.order))
        return f"unknown worker {worker_id[:32]!r} (workers: {known or 'none'})"

    # leases: the scheduler's pool says which worker a session may use (exclusive devices unless packed)

    def _tenant(self, s: Session) -> Any:
        return self._tenant_of(s.id)

    def _tenant_of(self, sid: str) -> Any:
        sched = getattr(self.core, "sched", None)
        return None if sched is None else sched.tenants.get(sid)

    def _cap(self, t: Any) -> int:
        sched = self.core.sched
        cap = getattr(sched, "_cap", None)
        return cap(t) if cap is not None else 0

    def lease_problem(self, s: Session, dst: str) -> str | None:
        t = self._tenant(s)
        if t is None:
            return None
        sched = self.core.sched
        if sched.frozen(s.id):
            return f"session {_short(s.id)} is frozen (preempted): its devices move when it runs again"
        if dst in t.workers:
            return None
        slot = sched.pool.slots.get(dst)
        if slot is None or not slot.placeable:
            return f"worker {dst} cannot take devices now"
        others = [x for x in slot.leases if x != s.id]
        cap = self._cap(t)
        if others and (cap == 0 or slot.exclusive):
            return f"worker {dst} is leased to session {_short(others[0])}"
        if cap and not sched.pool.fits(dst, cap):
            return f"worker {dst} has no room for session {_short(s.id)}'s memory cap"
        return None

    def _taken(self, s: Session, dst: str) -> bool:
        """Is `dst` leased to others so that the session cannot have it (any more)?"""
        t = self._tenant(s)
        return t is not None and dst not in t.workers and not self.core.sched.pool.fits(dst, self._cap(t))

    def _swap_leases(self, s: Session, src: str, dst: str, out: Effects) -> None:
        """The scheduler leases `dst` to the session and takes `src` back once it hosts nothing of it (and
        re-runs its queue, so a worker a move emptied is used at once)."""
        sched = getattr(self.core, "sched", None)
        if sched is not None:
            changes = sched.moved(self.now, s.id, src, dst, src_empty=src not in s.devices.values())
            self.core._apply(self.now, changes, out)

    def incoming(self) -> set[str]:
        """Targets of queued moves not leased to their session yet (drains, migrations): taken for other moves."""
        out = set()
        for sid, q in self.queues.items():
            t = self._tenant_of(sid)
            out |= {mv.dst for mv in q if t is None or mv.dst not in t.workers}
        return out

    def target(self, s: Session, exclude: str, skip: set[str] | None = None) -> str | None:
        """Where a drain moves a session's devices off `exclude` (rule 5): a free worker on another node (one
        of a node the session uses first, else best fit), a free worker on the same node, one of the session's
        own workers on another node, then on the same node, then (packed sessions) a shared worker with room.
        `skip`: workers other moves head for (default: `incoming()`). O(free index + the session's workers)."""
        skip = self.incoming() if skip is None else skip
        workers = self.core.workers
        drained = workers.get(exclude)
        t = self._tenant(s)
        if t is None:  # a core without a scheduler (test harnesses): the least loaded live worker, other nodes first
            node = node_of(drained.address, drained.labels) if drained is not None else ""
            cands = [w for w in workers.values() if w.state in st.PLACEABLE and w.id != exclude and w.id not in skip]
            return min(cands, key=lambda w: (node_of(w.address, w.labels) == node, w.bound, w.order)).id \
                if cands else None
        pool = self.core.sched.pool
        slot = pool.slots.get(exclude)
        node = slot.node if slot is not None else ""
        own = [pool.slots[w] for w in t.workers if w != exclude and w in pool.slots and pool.slots[w].placeable]
        prefer = sorted({o.node for o in own if o.node != node})
        dst = pool.free_off(node, prefer=prefer, skip=skip) or pool.free_on(node, skip=skip)
        if dst is not None:
            return dst
        own.sort(key=lambda o: (o.node == node, workers[o.worker].bound, o.order))
        if own:
            return own[0].worker
        cap = self._cap(t)
        if cap:
            shared = [w for w in pool.shared(cap, skip) if w != exclude]
            shared.sort(key=lambda w: pool.slots[w].node == node)  # stable: least room first within each
            return next((w for w in shared if self.lease_problem(s, w) is None), None)
        return None

    # ------------------------------------------------------------ requests

    def migrate(self, now: float, e: ev.Migrate, out: Effects) -> None:
        msg = e.msg
        s, problem = self.find_session(msg.session)
        if s is None:
            return self._refuse(out, e.request_id, problem)
        if msg.device not in s.devices:
            devices = ", ".join(map(str, sorted(s.devices))) or "none bound yet"
            return self._refuse(out, e.request_id, f"session {_short(s.id)} has no logical device {msg.device} "
                                                   f"(devices: {devices})")
        w = self.core.workers.get(msg.to_worker)
        if w is None:
            return self._refuse(out, e.request_id, self._unknown_worker(msg.to_worker))
        if w.state not in st.PLACEABLE:
            return self._refuse(out, e.request_id, f"worker {w.id} is {w.state}: it cannot take devices")
        if s.state == st.DEGRADED:
            return self._refuse(out, e.request_id, f"session {_short(s.id)} lost data to a worker loss: "
                                                   "its devices are not moved")
        src = s.devices[msg.device]
        if src == w.id:
            return out.append(fx.Reply(e.request_id, m.AdminReply(
                ok=True, message=f"logical device {msg.device} of session {_short(s.id)} is already on {w.id}")))
        problem = self.lease_problem(s, w.id)
        if problem:
            return self._refuse(out, e.request_id, problem)
        mv = Move(session=s.id, devices=[msg.device], src=src, dst=w.id, requested=now, requests=[e.request_id])
        self.requests[e.request_id] = ("move", mv)
        out.append(fx.SetTimer(now + max(msg.timeout_s, 0.0), ("faults", "admin", e.request_id)))
        self.queues.setdefault(s.id, []).append(mv)
        self.faults.active.add(s.id)
        self.start_next(s, out)

    def drain(self, now: float, e: ev.Drain, out: Effects) -> None:
        w = self.core.workers.get(e.msg.worker)
        if w is None:
            return self._refuse(out, e.request_id, self._unknown_worker(e.msg.worker))
        if w.state == st.LOST:
            return self._refuse(out, e.request_id, f"worker {w.id} is already gone (lost or released)")
        out.append(fx.SetTimer(now + max(e.msg.timeout_s, 0.0), ("faults", "admin", e.request_id)))
        job = self.drains.get(w.id)
        if job is not None:  # already draining: one more operator waits for it
            job.requests.append(e.request_id)
            self.requests[e.request_id] = ("drain", job)
            return
        hosted = [self.core.sessions[sid] for sid in sorted(w.sessions) if sid in self.core.sessions]
        targets = {}
        skip = self.incoming()
        for s in hosted:
            dst = self.target(s, w.id, skip)
            if dst is None:
                return self._refuse(out, e.request_id, f"no other worker can take session {_short(s.id)}'s "
                                                       f"devices from {w.id}")
            targets[s.id] = dst
            skip.add(dst)  # one target per session (a worker it uses is not another's to take anyway)
        job = self.drains[w.id] = DrainJob(worker=w.id, requested=now, requests=[e.request_id],
                                           sessions={s.id for s in hosted})
        self.requests[e.request_id] = ("drain", job)
        if w.state != st.DRAINING:
            w.state = st.step(st.WORKER_TABLE, w.state, st.DRAIN)
            sched = getattr(self.core, "sched", None)
            if sched is not None:
                self.core._apply(now, sched.worker_changed(now, w), out)
        count = sum(1 for s in hosted for x in s.devices.values() if x == w.id)
        self.core.log.add(now, f"worker {w.id} draining: {count} logical devices of {len(hosted)} sessions to move")
        for s in hosted:
            devices = sorted(d for d, x in s.devices.items() if x == w.id)
            self.queues.setdefault(s.id, []).append(Move(session=s.id, devices=devices, src=w.id, dst=targets[s.id],
                                                         requested=now, drain=w.id))
            self.faults.active.add(s.id)
            self.start_next(s, out)
        self.advance_drains(out)

    def timer(self, key: tuple, out: Effects) -> None:
        if len(key) == 3 and key[1] == "admin":
            entry = self.requests.pop(key[2], None)
            if entry is None:
                return  # answered already
            kind, job = entry
            if kind == "move":
                what = (f"moving logical device {job.devices} of session {_short(job.session)} to {job.dst}: "
                        f"{'copying' if job.seq else 'waiting for the session'}")
            else:
                what = f"draining {job.worker}: {job.phase}"
            out.append(fx.Reply(key[2], m.AdminReply(ok=False, message=f"still in progress ({what}); it goes on",
                                                     seconds=self.now - job.requested)))

    # ------------------------------------------------------------ moves

    def start_next(self, s: Session, out: Effects) -> None:
        q = self.queues.get(s.id)
        if not q or q[0].seq or s.id in self.faults.rebuilds or s.state != st.OPEN:
            return
        mv = q[0]
        devices = [d for d in mv.devices if s.devices.get(d) == mv.src]
        dst = self.core.workers.get(mv.dst)
        if not devices:
            q.pop(0)
            if not mv.drain:
                mv.failed = f"logical device {', '.join(map(str, mv.devices))} is no longer on {mv.src}"
            return self._done(s, mv, out)
        if mv.drain and (dst is None or dst.state not in st.PLACEABLE or self._taken(s, mv.dst)):
            # the target was taken meanwhile (the queue placed a session on it, it went away): pick again
            again = self.target(s, mv.drain, self.incoming() - {mv.dst})
            if again is not None:
                mv.dst, dst = again, self.core.workers[again]
        if dst is None or dst.state not in st.PLACEABLE:
            mv.failed = f"worker {mv.dst} can no longer take devices"
            q.pop(0)
            return self._done(s, mv, out)
        src = self.core.workers[mv.src]
        if mv.pull:
            self.faults.hold(s, "migrating")
            if src.state != st.LOST and src.completed < s.sent.get(mv.src, 0):
                return  # the session's work there is not done yet: a report of `src` brings us back
        mv.devices = devices
        shards = {d: tensors_on(s.tensors, s.meshes, d) for d in devices}
        mv.tensors = sum(len(t) for t in shards.values())
        mv.bytes = sum(shard_bytes(s.tensors[t], s.meshes[s.tensors[t].mesh], d) for d, tids in shards.items()
                       for t in tids)
        self.faults.hold(s, "migrating")
        s.state = st.step(st.SESSION_TABLE, s.state, st.MOVE)
        mv.started = self.now
        if mv.pull:
            cmd: m.Cmd = m.CmdFetchShards(devices=shards, namespace=s.id, address=src.address, move=devices)
        else:
            cmd = m.CmdSendShards(devices=shards, namespace=s.id, to=dst.address, move=devices)
        mv.seq = self.faults.send(s, {mv.copier: [cmd]}, out)[mv.copier]
        self.faults.active.add(s.id)

    def copy_failed(self, s: Session, w: Worker, e: m.ErrorReport) -> None:
        mv = self.active(s.id)
        if mv is not None and mv.copier == w.id and mv.seq == e.seq:
            mv.failed = f"the copy to {mv.dst} failed: {e.message}"

    def advance(self, s: Session, out: Effects) -> None:
        self._flush_drops(out)
        mv = self.active(s.id)
        if mv is None:
            self.start_next(s, out)
            return
        if self.core.workers[mv.copier].completed < mv.seq and not mv.failed:
            return
        self.queues[s.id].pop(0)
        if mv.failed:
            self._call_off(s, mv, out)
        else:
            self._commit(s, mv, out)
        self.start_next(s, out)

    def _commit(self, s: Session, mv: Move, out: Effects) -> None:
        for d in mv.devices:
            self.faults._unbind(s, d, mv.src)
            self.core._bind(s, d, mv.dst)
        self._swap_leases(s, mv.src, mv.dst, out)
        tids = sorted({t for d in mv.devices for t in tensors_on(s.tensors, s.meshes, d)})
        waits = {}
        for tid in tids:
            for reader, seq in s.readers.get(tid, {}).items():
                if reader != mv.src and self.faults.alive(reader):
                    waits[reader] = max(waits.get(reader, 0), seq)
        self.drops.append(Drop(s.id, mv.src, tids, list(mv.devices), waits))
        self._flush_drops(out)
        rec = self.faults.rec(s)
        rec.migrations += 1
        rec.force = True  # the copies' holders may now include the devices' own worker
        if s.state == st.MIGRATING:  # not when it lost data meanwhile (degraded): it stays so (as in _call_off)
            s.state = st.step(st.SESSION_TABLE, s.state, st.MOVED)
        report = mv.report(self.now)
        self.core.log.add(self.now, f"session {_short(s.id)} logical device{'s' if len(mv.devices) > 1 else ''} "
                                    f"{', '.join(map(str, mv.devices))} moved {mv.src} -> {mv.dst}: {mv.tensors} "
                                    f"shards, {mv.bytes} bytes, downtime {report.downtime_s:.3f}s")
        self._done(s, mv, out, report)
        self.faults.unhold(s, "migrating", out)

    def _call_off(self, s: Session, mv: Move, out: Effects) -> None:
        """Rule 4: the source keeps the devices; what reached the target is dropped there."""
        if self.faults.alive(mv.src):
            self.faults.send(s, {mv.src: [m.CmdStay(devices=list(mv.devices))]}, out)
        if self.faults.alive(mv.dst):
            tids = sorted({t for d in mv.devices for t in tensors_on(s.tensors, s.meshes, d)})
            if tids:
                self.faults.send(s, {mv.dst: [m.CmdDelete(tids=tids, devices=list(mv.devices))]}, out)
        self.core.log.add(self.now, f"session {_short(s.id)} move of logical devices {mv.devices} to {mv.dst} "
                                    f"called off: {mv.failed}")
        if s.state == st.MIGRATING:
            s.state = st.step(st.SESSION_TABLE, s.state, st.MOVED)
        self._done(s, mv, out)
        self.faults.unhold(s, "migrating", out)

    def _done(self, s: Session, mv: Move, out: Effects, report: m.MoveReport | None = None) -> None:
        ok = not mv.failed
        report = report or mv.report(self.now)
        for rid in mv.requests:
            self._reply(out, rid, m.AdminReply(
                ok=ok, moves=[report] if ok else [], seconds=self.now - mv.requested,
                message=(f"moved logical device {', '.join(map(str, mv.devices))} of session {_short(s.id)} "
                         f"from {mv.src} to {mv.dst}: {report.tensors} shards, {report.bytes} bytes, downtime "
                         f"{report.downtime_s:.3f}s") if ok else f"move failed: {mv.failed}"))
        job = self.drains.get(mv.drain) if mv.drain else None
        if job is not None:
            if ok:
                job.moves.append(report)
            else:
                job.failed = job.failed or f"session {_short(s.id)}: {mv.failed}"

    def _flush_drops(self, out: Effects) -> None:
        keep = []
        for drop in self.drops:
            s = self.core.sessions.get(drop.session)
            if s is None or not self.faults.alive(drop.worker):
                continue
            if any(self.faults.alive(w) and self.core.workers[w].completed < seq for w, seq in drop.waits.items()):
                keep.append(drop)
                continue
            devices = [d for d in drop.devices if s.devices.get(d) != drop.worker]  # unless it came back
            if devices and drop.tids:
                before = s.sent.get(drop.worker)
                self.faults.send(s, {drop.worker: [m.CmdDelete(tids=drop.tids, devices=devices)]}, out)
                if before is not None and drop.worker not in s.devices.values():
                    s.sent[drop.worker] = before  # cleanup on a worker it left: its Syncs do not wait for it
        self.drops = keep

    # ------------------------------------------------------------ losses and closing

    def abort(self, s: Session, why: str, out: Effects) -> set[str]:
        """The session is being rebuilt: its running move stops (a drain's move is tried again after).
        Returns the workers that may hold shards of it without hosting a device (the move's target)."""
        q = self.queues.get(s.id)
        extra: set[str] = set()
        if q and q[0].seq:
            mv = q[0]
            extra.add(mv.dst)
            self.faults.holds.get(s.id, set()).discard("migrating")
            if mv.drain:
                mv.seq, mv.started = 0, 0.0
            else:
                q.pop(0)
                mv.failed = why
                self._done(s, mv, out)
        self.drops = [d for d in self.drops if d.session != s.id]  # the rebuild drops everything anyway
        return extra

    def worker_lost(self, s: Session, w: Worker, taken: bool) -> None:
        """Called for sessions that used `w`, and for moves to it: fail what cannot go on."""
        q = self.queues.get(s.id, [])
        for mv in list(q):
            if mv.dst == w.id and not mv.seq:
                mv.failed = f"worker {w.id} was lost"
                q.remove(mv)
                self.later.append((s, mv))
        mv = self.active(s.id)
        if mv is not None and mv.dst == w.id and not taken:
            mv.failed = f"worker {w.id} was lost during the copy"

    def drain_worker_lost(self, w: Worker) -> None:
        job = self.drains.get(w.id)
        if job is not None:
            job.failed = job.failed or f"worker {w.id} was lost while draining"

    def closed(self, s: Session, out: Effects) -> None:
        for mv in self.queues.pop(s.id, []):
            mv.failed = "the session closed"
            self._done(s, mv, out)
        self.drops = [d for d in self.drops if d.session != s.id]

    # ------------------------------------------------------------ drains

    def advance_drains(self, out: Effects) -> None:
        for s, mv in self.later:
            self._done(s, mv, out)
        self.later.clear()
        for worker_id, job in list(self.drains.items()):
            w = self.core.workers.get(worker_id)
            if job.failed or w is None or w.state == st.LOST:
                del self.drains[worker_id]
                self._answer_drain(job, out, ok=False, message=f"drain of {worker_id} failed: "
                                                               f"{job.failed or 'the worker is gone'}")
                continue
            if job.phase == "moving":
                if any(mv.drain == worker_id for sid in job.sessions for mv in self.queues.get(sid, ())):
                    continue
                job.phase = "protecting"
            if job.phase == "protecting":
                if job.protect is None:  # once: later copies never go to a draining worker (not placeable)
                    job.protect = set(self.faults.recs)
                job.protect = self._copies_on(worker_id, job.protect, out)
                if job.protect:
                    continue
                self._release(w, job, out)

    def _copies_on(self, worker_id: str, sids: set[str], out: Effects) -> set[str]:
        """Which of `sids` still keep copies (or devices) on the worker? Starts the snapshots that move them."""
        waiting = set()
        for sid in sorted(sids):
            rec = self.faults.recs.get(sid)
            s = self.core.sessions.get(sid)
            if s is None or rec is None:
                continue
            if not rec.enabled:
                self.faults._drop_namespaces(rec, {ns for ns, ws in rec.namespaces.items() if worker_id in ws}, out)
                continue
            copies = [c for c in (rec.snapshot, rec.taking, *rec.adopts.values()) if c is not None]
            if any(worker_id in holders for c in copies for holders in c.holders.values()) \
                    or any(worker_id in ws for ws in rec.namespaces.values()) or worker_id in s.devices.values():
                waiting.add(sid)
                if rec.taking is None:
                    rec.force = True
                    self.faults.active.add(sid)
                    self.faults.maybe_snapshot(s, out)
        return waiting

    def _release(self, w: Worker, job: DrainJob, out: Effects) -> None:
        del self.drains[w.id]
        w.state = st.step(st.WORKER_TABLE, w.state, st.RELEASE)
        for s in self.core.sessions.values():  # nothing is bound there: no Sync waits for it (the core forgets it)
            s.sent.pop(w.id, None)
        by_address = self.core._by_address
        if by_address.get(w.address) == w.id:
            del by_address[w.address]
        took = self.now - job.requested
        self.core.log.add(self.now, f"worker {w.id} at {w.address} released after draining in {took:.3f}s "
                                    f"({len(job.moves)} moves)")
        sched = getattr(self.core, "sched", None)
        if sched is not None:
            self.core._apply(self.now, sched.worker_changed(self.now, w), out)
        self.core._prune_lost()
        moved = sum(len(mv.devices) for mv in job.moves)
        self._answer_drain(job, out, ok=True, message=f"drained {w.id}: moved {moved} logical devices of "
                                                      f"{len(job.moves)} sessions, released it")

    def _answer_drain(self, job: DrainJob, out: Effects, ok: bool, message: str) -> None:
        for rid in job.requests:
            self._reply(out, rid, m.AdminReply(ok=ok, message=message, moves=list(job.moves),
                                               seconds=self.now - job.requested))
