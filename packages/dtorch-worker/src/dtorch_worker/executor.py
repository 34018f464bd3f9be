"""Runs Execute batches strictly in `seq` order on one thread, one command at a time.

Batches arrive as separate RPCs and may overtake each other; early ones wait in
a buffer until their turn. A failing command never stops the worker: its
outputs become Poison(report) and the report is queued for the controller; a
command reading a poisoned input passes the ORIGINAL report on and reports
nothing new, so the user sees the first failure, once.

Peers read this worker's shards (Pull) when THEY reach a redistribution, while
this worker may already be further on. So a command that writes a shard in place
first waits until the peers' reads announced earlier (CmdExpectReads) are served.
That cannot deadlock: a planned read only needs data produced before the
CmdExpectReads in this worker's stream, and the reader only waits for things that
come before the redistribution in the client's instruction order, so every wait
points back in that one total order and no cycle can form. The wait is still
bounded (a reader may have been lost): then the write goes ahead with a warning.

Collectives (CmdGroup, CmdCollective; groups.py, collectives.py): a collective is issued when its command runs
and finishes on its group's lane while the executor goes on; its outputs are `Pending` in the store, so the
first command that uses one waits for it there (as do peers' pulls and whole-shard copies). A batch counts as
completed (reported to the controller) only once its collectives are done, and their errors are reported
with it. Why the waits cannot deadlock across sessions: groups.py, rule 5.

A client's early read (CmdReadable, `PullRequest.after`) is served once the batch of its mark completed and the
agent's report of that completion is on its way (`release_reads`): on a busy worker the read's bytes would
otherwise go out first and delay the report its Sync waits for.

Captured programs (`dtorch.compile`): a CmdProgram keeps this worker's commands of a session's program (slots for
tensor ids, seeds, numbers and group op numbers, `dtorch_protocol.programs`); a CmdReplay runs them filled in, in
its place in the batch, each as if it had been sent (errors, profiles and metrics per command).

Commands shared by a mesh's workers (protocol 1.7, `dtorch_protocol.shared`): a CmdRun or CmdDelete naming a mesh
instead of devices runs on this worker's devices of that mesh, as the batch's CmdMesh before it named them; it is
turned into this worker's own command as it comes up (`_local`), so runs, caps, profiles and metrics see ordinary
commands.

Memory caps: a session packed with others onto this device carries its cap on every Execute. A command that
makes a capped session hold more than its cap here (created or grown shards: runs, creates, redistributions,
restores) fails like any other: its outputs become Poison with a "memory cap exceeded" report, which frees
them. Peaks inside one command (temporaries, all devices' results before they are stored) are not bounded.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from functools import lru_cache
from typing import Any

import msgspec
import torch

from dtorch_protocol import programs, shared
from dtorch_protocol.messages import (
    TENSOR_SLOT,
    Cmd,
    CmdAbandon,
    CmdCloseSession,
    CmdCollective,
    CmdCreate,
    CmdDelete,
    CmdExpectReads,
    CmdFence,
    CmdFetchShards,
    CmdGroup,
    CmdKeepCopies,
    CmdMesh,
    CmdProgram,
    CmdReadable,
    CmdRebuilt,
    CmdRedistribute,
    CmdReplay,
    CmdRun,
    CmdSendShards,
    CmdStay,
    ErrorKind,
    ErrorReport,
    Execute,
    GroupOp,
    Piece,
    PullRequest,
    ShardPlan,
    ShardsRequest,
)
from dtorch_protocol.tls import Tls
from dtorch_protocol.values import decode_value, dtype_from_name, reduce_in_order
from dtorch_protocol.writes import written_arguments
from dtorch_worker import collectives, hygiene, random_blocks, shards
from dtorch_worker.device import backend_for
from dtorch_worker.groups import GroupError, Groups
from dtorch_worker.ops import prepare_args, resolve_op
from dtorch_worker.portable import kernel
from dtorch_worker.store import Key, Pending, Poison, ShardMissing, TensorStore, cap_message, describe
from dtorch_worker.transfer import PeerPool, PoisonedInput, poisoned_or, take_box

log = logging.getLogger("dtorch_worker.executor")

RANDOM_INITS = frozenset({"rand", "randn"})
DETERMINISTIC_INITS = frozenset({"zeros", "ones", "full", "empty", "arange"})


def one_line(e: BaseException, limit: int = 500) -> str:
    """'<ExceptionType>: <first line of the message>', short enough for a report."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if isinstance(e, KeyError) and text.startswith("'") and text.endswith("'"):
        text = text[1:-1]
    msg = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return msg if len(msg) <= limit else msg[:limit - 3] + "..."


def flatten(result: Any) -> list[Any]:
    """An op result as the flat list of outputs the client numbers (nested lists in order); an output torch leaves
    undefined keeps its place as None (`convolution_backward` with `output_mask` [False, True, True]: no gradient
    for the input), and an op that returns nothing has no outputs."""
    if isinstance(result, (tuple, list)):
        out: list[Any] = []
        for item in result:
            out.extend(flatten(item) if isinstance(item, (tuple, list)) else [item])
        return out
    if result is None:
        return []
    return [result]


def check_box(shape: Sequence[int], box: Sequence[Sequence[int]]) -> list[int]:
    """Validate a [[start, length], ...] box against `shape`; returns the box shape."""
    if len(box) != len(shape):
        raise ValueError(f"box {[list(b) for b in box]} has {len(box)} dims, the tensor has shape {list(shape)}")
    for d, (b, n) in enumerate(zip(box, shape)):
        if len(b) != 2 or b[0] < 0 or b[1] < 0 or b[0] + b[1] > n:
            raise ValueError(f"box {[list(x) for x in box]} is outside shape {list(shape)} at dim {d}")
    return [b[1] for b in box]


def narrow_box(t: torch.Tensor, box: Sequence[Sequence[int]]) -> torch.Tensor:
    for d, (start, length) in enumerate(box):
        t = t.narrow(d, start, length)
    return t


MAX_AHEAD_PER_SESSION = 1024  # batches of one session waiting behind a batch number that has not arrived
MAX_AHEAD = 8192  # ... of all sessions together
BACKUP_BYTES_IN_FLIGHT = 256 << 20  # background copies (upload backups) in flight: past it the stream waits


class BatchRefused(ValueError):
    """A batch the executor will not queue; str() is the one-line reason the controller gets."""


class MemoryCapExceeded(Exception):
    """A command took its session over its memory cap on this worker; str() is the one-line report."""


class StaleCopy(Exception):
    """A copy a snapshot would keep no longer matches tensor `tid` (CmdKeepCopies.check)."""

    def __init__(self, tid: int, message: str) -> None:
        super().__init__(message)
        self.tid = tid


class Executor:
    """Owns the executor thread, the ordering buffer and the error queue of one worker."""

    def __init__(self, store: TensorStore, device: str | torch.device = "cpu", tls: Tls | None = None,
                 on_complete: Callable[[int], None] | None = None, input_timeout_s: float = 10.0,
                 pull_timeout_s: float = 60.0, fetch_threads: int = 8, first_seq: int = 1,
                 reads_timeout_s: float = 60.0) -> None:
        self.store = store
        self.backend = backend_for(device)  # the only door to the hardware (device.py)
        self.device = self.backend.device
        self.on_complete = on_complete  # told the completed seq when it moved and someone may wait for it
        # told the completed seq when it moved but the session has a later batch here still running (its completion
        # is told in turn); the agent reports it within its lag bound (None: on_complete is told instead)
        self.on_deferred: Callable[[int], None] | None = None
        self.input_timeout_s = input_timeout_s
        self.pull_timeout_s = pull_timeout_s
        self.reads_timeout_s = reads_timeout_s  # bound on holding an in-place write for peers' reads
        self.address = ""  # our own server address: pieces naming it are read locally
        self.peers = PeerPool(tls, self.backend)
        self._fetch_pool = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix="dtorch-fetch")
        self._cond = threading.Condition()
        self._pending: dict[int, Execute] = {}
        self._executed = first_seq - 1  # highest seq whose commands ran (their collectives may be in flight)
        self._inflight: dict[int, int] = {}  # batch seq -> collectives of it still in flight
        self._sessions: dict[int, str] = {}  # seq -> session of the batches started and not completed yet
        self._told = first_seq - 1  # the completed seq last told (on_complete or on_deferred)
        self._marks: list[tuple[int, str, int]] = []  # (batch seq, session, mark) of CmdReadables not yet in effect
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._errors: dict[str, list[ErrorReport]] = {}
        self._errors_lock = threading.Lock()
        self._skip_below: dict[str, int] = {}  # session -> batches below this seq were abandoned (CmdAbandon)
        self._programs: dict[str, dict[int, CmdProgram]] = {}  # session -> its captured programs' commands here
        self._copied: dict[Key, tuple[int, int]] = {}  # (copies' namespace, tid, device) -> the tensor's memory and
        # version counter when the copy was made (CmdKeepCopies.check)
        self._seq = 0  # the batch running now
        self.busy_s = 0.0  # seconds spent running batches (utilization)
        self.groups = Groups(self.backend)  # process groups with other workers (CmdGroup)
        self.buffers = collectives.BufferPool()  # scratch buffers of collectives, reused
        self._sending: dict[int, list[threading.Event]] = {}  # storage -> collectives sending from it (rule 7)
        # DTORCH_SYNC_COLLECTIVES=1: wait for each collective where it is issued (no overlap; benchmarks compare)
        self.sync_collectives = os.environ.get("DTORCH_SYNC_COLLECTIVES", "") == "1"
        # what follows the running command: the rest of its program (if it is a program's), then of its batch
        self._after: tuple[Sequence[Cmd], int, Sequence[Cmd], int] = ((), 0, (), 0)
        # DTORCH_SYNC_BACKUPS=1: upload backups copied in the stream, as before (benchmarks compare)
        self.sync_backups = os.environ.get("DTORCH_SYNC_BACKUPS", "") == "1"
        self._backups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dtorch-backup",
                                           initializer=self.backend.activate)
        self.backup_bytes = 0  # bytes of background copies in flight (bounded by BACKUP_BYTES_IN_FLIGHT)
        self.pulled_bytes = 0  # tensor bytes pulled from peers (pieces)
        self.batches = 0  # batches run
        # told (session, cmd, started, ended, output bytes) after each command: metrics and profiles (telemetry.py)
        self.observe: Callable[[str, Cmd, float, float, Callable[[], int]], None] | None = None
        # told (session, dst tensor, bytes) when a collective op of a redistribution into dst received them
        self.on_received: Callable[[str, int, int], None] | None = None

    # ------------------------------------------------------------ ordering

    @property
    def completed(self) -> int:
        """Highest seq finished, its collectives included (batches finish in seq order)."""
        with self._cond:
            return self._done()

    def _done(self) -> int:
        return min(self._inflight) - 1 if self._inflight else self._executed

    @property
    def received_bytes(self) -> int:
        """Tensor bytes received from other workers: pulled pieces and collectives."""
        return self.pulled_bytes + self.groups.received

    def start(self) -> Executor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dtorch-executor", daemon=True)
            self._thread.start()
        return self

    def submit(self, batch: Execute) -> bool:
        """Queue a batch for its turn; False for a duplicate (already done or already queued), which the
        Execute handler answers as an error: batch numbers come from the controller alone, once each.

        A batch with a CmdAbandon acts on arrival: the session's earlier batches are skipped, and whatever
        the session is waiting for now (shards, peers' reads, pulls) ends, so its rebuild starts promptly. So does a
        CmdFence: nothing here waits on the lost workers it names any more.
        """
        abandon = None
        for c in batch.cmds:  # one look at each command: every batch comes this way
            if type(c) is CmdFence:
                self.fence(c.addresses)
                self.peers.lift(c.lifted)
            elif type(c) is CmdAbandon and abandon is None:
                abandon = c
        with self._cond:
            if self._stopped or batch.seq <= self._executed or batch.seq in self._pending:
                return False
            self._check_ahead(batch)
            self._pending[batch.seq] = batch
            if abandon is not None:
                self._skip_below[batch.session] = max(self._skip_below.get(batch.session, 0), batch.seq)
            self._cond.notify_all()
        if abandon is not None:
            self._abandon_now(batch.session, abandon)
        self.store.set_cap(batch.session, batch.memory_cap)  # known at once: client uploads are checked too
        return True

    def _check_ahead(self, batch: Execute) -> None:
        """Out-of-order batches are bounded per session: a batch arriving behind a gap in the numbering waits in
        memory until the gap fills, and the controller never leaves gaps for long (every seq it assigns is sent),
        so more than MAX_AHEAD_PER_SESSION of them means a lost batch: refused, the controller hears of it."""
        gap = self._executed + 1
        while gap in self._pending:
            gap += 1
        if batch.seq <= gap:
            return
        waiting = [b.session for seq, b in self._pending.items() if seq > gap]
        ahead = waiting.count(batch.session)
        if ahead >= MAX_AHEAD_PER_SESSION or len(waiting) >= MAX_AHEAD:
            raise BatchRefused(f"batch {batch.seq} refused: {ahead} batches of session {batch.session[:8]} "
                               f"({len(waiting)} in all) already wait behind batch {gap}, which never arrived "
                               f"(limits {MAX_AHEAD_PER_SESSION} per session, {MAX_AHEAD} in all)")

    def _abandon_now(self, session: str, cmd: CmdAbandon) -> None:
        with self._errors_lock:
            self._errors.pop(session, None)  # reports of abandoned work: nobody wants them
        self.fence(cmd.lost)
        self.store.abandon(session)
        self.peers.cancel(session)
        self.groups.abort(session)  # collectives in flight end now; their groups are fenced

    def fence(self, addresses: list[str]) -> None:
        """The workers at `addresses` were lost: calls to them end now, and so do the groups they are members of."""
        self.peers.fence(addresses)
        self.groups.fence_members(addresses)

    def _abandoned(self, session: str, seq: int) -> bool:
        with self._cond:
            return seq < self._skip_below.get(session, 0)

    def wait_completed(self, seq: int, timeout: float) -> bool:
        """Block until batch `seq` has finished (tests and shutdown use it)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done() >= seq or self._stopped, timeout) \
                and self._done() >= seq

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the current command; queued batches are dropped."""
        with self._cond:
            self._stopped = True
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self._backups.shutdown(wait=False, cancel_futures=True)
        self.peers.close()
        self.groups.stop()

    @property
    def stopped(self) -> bool:
        with self._cond:
            return self._stopped

    def _loop(self) -> None:
        self.backend.activate()  # the current device is per thread
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._executed + 1 in self._pending)
                if self._stopped:
                    return
                batch = self._pending.pop(self._executed + 1)
                self._sessions[batch.seq] = batch.session
            started = time.monotonic()
            if not self._abandoned(batch.session, batch.seq):
                self.run_batch(batch)
            self.busy_s += time.monotonic() - started
            self.batches += 1
            with self._cond:
                self._executed = batch.seq
                self._cond.notify_all()
            self._progress()

    def _progress(self) -> None:
        """Completion may have moved (a batch ran, a collective or a background copy landed). Tell it only when it
        moved, and at once (on_complete) unless every session whose batches just completed has a later batch here
        that has not: then a sync cannot be waiting for these alone (the client syncs on everything it sent), and the
        later one's completion is told in turn, so it is told as deferred (on_deferred: within the agent's lag).
        A TP forward sends one report per worker instead of one per batch and per collective."""
        with self._cond:
            done = self._done()
            if done <= self._told:
                return
            self._told = done
            finished = {self._sessions.pop(seq) for seq in [q for q in self._sessions if q <= done]}
            busy = set(self._sessions.values()) | {b.session for b in self._pending.values()}
            deferred = bool(finished) and finished <= busy
        tell = self.on_deferred if deferred and self.on_deferred is not None else self.on_complete
        if tell is not None:
            try:
                tell(done)
            except Exception:  # a reporting hiccup must not kill execution
                log.exception("completion callback failed")
        if tell is None:  # no agent reports completions (in-process workers): in effect at once
            self.release_reads(done)

    def release_reads(self, completed: int) -> None:
        """The completion up to batch `completed` is being reported: the client reads marked in those batches
        (CmdReadable) may be served now, their bytes after the report their Sync waits for. Called at every report:
        with no read marked (most reports) it takes no lock (a mark of a batch up to `completed` was recorded before
        that batch completed)."""
        if not self._marks:
            return
        with self._cond:
            marks = [(session, mark) for seq, session, mark in self._marks if seq <= completed]
            if marks:
                self._marks = [x for x in self._marks if x[0] > completed]
        for session, mark in marks:
            self.store.readable(session, mark)

    # ------------------------------------------------------------ errors

    def take_errors(self) -> dict[str, list[ErrorReport]]:
        """New error reports since the last call, per session (the agent sends them)."""
        with self._errors_lock:
            errors, self._errors = self._errors, {}
            return errors

    def restore_errors(self, errors: dict[str, list[ErrorReport]]) -> None:
        """Put back reports a failed send did not deliver, ahead of newer ones."""
        if not errors:
            return
        with self._errors_lock:
            for session, reports in errors.items():
                self._errors[session] = list(reports) + self._errors.get(session, [])

    def _record(self, session: str, report: ErrorReport, seq: int | None = None) -> None:
        seq = self._seq if seq is None else seq  # a collective finishing later reports under its own batch
        if self._abandoned(session, seq):
            return  # the command was cut short by a rebuild: its failure means nothing
        report = msgspec.structs.replace(report, seq=seq)
        with self._errors_lock:
            self._errors.setdefault(session, []).append(report)

    # ------------------------------------------------------------ commands

    def run_batch(self, batch: Execute) -> None:
        """Run every command of a batch now, in order, on the calling thread."""
        self._seq = batch.seq
        self.store.set_cap(batch.session, batch.memory_cap)
        self.peers.grant(batch.session, batch.caps)
        meshes = shared.Meshes()  # this batch's CmdMesh: the devices of its shared commands here
        cmds = batch.cmds
        for i, cmd in enumerate(cmds):
            if type(cmd) is CmdReplay or type(cmd) is CmdProgram:
                filled = self._program(batch.session, cmd)
                for k, one in enumerate(filled):
                    self._after = (filled, k + 1, cmds, i + 1)
                    self._local(batch.session, one, meshes)
            else:
                self._after = ((), 0, cmds, i + 1)
                self._local(batch.session, cmd, meshes)
        self._after = ((), 0, (), 0)

    def _local(self, session: str, cmd: Cmd, meshes: shared.Meshes) -> None:
        """Run `cmd` as this worker's own command: a command shared by a mesh's workers gets the devices its mesh has
        here (`dtorch_protocol.shared`), so everything after sees ordinary commands; a CmdMesh only notes them."""
        try:
            mine = meshes.local(cmd)
        except ValueError as e:
            self._record(session, ErrorReport(op=_describe(cmd)[0], src=getattr(cmd, "src", ""), message=str(e),
                                              seq=self._seq, kind=ErrorKind.OP))
            return
        if mine is not None:
            self._observed(session, mine)

    def _observed(self, session: str, cmd: Cmd) -> None:
        started = time.perf_counter()
        self.run_command(session, cmd)
        if self.observe is not None:
            self.observe(session, cmd, started, time.perf_counter(),
                         lambda: self.store.output_bytes(session, _outputs(cmd)))

    def _program(self, session: str, cmd: CmdProgram | CmdReplay) -> list[Cmd]:
        """Keep a captured program's commands (CmdProgram: nothing runs), or the commands a CmdReplay of it stands
        for, filled in. What does not fit is reported (kind OP: the user's step fails at its next sync)."""
        mine = self._programs.setdefault(session, {})
        if type(cmd) is CmdProgram:
            problem = programs.check_cmds(cmd)
            if problem is None and cmd.program not in mine and len(mine) >= programs.MAX_PROGRAMS:
                problem = f"a session keeps at most {programs.MAX_PROGRAMS} programs on a worker"
            if problem is None:
                mine[cmd.program] = cmd
                return []
        else:
            kept = mine.get(cmd.program)
            if kept is not None and kept.version == cmd.version:
                try:
                    return programs.fill_cmds(kept, cmd)
                except ValueError as e:
                    problem = str(e)
            else:
                problem = (f"translation {cmd.version} of program {cmd.program} is not on this worker (it has "
                           f"{'none' if kept is None else kept.version})")
        self._record(session, ErrorReport(op=f"program:{cmd.program}", src="", message=problem, seq=self._seq,
                                          kind=ErrorKind.OP))
        return []

    def run_command(self, session: str, cmd: Cmd) -> None:
        """Run one command; failures poison its outputs instead of raising.

        A command with outputs that takes a capped session over its memory cap here fails too (one that
        adds nothing, e.g. an in-place op or a view, never does).
        """
        outputs = _outputs(cmd)
        cap = self.store.cap(session) if outputs else 0
        # what its outputs' keys held before: the session's bytes before the command, counted only if needed
        before = self.store.storages([(session, tid, device) for tid, device in outputs]) if cap else {}
        try:
            if isinstance(cmd, CmdRun):
                self._run(session, cmd)
            elif isinstance(cmd, CmdCreate):
                self._create(session, cmd)
            elif isinstance(cmd, CmdRedistribute):
                self._redistribute(session, cmd)
            elif isinstance(cmd, CmdExpectReads):
                for device, n in cmd.reads.items():
                    self.store.expect_reads((session, cmd.tid, device), n, cmd.dst)
            elif isinstance(cmd, CmdReadable):
                with self._cond:
                    self._marks.append((self._seq, session, cmd.mark))
            elif isinstance(cmd, CmdDelete):
                for tid in cmd.tids:
                    for device in cmd.devices:
                        self.store.delete((session, tid, device), by_program=True)
            elif isinstance(cmd, CmdCloseSession):
                self._programs.pop(session, None)
                self._copied = {k: v for k, v in self._copied.items()
                                if k[0] != session and not k[0].startswith(session + "#")}
                self.groups.close(session)
                self.store.drop_session(session)
                self.store.drop_derived(session)
                self.peers.forget(session)
            elif isinstance(cmd, CmdGroup):
                self.groups.join(session, cmd, self.address)
            elif isinstance(cmd, CmdCollective):
                self._collective(session, cmd)
            elif isinstance(cmd, CmdSendShards):
                self._send_shards(session, cmd)
            elif isinstance(cmd, CmdKeepCopies):
                self._keep_copies(session, cmd)
            elif isinstance(cmd, CmdFetchShards):
                self._fetch_shards(session, cmd)
            elif isinstance(cmd, CmdAbandon):
                self.store.drop_tids(session, cmd.tids)
                self.store.clear_moved(session)
            elif isinstance(cmd, CmdRebuilt):
                self.store.rebuilt(session)
            elif isinstance(cmd, CmdStay):
                self.store.clear_moved(session, list(cmd.devices))
            elif isinstance(cmd, CmdFence):
                pass  # it acted on arrival (`submit`)
            else:
                raise TypeError(f"unknown command {type(cmd).__name__}")
            if cap and (held := self.store.session_bytes(session)) > cap \
                    and held > self.store.session_bytes(session, before):
                raise MemoryCapExceeded(cap_message(held, cap))
        except PoisonedInput as e:
            self._poison(session, cmd, e.report)
        except Exception as e:  # noqa: BLE001 (any failure becomes the user's error report)
            op, src, outs = _describe(cmd)
            kind = _kind(cmd)
            if isinstance(e, MemoryCapExceeded):
                message, kind = str(e), ErrorKind.MEMORY_CAP
            elif isinstance(e, StaleCopy):
                message, kind = str(e), ErrorKind.STALE_COPY
            else:
                message = one_line(e) + self.backend.error_hint(e)
            tid = e.tid if isinstance(e, StaleCopy) else outs[0] if outs else -1
            report = ErrorReport(op=op, src=src, message=message, tid=tid, seq=self._seq, kind=kind,
                                 peer=self._copied_to(cmd))
            log.debug("command %s failed: %s", op, report.message)
            self._poison(session, cmd, report)
            self._record(session, report)

    def _poison(self, session: str, cmd: Cmd, report: ErrorReport) -> None:
        poison = Poison(report)
        for tid, device in _outputs(cmd):
            self.store.put((session, tid, device), poison)

    def _input(self, session: str, tid: int, device: int) -> torch.Tensor:
        return poisoned_or(self.store.get((session, tid, device), self.input_timeout_s))

    # create ----------------------------------------------------------------

    def _create(self, session: str, cmd: CmdCreate) -> None:
        dtype = dtype_from_name(cmd.dtype)
        shape = list(cmd.shape)
        boxes = {dev: (box, check_box(shape, box)) for dev, box in cmd.boxes.items()}
        cap = self.store.cap(session)
        if cap and (new := sum(math.prod(b) for _, b in boxes.values()) * dtype.itemsize) > cap:
            raise MemoryCapExceeded(cap_message(new, cap))  # before allocating: it could never fit
        zero = set(cmd.zero)
        full: torch.Tensor | None = None
        drawn: dict[str, torch.Tensor] = {}  # a random box drawn once per worker (replicas clone it)
        if cmd.init == "arange":
            if not cmd.arange or len(cmd.arange) != 3:
                raise ValueError(f"arange needs [start, end, step], got {cmd.arange!r}")
            start, end, step = cmd.arange
            full = torch.arange(start, end, step, dtype=dtype).reshape(shape)
        elif cmd.init not in DETERMINISTIC_INITS and cmd.init not in RANDOM_INITS:
            raise ValueError(f"unknown init {cmd.init!r}")
        made: dict[int, torch.Tensor] = {}
        for dev, (box, bshape) in boxes.items():
            if dev in zero or cmd.init in ("zeros", "empty"):
                t = torch.zeros(bshape, dtype=dtype, device=self.device)
            elif cmd.init == "ones":
                t = torch.ones(bshape, dtype=dtype, device=self.device)
            elif cmd.init == "full":
                if cmd.value is None:
                    raise ValueError("full needs a value")
                t = torch.full(bshape, cmd.value, dtype=dtype, device=self.device)
            elif cmd.init in RANDOM_INITS:
                # only the blocks overlapping this box: O(shard), independent of the layout
                key = repr(box)
                if key not in drawn:
                    # drawn on the CPU and copied over: values independent of the device (device.py rule 3)
                    drawn[key] = random_blocks.draw(cmd.init, cmd.seed, shape, box, dtype).to(self.device)
                    t = drawn[key]
                else:  # devices must never share storage (an in-place op on one would change another)
                    t = drawn[key].clone()
            else:
                assert full is not None
                t = narrow_box(full, box).clone(memory_format=torch.contiguous_format).to(self.device)
            made[dev] = t
        for dev, t in made.items():
            self.store.put((session, cmd.tid, dev), t)

    # run -------------------------------------------------------------------

    def _rng(self, seed: int | None) -> Any:
        return nullcontext() if seed is None else self.backend.seeded(seed)

    def _run(self, session: str, cmd: CmdRun) -> None:
        op = resolve_op(cmd.op)
        run = kernel(cmd.op, op, self.device)  # torch's, or one for an op torch runs on the CPU alone
        results: dict[int, list[Any]] = {}
        for device in cmd.devices:
            args, kwargs = cmd.args, cmd.kwargs
            if cmd.local is not None and device in cmd.local:
                args, kwargs = cmd.local[device]

            def resolve(tid: int, device: int = device) -> torch.Tensor:
                return self._input(session, tid, device)

            a = prepare_args(cmd.op, decode_value(list(args), resolve, self.device))
            k = {key: decode_value(v, resolve, self.device) for key, v in (kwargs or {}).items()}
            self._wait_reads(cmd.op, [t for i, name in written_args(op) for t in _tensors(
                a[i] if i < len(a) else k.get(name))])
            before = hygiene.sizes_before(cmd.op, (a, k))
            with self._rng(cmd.seed):
                flat = flatten(run(*a, **k) if not cmd.default_dtype else _under_default(cmd.default_dtype, run, a, k))
            hygiene.scrub(cmd.op, flat, before, (a, k))  # no bytes another session left behind
            if len(cmd.outs) > len(flat):
                raise ValueError(f"{cmd.op} returned {len(flat)} outputs, expected {len(cmd.outs)}")
            for i, tid in enumerate(cmd.outs):
                if tid is not None and not isinstance(flat[i], torch.Tensor):
                    raise TypeError(f"{cmd.op} output {i} is a {type(flat[i]).__name__}, not a tensor")
            results[device] = flat
        # Store only once every device succeeded: a tensor is either whole or poisoned.
        for device, flat in results.items():
            for i, tid in enumerate(cmd.outs):
                if tid is not None:
                    self.store.put((session, tid, device), flat[i])

    def _sends_from(self, tensors: list[torch.Tensor], future: Future) -> None:
        """Collective `future` (in flight) may send straight from `tensors` (collectives.py, rule 7). What is kept is
        an event set when it is done, not the future: its result would keep the op's outputs alive after the
        session dropped them (and a fresh output allocated meanwhile costs a page fault per 4 KiB)."""
        if not tensors:
            return
        landed = threading.Event()
        future.add_done_callback(lambda _f: landed.set())  # done, failed or cancelled
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr:
                flying = [e for e in self._sending.get(ptr, ()) if not e.is_set()]
                self._sending[ptr] = [*flying, landed]
        if len(self._sending) > 64:  # forget storages whose collectives are all done
            self._sending = {p: es for p, es in self._sending.items() if not all(e.is_set() for e in es)}

    def _wait_sends(self, op: str, written: list[torch.Tensor]) -> None:
        """Hold an in-place write until the collectives sending from the same storage are done (each bounded by its
        group's timeout; a failed one has stopped reading, or its group is broken and its outputs poisoned)."""
        for t in written:
            for landed in self._sending.pop(t.untyped_storage().data_ptr(), ()):
                if not landed.wait(self.reads_timeout_s):
                    log.warning("%s writes in place while a collective may still send from its storage (after "
                                "%gs)", op, self.reads_timeout_s)

    def _wait_reads(self, op: str, written: list[torch.Tensor]) -> None:
        """Hold an in-place write until peers served the reads of the same storage announced before it, and until
        collectives sending straight from that storage are done."""
        if not written:
            return
        if self._sending:
            self._wait_sends(op, written)
        deadline = time.monotonic() + self.reads_timeout_s
        pending = self.store.wait_reads(written, 0.0)
        while pending and not self.stopped and (left := deadline - time.monotonic()) > 0:
            pending = self.store.wait_reads(written, min(left, 1.0))  # slices: stop() is not kept waiting
        if pending and not self.stopped:
            log.warning("%s writes in place while peers still have %s planned reads of %s after %gs; going ahead "
                        "and no longer waiting for them", op, sum(max(self.store.pending_reads(k), 0) for k in pending),
                        ", ".join(describe(k) for k in pending), self.reads_timeout_s)
            self.store.forget_reads(pending)  # a lost reader must not hold every later write of the shard too

    # whole shards: snapshots, restores, moving devices ------------------------

    def _send_shards(self, session: str, cmd: CmdSendShards) -> None:
        if cmd.move:
            self.store.mark_moved(session, list(cmd.move))  # uploads for them are refused from here on
        items = []
        listed = set()
        for device, tids in cmd.devices.items():
            for tid in tids:
                listed.add((tid, device))
                try:  # an upload the client Puts again after a loss may still be on its way (its readers wait too)
                    items.append((tid, device, self.store.get((session, tid, device), self.input_timeout_s)))
                except ShardMissing as e:  # never produced here (e.g. an upload that did not arrive)
                    items.append((tid, device, Poison(ErrorReport(op="copy", src="", message=str(e), tid=tid))))
        for key in self.store.device_keys(session, list(cmd.move)):  # uploads not adopted yet travel too
            if (key[1], key[2]) not in listed and (value := self.store.peek(key)) is not None:
                items.append((key[1], key[2], value))
        if cmd.namespace != session:  # copies for recovery: what they were copied from, for CmdKeepCopies.check
            for tid, device, shard in items:
                if isinstance(shard, torch.Tensor):
                    self._copied[(cmd.namespace, tid, device)] = _stamp(shard)
        if cmd.background and not cmd.move and not self.sync_backups:
            self._copy_later(session, cmd, items)
            return
        self._copy(session, cmd, items)
        for tid, device, _shard in items:  # uploads not adopted yet have no readers here: they moved
            if (tid, device) not in listed:
                self.store.delete((session, tid, device))

    def _copy(self, session: str, cmd: CmdSendShards, items: list[tuple[int, int, Any]]) -> None:
        if self._is_local(cmd.to):
            device = torch.device("cpu") if cmd.host else self.device
            for tid, dev, shard in shards.clone(items, device):
                self.store.put((cmd.namespace, tid, dev), shard)
            return
        self.peers.put_shards(cmd.to, shards.pack(items), session, namespace=cmd.namespace, sender=self.address,
                              host=cmd.host, move=list(cmd.move))

    def _copy_later(self, session: str, cmd: CmdSendShards, items: list[tuple[int, int, Any]]) -> None:
        """A background copy: its shards count as read by a peer until it has copied them (an in-place write waits,
        `_wait_reads`), its batch as in flight until it is done; it waits here while BACKUP_BYTES_IN_FLIGHT are
        (one copy larger than that goes alone)."""
        keys = [(session, tid, dev) for tid, dev, shard in items if isinstance(shard, torch.Tensor)]
        nbytes = sum(shard.untyped_storage().nbytes() for _t, _d, shard in items if isinstance(shard, torch.Tensor))
        seq = self._seq
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or not self.backup_bytes
                                or self.backup_bytes + nbytes <= BACKUP_BYTES_IN_FLIGHT, self.pull_timeout_s)
            self.backup_bytes += nbytes
            self._inflight[seq] = self._inflight.get(seq, 0) + 1
        for key in keys:
            self.store.expect_reads(key, 1)

        def copy() -> None:
            try:
                self._copy(session, cmd, items)
            except Exception as e:  # noqa: BLE001 - reported like the copy in the stream would be
                self._record(session, ErrorReport(op=_describe(cmd)[0], src="", message=one_line(e), seq=seq,
                                                  kind=ErrorKind.COPY, peer=self._copied_to(cmd)), seq)
            finally:
                for key in keys:
                    self.store.read_served(key)
                with self._cond:
                    self.backup_bytes -= nbytes
                    self._inflight[seq] -= 1
                    if not self._inflight[seq]:
                        del self._inflight[seq]
                    self._cond.notify_all()
                self._progress()

        self._backups.submit(copy)

    def _keep_copies(self, session: str, cmd: CmdKeepCopies) -> None:
        """Copies are never written: the same shards are filed under the new namespace too (no bytes move)."""
        for ns in (cmd.source, cmd.namespace):
            if not ns.startswith(session + "#"):
                raise ValueError(f"namespace {ns} is not one of session {session}'s copies ({session}#...)")
        if cmd.check:
            self._check_kept(session, cmd)
        kept = [((cmd.namespace, tid, dev), self.store.get((cmd.source, tid, dev)))
                for dev, tids in cmd.devices.items() for tid in tids]
        for key, shard in kept:
            self.store.put(key, shard)

    def _check_kept(self, session: str, cmd: CmdKeepCopies) -> None:
        """Each kept tensor's memory as it was copied, and shared with no tensor of its device that is not kept
        (that one's fresh copy would not alias the kept one); records the kept copies' stamps."""
        for dev, tids in cmd.devices.items():
            kept, memory = set(tids), {}  # memory -> a kept tensor on it
            for tid in tids:
                live = self.store.peek((session, tid, dev))
                if not isinstance(live, torch.Tensor):
                    continue  # poisoned: its copy is the poison
                stamp = _stamp(live)
                if self._copied.get((cmd.source, tid, dev)) != stamp:
                    raise StaleCopy(tid, f"tensor {tid} on device {dev} changed since its copy in {cmd.source}")
                self._copied[(cmd.namespace, tid, dev)] = stamp
                memory[stamp[0]] = tid
            for key in self.store.device_keys(session, [dev]):
                other = self.store.peek(key) if key[1] not in kept else None
                owner = memory.get(other.untyped_storage().data_ptr()) if isinstance(other, torch.Tensor) else None
                if owner is not None:
                    raise StaleCopy(owner, f"tensor {owner} on device {dev} shares memory with tensor {key[1]}, "
                                    "which is copied afresh")

    def _fetch_shards(self, session: str, cmd: CmdFetchShards) -> None:
        if self._is_local(cmd.address):
            items = [(tid, dev, self.store.get((cmd.namespace, tid, dev)))
                     for dev, tids in cmd.devices.items() for tid in tids]
            got = shards.clone(items, self.device)
        else:
            # copies are complete before the controller names them: nothing to wait for
            got = self.peers.pull_shards(cmd.address, ShardsRequest(session=cmd.namespace, devices=cmd.devices,
                                                                    timeout_s=0.0, move=list(cmd.move)),
                                         session)
        for tid, dev, shard in got:
            self.store.put((session, tid, cmd.rename.get(dev, dev)), shard)
        if cmd.move:  # the devices are here again (they may have left this worker before)
            self.store.clear_moved(session, list(cmd.move))

    # redistribute ----------------------------------------------------------

    def _redistribute(self, session: str, cmd: CmdRedistribute) -> None:
        dtype = dtype_from_name(cmd.dtype)
        jobs: list[tuple[Piece, torch.Tensor]] = []  # remote pieces and where they land
        local: list[tuple[Piece, torch.Tensor]] = []
        groups_out: dict[int, tuple[ShardPlan, list[torch.Tensor]]] = {}
        for dev, plan in cmd.plans.items():
            bufs: list[torch.Tensor] = []
            for group in plan.groups:
                covered = sum(_volume(p.size) for p in group)
                alloc = torch.empty if covered == _volume(plan.shape) else torch.zeros
                buf = alloc(list(plan.shape), dtype=dtype, device=self.device)
                for piece in group:
                    dst = take_box(buf, piece.dst_offset, piece.size)
                    (local if self._is_local(piece.address) else jobs).append((piece, dst))
                bufs.append(buf)
            groups_out[dev] = (plan, bufs)
        # Remote pieces first: the sources announced these reads and hold in-place writes until they are
        # served, so each one must be issued even when a local piece turns out to be missing or poisoned.
        self._fetch_all(session, cmd.src, cmd.dst, jobs)
        for piece, dst in local:
            dst.copy_(take_box(self._input(session, cmd.src, piece.device), piece.src_offset, piece.size))
        made: dict[int, torch.Tensor] = {}
        for dev, (plan, bufs) in groups_out.items():
            if not bufs:
                made[dev] = torch.zeros(list(plan.shape), dtype=dtype, device=self.device)
            else:
                made[dev] = reduce_in_order(bufs, plan.reduce)
        for dev, t in made.items():
            self.store.put((session, cmd.dst, dev), t)

    # collectives -----------------------------------------------------------

    def _collective(self, session: str, cmd: CmdCollective) -> None:
        """Run a redistribution's collective steps in order; the last one is left in flight (first use waits).

        A poisoned or missing input does not stop this worker from taking part (its peers would wait for it): it
        contributes zeros flagged as poison, and every output built from them is poisoned (collectives.py, rule 5).
        """
        if not cmd.steps:
            raise ValueError("a collective redistribution needs at least one step")
        dtype = dtype_from_name(cmd.dtype)
        devices = sorted({d for op in cmd.steps[0].ops for d in op.devices.values()})
        current: dict[int, torch.Tensor] = {}
        poisoned: dict[int, ErrorReport] = {}
        for d in devices:
            try:
                current[d] = self._input(session, cmd.src, d)
            except PoisonedInput as e:
                poisoned[d] = e.report
            except ShardMissing as e:
                poisoned[d] = ErrorReport(op="redistribute", src=cmd.src_line, message=str(e), tid=cmd.dst)
                self._record(session, poisoned[d])
            if d in poisoned:
                if d not in cmd.in_shapes:
                    raise ValueError(f"no shape for logical device {d} of tensor {cmd.src}")
                current[d] = torch.zeros(list(cmd.in_shapes[d]), dtype=dtype, device=self.device)
        last = len(cmd.steps) - 1
        for k, step in enumerate(cmd.steps):
            what = f"{step.kind} of tensor {cmd.src} into {cmd.dst}"
            done = collectives.Result()
            flying = []
            # needed at once: a later step packs it, or the next command reads it, or nothing else is left to run
            # (groups.py rule 4); only where it is this worker's one op of the step (two run side by side on lanes)
            now = (k < last or self._needed_at_once(cmd.dst)) and sum(1 for op in step.ops if op.group) == 1
            for op in map(collectives.spelled_out, step.ops):
                direct: list[torch.Tensor] = []
                finish = collectives.prepare(step, op, current, poisoned, dtype, self.buffers,
                                             self.backend.gather_by_all_to_all(len(op.layout)), direct)
                if op.group:
                    future = self.groups.submit(session, op, what, self._counted(session, cmd.dst, finish), now)
                    flying.append((op, future))
                    self._sends_from(direct, future)  # in-place writes to those storages wait for it
                else:
                    _merge(done, finish(collectives.LocalCtx(poisoned)))
            if k == last:
                return self._issue(session, cmd, what, done, flying)
            for op, future in flying:  # an intermediate step: the next one packs its outputs
                _merge(done, future.result(timeout=self.groups.bound(session, op)))
            current, poisoned = done.outputs, done.poisoned

    def _needed_at_once(self, tid: int) -> bool:
        """Is tensor `tid` needed as soon as it is made: the batch's next command that runs anything (deletes and
        marks skipped) names it among its arguments (not inside lists), or there is none and no other batch is
        waiting to run?"""
        program, k, batch, i = self._after
        for cmd in itertools.chain(itertools.islice(program, k, None), itertools.islice(batch, i, None)):
            if type(cmd) not in _MARKS:
                return type(cmd) is CmdRun and {TENSOR_SLOT: tid} in cmd.args
        return not self._pending

    def _counted(self, session: str, dst: int, finish: collectives.Finish) -> collectives.Finish:
        """`finish`, telling `on_received` what its collective op received (metrics, profiles, usage)."""
        on_received = self.on_received
        if on_received is None:
            return finish

        def run(ctx: Any) -> collectives.Result:
            try:
                return finish(ctx)
            finally:
                if ctx.received:
                    on_received(session, dst, ctx.received)
        return run

    def _issue(self, session: str, cmd: CmdCollective, what: str, done: collectives.Result,
               flying: list[tuple[GroupOp, Future]]) -> None:
        """Store what is done; the outputs of ops in flight are Pending until their lanes finish them."""
        for d, t in done.outputs.items():
            self.store.put((session, cmd.dst, d), Poison(done.poisoned[d]) if d in done.poisoned else t)
        seq = self._seq
        itemsize = dtype_from_name(cmd.dtype).itemsize
        for op, future in flying:
            deadline = time.monotonic() + self.groups.bound(session, op)
            pendings = {(session, cmd.dst, d): Pending(_volume(cmd.out_shapes.get(d, [])) * itemsize, deadline, what)
                        for d in op.devices.values()}
            for key, pending in pendings.items():
                self.store.put(key, pending)
            with self._cond:
                self._inflight[seq] = self._inflight.get(seq, 0) + 1
            future.add_done_callback(lambda f, pendings=pendings: self._landed(session, seq, cmd, what, pendings, f))
            if self.sync_collectives:
                for pending in pendings.values():
                    pending.done.wait(max(deadline - time.monotonic(), 0.0))

    def _landed(self, session: str, seq: int, cmd: CmdCollective, what: str, pendings: dict, future: Future) -> None:
        """A collective in flight finished (or failed, or was cancelled): its outputs, its errors, then progress."""
        try:
            if future.cancelled():
                raise RuntimeError(f"{what} was cancelled: the session is being rebuilt")
            result = future.result()
            for key in pendings:
                d = key[2]
                if d not in result.poisoned and list(result.outputs[d].shape) != list(cmd.out_shapes.get(d, [])):
                    raise RuntimeError(f"{what} made a shard of shape {list(result.outputs[d].shape)} for logical "
                                       f"device {d}, expected {cmd.out_shapes.get(d)}")
            for key, pending in pendings.items():
                d = key[2]
                self.store.resolve(key, pending, Poison(result.poisoned[d]) if d in result.poisoned
                                   else result.outputs[d])
        except Exception as e:  # noqa: BLE001 - becomes the user's error report, as for any command
            report = ErrorReport(op="redistribute", src=cmd.src_line, message=str(e) if isinstance(e, GroupError)
                                 else one_line(e), tid=cmd.dst, seq=seq)
            for key, pending in pendings.items():
                self.store.resolve(key, pending, Poison(report))
            log.warning("session %s: %s", session[:8], report.message)
            self._record(session, report, seq)
        finally:
            for pending in pendings.values():
                pending.done.set()
            with self._cond:
                self._inflight[seq] -= 1
                if not self._inflight[seq]:
                    del self._inflight[seq]
                self._cond.notify_all()
            self._progress()

    def _is_local(self, address: str) -> bool:
        return not address or address == self.address

    def _copied_to(self, cmd: Cmd) -> str:
        """`ErrorReport.peer` of a failed command: the worker a copy went to ("" for a local copy or another command),
        so the controller tells a copy lost with its destination from one that failed here."""
        return cmd.to if isinstance(cmd, CmdSendShards) and not self._is_local(cmd.to) else ""

    def _fetch_all(self, session: str, src: int, dst_tid: int, jobs: Iterable[tuple[Piece, torch.Tensor]]) -> None:
        """Pull remote pieces in parallel, each straight into its destination view."""

        def fetch(piece: Piece, dst: torch.Tensor) -> None:
            req = PullRequest(session=session, tid=src, device=piece.device, offset=list(piece.src_offset),
                              size=list(piece.size), timeout_s=self.pull_timeout_s, expected=True, dst=dst_tid)
            got = self.peers.pull(piece.address, req)
            dst.copy_(got)
            self.pulled_bytes += got.numel() * got.element_size()

        futures = [self._fetch_pool.submit(fetch, piece, dst) for piece, dst in jobs]
        first: BaseException | None = None
        for f in futures:  # wait for all, so no thread writes into a buffer after we give up on it
            err = f.exception()
            if err is not None and (first is None or isinstance(err, PoisonedInput)
                                    and not isinstance(first, PoisonedInput)):
                first = err
        if first is not None:
            raise first


def _volume(size: Sequence[int]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


@lru_cache(maxsize=4096)
def written_args(op: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments `op` may write in place (`Tensor(a!)` in its schema, out= included, and
    those it writes unmarked: a training batch norm's running statistics, `dtorch_protocol.writes`)."""
    return tuple(written_arguments(str(op), op._schema.arguments))


def _under_default(name: str, run: Any, a: list, k: dict) -> Any:
    """`run(*a, **k)` under the client's default dtype (`CmdRun.default_dtype`, one the protocol allows), as torch
    runs it there: an op on integers that makes floats makes them in it. Only this thread runs ops."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype_from_name(name))
    try:
        return run(*a, **k)
    finally:
        torch.set_default_dtype(before)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a decoded argument (a tensor, or a list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _merge(into: collectives.Result, more: collectives.Result) -> None:
    into.outputs.update(more.outputs)
    into.poisoned.update(more.poisoned)


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """A shard's memory and its version counter (shared by every view of it, moved by every write through one)."""
    return t.untyped_storage().data_ptr(), t._version


def _kind(cmd: Cmd) -> ErrorKind:
    """A failed copy between workers (a snapshot's, an upload backup's, a move's) is COPY: the controller reacts to
    it and never shows it; any other failed command is an OP error the user sees."""
    if isinstance(cmd, (CmdSendShards, CmdKeepCopies)) or isinstance(cmd, CmdFetchShards) and cmd.move:
        return ErrorKind.COPY
    return ErrorKind.OP


def _describe(cmd: Cmd) -> tuple[str, str, list[int]]:
    """(op name, source line, output tids) of a command, for error reports."""
    if isinstance(cmd, CmdRun):
        return cmd.op, cmd.src, [t for t in cmd.outs if t is not None]
    if isinstance(cmd, CmdCreate):
        return "create", cmd.src, [cmd.tid]
    if isinstance(cmd, (CmdRedistribute, CmdCollective)):
        return "redistribute", cmd.src_line, [cmd.dst]
    if isinstance(cmd, CmdSendShards):
        return f"copy shards to {cmd.to or 'this worker'} ({cmd.namespace})", "", []
    if isinstance(cmd, CmdKeepCopies):
        return f"keep copies of {cmd.source} as {cmd.namespace}", "", []
    if isinstance(cmd, CmdFetchShards) and cmd.move:  # a move: its failure calls the move off (internal)
        return f"copy shards from {cmd.address} (moving devices {cmd.move})", "", []
    if isinstance(cmd, CmdFetchShards):
        return (f"restore shards from {cmd.address or 'this worker'} ({cmd.namespace})", "",
                sorted({t for tids in cmd.devices.values() for t in tids}))
    return type(cmd).__name__, "", []


_MARKS = {CmdDelete, CmdReadable, CmdMesh}  # commands that run nothing: an output read after them is needed at once


def _outputs(cmd: Cmd) -> list[tuple[int, int]]:
    """Every (tid, device) a command writes: what gets poisoned when it fails."""
    if isinstance(cmd, CmdRun):
        return [(t, d) for d in cmd.devices for t in cmd.outs if t is not None]
    if isinstance(cmd, CmdCreate):
        return [(cmd.tid, d) for d in cmd.boxes]
    if isinstance(cmd, CmdRedistribute):
        return [(cmd.dst, d) for d in cmd.plans]
    if isinstance(cmd, CmdCollective):
        return [(cmd.dst, d) for op in (cmd.steps[-1].ops if cmd.steps else []) for d in op.devices.values()]
    if isinstance(cmd, CmdFetchShards):
        return [(t, d) for d, tids in cmd.devices.items() for t in tids]
    return []
