"""The scheduling-policy interface: what a policy decides, and nothing else.

Rules:

1. A policy is a small object the `Scheduler` consults; it keeps no state about sessions or workers and never
   mutates what it is shown. Mechanics (leases, the queue, freezing, resuming, fewest-node placement) live in
   `scheduler.py` and `pool.py` and are the same under every policy.
2. `rank(t, now)` is a session's importance class: a small int, lower = more important. It orders the queue
   first, decides who may preempt whom (a session may freeze only sessions of a strictly higher rank, and only
   when `preempts`), and who may overtake whom: a request may be placed ahead of an earlier one that cannot
   be placed only if that one could later preempt it (its rank is strictly lower). So FIFO, whose ranks are
   all equal and which does not preempt, is strictly first come, first served.
3. `key(t, now)` orders the queue within a rank (the scheduler appends the arrival number as the last tie-break).
4. `packs`: sessions that declare a memory cap (and are not realtime) may share a device with other such
   sessions while their caps fit in its memory. Otherwise every device is leased to one session at a time.
   `fgd` (parameter of the packing policies, default true): packed leases go where they strand the least room
   for the requests seen lately (pool.py rule 7); false: plain best fit (the baseline of packing studies).
5. `relocates`: a frozen session may resume on free devices instead of waiting for its own (its state is moved;
   scheduler.py rule 6), once it has been frozen `relocate_after` seconds. Only meaningful for policies that
   preempt.
6. `next_change(t, now)`: when `rank` or `key` of `t` may change by itself (attained service crossing a
   threshold, a starvation promotion), or None. The scheduler sets a timer for the earliest one.
7. `starving(t, now)`: a waiting or frozen session waited so long that its counted service restarts from zero.
8. `lends`: frozen sessions keep no idle reservations (scheduler.py rule 6); `shrinks`: preemption takes the spare
   devices of running elastic sessions before it freezes anyone (scheduler.py rule 10); `paces`: preemption freezes
   first the session whose sent batches should be done soonest (scheduler.py rule 6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

PRIORITY_RANK = {"high": 0, "normal": 1, "low": 2}
DEFAULT_THRESHOLDS = (60.0, 600.0, 3600.0)  # device-seconds: the levels of las and dtorch
RELOCATE_AFTER_S = 600.0  # a frozen session waits this long for its own devices before it may move elsewhere


class Tenant(Protocol):
    """What a policy reads of a session's scheduling record (`scheduler.Tenant`), and nothing more."""

    session: str
    priority: str  # "high" | "normal" | "low"
    kind: str  # "batch" | "realtime"
    waiting_since: float | None  # waiting or frozen since
    waited: float  # seconds spent queued or frozen before the current wait
    frozen_s: float  # ... of which frozen (preempted)
    expected_steps: int  # steps (sync points) it said it will reach; 0: unknown (scheduler.py rule 9)
    steps: int  # sync points reached so far
    step_service: float  # attained service at its last sync point

    @property
    def running(self) -> bool: ...

    @property
    def wanted_devices(self) -> int: ...  # logical devices it has and asks for

    @property
    def held_devices(self) -> int: ...

    def service(self, now: float) -> float: ...  # device-seconds attained

    def counted(self, now: float) -> float: ...  # ... since the last starvation promotion


class Policy(Protocol):
    name: str
    preempts: bool
    packs: bool
    relocates: bool
    relocate_after: float
    lends: bool  # frozen sessions keep no idle reservations (scheduler.py rule 6)
    shrinks: bool  # preemption shrinks elastic sessions before freezing anyone (scheduler.py rule 10)
    paces: bool  # preemption freezes first who frees its devices soonest (scheduler.py rule 6)

    def rank(self, t: Tenant, now: float) -> int: ...

    def key(self, t: Tenant, now: float) -> tuple: ...

    def next_change(self, t: Tenant, now: float) -> float | None: ...

    def starving(self, t: Tenant, now: float) -> bool: ...

    def describe(self) -> str: ...


class PolicyError(ValueError):
    """Bad policy name or parameters."""


class BasePolicy:
    """Defaults: one rank, queue order = arrival, no preemption, no packing."""

    name = "base"
    preempts = False
    packs = False
    relocates = False
    relocate_after = 0.0
    lends = False
    shrinks = False
    paces = False

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        params = dict(params or {})
        self.params = params
        unknown = sorted(set(params) - set(self.accepts()))
        if unknown:
            raise PolicyError(f"policy {self.name!r} takes no parameter {', '.join(map(repr, unknown))}"
                              + (f" (it takes {', '.join(self.accepts())})" if self.accepts() else ""))

    def accepts(self) -> tuple[str, ...]:
        return ()

    def rank(self, t: Tenant, now: float) -> int:
        return 0

    def key(self, t: Tenant, now: float) -> tuple:
        return ()

    def next_change(self, t: Tenant, now: float) -> float | None:
        return None

    def starving(self, t: Tenant, now: float) -> bool:
        return False

    def describe(self) -> str:
        return self.name


def relocation(policy: BasePolicy, default_after: float) -> None:
    """The `relocate` and `relocate_after` parameters of a preempting policy."""
    policy.relocates = flag(policy.params, "relocate", True)
    policy.relocate_after = number(policy.params, "relocate_after", default_after)


def flag(params: Mapping[str, Any], name: str, default: bool) -> bool:
    value = params.get(name, default)
    if not isinstance(value, bool):
        raise PolicyError(f"policy parameter {name!r} must be true or false, got {value!r}")
    return value


def number(params: Mapping[str, Any], name: str, default: float, minimum: float = 0.0) -> float:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value < math.inf:
        raise PolicyError(f"policy parameter {name!r} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def thresholds(params: Mapping[str, Any], default: tuple[float, ...] = DEFAULT_THRESHOLDS) -> tuple[float, ...]:
    """The `thresholds` parameter: ascending positive device-seconds, at least one."""
    value = params.get("thresholds", default)
    if (not isinstance(value, (list, tuple)) or not value
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < math.inf for x in value)
            or list(value) != sorted(set(value))):
        raise PolicyError(f"policy parameter 'thresholds' must be ascending positive device-seconds, got {value!r}")
    return tuple(float(x) for x in value)
