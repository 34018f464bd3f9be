"""What can happen to the controller: the inputs of `ControllerCore.handle`.

Requests that need an answer carry a `request_id` chosen by the adapter (any hashable value, unique
among requests in flight); the answer comes back as `effects.Reply(request_id, ...)`, at once or later.
`msg` is the validated wire message.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from dtorch_controller.core.timers import TimerKey
from dtorch_protocol import messages as m

RequestId = Hashable

# ---------------------------------------------------------------- from clients


@dataclass(frozen=True)
class OpenSession:
    request_id: RequestId
    msg: m.OpenSession


@dataclass(frozen=True)
class OpenMesh:
    request_id: RequestId
    msg: m.OpenMesh


@dataclass(frozen=True)
class Submit:
    request_id: RequestId
    msg: m.Submit


@dataclass(frozen=True)
class Sync:
    """Answered when the session's workers have caught up, or when `msg.timeout_s` runs out."""

    request_id: RequestId
    msg: m.Sync


@dataclass(frozen=True)
class CloseSession:
    request_id: RequestId
    msg: m.CloseSession


@dataclass(frozen=True)
class KeepAlive:
    """The client is still there (sent every `SessionOpened.keepalive_s`)."""

    request_id: RequestId
    msg: m.KeepAlive


@dataclass(frozen=True)
class Status:
    request_id: RequestId
    msg: m.StatusRequest = m.StatusRequest()


# ---------------------------------------------------------------- from workers


@dataclass(frozen=True)
class Register:
    request_id: RequestId
    msg: m.RegisterWorker


@dataclass(frozen=True)
class Report:
    """A heartbeat, completion and error report in one."""

    request_id: RequestId
    msg: m.WorkerReport


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


Event = (OpenSession | OpenMesh | Submit | Sync | CloseSession | KeepAlive | Status | Register | Report | TimerFired
         | WorkerUnreachable | Drain | Migrate)
