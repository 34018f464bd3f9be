"""Where did a logical device go? Uploads and reads retried on the device's new worker.

The client talks to workers directly (Put, Pull) at the addresses it last heard of. A logical device
may since have moved (migration, drain: the old worker answers "moved:") or its worker may have been
lost (recovery rebinds the device: the connection fails). Then the client asks the controller where
the device is now (Status: session -> device -> worker -> address), waiting while the controller has
not rebound it yet, and tries again there; bounded by the session's timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from dtorch.errors import ClusterError
from dtorch.protocol import wire

if TYPE_CHECKING:
    from dtorch.session import Session

T = TypeVar("T")
POLL_S = 0.05
LIVE = ("alive", "suspect", "draining")


class Moved(Exception):
    """A worker said the device's shards moved away from it."""


def moved_error(e: BaseException) -> bool:
    return "moved:" in str(e)


def relocating(session: Session, device: int, call: Callable[[str], T]) -> T:
    """`call(address)` on the device's worker; after "moved" or a lost connection, find it again and retry."""
    deadline = time.monotonic() + session.timeout
    while True:
        address = session._address(device)
        try:
            return call(address)
        except (ConnectionError, Moved, wire.RemoteError) as e:
            if isinstance(e, wire.RemoteError) and not moved_error(e):
                raise
            if time.monotonic() >= deadline:
                raise ClusterError(f"logical device {device} is unreachable: {e}") from None
            relocate(session, device, address, deadline)


def relocate(session: Session, device: int, stale: str, deadline: float) -> str:
    """Poll the controller until `device` sits on a live worker other than `stale` (or time runs out)."""
    same_since: float | None = None
    while True:
        reply = session.status()
        where = next((s.devices.get(device) for s in reply.sessions if s.session == session.id), None)
        worker = next((w for w in reply.workers if w.worker == where), None)
        now = time.monotonic()
        if worker is not None and worker.state in LIVE:
            if worker.address != stale:
                session._locations[device] = worker.address
                return worker.address
            # still there: a passing failure, or the loss is not detected yet; retry after a while anyway
            same_since = same_since if same_since is not None else now
            if now - same_since > 2.0:
                return stale
        if now >= deadline:
            raise ClusterError(f"logical device {device} has no live worker (it was on {stale})")
        time.sleep(POLL_S)
