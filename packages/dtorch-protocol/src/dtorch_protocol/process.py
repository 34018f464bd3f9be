"""Process lifetime shared by the controller and worker CLIs: the signals they answer, and exiting with the
process that started us.

Signals (`on_signals`, installed by every long-running CLI):
  SIGTERM, SIGINT  stop cleanly (the CLI's `stop` event)
  SIGUSR1          print every thread's Python stack to stderr (its log) and go on: an operator's look into a
                   process that seems stuck (`kill -USR1 PID`), without a debugger or py-spy on the host
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable

_STARTED_UNDER = os.getppid()

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STACKS_SIGNAL = signal.SIGUSR1


def on_signals(stop: threading.Event) -> None:
    """Install the table above (from the main thread): a stop signal sets `stop`, SIGUSR1 prints the stacks."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    faulthandler.register(STACKS_SIGNAL, all_threads=True)


def watch_parent(pid: int, on_gone: Callable[[], None], interval_s: float = 0.5) -> threading.Thread:
    """The other half of `--parent-pid`: call `on_gone` once process `pid` has exited (daemon thread).

    A child of `pid` also notices being re-parented away from it, which survives pid reuse.
    """

    def alive() -> bool:
        if pid == _STARTED_UNDER:
            return os.getppid() == pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def watch() -> None:
        while alive():
            time.sleep(interval_s)
        on_gone()

    thread = threading.Thread(target=watch, name="dtorch-parent-watch", daemon=True)
    thread.start()
    return thread
