"""`DisjointPartial`: a Partial("sum") whose per-device terms never overlap, and the ops that keep it.

Two decompositions produce it. Expert parallelism (`_experts`): each device computes the rows routed to its own
experts and holds zeros in every other row. Joint sequences (`_joint`): each device holds its chunk of each
concatenated segment in place. The tensor is the sum of the devices' terms (on the wire it is plain
`Partial("sum")`: the controller, redistributions and fetches treat it so), and each index of tensor dim `dim` is
nonzero on one device at most. Which device owns which index depends only on `routing` (an expert routing, or a
segment partition) and the index, so two tensors with the same routing and owned-dim size agree.

Because of that, an elementwise f distributes over the devices' terms whenever f(0, ..., 0) == 0: silu,
gelu, mul of two such tensors, mul by a replicated tensor, casts. torch's rules would gather a Partial
before any of them; the rules below keep the tensor where it is instead (table, per op kind):

  pointwise (torch.Tag.pointwise)  every DisjointPartial input has the same routing and (right-aligned) owned
                                   dim, unbroadcast; other inputs Replicate; f gives 0 where the
                                   DisjointPartial inputs are 0 (checked once per plan on small values)
  view / copy ops                  the owned dim survives as a whole dim: split, chunk, slice, narrow, select,
                                   index_select, unbind on other dims; transpose, t, permute, unsqueeze,
                                   squeeze, expand, view that keeps it; clone, detach, casts
  cat, stack                       along another dim, every input with the same routing and owned dim
  sum, mean                        over other dims (over the owned dim the result is an ordinary Partial)

Any other op sees an ordinary Partial("sum") (always correct): torch's own rule decides, e.g. a gather of
rows keeps it Partial, and the next op that needs a value reduces it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from dtorch._registry import NoRule
from dtorch._spec import Spec
from dtorch.device_mesh import DeviceMesh
from dtorch_protocol.placement_types import Partial, Placement, Replicate

aten = torch.ops.aten
_R = Replicate()


@dataclass(frozen=True, repr=False)
class DisjointPartial(Partial):
    """Partial("sum") in which each index of tensor dim `dim` is nonzero on one device at most (client-side only).

    `routing` names the partition: an int for an expert routing (`_experts`), `("segments", ...)` for a joint
    sequence (`_joint`)."""

    routing: Any = 0
    dim: int = 0

    def __repr__(self) -> str:
        return f"DisjointPartial(routing={self.routing}, dim={self.dim})"


def has_disjoint(args: Any, kwargs: Any) -> bool:
    return any(isinstance(s, Spec) and any(isinstance(p, DisjointPartial) for p in s.placements)
               for s in pytree.tree_leaves((args, kwargs)))


def demoted(spec: Spec) -> Spec:
    """The same tensor seen as an ordinary Partial("sum") (what torch's rules understand)."""
    return spec.with_placements(tuple(Partial() if isinstance(p, DisjointPartial) else p for p in spec.placements))


def propagate(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, torch_rule: Callable) -> Any:
    """The Propagation of an op with DisjointPartial inputs: kept where the table allows, else torch's rule on the
    demoted inputs (an input torch keeps Partial stays where it is)."""
    kept = _keep(func, args, kwargs, mesh, torch_rule)
    if kept is not None:
        return kept
    originals = _specs(args, kwargs)
    prop = torch_rule(func, *_map_specs((args, kwargs), demoted), mesh)
    _restore(prop, originals, lambda d, r: isinstance(r, Partial) and r.reduce_op == "sum")
    return prop


def _specs(args: Any, kwargs: Any) -> list[Spec]:
    return [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, Spec)]


def _map_specs(tree: Any, fn: Callable) -> Any:
    return pytree.tree_map(lambda v: fn(v) if isinstance(v, Spec) else v, tree)


def _restore(prop: Any, originals: list[Spec], keeps: Callable[[Placement, Placement], bool]) -> bool:
    """Put the DisjointPartial placements back into the input layouts torch required, where `keeps(original,
    required)` says the op reads it where it is. Inputs pair up by position (torch may rewrite the op and its
    args, never the order of its tensors); False when they do not pair."""
    leaves, tree = pytree.tree_flatten((prop.args, prop.kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, Spec)]
    if len(where) != len(originals):
        return False
    for i, orig in zip(where, originals):
        req = leaves[i]
        placements = tuple(o if isinstance(o, DisjointPartial) and keeps(o, r) else r
                           for o, r in zip(orig.placements, req.placements))
        leaves[i] = req.with_placements(placements)
    prop.args, prop.kwargs = pytree.tree_unflatten(leaves, tree)
    return True


# ---------------------------------------------------------------------------------------------- the table


_PARTIAL = -1  # what an owned-dim rule answers when the outputs are ordinary Partials (the owned dim was reduced)


def _keep(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh, torch_rule: Callable) -> Any:
    specs = _specs(args, kwargs)
    dims = {i for s in specs for i, p in enumerate(s.placements) if isinstance(p, DisjointPartial)}
    if len(dims) != 1:
        return None
    m = dims.pop()
    disjoint = [s for s in specs if isinstance(s.placements[m], DisjointPartial)]
    if len({s.placements[m].routing for s in disjoint}) != 1 or \
            any(not isinstance(s.placements[m], (DisjointPartial, Replicate)) for s in specs):
        return None
    owned = _OWNED.get(func) or (_pointwise if torch.Tag.pointwise in func.tags else None)
    out_dim = None if owned is None else owned(func, args, kwargs)
    if out_dim is None:
        return None
    routing = disjoint[0].placements[m].routing
    # torch's rule with the DisjointPartial dim seen as Replicate: every device runs the op on what it holds
    swap = lambda v: v.with_placements(tuple(_R if i == m else p for i, p in enumerate(v.placements)))  # noqa: E731
    try:
        prop = torch_rule(func, *_map_specs((args, kwargs), swap), mesh)
    except NoRule:
        return None
    if any(s.placements[m] != _R for s in _specs(prop.args, prop.kwargs)) or prop.rank_args is not None or \
            not _restore(prop, specs, lambda _o, r: r == _R):
        return None
    outs = prop.outputs if isinstance(prop.outputs, (list, tuple)) else [prop.outputs]
    if any(s is not None and s.placements[m] != _R for s in outs):
        return None
    p: Placement = Partial() if out_dim == _PARTIAL else DisjointPartial(routing=routing, dim=out_dim)
    fixed = [None if s is None else s.with_placements(tuple(p if i == m else q for i, q in enumerate(s.placements)))
             for s in outs]
    prop.outputs = type(prop.outputs)(fixed) if isinstance(prop.outputs, (list, tuple)) else fixed[0]
    return prop


def _owner(spec: Any) -> int | None:
    """The owned dim of a DisjointPartial spec (on its one DisjointPartial mesh dim), else None."""
    if isinstance(spec, Spec):
        for p in spec.placements:
            if isinstance(p, DisjointPartial):
                return p.dim
    return None


# Owned-dim rules: (func, args, kwargs) -> the owned dim of every output, _PARTIAL, or None (not kept).


def _pointwise(func: Any, args: tuple, kwargs: dict) -> int | None:
    specs = [s for s in pytree.tree_leaves((args, kwargs)) if isinstance(s, Spec)]
    out_shape = torch.broadcast_shapes(*[s.shape for s in specs])
    dims = set()
    for s in specs:
        own = _owner(s)
        if own is not None:
            dim = len(out_shape) - len(s.shape) + own
            if s.shape[own] != out_shape[dim]:
                return None  # broadcast along the owned dim
            dims.add(dim)
    if len(dims) != 1 or not _zero_preserving(func, args, kwargs):
        return None
    return dims.pop()


def _zero_preserving(func: Any, args: tuple, kwargs: dict) -> bool:
    """Does f give 0 where its DisjointPartial inputs are 0, whatever the replicated inputs hold?"""
    gen = torch.Generator().manual_seed(0)

    def probe(v: Any) -> Any:
        if not isinstance(v, Spec):
            return v
        shape = tuple(min(n, 2) for n in v.shape)  # keeps which dims broadcast
        if _owner(v) is not None:
            return torch.zeros(shape, dtype=v.dtype)
        if v.dtype == torch.bool:
            return torch.rand(shape, generator=gen) > 0.5
        if v.dtype.is_floating_point:
            sign = 1 - 2 * (torch.rand(shape, generator=gen) > 0.5).to(v.dtype)
            return ((torch.rand(shape, generator=gen) + 0.5) * sign).to(v.dtype)
        return torch.ones(shape, dtype=v.dtype)

    try:
        out = func(*pytree.tree_map(probe, args), **pytree.tree_map(probe, kwargs))
    except Exception:  # noqa: BLE001 - whatever refuses the probe does not keep the layout
        return False
    flat = out if isinstance(out, (list, tuple)) else [out]
    return all(isinstance(t, torch.Tensor) and not t.is_complex() and bool((t == 0).all()) for t in flat)


def _same(func: Any, args: tuple, kwargs: dict) -> int | None:
    """Copies and casts: the owned dim stays (a cast of 0 is 0)."""
    return _owner(args[0])


def _dim_arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any = 0) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _norm(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def _along_other_dim(pos: int, name: str) -> Callable:
    """split, slice, narrow, index_select: fine along any dim but the owned one (which keeps its place)."""

    def rule(func: Any, args: tuple, kwargs: dict) -> int | None:
        own = _owner(args[0])
        if own is None or _norm(_dim_arg(args, kwargs, pos, name), len(args[0].shape)) == own:
            return None
        return own

    return rule


def _select(func: Any, args: tuple, kwargs: dict) -> int | None:
    own, dim = _owner(args[0]), _norm(args[1], len(args[0].shape))
    if own is None or dim == own:
        return None
    return own - 1 if dim < own else own


def _transpose(func: Any, args: tuple, kwargs: dict) -> int | None:
    own, ndim = _owner(args[0]), len(args[0].shape)
    if own is None:
        return None
    a, b = (0, 1) if func is aten.t.default else (_norm(args[1], ndim), _norm(args[2], ndim))
    return b if own == a else a if own == b else own


def _permute(func: Any, args: tuple, kwargs: dict) -> int | None:
    own, ndim = _owner(args[0]), len(args[0].shape)
    return None if own is None else [_norm(d, ndim) for d in args[1]].index(own)


def _unsqueeze(func: Any, args: tuple, kwargs: dict) -> int | None:
    own = _owner(args[0])
    if own is None:
        return None
    dim = _norm(args[1], len(args[0].shape) + 1)
    return own + 1 if dim <= own else own


def _squeeze(func: Any, args: tuple, kwargs: dict) -> int | None:
    own, shape = _owner(args[0]), args[0].shape
    if own is None:
        return None
    dims = range(len(shape)) if len(args) < 2 else [args[1]] if isinstance(args[1], int) else args[1]
    gone = {_norm(d, len(shape)) for d in dims if shape[_norm(d, len(shape))] == 1}
    return None if own in gone else own - sum(1 for d in gone if d < own)


def _expand(func: Any, args: tuple, kwargs: dict) -> int | None:
    own, shape = _owner(args[0]), args[0].shape
    if own is None:
        return None
    new = own + len(args[1]) - len(shape)
    return new if args[1][new] in (-1, shape[own]) else None


def _view(func: Any, args: tuple, kwargs: dict) -> int | None:
    """A view keeps the owned dim when the dims before it (in product) and the dim itself survive."""
    own, shape = _owner(args[0]), args[0].shape
    if own is None:
        return None
    size = list(args[1])
    if -1 in size:
        known = math.prod(n for n in size if n != -1)
        size[size.index(-1)] = math.prod(shape) // known if known else 0
    before = math.prod(shape[:own])
    return next((k for k in range(len(size)) if math.prod(size[:k]) == before and size[k] == shape[own]), None)


def _unbind(func: Any, args: tuple, kwargs: dict) -> int | None:
    own, dim = _owner(args[0]), _norm(_dim_arg(args, kwargs, 1, "dim"), len(args[0].shape))
    if own is None or dim == own:
        return None
    return own - 1 if dim < own else own


def _stack(func: Any, args: tuple, kwargs: dict) -> int | None:
    owns = {_owner(t) for t in args[0]}
    if len(owns) != 1 or None in owns:
        return None
    own = owns.pop()
    dim = _norm(_dim_arg(args, kwargs, 1, "dim"), len(args[0][0].shape) + 1)
    return own + 1 if dim <= own else own


def _cat(func: Any, args: tuple, kwargs: dict) -> int | None:
    tensors = [t for t in args[0] if len(t.shape) > 1 or t.shape[0] > 0]  # legacy empty 1-d tensors are skipped
    owns = {_owner(t) for t in tensors}
    if len(owns) != 1 or None in owns:
        return None
    own = owns.pop()
    return None if _norm(_dim_arg(args, kwargs, 1, "dim"), len(tensors[0].shape)) == own else own


def _reduce(func: Any, args: tuple, kwargs: dict) -> int | None:
    """sum/mean over dims: the owned dim stays unless it is reduced (then the result is an ordinary Partial)."""
    own, ndim = _owner(args[0]), len(args[0].shape)
    if own is None:
        return None
    dims = _dim_arg(args, kwargs, 1, "dim", None)
    keepdim = _dim_arg(args, kwargs, 2, "keepdim", False)
    reduced = set(range(ndim)) if not dims else {_norm(d, ndim) for d in dims}
    if own in reduced:
        return _PARTIAL
    return own if keepdim else own - sum(1 for d in reduced if d < own)


_OWNED: dict[Any, Callable] = {
    aten._to_copy.default: _same,
    aten.clone.default: _same,
    aten.detach.default: _same,
    aten.alias.default: _same,
    aten.split.Tensor: _along_other_dim(2, "dim"),
    aten.split_with_sizes.default: _along_other_dim(2, "dim"),
    aten.chunk.default: _along_other_dim(2, "dim"),
    aten.slice.Tensor: _along_other_dim(1, "dim"),
    aten.narrow.default: _along_other_dim(1, "dim"),
    aten.index_select.default: _along_other_dim(1, "dim"),
    aten.select.int: _select,
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.expand.default: _expand,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.cat.default: _cat,
    aten.stack.default: _stack,
    aten.unbind.int: _unbind,
    aten.sum.dim_IntList: _reduce,
    aten.mean.dim: _reduce,
}
