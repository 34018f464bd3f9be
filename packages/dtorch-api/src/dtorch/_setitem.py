"""Writes through an index (`x[i] = v`) into a DTensor sharded on an indexed dim, carried out where the rows live.

`x[5] = 1` is `x.select(0, 5).fill_(1)`: a view, then a write through it. On a tensor sharded on dim 0 that row
lives on one device, which no placement can say, so the view was taken of a gathered copy (the whole tensor on
every device) and the copy written back (`_views`): 64 MiB moved, and a quarter of a second, to write one row of a
64 MiB tensor (torch's DTensor gathers too). A sequence-sharded KV cache written at each decoding step, a buffer
filled row by row, a mask set in place: each paid the whole tensor per write.

Rules (`region` decides, `DTensor.__setitem__` carries it out with `write`; outside rule 1 torch's path
runs):
  1. The case: basic indexing (ints, slices with a positive step, one `...`) that names part of a dim of `x` that
     is sharded; nothing Partial in `x`; autograd not recording the write (grad mode off, or neither `x` nor the
     value requires grad); a value that is a real number or a tensor broadcasting to the indexed region (a DTensor
     on `x`'s mesh; a plain one is lifted, replicated).
  2. Each device writes its own part of the region (`_regions` rules 1 and 2): `x` never moves. Then, as after
     any write, views of moved copies that `x` reaches or that reach `x` follow (`_views.after_write`).
  3. The write is one operation of a compiled step (`_capture`), and bumps `x`'s version as torch's write does, so
     autograd still refuses a backward through a tensor written after it was saved.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch import _regions, _views
from dtorch._local import is_dtensor
from dtorch._regions import Region, region_of, sharded_dims


def region(x: Any, index: Any, value: Any) -> Region | None:
    """The region `x[index] = value` writes, when rule 1 holds; else None (torch's path)."""
    spec_ = x._spec
    if spec_.has_partial() or spec_.unflattened() is not spec_:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or isinstance(value, torch.Tensor) and value.requires_grad):
        return None
    if is_dtensor(value):
        if value.device_mesh != x.device_mesh:
            return None
    elif not isinstance(value, torch.Tensor) and type(value) not in (int, float, bool):
        return None
    where = region_of(index, tuple(x.shape))
    if where is None or not sharded_dims(x) & set(where.partial_dims(tuple(x.shape))):
        return None  # (a region of unsharded dims: torch's path takes the view where it lies)
    if isinstance(value, torch.Tensor):
        try:
            if torch.broadcast_shapes(tuple(value.shape), where.value_shape) != where.value_shape:
                return None
        except RuntimeError:
            return None
    return where


def write(x: Any, where: Region, value: Any) -> None:
    """Rule 2."""
    _regions.write(x, where, value)
    if _views.by_root:
        _views.after_write(x)
