"""Drain: move everything off a worker, then release it. Sans-IO.

Rules:

1. The worker turns `draining` (no new devices); each session's devices on it move to a free worker on another
   node (a worker is drained because its node is going away, usually), else a free one on its node, else one the
   session already uses (other nodes first): `Moves.target`. Two moves never head for the same free worker, and a
   drain's move whose target was taken meanwhile picks again (moves.py).
2. Phases (`state.DRAIN_TABLE`): moving, until every move of the drain is over; protecting, until every session
   whose copies (snapshots, uploads) or devices sat on the worker took a new snapshot elsewhere (forced); then it
   is released: fenced like a lost worker (`release` in `state.WORKER_TABLE`), it exits. Nothing is lost.
3. A drain fails when one of its moves fails or the worker is lost meanwhile; the operator is told why. A worker
   whose drain failed serves again (`drain_failed` in `state.WORKER_TABLE`): what moved stays moved, the rest
   stays on it, and it takes new devices; the operator may drain it again.
4. Every Drain request gets exactly one reply: when done, or at its timeout (the drain goes on).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_controller.core.model import Cluster, Worker
from dtorch_controller.core.moves import Move, Moves, unknown_worker
from dtorch_controller.core.pipeline import Pipeline
from dtorch_controller.core.scheduler import Scheduler
from dtorch_controller.core.snapshots import Snapshots
from dtorch_controller.core.step import Step
from dtorch_controller.core.timers import AdminDeadline
from dtorch_protocol import messages as m


@dataclass
class DrainJob:
    worker: str
    requested: float
    requests: list[Hashable] = field(default_factory=list)
    pending: list[Move] = field(default_factory=list)  # its moves not over yet
    moves: list[m.MoveReport] = field(default_factory=list)  # its moves done
    phase: st.DrainPhase = st.DrainPhase.MOVING
    failed: str = ""
    protect: set[str] | None = None  # protecting: sessions that still keep copies on the worker


class Drains:
    def __init__(self, cluster: Cluster, sched: Scheduler, pipeline: Pipeline, snapshots: Snapshots,
                 moves: Moves) -> None:
        self.cluster = cluster
        self.sched = sched
        self.pipeline = pipeline
        self.snapshots = snapshots
        self.moves = moves
        self.jobs: dict[str, DrainJob] = {}  # worker -> its drain
        self.requests: dict[Hashable, DrainJob] = {}  # Drain request -> its job, while unanswered

    def drain(self, step: Step, e: ev.Drain) -> None:
        w = self.cluster.workers.get(e.msg.worker)
        if w is None:
            return step.refuse(e.request_id, unknown_worker(self.cluster, e.msg.worker))
        if w.state == st.LOST:
            return step.refuse(e.request_id, f"worker {w.id} is already gone (lost or released)")
        step.emit(fx.SetTimer(step.now + max(e.msg.timeout_s, 0.0), AdminDeadline(e.request_id)))
        job = self.jobs.get(w.id)
        if job is not None:  # already draining: one more operator waits for it
            job.requests.append(e.request_id)
            self.requests[e.request_id] = job
            return
        hosted = [self.cluster.sessions[sid] for sid in sorted(w.sessions) if sid in self.cluster.sessions]
        targets = {}
        skip = self.moves.incoming()
        for s in hosted:
            dst = self.moves.target(s, w.id, skip)
            if dst is None:
                return step.refuse(e.request_id, f"no other worker can take session {s.id[:8]}'s devices from "
                                                 f"{w.id}")
            targets[s.id] = dst
            skip.add(dst)  # one target per session (a worker it uses is not another's to take anyway)
        job = self.jobs[w.id] = DrainJob(worker=w.id, requested=step.now, requests=[e.request_id])
        self.requests[e.request_id] = job
        if w.state != st.DRAINING:
            w.state = st.step(st.WORKER_TABLE, w.state, st.DRAIN)
            step.apply(self.sched.worker_changed(step.now, w))
        count = sum(1 for s in hosted for x in s.devices.values() if x == w.id)
        step.note(f"worker {w.id} draining: {count} logical devices of {len(hosted)} sessions to move")
        for s in hosted:
            devices = sorted(d for d, x in s.devices.items() if x == w.id)
            mv = Move(session=s.id, devices=devices, src=w.id, dst=targets[s.id], requested=step.now, drain=w.id)
            job.pending.append(mv)
            self.moves.enqueue(step, s, [mv])
        self.advance(step)

    def deadline(self, step: Step, request_id: Hashable) -> bool:
        """A Drain request's timeout: answered "still in progress" unless done; False if not one of ours."""
        job = self.requests.pop(request_id, None)
        if job is None:
            return False
        step.reply(request_id, m.AdminReply(ok=False, message=f"still in progress (draining {job.worker}: "
                                                              f"{job.phase.value}); it goes on",
                                            seconds=step.now - job.requested))
        return True

    def worker_lost(self, w: Worker) -> None:
        job = self.jobs.get(w.id)
        if job is not None:
            job.failed = job.failed or f"worker {w.id} was lost while draining"

    def advance(self, step: Step) -> None:
        for worker_id, job in list(self.jobs.items()):
            self._collect(job)
            w = self.cluster.workers.get(worker_id)
            if job.failed or w is None or w.state == st.LOST:
                del self.jobs[worker_id]
                why = f"drain of {worker_id} failed: {job.failed or 'the worker is gone'}"
                if w is not None and w.state == st.DRAINING:  # rule 3: back in service
                    w.state = st.step(st.WORKER_TABLE, w.state, st.DRAIN_FAILED)
                    step.apply(self.sched.worker_changed(step.now, w))
                    why += f"; {worker_id} takes new devices again"
                    step.note(why)
                self._answer(step, job, ok=False, message=why)
                continue
            if job.phase == st.DrainPhase.MOVING:
                if job.pending:
                    continue
                job.phase = st.step(st.DRAIN_TABLE, job.phase, st.MOVED_OFF)
            if job.phase == st.DrainPhase.PROTECTING:
                if job.protect is None:  # once: later copies never go to a draining worker (not placeable)
                    job.protect = set(self.pipeline.recs)
                job.protect = self._copies_on(step, worker_id, job.protect)
                if job.protect:
                    continue
                self._release(step, w, job)

    def _collect(self, job: DrainJob) -> None:
        """The outcome of its moves that are over (moves.py rule 5)."""
        for mv in [mv for mv in job.pending if mv.phase in (st.MovePhase.DONE, st.MovePhase.CALLED_OFF)]:
            job.pending.remove(mv)
            if mv.report is not None:
                job.moves.append(mv.report)
            else:
                job.failed = job.failed or f"session {mv.session[:8]}: {mv.failed}"

    def _copies_on(self, step: Step, worker_id: str, sids: set[str]) -> set[str]:
        """Which of `sids` still keep copies (or devices) on the worker? Starts the snapshots that move them."""
        waiting = set()
        for sid in sorted(sids):
            rec = self.pipeline.recs.get(sid)
            s = self.cluster.sessions.get(sid)
            if s is None or rec is None:
                continue
            if not rec.enabled:
                self.snapshots.drop(step, rec, {ns for ns, ws in rec.namespaces.items() if worker_id in ws})
                continue
            copies = [c for c in (rec.snapshot, rec.taking, *rec.adopts.values()) if c is not None]
            if any(worker_id in holders for c in copies for holders in c.holders.values()) \
                    or any(worker_id in ws for ws in rec.namespaces.values()) or worker_id in s.devices.values():
                waiting.add(sid)
                if rec.taking is None:
                    rec.force = True
                    self.snapshots.maybe(step, s)
                    step.touch(sid)
        return waiting

    def _release(self, step: Step, w: Worker, job: DrainJob) -> None:
        del self.jobs[w.id]
        job.phase = st.step(st.DRAIN_TABLE, job.phase, st.PROTECTED)
        w.state = st.step(st.WORKER_TABLE, w.state, st.RELEASE)
        for s in self.cluster.sessions.values():  # nothing is bound there: no Sync waits for it (it is forgotten)
            s.sent.pop(w.id, None)
        self.cluster.fence(w)
        self.pipeline.unblock(step, w.id)  # its batches count no more (pipeline rule 7)
        took = step.now - job.requested
        step.note(f"worker {w.id} at {w.address} released after draining in {took:.3f}s ({len(job.moves)} moves)")
        step.apply(self.sched.worker_changed(step.now, w))
        self.cluster.prune_lost()
        step.emit(fx.Drained(w.id, len(job.moves)))
        moved = sum(len(mv.devices) for mv in job.moves)
        self._answer(step, job, ok=True, message=f"drained {w.id}: moved {moved} logical devices of "
                                                 f"{len(job.moves)} sessions, released it")

    def _answer(self, step: Step, job: DrainJob, ok: bool, message: str) -> None:
        for rid in job.requests:
            if self.requests.pop(rid, None) is not None:
                step.reply(rid, m.AdminReply(ok=ok, message=message, moves=list(job.moves),
                                             seconds=step.now - job.requested))
