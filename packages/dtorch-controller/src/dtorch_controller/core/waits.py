"""The wait index: which sessions a worker's report may let move on. Sans-IO.

Rules:

1. A session is *active* while it has copies being made, a rebuild or a move in flight (the controller decides,
   asking each feature). Active sessions are filed under the (worker, Execute seq) pairs they wait for.
2. A report of worker w looks only at the sessions filed under a seq w has now completed, plus the active sessions
   that wait on no seq (`poll`: the scheduler placing devices, a snapshot that could start and has not) and the ones
   not filed yet (`fresh`). Any other event that may unblock many sessions (a loss) looks at every active one.
   So a report costs O(sessions waiting on it), not O(sessions with copies), with thousands snapshotting.
3. Filing is idempotent; entries of sessions that moved on go stale and are skipped.
4. A parked Sync that waits for a worker is filed under that worker (`park`): its next report of a completion
   looks at the session again (`parked_on`), even when the worker hosts none of the session's devices any more
   (a shrunk or relocated session), and so does its loss. Each filing is used once.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from dtorch_controller.core.model import Worker


class WaitIndex:
    def __init__(self) -> None:
        self.active: set[str] = set()
        self.fresh: set[str] = set()  # active sessions not filed since they last changed
        self._wakes: dict[str, list[tuple[int, str]]] = {}  # worker -> heap of (Execute seq, session) waiting
        self._filed: set[tuple[str, int, str]] = set()  # (worker, seq, session) in `_wakes`
        self._poll: set[str] = set()  # active sessions waiting on no worker seq: looked at on every report
        self._parked: dict[str, set[str]] = {}  # worker -> sessions whose parked Syncs wait for it (rule 4)

    def start(self, sid: str) -> None:
        """The session waits for something: look at it on the next report, whoever sends it."""
        if sid not in self.active:
            self.active.add(sid)
            self.fresh.add(sid)

    def stop(self, sid: str) -> None:
        self.active.discard(sid)
        self.fresh.discard(sid)
        self._poll.discard(sid)

    def looked_at_by(self, reporter: Worker) -> set[str]:
        """Sessions a report of `reporter` may let move on (rule 2)."""
        return self._due(reporter) | self._poll | self.fresh

    def idle_for(self, reporter: Worker) -> bool:
        """True when a report of `reporter` has nothing to look at (`looked_at_by` would be empty): the idle
        heartbeat's fast path."""
        if self._poll or self.fresh:
            return False
        heap = self._wakes.get(reporter.id)
        return not heap or heap[0][0] > reporter.completed

    def _due(self, w: Worker) -> set[str]:
        """Sessions filed under an Execute seq `w` has now completed."""
        heap = self._wakes.get(w.id)
        due: set[str] = set()
        while heap and heap[0][0] <= w.completed:
            seq, sid = heapq.heappop(heap)
            self._filed.discard((w.id, seq, sid))
            due.add(sid)
        if heap is not None and not heap:
            del self._wakes[w.id]
        return due

    def file(self, sid: str, waits: Iterable[tuple[str, int]] | None) -> None:
        """File an active session under the (worker, seq) pairs it waits on; None or none: in `poll` (rule 1)."""
        self.fresh.discard(sid)
        if sid not in self.active:
            self._poll.discard(sid)
            return
        pairs = list(waits) if waits is not None else []
        if not pairs:
            self._poll.add(sid)
            return
        self._poll.discard(sid)
        for w, seq in pairs:
            if (w, seq, sid) not in self._filed:
                self._filed.add((w, seq, sid))
                heapq.heappush(self._wakes.setdefault(w, []), (seq, sid))

    def park(self, worker_id: str, sid: str) -> None:
        """The session's parked Syncs wait for the worker to complete its work (rule 4)."""
        self._parked.setdefault(worker_id, set()).add(sid)

    def parked_on(self, worker_id: str) -> set[str]:
        """The sessions whose parked Syncs waited for the worker, taken out of the index (rule 4)."""
        return self._parked.pop(worker_id, set())

    def forget_worker(self, worker_id: str) -> set[str]:
        """A lost worker completes nothing more: drop what was filed under it (a loss looks at every active
        session); returns the sessions whose parked Syncs waited for it (they look again)."""
        for seq, sid in self._wakes.pop(worker_id, []):
            self._filed.discard((worker_id, seq, sid))
        return self.parked_on(worker_id)
