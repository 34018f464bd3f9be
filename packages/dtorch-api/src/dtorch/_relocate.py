"""Where did a logical device go? Uploads and reads retried on the device's new worker.

The client talks to workers directly (Put, Pull) at the addresses it last heard of. A logical device
may since have moved (migration, drain: the old worker answers with kind MOVED) or its worker may have been
lost (recovery rebinds the device: the connection fails). Then the client asks the controller where
the device is now (Status: session -> device -> worker -> address), waiting while the controller has
not rebound it yet, and tries again there; bounded by the session's timeout.

A worker that stopped (SIGSTOP, a hung host) neither answers nor refuses: a transfer to it would wait
for its whole timeout. So a transfer still running after a second is watched: once the controller
says the device is elsewhere (or its worker was lost), the call is cancelled and retried there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dtorch.errors import ClusterError
from dtorch_protocol import wire
from dtorch_protocol.messages import ErrorKind

if TYPE_CHECKING:
    from dtorch.session import Session

T = TypeVar("T")
POLL_S = 0.05
LIVE = ("alive", "suspect", "draining")


class Moved(Exception):
    """A worker said the device's shards moved away from it."""


def moved_error(e: BaseException) -> bool:
    return getattr(e, "kind", None) == ErrorKind.MOVED


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
        mine = next((s for s in reply.sessions if s.session == session.id), None)
        where = mine.devices.get(device) if mine is not None else None
        worker = next((w for w in reply.workers if w.worker == where), None)
        now = time.monotonic()
        if mine is not None and mine.state not in ("recovering", "migrating") and (
                worker is None or worker.state not in LIVE):
            # lost for good (not rebuilt): the loss error, naming the lost tensors, is waiting at the next sync
            raise _loss_error(session, device, where)
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


_loss_lock = threading.Lock()


def _loss_error(session: Session, device: int, worker: str | None) -> Exception:
    """The error a sync raises about the loss; every transfer that hits it (uploads run in parallel) raises it."""
    with _loss_lock:
        known = getattr(session, "_loss_error", None)
        if known is not None:
            return known
        try:
            session.sync()
        except Exception as e:  # noqa: BLE001 - that is the one
            session._loss_error = e  # type: ignore[attr-defined]
            return e
        return ClusterError(f"logical device {device} was on worker {worker}, which was lost")


class Watch:
    """Cancel a call to `address` for `device` once the controller no longer has the device there."""

    def __init__(self, session: Session, device: int, address: str, cancel: Callable[[], Any],
                 every_s: float = 1.0) -> None:
        self.session, self.device, self.address, self.cancel, self.every_s = session, device, address, cancel, every_s
        self.fired = False
        self._done = threading.Event()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Watch:
        self._arm()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self) -> None:
        if not self._done.is_set():
            self._timer = threading.Timer(self.every_s, self._check)
            self._timer.daemon = True
            self._timer.start()

    def _check(self) -> None:
        if self._done.is_set():
            return
        try:
            reply = self.session.status()
        except Exception:  # noqa: BLE001 - the controller is busy or away: look again later
            return self._arm()
        mine = next((s for s in reply.sessions if s.session == self.session.id), None)
        where = mine.devices.get(self.device) if mine is not None else None
        worker = next((w for w in reply.workers if w.worker == where), None)
        if worker is None or worker.state not in LIVE or worker.address != self.address:
            self.fired = True
            self.cancel()
            return
        self._arm()
