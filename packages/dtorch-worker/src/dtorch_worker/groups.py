"""Process groups between workers, made on the controller's instruction (CmdGroup), and their ops.

Rules:

1. Rendezvous: every worker serves one TCPStore (started with it, advertised at registration as
   `RegisterWorker.rendezvous`), listening on the worker's advertised host only (torch's own store would listen
   on every interface). A group's members meet on rank 0's store under the prefix
   `dtorch/{key}/{group}/{generation}`, where `key` is the group's secret (`CmdGroup.key`, drawn by the
   controller for each group and generation, sent to its members only), so only they can name its keys: a
   member of another group, generation or session, or anyone else who reaches the port, never meets them. The
   session id never travels to the store (it is a secret of its own). A controller of protocol 1.5 sends no key:
   then the prefix names the session instead, as it did (workers may be newer than the controller).
2. Membership is checked, not trusted (table CHECKS): a CmdGroup with a short key, naming another worker at this
   rank, or (rank 0) another store than this worker's, is refused; every member claims its rank's slot in the
   store once (`compare_set`) with the fingerprint of the membership it was told, and every member waits for all
   slots and refuses the group unless each holds the member named there with the same fingerprint: a group
   whose members disagree, or whose slot someone else took, never runs an op. The exposure that remains (an
   on-path reader of the store's plaintext, the backends' own connections): docs/architecture.md, Threat model.
3. Each group is its own process group object, built by the device backend (`ProcessGroupGloo` on CPU,
   `ProcessGroupNCCL` on CUDA), never the default group: one worker serves many sessions.
4. Lanes: a group is built, and each of its ops runs, on the group's own thread (its *lane*), one op at a time
   in the order the executor submitted them, which is the group's seq order (checked: a gap is refused). So the
   executor never waits for a rendezvous or a transfer; it waits only where it uses an op's output
   (`TensorStore.get` on a pending shard). Ops of different groups never wait for each other, except on a
   device whose backend asks for one lane for all groups (`DeviceBackend.one_lane`: NCCL, where kernels of two
   communicators issued in different orders on two GPUs can deadlock): there every group's ops run on the
   worker's one lane, in the executor's order, which is the controller's total order (rule 5 holds as well).
   An op whose output the executor needs at once (`submit(now=True)`: the next command reads it, a later step of
   the same redistribution packs it, or nothing else is left to run) runs on the executor's own thread instead,
   where its lane has nothing queued or running and there is more than one lane: the group's order is kept, the
   executor waits where it would have waited anyway, and the two thread hand-offs (to the lane, and back at the
   first use) are saved.
5. Why this cannot deadlock across sessions: the controller assigns every worker's Execute seqs in the one order
   it handles events in, so any two batches reach all their common workers in the same relative order; a group's
   ops are issued (submitted to its lane) by every member at the same place of that order, and the only blocking
   waits (an op's output at its first use, an intermediate step) wait for ops issued earlier in it. The earliest
   waited-for op can always complete, so every one does.
6. Bounds: the rendezvous and every op are bounded by the group's timeout. An op slower than a second marks the
   member's arrival in the store; an op or rendezvous that times out fails with one line naming the op, the group
   and the members that never arrived (`CollectiveTimeout`), and breaks the group: its later ops fail at once with
   that line. A peer that dies (SIGKILL) fails the op at once (gloo) or at the timeout (NCCL).
7. Fencing: a CmdGroup of a newer generation fences the session's groups of older generations here once their
   submitted ops are done (bounded); CmdAbandon (a rebuild) aborts all the session's groups at once: their waits
   end now, ops in flight fail as aborted; so does CmdFence every group with a member at a lost worker's address,
   whichever its session; CmdCloseSession closes them. An op naming a fenced group is refused.
   Process group objects of fenced groups are dropped on a reaper thread (gloo's destructor waits for a stuck op).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from dtorch_protocol import wire
from dtorch_protocol.messages import CmdGroup, ErrorReport, GroupOp
from dtorch_worker.device import DeviceBackend

log = logging.getLogger("dtorch_worker.groups")

SLOW_S = 1.0  # an op still waiting after this long marks its member's arrival in the store
FENCE_WAIT_S = 30.0  # bound on waiting for an older generation's ops before fencing it anyway
POLL_S = 0.02  # how often a member looks for the others' slots while the group meets
KEY_CHARS = 16  # a group key has at least this many characters (the controller draws 32 hex digits)

Check = Callable[[CmdGroup, str, str], bool]  # (command, this worker's address, its store's address) -> acceptable
CHECKS: tuple[tuple[str, Check], ...] = (  # (why a CmdGroup is refused, what it must satisfy), checked in order
    (f"carries a key shorter than {KEY_CHARS} characters",
     lambda c, me, store: not c.key or len(c.key) >= KEY_CHARS),  # none: a 1.5 controller (rule 1)
    ("names a rank outside its members", lambda c, me, store: 0 <= c.rank < len(c.members)),
    ("has a timeout that is not positive", lambda c, me, store: c.timeout_s > 0),
    ("names another worker at this worker's rank",
     lambda c, me, store: not me or c.members[c.rank].endswith(f" at {me}")),
    ("puts the rendezvous on another store than this worker's, at rank 0",
     lambda c, me, store: c.rank != 0 or c.store == store),
)


class GroupError(RuntimeError):
    """An op could not run on its group (unknown, fenced, broken, aborted); str() is the user's line."""


class CollectiveTimeout(GroupError):
    """A rendezvous or op waited past the group's timeout; str() names the op, the group and who is missing."""


@dataclass
class Group:
    session: str
    id: str
    generation: int
    rank: int
    members: list[str]
    store_address: str
    timeout_s: float
    lane: ThreadPoolExecutor
    key: str  # the group's secret: its keys in the store are under it (rule 1)
    fingerprint: str  # of the membership this member was told (rule 2)
    pg: Any = None
    store: Any = None
    issued: int = 0  # the last op seq submitted to the lane
    queued: int = 0  # work items handed to the lane (by the executor's thread only)
    finished: int = 0  # of those, how many the lane has finished (by the lane only): it is idle when equal
    broken: str = ""  # why the group cannot run ops any more ("" while it can)
    aborted: threading.Event = field(default_factory=threading.Event)
    why_aborted: str = ""  # set before `aborted`: the session is being rebuilt, a member was lost, ...
    waiting: set[Any] = field(default_factory=set)  # completions waited for (device.completion): an abort sets them

    @property
    def size(self) -> int:
        return len(self.members)

    def name(self) -> str:
        return f"group {self.id} (generation {self.generation}, {self.size} workers)"


class Ctx:
    """What an op sees on its lane: the process group and bounded waits that name who is missing."""

    def __init__(self, group: Group, op: str, seq: int, backend: DeviceBackend) -> None:
        self.group, self.op, self.seq, self.backend = group, op, seq, backend
        self.received = 0  # bytes received from other ranks (the worker's counter)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def wait(self, work: Any) -> None:
        """Wait for a collective's Work within the group's timeout; raise one line naming who is missing."""
        g = self.group
        done = self.backend.completion(work)
        g.waiting.add(done)
        try:
            self._wait(work, done)
        finally:
            g.waiting.discard(done)

    def _wait(self, work: Any, done: Any) -> None:
        g = self.group
        deadline = time.monotonic() + g.timeout_s
        marked = False
        while not done.wait(min(SLOW_S, max(deadline - time.monotonic(), 0.0))) or g.aborted.is_set():
            if g.aborted.is_set():
                raise GroupError(f"{self.op} on {g.name()} was aborted ({g.why_aborted})")
            if not marked:
                marked = True
                _mark(g, "arrived", self.seq)
            if time.monotonic() >= deadline:
                missing = _missing(g, "arrived", self.seq)
                raise CollectiveTimeout(f"{self.op} on {g.name()} timed out after {g.timeout_s:g}s waiting for "
                                        f"{missing or 'a member (unknown which)'}")
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - the backend's own failure (a peer died: connection reset)
            raise GroupError(f"{self.op} on {g.name()} failed: {_first_line(e)}") from None

    def publish(self, report: ErrorReport) -> None:
        """This rank contributes poison to this op: leave the original report where the peers read it (and a mark
        that some rank did, which `any_published` reads in one look)."""
        self.group.store.set(f"poison/{self.seq}/{self.rank}", wire.encode(report))
        self.group.store.set(f"poison/{self.seq}", b"1")

    def any_published(self) -> bool:
        """Did any rank publish a report for this op? Asked once the op is done (every rank published before it took
        part); a store that cannot say fails the op (its outputs are poisoned, never silently unpoisoned)."""
        try:
            return bool(self.group.store.check([f"poison/{self.seq}"]))
        except Exception as e:  # noqa: BLE001 - the store's own failure, in one line
            raise GroupError(f"{self.op} on {self.group.name()}: the group's store cannot say whether an input "
                             f"was poisoned: {_first_line(e)}") from None

    def published(self, rank: int) -> bool:
        """Did rank `rank` publish a report for this op?"""
        try:
            return bool(self.group.store.check([f"poison/{self.seq}/{rank}"]))
        except Exception:  # noqa: BLE001 - an unreachable store: the generic report will do
            return False

    def report_of(self, rank: int) -> ErrorReport:
        """The report rank `rank` published for this op (its contribution was flagged as poisoned); never waits."""
        try:
            if self.published(rank):
                return wire.decode(ErrorReport, bytes(self.group.store.get(f"poison/{self.seq}/{rank}")))
        except Exception:  # noqa: BLE001 - the flag is enough to poison; the report is a courtesy
            pass
        return ErrorReport(op=self.op, src="", message=f"an input of {self.op} was poisoned on "
                                                           f"{self.group.members[rank]}")

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   meanwhile: Callable[[], Any] | None = None) -> Any:
        """Exchange byte pieces: `in_splits[r]` bytes of `inp` go to rank r, `out_splits[r]` come from it. Returns
        what `meanwhile()` returns, run here while the transfer is in flight (a look in the store)."""
        work = self.group.pg.alltoall_base(out, inp, out_splits, in_splits)
        try:
            result = meanwhile() if meanwhile is not None else None
        finally:
            self.wait(work)  # never leave the transfer writing into buffers the caller reuses
        self.received += sum(n for r, n in enumerate(out_splits) if r != self.rank)
        return result

    def all_reduce(self, buf: torch.Tensor) -> None:
        """The backend's sum of `buf` over the ranks, in place (only where it equals the sum in mesh order)."""
        self.wait(self.group.pg.allreduce([buf]))
        self.received += buf.numel() * buf.element_size() * 2 * (self.size - 1) // self.size  # a ring's share

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every rank's `inp` (the same size everywhere), concatenated in rank order, into `out`."""
        self.wait(self.group.pg._allgather_base(out, inp))
        self.received += inp.numel() * inp.element_size() * (self.size - 1)


class Groups:
    """The groups of every session on this worker, and this worker's rendezvous store."""

    def __init__(self, backend: DeviceBackend, host: str = "127.0.0.1") -> None:
        self.backend = backend
        self._server: Any = None  # this worker's TCPStore, started when first asked for (`rendezvous`)
        self.host = host  # the host peers reach this worker at (the CLI sets its advertised one)
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str], Group] = {}  # (session, group id) -> group
        self._fenced: dict[tuple[str, str], str] = {}  # (session, group id) -> why (bounded: sessions close)
        self._reapers: list[threading.Thread] = []
        self._one_lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtorch-groups") \
            if backend.one_lane else None  # every group's lane on such a device (rule 4)
        self.received = 0  # bytes received from other workers by collectives

    @property
    def rendezvous(self) -> str:
        """host:port peers reach this worker's store at (`RegisterWorker.rendezvous`); starts the store."""
        from torch.distributed import TCPStore

        with self._lock:
            if self._server is None:
                # torch's store listens on every interface; on a socket of ours it listens where we bound it
                listener = _listen(self.host)
                try:
                    self._server = TCPStore(self.host, listener.getsockname()[1], None, is_master=True,
                                            wait_for_workers=False, timeout=datetime.timedelta(seconds=60),
                                            master_listen_fd=listener.fileno(), use_libuv=True)
                except BaseException:
                    listener.close()
                    raise
                # The store owns the descriptor now and closes it when it goes (on its own loop thread, later). A
                # socket object still holding it would close the same number again when collected: by then another
                # thread may have been given that number (a gloo pair's socket, which then fails with "Bad file
                # descriptor" in the middle of another group's rendezvous).
                listener.detach()
            return f"{self.host}:{self._server.port}"

    # ------------------------------------------------------------ membership (executor thread)

    def join(self, session: str, cmd: CmdGroup, me: str = "") -> None:
        """CmdGroup (to the worker reached at `me`): fence the session's older generations here, then build the group
        on its lane. ValueError when the command fails a check (table CHECKS)."""
        with self._lock:
            store = f"{self.host}:{self._server.port}" if self._server is not None else ""
        why = next((why for why, ok in CHECKS if not ok(cmd, me, store)), "")
        if why:
            raise ValueError(f"CmdGroup of group {cmd.group} (generation {cmd.generation}) refused: it {why}")
        with self._lock:
            older = [g for (s, _i), g in self._groups.items() if s == session and g.generation < cmd.generation]
        for g in older:
            self._drain(g)
            self._fence(g, f"superseded by generation {cmd.generation}")
        g = Group(session=session, id=cmd.group, generation=cmd.generation, rank=cmd.rank, members=list(cmd.members),
                  store_address=cmd.store, timeout_s=cmd.timeout_s, key=cmd.key, fingerprint=_fingerprint(cmd),
                  lane=self._one_lane or ThreadPoolExecutor(max_workers=1,
                                                            thread_name_prefix=f"dtorch-group-{cmd.group}"))
        with self._lock:
            old = self._groups.get((session, cmd.group))
            self._groups[(session, cmd.group)] = g
            self._fenced.pop((session, cmd.group), None)
        if old is not None:
            self._fence(old, f"replaced by generation {cmd.generation}")
        self._on_lane(g, self._build, g)

    def _build(self, g: Group) -> None:
        from torch.distributed import PrefixStore, TCPStore

        self.backend.activate()
        host, _, port = g.store_address.rpartition(":")
        try:
            client = TCPStore(host, int(port), None, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=g.timeout_s))
            g.store = PrefixStore(f"dtorch/{g.key or g.session}/{g.id}/{g.generation}", client)
            _meet(g)
            # the backend's own bound a little longer than ours, so our line (naming who is missing) comes first
            g.pg = self.backend.new_group(g.store, g.rank, g.size, g.timeout_s + 5.0, self.host)
        except GroupError as e:
            g.broken = f"rendezvous of {g.name()} failed: {e}"
            log.warning("%s", g.broken)
        except Exception as e:  # noqa: BLE001 - any failure to meet: the group is broken, its ops say why
            missing = _missing(g, "joined", 0) if g.store is not None else ""
            why = f"timed out after {g.timeout_s:g}s waiting for {missing}" if missing else _first_line(e)
            g.broken = f"rendezvous of {g.name()} failed: {why}"
            log.warning("%s", g.broken)

    # ------------------------------------------------------------ ops (executor thread submits, lane runs)

    def submit(self, session: str, op: GroupOp, what: str, fn: Callable[[Ctx], Any], now: bool = False) -> Future:
        """Queue `fn(ctx)` on the group's lane, or with `now` run it here if the lane is idle (rule 4); checks the
        group and the op's place in its order."""
        with self._lock:
            g = self._groups.get((session, op.group))
            fenced = self._fenced.get((session, op.group))
        if g is None or g.generation != op.generation:
            why = fenced or ("never set up on this worker" if g is None else
                             f"at generation {g.generation} here, the op names {op.generation}")
            raise GroupError(f"{what} refused: group {op.group} (generation {op.generation}) {why}")
        if op.seq != g.issued + 1:
            raise GroupError(f"{what} refused: op {op.seq} of {g.name()} arrived after op {g.issued}")
        if op.rank != g.rank or len(op.layout) != g.size:
            raise GroupError(f"{what} refused: rank {op.rank} of {len(op.layout)} does not match {g.name()}, rank "
                             f"{g.rank}")
        g.issued = op.seq
        ctx = Ctx(g, what, op.seq, self.backend)
        if now and g.lane is not self._one_lane and g.queued == g.finished:
            done: Future = Future()
            try:
                done.set_result(self._run(g, ctx, fn))
            except Exception as e:  # noqa: BLE001 - delivered as the lane's future would deliver it
                done.set_exception(e)
            return done
        return self._on_lane(g, self._run, g, ctx, fn)

    def _on_lane(self, g: Group, fn: Callable[..., Any], *args: Any) -> Future:
        def counted() -> Any:
            try:
                return fn(*args)
            finally:
                g.finished += 1
        future = g.lane.submit(counted)
        g.queued += 1
        return future

    def _run(self, g: Group, ctx: Ctx, fn: Callable[[Ctx], Any]) -> Any:
        if g.aborted.is_set():
            raise GroupError(f"{ctx.op} on {g.name()} was aborted ({g.why_aborted})")
        if g.broken:
            raise GroupError(f"{ctx.op} cannot run: {g.broken}")
        try:
            return fn(ctx)
        except CollectiveTimeout as e:
            g.broken = str(e)  # the members are out of step: nothing more can run on this group
            raise
        finally:
            self.received += ctx.received

    # ------------------------------------------------------------ fencing

    def _drain(self, g: Group) -> None:
        """Wait (bounded) until the ops submitted to `g` are done."""
        done = threading.Event()
        try:
            g.lane.submit(done.set)
        except RuntimeError:  # already shut down
            return
        if not done.wait(FENCE_WAIT_S):
            log.warning("%s still busy after %gs; fencing it anyway", g.name(), FENCE_WAIT_S)

    def _fence(self, g: Group, why: str) -> None:
        with self._lock:
            if self._groups.get((g.session, g.id)) is g:
                del self._groups[(g.session, g.id)]
            self._fenced[(g.session, g.id)] = f"was fenced ({why})"
        g.why_aborted = g.why_aborted or why  # the first reason stays
        g.aborted.set()
        for done in list(g.waiting):
            done.set()  # waits in progress see `aborted` now
        if g.lane is not self._one_lane:  # on the one lane, its queued ops see `aborted` and fail at once
            g.lane.shutdown(wait=False, cancel_futures=True)
        if g.pg is not None:
            owned = [g.pg]  # the reaper holds the last reference: the destructor runs there, never here
            g.pg = None
            reaper = threading.Thread(target=_reap, args=(owned,), name="dtorch-group-reaper", daemon=True)
            reaper.start()
            with self._lock:
                self._reapers = [t for t in self._reapers if t.is_alive()] + [reaper]
        g.store = None

    def abort(self, session: str) -> None:
        """CmdAbandon: every group of the session ends now; their waits end, their ops fail as aborted."""
        with self._lock:
            gs = [g for (s, _i), g in self._groups.items() if s == session]
        for g in gs:
            self._fence(g, "the session is being rebuilt")

    def fence_members(self, addresses: list[str]) -> None:
        """CmdFence: every group (of any session) with a member at one of `addresses` ends now, as on CmdAbandon."""
        lost = tuple(f" at {a}" for a in addresses)
        with self._lock:
            gs = [g for g in self._groups.values() if any(member.endswith(lost) for member in g.members)]
        for g in gs:
            self._fence(g, "a member was declared lost")

    def close(self, session: str) -> None:
        """CmdCloseSession: forget the session's groups."""
        self.abort(session)
        with self._lock:
            for key in [k for k in self._fenced if k[0] == session]:
                del self._fenced[key]

    def bound(self, session: str, op: GroupOp) -> float:
        """How long a reader may wait for `op`'s outputs: its rendezvous and itself are each bounded by the
        group's timeout; past this something is stuck beyond them (a backend that ignores its timeout)."""
        with self._lock:
            g = self._groups.get((session, op.group))
        return 2 * (g.timeout_s if g is not None else 60.0) + 10.0

    def sessions(self) -> set[str]:
        with self._lock:
            return {s for s, _i in self._groups}

    def stop(self, reap_s: float = 0.0) -> None:
        """Abort every group; wait up to `reap_s` for their process groups to be dropped (a test process that
        exits while a reaper is inside gloo's destructor may be killed by an exception there)."""
        for session in self.sessions():
            self.abort(session)
        deadline = time.monotonic() + reap_s
        with self._lock:
            reapers = list(self._reapers)
        for t in reapers:
            t.join(max(deadline - time.monotonic(), 0.0))


def _reap(owned: list[Any]) -> None:
    """Drop a fenced process group here (gloo's destructor waits for a stuck op until the backend's timeout)."""
    pg = owned.pop()
    try:
        pg.abort()  # NCCL: ends kernels stuck on a dead peer; gloo: a no-op
    except Exception:  # noqa: BLE001 - best effort: not every backend aborts
        pass
    del pg


def _listen(host: str) -> socket.socket:
    """A socket listening on `host` only (any free port); ValueError in one line when `host` is not this machine's."""
    sock = None
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ValueError(f"cannot listen for rendezvous on {host!r}, the host this worker is reached at ({e}): "
                         "advertise an address of this machine, or start it with --no-collectives") from None
    sock.listen(128)
    return sock


def _fingerprint(cmd: CmdGroup) -> str:
    """What every member must have been told alike: the group, its generation, its members and its store."""
    told = json.dumps([cmd.group, cmd.generation, list(cmd.members), cmd.store])
    return hashlib.sha256(told.encode()).hexdigest()[:32]


def _meet(g: Group) -> None:
    """Claim this rank's slot, wait (bounded, abortable) for every member's, and check each holds the member named
    there with the same fingerprint (rule 2). GroupError says what was wrong or who never came."""
    mine = f"{g.fingerprint} {g.members[g.rank]}"
    held = g.store.compare_set(f"joined/{g.rank}", "", mine).decode(errors="replace")
    if held != mine:
        raise GroupError(f"rank {g.rank}'s slot was already taken (by {held.partition(' ')[2][:100] or 'someone'!r}"
                         "); refused")
    keys = [f"joined/{r}" for r in range(g.size)]
    deadline = time.monotonic() + g.timeout_s
    while not g.store.check(keys):
        if g.aborted.wait(POLL_S):
            raise GroupError(f"aborted ({g.why_aborted})")
        if time.monotonic() >= deadline:
            raise CollectiveTimeout(f"timed out after {g.timeout_s:g}s waiting for "
                                    f"{_missing(g, 'joined', 0) or 'a member (unknown which)'}")
    for r, member in enumerate(g.members):
        held = bytes(g.store.get(keys[r])).decode(errors="replace")
        if held != f"{g.fingerprint} {member}":
            who = held.partition(" ")[2][:100]  # whatever a stranger wrote: bounded in the line
            what = f"as {who!r}" if who != member else "with a different membership"
            raise GroupError(f"rank {r} ({member}) joined {what}; refused")


def _mark(g: Group, what: str, seq: int) -> None:
    try:
        g.store.set(f"{what}/{g.rank}", str(seq))
    except Exception:  # noqa: BLE001 - only for the message of a timeout
        pass


def _missing(g: Group, what: str, seq: int) -> str:
    """The members that have not marked `what` at `seq` or later in the store, as "w3 at host:port, ..."."""
    out = []
    for r, member in enumerate(g.members):
        if r == g.rank:
            continue
        try:
            key = f"{what}/{r}"
            there = g.store.check([key]) and (seq == 0 or int(g.store.get(key)) >= seq)
        except Exception:  # noqa: BLE001 - an unreachable store: cannot tell
            return ""
        if not there:
            out.append(member)
    return ", ".join(out)


_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")  # gloo's "[.../pair.cc:537] " prefix


def _first_line(e: BaseException) -> str:
    """The backend's error as one short line: its source location and its advice dropped."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    text = _SOURCE.sub("", text).split(". This is typically caused by")[0]
    return text if len(text) <= 300 else text[:297] + "..."
