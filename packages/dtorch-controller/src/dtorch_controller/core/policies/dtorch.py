"""The DTorch policy (the controller's default): strict priority classes; within a class, least remaining work
first when a session's progress says how much is left, least attained service otherwise; a session that waited
long enough for its running time is promoted (bounded unfairness); packing of memory-capped sessions;
preemption by freezing, relocation at once, and no idle reservations (frozen sessions lend the devices they wait
for).

Rules (a session's *score* is in device-seconds; lower goes first):

1. Rank = class x (levels) + level: classes (high, normal, low) are strict (a lower class never preempts or
   overtakes a higher one); within a class the level is `bisect(thresholds, score)`.
2. Score: the session's *estimated remaining work* when its progress is trustworthy (it declared its expected
   steps, has done at least one and fewer than declared): the service per step so far x the steps left.
   Otherwise its attained service since its last promotion (least attained service, Tiresias's 2D-LAS).
3. Promotion (the one fairness knob): a session that has waited (queued or frozen, this time) `fairness` times
   as long as it ran since its last promotion (and at least `promote_min_s`) is promoted: its counted service
   restarts at minus `promote_min_s` seconds of its devices: it runs at least `promote_min_s` at level 0 of
   its class before it can be demoted (a promoted session with an estimate takes the lower of the two). So a
   session's wait is bounded by about `fairness` times its running time, and a promotion is a step with a
   quantum, not a slope: the promoted session and the one it preempts do not trade places at every threshold
   crossing (a continuous credit for waiting did, a million times on ITP cluster04). Small `fairness`: close
   to first come, first served; large: pure shortest-remaining / least-attained; 0: no promotion.
4. Within a rank, the queue is ordered realtime first, then by score, then arrival.
5. Preemption freezes sessions of a strictly worse rank; a frozen session may resume on substitutes at once
   (`relocate_after`, default 0: moving a session's state costs seconds, waiting for its devices minutes);
   with `lend` (default on) it keeps no idle reservations: the devices it waits for serve others meanwhile
   and it gets devices back in rank order (its own when free, else substitutes, else by preemption).
6. Packing: batch sessions that declare a memory cap share devices (fragmentation-aware: pool.py).
7. Elastic sessions (`dtorch.connect(min_devices=k)`) are shrunk before anyone is frozen: they give up devices
   above their minimum and run on the rest as virtual devices, growing back when devices free up
   (scheduler.py rule 10).

Parameters: `thresholds` (device-seconds, ascending; default 60, 600, 3600), `fairness` (default 4; 0: no
promotion), `promote_min_s` (default 60), `preempt`, `pack`, `fgd` (fragmentation-aware packing; false: best
fit), `relocate`, `lend`, `shrink` (default true), `relocate_after` (default 0 s).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

from dtorch_controller.core.policies.base import (
    PRIORITY_RANK,
    BasePolicy,
    Tenant,
    flag,
    number,
    relocation,
    thresholds,
)

_SLACK = 1e-6  # device-seconds: a threshold reached up to float rounding counts as crossed


class DTorchPolicy(BasePolicy):
    name = "dtorch"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.thresholds = thresholds(self.params)
        self.levels = len(self.thresholds) + 1
        self.fairness = number(self.params, "fairness", 4.0)
        self.promote_min_s = number(self.params, "promote_min_s", 60.0)
        self.preempts = flag(self.params, "preempt", True)
        self.packs = flag(self.params, "pack", True)
        self.fgd = flag(self.params, "fgd", True)  # fragmentation-aware packing (pool.py rule 7); false: best fit
        self.lends = flag(self.params, "lend", True)
        self.shrinks = flag(self.params, "shrink", True)
        relocation(self, 0.0)

    def accepts(self) -> tuple[str, ...]:
        return ("thresholds", "fairness", "promote_min_s", "preempt", "pack", "fgd", "relocate", "relocate_after",
                "lend", "shrink")

    # ------------------------------------------------------------ the score (rules 2 and 3)

    def remaining(self, t: Tenant) -> float | None:
        """Estimated device-seconds left, from its declared steps and its service per step; None when untrusted."""
        if t.expected_steps and 0 < t.steps < t.expected_steps and t.step_service > 0:
            return t.step_service / t.steps * (t.expected_steps - t.steps)
        return None

    def score(self, t: Tenant, now: float) -> float:
        left = self.remaining(t)
        if not t.base:
            return t.counted(now) if left is None else left
        counted = t.counted(now) - self.promote_min_s * max(1, t.wanted_devices)  # promoted: a quantum first
        return counted if left is None else min(left, counted)

    def starving(self, t: Tenant, now: float) -> bool:
        """A waiting session that waited long enough for its running time: the scheduler restarts its counted
        service (rule 3)."""
        due = self._promotion_at(t, now)
        return due is not None and now >= due

    def _promotion_at(self, t: Tenant, now: float) -> float | None:
        if not self.fairness or t.running or t.waiting_since is None:
            return None
        if bisect.bisect_right(self.thresholds, self.score(t, now) + _SLACK) == 0:
            return None  # at the top level of its class already
        ran = t.counted(t.waiting_since) / max(1, t.wanted_devices)  # seconds of running since its promotion
        return t.waiting_since + max(self.promote_min_s, self.fairness * ran)

    # ------------------------------------------------------------ the policy surface

    def rank(self, t: Tenant, now: float) -> int:
        level = bisect.bisect_right(self.thresholds, self.score(t, now) + _SLACK)
        return PRIORITY_RANK[t.priority] * self.levels + level

    def key(self, t: Tenant, now: float) -> tuple:
        return (0 if t.kind == "realtime" else 1, self.score(t, now))

    def next_change(self, t: Tenant, now: float) -> float | None:
        """When the level may change by the clock alone: a running session's attained service crossing the next
        threshold up (least attained service; an estimated session changes at its steps instead), or a waiting
        one's promotion."""
        if not t.running:
            return self._promotion_at(t, now)
        held = t.held_devices
        value = self.score(t, now)
        level = bisect.bisect_right(self.thresholds, value + _SLACK)
        if not held or level >= len(self.thresholds) or self.remaining(t) is not None:
            return None
        return now + (self.thresholds[level] - value) / held

    def describe(self) -> str:
        limits = ", ".join(f"{x:g}" for x in self.thresholds)
        return (f"dtorch (levels at {limits} device-s of remaining or attained work, promotion after waiting "
                f"{self.fairness:g}x the running time, "
                f"preempt={'on' if self.preempts else 'off'}, pack={'on' if self.packs else 'off'}, "
                f"lend={'on' if self.lends else 'off'})")
