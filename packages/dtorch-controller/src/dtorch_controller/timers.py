"""One thread that fires the core's timers: a heap of deadlines and a condition variable.

The thread waits for the earliest deadline; a timer set for later does not wake it (the core sets one at nearly every
event it handles, and waking the thread for each cost a context switch and a turn of the GIL every time)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger("dtorch_controller.timers")

# The longest single wait: a deadline further off (a policy's backfill_after=1e308) is waited for in such steps
MAX_WAIT_S = 3600.0


class TimerThread:
    """Calls `fire(key)` once `clock()` reaches each timer's deadline; a new timer replaces one with the same key."""

    def __init__(self, fire: Callable[[Hashable], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._fire = fire
        self._clock = clock
        self._heap: list[tuple[float, int, Hashable]] = []
        self._current: dict[Hashable, int] = {}  # key -> tie-break number of its live entry
        self._numbers = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="dtorch-controller-timers", daemon=True)
        self._thread.start()

    def set(self, at: float, key: Hashable) -> None:
        with self._cond:
            number = next(self._numbers)
            self._current[key] = number
            heapq.heappush(self._heap, (at, number, key))
            if self._heap[0][1] == number:  # the earliest now; else the thread's wait ends before this is due
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _next_due(self) -> Hashable | None:
        """Wait for the earliest live timer; returns its key, or None once stopped."""
        with self._cond:
            while not self._stopped:
                if not self._heap:
                    self._cond.wait()
                    continue
                at, number, key = self._heap[0]
                if self._current.get(key) != number:  # replaced by a later set()
                    heapq.heappop(self._heap)
                    continue
                delay = at - self._clock()
                if delay > 0:  # at most MAX_WAIT_S at a time: a wait of 1e308 s raised OverflowError, ending the thread
                    self._cond.wait(min(delay, MAX_WAIT_S))
                    continue
                heapq.heappop(self._heap)
                del self._current[key]
                return key
            return None

    def _run(self) -> None:
        while (key := self._next_due()) is not None:
            try:
                self._fire(key)
            except Exception:  # a failing timer must not stop the others
                log.exception("timer %r failed", key)
