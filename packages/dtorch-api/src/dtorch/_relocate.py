"""Where did a logical device go? What the data plane asks the controller when a worker stops serving it.

The client talks to workers directly (Put, Pull) at the addresses it last heard of. A logical device
may since have moved (migration, drain: the old worker answers with kind MOVED) or its worker may have been
lost (recovery rebinds the device: the connection fails). Then the client asks the controller where
the device is now (Status: session -> device -> worker -> address), waiting while the controller has
not rebound it yet, and tries again there; bounded by the session's timeout.

A worker that stopped (SIGSTOP, a hung host) neither answers nor refuses: a transfer to it would wait
for its whole timeout. So a transfer still running after a second is watched: once the controller
says the device is elsewhere (or its worker was lost), the call is cancelled and retried there. One thread of
the process (`_Watcher`) looks for every transfer, so a transfer starts no thread of its own (`Thread.start` waits
until the new thread holds the GIL: on a busy client, up to a switch interval per transfer); a look at the
controller is bounded (Status, 10 s), and a slow one delays the others' looks by at most that.

Everything here reads the controller through a `look(device) -> Seen` function and returns addresses or
raises; it writes no one else's state.

Rules (`relocate`), on each look at the controller:
  session not recovering/migrating and the device's worker gone or not live  -> DeviceLost (for good)
  device on a live worker at another address                                 -> that address
  device still at the stale address                                          -> retry there after 2 s
  otherwise (being rebound)                                                  -> look again in POLL_S
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtorch.errors import ClusterError
from dtorch_protocol import messages as m

POLL_S = 0.05
_monotonic = time.monotonic  # the watcher's clock (tests replace `time` here to drive `relocate`)
LIVE = ("alive", "suspect", "draining")
BUSY = ("recovering", "migrating")  # session states in which a device is being rebound


class Moved(Exception):
    """A worker said the device's shards moved away from it."""


class DeviceLost(ClusterError):
    """The device's worker is gone for good (not rebuilt): the loss error is waiting at the next sync."""

    def __init__(self, device: int, worker: str | None) -> None:
        self.device, self.worker = device, worker
        super().__init__(f"logical device {device} was on worker {worker}, which was lost")


def moved_error(e: BaseException) -> bool:
    return getattr(e, "kind", None) == m.ErrorKind.MOVED


@dataclass(frozen=True)
class Seen:
    """What the controller says about one logical device of this session."""

    session_state: str | None  # None: the controller does not know the session
    worker: str | None
    worker_state: str | None  # None: no such worker
    address: str | None

    @property
    def live(self) -> bool:
        return self.worker_state in LIVE


def seen(reply: m.StatusReply, session: str, device: int) -> Seen:
    mine = next((s for s in reply.sessions if s.session == session), None)
    where = mine.devices.get(device) if mine is not None else None
    worker = next((w for w in reply.workers if w.worker == where), None)
    return Seen(mine.state if mine is not None else None, where,
                worker.state if worker is not None else None, worker.address if worker is not None else None)


Look = Callable[[int], Seen]


def relocate(look: Look, device: int, stale: str, deadline: float) -> str:
    """Poll the controller until `device` sits on a live worker other than `stale` (or time runs out); the
    table at the top of this module."""
    same_since: float | None = None
    while True:
        s = look(device)
        now = time.monotonic()
        if s.session_state is not None and s.session_state not in BUSY and not s.live:
            raise DeviceLost(device, s.worker)
        if s.live:
            if s.address != stale:
                return s.address  # type: ignore[return-value]
            # still there: a passing failure, or the loss is not detected yet; retry after a while anyway
            same_since = same_since if same_since is not None else now
            if now - same_since > 2.0:
                return stale
        if now >= deadline:
            raise ClusterError(f"logical device {device} has no live worker (it was on {stale})")
        time.sleep(POLL_S)


class _Watcher:
    """One daemon thread that runs every Watch's looks when they are due (started with the first Watch). It is woken
    only by a look due before every other's, and drops the entries of ended transfers from the top of its heap before
    each wait: a read every few milliseconds (each due a second later) costs the thread about one wake-up a second,
    not one per read (each a GIL handoff on a busy client)."""

    def __init__(self, name: str = "dtorch-watch") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Watch]] = []  # (when, order, watch): a heap
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, when: float, watch: Watch) -> None:
        with self._cond:
            entry = (when, next(self._order), watch)
            heapq.heappush(self._due, entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            if self._due[0] is entry:  # else the thread's timed wait already ends before this one is due: a wake-up
                self._cond.notify()  # of another thread on every transfer costs a busy client a GIL handoff

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._due and self._due[0][2].ended:  # transfers that ended: dropped without a wake-up each
                        heapq.heappop(self._due)
                    if self._due and self._due[0][0] <= (now := _monotonic()):
                        break
                    self._cond.wait(self._due[0][0] - now if self._due else None)
                _when, _order, watch = heapq.heappop(self._due)
            try:
                watch.check()
            except Exception:  # noqa: BLE001 - a failed cancel must not end the looks of every other transfer
                pass


_WATCHER = _Watcher()


class Watch:
    """Cancel a call to `address` for `device` once the controller no longer has the device there (looked at every
    `every_s` while the call runs, on the process's one watcher thread)."""

    def __init__(self, look: Look, device: int, address: str, cancel: Callable[[], Any],
                 every_s: float = 1.0) -> None:
        self.look, self.device, self.address, self.cancel, self.every_s = look, device, address, cancel, every_s
        self.fired = False
        self._done = threading.Event()

    def __enter__(self) -> Watch:
        _WATCHER.at(_monotonic() + self.every_s, self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()  # its entry is dropped once it reaches the top of the heap, or when due

    @property
    def ended(self) -> bool:
        return self._done.is_set()

    def check(self) -> None:
        """One look (the watcher calls it when due): cancel the call if the device left, else look again later."""
        if self._done.is_set():
            return
        try:
            s = self.look(self.device)
        except Exception:  # noqa: BLE001 - the controller is busy or away: look again later
            s = None
        if s is not None and (not s.live or s.address != self.address):
            self.fired = True
            self.cancel()
        elif not self._done.is_set():
            _WATCHER.at(_monotonic() + self.every_s, self)
