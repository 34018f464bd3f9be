"""Snapshots: consistent copies of a session's shards, taken in the workers' own streams. Sans-IO.

Rules:

1. A snapshot rides in the workers' streams: after client batch k, each worker hosting a logical device copies
   that device's live shards locally and to another worker's host memory (CmdSendShards), at exactly the point
   after k. No pause, no race with later in-place writes.
2. It is due after `snapshot_every_batches` batches or `snapshot_every_s` seconds (checked when batches go out, and
   at a KeepAlive of a session whose client keeps uploads for one: rule 7), and at once when `force`d (copies were
   lost, a drain or a move changed where they must be). None is taken while one is being made, while a hold forbids
   it (`state.HOLDS`), or while the session is not open.
3. It counts once every copying batch completed without error; then the log up to k and older copies are dropped
   (lineage.py rule 4). A failed copy (a report of kind COPY) makes it fail: its copies are dropped and a new one
   is forced. Uploads' copies (made at their adopt, pipeline.py) count the same way, except that a failed copy to
   the backup worker (`ErrorReport.peer`: it may have been lost) leaves the primary's own copy, and forces a
   snapshot to protect the upload again.
4. Remote copies go to another node than the primary's (`Pool.backup_for`): losing a whole node leaves a copy of
   every device it hosted. With no other worker to keep copies on, the session is not protected: its log and
   copies are dropped.
5. A routine snapshot keeps the previous one's copies of tensors nothing wrote since, and the copies of uploads
   nothing wrote after their adopt (lineage.py rule 5): both holders file them under the new namespace
   (CmdKeepCopies), in their streams before the old namespaces' drop, which follows the new snapshot's commit.
6. What the controller cannot see, the worker holding the tensors checks (`CmdKeepCopies.check`): memory written
   through another tensor (a view), or shared with a tensor this snapshot copies (its fresh copy would not alias
   the kept one). It then fails the keep (STALE_COPY, naming the tensor): the snapshot fails like any failed copy
   and is retaken whole, and that tensor is copied from then on (`Lineage.unkeepable`): a group of tensors sharing
   memory ends up copied together, as a snapshot without keeping copies it.
7. An upload whose copies are complete, both of them (a failed copy to the backup leaves one), is told to the client
   as safe (`Session.safe`, in the answer to its next Submit or KeepAlive): it need not keep the upload any longer
   (recovery.py rule 7). Not one a rebuild asked for again (`Session.reput`, then `Session.asked`): the client may
   still be putting it, and its copies may lack the lost worker's devices. The client keeps those past its Syncs
   (`SyncReply.keep`) until a snapshot that began after their adopts went out is committed (`Copies.covers`: its
   copies follow the adopt in each worker's stream); then they are safe.
"""

from __future__ import annotations

from dtorch_controller.core import state as st
from dtorch_controller.core.config import Config
from dtorch_controller.core.lineage import Copies, Lineage, instr_tids, shard_bytes, tensors_on, written
from dtorch_controller.core.model import Cluster, Session, Worker
from dtorch_controller.core.pipeline import Cmds, Pipeline
from dtorch_controller.core.pool import Pool
from dtorch_controller.core.step import Step
from dtorch_protocol import messages as m


class Snapshots:
    def __init__(self, config: Config, cluster: Cluster, pool: Pool, pipeline: Pipeline) -> None:
        self.config = config
        self.cluster = cluster
        self.pool = pool
        self.pipeline = pipeline

    def busy(self, s: Session, rec: Lineage) -> bool:
        """Copies being made (a snapshot, uploads), or a snapshot wanted that could start now. One that cannot (the
        session is not open, or held) waits for nothing a report brings: what ends the hold looks at the session."""
        return rec.taking is not None or bool(rec.adopts) and any(c.pending for c in rec.adopts.values()) \
            or (rec.force and rec.enabled and self._can_start(s))

    def _can_start(self, s: Session) -> bool:
        return s.state == st.OPEN and all(st.HOLDS[h].snapshots for h in self.pipeline.holding(s))

    # ------------------------------------------------------------ taking (rules 1, 2, 4)

    def maybe(self, step: Step, s: Session) -> None:
        """Take a snapshot if one is due (rule 2)."""
        rec = self.pipeline.rec(s, step.now)
        cfg = self.config
        if not rec.enabled or rec.taking is not None or not self._can_start(s):
            return
        since = rec.batches_since_snapshot()
        due = rec.force or rec.snapshot is None and (since or s.tensors) or since >= cfg.snapshot_every_batches \
            or since and step.now - rec.last_snapshot_at >= cfg.snapshot_every_s
        if due:
            self.take(step, s, rec)

    def take(self, step: Step, s: Session, rec: Lineage) -> None:
        """Copy every live shard after the last sent batch (rule 1), but those the previous snapshot holds
        unchanged (lineage.py rule 5)."""
        upto = rec.sent_upto
        primaries = self.cluster.order(set(s.devices.values()))
        holders = {p: self.pool.backup_for(p) for p in primaries}
        keeping = not rec.force
        rec.force = False
        rec.last_snapshot_at = step.now
        if any(h is None for h in holders.values()) or not all(self.cluster.alive(p) for p in primaries):
            self._unprotect(step, s, rec)  # nowhere to keep copies (a single worker): the log is useless
            return
        rec.window += 1
        namespace = f"{s.id}#s{rec.window}"
        tensors = dict(s.tensors)
        prev = rec.snapshot if keeping else None
        logged = [b for b in rec.log if b.seq <= upto]
        dirty = None if prev is None else written(logged)
        touched = written(logged, adopts=False) if keeping and rec.adopts else None  # an adopt is no later write

        def kept_from(d: int, t: int, pair: list[str]) -> str:
            """The namespace whose copies of `t` on device `d` this snapshot keeps, or "": copy it (lineage.py
            rule 5)."""
            if t in rec.unkeepable:
                return ""
            if prev is not None and dirty is not None and t not in dirty and prev.holders.get(d) == pair \
                    and prev.tensors.get(t) == tensors[t]:
                return prev.namespace
            up = rec.adopts.get(t)
            if up is not None and up.complete and touched is not None and t not in touched \
                    and up.holders.get(d) == pair and up.tensors.get(t) == tensors[t]:
                return up.namespace
            return ""

        # errors of the session come only from workers it sent to: one not among them sends errors of later work
        workers = set(s.sent) | set(s.devices.values())
        copies = Copies(namespace=namespace, upto=upto, tensors=tensors, started=step.now,
                        first_seq={w: self.cluster.workers[w].sent + 1 for w in workers
                                   if w in self.cluster.workers}, covers=s.asked | set(s.reput))
        hosted: dict[str, list[int]] = {}
        for d, w in sorted(s.devices.items()):
            hosted.setdefault(w, []).append(d)
        cmds: Cmds = {}
        for primary in primaries:
            holder = holders[primary]
            assert holder is not None
            devices = {d: tensors_on(tensors, s.meshes, d) for d in hosted[primary]}
            copy: dict[int, list[int]] = {}
            keep: dict[str, dict[int, list[int]]] = {}  # source namespace -> device -> tids
            for d, tids in devices.items():
                copies.holders[d] = [primary, holder]
                for t in tids:
                    source = kept_from(d, t, [primary, holder])
                    (keep.setdefault(source, {}) if source else copy).setdefault(d, []).append(t)
                    n = shard_bytes(tensors[t], s.meshes[tensors[t].mesh], d)
                    copies.bytes += n
                    copies.copied += 0 if source else n
            if copy:
                cmds.setdefault(primary, []).extend([
                    m.CmdSendShards(devices=copy, namespace=namespace, host=True),
                    m.CmdSendShards(devices=copy, namespace=namespace, to=self.cluster.address(holder), host=True)])
            for source, kept in sorted(keep.items()):  # the primary checks its tensors are as copied (rule 6)
                for w in (primary, holder):
                    cmds.setdefault(w, []).append(m.CmdKeepCopies(devices=kept, source=source, namespace=namespace,
                                                                  check=w == primary))
            if copy or keep:
                rec.namespaces.setdefault(namespace, set()).update((primary, holder))
        copies.pending = self.pipeline.send(step, s, cmds)
        rec.taking = copies
        if not copies.pending:
            self.advance(step, s, rec)

    def _unprotect(self, step: Step, s: Session, rec: Lineage) -> None:
        if rec.snapshot is not None:
            step.note(f"session {s.id[:8]} is not protected against worker loss: no other worker to keep copies on")
        rec.snapshot = None
        rec.log = [b for b in rec.log if not b.sent]
        rec.adopts.clear()
        s.asked.clear()  # no snapshot will cover them: no rebuild will ask for them either (rule 7)
        self.drop(step, rec, set(rec.namespaces))

    def drop(self, step: Step, rec: Lineage, namespaces: set[str]) -> None:
        """Drop copies: every live worker holding some of a namespace forgets it."""
        for ns in sorted(namespaces):
            for w in sorted(rec.namespaces.pop(ns, set())):
                if self.cluster.alive(w):
                    self.pipeline.send_raw(step, w, ns, [m.CmdCloseSession()])

    # ------------------------------------------------------------ counting copies (rule 3)

    def advance(self, step: Step, s: Session, rec: Lineage) -> None:
        """Count completed copying batches; commit a complete snapshot."""
        if rec.taking is None and not rec.adopts:
            return  # no copies in flight (most sessions, most of the time)
        for tid, copies in [(None, rec.taking), *rec.adopts.items()]:
            if copies is None or not copies.pending:
                continue
            for w, seq in list(copies.pending.items()):
                if not self.cluster.alive(w):
                    copies.failed = copies.failed or f"worker {w} was lost while copying"
                elif seq and self.cluster.workers[w].completed >= seq:
                    del copies.pending[w]
            if tid is not None and copies.complete and self._safe(s, tid, copies):
                s.safe.append(tid)
        taking = rec.taking
        if taking is not None and taking.failed:
            step.note(f"session {s.id[:8]} snapshot at batch {taking.upto} failed: {taking.failed}")
            rec.taking = None
            self.drop(step, rec, {taking.namespace})
            rec.force = True
        elif taking is not None and taking.complete:
            self._commit(step, s, rec, taking)
        if any(c.failed for c in rec.adopts.values()):
            rec.force = True  # a snapshot after the adopt covers the upload

    @staticmethod
    def _safe(s: Session, tid: int, copies: Copies) -> bool:
        """Rule 7: may the client let go of this upload, now that its copies are complete?"""
        return not copies.unmade and tid not in s.reput and tid not in s.asked \
            and all(len(holders) > 1 for holders in copies.holders.values())

    def _commit(self, step: Step, s: Session, rec: Lineage, snap: Copies) -> None:
        rec.snapshot, rec.taking = snap, None
        if covered := snap.covers & s.asked:  # rule 7: what was asked for again is in the snapshot
            s.safe.extend(sorted(covered))
            s.asked -= covered
        rec.log = [b for b in rec.log if b.seq > snap.upto]
        rec.adopts = {t: c for t, c in rec.adopts.items() if c.upto > snap.upto}
        keep = {snap.namespace} | {c.namespace for c in rec.adopts.values()}
        window = int(snap.namespace.rsplit("#s", 1)[1])
        old = {ns for ns in rec.namespaces if ns not in keep and _window(ns) < window}
        self.drop(step, rec, old)
        rec.window_errors = [(w, e) for w, e in rec.window_errors if e.seq >= snap.first_seq.get(w, 0)]
        for w, seqs in rec.replayed.items():
            rec.replayed[w] = {q: k for q, k in seqs.items() if k > snap.upto}
        live = set(s.tensors) | {t for b in rec.log for i in b.instrs for t in instr_tids(i)}
        rec.origin = {t: o for t, o in rec.origin.items() if t in live}
        if rec.force:
            self.maybe(step, s)

    def copy_failed(self, rec: Lineage, w: Worker, e: m.ErrorReport) -> None:
        """A copy of this worker's failed (kind COPY): the copies it made are no good, except that an upload's copy
        to another worker (`e.peer`) leaves the one it made of its own devices, and a snapshot is forced.
        STALE_COPY (rule 6): the copy of tensor `e.tid` could not be kept: it is copied from now on."""
        if e.kind == m.ErrorKind.STALE_COPY:
            rec.unkeepable.add(e.tid)
        for copies in (rec.taking, *rec.adopts.values()):
            if copies is None or copies.pending.get(w.id) != e.seq:
                continue
            if e.peer and copies is not rec.taking:
                for d, holders in copies.holders.items():
                    if holders[:1] == [w.id]:
                        copies.holders[d] = [w.id]
                rec.force = True
            else:
                copies.failed = e.message

    # ------------------------------------------------------------ what waits

    def awaits(self, s: Session, rec: Lineage) -> list[tuple[str, int]] | None:
        """(worker, Execute seq) pairs the copies wait on; None when a forced snapshot that could start did not yet
        (look at the session on every report). One that cannot start (`busy`) waits on nothing here: a session
        being rebuilt was looked at on every report of every worker, O(workers^2) a heartbeat round."""
        if rec.force and rec.enabled and rec.taking is None and self._can_start(s):
            return None
        waits: list[tuple[str, int]] = []
        for copies in (rec.taking, *rec.adopts.values()):
            for w, seq in copies.pending.items() if copies is not None else ():
                if not seq:
                    return None
                waits.append((w, seq))
        return waits


def _window(namespace: str) -> int:
    try:
        return int(namespace.rsplit("#", 1)[1][1:])
    except (IndexError, ValueError):
        return -1
