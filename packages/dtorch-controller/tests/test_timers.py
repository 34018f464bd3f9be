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
