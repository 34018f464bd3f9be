"""Op names from the wire -> torch OpOverloads, and nothing else.

Workers execute only registered torch ops named by their overload
("aten.add.Tensor"): the name is looked up in `torch.ops.<namespace>` and the
result must be an OpOverload, so no name can reach eval, import or an arbitrary
Python attribute. A few registered ops that touch the host (files) are refused too.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

ALLOWED_NAMESPACES = frozenset({"aten", "prims"})
# Registered, but they read host files: a session must not be able to reach them.
DENIED_OPS = frozenset({"aten.from_file"})

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class UnknownOp(ValueError):
    """The name is not a registered torch op this worker may run."""


def _refuse(name: str, why: str = "") -> UnknownOp:
    suffix = f" ({why})" if why else ""
    return UnknownOp(f"unknown op {name!r}: workers run only registered torch ops{suffix}")


@lru_cache(maxsize=4096)
def resolve_op(name: str) -> torch._ops.OpOverload:
    """Resolve "namespace.op.overload" to its OpOverload, or raise UnknownOp."""
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or not all(_IDENT.match(p) for p in parts):
        raise _refuse(name, "expected 'namespace.op.overload', e.g. 'aten.add.Tensor'")
    namespace, op_name, overload_name = parts
    if namespace not in ALLOWED_NAMESPACES:
        raise _refuse(name, f"namespace {namespace!r} is not allowed")
    if f"{namespace}.{op_name}" in DENIED_OPS:
        raise _refuse(name, "refused on workers")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError):
        raise _refuse(name) from None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise _refuse(name)
    try:
        overload = getattr(packet, overload_name)
    except (AttributeError, RuntimeError):
        raise _refuse(name) from None
    if not isinstance(overload, torch._ops.OpOverload) or overload.namespace != namespace:
        raise _refuse(name)
    return overload


# Ops whose kernels require their first input contiguous in its own suggested memory format, which torch's
# composite (F.group_norm) ensures just before calling them. The client decides that from its metadata, whose
# strides of size-1 dims come from meta kernels and can differ from the real kernels' (a (1, C, H, W) tensor
# channels-last to the client may be neither layout here): the worker makes sure again, as the composite would.
_CONTIGUOUS_FIRST = frozenset({"aten.native_group_norm.default"})


def prepare_args(name: str, args: list) -> list:
    """Adjust decoded arguments where a kernel's layout demands differ from what the client could see."""
    if name in _CONTIGUOUS_FIRST and args and isinstance(args[0], torch.Tensor):
        x = args[0]
        from torch._prims_common import suggest_memory_format  # the format the kernel checks against

        args = [x.contiguous(memory_format=suggest_memory_format(x)), *args[1:]]
    return args
