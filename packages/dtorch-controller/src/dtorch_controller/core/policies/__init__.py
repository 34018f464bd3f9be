"""Scheduling policies behind one interface (`base.Policy`), by name.

    dtorch    the default: strict classes; within a class least remaining work (declared progress) or least
              attained service, a shield from preemption for sessions that waited long; preemption by
              freezing, relocation, lending, elastic shrink, packing
    fifo      strict first come, first served; whole devices; no preemption
    priority  high/normal/low classes, preemption by freezing, packing of memory-capped sessions
    las       Tiresias-style discretized least-attained-service, preemption by freezing

`make_policy(name, params)` builds one; `dtorch-controller --policy NAME` and the simulator's `policy:` use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dtorch_controller.core.policies.base import BasePolicy, Policy, PolicyError
from dtorch_controller.core.policies.dtorch import DTorchPolicy
from dtorch_controller.core.policies.fifo import FifoPolicy
from dtorch_controller.core.policies.las import LasPolicy
from dtorch_controller.core.policies.priority import PriorityPolicy

DEFAULT_POLICY = "dtorch"

POLICIES: dict[str, Callable[[Mapping[str, Any] | None], Policy]] = {
    "dtorch": DTorchPolicy,
    "fifo": FifoPolicy,
    "priority": PriorityPolicy,
    "las": LasPolicy,
}


def known() -> str:
    return ", ".join(sorted(POLICIES))


def make_policy(name: str = DEFAULT_POLICY, params: Mapping[str, Any] | None = None) -> Policy:
    factory = POLICIES.get(name)
    if factory is None:
        raise PolicyError(f"unknown policy {name!r}: known policies are {known()}")
    return factory(params)


__all__ = ["DEFAULT_POLICY", "POLICIES", "BasePolicy", "DTorchPolicy", "FifoPolicy", "LasPolicy", "Policy",
           "PolicyError", "PriorityPolicy", "known", "make_policy"]
