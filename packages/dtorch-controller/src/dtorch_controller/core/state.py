"""Lifecycles as tables: the one place that says which state follows which (workers, sessions, rebuilds, drains,
moves) and what holds a session's batches back.

Rules (in the spirit of h11's `_state.py`):

1. A worker or session changes state only through `step(TABLE, state, event)`. The tables below are
   the whole lifecycle; read them, not the code that feeds them.
2. A (state, event) pair missing from a table is a bug in the core, never a client's fault, and raises
   `IllegalTransition`. The core only feeds events that make sense in the current state (a report
   from a lost worker is answered "fenced" before it gets here).
3. `lost` is terminal: a worker that was declared lost is fenced for good and must register again,
   under a new id, with an empty tensor store. This is what makes a late report from a worker that
   was merely slow harmless.
4. Only `alive` workers receive new logical devices. `suspect` workers keep theirs and still get
   commands: one missed heartbeat is not a fault.
5. A drained worker is released through `lost` (event `release`): fenced like a dead one, but only once
   nothing of any session is left on it (drain.py). A drain that fails puts its worker back to `alive` (event
   `drain_failed`): it keeps what did not move and takes new devices again, as before the drain.
6. A session whose worker was lost is `recovering` while its shards are rebuilt (its batches are held);
   one whose logical device is being moved is `migrating` (held too). `degraded` means data was lost for
   good: the client was told at a sync point, and no later loss is recovered.
7. A rebuild (recovery.py) goes placing -> resetting -> replaying -> done; another loss during any phase starts
   it over at placing (every phase can be done again).
8. A drain (drain.py) goes moving -> protecting -> released; a failure ends it at any phase (the reason is kept).
9. A move of logical devices (moves.py) is queued, then copying (a pull move first waits, holding the session's
   batches, until its source finished the session's work), then done or called off. A drain's move that a
   rebuild interrupts goes back to queued and is tried again.
10. A session's accepted batches go out in order while nothing holds them (`Hold`): frozen by the scheduler,
   recovering, or migrating. `HOLDS` says, for each, whether a Sync waits for it even when no batch is held,
   and whether a snapshot may be taken meanwhile.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

# ---------------------------------------------------------------- workers

ALIVE = "alive"  # heard from within the suspect window
SUSPECT = "suspect"  # silent for a while, not yet declared lost
DRAINING = "draining"  # leaving on purpose: keeps its tensors, gets no new devices (drain.py)
LOST = "lost"  # declared dead and fenced

REPORT = "report"  # a heartbeat/completion report arrived
SILENT = "silent"  # no report for Config.suspect_after_s
TIMEOUT = "timeout"  # no report for Config.heartbeat_timeout_s
UNREACHABLE = "unreachable"  # the adapter could not deliver a command batch
DRAIN = "drain"  # an operator asked the worker to leave
RELEASE = "release"  # a draining worker holds nothing any more: it leaves (fenced, it exits)
DRAIN_FAILED = "drain_failed"  # its drain failed: it serves as before

_GONE = {TIMEOUT: LOST, UNREACHABLE: LOST}

WORKER_TABLE: Mapping[str, Mapping[str, str]] = {
    ALIVE: {REPORT: ALIVE, SILENT: SUSPECT, DRAIN: DRAINING, **_GONE},
    SUSPECT: {REPORT: ALIVE, SILENT: SUSPECT, DRAIN: DRAINING, **_GONE},
    DRAINING: {REPORT: DRAINING, SILENT: DRAINING, DRAIN: DRAINING, RELEASE: LOST, DRAIN_FAILED: ALIVE, **_GONE},
    LOST: {},
}

PLACEABLE = frozenset({ALIVE})  # states that may receive new logical devices

# ---------------------------------------------------------------- sessions

OPEN = "open"  # every logical device it uses sits on a worker that is not lost
RECOVERING = "recovering"  # a worker it used was lost: shards are being rebuilt elsewhere, batches held
MIGRATING = "migrating"  # a logical device is being copied to another worker, batches held
DEGRADED = "degraded"  # some logical device's data was lost with its worker and could not be rebuilt
CLOSED = "closed"

WORKER_LOST = "worker_lost"  # ... and its shards cannot be rebuilt
RECOVER = "recover"  # ... and they can: rebuild them
RECOVERED = "recovered"
MOVE = "move"
MOVED = "moved"
CLOSE = "close"

SESSION_TABLE: Mapping[str, Mapping[str, str]] = {
    OPEN: {WORKER_LOST: DEGRADED, RECOVER: RECOVERING, MOVE: MIGRATING, CLOSE: CLOSED},
    RECOVERING: {RECOVER: RECOVERING, RECOVERED: OPEN, WORKER_LOST: DEGRADED, CLOSE: CLOSED},
    MIGRATING: {MOVED: OPEN, RECOVER: RECOVERING, WORKER_LOST: DEGRADED, CLOSE: CLOSED},
    DEGRADED: {WORKER_LOST: DEGRADED, CLOSE: CLOSED},
    CLOSED: {},
}


# ---------------------------------------------------------------- rebuilds after a worker loss (recovery.py)


class RebuildPhase(enum.Enum):
    PLACING = "placing"  # lost logical devices are bound again through the scheduler
    RESETTING = "resetting"  # every worker of the session ran CmdAbandon (drops its known tensors)
    REPLAYING = "replaying"  # shards restored from the snapshot, the log replayed, CmdRebuilt sent
    DONE = "done"


BOUND = "bound"  # every logical device is on a live worker: reset them
RESET = "reset"  # every worker ran the CmdAbandon: restore and replay
REPLAYED = "replayed"  # every worker ran the replay and CmdRebuilt
LOSS = "loss"  # another worker was lost meanwhile: start over

REBUILD_TABLE: Mapping[RebuildPhase, Mapping[str, RebuildPhase]] = {
    RebuildPhase.PLACING: {BOUND: RebuildPhase.RESETTING, LOSS: RebuildPhase.PLACING},
    RebuildPhase.RESETTING: {RESET: RebuildPhase.REPLAYING, LOSS: RebuildPhase.PLACING},
    RebuildPhase.REPLAYING: {REPLAYED: RebuildPhase.DONE, LOSS: RebuildPhase.PLACING},
    RebuildPhase.DONE: {},
}

# ---------------------------------------------------------------- drains (drain.py)


class DrainPhase(enum.Enum):
    MOVING = "moving"  # each session's devices move off the worker
    PROTECTING = "protecting"  # sessions whose copies sat on it take a snapshot elsewhere
    RELEASED = "released"  # nothing left on it: fenced, it exits


MOVED_OFF = "moved_off"
PROTECTED = "protected"

DRAIN_TABLE: Mapping[DrainPhase, Mapping[str, DrainPhase]] = {
    DrainPhase.MOVING: {MOVED_OFF: DrainPhase.PROTECTING},
    DrainPhase.PROTECTING: {PROTECTED: DrainPhase.RELEASED},
    DrainPhase.RELEASED: {},
}

# ---------------------------------------------------------------- moves of logical devices (moves.py)


class MovePhase(enum.Enum):
    QUEUED = "queued"  # behind the session's running move, or waiting for the session to be open
    WAITING = "waiting"  # a pull move: batches held until the source finished the session's work
    COPYING = "copying"  # the copy command is on its way (`seq` on the worker that copies)
    DONE = "done"  # devices rebound to the target
    CALLED_OFF = "called off"  # the source keeps them


HOLD = "hold"  # a pull move holds the session's batches until its source finished the session's work
START = "start"
COPIED = "copied"
GONE = "gone"  # a drain's move found its devices gone from the worker already: nothing to do
FAIL = "fail"
RETRY = "retry"  # a rebuild interrupted a drain's move: it is tried again afterwards

MOVE_TABLE: Mapping[MovePhase, Mapping[str, MovePhase]] = {
    MovePhase.QUEUED: {HOLD: MovePhase.WAITING, START: MovePhase.COPYING, GONE: MovePhase.DONE,
                       FAIL: MovePhase.CALLED_OFF},
    MovePhase.WAITING: {START: MovePhase.COPYING, FAIL: MovePhase.CALLED_OFF},
    MovePhase.COPYING: {COPIED: MovePhase.DONE, FAIL: MovePhase.CALLED_OFF, RETRY: MovePhase.QUEUED},
    MovePhase.DONE: {},
    MovePhase.CALLED_OFF: {},
}

# ---------------------------------------------------------------- what holds a session's batches (pipeline.py)


class Hold(enum.Enum):
    FROZEN = "frozen"  # preempted by the scheduler
    RECOVERING = "recovering"  # rebuilt after a worker loss
    MIGRATING = "migrating"  # a logical device is being moved


@dataclass(frozen=True)
class HoldRule:
    sync_waits: bool  # a Sync waits for the hold even when no batch is held
    snapshots: bool  # a snapshot may be taken while it holds


HOLDS: Mapping[Hold, HoldRule] = {
    # a frozen session's client sees Sync take longer only when it has batches held; its shards stay put
    Hold.FROZEN: HoldRule(sync_waits=False, snapshots=True),
    # its shards are being rebuilt: reads would see the middle of it; copies of what is going away are useless
    Hold.RECOVERING: HoldRule(sync_waits=True, snapshots=False),
    # its locations are about to change
    Hold.MIGRATING: HoldRule(sync_waits=True, snapshots=False),
}


class IllegalTransition(RuntimeError):
    """The core fed an event its table does not allow: a bug in the core."""


S = TypeVar("S", bound=Hashable)


def step(table: Mapping[S, Mapping[str, S]], state: S, event: str) -> S:
    """The state that follows `state` on `event`, or IllegalTransition."""
    try:
        return table[state][event]
    except KeyError:
        raise IllegalTransition(f"no transition from {state!r} on {event!r}") from None
