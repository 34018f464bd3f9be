"""Tiresias-style discretized least-attained-service (2D-LAS) scheduling.

A session's attained service is devices held x seconds running (frozen and waiting time does not count).
Thresholds split sessions into levels: level 0 below the first threshold, level 1 below the second, ...;
the level is the rank, so sessions that have had the least service go first and may freeze running
sessions of a higher level. Within a level: arrival order. A waiting or frozen session that has waited
`starve_factor` times its counted service (and at least `starve_min_s`) is promoted back to level 0 and its
counted service restarts from zero (Tiresias's starvation limit); starve_factor 0 turns promotion off.

Parameters: `thresholds` (device-seconds, ascending; default [60, 600, 3600]), `starve_factor` (default 0),
`starve_min_s` (default 60), `preempt` (default true), `relocate` (default true: a frozen session may resume on
free devices its state is moved to, scheduler.py rule 6) and `relocate_after` (seconds frozen first; default 600).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

from dtorch_controller.core.policies.base import (
    RELOCATE_AFTER_S,
    BasePolicy,
    Tenant,
    flag,
    number,
    relocation,
    thresholds,
)

_SLACK = 1e-6  # device-seconds: a threshold reached up to float rounding counts as crossed


class LasPolicy(BasePolicy):
    name = "las"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.thresholds = thresholds(self.params)
        self.starve_factor = number(self.params, "starve_factor", 0.0)
        self.starve_min_s = number(self.params, "starve_min_s", 60.0)
        self.preempts = flag(self.params, "preempt", True)
        relocation(self, RELOCATE_AFTER_S)

    def accepts(self) -> tuple[str, ...]:
        return ("thresholds", "starve_factor", "starve_min_s", "preempt", "relocate", "relocate_after")

    def rank(self, t: Tenant, now: float) -> int:
        return bisect.bisect_right(self.thresholds, t.counted(now) + _SLACK)

    def starving(self, t: Tenant, now: float) -> bool:
        """A waiting session that waited long enough for its level: the scheduler resets its counted service."""
        due = self._promotion_at(t)
        return due is not None and now >= due

    def _promotion_at(self, t: Tenant) -> float | None:
        if not self.starve_factor or t.running or t.waiting_since is None or t.counted(t.waiting_since) <= 0:
            return None
        return t.waiting_since + max(self.starve_min_s, self.starve_factor * t.counted(t.waiting_since))

    def next_change(self, t: Tenant, now: float) -> float | None:
        if t.running:
            held = t.held_devices
            service = t.counted(now)
            nxt = bisect.bisect_right(self.thresholds, service + _SLACK)
            if not held or nxt >= len(self.thresholds):
                return None
            return now + (self.thresholds[nxt] - service) / held
        return self._promotion_at(t)

    def describe(self) -> str:
        limits = ", ".join(f"{x:g}" for x in self.thresholds)
        return f"las (thresholds {limits} device-s, starve_factor {self.starve_factor:g})"
