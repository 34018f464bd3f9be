"""The one adapter to torch's private sharding propagation (`torch.distributed.tensor` internals).

torch 2.13 knows sharding rules for ~1,160 aten overloads and can apply them to metadata
alone, with process-group-free meshes. Everything private we touch is in this file:
`ShardingPropagator`, `OpSchema`, `DTensorSpec`, `TensorMeta`, and fake tensors (`FakeTensorMode`, to tell
an op whose output shapes depend on the values from one that refuses its shapes). When torch has no rule, or
answers with private placements (`_MaskPartial`, or a `_StridedShard` we cannot carry), we raise `NoRule` and
the caller falls back to running the op on replicated inputs, which is always correct. torch's strided shards we
carry: split factor 1 as `NestedShard` (nested chunking, Shard's boxes), a larger one as `_spec.StridedShard` where it
is the only mesh dim sharding its tensor dim (a linear's flattened batch x sequence under context parallelism).
Rules DTorch writes itself are registered in `_registry` and read here before torch's.

One more private door, to torch.compile's tracer: DTorch's own packages are on its skip list (`trace_rules.add`, as
numpy is), so a compiled function that runs ops on DTensors calls DTorch as it is, never tracing or compiling
DTorch's dispatch (it did, frame by frame, with a warning about `_thread.get_ident` and a recompile per frame).
And one to the autograd engine's state (`in_backward`), which tells `dtorch.debug.CommDebugMode` a backward's
collectives from a forward's.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._dynamo import trace_rules as _dynamo_trace_rules
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.distributed.tensor import DTensor as _TorchDTensor
from torch.distributed.tensor import placement_types as tp
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema

from dtorch import _disjoint
from dtorch._registry import NoRule, Propagation, Refused, ValueDependent, rule_for
from dtorch._spec import Spec, StridedShard
from dtorch.device_mesh import DeviceMesh
from dtorch_protocol.layout import box_shape, coords, shard_box
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard

for _package in ("dtorch", "dtorch_protocol"):  # torch.compile's tracer calls them as they are (module doc)
    _dynamo_trace_rules.add(_package)

_prop = _TorchDTensor._op_dispatcher.sharding_propagator
# torch logs every op its fake tensors refuse (a traceback per line, `E... fake_tensor.py:...`); DTorch raises the
# refusal itself, once, in the user's words (see `meta_outputs`)
_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextmanager
def _quiet() -> Iterator[None]:
    was, _FAKE_LOG.disabled = _FAKE_LOG.disabled, True
    try:
        yield
    finally:
        _FAKE_LOG.disabled = was


@dataclass(frozen=True, repr=False)
class NestedShard(Shard):
    """torch's `_StridedShard(dim, split_factor=1)`: the plain nested chunking of a flattened dim, e.g. `[B, S] ->
    [B*S]` with the batch split B ways on one mesh dim and the sequence on the next. The same boxes as Shard(dim)
    (on the wire it is one); kept apart so that torch's view rule can unflatten it back to Shard(1)."""

    def __repr__(self) -> str:
        return f"NestedShard(dim={self.dim})"


def _to_torch(p: Placement) -> Any:
    if isinstance(p, StridedShard):
        return tp._StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, NestedShard):
        return tp._StridedShard(p.dim, split_factor=1)
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
    if kind is tp._StridedShard and p.split_factor == 1:
        return NestedShard(p.dim)
    if kind is tp._StridedShard and p.split_factor > 1:
        return StridedShard(p.dim, p.split_factor)
    raise NoRule(f"torch chose the private placement {p}")


def _torch_spec(spec: Spec, rank: int) -> DTensorSpec:
    return DTensorSpec(spec.mesh.torch_mesh(rank), tuple(_to_torch(p) for p in spec.placements),
                       TensorMeta(torch.Size(spec.shape), spec.stride, spec.dtype))


def _placements(torch_placements: Sequence[Any], mesh: DeviceMesh) -> tuple[Placement, ...]:
    """Ours of torch's, one per mesh dim: a rule that answers otherwise (torch versions differ) is no rule."""
    if len(torch_placements) != mesh.ndim:
        raise NoRule(f"torch's rule gave {len(torch_placements)} placements for a {mesh.ndim}-d mesh")
    return tuple(_from_torch(p) for p in torch_placements)


def _our_spec(ts: DTensorSpec, mesh: DeviceMesh) -> Spec:
    meta = ts.tensor_meta
    if meta is None:
        raise NoRule("torch gave an output spec without tensor metadata")
    spec = Spec(mesh, _placements(ts.placements, mesh), tuple(meta.shape), tuple(meta.stride), meta.dtype)
    check_strided(spec.placements, spec.shape)
    return spec


def check_strided(placements: tuple[Placement, ...], shape: tuple[int, ...]) -> None:
    """A StridedShard we carry: one per tensor, alone on its tensor dim, which its split factor divides."""
    strided = [p for p in placements if isinstance(p, StridedShard)]
    if not strided:
        return
    p = strided[0]
    if len(strided) > 1 or sum(isinstance(q, Shard) and q.dim == p.dim for q in placements) or \
            shape[p.dim] % p.split_factor:
        raise NoRule(f"torch chose strided shards {placements} that DTorch does not carry")


def _convert(tree: Any, fn: Any) -> Any:
    return pytree.tree_map(lambda v: fn(v) if isinstance(v, (Spec, DTensorSpec)) else v, tree)


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
            wanted = _placements(sugg_leaves[i].placements, mesh)
            if any(isinstance(p, StridedShard) and p != q for p, q in zip(wanted, orig.placements)):
                raise NoRule("torch would move an input to a strided shard")  # only ops keep them, moves do not
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
    if _disjoint.has_disjoint(args, kwargs):  # expert-parallel and joint-sequence intermediates (see _disjoint)
        return _disjoint.propagate(func, args, kwargs, mesh, propagate)
    rule = rule_for(func)  # our own rules (registered in `_registry`) where torch has none
    if rule is not None:
        return rule(func, args, kwargs, mesh)
    if func in _MASK_INDEXED and _mask_over_sharded_dim(args):
        raise NoRule("a boolean mask indexes a sharded dim")
    if func is _aten.fill_.Scalar and isinstance(args[0], Spec) and args[0].has_partial():
        return _fill_partial(func, args, kwargs, mesh)
    if func in _DIM_AT:
        args = _non_negative_dim(args, _DIM_AT[func])
    if func is _aten.fill_.Tensor and _fill_0d(args):  # (torch has no rule: self was gathered and written back)
        return Propagation(func, (args[0], args[1].with_placements((Replicate(),) * mesh.ndim)), kwargs, None, args[0])
    try:
        # never torch's own cache: it keys on the tensor args plus only the non-tensor args a rule declares
        # static, so e.g. histc(bins=1) would reuse the plan of histc(bins=100); our plan cache keys on all args
        with _quiet():
            out = _prop.propagate_op_sharding_non_cached(_schema(func, args, kwargs, 0))
        op, new_args = _apply_suggestion(func, args, kwargs, out, mesh)
        outputs = cpu_outputs(func, args, _convert(out.output_spec, lambda s: _our_spec(s, mesh)), mesh)
    except Exception as e:  # no strategy, or a rule that cannot handle these placements
        if func is _aten.copy_.default and _copy_in_place(args):
            # torch refuses e.g. a self sharded on a dim smaller than the mesh, or one with strided shards; copying
            # never needs self to move (which would recurse: a moved self is written back with copy_): move src to
            # self's layout
            self, src = args[0], args[1]
            return Propagation(func, (self, src.with_placements(self.placements), *args[2:]), kwargs, None, self)
        if isinstance(e, NoRule):
            raise
        raise NoRule(f"{type(e).__name__}: {e}") from None
    # the input Specs keep the caller's shape/stride metadata; only placements change
    rank_args = None
    if out.use_val_from_redistribute_schema and mesh.size() > 1:
        # torch's args per rank (a view's local sizes) follow from the rank's local shapes: one propagation per
        # distinct set of them (at most a few), not one per rank (0.36 ms a device: 1.5 s a view on 4,096)
        specs = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, Spec)]
        cs = coords(mesh.shape)
        rewritten = {tuple(local_shape(v, cs[0]) for v in specs): new_args}
        per_rank = [(new_args, kwargs)]
        for rank in range(1, mesh.size()):
            key = tuple(local_shape(v, cs[rank]) for v in specs)
            if key not in rewritten:
                with _quiet():
                    out_r = _prop.propagate_op_sharding_non_cached(_schema(func, args, kwargs, rank))
                rewritten[key] = _apply_suggestion(func, args, kwargs, out_r, mesh)[1]
            per_rank.append((rewritten[key], kwargs))
        base = _nontensor_leaves(new_args)
        if any(_nontensor_leaves(a) != base for a, _ in per_rank[1:]):
            rank_args = per_rank
    return Propagation(op, new_args, kwargs, rank_args, outputs)


# Indexing ops whose indices may hold a boolean mask: torch's rules take each index for one dim, where a mask
# indexes as many dims as it has, so a self sharded on its second dim or later was split against an unsplit mask.
_MASK_INDEXED = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                 torch.ops.aten._index_put_impl_.default}


# Ops whose torch rule reads a negative dim as no dim at all (scans compare `[dim]` with the placements' non-negative
# dims): `x.cumsum(-1)` of a tensor sharded on its last dim ran on each shard alone, wrong from the second shard on
# (torch's DTensor too). The dim is made non-negative first: op -> the position of its dim argument.
_DIM_AT = {torch.ops.aten.cumsum.default: 1, torch.ops.aten.cumprod.default: 1, torch.ops.aten.logcumsumexp.default: 1}


def _non_negative_dim(args: tuple, at: int) -> tuple:
    self = args[0]
    if len(args) > at and isinstance(self, Spec) and type(args[at]) is int and args[at] < 0:
        return (*args[:at], args[at] % max(len(self.shape), 1), *args[at + 1:])
    return args


def _mask_over_sharded_dim(args: tuple) -> bool:
    self, indices = args[0], args[1]
    sharded = {p.dim for p in self.placements if isinstance(p, Shard)} if isinstance(self, Spec) else set()
    dim = 0
    for index in indices:
        n = len(index.shape) if isinstance(index, Spec) and index.dtype in (torch.bool, torch.uint8) else 1
        if n > 1 and sharded & set(range(dim, dim + n)):
            return True
        dim += n
    return False


def _fill_partial(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Propagation:
    """fill_ of a Partial self keeps the layout (views keep aliasing): the value goes to one device of each
    Partial("sum") group and 0 to the others. (torch fills every device, which sums to the value times the
    group size.)"""
    self, value = args[0], args[1]
    sums = [d for d, p in enumerate(self.placements) if isinstance(p, Partial) and p.reduce_op == "sum"]
    if not sums:
        return Propagation(func, args, kwargs, None, self)
    zero = type(value)(0)
    per_rank = [((self, value if all(c[d] == 0 for d in sums) else zero, *args[2:]), kwargs)
                for c in coords(mesh.shape)]
    return Propagation(func, args, kwargs, per_rank, self)


def _fill_0d(args: tuple) -> bool:
    """fill_ with a 0-dim tensor (`x[:, 3] = 3.0` after its view) into a self with nothing Partial: every device fills
    its own shard with the value, replicated."""
    return len(args) == 2 and isinstance(args[0], Spec) and not args[0].has_partial() and \
        isinstance(args[1], Spec) and not args[1].shape


def _copy_in_place(args: tuple) -> bool:
    return len(args) >= 2 and isinstance(args[0], Spec) and isinstance(args[1], Spec) and \
        args[0].shape == args[1].shape and args[0].mesh == args[1].mesh and \
        not any(isinstance(p, Partial) and p.reduce_op != "sum" for p in args[0].placements)


def _nontensor_leaves(args: tuple) -> list:
    return [v for v in pytree.tree_leaves(args) if not isinstance(v, Spec)]


def meta_specs(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> list[Spec]:
    """Global output specs (Replicate) of a tensor-returning op, from its meta kernel."""
    outs = meta_outputs(func, args, kwargs, mesh)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _to_meta(v: Any) -> Any:
    return torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device="meta") if isinstance(v, Spec) else v


def meta_outputs(func: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
    """Output metadata from running `func` on meta tensors of the global shapes (all Replicate).

    Where the meta kernel fails, torch's fake tensors tell why: output shapes that depend on the values, or
    no kernel that can tell them (`ValueDependent`: the local route), or shapes or dtypes the op refuses
    (`Refused`, with torch's own error). Fake tensors never run a real kernel here (no fallback kernels)."""
    try:
        result = func(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))
    except Exception:  # noqa: BLE001 - asked again below, where torch classifies it
        result = _fake_outputs(func, args, kwargs)
    replicate = (Replicate(),) * mesh.ndim

    def to_spec(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            if t.layout != torch.strided:  # e.g. nn.Embedding(sparse=True)'s gradient: refused here, at the op
                raise NotImplementedError(f"dtorch: {func} returns a {t.layout} tensor; DTensors hold strided tensors "
                                          "only (nn.Embedding: sparse=False)")
            return Spec(mesh, replicate, tuple(t.shape), tuple(t.stride()), t.dtype)
        if t is None:
            return None
        raise NoRule(f"returns a {type(t).__name__}")

    if isinstance(result, (tuple, list)):
        return cpu_outputs(func, args, type(result)(to_spec(t) for t in result), mesh)
    return to_spec(result)


# c10's names of dtypes, as torch's errors write them
_C10_NAMES = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
              torch.complex128: "ComplexDouble", torch.complex64: "ComplexFloat", torch.complex32: "ComplexHalf",
              torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
              torch.bool: "Bool"}
_functional_of: dict[Any, Any] = {}  # an in-place overload -> its out-of-place overload (None: there is none)


def check_inplace_cast(func: Any, args: tuple, kwargs: dict) -> None:
    """torch's rule for an in-place pointwise op (TensorIterator's): the result type of its inputs must cast to
    self's dtype (`int_tensor.mul_(0.5)`, `float_tensor.add_(complex_tensor)` raise). Meta kernels do not check it,
    so the op failed on the workers after the call, and poisoned self, where torch raises at the call and leaves
    self as it was. Raises `Refused` with torch's message."""
    if func not in _functional_of:
        name, packet = func.overloadpacket.__name__, None
        if name.endswith("_") and not name.endswith("__"):
            packet = getattr(getattr(torch.ops, func.namespace), name[:-1], None)  # its own namespace's
        _functional_of[func] = getattr(packet, func._overloadname, None) if packet is not None else None
    functional = _functional_of[func]
    if functional is None or not args or not isinstance(args[0], Spec):
        return
    try:
        result = functional(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))
    except Exception:  # noqa: BLE001 - the in-place op's own propagation says what is wrong
        return
    want = args[0].dtype
    if isinstance(result, torch.Tensor) and not torch.can_cast(result.dtype, want):
        names = [_C10_NAMES.get(d, str(d).removeprefix("torch.")) for d in (result.dtype, want)]
        raise Refused(RuntimeError(f"result type {names[0]} can't be cast to the desired output type {names[1]}"))


def _fake_outputs(func: Any, args: tuple, kwargs: dict) -> Any:
    mode = FakeTensorMode(allow_fallback_kernels=False)

    def to_fake(v: Any) -> Any:
        return mode.from_tensor(_to_meta(v)) if isinstance(v, Spec) else v

    try:
        with _quiet(), mode:
            return func(*pytree.tree_map(to_fake, args), **pytree.tree_map(to_fake, kwargs))
    except (DynamicOutputShapeException, DataDependentOutputException, UnsupportedOperatorException,
            NotImplementedError):
        raise ValueDependent(str(func)) from None
    except Exception as e:  # noqa: BLE001 - torch's own error about these shapes or dtypes
        raise Refused(e) from None


_aten = torch.ops.aten
# CPU norm kernels' statistics (outputs 1 and 2) differ from the meta kernels' (which torch's rules follow):
#   1. a batch norm not training returns them empty where the meta kernel says [C];
#   2. in bfloat16 or float16 they have the weight's dtype (the input's without a weight) where the meta kernel
#      says float32 (a training step's backward then failed on the worker: "expected scalar type BFloat16").
# op -> (position of `weight`, position of `training`: None never training, -1 always)
_CPU_STATS = {_aten.native_layer_norm.default: (2, -1), _aten.native_batch_norm.default: (1, 5),
              _aten._native_batch_norm_legit.default: (1, 5), _aten._native_batch_norm_legit.no_stats: (1, -1),
              _aten._native_batch_norm_legit_no_training.default: (1, None),
              _aten._batch_norm_no_update.default: (1, None), _aten._batch_norm_with_update.default: (1, -1)}
_REDUCED = (torch.bfloat16, torch.float16)


def _cpu_stats(func: Any, mesh: DeviceMesh) -> bool:
    return mesh.device_type == "cpu" and func in _CPU_STATS


def cpu_outputs(func: Any, args: tuple, outputs: Any, mesh: DeviceMesh) -> Any:
    """Output specs corrected where a CPU kernel's outputs differ from the meta kernel's (`_CPU_STATS`)."""
    if not _cpu_stats(func, mesh):
        return outputs
    at_weight, at_training = _CPU_STATS[func]
    empty = at_training is None or (at_training >= 0 and len(args) > at_training and not args[at_training])
    x = args[0]
    if not empty and x.dtype not in _REDUCED:
        return outputs
    weight = args[at_weight] if len(args) > at_weight else None
    fixed = list(outputs)
    for i in (1, 2):
        dtype = (weight if isinstance(weight, Spec) else x).dtype if x.dtype in _REDUCED else fixed[i].dtype  # 2
        if empty:  # 1
            fixed[i] = Spec(mesh, (Replicate(),) * mesh.ndim, (0,), (1,), dtype)
        else:
            fixed[i] = Spec(mesh, fixed[i].placements, fixed[i].shape, fixed[i].stride, dtype)
    return type(outputs)(fixed)


PROBE_MAX_NUMEL = 1 << 16  # real-tensor probes of empty shards stay this small


def _flat(outputs: Any) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def local_shape(spec: Spec, coord: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the shard at mesh position `coord` (a StridedShard's: its unflattened box, merged back)."""
    honest = spec.unflattened()
    shape = box_shape(shard_box(honest.shape, spec.mesh.shape, honest.placements, coord))
    if honest is spec:
        return shape
    d = next(p.dim for p in spec.placements if isinstance(p, StridedShard))
    return (*shape[:d], shape[d] * shape[d + 1], *shape[d + 2:])


def check_local(func: Any, prop: Propagation, mesh: DeviceMesh, given: tuple = ()) -> None:
    """Raise NoRule unless the op accepts every device's local shapes and gives the local outputs torch promised.

    torch's rules are written for the global view; a few break on particular local shapes: squeeze_copy drops
    a sharded dim whose shard has size 1, pixel_unshuffle gets shards not divisible by the factor, and
    batch_norm, fft or max refuse the empty shards of small dims. Each distinct set of local shapes runs once
    on meta tensors (and, when it has an empty shard, once on small real zeros); the plan is cached after.
    `given` are the args as the op was called with them: where the rule rewrote their numbers (a view's local
    sizes), a refusal of the local shapes always counts.
    """
    expected = _flat(prop.outputs)
    seen: set = set()
    shared = None  # the args every rank shares (no per-rank args): their specs and the rest, read once
    if prop.rank_args is None:
        shared = ([v for v in pytree.tree_leaves((prop.args, prop.kwargs)) if isinstance(v, Spec)],
                  repr(_nontensor_leaves((prop.args, prop.kwargs))))
    for rank, coord in enumerate(coords(mesh.shape)):
        args, kwargs = prop.rank_args[rank] if prop.rank_args else (prop.args, prop.kwargs)
        specs, rest = shared or ([v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, Spec)],
                                 repr(_nontensor_leaves((args, kwargs))))
        shapes = [local_shape(s, coord) for s in specs]
        key = (tuple(shapes), rest)
        if key in seen:
            continue
        seen.add(key)
        it = iter(shapes)
        meta = pytree.tree_map(lambda v: torch.empty(next(it), dtype=v.dtype, device="meta")  # noqa: B023
                               if isinstance(v, Spec) else v, (args, kwargs))
        try:
            with warnings.catch_warnings():  # what torch says of local shapes is not the user's business (an out=
                warnings.simplefilter("ignore")  # shard "resized" to the global result, deprecated)
                result = func(*meta[0], **meta[1])
        except NotImplementedError:
            return  # no meta kernel: nothing to check against
        except Exception as e:  # noqa: BLE001
            if prop.rank_args is None and _nontensor_leaves(args) == _nontensor_leaves(given) and \
                    _global_meta_fails(func, args, kwargs):
                return  # the meta kernel cannot judge these args at all (data-dependent); args torch rewrote (a view's
                # local sizes, the same on every device or not) are judged: nested uneven shards of a merged dim do
                # not split like the view's dims
            raise NoRule(f"the op refuses the local shapes {shapes} at mesh position {rank}: {e}") from None
        got = _flat(result)
        for i, spec in enumerate(expected):
            if spec is None or (i in (1, 2) and _cpu_stats(func, mesh)):  # not the meta kernel's
                continue
            t = got[i] if i < len(got) else None
            want = local_shape(spec, coord)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != spec.dtype:
                have = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise NoRule(f"torch's rule promises output {i} of {spec.dtype}{list(want)} at mesh position "
                             f"{rank}, the op gives {have}")
        empty = any(math.prod(sh) == 0 and math.prod(s.shape) > 0 for s, sh in zip(specs, shapes))
        if empty and sum(math.prod(sh) for sh in shapes) <= PROBE_MAX_NUMEL:
            it = iter(shapes)
            real = pytree.tree_map(lambda v: torch.zeros(next(it), dtype=v.dtype)  # noqa: B023
                                   if isinstance(v, Spec) else v, (args, kwargs))
            try:
                func(*real[0], **real[1])
            except Exception as e:  # noqa: BLE001
                raise NoRule(f"the op refuses an empty shard at mesh position {rank}: {e}") from None


def _global_meta_fails(func: Any, args: tuple, kwargs: dict) -> bool:
    """Does the meta kernel fail on the global args too (it cannot judge them: data-dependent, or torch's
    rewrite of the args)? A refusal of the user's own args is found on the replicate route (`meta_outputs`)."""
    try:
        func(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))
        return False
    except Exception:  # noqa: BLE001
        return True



def in_backward() -> int | None:
    """The id of the backward pass (autograd graph task) this thread runs now, None outside one."""
    task = torch._C._current_graph_task_id()
    return None if task == -1 else task
