"""Priority classes with preemption and packing.

* rank: high 0, normal 1, low 2; within a class realtime sessions queue ahead of batch ones, then arrival.
* A request that cannot be placed freezes running sessions of lower classes (lowest class first, most
  recently started first) when that frees enough devices; frozen sessions resume when their devices free up,
  or on free devices their state is moved to (relocation, scheduler.py rule 6).
* A request of a lower class may be placed ahead of a blocked higher-class one (it can be preempted later);
  within a class the order is strict.
* Packing: batch sessions that declare a memory cap share devices while the caps fit in a device's memory.

Parameters: `preempt` (default true), `pack` (default true), `fgd` (default true: fragmentation-aware packing,
pool.py rule 7; false: best fit), `relocate` (default true), `relocate_after` (600 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dtorch_controller.core.policies.base import PRIORITY_RANK, RELOCATE_AFTER_S, BasePolicy, Tenant, flag, relocation


class PriorityPolicy(BasePolicy):
    name = "priority"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.preempts = flag(self.params, "preempt", True)
        self.packs = flag(self.params, "pack", True)
        self.fgd = flag(self.params, "fgd", True)  # fragmentation-aware packing (pool.py rule 7); false: best fit
        relocation(self, RELOCATE_AFTER_S)

    def accepts(self) -> tuple[str, ...]:
        return ("preempt", "pack", "fgd", "relocate", "relocate_after")

    def rank(self, t: Tenant, now: float) -> int:
        return PRIORITY_RANK[t.priority]

    def key(self, t: Tenant, now: float) -> tuple:
        return (0 if t.kind == "realtime" else 1,)

    def describe(self) -> str:
        return f"priority (preempt={'on' if self.preempts else 'off'}, pack={'on' if self.packs else 'off'})"
