"""Reductions over `dim=[]`, which torch reads as every dim.

torch's DTensor rules and a few meta kernels read an empty dim list as no dim at all: planning such a reduction of a
sharded tensor crashed (`x.sum([])`, `var`, `std`, `count_nonzero`, `linalg.vector_norm`), `nansum` failed on any
layout, and `x.amax()`'s backward (which sums its mask over the same empty list) gave a wrong gradient
on a tensor sharded on its last dim. The ops of table ALL_DIMS are planned with every dim spelled out instead
(a decomposition, `_registry.register_decomposition`; it declines, NotImplemented, for any other dim and for a
0-dim tensor).
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor
from dtorch._registry import register_decomposition

aten = torch.ops.aten

ALL_DIMS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.nansum.default,
            aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction,
            aten.linalg_vector_norm.default, aten.count_nonzero.dim_IntList)


def _every_dim(op: Any) -> Any:
    at = [a.name for a in op._schema.arguments].index("dim")

    def run(args: tuple, kwargs: dict) -> Any:
        dim = args[at] if at < len(args) else kwargs.get("dim")
        if dim or dim is None:  # the common case first (every call of these ops asks): a dim named
            return NotImplemented
        self = args[0]
        if not is_dtensor(self) or self.ndim == 0 or not isinstance(dim, (list, tuple)):
            return NotImplemented
        every = list(range(self.ndim))
        if at < len(args):
            return op(*args[:at], every, *args[at + 1:], **kwargs)
        return op(*args, **{**kwargs, "dim": every})

    return run


for _op in ALL_DIMS:
    register_decomposition(_op)(_every_dim(_op))
