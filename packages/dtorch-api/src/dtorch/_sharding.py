"""The one adapter to torch's private sharding propagation (`torch.distributed.tensor` internals).

torch 2.13 knows sharding rules for ~1,160 aten overloads and can apply them to metadata
alone, with process-group-free meshes. Everything private we touch is in this file:
`ShardingPropagator`, `OpSchema`, `DTensorSpec`, `TensorMeta`. When torch has no rule, or
answers with private placements (`_StridedShard`, `_MaskPartial`), we raise `NoRule` and
the caller falls back to running the op on replicated inputs, which is always correct.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor as _TorchDTensor
from torch.distributed.tensor import placement_types as tp
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema

from dtorch._spec import Spec
from dtorch.device_mesh import DeviceMesh
from dtorch.placement_types import Partial, Placement, Replicate, Shard

_prop = _TorchDTensor._op_dispatcher.sharding_propagator


class NoRule(Exception):
    """torch has no usable sharding rule for this op and these placements."""


def _to_torch(p: Placement) -> Any:
    if isinstance(p, Shard):
        return tp.Shard(p.dim)
    if isinstance(p, Partial):
        return tp.Partial(p.reduce_op)
    return tp.Replicate()


def _from_torch(p: Any) -> Placement:
    kind = type(p)
    if kind is tp.Shard:
        return Shard(p.dim)
    if kind is tp.Replicate:
        return Replicate()
    if kind is tp.Partial and p.reduce_op in ("sum", "avg", "max", "min"):
        return Partial(p.reduce_op)
    raise NoRule(f"torch chose the private placement {p}")


def _torch_spec(spec: Spec, rank: int) -> DTensorSpec:
    return DTensorSpec(spec.mesh.torch_mesh(rank), tuple(_to_torch(p) for p in spec.placements),
                       TensorMeta(torch.Size(spec.shape), spec.stride, spec.dtype))


def _our_spec(ts: DTensorSpec, mesh: DeviceMesh) -> Spec:
    meta = ts.tensor_meta
    if meta is None:
        raise NoRule("torch gave an output spec without tensor metadata")
    return Spec(mesh, tuple(_from_torch(p) for p in ts.placements), tuple(meta.shape), tuple(meta.stride), meta.dtype)


def _convert(tree: Any, fn: Any) -> Any:
    return pytree.tree_map(lambda v: fn(v) if isinstance(v, (Spec, DTensorSpec)) else v, tree)


@dataclass
class Propagation:
    """torch's answer, in our types: what to run, on which input layouts, giving which outputs."""

    op: Any  # OpOverload to run (torch may rewrite it, e.g. squeeze -> squeeze.dims)
    args: tuple  # Specs (required input layouts) and non-tensor values, as for device 0
    kwargs: dict
    rank_args: list[tuple[tuple, dict]] | None  # per mesh position, where non-tensor args differ by device
    outputs: Any  # Spec | None | list/tuple of (Spec | None), mirroring the op's return


def _schema(func: Any, args: tuple, kwargs: dict, rank: int) -> OpSchema:
    info = _prop.op_to_schema_info.get(func) or _prop.op_to_schema_info_for_single_dim_strategy.get(func)
    to_torch = lambda s: _torch_spec(s, rank)  # noqa: E731
    return OpSchema(func, tuple(_convert(tuple(args), to_torch)), _convert(dict(kwargs), to_torch),
                    schema_info=info)


def _apply_suggestion(func: Any, args: tuple, kwargs: dict, out: Any, mesh: DeviceMesh) -> tuple[Any, tuple]:
    """Input layouts torch asks for, plus the rewritten non-tensor args where it rewrote them."""
    sugg = out.redistribute_schema
    if not out.needs_redistribute or sugg is None:
        return func, args
    leaves, tree = pytree.tree_flatten(tuple(args))
    sugg_leaves, sugg_tree = pytree.tree_flatten(tuple(sugg.args_schema))
    new = []
    for i, orig in enumerate(leaves):
        if isinstance(orig, Spec):
            wanted = tuple(_from_torch(p) for p in sugg_leaves[i].placements)
            # legacy empty 1-d tensors in cat take any layout in torch's rules; keep them valid for their rank
            wanted = tuple(Replicate() if isinstance(p, Shard) and p.dim >= len(orig.shape) else p for p in wanted)
            new.append(orig.with_placements(wanted))
        else:
            new.append(sugg_leaves[i] if out.use_val_from_redistribute_schema else orig)
    if out.use_val_from_redistribute_schema:
        new.extend(sugg_leaves[len(leaves):])
        return sugg.op, tuple(pytree.tree_unflatten(new, sugg_tree))
    return func, tuple(pytree.tree_unflatten(new, tree))


def propagate(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Propagation:
    """Sharding propagation for `func` on args whose DTensors are replaced by their Specs."""
    from dtorch._rules import RULES  # our own rules where torch has none

    rule = RULES.get(func)
    if rule is not None:
        return rule(func, args, kwargs, mesh)
    try:
        out = _prop.propagate_op_sharding(_schema(func, args, kwargs, 0))
        op, new_args = _apply_suggestion(func, args, kwargs, out, mesh)
        outputs = _convert(out.output_spec, lambda s: _our_spec(s, mesh))
    except NoRule:
        raise
    except Exception as e:  # no strategy, or a rule that cannot handle these placements
        raise NoRule(f"{type(e).__name__}: {e}") from None
    # the input Specs keep the caller's shape/stride metadata; only placements change
    rank_args = None
    if out.use_val_from_redistribute_schema and mesh.size() > 1:
        per_rank = [(new_args, kwargs)]
        for rank in range(1, mesh.size()):
            out_r = _prop.propagate_op_sharding_non_cached(_schema(func, args, kwargs, rank))
            per_rank.append((_apply_suggestion(func, args, kwargs, out_r, mesh)[1], kwargs))
        base = _nontensor_leaves(new_args)
        if any(_nontensor_leaves(a) != base for a, _ in per_rank[1:]):
            rank_args = per_rank
    return Propagation(op, new_args, kwargs, rank_args, outputs)


def _nontensor_leaves(args: tuple) -> list:
    return [v for v in pytree.tree_leaves(args) if not isinstance(v, Spec)]


def meta_specs(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> list[Spec]:
    """Global output specs (Replicate) of a tensor-returning op, from its meta kernel."""
    outs = meta_outputs(func, args, kwargs, mesh)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def meta_outputs(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
    """Output metadata from running `func` on meta tensors of the global shapes (all Replicate)."""

    def to_meta(v: Any) -> Any:
        return torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device="meta") if isinstance(v, Spec) else v

    result = func(*pytree.tree_map(to_meta, args), **pytree.tree_map(to_meta, kwargs))
    replicate = (Replicate(),) * mesh.ndim

    def to_spec(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return Spec(mesh, replicate, tuple(t.shape), tuple(t.stride()), t.dtype)
        if t is None:
            return None
        raise NoRule(f"returns a {type(t).__name__}")

    if isinstance(result, (tuple, list)):
        return type(result)(to_spec(t) for t in result)
    return to_spec(result)
