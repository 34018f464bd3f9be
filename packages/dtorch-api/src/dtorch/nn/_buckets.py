"""`fully_shard`'s communication, one collective per parameter group: FSDP2's flat all-gather and reduce-scatter.

A `fully_shard` call's parameters (FSDP2's parameter group) are gathered together when its module's forward starts,
and their gradients are reduced together when its backward ends. FSDP2 does this with its flat buffers: one
collective each way. One collective per parameter paid a collective's fixed cost (a controller round, and a
rendezvous of every worker) once for each parameter of the group (a transformer block has 9 or more).

Rules:
  1. A parameter is *packed* when it goes from Shard(0) to Replicate on every mesh dim its gather changes (the
     *gather dims*) and it is split evenly (every device's shard has one shape). The other mesh dims that split its
     dim 0 stay so (the *stacked dims*: TP's colwise weights under FSDP x TP). Packed parameters with the same
     gather and stacked dims and one dtype (after the mixed-precision cast) form a *bucket*. A bucket of one, and
     any other parameter, is redistributed alone.
  2. A bucket's gather: each device concatenates its shards, flattened (`aten._chunk_cat`, in one chunk), into its
     row of a flat tensor. The flat tensor is laid out Shard(0) over the gather and stacked dims, nested as the
     parameters' dim 0 (so its rows are in the order of their chunks of dim 0), and Shard(1) over the others, so
     each device's row is its own. One redistribution to Replicate over the gather dims (an all_gather; the stacked
     dims keep Shard(0)) gives every device the rows of its gathered shards. Each device then splits them per
     parameter (`aten.split_with_sizes_copy`) and views each piece as its gathered shard.
  3. A bucket's reduce (the backward of its gather) takes the gradients that arrive Partial(sum) on the gather dims
     and, on each other dim, laid out as the gathered parameter or Partial(sum) where the parameter is Replicate
     (HSDP's replicated dim; a norm's weight under sequence parallelism); a bucket's gradients are Partial on the
     same dims. Each device cuts them into one chunk per rank of dim 0 (`aten._chunk_cat`: row r holds what rank r
     keeps of every gradient). One redistribution to Shard(0) over the gather dims and Replicate over the other
     Partial dims (a reduce_scatter, and an all_reduce) reduces them; the result is split and viewed as each
     parameter's shard. Any other gradient is redistributed alone. Gradients are reduced in `reduce_dtype` and
     kept in the parameter's dtype. Where the module does not synchronize gradients (`Member.reduce` None), they
     are returned as the backward made them. As torch's own: a frozen parameter's gathered copy requires no
     gradient, and a parameter the forward did not use gets none (None, not zeros).
  4. Both move the per-parameter redistributions' bytes, only together: the values are the same, bit for bit (each
     sum is taken in the order that collectives rule 2 fixes).
  5. Gathering again for backward (`_reshard`) is per gather: the first parameter a backward needs gathers the whole
     gather again (one collective per bucket again). The others are handed out as they are needed, and what was
     not handed out is dropped when the gather's gradients are reduced.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from dtorch._local import emit, spec
from dtorch.dtensor import DTensor
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
_S0, _S1, _R, _SUM = Shard(0), Shard(1), Replicate(), Partial()


@dataclass(frozen=True, eq=False)
class Member:
    """One parameter of a gather: gathered to `placements` in `dtype`, its gradient reduced in `reduce` (None: left
    as the backward makes it, rule 3)."""

    param: DTensor
    placements: tuple[Placement, ...]
    dtype: torch.dtype
    reduce: torch.dtype | None


def gather(members: Sequence[Member]) -> list[DTensor]:
    """Each member's parameter gathered: each bucket in one collective, the rest alone (rules 1 and 2)."""
    return _moved(members, [m.param for m in members], [m.dtype for m in members], [m.placements for m in members])


def reduce(members: Sequence[Member], grads: Sequence[Any]) -> list[Any]:
    """Each member's gradient, from the gathered layout to its parameter's: each bucket in one collective (rule 3)."""
    out: list[Any] = [None] * len(members)
    todo = [i for i, g in enumerate(grads) if g is not None]
    for i in [i for i in todo if members[i].reduce is None]:
        out[i] = _cast(grads[i], members[i].param.dtype)
    todo = [i for i in todo if members[i].reduce is not None]
    mine = [members[i] for i in todo]
    reduced = _moved(mine, [grads[i] for i in todo], [m.reduce for m in mine], [m.param.placements for m in mine],
                     scatter=True)
    for i, m, g in zip(todo, mine, reduced):
        out[i] = _cast(g, m.param.dtype)
    return out


def _moved(members: Sequence[Member], tensors: list[Any], dtypes: list[torch.dtype],
           targets: list[tuple[Placement, ...]], scatter: bool = False) -> list[DTensor]:
    """`tensors` (one per member: its parameter, or with `scatter` its gradient) cast to `dtypes` and moved to
    `targets`: each bucket in one collective, the rest alone."""
    out: list[Any] = [None] * len(members)
    for (dims, stacked, dtype, summed), idx in _buckets(members, dtypes, tensors if scatter else None).items():
        cast = [_cast(tensors[i], dtype) for i in idx]
        if dims is None or len(idx) == 1:
            moved = [t.redistribute(placements=targets[i]) for t, i in zip(cast, idx)]
        else:
            moved = _packed(cast, [members[i].param for i in idx], [targets[i] for i in idx], dims, stacked, summed,
                            scatter)
        for i, t in zip(idx, moved):
            out[i] = t
    return out


class Gather(torch.autograd.Function):
    """A gather whose backward is its reduce: `Gather.apply(members, after, *params)` gives the gathered parameters;
    each of `after` is called when the backward reaches it (FSDP2's post-backward: `GatherAgain.release`, rule 5)."""

    @staticmethod
    def forward(ctx: Any, members: tuple[Member, ...], after: tuple[Callable[[], None], ...],
                *params: DTensor) -> tuple:
        ctx.members, ctx.after = members, after
        wholes = gather(members)
        ctx.mark_non_differentiable(*(w for w, p in zip(wholes, params) if not p.requires_grad))  # (frozen)
        ctx.set_materialize_grads(False)  # (an unused parameter's gradient stays None, not zeros)
        return tuple(wholes)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        for done in ctx.after:
            done()
        return (None, None, *reduce(ctx.members, grads))


class GatherAgain:
    """One gather's parameters gathered again for its backward (rule 5)."""

    def __init__(self, members: tuple[Member, ...]) -> None:
        self.members = members
        self.index = {id(m.param): i for i, m in enumerate(members)}
        self.pending: dict[int, DTensor] | None = None  # gathered and not yet handed out (None: not gathered yet)
        self.given: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handed out, while in use

    def whole(self, param: DTensor) -> DTensor:
        i = self.index[id(param)]
        whole = self.given.get(i)
        if whole is None:
            if self.pending is None:
                with torch.no_grad():
                    self.pending = dict(enumerate(gather(self.members)))
            whole = self.pending.pop(i, None)
            if whole is None:  # (handed out before and dropped since, or after the release)
                with torch.no_grad():
                    whole = gather([self.members[i]])[0]
            self.given[i] = whole
        return whole

    def release(self) -> None:
        self.pending = {}


def _buckets(members: Sequence[Member], dtypes: Sequence[torch.dtype],
             grads: Sequence[Any] | None = None) -> dict[tuple, list[int]]:
    """(gather dims or None, stacked dims, dtype, the other dims the gradients are Partial on) -> the indices of the
    members moved together (gather dims None: each alone), rules 1 and 3."""
    out: dict[tuple, list[int]] = {}
    for i, (m, dtype) in enumerate(zip(members, dtypes)):
        dims, summed = _gather_dims(m.param, m.placements), ()
        stacked = tuple(d for d, q in enumerate(m.placements) if d not in (dims or ()) and isinstance(q, Shard)
                        and q.dim % m.param.ndim == 0)
        if dims is not None and grads is not None:
            g = grads[i].placements if isinstance(grads[i], DTensor) else ()
            summed = tuple(d for d, (q, w) in enumerate(zip(g, m.placements)) if d not in dims and q != w)
            if len(g) != len(m.placements) or any(g[d] != _SUM for d in dims) \
                    or any(g[d] != _SUM or m.placements[d] != _R for d in summed):
                dims, summed = None, ()
        out.setdefault((dims, stacked, dtype, summed), []).append(i)
    return out


def _gather_dims(p: DTensor, gathered: tuple[Placement, ...]) -> tuple[int, ...] | None:
    """The mesh dims a packed parameter is gathered on; None where it is not packed (rule 1)."""
    dims = tuple(d for d, (s, g) in enumerate(zip(p.placements, gathered)) if s != g)
    if not dims or any(p.placements[d] != _S0 or gathered[d] != _R for d in dims):
        return None
    if any(q.is_partial() for q in gathered):
        return None
    return dims if _even(tuple(p.device_mesh.shape), p.placements, tuple(p.shape)) else None


@lru_cache(maxsize=4096)
def _even(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...], shape: tuple[int, ...]) -> bool:
    return len({tuple(n for _, n in shard_box(shape, mesh_shape, placements, c)) for c in coords(mesh_shape)}) == 1


def _local_shape(placements: tuple[Placement, ...], p: DTensor) -> tuple[int, ...]:
    """Each device's shape of `p` laid out as `placements` (even: rule 1)."""
    mesh_shape = tuple(p.device_mesh.shape)
    return tuple(n for _, n in shard_box(tuple(p.shape), mesh_shape, placements, (0,) * len(mesh_shape)))


def _counts(p: DTensor, dims: tuple[int, ...], stacked: tuple[int, ...], summed: tuple[int, ...]
            ) -> tuple[int, int, int]:
    """The devices of one gather group (the rows a device gathers), the stacked dims' devices (the flat tensor has
    both's product of rows), and the row's length over a device's (its Shard(1) dims: the rest)."""
    sizes = tuple(p.device_mesh.shape)
    return (math.prod(sizes[d] for d in dims), math.prod(sizes[d] for d in stacked),
            math.prod(n for d, n in enumerate(sizes) if d not in dims + stacked + summed))


def _flat(ndim: int, dims: tuple[int, ...], p: Placement, stacked: tuple[int, ...], summed: tuple[int, ...],
          q: Placement) -> tuple[Placement, ...]:
    """The flat tensor's placements: `p` on the gather dims, Shard(0) on the stacked ones, `q` on the `summed` ones,
    Shard(1) (each device its own columns) elsewhere."""
    return tuple(p if d in dims else _S0 if d in stacked else q if d in summed else _S1 for d in range(ndim))


def _packed(tensors: list[DTensor], params: list[DTensor], targets: list[tuple[Placement, ...]],
            dims: tuple[int, ...], stacked: tuple[int, ...], summed: tuple[int, ...], scatter: bool
            ) -> list[DTensor]:
    """`tensors` (one per parameter of a bucket: its shard, or with `scatter` its gradient) moved to `targets` in one
    redistribution over the gather dims: packed into one flat tensor on each device, moved, split and viewed as
    each target's local shape (rules 2 and 3)."""
    mesh, dtype = params[0].device_mesh, tensors[0].dtype
    n, m, keep = _counts(params[0], dims, stacked, summed)
    lengths = [math.prod(_local_shape(p.placements, p)) for p in params]
    src, dst = (_SUM, _S0) if scatter else (_S0, _R)
    flat = emit(aten._chunk_cat.default, (tensors, 0, n if scatter else 1),
                spec(mesh, _flat(mesh.ndim, dims, src, stacked, summed, _SUM), (n * m, sum(lengths) * keep), dtype))
    rows = flat.redistribute(placements=_flat(mesh.ndim, dims, dst, stacked, summed, _R))
    pieces = emit(aten.split_with_sizes_copy.default, (rows, lengths, 1),
                  [spec(mesh, rows.placements, (n * m, length * keep), dtype) for length in lengths])
    return [emit(aten.view.default, (piece, list(_local_shape(pl, p))), spec(mesh, pl, tuple(p.shape), dtype))
            for piece, pl, p in zip(pieces, targets, params)]


def _cast(t: Any, dtype: torch.dtype) -> Any:
    return t if t.dtype == dtype else t.to(dtype)
