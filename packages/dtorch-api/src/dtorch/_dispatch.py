"""What `DTensor.__torch_dispatch__` does: look the op's plan up (or have `_planner` make it), then carry it
out: emit its instructions to the session and return new DTensors at once.

The plan cache is keyed on cheap identities: the op's id, each DTensor's interned spec id and the other
arguments, so a training loop plans each op once (`torch_dispatch` is the hot path). An op with a registered
decomposition (`_registry`: expert-sharded grouped matmuls, joint sequences) is first offered to it, which may
carry it out as several ops. Carrying a plan out by route (see `_planner` for the routes):
  sharded, replicate  redistribute the inputs that must move, InstrCall, delete the temporaries
  sync, local         fetch the inputs (a sync point, at most DTORCH_LOCAL_MAX_BYTES), run the op here; local
                      uploads its outputs as Replicate
  out                 run the functional op, then copy each result into its out= tensor
An op whose shapes or dtypes torch refuses raises here, at once, with torch's error, the op and the user's line;
a view whose shape holds 1/n of a tensor sharded over n devices also says what that is (`_local_count_hint`).

In-place ops keep the DTensor object; when they change its shape (`squeeze_`, `transpose_`, `resize_`)
the wrapper's metadata follows. An in-place op on a plain torch.Tensor (`buf[i] = x`) takes the DTensors' values
there (a sync point); any other op that would write into a plain torch.Tensor is refused. A view op whose input
had to move gives views of the moved copy; `_views` keeps writes through them and to their input in step.

This module and `dtensor` are the one pair of client modules that import each other (by module).
"""

from __future__ import annotations

import math
import threading
import warnings
from sys import _getframe
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.utils._mode_utils import no_dispatch

from dtorch import _planner, _torch_state, _views
from dtorch._planner import MixedMeshes, Plan, is_inplace, out_plan, outs, writes
from dtorch._registry import NoRule, Refused, decomposition_for
from dtorch._sharding import NestedShard, check_strided, local_shape
from dtorch._source import SKIP, caller, stacklevel, user_src
from dtorch._spec import Spec, StridedShard, contiguous_stride
from dtorch._views import by_root as _origins
from dtorch.device_mesh import WRAPPER_DEVICE, DeviceMesh
from dtorch.errors import DTorchError, describe_src, env_int
from dtorch_protocol import messages as m
from dtorch_protocol.layout import coords
from dtorch_protocol.placement_types import Placement, Replicate, Shard
from dtorch_protocol.values import dtype_name, tensor_to_bytes

if TYPE_CHECKING:
    from dtorch.dtensor import DTensor
    from dtorch.session import Session

LITERAL_MAX_NUMEL = 1 << 16  # plain tensors up to this size travel inside the instruction

planner = _planner.Planner()
_cached = planner.get


SHAPED_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def _local_count_hint(func: Any, args: tuple) -> str:
    """What to add to torch's refusal of a view whose shape holds the tensor divided by a sharded mesh dim's size:
    the mark of torch's SPMD recipes, which patch a module's counts (attention heads) to each rank's local ones.
    DTorch's modules see global shapes, so a ported recipe must drop that patch."""
    if func not in SHAPED_VIEWS or len(args) < 2 or type(args[0]) is not dtensor.DTensor:
        return ""
    x, shape = args[0], args[1]
    if not isinstance(shape, (list, tuple)) or -1 in shape or not all(type(n) is int for n in shape):
        return ""
    wanted = math.prod(shape)
    for size, p in zip(x.device_mesh.shape, x.placements):
        if size > 1 and isinstance(p, Shard) and wanted * size == x.numel():
            return (f" (this shape holds 1/{size} of the tensor, as a head count divided by the {size} devices of "
                    f"a torch tensor-parallel recipe would: DTorch modules see global shapes, keep the model's own "
                    f"counts)")
    return ""


class _Plain(Exception):
    """A plain torch.Tensor among the arguments: lift it to a Replicate DTensor first."""


_SCALARS = (int, float, bool, str, type(None), complex, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(v: Any, leaves: list, plain: Any = None) -> Any:
    """Cache key of one argument; appends DTensors to `leaves` in traversal order. A plain tensor raises _Plain,
    or is keyed by `plain(tensor)` when given."""
    t = type(v)
    if t in _SCALARS:
        return t, v
    if t is dtensor.DTensor:
        leaves.append(v)
        return v._spec.sid
    if t is list or t is tuple or t is torch.Size:
        return t, tuple([_key(x, leaves, plain) for x in v])
    if t is dict:
        return t, tuple([(k, _key(x, leaves, plain)) for k, x in v.items()])
    if isinstance(v, torch.Tensor):
        spec = getattr(v, "_spec", None)
        if spec is None:
            if plain is None:
                raise _Plain
            return plain(v)
        leaves.append(v)
        return spec.sid
    raise TypeError(f"DTorch cannot pass a {t.__name__} to an op")


_SET_SOURCE = torch.ops.aten.set_.source_Tensor


def _fill(t: Any, tids: list[int]) -> Any:
    if type(t) is list:
        return [_fill(x, tids) for x in t]
    if type(t) is dict:
        if "$t" in t:
            return {"$t": tids[t["$t"]]}
        if any(type(x) in (list, dict) for x in t.values()):
            return {k: _fill(x, tids) for k, x in t.items()}
    return t


def _specs(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v._spec if isinstance(v, dtensor.DTensor) else v, tree)


def redistribute_to(x: DTensor, mesh: Any, placements: tuple, src: str) -> DTensor:
    """Queue a redistribution of `x` and return the new DTensor (no autograd)."""
    hook = owned_hook()
    if hook is not None:
        return hook.run(("redistribute", x._spec.sid, mesh.id, tuple(placements)), [x],
                        lambda: redistribute_to(x, mesh, placements, src))
    if x._spec.unflattened() is not x._spec:
        return _from_strided(x, mesh, placements, src)
    if any(isinstance(p, StridedShard) for p in placements):
        return _to_strided(x, mesh, placements, src)
    session = x._session
    if mesh != x.device_mesh:
        session.ensure_mesh(mesh)
    spec = x._spec.with_placements(placements, mesh)
    if spec == x._spec:
        return x
    tid = session.new_tid()
    session.emit(m.InstrRedistribute(src=x._tid, dst=tid, src_spec=x._spec.wire, dst_spec=spec.wire, src_line=src))
    return dtensor.DTensor(spec, tid, session)


def _reshape_shards(x: DTensor, spec: Spec, src: str) -> DTensor:
    """`x` as `spec`, which holds the same shards reshaped (a strided shard and its unflattened layout): each
    device reshapes its own shard, no data moves."""
    session, tid = x._session, x._session.new_tid()
    local = {dev: [[{"$t": x._tid}, list(local_shape(spec, c))], {}]
             for dev, c in zip(spec.mesh.devices, coords(spec.mesh.shape))}
    session.emit(m.InstrCall(op="aten.reshape.default", mesh=spec.mesh.id, args=[{"$t": x._tid}, list(spec.shape)],
                             kwargs={}, outs=[m.OutSpec(tid, spec.wire)], local=local, src=src))
    return dtensor.DTensor(spec, tid, session)


def _to_strided(x: DTensor, mesh: Any, placements: tuple, src: str) -> DTensor:
    """`x` laid out with a `StridedShard` (the gradient of a move from one): viewed in the unflattened shape, moved
    to the unflattened layout there, each device's shard reshaped."""
    try:
        check_strided(tuple(placements), x._spec.shape)
    except NoRule as e:
        raise NotImplementedError(f"dtorch: {e}") from None
    target = x._spec.with_placements(tuple(placements), mesh)
    honest = target.unflattened()
    unflat = torch.ops.aten.view.default(x, list(honest.shape))
    moved = redistribute_to(unflat, mesh, honest.placements, src)
    return _reshape_shards(moved, target, src)


def _from_strided(x: DTensor, mesh: Any, placements: tuple, src: str) -> DTensor:
    """A tensor with a `StridedShard` (which the controller cannot move) laid out as `placements`: each device
    reshapes its shard to the unflattened layout, which moves (the strided dim gathered unless it stays, another
    mesh dim sharding it gathered too), a view flattens it back, and a last move reaches the target."""
    spec = x._spec
    d = next(p.dim for p in spec.placements if isinstance(p, StridedShard))
    unflat = _reshape_shards(x, spec.unflattened(), src)
    keep = mesh == spec.mesh
    target = tuple(
        Shard(d + 1) if keep and p == q and isinstance(p, StridedShard) else
        Replicate() if isinstance(p, (StridedShard, NestedShard)) or (isinstance(p, Shard) and p.dim == d) else
        Shard(p.dim + 1) if isinstance(p, Shard) and p.dim > d else p
        for p, q in zip(placements, spec.placements if keep else placements))
    moved = redistribute_to(unflat, mesh, target, src)
    flat = torch.ops.aten.view.default(moved, list(spec.shape))
    if flat._spec.unflattened() is not flat._spec and flat._spec.placements != tuple(placements):
        raise NotImplementedError(f"dtorch: cannot lay out a tensor with strided shards {spec.placements} as "
                                  f"{tuple(placements)}")
    return redistribute_to(flat, mesh, tuple(placements), src)


def _to_mesh(tree: Any, first: DTensor) -> Any:
    """Move DTensors on other meshes onto `first`'s mesh, replicated: the op then runs there. One on a named slice
    of that mesh (`mesh["tp"]`) keeps its placements on the slice's dims (replicated over the others).

    This is how unmodified code crosses pipeline stages, e.g. `generate` appending a token computed
    on the last stage to input ids held by the first.
    """
    mesh = first.device_mesh
    replicate = (Replicate(),) * mesh.ndim

    def move(v: Any) -> Any:
        if isinstance(v, dtensor.DTensor) and v.device_mesh != mesh:
            return redistribute_to(v, mesh, _on_whole(v, mesh) or replicate, user_src(4))
        return v

    return pytree.tree_map(move, tree)


def _on_whole(v: DTensor, mesh: DeviceMesh) -> tuple[Placement, ...] | None:
    """`v`'s placements on `mesh` when `v` lives on a named slice of it, else None."""
    own, names = v.device_mesh, v.device_mesh.mesh_dim_names or ()
    if own._root is not mesh._root or own is own._root or not names or \
            not set(names) <= set(mesh.mesh_dim_names or ()):
        return None
    return tuple(v.placements[names.index(n)] if n in names else Replicate() for n in mesh.mesh_dim_names)


def _widest(leaves: list[DTensor]) -> DTensor:
    """Where an op across meshes runs: on the mesh the others are named slices of (a model laid out on the whole
    mesh and an input on `mesh["tp"]`: the input moves, not every weight), else the first DTensor's."""
    return next((d for d in leaves if all(v.device_mesh == d.device_mesh or _on_whole(v, d.device_mesh) is not None
                                          for v in leaves)), leaves[0])


def _written_dtensor(func: Any, args: tuple, kwargs: dict) -> DTensor | None:
    """The first DTensor an op writes (self of an in-place op, out=): an op across meshes runs on its mesh, since
    a moved copy would take the write."""
    for position, name in writes(func, args, kwargs):
        value = kwargs.get(name) if position >= len(args) else args[position]
        if isinstance(value, dtensor.DTensor):
            return value
    return None


def _foreach_by_mesh(func: Any, args: tuple) -> dict[Any, list[int]] | None:
    """The positions of a foreach op's lists, by the mesh of their tensors, when they live on several meshes (an
    optimizer or `clip_grad_norm_` over pipeline stages); None for any other op."""
    if not func.__name__.startswith("_foreach_") or not args or not isinstance(args[0], (list, tuple)):
        return None
    lists = [a for a in args if isinstance(a, (list, tuple)) and len(a) == len(args[0])]
    by_mesh: dict[Any, list[int]] = {}
    for i in range(len(args[0])):
        mesh = next((a[i].device_mesh for a in lists if isinstance(a[i], dtensor.DTensor)), None)
        by_mesh.setdefault(mesh, []).append(i)
    return by_mesh if len(by_mesh) > 1 else None


def _run_by_mesh(func: Any, args: tuple, kwargs: dict, by_mesh: dict[Any, list[int]]) -> Any:
    """One call of a foreach op per mesh, on its positions of every list: each write stays on the tensor it writes
    (moving every list to one mesh, as other ops cross meshes, wrote into copies), results come back in order."""
    n = len(args[0])
    results: list[Any] = [None] * n
    for positions in by_mesh.values():
        def pick(v: Any, positions: list[int] = positions) -> Any:
            return [v[i] for i in positions] if isinstance(v, (list, tuple)) and len(v) == n else v
        out = func(*[pick(a) for a in args], **{k: pick(v) for k, v in kwargs.items()})
        for i, value in zip(positions, out or ()):
            results[i] = value
    return results if func._schema.returns else None


def replicate_plain(tensor: torch.Tensor, like: DTensor) -> DTensor:
    """A plain tensor mixed into an op: small ones ride inside the instruction, large ones are uploaded."""
    mesh, session = like.device_mesh, like._session
    shape = tuple(tensor.shape)
    spec = Spec(mesh, (Replicate(),) * mesh.ndim, shape, contiguous_stride(shape), tensor.dtype)
    if tensor.numel() > LITERAL_MAX_NUMEL:
        return dtensor.DTensor(spec, session.upload(tensor, spec), session)
    tid = session.new_tid()
    literal = {"$lit": [dtype_name(tensor.dtype), list(shape), tensor_to_bytes(tensor)]}
    session.emit(m.InstrCall(op="aten.clone.default", mesh=mesh.id, args=[literal], kwargs={},
                             outs=[m.OutSpec(tid, spec.wire)], src=user_src(3)))
    return dtensor.DTensor(spec, tid, session)


def _lift_plain(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Plain tensors mixed into an op become Replicate DTensors on the op's mesh (never ones it writes)."""
    ref = next((v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, dtensor.DTensor)), None)
    if ref is None:
        raise TypeError("no DTensor among the arguments")
    for pos, name in writes(func, args, kwargs):
        value = args[pos] if pos < len(args) else kwargs.get(name)
        if any(isinstance(v, torch.Tensor) and not isinstance(v, dtensor.DTensor) for v in pytree.tree_leaves(value)):
            raise NotImplementedError(f"dtorch: {func} would write into the plain torch.Tensor {name!r}; "
                                      "make it a DTensor first (dtorch.distribute_tensor)")

    def lift(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or isinstance(v, dtensor.DTensor):
            return v
        if isinstance(v, torch.nn.Parameter) and not getattr(v, "_dtorch_warned", False):
            v._dtorch_warned = True  # (once per parameter)
            warnings.warn(PLAIN_PARAMETER.format(shape=list(v.shape)), stacklevel=stacklevel())
        return replicate_plain(v, ref)

    return pytree.tree_map(lift, args), pytree.tree_map(lift, kwargs)


AUTOCAST_CUDA = ("dtorch: torch.autocast('cuda') does not reach DTensors, which are CPU tensors in this process (their "
                 "mesh says where the shards live); use torch.autocast('cpu', dtype=...): the workers then compute in "
                 "that dtype, on whatever devices they have")
PLAIN_PARAMETER = ("dtorch: a plain nn.Parameter of shape {shape} takes part in an op on DTensors: it is uploaded at "
                   "each use, and an optimizer cannot step it (its gradient is a DTensor); lay its module out first "
                   "(dtorch.nn.replicate_module, parallelize_module or fully_shard)")
WRITES_PLAIN = "writes into a plain torch.Tensor"  # why an in-place op on one runs on the client (a sync point)
_FLAT = (int, float, bool, type(None))
# what torch raises about shapes and dtypes, and what DTorch refuses (a quantized dtype)
_TORCH_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError)
LOCAL_MAX_BYTES = 64 << 20  # default bound on what one op may fetch to run on the client (DTORCH_LOCAL_MAX_BYTES)


def _check_local_size(func: Any, why: str, leaves: list[DTensor]) -> None:
    """Refuse to fetch more than DTORCH_LOCAL_MAX_BYTES to run one op on the client."""
    specs = {d._tid: d._spec for d in leaves}.values()
    size = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
    limit = env_int("DTORCH_LOCAL_MAX_BYTES", LOCAL_MAX_BYTES)
    if size > limit:
        raise DTorchError(f"dtorch: {func} {why}, so it runs on the client on its fetched inputs, {_mib(size)}: "
                          f"above the local-route limit of {_mib(limit)} (set DTORCH_LOCAL_MAX_BYTES to allow it)")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


_default_dtype = torch.get_default_dtype
_planned_under = _torch_state.update()


def _new_default_dtype() -> None:
    global _planned_under
    _planned_under = _torch_state.update()
    planner.clear()


def torch_dispatch(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """`DTensor.__torch_dispatch__`. The hot path, for an op whose arguments are DTensors and numbers and whose
    plan is cached and fast: key (the op, each DTensor's spec id, each number with its type), a tensor id, the
    user's line, one record queued (the sender thread encodes it), the output wrapper. Nothing else.
    (Keys hold the op's id, not the op: OpOverload's `__hash__` is Python; the plan holds the op, so the id
    stays its own while the key is cached.)"""
    if _default_dtype() is not _planned_under:  # plans, and ops, follow torch.set_default_dtype (`_torch_state`)
        _new_default_dtype()
    hook = step_hook
    if hook is not None:  # a compiled step is being recorded or replayed (dtorch.steps), by this thread or another
        if hook.owner == _thread():
            return hook.dispatch(cls, func, types, args, kwargs)
        hook.foreign()  # (another thread's ops run eagerly: `_capture` rule 10)
    if kwargs:
        return dispatch(func, args, kwargs)
    if len(args) == 2 and type(args[0]) is cls and type(args[1]) is cls:  # binary ops: most of a model's
        a, b = args
        key: Any = (id(func), a._spec.sid, b._spec.sid)
        tids: Any = (a._tid, b._tid)
    else:
        key, tids = [id(func)], []
        for a in args:
            t = type(a)
            if t is cls:
                key.append(a._spec.sid)
                tids.append(a._tid)
            elif t in _FLAT:
                key.append((t, a))
            else:
                return dispatch(func, args, {})
        key = tuple(key)
    plan = _cached(key)
    if plan is None or plan.encode is None:
        return dispatch(func, args, {}, key)
    session = (args[0] if type(args[0]) is cls else next(a for a in args if type(a) is cls))._session
    tid = session.new_tid()
    f = _getframe(1)  # the user's line: `_source.caller`, inlined (a call costs a tenth of this path)
    while f is not None and f.f_code.co_filename.startswith(SKIP):
        f = f.f_back
    session.emit((plan.encode, *tids, tid, *((f.f_code, f.f_lasti) if f is not None else (None, 0))))
    out = plan.outputs
    # positional (size, strides, storage_offset, memory_format, dtype, layout, device): a third cheaper than
    # keywords; strides None for contiguous outputs (the default layout, cheaper still)
    r = _make_wrapper(cls, out.shape, None if out.contiguous else out.stride, None, None, out.dtype, _STRIDED,
                      WRAPPER_DEVICE)
    r._spec, r._tid, r._session = out, tid, session
    if _origins and plan.view:
        _views.after_view(args[0], None, [r])
    return r


def op_key(func: Any, args: tuple, kwargs: dict | None) -> tuple[Any, list]:
    """(key, DTensor leaves) of an op: the plan cache's key (the op's id, each DTensor's spec id, every other
    argument; a small plain tensor by its values); raises _Plain (a large plain tensor) or TypeError."""
    leaves: list = []
    if not kwargs:
        key = [id(func)]
        for a in args:
            t = type(a)
            if t is dtensor.DTensor:
                key.append(a._spec.sid)
                leaves.append(a)
            elif t in _FLAT:
                key.append((t, a))
            else:
                break
        else:
            return tuple(key), leaves
        leaves = []
    try:
        return (id(func), None, _key(args, leaves), _key(kwargs, leaves) if kwargs else None), leaves
    except _Plain:  # small plain tensors ride in the instruction as literals: their values are part of the key
        leaves = []
        return (id(func), _literal_key, _key(args, leaves, _literal_key),
                _key(kwargs, leaves, _literal_key) if kwargs else None), leaves


def _literal_key(t: torch.Tensor) -> Any:
    if t.numel() > LITERAL_MAX_NUMEL or t.requires_grad:
        raise _Plain
    return t.dtype, tuple(t.shape), tensor_to_bytes(t)


step_hook: Any = None  # the compiled step recording or replaying now (`dtorch.steps`), else None
_thread = threading.get_ident


def owned_hook() -> Any:
    """The step hook for the thread that runs the step; None for any other thread, whose calls run eagerly and
    end automatic capture (`_capture` rule 10)."""
    hook = step_hook
    if hook is not None and hook.owner != _thread():
        hook.foreign()
        return None
    return hook


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


def dispatch(func: Any, args: tuple, kwargs: dict, key: Any = None) -> Any:
    """Every op: plan (cached under `key`, the flat key when the arguments are DTensors and numbers only, else
    a nested one), then carry the plan out by its route."""
    if func is _SET_SOURCE and args[0] is args[1]:
        return args[0]  # x.set_(x), as torch.nn.utils.parametrize does: nothing to move
    decompose = decomposition_for(func)
    if decompose is not None and (done := decompose(args, kwargs)) is not NotImplemented:
        return done  # several ops, some with per-device layouts (expert parallelism, joint sequences)
    leaves: list = []
    if key is not None:
        leaves = [a for a in args if type(a) is dtensor.DTensor]
    else:
        try:
            key = (id(func), None, _key(args, leaves), _key(kwargs, leaves) if kwargs else None)
        except _Plain:
            if outs(func) and _plain_out(func, kwargs):
                return _run_out(out_plan(func, [], "writes plain torch.Tensors"), func, args, kwargs)
            if is_inplace(func) and args and type(args[0]) is torch.Tensor:
                # `buf[i] = x` of a plain `buf` (made by a factory, as generate's beam search does): x's values
                # come into buf as a copy to the CPU would bring them (a sync point, bounded)
                dtensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, dtensor.DTensor)]
                return _run_locally(func, args, kwargs, dtensors, WRITES_PLAIN)
            args, kwargs = _lift_plain(func, args, kwargs)
            leaves = []
            key = (id(func), None, _key(args, leaves), _key(kwargs, leaves) if kwargs else None)
        except TypeError:  # unhashable or exotic argument: plan without caching
            key, leaves = None, [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, dtensor.DTensor)]
    plan = planner.get(key) if key is not None else None
    if plan is None:
        if torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu"):
            warnings.warn(AUTOCAST_CUDA, stacklevel=3)
        try:
            plan = planner.plan(key, func, _specs(args), _specs(kwargs))
        except MixedMeshes:
            if (by_mesh := _foreach_by_mesh(func, args)) is not None:
                return _run_by_mesh(func, args, kwargs, by_mesh)
            home = _written_dtensor(func, args, kwargs)
            home = _widest(leaves) if home is None else home
            return func(*_to_mesh(args, home), **_to_mesh(kwargs, home))
        except Refused as e:  # torch refuses these shapes or dtypes: say so now, where the user wrote the op
            kind = e.error_type if e.error_type in _TORCH_ERRORS else RuntimeError
            raise kind(f"{func} at {describe_src(user_src(2))}: {e.message}{_local_count_hint(func, args)}") from None
    if plan.encode is not None:
        session: Session = leaves[0]._session
        tid = session.new_tid()
        session.emit((plan.encode, *[d._tid for d in leaves], tid, *caller(2)))
        result = dtensor.DTensor(plan.outputs, tid, session)
        if _origins and plan.view:
            _views.after_view(leaves[0], None, [result])
        return result
    if plan.random and plan.inplace:
        return _random_in_place(plan, leaves)
    if plan.route == "sync":
        return _run_locally(func, args, kwargs, leaves, plan.why)
    if plan.route == "local":
        return _run_and_upload(plan, args, kwargs, leaves)
    if plan.route == "out":
        return _run_out(plan, func, args, kwargs)
    if plan.inplace and _reshapes(plan, leaves[0]):
        return _emit_reshaping(plan, args, kwargs, leaves)
    result = _emit(plan, leaves)
    return None if not func._schema.returns else result


def _random_in_place(plan: Plan, leaves: list[DTensor]) -> Any:
    """`x.uniform_()` and friends: draw into a fresh copy (seeded, replicated), then copy_ into x.

    Writing through `copy_` keeps torch's aliasing: when x is a view, its base sees the values.
    """
    self = leaves[0]
    fresh = torch.ops.aten.clone.default(self)
    _emit(plan, [fresh, *leaves[1:]])
    return torch.ops.aten.copy_.default(self, fresh)


def _emit(plan: Plan, leaves: list[DTensor]) -> Any:
    session: Session = leaves[0]._session
    src = user_src(3)
    tids, temps = [], []
    held = {}  # inputs moved from or to strided shards (several instructions: `_from_strided`), kept alive until sent
    for i, (d, target) in enumerate(zip(leaves, plan.inputs)):
        if target is None:
            tids.append(d._tid)
        elif d._spec.unflattened() is not d._spec or target.unflattened() is not target:
            held[i] = redistribute_to(d, target.mesh, target.placements, src)
            tids.append(held[i]._tid)
        else:
            tmp = session.new_tid()
            session.emit(m.InstrRedistribute(src=d._tid, dst=tmp, src_spec=d._spec.wire, dst_spec=target.wire,
                                             src_line=src))
            tids.append(tmp)
            temps.append(tmp)
    outs = plan.flat_outputs
    if plan.inplace:
        out_tids = [tids[0]] + [session.new_tid() if s is not None else None for s in outs[1:]]
    else:
        out_tids = [session.new_tid() if s is not None else None for s in outs]
    local = None
    if plan.local is not None:  # each distinct template filled once (devices whose args are alike share one)
        filled: dict[int, list] = {}
        local = {dev: filled.get(id(t)) or filled.setdefault(id(t), [_fill(t[0], tids), _fill(t[1], tids)])
                 for dev, t in plan.local.items()}
    session.emit(m.InstrCall(op=plan.op_name, mesh=leaves[0]._spec.mesh.id, args=_fill(plan.args, tids),
                             kwargs=_fill(plan.kwargs, tids),
                             outs=[None if t is None else m.OutSpec(t, s.wire) for t, s in zip(out_tids, outs)],
                             local=local, src=src, seed=session.next_seed() if plan.random else None,
                             writes=[tids[i] for i in sorted(plan.mutated) if tids[i] not in out_tids],
                             default_dtype=_torch_state.default_dtype))
    # a written input that had to move was written in its moved copy: copy it back in place (keeps aliasing)
    written_back = {}
    for i in plan.mutated:
        target = plan.inputs[i]
        if i in held:
            written_back[i] = held[i]
        elif target is not None:
            temps.remove(tids[i])
            written_back[i] = dtensor.DTensor(target, tids[i], session)
    moved_view = None  # a view op's outputs alias the moved copy of its input (`_views`, rule 1)
    if plan.view and plan.inputs and plan.inputs[0] is not None:
        moved_view = held.get(0)
        if moved_view is None:
            temps.remove(tids[0])
            moved_view = dtensor.DTensor(plan.inputs[0], tids[0], session)
    if temps:
        session.emit(m.InstrDelete(tids=temps))
    for i, moved in written_back.items():
        torch.ops.aten.copy_.default(leaves[i], moved)
    results = [None if s is None else leaves[0] if plan.inplace and i == 0 else dtensor.DTensor(s, t, session)
               for i, (t, s) in enumerate(zip(out_tids, outs))]
    if plan.view and (moved_view is not None or _origins):
        _views.after_view(leaves[0], moved_view, results)
    if _origins:  # writes through views of moved copies, and into the tensors they were taken of (`_views`)
        for i in plan.mutated:
            if i not in written_back:
                _views.after_write(leaves[i])
    if isinstance(plan.outputs, (list, tuple)):
        return type(plan.outputs)(results)
    return results[0]


def _reshapes(plan: Plan, self: DTensor) -> bool:
    out = plan.flat_outputs[0]
    return out is not None and (out.shape, out.stride) != (self._spec.shape, self._spec.stride)


def _emit_reshaping(plan: Plan, args: tuple, kwargs: dict, leaves: list[DTensor]) -> Any:
    """An in-place view op (squeeze_, t_, resize_) changing self's shape: the wrapper's metadata follows.

    When self must move first (resize_ of a sharded tensor), the op reshapes a moved copy, which then
    becomes self (its tensor id and layout); the shape change does not reach self's views, whose data
    this op does not change.
    """
    self, s = leaves[0], plan.flat_outputs[0]
    _check_room(plan, self, s)
    if plan.inputs[0] is not None:
        moved = redistribute_to(self, self._spec.mesh, plan.inputs[0].placements, user_src(4))
        plan.func(moved, *args[1:], **kwargs)
        self._tid, moved._tid = moved._tid, self._tid  # moved's __del__ now frees self's old shards
        result, s = self, moved._spec
    else:
        result = _emit(plan, leaves)
    with no_dispatch():
        self.as_strided_(s.shape, s.stride)
    self._spec = Spec(self._spec.mesh, s.placements, s.shape, s.stride, self._spec.dtype)
    return result


def _check_room(plan: Plan, self: DTensor, out: Spec) -> None:
    """An in-place op changing self's shape must fit the wrapper's (unallocated) storage."""
    need = 0 if 0 in out.shape else 1 + sum((n - 1) * st for n, st in zip(out.shape, out.stride))
    have = self.untyped_storage().nbytes() // max(self.element_size(), 1)
    if need > have:
        raise NotImplementedError(f"dtorch: {plan.op_name} would grow a DTensor of shape {list(self.shape)} to "
                                  f"{list(out.shape)}; make a new DTensor instead")


def _run_locally(func: Any, args: tuple, kwargs: dict, leaves: list[DTensor], why: str) -> Any:
    """A sync point: ops that return Python values run on the fetched full tensors, bounded in bytes."""
    _check_local_size(func, why, leaves)

    def full(v: Any) -> Any:
        return v._read() if isinstance(v, dtensor.DTensor) else v

    return func(*pytree.tree_map(full, args), **pytree.tree_map(full, kwargs))


def _plain_out(func: Any, kwargs: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and getattr(v, "_spec", None) is None
               for n in outs(func) for v in pytree.tree_leaves(kwargs.get(n)))


def _run_out(plan: Plan, func: Any, args: tuple, kwargs: dict) -> Any:
    """The out route: run the functional op, then write each result into its out= tensor (resizing it as torch
    does); returns the out tensors. A plain out tensor receives the fetched values (a sync point)."""
    names = outs(func)
    targets = [kwargs.get(n) for n in names]
    if plan.func is func:  # no functional overload: the op writes Replicate copies of its out= tensors
        results = [torch.ops.aten.new_empty.default(replicate_plain(torch.zeros(()), t), list(t.shape), dtype=t.dtype)
                   for t in targets]
        func(*args, **{**kwargs, **dict(zip(names, results))})
    else:
        result = plan.func(*args, **{k: v for k, v in kwargs.items() if k not in names})
        results = list(result) if len(names) > 1 else [result]
    for out, res in zip(targets, results):
        for o, r in zip(*((out, res) if isinstance(out, (list, tuple)) else ([out], [res]))):
            _write_out(plan, o, r)
    if not func._schema.returns:
        return None
    return tuple(targets) if len(names) > 1 else targets[0]


def _write_out(plan: Plan, out: torch.Tensor, res: Any) -> None:
    if not isinstance(out, dtensor.DTensor):
        full = res._read() if isinstance(res, dtensor.DTensor) else res
        with torch.no_grad():
            if out.shape != full.shape:
                try:
                    out.resize_(full.shape)
                except RuntimeError:  # torch's own temporaries of a DTensor op (`linalg.det(out=)`'s LU): their
                    out.set_(torch.empty(full.shape, dtype=out.dtype))  # storage cannot grow: a fresh one
            out.copy_(full)
        return
    if not isinstance(res, dtensor.DTensor):
        raise NotImplementedError(f"dtorch: {plan.op_name} gave a {type(res).__name__} for a DTensor out=")
    if out.shape == res.shape:
        out.copy_(res)  # keeps out's layout and storage: its views see the values
    elif out.dtype == res.dtype:
        _adopt(out, res)  # torch resizes out here; out takes the result's shards and layout
    else:
        raise NotImplementedError(f"dtorch: {plan.op_name} would resize a {out.dtype} DTensor out= of shape "
                                  f"{list(out.shape)} to a {res.dtype} result of shape {list(res.shape)}")


def _adopt(dst: DTensor, src: DTensor) -> None:
    """`dst` becomes `src`: its tensor id, layout and wrapper metadata (src's __del__ frees dst's old shards)."""
    dst._tid, src._tid = src._tid, dst._tid
    with no_dispatch():
        dst.set_(src.untyped_storage(), 0, src.shape, src.stride())
    dst._spec = src._spec


def _run_and_upload(plan: Plan, args: tuple, kwargs: dict, leaves: list[DTensor]) -> Any:
    """The local route: run on the fetched full tensors (a sync point), upload the outputs as Replicate."""
    ref = leaves[0]
    if plan.random:
        seed = ref._session.next_seed()  # (drawn before the fork, which would give the draw back)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            result = _run_locally(plan.func, args, kwargs, leaves, plan.why)
    else:
        result = _run_locally(plan.func, args, kwargs, leaves, plan.why)

    def upload(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.layout != torch.strided:
            raise NotImplementedError(f"dtorch: {plan.op_name} returns a {v.layout} tensor; DTensors hold "
                                      "strided tensors only")
        return replicate_plain(v, ref)

    return pytree.tree_map(upload, result)


# Last: `dtensor` takes `torch_dispatch` from this module while its class is made, whichever module is imported
# first (the one pair of client modules that import each other).
from dtorch import dtensor  # noqa: E402
