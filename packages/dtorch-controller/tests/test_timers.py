"""The controller's timer thread (timers.py), which fires the core's SetTimer effects on the wall clock."""

from __future__ import annotations

import threading
import time

from dtorch_controller.timers import TimerThread


def test_a_deadline_too_far_for_one_wait_keeps_the_thread_and_the_other_timers():
    """A policy may set a timer 1e308 s off (`--policy-param backfill_after=1e308` on a queued session): waiting for it
    raised OverflowError in the thread, which died, and no timer of the core (heartbeat deadlines, session timeouts)
    fired again."""
    fired: list[str] = []
    done = threading.Event()
    timers = TimerThread(lambda key: (fired.append(key), done.set()))
    try:
        timers.set(time.monotonic() + 1e308, "far")
        time.sleep(0.1)  # the thread now waits for "far"
        timers.set(time.monotonic() + 0.05, "near")
        assert done.wait(5) and fired == ["near"]
    finally:
        timers.stop()


def test_only_a_timer_due_before_the_one_waited_for_wakes_the_thread():
    """The core sets a timer at nearly every event; each woke the thread, which found nothing due and waited again (a
    context switch and a turn of the GIL each time). Now only a new earliest deadline wakes it, and every timer
    still fires in time, in deadline order."""
    fired: list[str] = []
    done = threading.Event()
    timers = TimerThread(lambda key: (fired.append(key), key == "last" and done.set()))
    wakes = []
    notify = timers._cond.notify
    timers._cond.notify = lambda n=1: (wakes.append(n), notify(n))  # (called with the condition held)
    try:
        now = time.monotonic()
        timers.set(now + 0.3, "last")
        for k in range(50):
            timers.set(now + 0.4 + k, f"later {k}")  # after the one waited for: no wake
        assert len(wakes) == 1
        timers.set(now + 0.1, "first")  # the new earliest: one wake
        timers.set(now + 0.2, "second")
        assert len(wakes) == 2
        assert done.wait(5) and fired == ["first", "second", "last"]
    finally:
        timers.stop()
