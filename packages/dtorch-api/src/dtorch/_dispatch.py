"""What `DTensor.__torch_dispatch__` does: plan an op once per signature, then emit and return at once.

A plan says which inputs must be redistributed to which layouts, the wire form of the
arguments (with slots for tensor ids, and per-device variants where args differ by
device), and the output specs. It is cached on a cheap key built from the op, each
DTensor's spec key and the other arguments, so a training loop plans each op once.

Four routes, in order of preference:
  sharded   torch's sharding rules (`_sharding.propagate`), checked against every device's local shapes
            (`_sharding.check_local`): a rule that breaks on some local shape falls through to replicate
  replicate no rule: gather inputs to Replicate, run everywhere, output Replicate (always correct);
            random ops take this route with a shared seed so values never depend on the plan
  sync      the op returns a Python value (`item`, `is_nonzero`, `equal`): fetch and run locally
  local     the op's output shape depends on the values (no meta kernel: `nonzero`, `unique`,
            `masked_select`, ...) or workers cannot run it (an op outside aten/prims): a sync point that
            fetches the inputs, runs the op on the client and uploads the outputs as Replicate
  out       an out= op whose out tensors are laid out (or shaped) unlike its outputs, or are plain
            tensors: the functional op runs, then each result is copied into its out tensor

In-place ops keep the DTensor object; when they change its shape (`squeeze_`, `transpose_`, `resize_`)
the wrapper's metadata follows. An op that would write into a plain torch.Tensor is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.utils._mode_utils import no_dispatch

from dtorch import _rules, _sharding
from dtorch._source import user_src
from dtorch._spec import Spec
from dtorch_protocol import messages as m
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Partial, Replicate
from dtorch_protocol.values import encode_value

if TYPE_CHECKING:
    from dtorch.dtensor import DTensor
    from dtorch.session import Session

LITERAL_MAX_NUMEL = 1 << 16  # plain tensors up to this size travel inside the instruction
WORKER_NAMESPACES = ("aten", "prims")  # what workers run (dtorch_worker.ops); other ops take the local route


DTensorType: type | None = None  # set by dtorch.dtensor (avoids an import cycle)


class _Plain(Exception):
    """A plain torch.Tensor among the arguments: lift it to a Replicate DTensor first."""


_SCALARS = (int, float, bool, str, type(None), complex, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(v: Any, leaves: list) -> Any:
    """Cache key of one argument; appends DTensors to `leaves` in traversal order."""
    t = type(v)
    if t in _SCALARS:
        return t, v
    if t is DTensorType:
        leaves.append(v)
        return v._spec.key
    if t is list or t is tuple or t is torch.Size:
        return t, tuple([_key(x, leaves) for x in v])
    if t is dict:
        return t, tuple([(k, _key(x, leaves)) for k, x in v.items()])
    if isinstance(v, torch.Tensor):
        spec = getattr(v, "_spec", None)
        if spec is None:
            raise _Plain
        leaves.append(v)
        return spec.key
    raise TypeError(f"DTorch cannot pass a {t.__name__} to an op")


@dataclass
class Plan:
    op_name: str
    route: str  # "sharded" | "replicate" | "sync" | "local" | "out"
    func: Any
    inputs: list[Spec | None]  # per DTensor leaf: layout to redistribute to, None if it stays
    args: list  # wire template: {"$t": leaf index} marks tensor slots
    kwargs: dict
    local: dict[int, list] | None  # device -> [args, kwargs] templates where they differ per device
    outputs: Any  # Spec | None | list/tuple of (Spec | None)
    flat_outputs: list[Spec | None]
    inplace: bool
    random: bool
    mutated: frozenset[int] = frozenset()  # DTensor leaves the op writes in place (schema alias_info.is_write)
    fast: tuple | None = None  # (top-level arg slots, output spec): the common case, emitted without walking

    def __post_init__(self) -> None:
        simple = (self.route != "sync" and not self.inplace and not self.mutated and not self.random
                  and self.local is None
                  and not any(self.inputs) and not isinstance(self.outputs, (list, tuple))
                  and self.outputs is not None and not _has_slot(self.kwargs))
        slots = [(pos, a["$t"]) for pos, a in enumerate(self.args) if type(a) is dict and "$t" in a]
        if simple and all(not _has_slot(a) for a in self.args if not (type(a) is dict and "$t" in a)):
            self.fast = (slots, self.outputs)


def _has_slot(t: Any) -> bool:
    if type(t) is list:
        return any(_has_slot(x) for x in t)
    if type(t) is dict:
        return "$t" in t or any(_has_slot(x) for x in t.values())
    return False


_plans: dict[Any, Plan] = {}
_SET_SOURCE = torch.ops.aten.set_.source_Tensor

# A shard's strides can differ from the global tensor's (kernels pick their own output layouts), so a view
# that is valid globally may not be locally: workers reshape, which is the same view whenever one exists.
_WIRE_NAME = {torch.ops.aten.view.default: "aten.reshape.default",
              torch.ops.aten._unsafe_view.default: "aten.reshape.default"}


class _Slot(int):
    """Marks where the n-th DTensor of an op's arguments goes."""


def _slot_templates(args: Any, kwargs: dict) -> tuple[list, dict]:
    """Wire form of (args, kwargs) in which the n-th DTensor spec becomes the slot {"$t": n}."""
    counter = iter(range(1 << 30))
    marked = pytree.tree_map(lambda v: _Slot(next(counter)) if isinstance(v, Spec) else v, (list(args), kwargs))

    def enc(v: Any) -> Any:
        if type(v) is _Slot:
            return {"$t": int(v)}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {k: enc(x) for k, x in v.items()}
        return encode_value(v, lambda t: None)

    return enc(marked[0]), enc(marked[1])


def _fill(t: Any, tids: list[int]) -> Any:
    if type(t) is list:
        return [_fill(x, tids) for x in t]
    if type(t) is dict:
        if "$t" in t:
            return {"$t": tids[t["$t"]]}
        if any(type(x) in (list, dict) for x in t.values()):
            return {k: _fill(x, tids) for k, x in t.items()}
    return t


def _is_inplace(func: Any) -> bool:
    schema = func._schema
    return bool(schema.returns) and schema.returns[0].alias_info is not None and \
        schema.returns[0].alias_info.is_write and bool(schema.arguments) and \
        schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write


def _written_leaves(func: Any, args: tuple, kwargs: dict) -> frozenset[int]:
    """Indices (in DTensor-leaf order) of the tensors `func` writes: `add_`'s self, `out=`, `_foreach_*_` lists."""
    schema = {a.name: a for a in func._schema.arguments}
    positional = func._schema.arguments
    written, index = set(), 0
    named = [(positional[i] if i < len(positional) else None, v) for i, v in enumerate(args)]
    named += [(schema.get(k), v) for k, v in kwargs.items()]
    for arg, value in named:
        n = sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))
        if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
            written.update(range(index, index + n))
        index += n
    return frozenset(written)


def _writes(func: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments `func` writes (self of in-place ops, out=)."""
    return [(i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


_out_names: dict[Any, tuple[str, ...]] = {}


def _outs(func: Any) -> tuple[str, ...]:
    """Names of `func`'s out= arguments (kwarg-only in aten schemas)."""
    names = _out_names.get(func)
    if names is None:
        names = _out_names[func] = tuple(a.name for a in func._schema.arguments if a.is_out)
    return names


def _functional(func: Any) -> Any:
    """The overload of `func`'s op that takes the same arguments without out= and writes nothing, or None."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments if not a.is_out]
    packet = func.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        if not any(a.alias_info is not None and a.alias_info.is_write for a in args) and \
                [(a.name, str(a.type)) for a in args] == want:
            return cand
    return None


def _out_plan(func: Any, specs: list[Spec], why: str) -> Plan:
    functional = _functional(func)
    if functional is None:
        raise NotImplementedError(f"dtorch: {func} {why}, and it has no functional overload to run instead, so "
                                  f"it cannot run on DTensors with placements {_placements(specs)}")
    return Plan(str(func), "out", functional, [], [], {}, None, None, [], False, False)


def _out_mismatch(func: Any, spec_kwargs: dict, flat_outputs: list) -> bool:
    """Do the out= tensors differ in layout or shape from what the op computes?"""
    targets = [spec_kwargs.get(n) for n in _outs(func)]
    if len(targets) != len(flat_outputs):
        return True
    for t, o in zip(targets, flat_outputs):
        if isinstance(t, Spec) and o is not None and (t.placements != o.placements or t.shape != o.shape):
            return True
        if isinstance(t, (list, tuple)):
            return True  # Tensor[] outs: always through the functional op
    return False


def _placements(specs: list[Spec]) -> list:
    return [s.placements for s in specs]


def _local_plan(func: Any, specs: list[Spec], why: str, random: bool) -> Plan:
    if _outs(func) and not _is_inplace(func):
        return _out_plan(func, specs, why)
    if _writes(func):
        raise NotImplementedError(f"dtorch: {func} {why} and writes its arguments in place, so it cannot run on "
                                  f"DTensors with placements {_placements(specs)}")
    return Plan(str(func), "local", func, [], [], {}, None, None, [], False, random)


def _returns_tensors(func: Any) -> bool:
    for r in func._schema.returns:
        text = str(r.type)
        if "Tensor" not in text:
            return False
    return True


def _make_plan(func: Any, args: tuple, kwargs: dict, leaves: list[DTensor]) -> Plan:
    specs = [d._spec for d in leaves]
    if len({s.mesh for s in specs}) > 1:
        raise _MixedMeshes
    mesh = specs[0].mesh
    it = iter(specs)
    spec_args = pytree.tree_map(lambda v: next(it) if isinstance(v, torch.Tensor) else v, args)
    spec_kwargs = pytree.tree_map(lambda v: next(it) if isinstance(v, torch.Tensor) else v, kwargs)
    op_name = str(func)
    inplace = _is_inplace(func)
    if not _returns_tensors(func):
        return Plan(op_name, "sync", func, [], [], {}, None, None, [], inplace, False)
    # seeded ops run replicated under a shared seed, unless one of our rules covers them (it refuses dropout)
    random = torch.Tag.nondeterministic_seeded in func.tags and func not in _rules.RULES
    if func.namespace not in WORKER_NAMESPACES:
        return _local_plan(func, specs, "is not an aten/prims op (workers run only those)", random)
    route, local = "sharded", None
    try:
        if random:
            raise _sharding.NoRule("random op")
        prop = _sharding.propagate(func, spec_args, spec_kwargs, mesh)
        run_func, new_args, outputs = prop.op, prop.args, prop.outputs
        if _non_sum_partial(outputs) and any(_has_empty_shard(s) for s in specs):
            raise _sharding.NoRule("max/min/avg over an empty shard")  # torch refuses e.g. max() of nothing
        required = [s for s in pytree.tree_leaves((new_args, prop.kwargs)) if isinstance(s, Spec)]
        _sharding.check_local(func, prop, mesh)
        if prop.rank_args is not None:
            local = {mesh.devices[rank]: list(_slot_templates(a, k)) for rank, (a, k) in enumerate(prop.rank_args)}
    except _sharding.NoRule:
        route, run_func, new_args = "replicate", func, spec_args
        replicate = (Replicate(),) * mesh.ndim
        required = [s.with_placements(replicate) for s in specs]
        try:
            outputs = _sharding.meta_outputs(func, spec_args, spec_kwargs, mesh)
        except _sharding.NoRule as e:
            raise NotImplementedError(f"dtorch: {func} is not supported on DTensors with placements "
                                      f"{_placements(specs)} ({e})") from None
        except Exception:  # noqa: BLE001 (no meta kernel: the output shape depends on the values)
            return _local_plan(func, specs, "has no sharding rule and no meta kernel", random)
    inputs = [None if r.placements == s.placements else r for r, s in zip(required, specs)]
    flat_outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if _outs(func) and _out_mismatch(func, spec_kwargs, flat_outputs):
        return _out_plan(func, specs, "computes outputs laid out unlike its out= tensors")
    if not func._schema.returns:  # e.g. _linalg_check_errors: runs for its error only (dispatch returns None)
        outputs, flat_outputs = (), []
    wire_args, wire_kwargs = _slot_templates(new_args, spec_kwargs)
    return Plan(_WIRE_NAME.get(run_func, str(run_func)), route, run_func, inputs, wire_args, wire_kwargs, local,
                outputs, flat_outputs, inplace, random, _written_leaves(func, args, kwargs))


def _non_sum_partial(outputs: Any) -> bool:
    flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return any(isinstance(p, Partial) and p.reduce_op != "sum" for s in flat if s is not None for p in s.placements)


def _has_empty_shard(spec: Spec) -> bool:
    return any(n == 0 and full > 0 for c in coords(spec.mesh.shape)
               for (_, n), full in zip(shard_box(spec.shape, spec.mesh.shape, spec.placements, c), spec.shape))


class _MixedMeshes(Exception):
    """DTensors of one op live on different meshes (pipeline stages, roles)."""


def _to_mesh(tree: Any, first: DTensor) -> Any:
    """Move DTensors on other meshes onto `first`'s mesh, replicated: the op then runs there.

    This is how unmodified code crosses pipeline stages, e.g. `generate` appending a token computed
    on the last stage to input ids held by the first.
    """
    from dtorch.dtensor import redistribute_to

    mesh = first.device_mesh
    replicate = (Replicate(),) * mesh.ndim

    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and hasattr(v, "_spec") and v.device_mesh != mesh:
            return redistribute_to(v, mesh, replicate, user_src(4))
        return v

    return pytree.tree_map(move, tree)


def _lift_plain(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Plain tensors mixed into an op become Replicate DTensors on the op's mesh (never ones it writes)."""
    from dtorch.dtensor import DTensor
    from dtorch.factories import replicate_plain

    ref = next((v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, DTensor)), None)
    if ref is None:
        raise TypeError("no DTensor among the arguments")
    for pos, name in _writes(func):
        value = args[pos] if pos < len(args) else kwargs.get(name)
        if any(isinstance(v, torch.Tensor) and not isinstance(v, DTensor) for v in pytree.tree_leaves(value)):
            raise NotImplementedError(f"dtorch: {func} would write into the plain torch.Tensor {name!r}; "
                                      "make it a DTensor first (dtorch.distribute_tensor)")

    def lift(v: Any) -> Any:
        return replicate_plain(v, ref) if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v

    return pytree.tree_map(lift, args), pytree.tree_map(lift, kwargs)


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    if func is _SET_SOURCE and args[0] is args[1]:
        return args[0]  # x.set_(x), as torch.nn.utils.parametrize does: nothing to move
    decompose = _rules.DECOMPOSITIONS.get(func)
    if decompose is not None and (out := decompose(args, kwargs)) is not NotImplemented:
        return out  # e.g. expert-parallel grouped matmuls: several ops, some with per-device layouts
    leaves: list = []
    try:
        key = (func, _key(args, leaves), _key(kwargs, leaves) if kwargs else None)
    except _Plain:
        if _outs(func) and _plain_out(func, kwargs):
            return _run_out(_out_plan(func, [], "writes plain torch.Tensors"), func, args, kwargs)
        args, kwargs = _lift_plain(func, args, kwargs)
        leaves = []
        key = (func, _key(args, leaves), _key(kwargs, leaves) if kwargs else None)
    except TypeError:  # unhashable or exotic argument: plan without caching
        key, leaves = None, [v for v in pytree.tree_leaves((args, kwargs)) if hasattr(v, "_spec")]
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        try:
            plan = _make_plan(func, args, kwargs, leaves)
        except _MixedMeshes:
            return func(*_to_mesh(args, leaves[0]), **_to_mesh(kwargs, leaves[0]))
        if key is not None:
            _plans[key] = plan
    if plan.fast is not None:
        return _emit_fast(plan, leaves)
    if plan.random and plan.inplace:
        return _random_in_place(plan, leaves)
    if plan.route == "sync":
        return _run_locally(func, args, kwargs, leaves)
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


def _emit_fast(plan: Plan, leaves: list[DTensor]) -> DTensor:
    """The hot path: no moves, one output, tensor slots only at the top level of args."""
    slots, out = plan.fast  # type: ignore[misc]
    session: Session = leaves[0]._session
    args = plan.args.copy()
    for pos, i in slots:
        args[pos] = {"$t": leaves[i]._tid}
    tid = session.new_tid()
    session.emit(m.InstrCall(plan.op_name, out.mesh.id, args, plan.kwargs, [m.OutSpec(tid, out.wire)], None,
                             user_src(3)))
    return DTensorType(out, tid, session)  # type: ignore[misc]


def _emit(plan: Plan, leaves: list[DTensor]) -> Any:
    from dtorch.dtensor import DTensor

    session: Session = leaves[0]._session
    src = user_src(3)
    tids, temps = [], []
    for d, target in zip(leaves, plan.inputs):
        if target is None:
            tids.append(d._tid)
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
    local = None if plan.local is None else {dev: [_fill(a, tids), _fill(k, tids)]
                                              for dev, (a, k) in plan.local.items()}
    session.emit(m.InstrCall(op=plan.op_name, mesh=leaves[0]._spec.mesh.id, args=_fill(plan.args, tids),
                             kwargs=_fill(plan.kwargs, tids),
                             outs=[None if t is None else m.OutSpec(t, s.wire) for t, s in zip(out_tids, outs)],
                             local=local, src=src, seed=session.next_seed() if plan.random else None))
    # a written input that had to move was written in its moved copy: copy it back in place (keeps aliasing)
    written_back = []
    for i in plan.mutated:
        target = plan.inputs[i]
        if target is not None:
            temps.remove(tids[i])
            written_back.append((leaves[i], DTensor(target, tids[i], session)))
    if temps:
        session.emit(m.InstrDelete(tids=temps))
    for dst, moved in written_back:
        torch.ops.aten.copy_.default(dst, moved)
    results = [None if s is None else leaves[0] if plan.inplace and i == 0 else DTensor(s, t, session)
               for i, (t, s) in enumerate(zip(out_tids, outs))]
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
    from dtorch.dtensor import redistribute_to

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


def _run_locally(func: Any, args: tuple, kwargs: dict, leaves: list[DTensor]) -> Any:
    """A sync point: ops that return Python values run on the fetched full tensors."""
    from dtorch.dtensor import DTensor

    def full(v: Any) -> Any:
        return v.to_torch() if isinstance(v, DTensor) else v

    return func(*pytree.tree_map(full, args), **pytree.tree_map(full, kwargs))


def _plain_out(func: Any, kwargs: dict) -> bool:
    return any(isinstance(v, torch.Tensor) and getattr(v, "_spec", None) is None
               for n in _outs(func) for v in pytree.tree_leaves(kwargs.get(n)))


def _run_out(plan: Plan, func: Any, args: tuple, kwargs: dict) -> Any:
    """The out route: run the functional op, then write each result into its out= tensor (resizing it as torch
    does); returns the out tensors. A plain out tensor receives the fetched values (a sync point)."""
    names = _outs(func)
    outs = [kwargs.get(n) for n in names]
    result = plan.func(*args, **{k: v for k, v in kwargs.items() if k not in names})
    results = list(result) if len(names) > 1 else [result]
    for out, res in zip(outs, results):
        for o, r in zip(*((out, res) if isinstance(out, (list, tuple)) else ([out], [res]))):
            _write_out(plan, o, r)
    if not func._schema.returns:
        return None
    return tuple(outs) if len(names) > 1 else outs[0]


def _write_out(plan: Plan, out: torch.Tensor, res: Any) -> None:
    from dtorch.dtensor import DTensor

    if not isinstance(out, DTensor):
        full = res.to_torch() if isinstance(res, DTensor) else res
        with torch.no_grad():
            if out.shape != full.shape:
                out.resize_(full.shape)
            out.copy_(full)
        return
    if not isinstance(res, DTensor):
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
    from dtorch.factories import replicate_plain

    ref = leaves[0]
    if plan.random:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ref._session.next_seed())
            result = _run_locally(plan.func, args, kwargs, leaves)
    else:
        result = _run_locally(plan.func, args, kwargs, leaves)

    def upload(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.layout != torch.strided:
            raise NotImplementedError(f"dtorch: {plan.op_name} returns a {v.layout} tensor; DTensors hold "
                                      "strided tensors only")
        return replicate_plain(v, ref)

    return pytree.tree_map(upload, result)
