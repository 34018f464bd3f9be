"""`cumsum` over a sharded dim: each device scans its own part and adds what the devices before it hold.

torch's rule gathers the whole dim on every device first: position ids from a sequence-sharded attention mask
(`mask.cumsum(-1) - 1`), a router's running count of the tokens sent to each expert over a batch-sharded token dim.

Rule (a decomposition, `_registry.register_decomposition`; it declines, NotImplemented, unless the dim is sharded
with every device holding some of it and nothing Partial): each device scans its part (local `cumsum`) and sums it;
the sums are gathered over the mesh dims that shard the dim (one value per part per row), and each device adds the
sums of the parts before its own (per-device arguments: how many there are). Integers are exact; floats are
added in another order than torch's one pass, so they agree to rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import emit, on_dims, rows, sharded_dim, sharding, spec, to
from dtorch._registry import named_args, register_decomposition
from dtorch_protocol.placement_types import Replicate

aten = torch.ops.aten


@register_decomposition(aten.cumsum.default)
def cumsum(args: tuple, kwargs: dict) -> Any:
    values = named_args(aten.cumsum.default, args, kwargs)
    x, dim = values["self"], values["dim"]
    if type(dim) is not int or x.ndim == 0 or not sharded_dim(x, dim=dim):
        return NotImplemented
    dim %= x.ndim
    mesh, starts = x.device_mesh, [start for start, _ in rows(x, dim)]
    order = sorted(set(starts))  # the parts of the dim, in order (devices that differ elsewhere share one)
    dtype = values["dtype"] or (x.dtype if x.is_floating_point() or x.is_complex() else torch.int64)
    scanned = emit(aten.cumsum.default, (x, dim), spec(mesh, x.placements, tuple(x.shape), dtype),
                   kwargs={"dtype": dtype})
    sums_shape = tuple(len(order) if d == dim else n for d, n in enumerate(x.shape))
    sums = emit(aten.sum.dim_IntList, (x, [dim], True), spec(mesh, x.placements, sums_shape, dtype),
                kwargs={"dtype": dtype})  # one per part: sharded on dim as x is, one each
    sums = to(sums, on_dims(x.placements, sharding(x, dim), Replicate()))
    before = emit(aten.narrow.default, (sums, dim, 0, 0), sums._spec,
                  per_device=[(sums, dim, 0, order.index(start)) for start in starts])
    offset = emit(aten.sum.dim_IntList, (before, [dim], True), before._spec, kwargs={"dtype": dtype})
    return emit(aten.add.Tensor, (scanned, offset), scanned._spec)

