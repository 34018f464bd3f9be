"""What the controller asks its adapter to do: the outputs of `ControllerCore.handle`.

The adapter performs them in list order, outside any lock it holds around the core; their outcomes
come back as new events (a failed send as `events.WorkerUnreachable`, a due timer as `events.TimerFired`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Literal

from dtorch_protocol import messages as m


@dataclass(frozen=True)
class Refusal:
    """A request the core declines. The server raises `wire.ProtocolError` for kind "protocol" (bad
    handshake), `wire.LimitExceeded` for "quota" (a tenant's quota), `wire.Conflict` for "conflict" (may
    change: an address held by a live worker) and `wire.RemoteError` for "refused" (unknown session,
    out-of-order batch, ...)."""

    kind: Literal["protocol", "refused", "quota", "conflict"]
    message: str


@dataclass(frozen=True)
class Reply:
    """Answer request `request_id` with a reply message of its method, or with a `Refusal`."""

    request_id: Hashable
    message: Any


@dataclass(frozen=True)
class SendExecute:
    """Deliver one command batch. Batch seqs per worker are contiguous from 1; the worker runs them in order."""

    worker_id: str
    address: str
    execute: m.Execute


@dataclass(frozen=True)
class SetTimer:
    """Feed `TimerFired(key)` once the clock reaches `at`; replaces an earlier timer with the same key."""

    at: float
    key: Hashable


Effect = Reply | SendExecute | SetTimer
