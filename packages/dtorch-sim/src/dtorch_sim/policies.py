"""Scheduling policies the simulator can run: the controller core's own (`dtorch_controller.core.policies`), the
one list of policies; the simulator adds no scheduling logic. `policy.params` go to the scenario's policy,
`policy.params_for: {name: params}` to each named policy, in `run` as in `compare` (an entry wins over `params`)."""

from __future__ import annotations

from collections.abc import Mapping

from dtorch_controller.core.policies import POLICIES, Policy, PolicyError
from dtorch_controller.core.policies import make_policy as _make_policy

__all__ = ["UnknownPolicy", "is_known", "known", "make_policy", "names"]


class UnknownPolicy(ValueError):
    pass


def names() -> list[str]:
    return sorted(POLICIES)


def known() -> str:
    return ", ".join(names())


def is_known(name: str) -> bool:
    return name in POLICIES


def make_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    if not is_known(name):
        raise UnknownPolicy(f"unknown policy {name!r}: known policies are {known()}")
    try:
        return _make_policy(name, dict(params or {}))
    except PolicyError as e:
        raise UnknownPolicy(str(e)) from None
