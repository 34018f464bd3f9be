"""Worker and session lifecycles as tables: the one place that says which state follows which.

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
   nothing of any session is left on it (recovery.py, migration.py).
6. A session whose worker was lost is `recovering` while its shards are rebuilt (its batches are held);
   one whose logical device is being moved is `migrating` (held too). `degraded` means data was lost for
   good: the client was told at a sync point, and no later loss is recovered.
"""

from __future__ import annotations

from collections.abc import Mapping

# ---------------------------------------------------------------- workers

ALIVE = "alive"  # heard from within the suspect window
SUSPECT = "suspect"  # silent for a while, not yet declared lost
DRAINING = "draining"  # leaving on purpose: keeps its tensors, gets no new devices (used by a later issue)
LOST = "lost"  # declared dead and fenced

REPORT = "report"  # a heartbeat/completion report arrived
SILENT = "silent"  # no report for Config.suspect_after_s
TIMEOUT = "timeout"  # no report for Config.heartbeat_timeout_s
UNREACHABLE = "unreachable"  # the adapter could not deliver a command batch
REPLACED = "replaced"  # a new worker registered at the same address (the process restarted)
DRAIN = "drain"  # an operator asked the worker to leave
RELEASE = "release"  # a draining worker holds nothing any more: it leaves (fenced, it exits)

_GONE = {TIMEOUT: LOST, UNREACHABLE: LOST, REPLACED: LOST}

WORKER_TABLE: Mapping[str, Mapping[str, str]] = {
    ALIVE: {REPORT: ALIVE, SILENT: SUSPECT, DRAIN: DRAINING, **_GONE},
    SUSPECT: {REPORT: ALIVE, SILENT: SUSPECT, DRAIN: DRAINING, **_GONE},
    DRAINING: {REPORT: DRAINING, SILENT: DRAINING, DRAIN: DRAINING, RELEASE: LOST, **_GONE},
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


class IllegalTransition(RuntimeError):
    """The core fed an event its table does not allow: a bug in the core."""


def step(table: Mapping[str, Mapping[str, str]], state: str, event: str) -> str:
    """The state that follows `state` on `event`, or IllegalTransition."""
    try:
        return table[state][event]
    except KeyError:
        raise IllegalTransition(f"no transition from {state!r} on {event!r}") from None
