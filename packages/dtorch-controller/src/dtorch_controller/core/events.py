"""What can happen to the controller: the inputs of `ControllerCore.handle`.

Requests that need an answer carry a `request_id` chosen by the adapter (any hashable value, unique
among requests in flight); the answer comes back as `effects.Reply(request_id, ...)`, at once or later.
`msg` is the validated wire message. `who` is the tenant the adapter authenticated (from its API key):
a session belongs to the tenant that opened it, and only that tenant may name it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from dtorch_controller.core.timers import TimerKey
from dtorch_protocol import messages as m

RequestId = Hashable


@dataclass(frozen=True)
class Quota:
    """What a tenant may hold at once, set by the admin (`dtorch-controller keys quota`); 0 = no limit."""

    devices: int = 0  # logical devices over all its sessions
    memory_bytes: int = 0  # device memory its leases may take (a whole device counts all of its memory)
    sessions: int = 0  # open sessions


@dataclass(frozen=True)
class Principal:
    """Who sent a request: a tenant (its sessions only) or an admin (also sees everyone's in Status)."""

    tenant: str
    admin: bool = False
    quota: Quota = Quota()


OPERATOR = Principal(tenant="", admin=True)  # in-process callers the adapter is not between: simulator, tests

# ---------------------------------------------------------------- from clients


@dataclass(frozen=True)
class OpenSession:
    request_id: RequestId
    msg: m.OpenSession
    who: Principal = OPERATOR


@dataclass(frozen=True)
class OpenMesh:
    request_id: RequestId
    msg: m.OpenMesh
    who: Principal = OPERATOR


@dataclass(frozen=True)
class Submit:
    request_id: RequestId
    msg: m.Submit
    who: Principal = OPERATOR
    carried: bool = False  # the batch rides in a Sync (protocol 1.7): that Sync answers what a Submit's answer would


@dataclass(frozen=True)
class Sync:
    """Answered when the session's workers have caught up, or when `msg.timeout_s` runs out."""

    request_id: RequestId
    msg: m.Sync
    who: Principal = OPERATOR


@dataclass(frozen=True)
class CloseSession:
    request_id: RequestId
    msg: m.CloseSession
    who: Principal = OPERATOR


@dataclass(frozen=True)
class KeepAlive:
    """The client is still there (sent every `SessionOpened.keepalive_s`)."""

    request_id: RequestId
    msg: m.KeepAlive
    who: Principal = OPERATOR


@dataclass(frozen=True)
class Status:
    request_id: RequestId
    msg: m.StatusRequest = m.StatusRequest()
    who: Principal = OPERATOR


# ---------------------------------------------------------------- from workers


@dataclass(frozen=True)
class Register:
    request_id: RequestId
    msg: m.RegisterWorker


@dataclass(frozen=True, init=False)
class Report:
    """A heartbeat, completion and error report in one."""

    request_id: RequestId
    msg: m.WorkerReport

    def __init__(self, request_id: RequestId, msg: m.WorkerReport) -> None:
        # frozen, but made without the generated __init__'s object.__setattr__ per field: one per completed batch
        self.__dict__.update(request_id=request_id, msg=msg)


@dataclass(frozen=True)
class WorkersAlive:
    """Reports with nothing new, several at once: each worker in `workers` (worker id -> the utilization it reported,
    -1 if none) reported now with the same `completed`, no errors and the same shards as in its last report. The core
    handles it as one such `Report` per worker, in order (liveness, a suspect worker back, memory caps, what waited
    for it), and answers once, with `effects.AliveReply` naming the workers it fences (each would have been answered
    "fenced"). For an adapter that batches the empty heartbeats of many workers (the simulator, per heartbeat slot):
    one event instead of one per worker."""

    request_id: RequestId
    workers: Mapping[str, float]


# ---------------------------------------------------------------- from operators (admin)


@dataclass(frozen=True)
class Drain:
    """Move everything off a worker, then release it; answered when done or at `msg.timeout_s`."""

    request_id: RequestId
    msg: m.DrainRequest


@dataclass(frozen=True)
class Migrate:
    """Move one logical device of a running session to another worker; answered with the move's report."""

    request_id: RequestId
    msg: m.MigrateRequest


# ---------------------------------------------------------------- from the adapter


@dataclass(frozen=True)
class TimerFired:
    """A `SetTimer` came due. Stale or early firings are harmless: the core rechecks its state (timers.py)."""

    key: TimerKey


@dataclass(frozen=True)
class WorkerUnreachable:
    """Sending a command batch to a worker failed (or it refused the batch): its later batches cannot run."""

    worker_id: str
    address: str = ""
    message: str = ""


Event = (OpenSession | OpenMesh | Submit | Sync | CloseSession | KeepAlive | Status | Register | Report | WorkersAlive
         | TimerFired | WorkerUnreachable | Drain | Migrate)
