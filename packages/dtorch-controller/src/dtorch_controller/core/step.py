"""The working context of one event: its time, the effects so far, and what is left for the settle pass.

Rules:

1. `ControllerCore.handle` makes one `Step` per event and hands it to the handler and to every component the
   handler uses. Components never call back into the controller: what they want done that is not theirs they
   put here (effects, scheduler `Changes` to apply, sessions to look at again) and the controller does it.
2. `changes` are the scheduler's decisions not applied yet; the controller applies them (binding devices, holding
   and releasing frozen sessions, queueing moves) before the event ends.
3. `touched` sessions are looked at again before the event ends (their copies, rebuild, moves, snapshot) until
   nothing changes any more, and their pending Syncs are answered when they can be. Touch a session when
   something of it changed that may let it move on, never when nothing did: that is what ends the settle pass.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from dtorch_controller.core import effects as fx
from dtorch_controller.core.eventlog import EventLog
from dtorch_controller.core.model import Worker
from dtorch_controller.core.scheduler import Changes


@dataclass(slots=True, init=False)  # one per event: slots make it cheaper to make and to read
class Step:
    now: float
    log: EventLog
    out: list[fx.Effect]
    changes: list[Changes]  # the scheduler's decisions, to apply
    touched: set[str]  # sessions to look at again in the settle pass
    pumped: set[str]  # a snapshot may be due: batches went out, or a KeepAlive of a client keeping uploads for one
    synced: set[str]  # sessions whose Syncs may be answerable
    reporter: Worker | None  # the worker whose report this is: sessions waiting for it move on
    completed: bool  # ... and it completed more work (its deletes and parked Syncs may go on)
    everyone: bool  # look at every active session (a worker was lost)

    def __init__(self, now: float, log: EventLog, out: list[fx.Effect] | None = None) -> None:
        # written out: the generated one calls a factory per field (a step per event, millions on a long run)
        self.now, self.log, self.out = now, log, [] if out is None else out
        self.changes, self.touched, self.pumped, self.synced = [], set(), set(), set()
        self.reporter, self.completed, self.everyone = None, False, False

    def emit(self, effect: fx.Effect) -> None:
        self.out.append(effect)

    def reply(self, request_id: Hashable, message: Any) -> None:
        self.out.append(fx.Reply(request_id, message))

    def refuse(self, request_id: Hashable, message: str, kind: str = "refused") -> None:
        self.out.append(fx.Reply(request_id, fx.Refusal(kind, message)))  # type: ignore[arg-type]

    def note(self, text: str) -> None:
        """A line for the event log (Status shows the recent ones)."""
        self.log.add(self.now, text)

    def apply(self, changes: Changes) -> None:
        self.changes.append(changes)

    def touch(self, session: str) -> None:
        self.touched.add(session)
        self.synced.add(session)
