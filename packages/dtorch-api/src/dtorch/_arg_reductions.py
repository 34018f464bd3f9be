"""argmax, argmin, and max and min with indices, over a sharded dim (vocabulary-parallel logits).

torch's rules gather the whole dim on every device first: greedy decoding from vocabulary-parallel logits
(`logits[:, -1].argmax(-1)`) moved tokens x vocabulary at every step (and a sequence classifier's pooling, the
argmax of the last non-padding position over a sequence-sharded batch, the positions).

Rules (decompositions, `_registry.register_decomposition`; each declines, NotImplemented, unless the dim is sharded
on some mesh dim with every device holding some of it, nothing is Partial and x's dtype is in `_local.REDUCIBLE`):
  1. argmax(x, dim) (argmin mirrored): each device finds its own extreme and its first place (shifted into the
     whole dim). Three reductions of the output's size, none of x: whether any device holds a NaN (which torch
     counts as the extreme), the extreme over devices (NaN aside), and the smallest index among the devices that
     hold the NaN, or else the extreme: torch's first occurrence.
  2. max(x, dim) and min(x, dim): the indices as rule 1, the values the extreme (NaN where any device holds one).
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import REDUCIBLE, emit, on_dims, rows, sharded_dim, sharding, spec, to
from dtorch._registry import named_args, register_decomposition
from dtorch_protocol.placement_types import Partial, Replicate

aten = torch.ops.aten
FIRST = torch.iinfo(torch.int64).max  # a device without the extreme offers no index

# op -> (its own reduction of a device's shard, its arg-reduction, the reduction over devices, whether values too)
EXTREMES = {
    aten.argmax.default: (aten.amax.default, aten.argmax.default, "max", False),
    aten.argmin.default: (aten.amin.default, aten.argmin.default, "min", False),
    aten.max.dim: (aten.amax.default, aten.argmax.default, "max", True),
    aten.min.dim: (aten.amin.default, aten.argmin.default, "min", True),
}


def _extreme(op: Any) -> Any:
    reduce, arg, over, with_values = EXTREMES[op]

    def run(args: tuple, kwargs: dict) -> Any:
        values = named_args(op, args, kwargs)
        x, dim = values["self"], values["dim"]
        if type(dim) is not int or x.dtype not in REDUCIBLE or not sharded_dim(x, dim=dim):
            return NotImplemented
        value, index = _arg(x, dim % x.ndim, reduce, arg, over)
        if not values["keepdim"]:
            value, index = aten.squeeze.dim(value, dim), aten.squeeze.dim(index, dim)
        return (value, index) if with_values else index

    return run


def _arg(x: Any, dim: int, reduce: Any, arg: Any, over: str) -> tuple[Any, Any]:
    """Rule 1: (the extreme, its first index) along `dim`, kept as a dim of one, replicated on the mesh dims that
    shard it."""
    mesh, shape = x.device_mesh, tuple(1 if d == dim else n for d, n in enumerate(x.shape))
    spread = sharding(x, dim)
    whole = on_dims(x.placements, spread, Replicate())

    def local(op: Any, args: tuple, dtype: torch.dtype, reduced: str | None = None, **per_device: Any) -> Any:
        placements = on_dims(x.placements, spread, Partial(reduced)) if reduced else whole
        return emit(op, args, spec(mesh, placements, shape, dtype), **per_device)

    starts = [start for start, _ in rows(x, dim)]
    extreme = local(reduce, (x, [dim], True), x.dtype, over)  # (each device's: Partial, reduced by `over`)
    if x.is_floating_point():
        nan = local(aten.isnan.default, (extreme,), torch.bool)
        any_nan = to(local(aten._to_copy.default, (nan,), torch.float32, "max", kwargs={"dtype": torch.float32}),
                     whole)
        extreme = local(aten.where.ScalarSelf, (nan, float("-inf") if over == "max" else float("inf"), extreme),
                        x.dtype, over)
    best = to(extreme, whole)
    holds = local(aten.eq.Tensor, (extreme, best), torch.bool)
    if x.is_floating_point():
        holds = local(aten.where.self, (local(aten.gt.Scalar, (any_nan, 0.0), torch.bool), nan, holds), torch.bool)
        best = aten.where.ScalarSelf(aten.gt.Scalar(any_nan, 0.0), float("nan"), best)
    at = local(arg, (x, dim, True), torch.int64)
    at = local(aten.add.Tensor, (at, 0), torch.int64, per_device=[(at, start) for start in starts])
    index = to(local(aten.where.ScalarOther, (holds, at, FIRST), torch.int64, "min"), whole)
    return best, index


for _op in EXTREMES:
    register_decomposition(_op)(_extreme(_op))
