"""The DTorch policy (the controller's default): strict priority classes; within a class, least remaining work
first when a session's progress says how much is left, least attained service otherwise; waiting earns credit
(bounded unfairness); packing of memory-capped sessions; preemption by freezing, relocation at once, and no
idle reservations (frozen sessions lend the devices they wait for).

Rules (a session's *score* is in device-seconds; lower goes first):

1. Rank = class x (levels) + level: classes (high, normal, low) are strict (a lower class never preempts or
   overtakes a higher one); within a class the level is `bisect(thresholds, score - credit)`.
2. Score: the session's *estimated remaining work* when its progress is trustworthy (it declared its expected
   steps, has done at least one and fewer than declared): the service per step so far x the steps left.
   Otherwise its attained service since its last promotion (least attained service, Tiresias's 2D-LAS).
3. Credit (the one fairness knob): every second a session waits (queued or frozen) credits it
   `devices / fairness` device-seconds, so it climbs one level per `fairness x level width / devices` seconds
   of waiting and no session is passed over forever. Small `fairness`: close to first come, first served;
   large: pure shortest-remaining / least-attained. A session's waiting time is bounded by roughly `fairness`
   times its own running time.
4. Within a rank, the queue is ordered realtime first, then by score - credit, then arrival.
5. Preemption freezes sessions of a strictly worse rank; a frozen session may resume on substitutes at once
   (`relocate_after`, default 0: moving a session's state costs seconds, waiting for its devices minutes);
   with `lend` (default on) it keeps no idle reservations: the devices it waits for serve others meanwhile
   and it gets devices back in rank order (its own when free, else substitutes, else by preemption).
6. Packing: batch sessions that declare a memory cap share devices (fragmentation-aware: pool.py).
7. Elastic sessions (`dtorch.connect(min_devices=k)`) are shrunk before anyone is frozen: they give up devices
   above their minimum and run on the rest as virtual devices, growing back when devices free up
   (scheduler.py rule 10).

Parameters: `thresholds` (device-seconds, ascending; default 60, 600, 3600), `fairness` (default 1.0; 0: no
credit), `preempt`, `pack`, `relocate`, `lend`, `shrink` (default true), `relocate_after` (default 0 s).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

from dtorch_controller.core.policies.base import (
    PRIORITY_RANK,
    BasePolicy,
    PolicyError,
    Tenant,
    flag,
    number,
    relocation,
)

DEFAULT_THRESHOLDS = (60.0, 600.0, 3600.0)
_SLACK = 1e-6  # device-seconds: a threshold reached up to float rounding counts as crossed


class DTorchPolicy(BasePolicy):
    name = "dtorch"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        raw = self.params.get("thresholds", DEFAULT_THRESHOLDS)
        if (not isinstance(raw, (list, tuple)) or not raw
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 for x in raw)
                or list(raw) != sorted(set(raw))):
            raise PolicyError(f"policy parameter 'thresholds' must be ascending positive device-seconds, got {raw!r}")
        self.thresholds = tuple(float(x) for x in raw)
        self.levels = len(self.thresholds) + 1
        self.fairness = number(self.params, "fairness", 1.0)
        self.preempts = flag(self.params, "preempt", True)
        self.packs = flag(self.params, "pack", True)
        self.lends = flag(self.params, "lend", True)
        self.shrinks = flag(self.params, "shrink", True)
        relocation(self, 0.0)

    def accepts(self) -> tuple[str, ...]:
        return ("thresholds", "fairness", "preempt", "pack", "relocate", "relocate_after", "lend", "shrink")

    # ------------------------------------------------------------ the score (rules 2 and 3)

    def remaining(self, t: Tenant) -> float | None:
        """Estimated device-seconds left, from its declared steps and its service per step; None when untrusted."""
        if t.expected_steps and 0 < t.steps < t.expected_steps and t.step_service > 0:
            return t.step_service / t.steps * (t.expected_steps - t.steps)
        return None

    def score(self, t: Tenant, now: float) -> float:
        left = self.remaining(t)
        return left if left is not None else t.counted(now)

    def credit(self, t: Tenant, now: float) -> float:
        if not self.fairness:
            return 0.0
        waited = t.waited + (now - t.waiting_since if t.waiting_since is not None else 0.0)
        return waited * max(1, t.wanted_devices) / self.fairness

    def _effective(self, t: Tenant, now: float) -> float:
        return self.score(t, now) - self.credit(t, now)

    # ------------------------------------------------------------ the policy surface

    def rank(self, t: Tenant, now: float) -> int:
        level = bisect.bisect_right(self.thresholds, self._effective(t, now) + _SLACK)
        return PRIORITY_RANK[t.priority] * self.levels + level

    def key(self, t: Tenant, now: float) -> tuple:
        return (0 if t.kind == "realtime" else 1, self._effective(t, now))

    def next_change(self, t: Tenant, now: float) -> float | None:
        """When the level may change by the clock alone: a running session's attained service crossing the next
        threshold up (least attained service; an estimated session changes at its steps instead), or a waiting
        one's credit crossing the next threshold down."""
        value = self._effective(t, now)
        level = bisect.bisect_right(self.thresholds, value + _SLACK)
        if t.running:
            held = t.held_devices
            if not held or level >= len(self.thresholds) or self.remaining(t) is not None:
                return None
            return now + (self.thresholds[level] - value) / held
        if not self.fairness or level == 0:
            return None
        rate = max(1, t.wanted_devices) / self.fairness  # device-seconds of credit per second waited
        return now + (value - self.thresholds[level - 1]) / rate + 1e-6

    def describe(self) -> str:
        limits = ", ".join(f"{x:g}" for x in self.thresholds)
        return (f"dtorch (levels at {limits} device-s of remaining or attained work, fairness {self.fairness:g}, "
                f"preempt={'on' if self.preempts else 'off'}, pack={'on' if self.packs else 'off'}, "
                f"lend={'on' if self.lends else 'off'})")
