"""Grouped matmuls (`aten._grouped_mm`), the op MoE experts run on, and expert parallelism over them.

transformers' default experts forward (`grouped_mm_experts_forward`) sorts the (token, choice) slots by expert,
gathers the tokens' rows in that order (`hidden[perm // top_k]`), runs `_grouped_mm(rows, experts, offsets)`
twice with the activation between, weights the rows, puts them back in slot order (`rows[inv_perm]`) and sums
each token's choices. Every shape is static (no `nonzero`), so none of it needs a sync point.

Rules, by operands (S = rows, E = experts, n = devices on the expert mesh dim m, G = E / n per device; rule 1 is
registered in `_registry` as a sharding rule, rules 2 and 3 as a decomposition):
  1. no expert-sharded operand          the op runs replicated; DTorch gives the output shape itself (the meta
                                        kernel takes only bfloat16, which would send it to the client's local route)
  2. rows @ experts, experts Shard(0)   decomposed: device d owns experts [dG, dG+G), i.e. the sorted rows
     on m (ExpertParallel)              [lo_d, hi_d) = [offs[dG-1], offs[dG+G-1]). It gathers those rows to the
                                        top of a buffer of S rows (idx_d = min(arange(S) + lo_d, S-1)), runs
                                        `_grouped_mm` on its own experts with offsets offs[dG:dG+G] - lo_d (only its
                                        rows are computed), masks the rest and adds the rows back in place: the
                                        result is `DisjointPartial(routing, dim=0)` on m (see `_disjoint`). The rows
                                        operand is Replicate or DisjointPartial of the same routing.
  3. rows^T @ rows (expert weight       the same compaction of both operands, then `_grouped_mm` over the local
     gradients), one operand            groups: the result is `Shard(0)` on m, like the expert weights
     DisjointPartial on m
The per-device bounds, indices and offsets come from the offsets tensor by ordinary DTensor ops on `[n, ...]`
tensors sharded on m (`_Compaction`, once per offsets tensor); the three ops that use them on each device's own
rows are emitted directly with their layouts (`_local.emit`).

The token exchange is therefore the rows gather itself: `hidden[perm // top_k]` with tokens sharded gathers them
(one all-gather on m), and the combine is the first op that needs the DisjointPartial result's values (one
reduce-scatter or all-reduce on m, usually at the residual add). For EP degrees up to top_k the all-gather moves
no more bytes than an all-to-all would, and it needs no sync to learn the split sizes.

Routing tags: DisjointPartial tensors combine elementwise only with the same routing. An `ExpertParallel` module
gives its first offsets tensor per call its own tag (stable across calls, so plans stay cached); backward finds
the tag on the offsets tensor autograd saved. Other offsets get a fresh tag. Intermediates of two calls of the same
experts module share a tag; MoE code never combines them elementwise.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from dtorch._disjoint import DisjointPartial
from dtorch._local import emit, is_dtensor, on_dim, spec, to
from dtorch._registry import NoRule, Propagation, register, register_decomposition
from dtorch._spec import Spec, contiguous_stride
from dtorch.device_mesh import DeviceMesh
from dtorch_protocol.placement_types import Placement, Replicate, Shard

aten = torch.ops.aten
GROUPED_MM = aten._grouped_mm.default
_R = Replicate()

# ------------------------------------------------------------------------------------------------ routing tags


@dataclass
class _Scope:
    tag: int
    claimed: bool = False


_scope: ContextVar[_Scope | None] = ContextVar("dtorch_expert_routing", default=None)
_tags = itertools.count(1)


def new_routing_tag() -> int:
    return next(_tags)


@contextlib.contextmanager
def routing_scope(tag: int) -> Iterator[None]:
    """Inside, the first offsets tensor a grouped matmul meets takes routing `tag` (ExpertParallel's forward)."""
    token = _scope.set(_Scope(tag))
    try:
        yield
    finally:
        _scope.reset(token)


def _routing(offs: Any) -> int:
    tag = offs.__dict__.get("_dtorch_routing")
    if tag is None:
        scope = _scope.get()
        if scope is not None and not scope.claimed:
            scope.claimed, tag = True, scope.tag
        else:
            tag = new_routing_tag()
        offs.__dict__["_dtorch_routing"] = tag
    return tag


# ------------------------------------------------------------------------------------------------ helpers


def _with(mesh: DeviceMesh, m: int, p: Placement) -> tuple[Placement, ...]:
    return on_dim(mesh.ndim, m, p)


def _operand(t: Any, m: int, routing: int, owned: int) -> Any:
    """Rows the decomposition reads: Replicate, or DisjointPartial of this routing along the rows dim `owned`."""
    p = t.placements[m]
    keep = p if isinstance(p, DisjointPartial) and p.routing == routing and p.dim == owned else _R
    return to(t, _with(t.device_mesh, m, keep))


@dataclass(frozen=True)
class _Compaction:
    """Per device d of mesh dim m: where its experts' rows are (all tensors sharded Shard(0) on m)."""

    routing: int
    idx: Any  # [n*S] int64: device d's rows of the sorted order, compacted to the top (clamped past its count)
    valid: Any  # [n*S, 1] bool: which of the compacted rows are d's
    offs: Any  # [E] int32: each local expert's end offset within the compacted rows


def _compaction(offs: Any, m: int, rows: int) -> _Compaction:
    mesh = offs.device_mesh
    cache = offs.__dict__.setdefault("_dtorch_compactions", {})
    key = (mesh.id, m, rows)
    if key in cache:
        return cache[key]
    routing = _routing(offs)
    offs = to(offs, (_R,) * mesh.ndim)
    n, experts = mesh.shape[m], offs.shape[0]
    per = experts // n
    sharded = _with(mesh, m, Shard(0))
    bounds = torch.cat([offs.new_zeros(1), offs])  # [E+1]: expert e's rows are [bounds[e], bounds[e+1])
    lo = to(bounds[0:experts:per], sharded)
    hi = to(bounds[per:experts + 1:per], sharded)
    pos = (offs.new_ones(rows, dtype=torch.long).cumsum(0) - 1).unsqueeze(0)  # arange(rows), replicated
    idx = (pos + lo.unsqueeze(1)).clamp(max=max(rows - 1, 0)).reshape(-1)
    valid = (pos < (hi - lo).unsqueeze(1)).reshape(-1, 1)
    local_offs = (offs.view(n, per) - lo.unsqueeze(1)).reshape(-1).to(offs.dtype)
    cache[key] = _Compaction(routing, idx, valid, local_offs)
    return cache[key]


def _unpack(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, Any, Any]:
    names = ("self", "mat2", "offs", "bias", "out_dtype")
    values = dict(zip(names, args))
    values.update(kwargs)
    return tuple(values.get(n) for n in names)  # type: ignore[return-value]


def _expert_dim(w: Any) -> int | None:
    """The mesh dim on which a 3-d weight is sharded by expert (dim 0), when every other mesh dim replicates it."""
    dims = [i for i, p in enumerate(w.placements) if p == Shard(0)]
    if len(dims) != 1 or any(p != _R for i, p in enumerate(w.placements) if i != dims[0]):
        return None
    return dims[0]


def _disjoint_dim(*ts: Any) -> int | None:
    dims = {i for t in ts for i, p in enumerate(t.placements) if isinstance(p, DisjointPartial)}
    return dims.pop() if len(dims) == 1 else None


# ------------------------------------------------------------------------------------------------ rule 2 and 3


@register_decomposition(GROUPED_MM)
def decompose(args: tuple, kwargs: dict) -> Any:
    """`_grouped_mm` with expert-sharded operands (rules 2 and 3), or NotImplemented for the ordinary route."""
    x, w, offs, bias, out_dtype = _unpack(args, kwargs)
    if not (is_dtensor(x) and is_dtensor(w) and is_dtensor(offs)) or bias is not None \
            or x.device_mesh != w.device_mesh or offs.device_mesh != w.device_mesh or offs.ndim != 1:
        return NotImplemented
    dtype = out_dtype or x.dtype
    if x.ndim == 2 and w.ndim == 3:
        dim = _expert_dim(w)
        if dim is None or w.shape[0] % w.device_mesh.shape[dim] or offs.shape[0] != w.shape[0]:
            return NotImplemented
        return _rows_at_experts(x, w, offs, dim, dtype)
    if x.ndim == 2 and w.ndim == 2:
        dim = _disjoint_dim(x, w)
        if dim is None or offs.shape[0] % w.device_mesh.shape[dim]:
            return NotImplemented
        return _expert_gradient(x, w, offs, dim, dtype)
    return NotImplemented


def _rows_at_experts(x: Any, w: Any, offs: Any, m: int, dtype: torch.dtype) -> Any:
    mesh, rows = w.device_mesh, x.shape[0]
    n, out = mesh.shape[m], w.shape[2]
    c = _compaction(offs, m, rows)
    x = _operand(x, m, c.routing, owned=0)
    sharded = _with(mesh, m, Shard(0))
    gathered = emit(aten.index_select.default, (x, 0, c.idx), spec(mesh, sharded, (n * rows, x.shape[1]), x.dtype))
    local = emit(GROUPED_MM, (gathered, w, c.offs, None, dtype), spec(mesh, sharded, (n * rows, out), dtype))
    # rows past the device's count were never written
    local = emit(aten.where.ScalarOther, (c.valid, local, 0.0), spec(mesh, sharded, (n * rows, out), dtype))
    zeros = offs.new_zeros((rows, out), dtype=dtype)
    disjoint = _with(mesh, m, DisjointPartial(routing=c.routing, dim=0))
    return emit(aten.index_add.default, (zeros, 0, c.idx, local), spec(mesh, disjoint, (rows, out), dtype))


def _expert_gradient(a: Any, b: Any, offs: Any, m: int, dtype: torch.dtype) -> Any:
    mesh, rows = b.device_mesh, b.shape[0]
    n = mesh.shape[m]
    c = _compaction(offs, m, rows)
    a = _operand(a, m, c.routing, owned=1)
    b = _operand(b, m, c.routing, owned=0)
    sharded = _with(mesh, m, Shard(0))
    # gathered as [rows, K] and used transposed: the kernel wants 16-byte strides, which rows (any count) lack
    at = emit(aten.index_select.default, (a.t(), 0, c.idx), spec(mesh, sharded, (n * rows, a.shape[0]), a.dtype)).t()
    bc = emit(aten.index_select.default, (b, 0, c.idx), spec(mesh, sharded, (n * rows, b.shape[1]), b.dtype))
    return emit(GROUPED_MM, (at, bc, c.offs, None, dtype),
                spec(mesh, sharded, (offs.shape[0], a.shape[0], b.shape[1]), dtype))


# ------------------------------------------------------------------------------------------------ rule 1


def _out_shape(x: Spec, w: Spec, offs: Any) -> tuple[int, ...]:
    a, b = x.shape, w.shape
    if len(a) == 2 and len(b) == 3:
        return (a[0], b[2])
    if len(a) == 3 and len(b) == 2:
        return (a[1], b[1])
    if len(a) == 2 and len(b) == 2 and isinstance(offs, Spec):
        return (offs.shape[0], a[0], b[1])
    if len(a) == 3 and len(b) == 3:
        return (a[0], a[1], b[2])
    raise NoRule(f"_grouped_mm of {len(a)}-d and {len(b)}-d operands")


@register(GROUPED_MM)
def grouped_mm_replicated(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Propagation:
    """Rule 1: every operand replicated, the output replicated, its shape computed here."""
    x, w, offs, _bias, out_dtype = _unpack(args, kwargs)
    replicate = (_R,) * mesh.ndim
    rep = lambda v: v.with_placements(replicate) if isinstance(v, Spec) else v  # noqa: E731
    shape = _out_shape(x, w, offs)
    out = Spec(mesh, replicate, shape, contiguous_stride(shape), out_dtype or x.dtype)
    return Propagation(func, tuple(rep(a) for a in args), {k: rep(v) for k, v in kwargs.items()}, None, out)

