"""The records the core keeps (workers, sessions, meshes) and `Cluster`, the tables that hold them.

Rules:

1. `Cluster.bind` and `Cluster.unbind` are the only code that binds a logical device to a worker or takes it
   off: they keep `Session.devices`, `Worker.sessions` and `Worker.bound` consistent, and an unbind starts a
   new generation of the session's process groups (collectives.py rule 6).
2. A worker is `alive` (for sending and waiting) until it is declared lost; `waits_for(worker, seq)` is whether
   waiting for its Execute `seq` still makes sense (alive and not done yet).
3. A lost worker is forgotten once nothing refers to it, keeping the most recent `lost_workers_kept` for Status.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

from dtorch_controller.core import state as st
from dtorch_controller.core.collectives import CommGroups
from dtorch_protocol import messages as m
from dtorch_protocol.layout import coords


@dataclass(frozen=True)
class Mesh:
    """A session's n-d array of logical device ids (row-major), as opened with OpenMesh."""

    id: int
    devices: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def key(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Identity for planning: two meshes with the same devices and shape are the same mesh."""
        return (self.devices, self.shape)

    @cached_property
    def coord(self) -> dict[int, tuple[int, ...]]:
        """Logical device -> its coordinate in the mesh."""
        return dict(zip(self.devices, coords(self.shape)))


@dataclass
class Worker:
    id: str
    address: str
    device_type: str
    memory_bytes: int
    labels: dict[str, str]
    order: int  # registration order, for deterministic tie-breaks
    last_seen: float
    state: str = st.ALIVE
    utilization: float = -1.0  # share of the last report interval spent executing (-1: not reported)
    sent: int = 0  # last Execute seq handed to the adapter for this worker
    completed: int = 0  # highest Execute seq the worker reported finished
    stats: dict[str, m.ShardStats] = field(default_factory=dict)  # session -> live shards, from the last report
    sessions: set[str] = field(default_factory=set)  # sessions with logical devices bound here
    bound: int = 0  # logical devices bound here, all sessions together
    rendezvous: str = ""  # host:port of its TCPStore for process groups ("": no collectives with it)
    device_id: str = ""  # its physical device ("" for CPUs): workers sharing one form no process group
    received_bytes: int = 0  # tensor bytes it received from peers (from its last report)

    @property
    def tensors(self) -> int:
        return sum(s.tensors for s in self.stats.values())

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stats.values())


@dataclass
class PendingSync:
    request_id: Hashable
    upto: int
    timeout_s: float


@dataclass
class DeferredDelete:
    """A delete held back until remote readers of the tensor (redistributions on other workers) are done.

    Workers order only their own batches, so deleting a source shard right away could race a peer's pull.
    """

    tid: int
    devices: dict[str, list[int]]  # worker -> logical devices whose shard to delete
    waits: dict[str, int]  # reader worker -> Execute seq it must complete first


@dataclass
class Session:
    id: str
    name: str
    priority: str
    kind: str
    opened_at: float
    tenant: str = ""  # who opened it: only that tenant may name it
    memory_cap: int = 0  # bytes per device each Execute carries (packed leases; 0: whole devices, no cap)
    last_heard: float = 0.0  # the last request naming this session (liveness)
    state: str = st.OPEN
    devices: dict[int, str] = field(default_factory=dict)  # logical device -> worker id
    meshes: dict[int, Mesh] = field(default_factory=dict)
    tensors: dict[int, m.TensorSpec] = field(default_factory=dict)  # live tensors by tid
    seq: int = 0  # last accepted Submit batch
    sent: dict[str, int] = field(default_factory=dict)  # worker -> last Execute seq sent for this session
    errors: list[m.ErrorReport] = field(default_factory=list)  # surfaced (and cleared) at the next Sync
    errors_dropped: int = 0  # workers' error reports past MAX_ERRORS_HELD since the last Sync: counted, not kept
    syncs: dict[Hashable, PendingSync] = field(default_factory=dict)
    readers: dict[int, dict[str, int]] = field(default_factory=dict)  # tid -> remote reader worker -> Execute seq
    deferred: list[DeferredDelete] = field(default_factory=list)
    comm: CommGroups = field(default_factory=CommGroups)  # process groups of its collectives (collectives.py)
    programs: dict[int, m.InstrDefine] = field(default_factory=dict)  # captured steps by id (core/programs.py)
    reput: dict[int, list[int]] = field(default_factory=dict)  # uploads a rebuild asks for again (recovery.py rule 7)
    rebound: set[int] = field(default_factory=set)  # devices a loss rebound, until a done Sync tells the client
    asked: set[int] = field(default_factory=set)  # asked for again, until a snapshot covers them (snapshots.py rule 7)
    safe: list[int] = field(default_factory=list)  # uploads whose copies are complete, not told yet (lineage rule 3)

    def take_reput(self) -> dict[int, list[int]]:
        """The uploads a rebuild asks for again, to tell the client once; asked, they are `safe` only once a snapshot
        covers them (snapshots.py rule 7)."""
        reput, self.reput = self.reput, {}
        self.asked.update(reput)
        return reput

    def take_safe(self) -> list[int]:
        safe, self.safe = self.safe, []
        return safe


class Cluster:
    """Every worker and session the core knows, by id, and which worker serves which address."""

    def __init__(self, lost_workers_kept: int) -> None:
        self.workers: dict[str, Worker] = {}
        self.sessions: dict[str, Session] = {}
        self.by_address: dict[str, str] = {}  # address -> id of the worker there that is not lost
        self.lost_workers_kept = lost_workers_kept
        self._registrations = 0

    # ------------------------------------------------------------ workers

    def add_worker(self, msg: m.RegisterWorker, now: float) -> Worker:
        worker_id = f"w{self._registrations}"
        self._registrations += 1
        w = self.workers[worker_id] = Worker(
            id=worker_id, address=msg.address, device_type=msg.device_type, memory_bytes=msg.memory_bytes,
            labels=dict(msg.labels), order=self._registrations, last_seen=now, rendezvous=msg.rendezvous,
            device_id=msg.device_id)
        self.by_address[msg.address] = worker_id
        return w

    def at(self, address: str) -> Worker | None:
        """The worker at `address` that is not lost."""
        worker_id = self.by_address.get(address)
        return self.workers[worker_id] if worker_id is not None else None

    def fence(self, w: Worker) -> None:
        """`w` was declared lost (or released): its address no longer names it."""
        if self.by_address.get(w.address) == w.id:
            del self.by_address[w.address]

    def alive(self, worker_id: str) -> bool:
        w = self.workers.get(worker_id)
        return w is not None and w.state != st.LOST

    def waits_for(self, worker_id: str, seq: int) -> bool:
        """Is Execute `seq` of the worker still to be waited for (alive, not completed)?"""
        w = self.workers.get(worker_id)
        return w is not None and w.state != st.LOST and w.completed < seq

    def address(self, worker_id: str) -> str:
        return self.workers[worker_id].address

    def order(self, worker_ids: Iterable[str]) -> list[str]:
        """`worker_ids` in registration order."""
        return sorted(worker_ids, key=lambda w: self.workers[w].order)

    def prune_lost(self) -> None:
        """Forget the oldest lost workers nothing refers to, keeping `lost_workers_kept` for Status."""
        idle = sorted((w for w in self.workers.values() if w.state == st.LOST and not w.sessions),
                      key=lambda w: w.order)
        for w in idle[:max(0, len(idle) - self.lost_workers_kept)]:
            del self.workers[w.id]

    def recall(self, w: Worker) -> None:
        """Know a lost worker again that was forgotten meanwhile (a rebuild gives up: devices go back to it)."""
        self.workers.setdefault(w.id, w)

    def describe_workers(self) -> str:
        return ", ".join(f"{w.id} {w.state}" for w in sorted(self.workers.values(), key=lambda w: w.order)) or "none"

    # ------------------------------------------------------------ sessions

    def bind(self, s: Session, device: int, worker_id: str) -> None:
        w = self.workers[worker_id]
        s.devices[device] = worker_id
        w.sessions.add(s.id)
        w.bound += 1

    def unbind(self, s: Session, device: int) -> None:
        w = self.workers[s.devices.pop(device)]
        s.comm.bump()  # the device moves (rebuild, migration, relocation, growth, shrink, drain): new process groups
        w.bound -= 1
        if w.id not in s.devices.values():
            w.sessions.discard(s.id)

    def unbind_all(self, s: Session) -> None:
        """The session closed: its workers host nothing of it any more (`s.devices` stays, for the record)."""
        for worker_id in s.devices.values():
            w = self.workers[worker_id]
            w.bound -= 1
            w.sessions.discard(s.id)

    def locations(self, s: Session) -> dict[int, str]:
        """Logical device -> address of its worker, for the client."""
        return {d: self.workers[w].address for d, w in sorted(s.devices.items())}

    def find_session(self, text: str) -> tuple[Session | None, str]:
        """A session by id or unique prefix (of 4 characters or more); else None and a one-line reason."""
        if text in self.sessions:
            return self.sessions[text], ""
        hits = [s for sid, s in self.sessions.items() if len(text) >= 4 and sid.startswith(text)]
        if len(hits) == 1:
            return hits[0], ""
        known = ", ".join(sorted(sid[:8] for sid in self.sessions)) or "none"
        if len(hits) > 1:
            return None, f"session prefix {text[:16]!r} is ambiguous ({len(hits)} sessions match)"
        return None, f"unknown session {text[:16]!r} (sessions: {known})"
