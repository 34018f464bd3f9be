"""Views of part of a sharded dim (`x[3]`, `x[:, -1]`, `x[2:5]` of a tensor sharded on that dim): only the part moves.

A view across a sharded dim is taken of a moved copy of its input (`_views`), and torch's rule replicates the whole
input for it: reading one row of a row-sharded tensor (`print(x[0])`, the last position of a sequence-sharded batch
of hidden states) gathered the whole tensor on every device.

Rules (decompositions of `select.int` and `slice.Tensor`; each declines, NotImplemented, outside rule 1):
  1. The case: a dim sharded on a mesh dim of more than one device, of which the view names at most half (a larger
     part costs about what a gather of the whole costs: torch's path runs); nothing Partial; not itself a view of a
     moved copy (`_views` rule 2 applies); a dtype of `_local.REDUCIBLE`.
  2. The moved copy is the region alone (`_regions.read`: one reduction of the region's bytes), replicated on the
     mesh dims that shard that dim; the view is taken of it, and its origin (`_views`) is the input with that
     region: writes through the view reach the input's rows, later writes to the input reach the view.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch import _views
from dtorch._local import REDUCIBLE, is_dtensor
from dtorch._regions import Region, read, sharded_dims
from dtorch._registry import register_decomposition

aten = torch.ops.aten


@register_decomposition(aten.select.int)
def select(args: tuple, kwargs: dict) -> Any:
    if kwargs or len(args) != 3:
        return NotImplemented
    x, dim, index = args
    if not _sharded_on(x, dim) or type(index) is not int:
        return NotImplemented
    dim %= x.ndim
    size = x.shape[dim]
    if not -size <= index < size:
        return NotImplemented  # (torch's path raises torch's IndexError)
    return _view(x, dim, (index % size, 1, 1), lambda moved: aten.select.int(moved, dim, 0))


@register_decomposition(aten.slice.Tensor)
def slice_(args: tuple, kwargs: dict) -> Any:
    if kwargs or not 1 <= len(args) <= 5:
        return NotImplemented
    x, dim, start, end, step = (*args, *(0, None, None, 1)[len(args) - 1:])  # (the schema's defaults)
    if not _sharded_on(x, dim) or any(type(v) not in (int, type(None)) for v in (start, end)) or \
            type(step) is not int or step <= 0:
        return NotImplemented
    dim %= x.ndim
    first, stop, step = slice(start, end, step).indices(x.shape[dim])
    n = len(range(first, stop, step))
    return _view(x, dim, (first, n, step), lambda moved: aten.slice.Tensor(moved, dim, 0, n))


def _sharded_on(x: Any, dim: Any) -> bool:
    return is_dtensor(x) and type(dim) is int and x.ndim > 0 and dim % x.ndim in sharded_dims(x)


def _view(x: Any, dim: int, r: tuple[int, int, int], take: Any) -> Any:
    """Rule 2, for the range `r` of `dim`."""
    if 2 * r[1] > x.shape[dim] or x.dtype not in REDUCIBLE or x._spec.has_partial() or \
            x._spec.unflattened() is not x._spec or getattr(x, "_origin", None) is not None:
        return NotImplemented
    where = Region(tuple(r if d == dim else (0, n, 1) for d, n in enumerate(x.shape)))
    moved = read(x, where)
    view = take(moved)
    view._origin = _views.Origin(x, moved, where)
    return view
