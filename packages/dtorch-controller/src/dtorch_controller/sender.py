"""Execute batches on their way to workers: in order per worker, on a few long-lived threads.

Rules:

1. `send(address, deliver)` never blocks: it queues `deliver` (a blocking call to the worker and what follows it)
   behind the address's earlier ones. Each address's queue is drained by one pool thread at a time, so a worker
   receives its batches in the order they were sent (it would reorder them by seq anyway, within bounds), and
   different workers' batches go out in parallel, up to THREADS at once.
2. Why not a gRPC future per call (what the adapter did): gRPC's sync stack starts a thread per channel for the
   futures in flight and ends it when none is left, so every burst of batches started one thread per worker, and
   `Thread.start` waits until the new thread holds the GIL: up to a switch interval (5 ms) on a busy controller,
   which delayed the second worker's batch of a TP step by that much (traced: 0.2-4.6 ms per call).
3. A worker that never answers holds one thread until the call's own timeout (Execute's, 60 s); the others go on
   serving the other addresses. `close` drops what is still queued.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("dtorch_controller.sender")

THREADS = 32  # workers reached at once; idle ones cost nothing, and they are started only when needed


class Sender:
    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dtorch-send")
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Callable[[], None]]] = {}  # address -> waiting; present while being drained
        self._closed = False

    def send(self, address: str, deliver: Callable[[], None]) -> None:
        """Queue `deliver` behind the address's earlier ones (rule 1)."""
        with self._lock:
            if self._closed:
                return
            queue = self._queues.get(address)
            if queue is not None:
                queue.append(deliver)
                return
            self._queues[address] = deque([deliver])
        self._pool.submit(self._drain, address)

    def _drain(self, address: str) -> None:
        while True:
            with self._lock:
                queue = self._queues[address]
                if not queue or self._closed:
                    del self._queues[address]
                    return
                deliver = queue.popleft()
            try:
                deliver()
            except Exception:  # noqa: BLE001 - one failed delivery must not strand the others queued here
                log.exception("sending to %s failed", address)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
