"""The core seen from outside, read only: what an adapter or the simulator may look at any time.

With the notices the core emits (effects.py: placed, queued, frozen, resumed, relocated, recovered, fenced,
moved, drained), this is the whole observer surface: nothing else of the core is meant for reading from outside,
and nothing here changes anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from dtorch_controller.core import state as st
from dtorch_controller.core.model import Cluster
from dtorch_controller.core.scheduler import Scheduler


class CoreView:
    def __init__(self, cluster: Cluster, sched: Scheduler) -> None:
        self._cluster = cluster
        self._sched = sched

    @property
    def queued(self) -> int:
        """Mesh requests waiting in the scheduler's queue."""
        return self._sched.queued

    def schedule(self, session: str) -> str:
        """The session's scheduling state: idle, waiting, running, frozen or closed."""
        return self._sched.state(session)

    def worker_state(self, worker_id: str) -> str | None:
        """alive, suspect, draining or lost; None when the core does not know it (or forgot it, lost)."""
        w = self._cluster.workers.get(worker_id)
        return w.state if w is not None else None

    def sessions_on(self, worker_id: str) -> frozenset[str]:
        """Sessions with logical devices bound to the worker."""
        w = self._cluster.workers.get(worker_id)
        return frozenset(w.sessions) if w is not None else frozenset()

    def leased(self, worker_id: str) -> bool:
        """Does any session lease the worker (running, or a frozen one's reservation)?"""
        return bool(self._sched.pool.holders(worker_id))

    def leases(self) -> Iterator[tuple[int, Mapping[str, int]]]:
        """(memory bytes, session -> cap leased) of every worker in the pool that carries leases."""
        for slot in self._sched.pool.slots.values():
            if slot.leases:
                yield slot.memory, slot.leases

    def bound_devices(self) -> int:
        """Logical devices bound to workers that are not lost (more than workers: virtual devices)."""
        return sum(w.bound for w in self._cluster.workers.values() if w.state != st.LOST)

    @property
    def decisions(self) -> int:
        """Scheduling decisions so far (placements, queueings, freezes, resumes), for benchmarks."""
        return self._sched.decisions
