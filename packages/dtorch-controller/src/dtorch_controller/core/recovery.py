"""Fault tolerance in the core: snapshots, the instruction log, recovery after a worker loss. Sans-IO.

Rules:

1. Every accepted client batch is logged (lineage.py) and goes out through `dispatch`, strictly in
   order; nothing is sent while the session is *held* (recovering, or migrating a device). Held batches
   are accepted at once and sent when the hold ends; a Sync waits for them.
2. Snapshots ride in the workers' own streams: after client batch k, each worker hosting a logical
   device copies that device's live shards locally and to another worker's host memory
   (CmdSendShards), at exactly the point after k. No pause, no race with later in-place writes. A
   snapshot counts once every copying batch completed without error; then the log up to k and older
   copies are dropped. Uploads are copied the same way at the point of their InstrAdopt.
3. When a worker is lost, a session that used it is *recoverable* when it has a complete snapshot with a
   surviving copy of every device's shards and of every upload in its log. Its lost logical devices are
   rebound through the scheduler; then, in three phases:
   placing   wait until every logical device is bound to a live worker;
   resetting every worker of the session gets CmdAbandon (acts on arrival: abandons the old stream, ends
             its waits on the dead worker) and drops the session's known tensors; wait until all ran it;
   replaying each worker restores its devices' shards from the snapshot copies (CmdFetchShards, local
             when it has them), then the logged batches are translated again for the new binding and
             sent, uploads restored from their copies at the adopt's point; CmdRebuilt ends the phase.
   The client sees only a slower Sync: errors of the abandoned work are dropped (by worker Execute seq),
   errors of replayed batches the client already saw are not repeated.
4. A session that is not recoverable loses the lost devices' tensors: its next Sync raises an error
   naming them and the op that made each, it becomes `degraded`, and stops keeping lineage. Other
   sessions and the controller carry on.
5. A worker that only held copies takes the session's protection with it: a new snapshot is taken at
   once (a drain relies on this too).
6. Recovery may restart from the top at any phase (another loss): every phase can be done again.
7. Remote copies go to another node than the primary's (`Pool.backup_for`): losing a whole node leaves a
   copy of every device it hosted. Only a one-node cluster keeps both copies on one node.
8. A worker's report advances only the sessions that wait for it: each active session is filed under the
   (worker, Execute seq) pairs it waits on (copies, rebuild phases, a move's copy, a move's drop), and
   sessions waiting on something else (the scheduler placing devices, a snapshot that could not start yet)
   are looked at on every report; any other event (a loss) looks at them all. So a report costs
   O(sessions waiting on it), not O(sessions with copies), with thousands of sessions snapshotting.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from dtorch_controller.core import effects as fx
from dtorch_controller.core import state as st
from dtorch_controller.core.lineage import (
    Copies,
    Lineage,
    LoggedBatch,
    instr_tids,
    note_origins,
    shard_bytes,
    tensors_on,
)
from dtorch_controller.core.model import Session, Worker
from dtorch_controller.core.pool import node_of
from dtorch_controller.core.translate import Batch, translate
from dtorch_protocol import messages as m

if TYPE_CHECKING:
    from dtorch_controller.core.controller import ControllerCore

Effects = list[fx.Effect]


def _short(session_id: str) -> str:
    return session_id[:8]


class Active(set):
    """`Faults.active`: sessions with copies, a rebuild or a move in flight. `add` also marks the session to be
    looked at (and filed under what it waits for) by the next `advance` (rule 8): whoever starts something a
    session must wait for adds it here (elastic.py too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: set[str] = set()

    def add(self, sid: str) -> None:  # type: ignore[override]
        super().add(sid)
        self.fresh.add(sid)


@dataclass
class Rebuild:
    """A recovery in progress (rule 3)."""

    started: float
    reason: str
    lost: set[str] = field(default_factory=set)  # addresses of the lost workers (fenced on the others)
    gone: dict[str, Worker] = field(default_factory=dict)  # the lost workers' records (the core may forget them)
    phase: str = "placing"  # placing -> resetting -> replaying
    waits: dict[str, int] = field(default_factory=dict)  # worker -> Execute seq that must complete
    extra: set[str] = field(default_factory=set)  # workers that got session shards without hosting a device
    before: dict[int, str] = field(default_factory=dict)  # logical device -> worker when it started
    placed: bool = False  # lost devices were handed to the scheduler
    replayed: int = 0


class Faults:
    """The core's fault-tolerance component: it shares the core's tables and effects (single-threaded)."""

    def __init__(self, core: ControllerCore) -> None:
        from dtorch_controller.core.migration import Mover

        self.core = core
        self.now = 0.0  # the time of the event being handled (set by the core)
        self.recs: dict[str, Lineage] = {}
        self.rebuilds: dict[str, Rebuild] = {}
        self.holds: dict[str, set[str]] = {}  # session -> why its batches are held
        self.active = Active()  # sessions with copies, a rebuild or a move in flight
        self._wakes: dict[str, list[tuple[int, str]]] = {}  # worker -> heap of (Execute seq, session) waiting
        self._filed: set[tuple[str, int, str]] = set()  # (worker, seq, session) in `_wakes`
        self._poll: set[str] = set()  # active sessions waiting on no worker seq: looked at on every report
        self._walking_all = False  # `advance` is looking at every active session (not after a report)
        self.utilization: dict[str, float] = {}
        self.released: set[str] = set()  # sessions whose rebuild was given up in `losing`: unhold in `lost`
        self.mover = Mover(self)

    # ------------------------------------------------------------ small helpers

    @property
    def enabled(self) -> bool:
        return self.core.config.snapshot_every_batches > 0

    def rec(self, s: Session) -> Lineage:
        rec = self.recs.get(s.id)
        if rec is None:
            # the empty registry before batch 1 is a complete snapshot that needs no copies
            rec = self.recs[s.id] = Lineage(enabled=self.enabled,
                                            snapshot=Copies(namespace="", upto=0, tensors={}) if self.enabled
                                            else None, last_snapshot_at=self.now)
        return rec

    def alive(self, worker_id: str) -> bool:
        w = self.core.workers.get(worker_id)
        return w is not None and w.state != st.LOST

    def _send_raw(self, worker_id: str, session: str, cmds: list[m.Cmd], out: Effects) -> int:
        """One Execute under any session key (namespaces of copies), outside the session's own `sent`."""
        w = self.core.workers[worker_id]
        w.sent += 1
        out.append(fx.SendExecute(w.id, w.address, m.Execute(seq=w.sent, session=session, cmds=cmds)))
        return w.sent

    def send(self, s: Session, cmds: dict[str, list[m.Cmd]], out: Effects) -> dict[str, int]:
        """Send through the core (counted in the session's `sent`, so Syncs wait); worker -> Execute seq."""
        self.core._send(s, cmds, out)
        return {w: s.sent[w] for w, batch in cmds.items() if batch}

    def hold(self, s: Session, reason: str) -> None:
        self.holds.setdefault(s.id, set()).add(reason)

    def unhold(self, s: Session, reason: str, out: Effects) -> None:
        reasons = self.holds.get(s.id)
        if reasons is not None:
            reasons.discard(reason)
            if not reasons:
                del self.holds[s.id]
        self.pump(s, out)
        self.core._resolve_syncs(s, out)

    def holding(self, s: Session) -> bool:
        """Batches accepted but held back (a Sync must wait for them)."""
        return bool(self.holds.get(s.id))

    def backup_holder(self, primary: str) -> str | None:
        """Where the remote copies of `primary`'s devices go (rule 7): a live, placeable worker on another node,
        on its own node only when no other node has one. The pool answers in O(1) for nodes that registered
        contiguously; a core without a scheduler (test harnesses) scans."""
        pool = getattr(getattr(self.core, "sched", None), "pool", None)
        if pool is not None:
            return pool.backup_for(primary)
        ring = sorted((w for w in self.core.workers.values() if w.state in st.PLACEABLE or w.id == primary),
                      key=lambda w: w.order)
        ids = [w.id for w in ring]
        if primary not in ids:
            return next((i for i in ids), None)
        k = ids.index(primary)
        others = ids[k + 1:] + ids[:k]
        node = {w.id: node_of(w.address, w.labels) for w in ring}
        return next((o for o in others if node[o] != node[primary]), None) or next(iter(others), None)

    def address(self, worker_id: str) -> str:
        return self.core.workers[worker_id].address

    # ------------------------------------------------------------ batches: log, hold, dispatch

    def submitted(self, s: Session, seq: int, instrs: list[m.Instr]) -> None:
        """A client batch was accepted (before the scheduler decides whether it may go)."""
        self.rec(s).log.append(LoggedBatch(seq, instrs))

    def dispatch(self, s: Session, instrs: list[m.Instr], out: Effects) -> None:
        """The scheduler lets this batch go: send it, and every batch before it, in order (rule 1)."""
        rec = self.rec(s)
        b = next((b for b in rec.log if not b.sent and b.instrs is instrs), None)
        if b is None:  # not logged (a batch replayed by another component): send it as it is
            b = LoggedBatch(s.seq, instrs)
            rec.log.append(b)
        b.ready = True
        self.pump(s, out)

    def pump(self, s: Session, out: Effects) -> None:
        if s.id not in self.core.sessions:
            return
        rec = self.rec(s)
        if self.holding(s):
            return
        for b in rec.log:
            if b.sent:
                continue
            if not b.ready:
                break
            b.sent = True
            rec.sent_upto = b.seq
            self._send_batch(s, rec, b, out)
        if not rec.enabled:
            rec.log = [b for b in rec.log if not b.sent]
        self.maybe_snapshot(s, out)

    def _send_batch(self, s: Session, rec: Lineage, b: LoggedBatch, out: Effects) -> None:
        note_origins(rec.origin, b.instrs)  # for loss messages, with or without recovery (bounded: live tensors)
        cmds, adopts, errors = self._translate(s, rec, b, replay=False)
        s.errors.extend(errors)
        seqs = self.send(s, cmds, out)
        for copies in adopts:
            copies.pending = {w: seqs[w] for w in copies.pending}
            self.active.add(s.id)

    def _translate(self, s: Session, rec: Lineage, b: LoggedBatch, replay: bool,
                   ) -> tuple[dict[str, list[m.Cmd]], list[Copies], list[m.ErrorReport]]:
        """Translate a batch, cut at each InstrAdopt to copy the upload there (or restore it, replaying)."""
        instrs = b.instrs
        cmds: dict[str, list[m.Cmd]] = {}
        errors: list[m.ErrorReport] = []
        adopts: list[Copies] = []
        start = 0

        def run(segment: list[m.Instr]) -> None:
            if not segment:
                return
            batch: Batch = translate(s, segment, self.core.workers)
            errors.extend(batch.errors)
            s.deferred.extend(batch.deferred)
            for w, batch_cmds in batch.cmds.items():
                cmds.setdefault(w, []).extend(batch_cmds)

        for i, instr in enumerate(instrs):
            if not isinstance(instr, m.InstrAdopt):
                continue
            run(instrs[start:i + 1])
            start = i + 1
            if replay:
                self._restore_upload(s, rec, instr, cmds)
            elif instr.tid not in s.tensors:  # refused by translate: nothing to restore either
                rec.adopts[instr.tid] = Copies(namespace="", upto=b.seq, tensors={})
            elif rec.enabled:
                copies = self._copy_upload(s, rec, instr, b.seq, cmds)
                if copies is not None:
                    adopts.append(copies)
        run(instrs[start:])
        return cmds, adopts, errors

    def _copy_upload(self, s: Session, rec: Lineage, instr: m.InstrAdopt, seq: int, cmds: dict[str, list[m.Cmd]],
                     ) -> Copies | None:
        mesh = s.meshes.get(instr.spec.mesh)
        if mesh is None:
            return None
        namespace = f"{s.id}#a{rec.window}"
        copies = Copies(namespace=namespace, upto=seq, tensors={instr.tid: instr.spec}, started=self.now)
        by_worker: dict[str, list[int]] = {}
        for d in mesh.devices:
            by_worker.setdefault(s.devices[d], []).append(d)
        for primary, devices in by_worker.items():
            holder = self.backup_holder(primary)
            shards = {d: [instr.tid] for d in devices}
            cmds.setdefault(primary, []).append(m.CmdSendShards(devices=shards, namespace=namespace, host=True))
            holders = [primary]
            if holder is not None:
                cmds[primary].append(m.CmdSendShards(devices=shards, namespace=namespace, to=self.address(holder),
                                                     host=True))
                holders.append(holder)
            for d in devices:
                copies.holders[d] = holders
            copies.pending[primary] = 0  # the seq is known once sent
            for w in holders:
                rec.namespaces.setdefault(namespace, set()).add(w)
        rec.adopts[instr.tid] = copies
        return copies

    def _restore_upload(self, s: Session, rec: Lineage, instr: m.InstrAdopt, cmds: dict[str, list[m.Cmd]]) -> None:
        copies = rec.adopts.get(instr.tid)
        mesh = s.meshes.get(instr.spec.mesh)
        if copies is None or not copies.tensors or mesh is None:
            return
        for d in mesh.devices:
            target = s.devices[d]
            source = self._source(copies, d, target)
            if source is None:
                continue  # checked before the rebuild started; a read of it will say it is missing
            cmds.setdefault(target, []).append(m.CmdFetchShards(
                devices={d: [instr.tid]}, namespace=copies.namespace,
                address="" if source == target else self.address(source)))

    def _source(self, copies: Copies, device: int, target: str) -> str | None:
        holders = [w for w in copies.holders.get(device, []) if self.alive(w)]
        if target in holders:
            return target
        return holders[0] if holders else None

    # ------------------------------------------------------------ snapshots

    def maybe_snapshot(self, s: Session, out: Effects) -> None:
        rec = self.rec(s)
        cfg = self.core.config
        if not rec.enabled or rec.taking is not None or self.holding(s) or s.id in self.rebuilds \
                or s.state != st.OPEN:
            return
        since = rec.batches_since_snapshot()
        due = rec.force or rec.snapshot is None and (since or s.tensors) or since >= cfg.snapshot_every_batches \
            or since and self.now - rec.last_snapshot_at >= cfg.snapshot_every_s
        if due:
            self.take_snapshot(s, rec, out)

    def take_snapshot(self, s: Session, rec: Lineage, out: Effects) -> None:
        """Copy every live shard after the last sent batch (rule 2)."""
        upto = rec.sent_upto
        primaries = sorted({w for w in s.devices.values()}, key=lambda w: self.core.workers[w].order)
        holders = {p: self.backup_holder(p) for p in primaries}
        rec.force = False
        rec.last_snapshot_at = self.now
        if any(h is None for h in holders.values()) or not all(self.alive(p) for p in primaries):
            # nowhere to keep copies (a single worker): the session is not protected, the log is useless
            self._unprotect(s, rec, out)
            return
        rec.window += 1
        namespace = f"{s.id}#s{rec.window}"
        tensors = dict(s.tensors)
        # errors of the session come only from workers it sent to: one not among them sends errors of later work
        workers = set(s.sent) | set(s.devices.values())
        copies = Copies(namespace=namespace, upto=upto, tensors=tensors, started=self.now,
                        first_seq={w: self.core.workers[w].sent + 1 for w in workers if w in self.core.workers})
        cmds: dict[str, list[m.Cmd]] = {}
        for primary in primaries:
            devices = {d: tensors_on(tensors, s.meshes, d) for d, w in sorted(s.devices.items()) if w == primary}
            devices = {d: tids for d, tids in devices.items() if tids}
            for d in (d for d, w in s.devices.items() if w == primary):
                copies.holders[d] = [primary, holders[primary]]  # type: ignore[list-item]
            if not devices:
                continue
            holder = holders[primary]
            assert holder is not None
            cmds[primary] = [m.CmdSendShards(devices=devices, namespace=namespace, host=True),
                             m.CmdSendShards(devices=devices, namespace=namespace, to=self.address(holder), host=True)]
            copies.bytes += sum(shard_bytes(tensors[t], s.meshes[tensors[t].mesh], d)
                                for d, tids in devices.items() for t in tids)
            rec.namespaces.setdefault(namespace, set()).update((primary, holder))
        copies.pending = self.send(s, cmds, out)
        rec.taking = copies
        self.active.add(s.id)
        if not copies.pending:
            self._advance_copies(s, rec, out)

    def _unprotect(self, s: Session, rec: Lineage, out: Effects) -> None:
        if rec.snapshot is not None:
            self.core.log.add(self.now, f"session {_short(s.id)} is not protected against worker loss: "
                                        "no other worker to keep copies on")
        rec.snapshot = None
        rec.log = [b for b in rec.log if not b.sent]
        rec.adopts.clear()
        self._drop_namespaces(rec, set(rec.namespaces), out)

    def _drop_namespaces(self, rec: Lineage, namespaces: set[str], out: Effects) -> None:
        for ns in sorted(namespaces):
            for w in sorted(rec.namespaces.pop(ns, set())):
                if self.alive(w):
                    self._send_raw(w, ns, [m.CmdCloseSession()], out)

    def _advance_copies(self, s: Session, rec: Lineage, out: Effects) -> None:
        """Count completed copying batches; commit a complete snapshot."""
        for copies in [c for c in (rec.taking, *rec.adopts.values()) if c is not None]:
            for w, seq in list(copies.pending.items()):
                worker = self.core.workers.get(w)
                if worker is None or worker.state == st.LOST:
                    copies.failed = copies.failed or f"worker {w} was lost while copying"
                elif seq and worker.completed >= seq:
                    del copies.pending[w]
        taking = rec.taking
        if taking is not None and taking.failed:
            self.core.log.add(self.now, f"session {_short(s.id)} snapshot at batch {taking.upto} failed: "
                                        f"{taking.failed}")
            rec.taking = None
            self._drop_namespaces(rec, {taking.namespace}, out)
            rec.force = True
        elif taking is not None and taking.complete:
            self._commit(s, rec, taking, out)
        if any(c.failed for c in rec.adopts.values()):
            rec.force = True  # a snapshot after the adopt covers the upload
        if not self._busy(rec) and s.id not in self.rebuilds and not self.mover.busy(s.id) \
                and not (rec.force and rec.enabled):  # without lineage a forced snapshot never comes
            self.active.discard(s.id)

    @staticmethod
    def _busy(rec: Lineage) -> bool:
        return rec.taking is not None or any(c.pending for c in rec.adopts.values())

    def _commit(self, s: Session, rec: Lineage, snap: Copies, out: Effects) -> None:
        rec.snapshot, rec.taking = snap, None
        rec.log = [b for b in rec.log if b.seq > snap.upto]
        rec.adopts = {t: c for t, c in rec.adopts.items() if c.upto > snap.upto}
        keep = {snap.namespace} | {c.namespace for c in rec.adopts.values()}
        window = int(snap.namespace.rsplit("#s", 1)[1])
        old = {ns for ns in rec.namespaces if ns not in keep and _window(ns) < window}
        self._drop_namespaces(rec, old, out)
        rec.window_errors = [(w, e) for w, e in rec.window_errors if e.seq >= snap.first_seq.get(w, 0)]
        for w, seqs in rec.replayed.items():
            rec.replayed[w] = {q: k for q, k in seqs.items() if k > snap.upto}
        live = {tid for tid in s.tensors} | {t for b in rec.log for i in b.instrs for t in instr_tids(i)}
        rec.origin = {t: o for t, o in rec.origin.items() if t in live}
        if rec.force:
            self.maybe_snapshot(s, out)

    # ------------------------------------------------------------ errors and progress

    def errors(self, s: Session, w: Worker, reports: list[m.ErrorReport]) -> list[m.ErrorReport]:
        """Which of a worker's error reports the client sees (rule 3: abandoned work, repeats and copies not)."""
        rec = self.recs.get(s.id)
        if rec is None:
            return reports
        kept = []
        reset = rec.reset_seq.get(w.id, 0)
        replayed = rec.replayed.get(w.id, {})
        for e in reports:
            if 0 < e.seq < reset:
                continue
            if e.kind == m.ErrorKind.COPY:  # a copy of ours failed: internal, never surfaced
                self._copy_failed(s, rec, w, e)
                continue
            k = replayed.get(e.seq)
            if k is not None and k <= rec.delivered:
                continue
            kept.append(e)
            if e.seq:
                rec.window_errors.append((w.id, e))
        return kept

    def _copy_failed(self, s: Session, rec: Lineage, w: Worker, e: m.ErrorReport) -> None:
        for copies in (rec.taking, *rec.adopts.values()):
            if copies is not None and copies.pending.get(w.id) == e.seq:
                copies.failed = e.message
        self.mover.copy_failed(s, w, e)

    def delivered(self, s: Session) -> None:
        """A Sync was answered done: every error of the batches sent so far reached the client."""
        rec = self.recs.get(s.id)
        if rec is not None:
            rec.delivered = rec.sent_upto
            rec.window_errors.clear()

    def progress(self, now: float, w: Worker, msg: m.WorkerReport, out: Effects) -> None:
        """A worker reported: advance copies, rebuilds and moves that wait for it (rule 8)."""
        if msg.utilization >= 0:
            self.utilization[w.id] = msg.utilization
        self.advance(out, w)

    def advance(self, out: Effects, reporter: Worker | None = None) -> None:
        """Advance the active sessions: all of them, or after `reporter`'s report only those that may move on
        from it (rule 8)."""
        if reporter is None:
            sids = set(self.active)
        else:
            sids = self._due(reporter) | self._poll | self.active.fresh
        self._walking_all = reporter is None
        for sid in sorted(sids):
            s = self.core.sessions.get(sid)
            if s is None:
                self.active.discard(sid)
                continue
            if sid not in self.active:
                continue  # a stale wake-up
            rec = self.rec(s)
            self._advance_copies(s, rec, out)
            if sid in self.rebuilds:
                self._advance_rebuild(s, rec, out)
            self.mover.advance(s, out)
            if rec.force and rec.taking is None:
                self.maybe_snapshot(s, out)
        self._walking_all = False
        self.mover.advance_drains(out)
        for sid in sids | self.active.fresh:
            self._file(sid)

    def _due(self, w: Worker) -> set[str]:
        """Sessions filed under an Execute seq `w` has now completed."""
        heap = self._wakes.get(w.id)
        due: set[str] = set()
        while heap and heap[0][0] <= w.completed:
            seq, sid = heapq.heappop(heap)
            self._filed.discard((w.id, seq, sid))
            due.add(sid)
        if heap is not None and not heap:
            del self._wakes[w.id]
        return due

    def _file(self, sid: str) -> None:
        """File an active session under the (worker, seq) pairs it waits on, or in `_poll` (rule 8)."""
        self.active.fresh.discard(sid)
        s = self.core.sessions.get(sid)
        if s is None or sid not in self.active:
            self._poll.discard(sid)
            return
        waits = self._awaits(s)
        if not waits:  # None (waits on something else) or nothing left: look at it on every report
            self._poll.add(sid)
            return
        self._poll.discard(sid)
        for w, seq in waits:
            if (w, seq, sid) not in self._filed:
                self._filed.add((w, seq, sid))
                heapq.heappush(self._wakes.setdefault(w, []), (seq, sid))

    def _awaits(self, s: Session) -> list[tuple[str, int]] | None:
        """The (worker, Execute seq) pairs whose completion may let the session move on; None when it may move
        on without one (it must be looked at on every report)."""
        waits: list[tuple[str, int]] = []
        r = self.rebuilds.get(s.id)
        if r is not None:
            if r.phase == "placing":
                return None  # waits for the scheduler, or for a suspect worker to report
            waits += [(w, seq) for w, seq in r.waits.items() if self._waits_for(w, seq)]
            if not waits:
                return None
        rec = self.recs.get(s.id)
        if rec is not None:
            if rec.force and rec.enabled and rec.taking is None:
                return None  # a snapshot that could not start yet
            for copies in (rec.taking, *rec.adopts.values()):
                for w, seq in copies.pending.items() if copies is not None else ():
                    if not seq:
                        return None
                    waits.append((w, seq))
        more = self.mover.awaits(s.id)
        return None if more is None else waits + more

    def _waits_for(self, worker_id: str, seq: int) -> bool:
        w = self.core.workers.get(worker_id)
        return w is not None and w.state != st.LOST and w.completed < seq

    # ------------------------------------------------------------ worker loss

    def losing(self, w: Worker, reason: str) -> set[str]:
        """`w` was just declared lost (before the core reports lost data): returns the sessions that will be
        rebuilt instead (`lost` does it once the scheduler knows)."""
        taken: set[str] = set()
        for sid in sorted(self.core.sessions):
            s = self.core.sessions[sid]
            rec = self.recs.get(sid)
            bound = w.id in s.devices.values()
            uses = bound or self.mover.involves(sid, w.id)
            if not bound:  # what it sent there (a move's source) is not waited for; the core may forget `w`
                s.sent.pop(w.id, None)
            if rec is not None:
                held = False
                for copies in (rec.snapshot, rec.taking, *rec.adopts.values()):
                    if copies is None:
                        continue
                    for d, holders in copies.holders.items():
                        if w.id in holders:
                            held = True
                            copies.holders[d] = [h for h in holders if h != w.id]
                    if copies.pending.pop(w.id, None) is not None:
                        copies.failed = copies.failed or f"worker {w.id} was lost while copying"
                for ns in rec.namespaces.values():
                    ns.discard(w.id)
                if held:
                    rec.force = True
                    self.active.add(sid)
            if not uses:
                continue
            why = self.unrecoverable(s)
            r = self.rebuilds.get(sid)
            if why is None:
                taken.add(sid)
                self.rebuilds.setdefault(sid, Rebuild(started=self.now, reason=f"worker {w.id} lost: {reason}"))
            elif r is not None:
                taken.add(sid)  # an earlier loss is pending in the rebuild: this reports both
                self._give_up(s, rec or self.rec(s), why)
            else:
                self._disable(s, why)  # the core reports the lost devices' tensors
            self.mover.worker_lost(s, w, taken=sid in taken)
        self.mover.drain_worker_lost(w)
        return taken

    def lost(self, w: Worker, taken: set[str], out: Effects) -> None:
        """After the core and the scheduler took `w` out: start (or restart) the rebuilds of `taken`."""
        for sid in sorted(self.released):  # rebuilds given up: their held batches go on (and fail)
            s = self.core.sessions.get(sid)
            if s is not None:
                for reason in list(self.holds.get(sid, ())):
                    self.unhold(s, reason, out)
        self.released.clear()
        for sid in sorted(taken):
            s = self.core.sessions.get(sid)
            if s is not None:
                self._start_rebuild(s, w, out)
        for _seq, sid in self._wakes.pop(w.id, []):
            self._filed.discard((w.id, _seq, sid))
        self.advance(out)

    def unrecoverable(self, s: Session) -> str | None:
        """Why the session cannot be rebuilt after a loss, or None (rule 3)."""
        rec = self.rec(s)
        if not rec.enabled:
            return "recovery is off (--snapshot-batches 0)" if not self.enabled else rec.why or "recovery is off"
        snap = rec.snapshot
        if snap is None:
            return "no complete snapshot of its tensors (copies need a second worker)"
        if not any(w.state in st.PLACEABLE for w in self.core.workers.values()):
            return "no live worker left to rebuild it on"
        for d in sorted(self._devices(s)):  # bound or not (a rebuild may be waiting to place some)
            if tensors_on(snap.tensors, s.meshes, d) and not any(self.alive(h) for h in snap.holders.get(d, [])):
                return f"every copy of logical device {d}'s shards was on lost workers"
        for b in rec.sent_batches():
            for instr in b.instrs:
                if isinstance(instr, m.InstrAdopt):
                    copies = rec.adopts.get(instr.tid)
                    if copies is None or copies.failed or copies.pending:
                        return f"the upload of tensor {instr.tid} (batch {b.seq}) has no complete copy"
                    if not copies.tensors:
                        continue  # refused: nothing to restore
                    mesh = s.meshes.get(instr.spec.mesh)
                    for d in mesh.devices if mesh else ():
                        if not any(self.alive(h) for h in copies.holders.get(d, [])):
                            return f"every copy of the upload of tensor {instr.tid} was on lost workers"
        return None

    def _disable(self, s: Session, why: str) -> None:
        rec = self.rec(s)
        if rec.enabled:
            self.core.log.add(self.now, f"session {_short(s.id)} cannot be rebuilt: {why}")
        rec.enabled = False
        rec.why = why
        rec.snapshot = None
        rec.taking = None
        rec.log = [b for b in rec.log if not b.sent]
        rec.adopts.clear()
        if self.rebuilds.pop(s.id, None) is not None or self.holds.get(s.id):
            self.released.add(s.id)
        # copies are dropped when the session closes (their workers may be the lost ones)

    def lost_detail(self, s: Session, tids: list[int]) -> str:
        """'tensor 7 (aten.mm.default at train.py:12), ...' for the loss message; why it was not rebuilt."""
        rec = self.recs.get(s.id)
        origin = rec.origin if rec is not None else {}
        parts = []
        for tid in tids[:6]:
            op, src = origin.get(tid, ("", ""))
            parts.append(f"tensor {tid}" + (f" (made by {op}{' at ' + src if src else ''})" if op else ""))
        more = f" and {len(tids) - 6} more" if len(tids) > 6 else ""
        why = rec.why if rec is not None else ""
        return ", ".join(parts) + more + (f"; not rebuilt: {why}" if why else "")

    # ------------------------------------------------------------ rebuilding

    def _start_rebuild(self, s: Session, lost: Worker, out: Effects) -> None:
        rec = self.rec(s)
        r = self.rebuilds.get(s.id)
        if r is None:
            return
        first = r.phase == "placing" and not r.waits and not r.lost
        if first:
            r.before = dict(s.devices)
        r.lost.add(lost.address)
        r.gone[lost.id] = lost
        r.phase = "placing"
        r.placed = False
        r.waits.clear()
        if s.state != st.RECOVERING:
            s.state = st.step(st.SESSION_TABLE, s.state, st.RECOVER)
        self.hold(s, "recovering")
        if rec.taking is not None:
            self._drop_namespaces(rec, {rec.taking.namespace}, out)
            rec.taking = None
        r.extra |= self.mover.abort(s, f"worker {lost.id} was lost", out)
        for wid in [w for w in s.sent if not self.alive(w)]:
            del s.sent[wid]
        if first:
            self.core.log.add(self.now, f"session {_short(s.id)} recovering from {r.reason}: rewinding to "
                                        f"batch {rec.snapshot.upto if rec.snapshot else 0}, replaying "
                                        f"{rec.batches_since_snapshot()} batches")
        self.active.add(s.id)

    def _unbind(self, s: Session, device: int, worker_id: str) -> None:
        w = self.core.workers[worker_id]
        del s.devices[device]
        s.comm.bump()  # the device moves (rebuild, migration, relocation, growth, drain): new process groups
        w.bound -= 1
        if worker_id not in s.devices.values():
            w.sessions.discard(s.id)

    def place(self, s: Session, devices: list[int], out: Effects) -> None:
        """Bind `devices` again through the scheduler (it may have to queue them)."""
        mesh = next((mesh for mesh in s.meshes.values() if devices[0] in mesh.coord), None)
        sched = getattr(self.core, "sched", None)
        if sched is None or mesh is None:
            return
        changes, _answer = sched.place(self.now, s.id, mesh.id, tuple(devices), restore=True)
        self.core._apply(self.now, changes, out)

    def _devices(self, s: Session) -> set[int]:
        return {d for mesh in s.meshes.values() for d in mesh.devices}

    def _advance_rebuild(self, s: Session, rec: Lineage, out: Effects) -> None:
        r = self.rebuilds[s.id]
        if any(self.core.workers[w].completed < seq for w, seq in r.waits.items() if self.alive(w)):
            return
        if r.phase == "placing":
            if r.placed and not self._walking_all and self._devices(s) - set(s.devices):
                return  # still waiting for the scheduler (copies only go with a loss, which looks at all)
            why = self.unrecoverable(s)
            if why is not None:
                return self._give_up(s, rec, why, out)
            if not r.placed:
                if self._needs_a_suspect(s, rec):
                    return  # a copy it needs is only on a silent worker: wait until it reports or is lost
                devices = []
                for d, wid in sorted(s.devices.items()):
                    if not self.alive(wid):
                        self._unbind(s, d, wid)
                        devices.append(d)
                r.placed = True
                if devices:
                    self.place(s, devices, out)
            if self._devices(s) - set(s.devices):
                return  # the scheduler has not bound them yet
            self._reset(s, rec, r, out)
        elif r.phase == "resetting":
            why = self.unrecoverable(s)
            if why is not None:
                return self._give_up(s, rec, why, out)
            self._replay(s, rec, r, out)
        elif r.phase == "replaying":
            self._finish(s, rec, r, out)

    def _known_tids(self, s: Session, rec: Lineage) -> list[int]:
        tids = set(s.tensors) | set(s.readers) | {dd.tid for dd in s.deferred}
        if rec.snapshot is not None:
            tids |= set(rec.snapshot.tensors)
        for b in rec.sent_batches():
            for instr in b.instrs:
                tids |= instr_tids(instr)
        return sorted(tids)

    def _reset(self, s: Session, rec: Lineage, r: Rebuild, out: Effects) -> None:
        workers = sorted({w for w in s.devices.values()} | {w for w in r.extra if self.alive(w)},
                         key=lambda w: self.core.workers[w].order)
        cmd = m.CmdAbandon(tids=self._known_tids(s, rec), lost=sorted(r.lost))
        r.waits = self.send(s, {w: [cmd] for w in workers}, out)
        rec.reset_seq.update(r.waits)
        rec.replayed.clear()
        # errors of work after the snapshot are redone by the replay (or were caused by the loss)
        first = rec.snapshot.first_seq if rec.snapshot is not None else {}
        drop = [e for w, e in rec.window_errors if e.seq >= first.get(w, 0)]
        s.errors = [e for e in s.errors if not any(e is d for d in drop)]
        rec.window_errors = [(w, e) for w, e in rec.window_errors if not any(e is d for d in drop)]
        r.phase = "resetting"

    def _replay(self, s: Session, rec: Lineage, r: Rebuild, out: Effects) -> None:
        snap = rec.snapshot
        assert snap is not None
        s.tensors = dict(snap.tensors)
        s.readers.clear()
        s.deferred.clear()
        restore: dict[str, list[m.Cmd]] = {}
        for d in sorted(s.devices):
            tids = tensors_on(snap.tensors, s.meshes, d)
            if not tids:
                continue
            target = s.devices[d]
            source = self._source(snap, d, target)
            assert source is not None  # checked by unrecoverable()
            restore.setdefault(target, []).append(m.CmdFetchShards(
                devices={d: tids}, namespace=snap.namespace, address="" if source == target else self.address(source)))
        workers = set(r.waits)
        last = dict(self.send(s, restore, out))
        batches = list(rec.sent_batches())
        for b in batches:
            cmds, _adopts, _errors = self._translate(s, rec, b, replay=True)  # errors were reported before
            seqs = self.send(s, cmds, out)
            for w, seq in seqs.items():
                rec.replayed.setdefault(w, {})[seq] = b.seq
            last.update(seqs)
        done = self.send(s, {w: [m.CmdRebuilt()] for w in sorted(workers | set(s.devices.values()))
                             if self.alive(w)}, out)
        last.update(done)
        r.waits = last
        r.replayed = len(batches)
        r.phase = "replaying"

    def _finish(self, s: Session, rec: Lineage, r: Rebuild, out: Effects) -> None:
        del self.rebuilds[s.id]
        rec.recoveries += 1
        rec.force = True  # copies on the new workers
        s.state = st.step(st.SESSION_TABLE, s.state, st.RECOVERED)
        moved = ", ".join(f"{d}->{w}" for d, w in sorted(s.devices.items()) if r.before.get(d) != w)
        self.core.log.add(self.now, f"session {_short(s.id)} recovered in {self.now - r.started:.3f}s "
                                    f"(devices {moved or 'unchanged'}, {r.replayed} batches replayed)")
        self.unhold(s, "recovering", out)
        self.mover.start_next(s, out)

    def _needs_a_suspect(self, s: Session, rec: Lineage) -> bool:
        """Is some copy the rebuild needs only on workers that went silent (suspect), not on a live one?"""
        ok = (st.ALIVE, st.DRAINING)
        needed = []
        if rec.snapshot is not None:
            needed += [rec.snapshot.holders.get(d, []) for d in self._devices(s)
                       if tensors_on(rec.snapshot.tensors, s.meshes, d)]
        for b in rec.sent_batches():
            for instr in b.instrs:
                copies = rec.adopts.get(instr.tid) if isinstance(instr, m.InstrAdopt) else None
                if copies is not None and copies.tensors:
                    needed += list(copies.holders.values())
        return any(not any(self.core.workers[h].state in ok for h in holders if self.alive(h)) for holders in needed)

    def _give_up(self, s: Session, rec: Lineage, why: str, out: Effects | None = None) -> None:
        """The copies a rebuild needs are gone too: report what is lost (rule 4) and let the batches go on.

        Logical devices stay (or go back) on their lost workers, so later instructions on them fail at once.
        """
        r = self.rebuilds.pop(s.id, None)
        self._disable(s, why)
        self.released.add(s.id)
        if r is not None:
            for d, wid in sorted(r.before.items()):
                if not self.alive(wid) and s.devices.get(d) != wid:
                    if wid not in self.core.workers:  # forgotten meanwhile (nothing was bound to it): recall it
                        if wid not in r.gone:
                            continue
                        self.core.workers[wid] = r.gone[wid]
                    if d in s.devices:
                        self._unbind(s, d, s.devices[d])
                    self.core._bind(s, d, wid)
        if r is not None and r.phase != "placing":  # the session's workers dropped its shards already
            lost = sorted(s.tensors)
        else:
            gone = {mesh.id for mesh in s.meshes.values() if any(not self.alive(s.devices[d]) for d in mesh.devices
                                                                 if d in s.devices)}
            lost = sorted(tid for tid, spec in s.tensors.items() if spec.mesh in gone)
        if lost:
            s.errors.append(m.ErrorReport(
                op="worker lost", src="", tid=lost[0], kind=m.ErrorKind.WORKER_LOST,
                message=f"{r.reason if r else 'a worker was lost'}; {len(lost)} tensors lost: "
                        f"{self.lost_detail(s, lost)}"))
        s.state = st.step(st.SESSION_TABLE, s.state, st.WORKER_LOST)
        self.core.log.add(self.now, f"session {_short(s.id)} lost data: {why}")
        if out is not None:
            for reason in list(self.holds.get(s.id, ())):
                self.unhold(s, reason, out)
            self.released.discard(s.id)

    # ------------------------------------------------------------ sessions closing, timers, status

    def closed(self, s: Session, out: Effects) -> None:
        rec = self.recs.pop(s.id, None)
        if rec is not None:
            self._drop_namespaces(rec, set(rec.namespaces), out)
        self.rebuilds.pop(s.id, None)
        self.holds.pop(s.id, None)
        self.active.discard(s.id)
        self.active.fresh.discard(s.id)
        self._poll.discard(s.id)
        self.mover.closed(s, out)

    def timer(self, key: Any, out: Effects) -> bool:
        """Timers of this component; False when `key` is not one of them."""
        if isinstance(key, tuple) and key and key[0] == "faults":
            self.mover.timer(key, out)
            return True
        return False

    def worker_status(self, workers: list[m.WorkerStatus]) -> list[m.WorkerStatus]:
        out = []
        for ws in workers:
            w = self.core.workers.get(ws.worker)
            stats = w.stats if w is not None else {}
            copies = [v for k, v in stats.items() if "#" in k]  # namespaces derived from a session: its copies
            out.append(msgspec.structs.replace(
                ws, utilization=self.utilization.get(ws.worker, -1.0), backup_bytes=sum(v.bytes for v in copies),
                tensors=ws.tensors - sum(v.tensors for v in copies), bytes=ws.bytes - sum(v.bytes for v in copies)))
        return out

    def session_status(self, sessions: list[m.SessionStatus]) -> list[m.SessionStatus]:
        out = []
        for ss in sessions:
            rec = self.recs.get(ss.session)
            if rec is None:
                out.append(ss)
                continue
            snap = rec.snapshot.upto if rec.snapshot is not None and rec.enabled else -1
            out.append(msgspec.structs.replace(ss, snapshot_batch=snap, replay_batches=rec.batches_since_snapshot(),
                                               recoveries=rec.recoveries, migrations=rec.migrations))
        return out


def _window(namespace: str) -> int:
    try:
        return int(namespace.rsplit("#", 1)[1][1:])
    except (IndexError, ValueError):
        return -1


def reply(out: Effects, request_id: Hashable, message: Any) -> None:
    out.append(fx.Reply(request_id, message))
