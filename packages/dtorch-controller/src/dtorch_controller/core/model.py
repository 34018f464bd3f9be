"""The records the core keeps: workers, sessions, meshes. Plain data, mutated only by the core."""

from __future__ import annotations

from collections.abc import Hashable
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
    last_heard: float = 0.0  # the last request naming this session (liveness)
    state: str = st.OPEN
    devices: dict[int, str] = field(default_factory=dict)  # logical device -> worker id
    meshes: dict[int, Mesh] = field(default_factory=dict)
    tensors: dict[int, m.TensorSpec] = field(default_factory=dict)  # live tensors by tid
    seq: int = 0  # last accepted Submit batch
    sent: dict[str, int] = field(default_factory=dict)  # worker -> last Execute seq sent for this session
    errors: list[m.ErrorReport] = field(default_factory=list)  # surfaced (and cleared) at the next Sync
    syncs: dict[Hashable, PendingSync] = field(default_factory=dict)
    readers: dict[int, dict[str, int]] = field(default_factory=dict)  # tid -> remote reader worker -> Execute seq
    deferred: list[DeferredDelete] = field(default_factory=list)
    comm: CommGroups = field(default_factory=CommGroups)  # process groups of its collectives (collectives.py)
