"""The command path: from an accepted client batch to Execute batches on the workers. Sans-IO.

Rules:

1. Every accepted client batch is logged (lineage.py) and goes out strictly in order, translated for the session's
   binding at the moment it goes out (translate.py). Nothing goes out while something holds the session
   (`state.Hold`: frozen by the scheduler, recovering, migrating): held batches are accepted at once and go out,
   in order, when the last hold ends. The log is the frozen backlog too: there is no other list of held batches.
2. Only this module numbers Execute batches: each worker's seqs are contiguous from 1 across sessions. `send`
   counts them in the session's `sent` (its Syncs wait for them); `send_raw` sends under another namespace (copies
   kept for recovery). Every Execute carries the session's memory cap.
3. An upload (InstrAdopt) is copied at its point in the stream (lineage.py rule 3): the batch is cut after the
   adopt; translating for a replay restores the upload from its copies there instead. Going out on a device a loss
   rebound (`Session.rebound`), it is also asked of the client again (recovery.py rule 7); a worker that has it
   already, or used and deleted it, refuses that Put (the worker's store.py).
4. `translate` does not send: a feature may translate a program again (a rebuild replays its log on a new binding)
   and send it with `send`, or leave it. `_send_batch` is the one place where a logged batch becomes commands.
   A captured program (issue #12, `programs.py`) is kept at `accept`; its replays stay in the log as they came
   (with the definition they named). Going out, a replay is one CmdReplay per worker of its program compiled for
   the session's binding (`compiled`; the workers keep the commands, CmdProgram; translated and compiled again
   when the binding or the tensors it reads changed); a rebuild translates the instructions it stands for.
5. A Sync is answered done when no live worker the session sent to is behind and no hold makes it wait
   (`state.HOLDS`: a frozen session's only while batches are held; recovering and migrating always). Uploads a
   rebuild asks the client for (recovery.py rule 7) are the answer, not done, of its parked Syncs.
6. A delete of a tensor that remote readers (redistributions on other workers) still have to read is held back
   until those readers completed (or were lost).
7. Dispatch window (`Config.dispatch_ahead` = k > 0): a session has at most k Execute batches sent and not completed
   on any one worker. The next batch waits in the log until that worker reports a completion (`unblock`, from the
   controller's settle pass, or the worker's loss or its release after a drain), and a Sync waits for it as for a
   held one. Batches already sent run even when the session is frozen (rule 1 holds only what was not sent), so
   this bounds how long a freeze takes to free its devices, and how long a move or a rebuild queued behind them
   waits: k batches, not everything the client sent since its last sync point. 0 (the core's default): no bound;
   `dtorch-controller` runs with 1 unless told otherwise (its --dispatch-ahead), and so does the simulator.
8. Pace: each session's batches going out are timed (`pace`: when the last went out, and a moving average of the
   gaps between them). `busy_for` says when its last batch should be done: the scheduler freezes first the
   session that frees its devices soonest (scheduler.py rule 6). Unknown (one batch so far): infinity.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

from dtorch_controller.core import effects as fx
from dtorch_controller.core import programs
from dtorch_controller.core import state as st
from dtorch_controller.core.lineage import (
    Copies,
    Lineage,
    LoggedBatch,
    copy_upload,
    note_instrs,
    restore_upload,
)
from dtorch_controller.core.model import Cluster, Session, Worker
from dtorch_controller.core.pool import Pool
from dtorch_controller.core.step import Step
from dtorch_controller.core.translate import Batch, translate
from dtorch_protocol import messages as m

Cmds = dict[str, list[m.Cmd]]  # worker id -> commands, in order
_PACE_WEIGHT = 0.25  # weight of the latest gap between a session's batches in its pace (`busy_for`)
_SYNC_WAITS = frozenset(h for h, rule in st.HOLDS.items() if rule.sync_waits)  # holds a Sync waits for (rule 5)


class Pipeline:
    def __init__(self, cluster: Cluster, pool: Pool, recovery: bool, ahead: int = 0) -> None:
        self.cluster = cluster
        self.pool = pool
        self.recovery = recovery  # sessions keep lineage (snapshots and their log) to be rebuilt after a loss
        self.ahead = ahead  # rule 7: batches of a session sent and not completed per worker (0: no bound)
        self.in_flight: dict[str, dict[str, deque[int]]] = {}  # session -> worker -> its seqs sent there (rule 7)
        self.windowed: dict[str, set[str]] = {}  # worker -> sessions whose next batch waits for its completion
        self.recs: dict[str, Lineage] = {}  # session -> its log and copies (read them here, change them in place)
        self.pace: dict[str, tuple[float, float]] = {}  # session -> when its last batch went out, and the seconds
        # between its batches (a moving average; 0: one batch so far): when its devices should be done (`busy_for`)
        self.holds: dict[str, set[st.Hold]] = {}  # session -> what holds its batches
        self.compiled: dict[str, dict[int, programs.Compiled]] = {}  # session -> program -> its commands (rule 4)
        self._versions = itertools.count(1)  # numbers each translation of a program the workers keep
        # sessions that may hold deletes back (rule 6): each one whose `deferred` grew; dropped once seen empty
        self.deferring: set[str] = set()

    def rec(self, s: Session, now: float) -> Lineage:
        """The session's lineage, made at first use: the empty registry before batch 1 is a complete snapshot."""
        rec = self.recs.get(s.id)
        if rec is None:
            rec = self.recs[s.id] = Lineage(enabled=self.recovery, last_snapshot_at=now,
                                            snapshot=Copies(namespace="", upto=0, tensors={}) if self.recovery
                                            else None)
        return rec

    def close(self, s: Session) -> Lineage | None:
        """Forget the session's log and holds; returns its lineage (its copies are still to be dropped)."""
        self.holds.pop(s.id, None)
        self.compiled.pop(s.id, None)
        self.in_flight.pop(s.id, None)
        self.pace.pop(s.id, None)
        return self.recs.pop(s.id, None)

    # ------------------------------------------------------------ accepting and holding (rule 1)

    def accept(self, step: Step, s: Session, instrs: list[m.Instr]) -> None:
        """Batch `s.seq` was accepted: log it and send it, unless the session is held. Captured programs are kept
        and their replays filled in first (rule 4): the log holds plain instructions."""
        instrs, named, refused = programs.accept(s.programs, instrs)
        s.errors.extend(refused)
        self.rec(s, step.now).log.append(LoggedBatch(s.seq, instrs, programs=named))
        step.emit(fx.Accepted(s.id, s.seq, programs.size(instrs, named)))
        self.pump(step, s)

    def hold(self, s: Session, reason: st.Hold) -> None:
        self.holds.setdefault(s.id, set()).add(reason)

    def release(self, step: Step, s: Session, reason: st.Hold) -> None:
        """`reason` no longer holds the session: what nothing else holds goes out, its Syncs may be answered."""
        reasons = self.holds.get(s.id)
        if reasons is not None:
            reasons.discard(reason)
            if not reasons:
                del self.holds[s.id]
        self.pump(step, s)
        step.touch(s.id)

    def holding(self, s: Session) -> frozenset[st.Hold]:
        return frozenset(self.holds.get(s.id, ()))

    def unsent(self, s: Session) -> bool:
        """Accepted batches not sent yet."""
        rec = self.recs.get(s.id)
        return rec is not None and rec.sent_upto < s.seq

    def pump(self, step: Step, s: Session) -> bool:
        """Send the logged batches not sent yet, in order, unless the session is held. True when something went
        out."""
        if s.id not in self.cluster.sessions or self.holds.get(s.id):
            return False
        rec = self.rec(s, step.now)
        sent = False
        for b in rec.log:
            if not b.sent:
                if self.ahead and (full := self._full(s)) is not None:
                    self.windowed.setdefault(full, set()).add(s.id)  # rule 7: its completion sends the rest
                    break
                b.sent = sent = True
                rec.sent_upto = b.seq
                self._send_batch(step, s, rec, b)
        if sent and not rec.enabled:  # without lineage the log holds only what is not sent (none was before)
            rec.log = [b for b in rec.log if not b.sent]
        step.pumped.add(s.id)
        return sent

    def _full(self, s: Session) -> str | None:
        """A worker that has `ahead` batches of the session not completed yet (rule 7), or None."""
        mine = self.in_flight.get(s.id)
        if not mine:
            return None
        workers = self.cluster.workers
        full, done = None, []
        for worker_id, seqs in mine.items():  # not a copy: a wide session's completions each ask (n x n)
            w = workers.get(worker_id)
            if w is not None and w.state != st.LOST:
                while seqs and seqs[0] <= w.completed:
                    seqs.popleft()
                if len(seqs) >= self.ahead:
                    full = worker_id
                    break
            if w is None or w.state == st.LOST or not seqs:
                done.append(worker_id)
        for worker_id in done:
            del mine[worker_id]
        return full

    def unblock(self, step: Step, worker_id: str) -> list[str]:
        """`worker_id` completed a batch or was lost: the sessions waiting for it send what now fits (rule 7).
        Returns the ones that sent nothing (the window is still full on another of their workers: a wide session's
        completions but the last of a step) and that nothing had pumped before in this event."""
        still = []
        pumped = step.pumped
        for sid in sorted(self.windowed.pop(worker_id, ())):
            s = self.cluster.sessions.get(sid)
            if s is not None:
                before = sid in pumped
                if not self.pump(step, s) and not before:
                    still.append(sid)
        return still

    def busy_for(self, session: str, now: float) -> float:
        """Seconds until the session's last batch should be done, from the pace of its batches (inf: unknown)."""
        last, period = self.pace.get(session, (now, 0.0))
        return max(0.0, last + period - now) if period else math.inf

    def _send_batch(self, step: Step, s: Session, rec: Lineage, b: LoggedBatch) -> None:
        last, period = self.pace.get(s.id, (step.now, 0.0))
        gap = step.now - last
        self.pace[s.id] = (step.now, gap if not period else period + _PACE_WEIGHT * (gap - period))
        cmds, adopts, errors = self.translate(step.now, s, rec, b, replay=False)
        s.errors.extend(errors)
        seqs = self.send(step, s, cmds)
        for copies in adopts:
            copies.pending = {w: seqs[w] for w in copies.pending}

    # ------------------------------------------------------------ translating (rules 3 and 4)

    def translate(self, now: float, s: Session, rec: Lineage, b: LoggedBatch, replay: bool,
                  ) -> tuple[Cmds, list[Copies], list[m.ErrorReport]]:
        """Translate a batch for the session's binding, cut at each InstrAdopt to copy the upload there (or restore
        it, `replay`). Returns the commands, the copies started (their seqs are known once sent) and the errors.
        Going out (not `replay`), it notes which op made each tensor, for loss messages (bounded: live tensors), and
        a replay of a program is its compiled commands (rule 4); a rebuild translates what it stands for."""
        instrs = b.instrs if not replay else programs.expand(b.instrs, b.programs)
        cmds: Cmds = {}
        errors: list[m.ErrorReport] = []
        adopts: list[Copies] = []
        start = 0

        def take(batch: Batch) -> None:
            errors.extend(batch.errors)
            if batch.deferred:
                s.deferred.extend(batch.deferred)
                self.deferring.add(s.id)
            for w, batch_cmds in batch.cmds.items():
                mine = cmds.get(w)
                if mine is None:
                    cmds[w] = batch_cmds
                else:
                    mine.extend(batch_cmds)

        def run(segment: list[m.Instr]) -> None:
            if segment:
                if not replay:
                    note_instrs(rec.origin, segment)
                take(translate(s, segment, self.cluster.workers))

        for i, instr in enumerate(instrs):
            if type(instr) is m.InstrReplay:
                run(instrs[start:i])
                start = i + 1
                take(programs.replay(self.compiled.setdefault(s.id, {}), s, self.cluster.workers,
                                     b.programs[instr.program], instr, rec.origin, next(self._versions)))
                continue
            if not isinstance(instr, m.InstrAdopt):
                continue
            run(instrs[start:i + 1])
            start = i + 1
            if replay:
                restore_upload(s, rec, instr, cmds, self.cluster.alive, self.cluster.address)
                continue
            if instr.tid not in s.tensors:  # refused by translate: nothing to restore either
                rec.adopts[instr.tid] = Copies(namespace="", upto=b.seq, tensors={})
                continue
            if s.rebound and (mesh := s.meshes.get(instr.spec.mesh)) is not None:  # rule 3
                if again := [d for d in mesh.devices if d in s.rebound]:
                    s.reput[instr.tid] = again
            if rec.enabled:
                copies = copy_upload(s, rec, instr, b.seq, now, cmds, self.pool.backup_for, self.cluster.address)
                if copies is not None:
                    adopts.append(copies)
        run(instrs[start:])
        return cmds, adopts, errors

    # ------------------------------------------------------------ sending (rule 2)

    def send(self, step: Step, s: Session, cmds: Cmds) -> dict[str, int]:
        """One Execute per worker with commands, with the worker's next seq; returns worker -> seq."""
        seqs = {}
        workers, flight = self.cluster.workers, None
        for worker_id, batch in cmds.items():
            if not batch:
                continue
            w = workers[worker_id]
            w.sent += 1
            s.sent[worker_id] = seqs[worker_id] = w.sent
            if self.ahead:
                if flight is None:
                    flight = self.in_flight.setdefault(s.id, {})
                mine = flight.get(worker_id)
                if mine is None:
                    mine = flight[worker_id] = deque()
                mine.append(w.sent)
            step.emit(fx.SendExecute(worker_id, w.address, m.Execute(seq=w.sent, session=s.id, cmds=batch,
                                                                     memory_cap=s.memory_cap)))
        return seqs

    def send_raw(self, step: Step, worker_id: str, namespace: str, cmds: list[m.Cmd]) -> int:
        """One Execute under another session key (a namespace of copies), outside the session's `sent`."""
        w = self.cluster.workers[worker_id]
        w.sent += 1
        step.emit(fx.SendExecute(w.id, w.address, m.Execute(seq=w.sent, session=namespace, cmds=cmds)))
        return w.sent

    # ------------------------------------------------------------ syncs (rule 5)

    def first_busy(self, s: Session) -> str | None:
        """A worker of `busy(s)`, or None: stops at the first, looking at the latest sent to first (a report of each
        of a wide session's workers may ask this, and a relocated session keeps its old workers in `sent`)."""
        workers = self.cluster.workers
        for worker_id, seq in reversed(s.sent.items()):
            w = workers.get(worker_id)
            if w is not None and w.completed < seq and w.state != st.LOST:
                return worker_id
        return None

    def busy(self, s: Session) -> list[Worker]:
        """Workers that have not finished the session's batches yet (lost ones are reported, not waited for)."""
        busy = []
        for worker_id, seq in s.sent.items():
            w = self.cluster.workers.get(worker_id)  # a forgotten worker was lost: nothing to wait for
            if w is not None and w.state != st.LOST and w.completed < seq:
                busy.append(w)
        return busy

    def held(self, s: Session) -> bool:
        """Does a hold make a Sync wait (rule 5)?"""
        reasons = self.holds.get(s.id)
        if reasons:
            return not _SYNC_WAITS.isdisjoint(reasons) or self.unsent(s)
        return bool(self.ahead) and self.unsent(s)  # rule 7: batches waiting for the window

    def done(self, s: Session) -> m.SyncReply:
        """A Sync answered done: every error of the batches sent so far reaches the client now."""
        rec = self.recs.get(s.id)
        if rec is not None:
            rec.delivered = rec.sent_upto
            rec.window_errors.clear()
        errors, s.errors = s.errors, []
        if s.rebound:
            s.rebound.clear()  # its locations tell the client where the devices are now (recovery.py rule 7)
        s.safe.clear()  # the client lets go of every upload it kept before the Sync (lineage.py rule 3) but `keep`
        if s.errors_dropped:
            errors.append(m.ErrorReport(op="errors", src="", message=f"{s.errors_dropped} more error reports came "
                                        f"from workers since the last sync; only the first {len(errors)} are kept"))
            s.errors_dropped = 0
        return m.SyncReply(done=True, errors=errors, locations=self.cluster.locations(s), memory_cap=s.memory_cap,
                           keep=sorted(s.asked))

    def reput(self, s: Session) -> m.SyncReply:
        """The answer that asks the client for the uploads a rebuild needs (rule 5); asked once."""
        reput = s.take_reput()
        return m.SyncReply(done=False, locations=self.cluster.locations(s), memory_cap=s.memory_cap, reput=reput,
                           message=f"the rebuild needs {len(reput)} uploads again")

    def answer_syncs(self, step: Step, s: Session) -> str | None:
        """Answer the session's parked Syncs if they can be (rule 5); else the worker they wait for, if any (the
        controller files them under it), or None (a hold: its release looks at them again)."""
        if s.reput and s.syncs:
            reply = self.reput(s)
            for pending in s.syncs.values():
                step.reply(pending.request_id, reply)
            s.syncs.clear()
            return None
        # held first: it is O(1), and a frozen session's parked Syncs are looked at by every report of the workers
        # it stays bound to (with LAS, hundreds of frozen sessions), where `first_busy` walks the workers it used
        if not s.syncs or self.held(s):
            return None
        busy = self.first_busy(s)
        if busy is None:
            for pending in s.syncs.values():
                step.reply(pending.request_id, self.done(s))
            s.syncs.clear()
        return busy

    # ------------------------------------------------------------ deletes held back (rule 6)

    def flush_deferred(self, step: Step, s: Session) -> None:
        """Send the deletes whose remote readers have finished (or were lost)."""
        if not s.deferred:
            return
        ready, waiting = [], []
        for dd in s.deferred:
            done = all(not self.cluster.waits_for(wid, seq) for wid, seq in dd.waits.items())
            (ready if done else waiting).append(dd)
        s.deferred = waiting
        groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        for dd in ready:
            if dd.tid in s.tensors:  # the id was reused: the new tensor already replaced the old shards
                continue
            for worker_id, devices in dd.devices.items():
                if self.cluster.workers[worker_id].state != st.LOST:
                    groups.setdefault((worker_id, tuple(devices)), []).append(dd.tid)
        cmds: Cmds = {}
        for (worker_id, devices), tids in groups.items():
            cmds.setdefault(worker_id, []).append(m.CmdDelete(tids=tids, devices=list(devices)))
        self.send(step, s, cmds)
