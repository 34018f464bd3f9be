"""Emitting an op on each device's own shards, for decompositions that know the layout of what it produces.

A decomposition (`_registry.register_decomposition`) runs several ops in place of one; the ops whose per-device
work is not what torch's rules would derive from the inputs' layouts (each device gathering its own rows, say)
are emitted here with the layout the decomposition declares. Arguments may differ per device (`per_device`: the
args of each mesh position, in the mesh's row-major order), as for ops planned with per-device args.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from dtorch import _torch_state
from dtorch._source import user_src
from dtorch._spec import Spec, contiguous_stride
from dtorch_protocol import messages as m
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Placement, Replicate, Shard
from dtorch_protocol.values import encode_value

_R = Replicate()
aten = torch.ops.aten
# dtypes whose Partial values reduce (sum, max, min) across devices as they are: the decompositions that leave a
# result Partial take these only
REDUCIBLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def on_dim(ndim: int, dim: int, p: Placement, others: tuple[Placement, ...] | None = None) -> tuple[Placement, ...]:
    """Placements with `p` on mesh dim `dim` and `others` (default Replicate) elsewhere."""
    base = others or (_R,) * ndim
    return tuple(p if i == dim else q for i, q in enumerate(base))


def on_dims(placements: tuple[Placement, ...], mesh_dims: list[int], p: Placement) -> tuple[Placement, ...]:
    """`placements` with `p` on each of `mesh_dims`."""
    return tuple(p if i in mesh_dims else q for i, q in enumerate(placements))


def spec(mesh: Any, placements: tuple[Placement, ...], shape: tuple[int, ...], dtype: torch.dtype) -> Spec:
    return Spec(mesh, placements, tuple(shape), contiguous_stride(shape), dtype)


def emit(op: Any, args: tuple, out: Spec | list[Spec | None], per_device: list[tuple] | None = None,
         kwargs: dict | None = None) -> Any:
    """Run `op` on every device's shards of the DTensors in `args` (or in `per_device[i]` on the i-th device of the
    mesh); `out` declares the global layout of what it gives (a list for ops with several outputs, None to drop one).
    """
    ref = next(a for a in pytree.tree_leaves((args, per_device)) if is_dtensor(a))
    session, mesh, make = ref._session, ref.device_mesh, type(ref)
    ref_of = lambda t: {"$t": t._tid} if is_dtensor(t) else None  # noqa: E731
    encode = lambda v: encode_value(v, ref_of)  # noqa: E731
    kw = {k: encode(v) for k, v in (kwargs or {}).items()}
    local = None if per_device is None else {dev: [encode(list(a)), kw] for dev, a in zip(mesh.devices, per_device)}
    specs = out if isinstance(out, list) else [out]
    tids = [None if s is None else session.new_tid() for s in specs]
    written = [a._tid for arg, a in zip(op._schema.arguments, args)
               if arg.alias_info is not None and arg.alias_info.is_write and is_dtensor(a)]
    session.emit(m.InstrCall(op=str(op), mesh=mesh.id, args=encode(list(args)), kwargs=kw,
                             outs=[None if s is None else m.OutSpec(t, s.wire) for t, s in zip(tids, specs)],
                             local=local, src=user_src(3), writes=written, default_dtype=_torch_state.default_dtype))
    results = [None if s is None else make(s, t, session) for t, s in zip(tids, specs)]
    return results if isinstance(out, list) else results[0]


def to(t: Any, placements: tuple[Placement, ...]) -> Any:
    """`t` redistributed to `placements` on its mesh (inside a decomposition autograd is off: a plain move)."""
    return t if t.placements == placements else t.redistribute(placements=placements)


def is_dtensor(v: Any) -> bool:
    """A DTensor, told without importing the module (decompositions sit below `dtensor`)."""
    return isinstance(v, torch.Tensor) and getattr(v, "_spec", None) is not None and hasattr(v, "_tid")


def sharded_dim(*tensors: Any, dim: int) -> bool:
    """Is `dim` of these DTensors (laid out alike) sharded, with some of it on every device and nothing Partial?"""
    if not all(is_dtensor(t) for t in tensors):
        return False
    first = tensors[0]
    dim %= max(first.ndim, 1)
    if any(p.is_partial() for t in tensors for p in t.placements):
        return False
    parts = math.prod(first.device_mesh.size(i) for i, p in enumerate(first.placements)
                      if isinstance(p, Shard) and p.dim % first.ndim == dim)
    return parts > 1 and all(length for _, length in rows(first, dim))


def sharding(t: Any, dim: int) -> list[int]:
    """The mesh dims that shard `dim` of DTensor `t`."""
    return [i for i, p in enumerate(t.placements) if isinstance(p, Shard) and p.dim % t.ndim == dim % t.ndim]


def boxes(mesh: Any, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """Each device's box ((start, length) per dim) of a tensor of `shape` laid out so, in the mesh's row-major
    order (torch.chunk's split: 5 over 4 devices is 2, 2, 1, 0)."""
    return [shard_box(tuple(shape), mesh.shape, tuple(placements), c) for c in coords(mesh.shape)]


def rows(t: Any, dim: int) -> list[tuple[int, int]]:
    """Each device's (start, length) of `dim` of DTensor `t`, in the mesh's row-major order."""
    return [box[dim % t.ndim] for box in boxes(t.device_mesh, t.placements, t.shape)]


def own_rows(indices: Any, rows: list[tuple[int, int]]) -> tuple[Any, Any]:
    """(mine, safe) for indices into a dim split over devices (`rows`: each device's (start, length) of it, in the
    mesh's row-major order): where each device's indices fall in its rows, and the indices shifted into them, 0
    elsewhere. Both are laid out as `indices` but differ per device: only ops emitted here may read them."""
    mesh = indices.device_mesh
    shifted = emit(aten.sub.Scalar, (indices, 0), indices._spec, per_device=[(indices, start) for start, _ in rows])
    below = emit(aten.lt.Scalar, (shifted, 0), spec(mesh, indices.placements, indices.shape, torch.bool),
                 per_device=[(shifted, length) for _, length in rows])
    mine = emit(aten.logical_and.default, (emit(aten.ge.Scalar, (shifted, 0), below._spec), below), below._spec)
    return mine, emit(aten.mul.Tensor, (shifted, mine), shifted._spec)


def check_indices(indices: Any, size: int, message: str, allowed: int | None = None) -> None:
    """Fail where an index lies outside [0, `size`) (and is not `allowed`: an ignore_index), as torch's kernel
    does: a lookup masked by `own_rows` would read zeros there, a wrong value and no error. The failure reaches the
    user at the next sync point, with `message` and the user's line. Each device checks the indices it holds (its
    `all` covers its own shard: no collective); only the assert reads that per-device flag."""
    ok = aten.logical_and.default(aten.ge.Scalar(indices, 0), aten.lt.Scalar(indices, size))
    if allowed is not None:
        ok = aten.logical_or.default(ok, aten.eq.Scalar(indices, allowed))
    mesh = indices.device_mesh
    every = emit(aten.all.default, (ok,), spec(mesh, (_R,) * mesh.ndim, (), torch.bool))
    emit(aten._assert_async.msg, (every, message), [])


def only_mine(mine: Any, values: Any, out: Spec) -> Any:
    """`values` where `mine`, zero elsewhere, on each device (`where`: an inf or NaN elsewhere cannot leak, as it
    would through a product with the mask)."""
    return emit(aten.where.ScalarOther, (mine, values, 0.0 if values.dtype.is_floating_point else 0), out)
