"""Where a session's logical devices go: the pluggable placement policy.

The core asks the policy once per OpenMesh, with the logical devices that are not bound yet and a
snapshot of the workers that may take new devices. The policy answers with an assignment or a refusal
(with a queue position, for policies that queue). It holds no reference to core state, so a policy
with queueing, priorities or preemption (a later issue) can be swapped in without touching the core's
bookkeeping; such a policy will also need a hook to retry queued requests when capacity changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class WorkerSlot:
    """What a policy may know about one placeable worker."""

    worker: str
    bound: int  # logical devices already bound here, all sessions together
    order: int  # registration order
    memory_bytes: int = 0
    device_type: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PlacementRequest:
    session: str
    priority: str  # "high" | "normal" | "low"
    devices: tuple[int, ...]  # logical devices to bind, in mesh order
    registered: int = 0  # workers known to the core that are not lost (to word a refusal)


@dataclass(frozen=True)
class PlacementDecision:
    placed: bool
    assignment: Mapping[int, str] = field(default_factory=dict)  # logical device -> worker id
    queue_position: int = 0
    message: str = ""


class PlacementPolicy(Protocol):
    def place(self, request: PlacementRequest, workers: Sequence[WorkerSlot]) -> PlacementDecision:
        """Bind every device of `request` to one of `workers`, or refuse; must not mutate its arguments."""
        ...


class FifoPlacement:
    """Place at once, first come first served: each device goes to the worker with the fewest bound devices.

    Several logical devices may land on one worker (virtual devices), so any mesh fits on one worker.
    Ties go to the earliest registered worker, which keeps placements reproducible.
    """

    def place(self, request: PlacementRequest, workers: Sequence[WorkerSlot]) -> PlacementDecision:
        if not workers:
            message = ("no workers registered" if not request.registered
                       else f"no alive workers ({request.registered} registered, none accepting devices)")
            return PlacementDecision(placed=False, message=message)
        load = {w.worker: (w.bound, w.order) for w in workers}
        assignment: dict[int, str] = {}
        for device in request.devices:
            worker = min(load, key=load.__getitem__)
            assignment[device] = worker
            bound, order = load[worker]
            load[worker] = (bound + 1, order)
        return PlacementDecision(placed=True, assignment=assignment)
