"""The DTorch policy (the controller's default): strict priority classes; within a class, least remaining work
first when a session's progress says how much is left, least attained service otherwise; a request that never
ran moves to the top of its class after a short wait; optionally, a session treated unfairly (frozen long for its
running time) is shielded from preemption for a while (bounded unfairness, `fairness`); packing of memory-capped
sessions; preemption by freezing, relocation at once, and no idle reservations (frozen sessions lend the devices
they wait for).

Rules (a session's *score* is in device-seconds; lower goes first):

1. Rank = class x (levels + 1) + slot: classes (high, normal, low) are strict (a lower class never preempts or
   overtakes a higher one). Within a class, slot 0 holds the shielded (rule 3) and the waiting requests that are
   backfilled around (rule 8); the others sit at slot 1 + `bisect(thresholds, score)` (their level).
2. Score: the session's attained service (least attained service, Tiresias's 2D-LAS), or its *estimated
   remaining work* where that is lower and its progress is trustworthy (it declared its expected steps, has done
   at least one and fewer than declared): the service per step so far x the steps left. An estimate promotes a
   session that is nearly done (shortest remaining first), never demotes one below where least attained service
   puts it: ranked by its estimate alone, a long session fell to the last level at its first sync point (with every
   job of ITP cluster02 declaring its exact steps, the mean JCT over four seeds was 617 s, against 540 s with no
   declarations and 554 s with the minimum: docs/simulation.md, session 23).
3. Shield (the one fairness knob): a running session that has been frozen (preempted), in all, more than
   `fairness` times as long as it has run (attained service / its devices) keeps slot 0 of its class while it
   runs, so nobody of its class preempts it, until it has run that long (frozen time / `fairness`). Least
   attained service demotes a wide job to the last level within a minute or two of running, and every newcomer
   may then freeze it again: without the shield the widest long jobs are frozen again and again. Time spent
   queued does not count: sessions that only queued, shielded, would hold level 0 and block the level-0 queue
   behind a wide request (ITP cluster02 in docs/simulation.md). The shield bounds how often a session is
   interrupted, not how long it waits for devices: a frozen session still gets devices in rank order. 1: a
   session runs at least as long, uninterrupted, as it has been frozen; larger: less shielding, closer to pure
   least attained service; 0 (the default): off. Off by default since session 16: with a dispatch window
   (pipeline.py rule 7, which the shipped scenarios use) a freeze takes effect within a step and the shield cost
   mean JCT on four of the five shipped runs (up to 2.5x on ITP cluster02, where shielded sessions kept a
   whole-cluster request, and the queue behind it, waiting for hours), for a better p99 only on openb and ITP
   cluster04 at 576 GPUs (docs/simulation.md). (A promotion that restarted a waiting session's attained
   service, the previous mechanism, preempted the holders at every promotion and cost 1.3x in mean JCT with no
   better tail: docs/simulation.md.)
4. Within a rank, the queue is ordered realtime first, then by score, then arrival.
5. Preemption freezes sessions of a strictly worse rank; a frozen session may resume on substitutes at once
   (`relocate_after`, default 0: moving a session's state costs seconds, waiting for its devices minutes);
   with `lend` (default on) it keeps no idle reservations: the devices it waits for serve others meanwhile
   and it gets devices back in rank order (its own when free, else substitutes, else by preemption).
6. Packing: batch sessions that declare a memory cap share devices (fragmentation-aware: pool.py).
7. Elastic sessions (`dtorch.connect(min_devices=k)`) are shrunk before anyone is frozen: they give up devices
   above their minimum and run on the rest as virtual devices, growing back when devices free up
   (scheduler.py rule 10).
8. Backfill: a request that has never run and has waited `backfill_after` seconds moves to slot 0 of its class.
   The scheduler lets no request overtake a blocked one of the same rank (it could never preempt it back), so a
   wide request that cannot be placed (its devices are held by sessions it may not preempt: shielded ones, or
   newcomers of its own level) held every request of its level behind it while devices stood idle (ITP cluster02:
   25 one-device jobs queued 360 s behind a 64-device one, with 28 devices free). At slot 0 the requests behind it
   may go ahead on the free devices, and once it fits it may preempt them, as it may preempt any running session
   of its class outside slot 0. 0: off.
9. Preemption by pace: of the sessions that would free enough by themselves, the one whose sent batches should be
   done soonest is frozen first (the core times each session's batches: pipeline.py rule 8). A freeze takes
   effect only once what was sent has run, and the preemptor's devices wait idle until then (scheduler.py rule 6).

Parameters: `thresholds` (device-seconds, ascending; default 60, 600, 3600), `fairness` (default 0: no
shield), `backfill_after` (seconds, default 30; 0: off), `preempt`, `pack`, `fgd` (fragmentation-aware packing;
false: best fit), `relocate`, `lend`, `shrink`, `pace` (default true), `relocate_after` (default 0 s).
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
_EPS_S = 1e-9  # seconds: a deadline reached up to float rounding counts as passed
BACKFILL_AFTER_S = 30.0  # rule 8: a request that never ran waits this long before others may go around it


class DTorchPolicy(BasePolicy):
    name = "dtorch"

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.thresholds = thresholds(self.params)
        self.levels = len(self.thresholds) + 1
        self.slots = self.levels + 1  # per class: slot 0 (shielded, backfilled around), then the levels
        self.fairness = number(self.params, "fairness", 0.0)
        self.backfill_after = number(self.params, "backfill_after", BACKFILL_AFTER_S)
        self.preempts = flag(self.params, "preempt", True)
        self.packs = flag(self.params, "pack", True)
        self.fgd = flag(self.params, "fgd", True)  # fragmentation-aware packing (pool.py rule 7); false: best fit
        self.lends = flag(self.params, "lend", True)
        self.shrinks = flag(self.params, "shrink", True)
        self.paces = flag(self.params, "pace", True)
        relocation(self, 0.0)

    def accepts(self) -> tuple[str, ...]:
        return ("thresholds", "fairness", "backfill_after", "preempt", "pack", "fgd", "relocate", "relocate_after",
                "lend", "shrink", "pace")

    # ------------------------------------------------------------ the score (rules 2 and 3)

    def remaining(self, t: Tenant) -> float | None:
        """Estimated device-seconds left, from its declared steps and its service per step; None when untrusted."""
        if t.expected_steps and 0 < t.steps < t.expected_steps and t.step_service > 0:
            return t.step_service / t.steps * (t.expected_steps - t.steps)
        return None

    def score(self, t: Tenant, now: float) -> float:
        """Rule 2: attained service, or the estimated remaining work where that is trusted and lower."""
        left = self.remaining(t)
        return t.service(now) if left is None else min(left, t.service(now))

    def _shield_ends(self, t: Tenant, now: float) -> float | None:
        """When a running session's shield ends (rule 3), or None when it is not shielded."""
        if not self.fairness or not t.running or not t.held_devices:
            return None
        ran = t.service(now) / max(1, t.wanted_devices)  # seconds of running, on all its devices
        due = t.frozen_s / self.fairness
        if due <= ran + _SLACK:
            return None
        return now + (due - ran) * max(1, t.wanted_devices) / t.held_devices

    def _backfill_at(self, t: Tenant) -> float | None:
        """When a request that has never run moves to slot 0 (rule 8), or None (it ran, or backfill is off)."""
        if not self.backfill_after or t.running or t.waiting_since is None or t.frozen_s or t.service(t.waiting_since):
            return None
        return t.waiting_since + self.backfill_after

    # ------------------------------------------------------------ the policy surface

    def rank(self, t: Tenant, now: float) -> int:
        backfill = self._backfill_at(t)
        if (backfill is not None and now >= backfill - _EPS_S) or self._shield_ends(t, now) is not None:
            return PRIORITY_RANK[t.priority] * self.slots
        level = bisect.bisect_right(self.thresholds, self.score(t, now) + _SLACK)
        return PRIORITY_RANK[t.priority] * self.slots + 1 + level

    def key(self, t: Tenant, now: float) -> tuple:
        return (0 if t.kind == "realtime" else 1, self.score(t, now))

    def next_change(self, t: Tenant, now: float) -> float | None:
        """When the level of a running session may change by the clock alone: its shield ending, or its attained
        service crossing the next threshold up (least attained service; where its estimate stays below that
        threshold, it changes only at its steps). A waiting session's level changes only when it runs."""
        if not t.running:
            backfill = self._backfill_at(t)
            return backfill if backfill is not None and backfill > now else None
        shield = self._shield_ends(t, now)
        if shield is not None:
            return shield
        held = t.held_devices
        level = bisect.bisect_right(self.thresholds, self.score(t, now) + _SLACK)
        if not held or level >= len(self.thresholds):
            return None
        left = self.remaining(t)
        if left is not None and left < self.thresholds[level] - _SLACK:  # its estimate caps it below: no change
            return None  # but at its steps
        return now + (self.thresholds[level] - t.service(now)) / held

    def describe(self) -> str:
        limits = ", ".join(f"{x:g}" for x in self.thresholds)
        shield = f"shielded once frozen {self.fairness:g}x its running time" if self.fairness else "no shield"
        return (f"dtorch (levels at {limits} device-s of remaining or attained work, {shield}, "
                f"preempt={'on' if self.preempts else 'off'}, pack={'on' if self.packs else 'off'}, "
                f"lend={'on' if self.lends else 'off'}, pace={'on' if self.paces else 'off'})")
