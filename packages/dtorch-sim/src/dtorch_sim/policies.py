"""Placement policies the simulator can run: exactly the ones the controller core ships.

The core's registry (`dtorch_controller.core.policies`) is the one list; the simulator only names it.
"""

from __future__ import annotations

from collections.abc import Mapping

from dtorch_controller.core.policies import POLICIES, Policy, PolicyError
from dtorch_controller.core.policies import known as _known
from dtorch_controller.core.policies import make_policy as _make_policy

__all__ = ["POLICIES", "UnknownPolicy", "known", "make_policy"]


class UnknownPolicy(ValueError):
    pass


def known() -> str:
    return _known()


def make_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    if name not in POLICIES:
        raise UnknownPolicy(f"unknown policy {name!r}: known policies are {known()}")
    try:
        return _make_policy(name, params or {})
    except PolicyError as e:
        raise UnknownPolicy(str(e)) from None
