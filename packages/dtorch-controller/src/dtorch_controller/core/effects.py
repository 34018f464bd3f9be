"""What the controller asks its adapter to do, and what it tells observers: the outputs of `ControllerCore.handle`.

The adapter performs `Reply`, `SendExecute` and `SetTimer` in list order, outside any lock it holds around the
core; their outcomes come back as new events (a failed send as `events.WorkerUnreachable`, a due timer as
`events.TimerFired`). A `Notice` asks for nothing: it says what happened (a session placed, frozen, recovered;
a worker fenced, drained) for whoever watches the core from outside (the simulator counts them; the server's
metrics count and time them, metrics.py). Notices are the core's observer surface, with `view.CoreView` for
counts at any time.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dtorch_controller.core.timers import TimerKey
from dtorch_protocol import messages as m


@dataclass(frozen=True)
class Refusal:
    """A request the core declines. The server raises `wire.ProtocolError` for kind "protocol" (bad
    handshake), `wire.LimitExceeded` for "quota" (a tenant's quota), `wire.Conflict` for "conflict" (may
    change: an address held by a live worker) and `wire.RemoteError` for "refused" (unknown session,
    out-of-order batch, ...)."""

    kind: Literal["protocol", "refused", "quota", "conflict"]
    message: str


@dataclass(frozen=True, init=False)
class Reply:
    """Answer request `request_id` with a reply message of its method (`AliveReply` for `WorkersAlive`), or with a
    `Refusal`."""

    request_id: Hashable
    message: Any

    def __init__(self, request_id: Hashable, message: Any) -> None:
        # frozen, but made without the generated __init__'s object.__setattr__ per field: most events answer one
        self.__dict__.update(request_id=request_id, message=message)


@dataclass(frozen=True)
class AliveReply:
    """The answer to `events.WorkersAlive`: the workers among them that are fenced (unknown here or declared lost:
    each must stop, or register again), in the order given; empty when all are fine."""

    fenced: tuple[str, ...] = ()


@dataclass(frozen=True, init=False)
class SendExecute:
    """Deliver one command batch. Batch seqs per worker are contiguous from 1; the worker runs them in order."""

    worker_id: str
    address: str
    execute: m.Execute

    def __init__(self, worker_id: str, address: str, execute: m.Execute) -> None:
        # as Reply's: one per worker of every batch
        self.__dict__.update(worker_id=worker_id, address=address, execute=execute)


@dataclass(frozen=True)
class SetTimer:
    """Feed `TimerFired(key)` once the clock reaches `at`; replaces an earlier timer with the same key."""

    at: float
    key: TimerKey


# ---------------------------------------------------------------- notices (nothing to perform)


@dataclass(frozen=True)
class Notice:
    """Something happened that an observer may count; the adapter has nothing to do."""


@dataclass(frozen=True)
class Placed(Notice):
    """Logical devices of `session` were bound to workers (a mesh placed, a rebuild placing lost devices)."""

    session: str
    devices: Mapping[int, str]  # logical device -> worker


@dataclass(frozen=True)
class Accepted(Notice):
    """Batch `seq` of `session` was accepted: `instructions` to run (what the batch stands for once the core
    expanded it; the metrics' and usage records' instruction counts)."""

    session: str
    seq: int
    instructions: int


@dataclass(frozen=True)
class Queued(Notice):
    """A mesh request of `session` waits in the scheduler's queue."""

    session: str
    position: int


@dataclass(frozen=True)
class Frozen(Notice):
    """`session` was preempted: its batches are held, its shards stay where they are."""

    session: str


@dataclass(frozen=True)
class Resumed(Notice):
    """A frozen `session` runs again (its held batches go out)."""

    session: str


@dataclass(frozen=True)
class Relocated(Notice):
    """A frozen `session` resumes on substitute workers: its devices move off the workers it lost (lost -> new)."""

    session: str
    swap: Mapping[str, str]


@dataclass(frozen=True)
class Recovered(Notice):
    """`session` was rebuilt after a worker loss: `replayed` logged batches ran again on the new binding."""

    session: str
    seconds: float
    replayed: int


@dataclass(frozen=True)
class DataLost(Notice):
    """`session` lost data with a worker and could not be rebuilt (its next Sync raises); `why`: why not (recovery
    off, no complete snapshot, a copy lost too, ...). Once per loss that took data, rebuild tried or not."""

    session: str
    why: str


@dataclass(frozen=True)
class Fenced(Notice):
    """`worker` was declared lost, fenced for good: silent for the heartbeat timeout (`cause` "timeout") or a
    batch could not be delivered ("unreachable"). `silent_s`: from its last report to this (the detection
    latency, an upper bound on the time since it failed)."""

    worker: str
    reason: str
    cause: Literal["timeout", "unreachable"]
    silent_s: float


@dataclass(frozen=True)
class Moved(Notice):
    """Logical `devices` of `session` moved from worker `src` to `dst` (migrate, drain, growth, relocation)."""

    session: str
    devices: tuple[int, ...]
    src: str
    dst: str
    bytes: int
    downtime_s: float


@dataclass(frozen=True)
class Drained(Notice):
    """`worker` held nothing any more after a drain and was released (fenced: it exits)."""

    worker: str
    moves: int


Effect = Reply | SendExecute | SetTimer | Notice
