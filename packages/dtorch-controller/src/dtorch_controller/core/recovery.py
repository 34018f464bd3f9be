"""Recovery after a worker loss: rebuild each session that used it from its snapshot and log. Sans-IO.

Rules:

1. When a worker is lost, a session that used it is *recoverable* when it has a complete snapshot with a
   surviving copy of every device's shards and of every upload in its log (snapshots.py, lineage.py). Its batches
   are held (`Hold.RECOVERING`) and its lost logical devices are rebound through the scheduler; then the rebuild
   goes through the phases of `state.REBUILD_TABLE`:
   placing   wait until every logical device is bound to a live worker (a copy it needs that is only on a
             suspect worker is waited for: that worker may report again) and the uploads' copies that live
             workers are making are made (or failed: a copy to a lost worker leaves the primary's own);
   resetting every worker of the session gets CmdAbandon (acts on arrival: abandons the old stream, ends
             its waits on the dead worker) and drops the session's known tensors; wait until all ran it;
   replaying each worker restores its devices' shards from the snapshot copies (CmdFetchShards, local
             when it has them), then the logged batches are translated again for the new binding and
             sent, uploads restored from their copies at the adopt's point; CmdRebuilt ends the phase.
   The client sees only a slower Sync: errors of the abandoned work are dropped (by worker Execute seq),
   errors of replayed batches the client already saw are not repeated, failed copies (kind COPY) never show.
2. A session that is not recoverable loses the lost devices' tensors: its next Sync raises an error naming them
   and the op that made each, it becomes `degraded`, and stops keeping lineage. Other sessions and the controller
   carry on. Its lost logical devices stay (or go back) on the lost worker, so later instructions on them fail.
3. A worker that only held copies takes the session's protection with it: a new snapshot is forced at once.
4. A rebuild may restart from placing at any phase (another loss): every phase can be done again.
5. A running move of the session stops (moves.py rule 4); the move's target may hold shards of the session and
   is reset too.
6. Whether or not the session is rebuilt, its other live workers (hosts, holders of its copies) get CmdFence for the
   lost worker at once, one each (under the namespace FENCES: no Sync waits for it): a stopped worker keeps its
   connections open, and a copy or a collective waiting on it would otherwise hold their streams (and the
   session's next Sync) until its own timeout. A worker that registers at a fenced address (a restart) has it
   lifted (`CmdFence.lifted`) on the live workers that were told to fence it: they reach it again.
7. Uploads no copy holds do not make a session unrecoverable: the client still holds them (it keeps each upload until
   told that its copies are complete: snapshots.py rule 7, or a Sync answered done after it). They are the shards
   whose lost worker had not copied them yet (lineage.py rule 3), found when the replay goes out (the workers' resets
   are done, so nothing drops them), and the uploads going out later (held, or not even sent by the client yet) on a
   device the loss rebound (`Session.rebound`, until a Sync answered done tells the client where its devices are: it
   may have Put them to the lost worker; pipeline.py rule 3). They are asked for: `Session.reput`, given to the
   session's parked Syncs at once (done=False, `SyncReply.reput`), else to its next Submit, Sync or KeepAlive
   (`SubmitReply.reput`: a program streaming for long between sync points hears it too; a Submit carried by a Sync
   leaves it to the Sync, answered at once; `KeepAliveReply.reput`: a client silent between sync points hears it
   within a keep-alive period, 1 s at most); the client Puts them to the devices' new workers, and the first reader
   of one (or its copy) waits for it there (the worker's input wait, 10 s by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from dtorch_controller.core import effects as fx
from dtorch_controller.core import state as st
from dtorch_controller.core.lineage import Lineage, copy_source, instr_tids, reputs, tensors_on, upload_source
from dtorch_controller.core.model import Cluster, Session, Worker
from dtorch_controller.core.moves import Moves
from dtorch_controller.core.pipeline import Cmds, Pipeline
from dtorch_controller.core.scheduler import Scheduler
from dtorch_controller.core.snapshots import Snapshots
from dtorch_controller.core.step import Step
from dtorch_protocol import messages as m

FENCES = "#fence"  # the namespace CmdFence goes under (no session's: it acts for all of them)


@dataclass
class Rebuild:
    """A recovery in progress (rule 1)."""

    started: float
    reason: str
    lost: set[str] = field(default_factory=set)  # addresses of the lost workers (fenced on the others)
    gone: dict[str, Worker] = field(default_factory=dict)  # the lost workers' records (the core may forget them)
    phase: st.RebuildPhase = st.RebuildPhase.PLACING
    waits: dict[str, int] = field(default_factory=dict)  # worker -> Execute seq that must complete
    extra: set[str] = field(default_factory=set)  # workers that got session shards without hosting a device
    before: dict[int, str] = field(default_factory=dict)  # logical device -> worker when it started
    placed: bool = False  # lost devices were handed to the scheduler
    replayed: int = 0

    def to(self, event: str) -> None:
        self.phase = st.step(st.REBUILD_TABLE, self.phase, event)


class Recovery:
    def __init__(self, cluster: Cluster, sched: Scheduler, pipeline: Pipeline, snapshots: Snapshots,
                 moves: Moves) -> None:
        self.cluster = cluster
        self.sched = sched
        self.pipeline = pipeline
        self.snapshots = snapshots
        self.moves = moves
        self.rebuilds: dict[str, Rebuild] = {}
        self.fenced: dict[str, set[str]] = {}  # a lost worker's address -> the workers told, until one registers there

    @property
    def enabled(self) -> bool:
        return self.pipeline.recovery

    # ------------------------------------------------------------ a worker is lost

    def worker_lost(self, step: Step, w: Worker, reason: str) -> None:
        """`w` was just declared lost: rebuild the sessions that used it, or report what they lost (rules 1-3)."""
        fence: set[str] = set()  # the live workers that shared a session with `w` (rule 6)
        for sid in sorted(self.cluster.sessions):
            s = self.cluster.sessions[sid]
            rec = self.pipeline.recs.get(sid)
            bound = w.id in s.devices.values()
            if bound or w.id in s.sent or rec is not None and any(w.id in ws for ws in rec.namespaces.values()):
                fence.update(self._others(s, rec, w))
            uses = bound or self.moves.involves(sid, w.id)
            if not bound:  # what it sent there (a move's source) is not waited for; the core may forget `w`
                s.sent.pop(w.id, None)
            if rec is not None:
                self._forget_copies_on(step, s, rec, w)
            if not uses:
                continue
            why = self.unrecoverable(step, s)
            r = self.rebuilds.get(sid)
            if why is None:
                if r is None:
                    r = self.rebuilds[sid] = Rebuild(started=step.now, reason=f"worker {w.id} lost: {reason}")
                self.moves.worker_lost(step, s, w, rebuilt=True)
                self._start(step, s, r, w)
            elif r is not None:  # an earlier loss is pending in the rebuild: this reports both
                self._give_up(step, s, self.pipeline.rec(s, step.now), why)
                self.moves.worker_lost(step, s, w, rebuilt=True)
            else:
                self._disable(step, s, why)
                self.moves.worker_lost(step, s, w, rebuilt=False)
                self.moves.sources_lost(step, s)
                if bound:
                    self._report_loss(step, s, w, reason, why)
        if fence:
            self.fenced.setdefault(w.address, set()).update(fence)
        for wid in self.cluster.order(fence):  # outside the sessions' streams: no Sync waits for it
            self.pipeline.send_raw(step, wid, FENCES, [m.CmdFence(addresses=[w.address])])

    def worker_registered(self, step: Step, w: Worker) -> None:
        """Rule 6: a worker registered at a fenced address (a restart, once the old one was lost): the live workers
        that were told to fence it may reach that address again."""
        told = [wid for wid in self.fenced.pop(w.address, ()) if wid != w.id and self.cluster.alive(wid)]
        for wid in self.cluster.order(told):
            self.pipeline.send_raw(step, wid, FENCES, [m.CmdFence(lifted=[w.address])])

    def _others(self, s: Session, rec: Lineage | None, w: Worker) -> list[str]:
        """The session's live workers (hosts, holders of its copies) other than `w`."""
        workers = set(s.devices.values()).union(s.sent, *(rec.namespaces.values() if rec is not None else ()))
        return [wid for wid in workers if wid != w.id and self.cluster.alive(wid)]

    def _forget_copies_on(self, step: Step, s: Session, rec: Lineage, w: Worker) -> None:
        held = False
        for copies in (rec.snapshot, rec.taking, *rec.adopts.values()):
            if copies is None:
                continue
            making = copies.pending.pop(w.id, None) is not None  # `w` was copying its devices' shards
            for d, holders in copies.holders.items():
                if w.id in holders:
                    held = True
                    if making and holders[0] == w.id and copies is not rec.taking:
                        copies.holders[d] = []  # an upload's copy `w` was making of its own device may be partial
                        copies.unmade.add(d)
                    else:
                        copies.holders[d] = [h for h in holders if h != w.id]
            if making and copies is rec.taking:
                copies.failed = copies.failed or f"worker {w.id} was lost while copying"
        for ns in rec.namespaces.values():
            ns.discard(w.id)
        if held:
            rec.force = True  # rule 3
            step.touch(s.id)

    def _report_loss(self, step: Step, s: Session, w: Worker, reason: str, why: str) -> None:
        """Rule 2 for a session that was not being rebuilt (`why` not): its next Sync raises what the loss took."""
        devices = sorted(d for d, worker_id in s.devices.items() if worker_id == w.id)
        on_worker = {mesh.id for mesh in s.meshes.values() if any(s.devices[d] == w.id for d in mesh.devices)}
        lost = sorted(tid for tid, spec in s.tensors.items() if spec.mesh in on_worker)
        unfinished = s.sent.pop(w.id, 0) > w.completed
        s.state = st.step(st.SESSION_TABLE, s.state, st.WORKER_LOST)
        if lost or unfinished:
            what = f"{len(lost)} tensors lost: {self.lost_detail(s, lost)}" if lost else "unfinished commands lost"
            s.errors.append(m.ErrorReport(
                op="worker lost", src="", tid=lost[0] if lost else -1, kind=m.ErrorKind.WORKER_LOST,
                message=f"worker {w.id} at {w.address} was lost ({reason}); logical devices {devices} "
                        f"lost their data: {what}"))
            step.emit(fx.DataLost(s.id, why))
        step.note(f"session {s.id[:8]} lost logical devices {devices} with worker {w.id}")
        self.pipeline.flush_deferred(step, s)
        step.touch(s.id)

    def unrecoverable(self, step: Step, s: Session) -> str | None:
        """Why the session cannot be rebuilt after a loss, or None (rule 1)."""
        rec = self.pipeline.rec(s, step.now)
        if not rec.enabled:
            return "recovery is off (--snapshot-batches 0)" if not self.enabled else rec.why or "recovery is off"
        snap = rec.snapshot
        if snap is None:
            return "no complete snapshot of its tensors (copies need a second worker)"
        if not any(w.state in st.PLACEABLE for w in self.cluster.workers.values()):
            return "no live worker left to rebuild it on"
        for d in sorted(_devices(s)):  # bound or not (a rebuild may be waiting to place some)
            if tensors_on(snap.tensors, s.meshes, d) and not any(self.cluster.alive(h)
                                                                 for h in snap.holders.get(d, [])):
                return f"every copy of logical device {d}'s shards was on lost workers"
        for b in rec.sent_batches():
            for instr in b.instrs:
                if isinstance(instr, m.InstrAdopt):
                    copies = rec.adopts.get(instr.tid)  # copies live workers are still making: waited for (rule 1)
                    if copies is None or copies.failed:
                        return f"the upload of tensor {instr.tid} (batch {b.seq}) has no complete copy"
                    if not copies.tensors:
                        continue  # refused: nothing to restore
                    mesh = s.meshes.get(instr.spec.mesh)
                    for d in mesh.devices if mesh else ():  # a copy a lost worker was making: the client's (rule 7)
                        if d not in copies.unmade and \
                                upload_source(copies, instr.spec, mesh, d, "", self.cluster.alive) is None:
                            return f"every copy of the upload of tensor {instr.tid} was on lost workers"
        return None

    def _disable(self, step: Step, s: Session, why: str) -> None:
        rec = self.pipeline.rec(s, step.now)
        if rec.enabled:
            step.note(f"session {s.id[:8]} cannot be rebuilt: {why}")
        rec.enabled = False
        rec.why = why
        rec.snapshot = None
        rec.taking = None
        rec.log = [b for b in rec.log if not b.sent]
        rec.adopts.clear()
        s.reput, s.rebound, s.asked = {}, set(), set()
        # copies are dropped when the session closes (their workers may be the lost ones)

    def lost_detail(self, s: Session, tids: list[int]) -> str:
        """'tensor 7 (aten.mm.default at train.py:12), ...' for the loss message; why it was not rebuilt."""
        rec = self.pipeline.recs.get(s.id)
        origin = rec.origin if rec is not None else {}
        parts = []
        for tid in tids[:6]:
            op, src = origin.get(tid, ("", ""))
            parts.append(f"tensor {tid}" + (f" (made by {op}{' at ' + src if src else ''})" if op else ""))
        more = f" and {len(tids) - 6} more" if len(tids) > 6 else ""
        why = rec.why if rec is not None else ""
        return ", ".join(parts) + more + (f"; not rebuilt: {why}" if why else "")

    # ------------------------------------------------------------ rebuilding (rule 1)

    def rebuilding(self, sid: str) -> bool:
        return sid in self.rebuilds

    def _start(self, step: Step, s: Session, r: Rebuild, lost: Worker) -> None:
        rec = self.pipeline.rec(s, step.now)
        first = r.phase == st.RebuildPhase.PLACING and not r.waits and not r.lost
        if first:
            r.before = dict(s.devices)
        r.lost.add(lost.address)
        r.gone[lost.id] = lost
        r.to(st.LOSS)
        r.placed = False
        r.waits.clear()
        if s.state != st.RECOVERING:
            s.state = st.step(st.SESSION_TABLE, s.state, st.RECOVER)
        self.pipeline.hold(s, st.Hold.RECOVERING)
        if rec.taking is not None:
            self.snapshots.drop(step, rec, {rec.taking.namespace})
            rec.taking = None
        r.extra |= self.moves.abort(step, s, f"worker {lost.id} was lost")
        for wid in [w for w in s.sent if not self.cluster.alive(w)]:
            del s.sent[wid]
        if first:
            step.note(f"session {s.id[:8]} recovering from {r.reason}: rewinding to batch "
                      f"{rec.snapshot.upto if rec.snapshot else 0}, replaying {rec.batches_since_snapshot()} batches")
        step.touch(s.id)

    def advance(self, step: Step, s: Session) -> None:
        r = self.rebuilds.get(s.id)
        if r is None:
            return
        rec = self.pipeline.rec(s, step.now)
        if any(self.cluster.waits_for(w, seq) for w, seq in r.waits.items()):
            return
        if r.phase == st.RebuildPhase.PLACING:
            if r.placed and not step.everyone and _devices(s) - set(s.devices):
                return  # still waiting for the scheduler (copies only go with a loss, which looks at all)
            if any(c.pending for c in rec.adopts.values()):
                return  # uploads' copies live workers are making: they complete, or fail (rule 1)
            why = self.unrecoverable(step, s)
            if why is not None:
                return self._give_up(step, s, rec, why)
            if not r.placed:
                if self._needs_a_suspect(s, rec):
                    return  # a copy it needs is only on a silent worker: wait until it reports or is lost
                devices = []
                for d, wid in sorted(s.devices.items()):
                    if not self.cluster.alive(wid):
                        self.cluster.unbind(s, d)
                        devices.append(d)
                r.placed = True
                if devices:
                    self._place(step, s, devices)
            if _devices(s) - set(s.devices):
                return  # the scheduler has not bound them yet
            self._reset(step, s, rec, r)
        elif r.phase == st.RebuildPhase.RESETTING:
            why = self.unrecoverable(step, s)
            if why is not None:
                return self._give_up(step, s, rec, why)
            self._replay(step, s, rec, r)
        elif r.phase == st.RebuildPhase.REPLAYING:
            self._finish(step, s, rec, r)

    def awaits(self, sid: str) -> list[tuple[str, int]] | None:
        """The (worker, seq) pairs the rebuild waits on; None when placing (the scheduler, a suspect worker)."""
        r = self.rebuilds[sid]
        if r.phase == st.RebuildPhase.PLACING:
            return None
        return [(w, seq) for w, seq in r.waits.items() if self.cluster.waits_for(w, seq)] or None

    def _place(self, step: Step, s: Session, devices: list[int]) -> None:
        """Bind `devices` again through the scheduler (it may have to queue them)."""
        mesh = next((mesh for mesh in s.meshes.values() if devices[0] in mesh.coord), None)
        if mesh is not None:
            changes, _answer = self.sched.place(step.now, s.id, mesh.id, tuple(devices), restore=True)
            step.apply(changes)

    def _known_tids(self, s: Session, rec: Lineage) -> list[int]:
        tids = set(s.tensors) | set(s.readers) | {dd.tid for dd in s.deferred}
        if rec.snapshot is not None:
            tids |= set(rec.snapshot.tensors)
        for b in rec.sent_batches():
            for instr in b.instrs:
                tids |= instr_tids(instr)
        return sorted(tids)

    def _reset(self, step: Step, s: Session, rec: Lineage, r: Rebuild) -> None:
        workers = self.cluster.order({w for w in s.devices.values()} | {w for w in r.extra if self.cluster.alive(w)})
        cmd = m.CmdAbandon(tids=self._known_tids(s, rec), lost=sorted(r.lost))
        r.waits = self.pipeline.send(step, s, {w: [cmd] for w in workers})
        rec.reset_seq.update(r.waits)
        rec.replayed.clear()
        # errors of work after the snapshot are redone by the replay (or were caused by the loss)
        first = rec.snapshot.first_seq if rec.snapshot is not None else {}
        drop = {id(e) for w, e in rec.window_errors if e.seq >= first.get(w, 0)}  # by identity, in O(errors)
        s.errors = [e for e in s.errors if id(e) not in drop]
        rec.window_errors = [(w, e) for w, e in rec.window_errors if id(e) not in drop]
        r.to(st.BOUND)

    def _replay(self, step: Step, s: Session, rec: Lineage, r: Rebuild) -> None:
        snap = rec.snapshot
        assert snap is not None
        s.tensors = dict(snap.tensors)
        s.readers.clear()
        s.deferred.clear()
        restore: Cmds = {}
        for d in sorted(s.devices):
            tids = tensors_on(snap.tensors, s.meshes, d)
            if not tids:
                continue
            target = s.devices[d]
            source = copy_source(snap, d, target, self.cluster.alive)
            assert source is not None  # checked by unrecoverable()
            restore.setdefault(target, []).append(m.CmdFetchShards(
                devices={d: tids}, namespace=snap.namespace,
                address="" if source == target else self.cluster.address(source)))
        workers = set(r.waits)
        last = dict(self.pipeline.send(step, s, restore))
        batches = list(rec.sent_batches())
        for b in batches:
            cmds, _adopts, _errors = self.pipeline.translate(step.now, s, rec, b, replay=True)  # errors: reported
            seqs = self.pipeline.send(step, s, cmds)
            for w, seq in seqs.items():
                rec.replayed.setdefault(w, {})[seq] = b.seq
            last.update(seqs)
        done = self.pipeline.send(step, s, {w: [m.CmdRebuilt()] for w in sorted(workers | set(s.devices.values()))
                                            if self.cluster.alive(w)})
        last.update(done)
        r.waits = last
        r.replayed = len(batches)
        r.to(st.RESET)
        s.rebound |= {d for d in s.devices if r.before.get(d) in r.gone}  # rule 7
        if lost := reputs(s, rec, self.cluster.alive):
            s.reput.update(lost)  # with what an earlier rebuild asked for and the client was not told yet
            step.note(f"session {s.id[:8]} asks its client for {len(lost)} uploads the lost worker alone had")

    def _finish(self, step: Step, s: Session, rec: Lineage, r: Rebuild) -> None:
        del self.rebuilds[s.id]
        r.to(st.REPLAYED)
        rec.recoveries += 1
        rec.force = True  # copies on the new workers
        s.state = st.step(st.SESSION_TABLE, s.state, st.RECOVERED)
        moved = ", ".join(f"{d}->{w}" for d, w in sorted(s.devices.items()) if r.before.get(d) != w)
        step.note(f"session {s.id[:8]} recovered in {step.now - r.started:.3f}s "
                  f"(devices {moved or 'unchanged'}, {r.replayed} batches replayed)")
        step.emit(fx.Recovered(s.id, step.now - r.started, r.replayed))
        self.pipeline.release(step, s, st.Hold.RECOVERING)

    def _needs_a_suspect(self, s: Session, rec: Lineage) -> bool:
        """Is some copy the rebuild needs only on workers that went silent (suspect), not on a live one?"""
        ok = (st.ALIVE, st.DRAINING)
        needed = []
        if rec.snapshot is not None:
            needed += [rec.snapshot.holders.get(d, []) for d in _devices(s)
                       if tensors_on(rec.snapshot.tensors, s.meshes, d)]
        for b in rec.sent_batches():
            for instr in b.instrs:
                copies = rec.adopts.get(instr.tid) if isinstance(instr, m.InstrAdopt) else None
                if copies is not None and copies.tensors:  # a device with none takes a replica's (lineage rule 3)
                    needed += [holders for holders in copies.holders.values() if holders]
        workers = self.cluster.workers
        return any(not any(workers[h].state in ok for h in holders if self.cluster.alive(h)) for holders in needed)

    def _give_up(self, step: Step, s: Session, rec: Lineage, why: str) -> None:
        """The copies a rebuild needs are gone too: report what is lost (rule 2) and let the batches go on."""
        r = self.rebuilds.pop(s.id, None)
        self._disable(step, s, why)
        if r is not None:
            for d, wid in sorted(r.before.items()):
                if not self.cluster.alive(wid) and s.devices.get(d) != wid:
                    if wid not in self.cluster.workers:  # forgotten meanwhile (nothing was bound to it): recall it
                        if wid not in r.gone:
                            continue
                        self.cluster.recall(r.gone[wid])
                    if d in s.devices:
                        self.cluster.unbind(s, d)
                    self.cluster.bind(s, d, wid)
        if r is not None and r.phase != st.RebuildPhase.PLACING:  # its workers dropped its shards already
            lost = sorted(s.tensors)
        else:
            gone = {mesh.id for mesh in s.meshes.values() if any(not self.cluster.alive(s.devices[d])
                                                                 for d in mesh.devices if d in s.devices)}
            lost = sorted(tid for tid, spec in s.tensors.items() if spec.mesh in gone)
        if lost:
            s.errors.append(m.ErrorReport(
                op="worker lost", src="", tid=lost[0], kind=m.ErrorKind.WORKER_LOST,
                message=f"{r.reason if r else 'a worker was lost'}; {len(lost)} tensors lost: "
                        f"{self.lost_detail(s, lost)}"))
        s.state = st.step(st.SESSION_TABLE, s.state, st.WORKER_LOST)
        step.note(f"session {s.id[:8]} lost data: {why}")
        step.emit(fx.DataLost(s.id, why))
        self.moves.sources_lost(step, s)
        for reason in sorted(self.pipeline.holding(s) - {st.Hold.FROZEN}, key=lambda h: h.value):
            self.pipeline.release(step, s, reason)

    def closed(self, s: Session) -> set[str]:
        """`s` closed: its rebuild ends. Returns the workers that may hold its shards without hosting a device (the
        targets of copies the rebuild interrupted, `Rebuild.extra`)."""
        r = self.rebuilds.pop(s.id, None)
        return set(r.extra) if r is not None else set()

    # ------------------------------------------------------------ what the client sees

    def errors(self, s: Session, w: Worker, reports: list[m.ErrorReport]) -> list[m.ErrorReport]:
        """Which of a worker's error reports the client sees (rule 1: abandoned work, repeats and copies not)."""
        rec = self.pipeline.recs.get(s.id)
        if rec is None:
            return reports
        kept = []
        reset = rec.reset_seq.get(w.id, 0)
        replayed = rec.replayed.get(w.id, {})
        for e in reports:
            if 0 < e.seq < reset:
                continue
            if e.kind in (m.ErrorKind.COPY, m.ErrorKind.STALE_COPY):  # a copy of ours failed: internal, never shown
                self.snapshots.copy_failed(rec, w, e)
                self.moves.copy_failed(s, w, e)
                continue
            k = replayed.get(e.seq)
            if k is not None and k <= rec.delivered:
                continue
            kept.append(e)
            if e.seq:
                rec.window_errors.append((w.id, e))
        return kept

    def session_status(self, ss: m.SessionStatus) -> m.SessionStatus:
        rec = self.pipeline.recs.get(ss.session)
        if rec is None:
            return ss
        snap = rec.snapshot if rec.enabled else None
        return msgspec.structs.replace(ss, snapshot_batch=-1 if snap is None else snap.upto,
                                       replay_batches=rec.batches_since_snapshot(),
                                       snapshot_bytes=0 if snap is None else snap.bytes,
                                       snapshot_copied_bytes=0 if snap is None else snap.copied,
                                       recoveries=rec.recoveries, migrations=rec.migrations)


def _devices(s: Session) -> set[int]:
    return {d for mesh in s.meshes.values() for d in mesh.devices}
