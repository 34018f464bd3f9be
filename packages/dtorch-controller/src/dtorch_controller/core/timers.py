"""Timer keys: what each `SetTimer` asks to be woken for. The core handles a `TimerFired` by the type of its key.

Rules:

1. Every timer the core sets has one of these keys; its fields say what to look at again. A `SetTimer` with an
   equal key replaces the earlier one (adapters keep one timer per key).
2. A timer may fire late, early, twice or after it stopped mattering: its handler rechecks the state, and a key
   of an unknown type is ignored.
3. Keys are small frozen values. An adapter may look at a key's type (the simulator files `Heartbeat` deadlines
   into its heartbeat slots) but never takes a key apart.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class Heartbeat:
    """The worker's next report is due: suspect or lost if it stays silent (controller.py)."""

    worker: str


@dataclass(frozen=True)
class SyncDeadline:
    """A parked Sync runs out of time (its `timeout_s`)."""

    session: str
    request: Hashable


@dataclass(frozen=True)
class ClientSilence:
    """The client may have gone: its session closes when it said nothing for `session_timeout_s`."""

    session: str


@dataclass(frozen=True)
class PolicyTick:
    """The scheduling policy's next deadline (a LAS threshold, a starvation promotion, a relocation's patience)."""


@dataclass(frozen=True)
class AdminDeadline:
    """A Migrate or Drain request is answered "still in progress" at its timeout (moves.py); the work goes on."""

    request: Hashable


TimerKey = Heartbeat | SyncDeadline | ClientSilence | PolicyTick | AdminDeadline
