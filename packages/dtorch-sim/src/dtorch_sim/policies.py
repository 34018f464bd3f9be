"""Placement policies the simulator can run: exactly the ones the controller core ships today.

A scheduling issue adds its policies to the core; listing them here makes them runnable and comparable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dtorch_controller.core.scheduling import FifoPlacement, PlacementPolicy

POLICIES: dict[str, Callable[[Mapping[str, object]], PlacementPolicy]] = {
    "fifo": lambda params: FifoPlacement(),
}


class UnknownPolicy(ValueError):
    pass


def known() -> str:
    return ", ".join(sorted(POLICIES))


def make_policy(name: str, params: Mapping[str, object] | None = None) -> PlacementPolicy:
    factory = POLICIES.get(name)
    if factory is None:
        raise UnknownPolicy(f"unknown policy {name!r}: known policies are {known()}")
    return factory(params or {})
