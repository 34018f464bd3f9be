"""Process lifetime shared by the controller and worker CLIs: exit with the process that started us."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

_STARTED_UNDER = os.getppid()


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
