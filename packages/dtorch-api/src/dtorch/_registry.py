"""The sharding-rule registry: DTorch's own rules for ops where torch has none, and the types a rule speaks.

A rule is a function `rule(func, args, kwargs, mesh) -> Propagation` over arguments whose DTensors are
replaced by their `Spec`s; it raises `NoRule` when it cannot handle these placements (the op then takes the
replicate route). Rule modules register their ops here and import nothing of the sharding adapter's
internals:

    from dtorch._registry import NoRule, Propagation, register

    @register(torch.ops.aten.my_op.default)
    def my_op(func, args, kwargs, mesh): ...

`_sharding.propagate` (the only door to torch's internals) reads the registry before asking torch; the
planner imports the rule modules (`_rules`, and any added beside it) so that they are registered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtorch.device_mesh import DeviceMesh


class NoRule(Exception):
    """No usable sharding rule for this op and these placements (the op runs replicated instead)."""


class ValueDependent(Exception):
    """The op's output shapes depend on the values (`nonzero`, `unique`, ...), or no meta kernel can tell them:
    only running it on the values can (the local route)."""


class Refused(Exception):
    """torch's meta kernel refuses these shapes or dtypes: the op cannot run on any values (a user error)."""

    def __init__(self, error: BaseException) -> None:
        self.error_type, self.message = type(error), str(error)
        super().__init__(f"{type(error).__name__}: {error}")


@dataclass
class Propagation:
    """A rule's answer: what to run, on which input layouts, giving which outputs."""

    op: Any  # OpOverload to run (a rule may rewrite it, e.g. squeeze -> squeeze.dims)
    args: tuple  # Specs (required input layouts) and non-tensor values, as for device 0
    kwargs: dict
    rank_args: list[tuple[tuple, dict]] | None  # per mesh position, where non-tensor args differ by device
    outputs: Any  # Spec | None | list/tuple of (Spec | None), mirroring the op's return


Rule = Callable[[Any, tuple, dict, DeviceMesh], Propagation]

_RULES: dict[Any, Rule] = {}


def _adder(table: dict, kind: str, ops: tuple) -> Callable:
    def add(fn: Callable) -> Callable:
        for op in ops:
            known = table.get(op)
            if known is not None and known is not fn:
                raise ValueError(f"{op} already has the {kind} {known.__module__}.{known.__qualname__}")
            table[op] = fn
        return fn

    return add


def register(*ops: Any) -> Callable[[Rule], Rule]:
    """Decorator: `rule` plans each of `ops` (OpOverloads). An op has at most one rule."""
    return _adder(_RULES, "rule", ops)


def rule_for(op: Any) -> Rule | None:
    """The registered rule of `op`, or None (torch's rules then apply)."""
    return _RULES.get(op)


# Decompositions: ops the dispatcher hands to a function of the DTensors instead of planning them as one op, where
# one op's per-device work is several ops (expert parallelism: `_experts`; joint sequences: `_joint`). A
# decomposition `fn(args, kwargs)` returns the op's result, or NotImplemented to decline (the op is then planned as
# usual); it decides from the arguments' specs alone, so a declined signature may be cached and never asked again.
Decomposition = Callable[[tuple, dict], Any]

_DECOMPOSITIONS: dict[Any, Decomposition] = {}


def named_args(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by their names in `func`'s schema, defaults filled in (for decompositions that read them)."""
    values = {a.name: a.default_value if a.has_default_value() else None for a in func._schema.arguments}
    values.update(zip((a.name for a in func._schema.arguments), args))
    values.update(kwargs)
    return values


def register_decomposition(*ops: Any) -> Callable[[Decomposition], Decomposition]:
    """Decorator: `fn` may carry out each of `ops` (OpOverloads). Where several may (each for its own case: `_joint`'s
    slices of joint sequences, `_slices`' of sharded dims), they are asked in the order they were registered."""
    def add(fn: Decomposition) -> Decomposition:
        for op in ops:
            known = _DECOMPOSITIONS.get(op)
            _DECOMPOSITIONS[op] = fn if known is None else _either(known, fn)
        return fn

    return add


def _either(first: Decomposition, second: Decomposition) -> Decomposition:
    def either(args: tuple, kwargs: dict) -> Any:
        done = first(args, kwargs)
        return second(args, kwargs) if done is NotImplemented else done

    return either


def decomposition_for(op: Any) -> Decomposition | None:
    """The registered decomposition of `op`, or None."""
    return _DECOMPOSITIONS.get(op)
