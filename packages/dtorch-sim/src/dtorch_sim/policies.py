"""Scheduling policies the simulator can run: the controller core's own, plus named presets of them.

The core's registry (`dtorch_controller.core.policies`) is the one list of policies; the simulator adds no
scheduling logic. A *preset* is a core policy with fixed parameters under a name of its own:

    dtorch    the DTorch policy: `priority` with preemption and packing on (the controller's default policy)

A preset's parameters may be extended by the scenario (`policy.params`), never contradicted silently: the
scenario's values win, as they would on the controller's command line.
"""

from __future__ import annotations

from collections.abc import Mapping

from dtorch_controller.core.policies import POLICIES, Policy, PolicyError
from dtorch_controller.core.policies import make_policy as _make_policy

__all__ = ["PRESETS", "UnknownPolicy", "is_known", "known", "make_policy", "names"]

PRESETS: dict[str, tuple[str, dict[str, object]]] = {
    "dtorch": ("priority", {"preempt": True, "pack": True}),
}


class UnknownPolicy(ValueError):
    pass


def names() -> list[str]:
    return sorted({*POLICIES, *PRESETS})


def known() -> str:
    return ", ".join(names())


def is_known(name: str) -> bool:
    return name in POLICIES or name in PRESETS


def make_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    if not is_known(name):
        raise UnknownPolicy(f"unknown policy {name!r}: known policies are {known()}")
    base, fixed = PRESETS.get(name, (name, {}))
    try:
        return _make_policy(base, {**fixed, **(params or {})})
    except PolicyError as e:
        raise UnknownPolicy(str(e).replace(f"policy {base!r}", f"policy {name!r}")) from None
